"""Devices and dtypes the tests run on: the CPU always (float32, float16, bfloat16); CUDA tensors
(float16, bfloat16) where torch sees a GPU and flash_attn_rs can use it."""

import pytest
import torch

import flash_attn_rs


def _devices():
    devices = [("cpu", dt) for dt in (torch.float32, torch.float16, torch.bfloat16)]
    if torch.cuda.is_available():
        ok, why = flash_attn_rs.cuda_status()
        if not ok:
            raise RuntimeError(f"torch sees a GPU but flash_attn_rs cannot use it: {why}")
        devices += [("cuda", dt) for dt in (torch.float16, torch.bfloat16)]
    return devices


DEVICES = _devices()


def pytest_generate_tests(metafunc):
    if "device_dtype" in metafunc.fixturenames:
        metafunc.parametrize("device_dtype", DEVICES, ids=[f"{d}-{str(t).split('.')[-1]}" for d, t in DEVICES])
    if "device" in metafunc.fixturenames:
        names = sorted({d for d, _ in DEVICES})
        metafunc.parametrize("device", names)


@pytest.fixture
def gen(request):
    """A generator seeded per test case (its id), so that a failure reproduces."""
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g
