"""A real model: a tiny randomly initialised Llama from transformers, trained a few steps with
flash_attn_rs as its attention implementation and with torch SDPA, from the same weights and
batches; losses and gradients must agree (float32: both are within the contract of the exact
result, so of each other)."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flash_attn_rs.transformers as fa_hf  # noqa: E402

NAME = fa_hf.register()


@pytest.fixture(autouse=True)
def calls(monkeypatch):
    """Counts the model's calls into flash_attn_rs, so that a test cannot pass on SDPA alone."""
    counts = {"dense": 0, "varlen": 0}
    dense, varlen = fa_hf.flash_attn_func, fa_hf.flash_attn_varlen_func

    def counted_dense(*a, **k):
        counts["dense"] += 1
        return dense(*a, **k)

    def counted_varlen(*a, **k):
        counts["varlen"] += 1
        return varlen(*a, **k)

    monkeypatch.setattr(fa_hf, "flash_attn_func", counted_dense)
    monkeypatch.setattr(fa_hf, "flash_attn_varlen_func", counted_varlen)
    return counts


def _model(device, dtype, attn):
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attn_implementation=attn,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype)


def _set_attn(model, name):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers
        model.config._attn_implementation = name
    assert model.config._attn_implementation == name
    return model


def _train(model, batches, mask=None, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    for ids in batches[:steps]:
        opt.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        losses.append(loss.detach().float())
        grads.append({n: p.grad.detach().float().clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads


def _gen_batches(device, steps=3, b=2, s=48):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 96, (b, s), generator=g).to(device) for _ in range(steps)]


def _assert_close(ours, ref, what, rtol):
    scale = max(1e-6, ref.abs().max().item())
    err = (ours - ref).abs().max().item()
    assert err <= rtol * scale, f"{what}: max difference {err:.3e} against scale {scale:.3e}"


def test_tiny_llama_trains_like_sdpa(device, calls):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    batches = _gen_batches(device)
    ref_model = _model(device, torch.float32, "sdpa")
    ours_model = _set_attn(copy.deepcopy(ref_model).to(dtype), NAME)
    ref_losses, ref_grads = _train(ref_model, batches)
    losses, grads = _train(ours_model, batches)
    assert calls["dense"] == 3 * 2  # 3 steps, 2 layers
    if dtype == torch.float32:
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            _assert_close(a, b, f"loss, step {step}", 1e-5)
        for step, (ga, gb) in enumerate(zip(grads, ref_grads)):
            for name in gb:
                _assert_close(ga[name], gb[name], f"grad {name}, step {step}", 1e-3)
    else:
        # bf16: ours and SDPA in bf16 each against the float32 run; ours may be at most twice as far.
        sdpa_model = _set_attn(copy.deepcopy(_model(device, torch.float32, "sdpa")).to(dtype), "sdpa")
        sdpa_losses, _ = _train(sdpa_model, batches)
        for step, (a, s, r) in enumerate(zip(losses, sdpa_losses, ref_losses)):
            assert (a - r).abs() <= 2 * (s - r).abs() + 2e-2 * r.abs(), (step, a, s, r)


def test_padded_batch_matches_sdpa(device, calls):
    dtype = torch.float32
    if device == "cuda":
        dtype = torch.bfloat16
    ref = _model(device, dtype, "sdpa").eval()
    ours = _set_attn(copy.deepcopy(ref), NAME)
    ids = _gen_batches(device, steps=1, b=3, s=20)[0]
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding
    mask[2, :3] = 0
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = ref(input_ids=ids, attention_mask=mask).logits
    assert calls["varlen"] == 2 and calls["dense"] == 0
    valid = mask.bool()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    _assert_close(a[valid].float(), b[valid].float(), "logits of real tokens", tol)


def test_generate_with_kv_cache_matches_sdpa(device, calls):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    ref = _model(device, dtype, "sdpa").eval()
    ours = _set_attn(copy.deepcopy(ref), NAME)
    ids = _gen_batches(device, steps=1, b=2, s=10)[0]
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        a = ours.generate(ids, **kwargs)
        b = ref.generate(ids, **kwargs)
    assert calls["dense"] == 8 * 2  # a prefill and 7 decode steps, 2 layers
    if dtype == torch.float32:
        assert torch.equal(a, b)
    else:
        assert a.shape == b.shape
