"""flash_attn_with_kvcache against the float64 oracle: contiguous and paged caches, in-place
appends, rotary embedding (both layouts), cache_batch_idx, cache_leftpad, GQA."""

import pytest
import torch

import flash_attn_rs as fa
from reference import EPS_OUT, assert_contract, attention


def rotate(x, cos, sin, pos, interleaved):
    """Rotary embedding of ``x [n, h, d]`` at positions ``pos [n]`` in the dtype of ``cos``."""
    rd = 2 * cos.shape[1]
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    x = x.to(cos.dtype)
    out = x.clone()
    if interleaved:
        x1, x2 = x[..., 0:rd:2], x[..., 1:rd:2]
        out[..., 0:rd:2] = x1 * c - x2 * s
        out[..., 1:rd:2] = x2 * c + x1 * s
    else:
        x1, x2 = x[..., : rd // 2], x[..., rd // 2 : rd]
        out[..., : rd // 2] = x1 * c - x2 * s
        out[..., rd // 2 : rd] = x2 * c + x1 * s
    return out


def _expected(q, k_cache, v_cache, k_new, v_new, seqlens, *, causal, rotary, leftpad, batch_idx, table, page, dt):
    """Per sequence: the keys it attends to (cache then new tokens, rotated) and its rotated
    queries, in ``dt`` (float64: the oracle; float32 rounded to the dtype: the naive path)."""
    b, sq = q.shape[0], q.shape[1]
    outs, lses = [], []
    for i in range(b):
        n = int(seqlens[i])
        lp = 0 if leftpad is None else int(leftpad[i])
        if table is None:
            row = i if batch_idx is None else int(batch_idx[i])
            kc, vc = k_cache[row, :n], v_cache[row, :n]
        else:
            pages = [int(p) for p in table[i]]
            kc = torch.cat([k_cache[p] for p in pages])[:n]
            vc = torch.cat([v_cache[p] for p in pages])[:n]
        kc, vc = kc.to(dt), vc.to(dt)
        qi = q[i]
        if k_new is not None:
            kn = k_new[i]
            if rotary is not None:
                cos, sin, inter = rotary
                pos = torch.arange(n, n + kn.shape[0])
                kn = rotate(kn, cos.to(dt), sin.to(dt), pos, inter)
                if dt != torch.float64:
                    kn = kn.to(q.dtype)
            kc = torch.cat([kc, kn.to(dt)])
            vc = torch.cat([vc, v_new[i].to(dt)])
        if rotary is not None:
            cos, sin, inter = rotary
            pos = torch.arange(n, n + sq) if causal else torch.full((sq,), n)
            qi = rotate(qi, cos.to(dt), sin.to(dt), pos, inter)
            if dt != torch.float64:
                qi = qi.to(q.dtype)
        kc, vc = kc[lp:], vc[lp:]
        o, l = attention(qi[None].to(dt), kc[None], vc[None], scale=q.shape[-1] ** -0.5, causal=causal,
                         compute_dtype=dt if dt == torch.float64 else q.dtype)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


CASES = [
    # (b, sq, sn, hq, hk, d, s_cache, options)
    (2, 1, 1, 8, 2, 64, 300, {"causal": True}),
    (3, 4, 4, 4, 4, 64, 200, {"causal": True, "rotary": False}),
    (2, 3, 3, 4, 2, 64, 150, {"causal": True, "rotary": True}),
    (2, 1, 0, 4, 1, 128, 700, {"causal": False}),
    (2, 2, 2, 4, 2, 64, 96, {"causal": True, "page": 16}),
    (3, 1, 1, 4, 2, 64, 64, {"causal": True, "page": 7, "rotary": False}),
    (2, 1, 1, 4, 2, 64, 120, {"causal": True, "batch_idx": True}),
    (2, 2, 0, 4, 2, 32, 100, {"causal": True, "leftpad": True}),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kvcache_matches_oracle(case, device, gen):
    b, sq, sn, hq, hk, d, s_cache, opts = CASES[case]
    dtypes = (torch.float32, torch.bfloat16) if device == "cpu" else (torch.bfloat16, torch.float16)
    for dtype in dtypes:
        rnd = lambda *s: torch.randn(*s, generator=gen).to(dtype=dtype)  # noqa: E731
        page = opts.get("page")
        seqlens = torch.randint(1, s_cache - sn - 1, (b,), generator=gen, dtype=torch.int32)
        q = rnd(b, sq, hq, d)
        table = None
        if page is None:
            b_cache = b + 2 if opts.get("batch_idx") else b
            k_cache, v_cache = rnd(b_cache, s_cache, hk, d), rnd(b_cache, s_cache, hk, d)
        else:
            per_seq = -(-s_cache // page)
            k_cache, v_cache = rnd(b * per_seq + 3, page, hk, d), rnd(b * per_seq + 3, page, hk, d)
            table = torch.randperm(b * per_seq + 3, generator=gen)[: b * per_seq].view(b, per_seq).to(torch.int32)
        batch_idx = None
        if opts.get("batch_idx"):
            batch_idx = torch.randperm(b + 2, generator=gen)[:b].to(torch.int32)
        leftpad = None
        if opts.get("leftpad"):
            leftpad = torch.stack([torch.randint(0, int(n), (), generator=gen) for n in seqlens]).to(torch.int32)
        k_new = rnd(b, sn, hk, d) if sn else None
        v_new = rnd(b, sn, hk, d) if sn else None
        rotary = None
        if "rotary" in opts:
            angles = torch.rand(s_cache, d // 4, generator=gen, dtype=torch.float64) * 6.3
            rotary = (angles.cos().to(dtype), angles.sin().to(dtype), opts["rotary"])
        before_k, before_v = k_cache.clone(), v_cache.clone()
        # Everything on the device under test, index tensors included (FlashAttention's callers
        # keep them there); the oracle runs on the CPU copies.
        on = lambda t: None if t is None else t.to(device)  # noqa: E731
        dk_cache, dv_cache = on(k_cache), on(v_cache)
        out, lse = fa.flash_attn_with_kvcache(
            on(q), dk_cache, dv_cache, on(k_new), on(v_new),
            rotary_cos=None if rotary is None else on(rotary[0]), rotary_sin=None if rotary is None else on(rotary[1]),
            cache_seqlens=on(seqlens), cache_batch_idx=on(batch_idx), cache_leftpad=on(leftpad), block_table=on(table),
            causal=opts["causal"], rotary_interleaved=False if rotary is None else rotary[2],
            return_softmax_lse=True,
        )
        assert out.device.type == device and lse.device.type == device
        out, lse, k_cache, v_cache = out.cpu(), lse.cpu(), dk_cache.cpu(), dv_cache.cpu()
        args = dict(causal=opts["causal"], rotary=rotary, leftpad=leftpad, batch_idx=batch_idx, table=table,
                    page=page)
        o64, l64 = _expected(q, before_k, before_v, k_new, v_new, seqlens, dt=torch.float64, **args)
        on, ln = _expected(q, before_k, before_v, k_new, v_new, seqlens, dt=torch.float32, **args)
        assert_contract(f"out {dtype}", out, on, o64, EPS_OUT[dtype])
        assert_contract(f"lse {dtype}", lse, ln, l64, EPS_OUT[torch.float32])
        # The new tokens were written in place (rotated), and nothing else changed.
        if sn:
            for i in range(b):
                n = int(seqlens[i])
                for t in range(sn):
                    if table is None:
                        row = i if batch_idx is None else int(batch_idx[i])
                        got_k, got_v = k_cache[row, n + t], v_cache[row, n + t]
                        before_k[row, n + t], before_v[row, n + t] = got_k, got_v
                    else:
                        p, o = int(table[i][(n + t) // page]), (n + t) % page
                        got_k, got_v = k_cache[p, o], v_cache[p, o]
                        before_k[p, o], before_v[p, o] = got_k, got_v
                    want_k = k_new[i, t]
                    if rotary is not None:
                        want_k = rotate(want_k[None], rotary[0].float(), rotary[1].float(), torch.tensor([n + t]),
                                        rotary[2])[0].to(dtype)
                    assert torch.allclose(got_k.float(), want_k.float(), atol=EPS_OUT[dtype], rtol=EPS_OUT[dtype])
                    assert torch.equal(got_v, v_new[i, t])
        assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 2 * EPS_OUT[dtype]


def test_kvcache_int_seqlens_and_defaults(device_dtype, gen):
    device, dtype = device_dtype
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q = rnd(2, 1, 4, 64)
    kc, vc = rnd(2, 50, 2, 64), rnd(2, 50, 2, 64)
    full = fa.flash_attn_with_kvcache(q, kc, vc)
    assert torch.allclose(full.float(), fa.flash_attn_func(q, kc, vc).float(), atol=_tol(dtype))
    part = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=20)
    assert torch.allclose(part.float(), fa.flash_attn_func(q, kc[:, :20], vc[:, :20]).float(), atol=_tol(dtype))


def test_kvcache_split_counts_agree(device_dtype, gen):
    device, dtype = device_dtype
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q = rnd(1, 1, 8, 128)
    kc, vc = rnd(1, 4096, 2, 128), rnd(1, 4096, 2, 128)
    ref = fa.flash_attn_func(q, kc, vc).float()
    for n in (1, 3, 8):
        out = fa.flash_attn_with_kvcache(q, kc, vc, num_splits=n)
        assert torch.allclose(out.float(), ref, atol=_tol(dtype)), n
