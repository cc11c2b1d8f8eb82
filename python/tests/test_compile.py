"""torch integration: the custom ops pass torch's own op checks, and torch.compile(fullgraph=True)
traces through a module that calls flash_attn_func, forward and backward."""

import pytest
import torch

import flash_attn_rs as fa
from flash_attn_rs._ops import bwd_op, fwd_op, kvcache_op


class Block(torch.nn.Module):
    """Self-attention: a qkv projection, flash_attn_func, an output projection."""

    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.hd)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], -1)
        q = q.view(b, s, self.heads, self.hd)
        k = k.view(b, s, self.kv_heads, self.hd)
        v = v.view(b, s, self.kv_heads, self.hd)
        o = fa.flash_attn_func(q, k, v, causal=True, softcap=20.0)
        return self.proj(o.reshape(b, s, -1))


def _args(device, dtype, gen):
    q = torch.randn(2, 24, 4, 32, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    k = torch.randn(2, 30, 2, 32, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    v = torch.randn(2, 30, 2, 32, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    return q, k, v


def test_opcheck_fwd_bwd(device_dtype, gen):
    device, dtype = device_dtype
    q, k, v = _args(device, dtype, gen)
    rng = torch.tensor([5, 9])
    fwd_args = (q, k, v, None, None, None, 0.2, True, -1, -1, 0.0, 0.1, False, rng)
    torch.library.opcheck(fwd_op, fwd_args)
    out, lse, rng = fwd_op(*fwd_args)
    # The backward op runs inside autograd's backward pass, on tensors that need no gradient (no
    # double backward).
    q, k, v, out, lse = (t.detach() for t in (q, k, v, out, lse))
    bwd_args = (torch.randn_like(out), q, k, v, out, lse, rng, None, None, None, 0.2, True, -1, -1, 0.0, 0.1, False)
    torch.library.opcheck(bwd_op, bwd_args)


def test_opcheck_kvcache(gen):
    q = torch.randn(2, 1, 4, 32, generator=gen)
    kc, vc = torch.randn(2, 20, 2, 32, generator=gen), torch.randn(2, 20, 2, 32, generator=gen)
    kn, vn = torch.randn(2, 1, 2, 32, generator=gen), torch.randn(2, 1, 2, 32, generator=gen)
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    args = (q, kc, vc, kn, vn, None, None, seqlens, None, None, None, None, 0.2, True, -1, -1, 0.0, False, 0)
    torch.library.opcheck(kvcache_op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_forward_and_backward(device, backend, gen):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    block = Block().to(device=device, dtype=dtype)
    x = torch.randn(2, 40, 64, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    eager_out = block(x)
    eager_out.square().mean().backward()
    eager = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    out = compiled(x)
    out.square().mean().backward()
    got = [p.grad for p in block.parameters()] + [x.grad]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out, eager_out, atol=tol, rtol=tol)
    for a, b in zip(got, eager):
        assert torch.allclose(a, b, atol=tol, rtol=tol)


def test_compile_varlen_and_dropout(gen):
    q = torch.randn(30, 2, 32, generator=gen, requires_grad=True)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)

    def f(q, cu):
        return fa.flash_attn_varlen_func(q, q, q, cu, cu, 20, 20, dropout_p=0.1, causal=True)

    torch.manual_seed(3)
    eager = f(q, cu)
    torch.manual_seed(3)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, cu)
    assert torch.equal(eager, compiled)
    compiled.sum().backward()
    assert torch.isfinite(q.grad).all()
