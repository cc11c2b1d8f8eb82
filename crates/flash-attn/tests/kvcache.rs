//! KV-cache attention (DESIGN §6) against the f64 oracle: contiguous and paged caches (page sizes
//! 1, 16, 256 and odd ones), in-place append checked element by element, rotary (both layouts),
//! leftpad, GQA/MQA, causal, windows, softcap, ALiBi, split-KV agreement, thread-count
//! invariance, and every bad input as a typed error with nothing written.
//!
//! The oracle side is built here without the library's addressing: the test gathers each
//! sequence's keys from the updated cache by its own indexing and runs Algorithm 0 on the result
//! as a varlen batch.

mod common;

use flash_attn::check::{report, Rng};
use flash_attn::cpu::Isa;
use flash_attn::kvcache::{self, KvCache, Rotary};
use flash_attn::{reference, AttentionSpec, Causal, DType, Element, Error, Tensor, TensorMut};
use proptest::prelude::*;

/// A random KV-cache problem, described by plain sizes and index vectors.
#[derive(Debug, Clone)]
struct Setup {
    b: usize,
    sq: usize,
    hq: usize,
    hk: usize,
    d: usize,
    dv: usize,
    sn: usize,
    /// `Some(page_size)` for a paged cache.
    page: Option<usize>,
    /// Dimension 0 of the cache: rows (contiguous) or pages.
    dim0: usize,
    /// Dimension 1: positions (contiguous) or the page size.
    dim1: usize,
    seqlens: Vec<i32>,
    leftpad: Option<Vec<i32>>,
    batch_idx: Option<Vec<i32>>,
    /// `[b, max_pages]`.
    table: Option<(Vec<i32>, usize)>,
    /// `(rd, interleaved, max_pos)`.
    rotary: Option<(usize, bool, usize)>,
    causal: Causal,
    window: Option<(i64, i64)>,
    softcap: Option<f32>,
    alibi: bool,
    num_splits: usize,
}

fn shuffle<T>(rng: &mut Rng, xs: &mut [T]) {
    for i in (1..xs.len()).rev() {
        xs.swap(i, rng.range(0, i));
    }
}

impl Setup {
    fn random(rng: &mut Rng, max_cached: usize) -> Self {
        let b = rng.range(1, 3);
        let hk = rng.pick(&[1usize, 2, 3]);
        let hq = hk * rng.pick(&[1usize, 2, 4, 5]);
        let d = rng.pick(&[8usize, 16, 32, 64, 128, 5, 24]);
        let dv = if rng.chance(0.7) { d } else { rng.pick(&[3usize, 16, 40]) };
        let sq = if rng.chance(0.5) { 1 } else { rng.range(2, 8) };
        let sn = if rng.chance(0.6) { rng.range(1, sq) } else { 0 };
        let seqlens: Vec<i32> = (0..b).map(|_| rng.range(0, max_cached) as i32).collect();
        let leftpad =
            rng.chance(0.3).then(|| seqlens.iter().map(|&s| rng.range(0, s as usize) as i32).collect::<Vec<_>>());
        let need = seqlens.iter().map(|&s| s as usize + sn).max().unwrap_or(0).max(1);
        let cap = need + rng.range(0, 8);
        let page = rng.chance(0.6).then(|| rng.pick(&[1usize, 3, 16, 256, 7, 33]));
        let (dim0, dim1, batch_idx, table) = match page {
            None => {
                let rows = b + rng.range(0, 2);
                let idx = (rows > b || rng.chance(0.5)).then(|| {
                    let mut all: Vec<i32> = (0..rows as i32).collect();
                    shuffle(rng, &mut all);
                    all.truncate(b);
                    all
                });
                (rows, cap, idx, None)
            }
            Some(ps) => {
                let max_pages = cap.div_ceil(ps);
                let pages = b * max_pages + rng.range(0, 3);
                let mut all: Vec<i32> = (0..pages as i32).collect();
                shuffle(rng, &mut all);
                let mut table: Vec<i32> = all[..b * max_pages].to_vec();
                // Entries past a sequence's last page are never read: leave garbage there.
                for (bi, &s) in seqlens.iter().enumerate() {
                    let used = (s as usize + sn).div_ceil(ps);
                    for e in &mut table[bi * max_pages + used..(bi + 1) * max_pages] {
                        if rng.chance(0.5) {
                            *e = -1;
                        }
                    }
                }
                (pages, ps, None, Some((table, max_pages)))
            }
        };
        let rotary = rng.chance(0.4).then(|| {
            let rd = 2 * rng.range(1, d / 2);
            (rd, rng.chance(0.5), need + sq + rng.range(0, 4))
        });
        let causal = rng.pick(&[Causal::None, Causal::BottomRight, Causal::BottomRight, Causal::TopLeft]);
        let window = rng.chance(0.25).then(|| (rng.pick(&[-1i64, 0, 3, 40]), rng.pick(&[-1i64, 0, 2])));
        let softcap = rng.chance(0.2).then(|| rng.pick(&[5.0f32, 30.0]));
        let alibi = rng.chance(0.2);
        let num_splits = rng.pick(&[0usize, 0, 1, 2, 3, 7]);
        Setup {
            b,
            sq,
            hq,
            hk,
            d,
            dv,
            sn,
            page,
            dim0,
            dim1,
            seqlens,
            leftpad,
            batch_idx,
            table,
            rotary,
            causal,
            window,
            softcap,
            alibi,
            num_splits,
        }
    }

    /// Cache `(dim0, dim1)` of position `t` of sequence `b`, by the test's own indexing.
    fn slot(&self, b: usize, t: usize) -> (usize, usize) {
        match (&self.table, self.page) {
            (Some((table, max_pages)), Some(ps)) => (table[b * max_pages + t / ps] as usize, t % ps),
            _ => (self.batch_idx.as_ref().map_or(b, |idx| idx[b] as usize), t),
        }
    }

    fn start(&self, b: usize) -> usize {
        self.leftpad.as_ref().map_or(0, |l| l[b] as usize)
    }

    fn sk(&self, b: usize) -> usize {
        self.seqlens[b] as usize + self.sn - self.start(b)
    }
}

/// What a call leaves: `(out, lse, k_cache, v_cache)`.
type Run<T> = (Vec<T>, Vec<f32>, Vec<T>, Vec<T>);

/// Owned inputs of a setup in dtype `T`.
struct Data<T> {
    q: Vec<T>,
    k_cache: Vec<T>,
    v_cache: Vec<T>,
    k_new: Vec<T>,
    v_new: Vec<T>,
    cos: Vec<T>,
    sin: Vec<T>,
    alibi: Vec<f32>,
}

fn random_vec<T: Element>(rng: &mut Rng, n: usize) -> Vec<T> {
    (0..n).map(|_| T::from_f64(rng.normal())).collect()
}

impl Setup {
    fn data<T: Element>(&self, rng: &mut Rng) -> Data<T> {
        let (cos, sin) = match self.rotary {
            Some((rd, _, max_pos)) => {
                let angles: Vec<f64> = (0..max_pos * rd / 2).map(|_| rng.uniform() * 6.3).collect();
                (
                    angles.iter().map(|a| T::from_f64(a.cos())).collect(),
                    angles.iter().map(|a| T::from_f64(a.sin())).collect(),
                )
            }
            None => (Vec::new(), Vec::new()),
        };
        Data {
            q: random_vec(rng, self.b * self.sq * self.hq * self.d),
            k_cache: random_vec(rng, self.dim0 * self.dim1 * self.hk * self.d),
            v_cache: random_vec(rng, self.dim0 * self.dim1 * self.hk * self.dv),
            k_new: random_vec(rng, self.b * self.sn * self.hk * self.d),
            v_new: random_vec(rng, self.b * self.sn * self.hk * self.dv),
            cos,
            sin,
            alibi: (0..self.b * self.hq).map(|_| rng.uniform() as f32).collect(),
        }
    }

    fn spec<'a>(&self, data: &'a Data<impl Element>, isa: Option<Isa>) -> AttentionSpec<'a> {
        let mut spec = AttentionSpec::new().causal_mode(self.causal);
        if let Some((l, r)) = self.window {
            spec = spec.window(l, r);
        }
        if let Some(c) = self.softcap {
            spec = spec.softcap(c);
        }
        if self.alibi {
            spec = spec.alibi_slopes(Tensor::new(&data.alibi, &[self.b, self.hq]));
        }
        if let Some(isa) = isa {
            spec = spec.cpu_isa(isa);
        }
        spec
    }

    fn cache<'a, T: Element>(&'a self, data: &'a Data<T>) -> KvCache<'a, T> {
        let mut c = KvCache::new(&self.seqlens).num_splits(self.num_splits);
        if let Some(idx) = &self.batch_idx {
            c = c.batch_idx(idx);
        }
        if let Some((table, max_pages)) = &self.table {
            c = c.paged(Tensor::new(table, &[self.b, *max_pages]));
        }
        if let Some(lp) = &self.leftpad {
            c = c.leftpad(lp);
        }
        if self.sn > 0 {
            c = c.append(
                Tensor::new(&data.k_new, &[self.b, self.sn, self.hk, self.d]),
                Tensor::new(&data.v_new, &[self.b, self.sn, self.hk, self.dv]),
            );
        }
        if let Some((rd, inter, max_pos)) = self.rotary {
            c = c.rotary(Tensor::new(&data.cos, &[max_pos, rd / 2]), Tensor::new(&data.sin, &[max_pos, rd / 2]), inter);
        }
        c
    }

    fn cache_shapes(&self) -> ([usize; 4], [usize; 4]) {
        ([self.dim0, self.dim1, self.hk, self.d], [self.dim0, self.dim1, self.hk, self.dv])
    }

    /// Runs the call on copies of the caches: `(out, lse, k_cache, v_cache)`.
    fn run<T: Element>(&self, data: &Data<T>, isa: Option<Isa>) -> Result<Run<T>, Error> {
        let (ks, vs) = self.cache_shapes();
        let (mut kc, mut vc) = (data.k_cache.clone(), data.v_cache.clone());
        let res = kvcache::forward(
            &self.spec(data, isa),
            &Tensor::new(&data.q, &[self.b, self.sq, self.hq, self.d]),
            &mut TensorMut::new(&mut kc, &ks),
            &mut TensorMut::new(&mut vc, &vs),
            &self.cache(data),
        )?;
        assert_eq!(res.out_shape, vec![self.b, self.sq, self.hq, self.dv]);
        assert_eq!(res.lse_shape, vec![self.b, self.hq, self.sq]);
        Ok((res.out, res.lse, kc, vc))
    }
}

/// Unit roundoff of the dtype.
fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 2f64.powi(-24),
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
    }
}

/// Checks the updated caches element by element: new values bitwise, new keys bitwise (or within
/// the rounding of an f64 rotation), everything else untouched.
fn check_caches<T: Element>(s: &Setup, data: &Data<T>, kc: &[T], vc: &[T]) -> Result<(), TestCaseError> {
    let (mut want_k, mut want_v) = (data.k_cache.clone(), data.v_cache.clone());
    let mut rotated = vec![false; want_k.len()];
    for b in 0..s.b {
        for t in 0..s.sn {
            let pos = s.seqlens[b] as usize + t;
            let (i0, i1) = s.slot(b, pos);
            for h in 0..s.hk {
                let src = ((b * s.sn + t) * s.hk + h) * s.d;
                let dst = ((i0 * s.dim1 + i1) * s.hk + h) * s.d;
                want_k[dst..dst + s.d].copy_from_slice(&data.k_new[src..src + s.d]);
                if s.rotary.is_some() {
                    rotated[dst..dst + s.d].iter_mut().for_each(|r| *r = true);
                }
                let src = ((b * s.sn + t) * s.hk + h) * s.dv;
                let dst = ((i0 * s.dim1 + i1) * s.hk + h) * s.dv;
                want_v[dst..dst + s.dv].copy_from_slice(&data.v_new[src..src + s.dv]);
            }
        }
    }
    for (i, (a, w)) in vc.iter().zip(&want_v).enumerate() {
        prop_assert!(a.to_f64().to_bits() == w.to_f64().to_bits(), "v_cache[{i}]: {} != {}", a.to_f64(), w.to_f64());
    }
    for (i, (a, w)) in kc.iter().zip(&want_k).enumerate() {
        if !rotated[i] {
            prop_assert!(
                a.to_f64().to_bits() == w.to_f64().to_bits(),
                "k_cache[{i}]: {} != {}",
                a.to_f64(),
                w.to_f64()
            );
        }
    }
    // Rotated keys: an f64 rotation of the new key at its position.
    if let Some((rd, inter, _)) = s.rotary {
        let u = unit_roundoff(T::DTYPE);
        for b in 0..s.b {
            for t in 0..s.sn {
                let pos = s.seqlens[b] as usize + t;
                let (i0, i1) = s.slot(b, pos);
                for h in 0..s.hk {
                    let src: Vec<f64> =
                        data.k_new[((b * s.sn + t) * s.hk + h) * s.d..][..s.d].iter().map(|x| x.to_f64()).collect();
                    let mut want = src.clone();
                    for f in 0..rd / 2 {
                        let (a, bb) = if inter { (2 * f, 2 * f + 1) } else { (f, f + rd / 2) };
                        let (c, sn) = (data.cos[pos * rd / 2 + f].to_f64(), data.sin[pos * rd / 2 + f].to_f64());
                        want[a] = src[a] * c - src[bb] * sn;
                        want[bb] = src[a] * sn + src[bb] * c;
                    }
                    let got = &kc[((i0 * s.dim1 + i1) * s.hk + h) * s.d..][..s.d];
                    let mag = src.iter().fold(1.0f64, |m, x| m.max(x.abs()));
                    for (x, (g, w)) in got.iter().zip(&want).enumerate() {
                        let err = (g.to_f64() - w).abs();
                        prop_assert!(err <= 4.0 * u * mag, "rotated k[{x}] of ({b}, {t}, {h}): {} vs {w}", g.to_f64());
                    }
                }
            }
        }
    }
    Ok(())
}

/// Checks `out` and `lse` against the oracle on the updated cache, gathered by the test.
fn check_attention<T: Element>(
    s: &Setup,
    data: &Data<T>,
    (out, lse, kc, vc): (&[T], &[f32], &[T], &[T]),
) -> Result<(), TestCaseError> {
    let q = match s.rotary {
        Some((rd, inter, max_pos)) => kvcache::rotate_queries(
            &Tensor::new(&data.q, &[s.b, s.sq, s.hq, s.d]),
            &s.seqlens,
            &Rotary {
                cos: Tensor::new(&data.cos, &[max_pos, rd / 2]),
                sin: Tensor::new(&data.sin, &[max_pos, rd / 2]),
                interleaved: inter,
            },
            s.causal != Causal::None || s.window.is_some(),
        )
        .map_err(|e| TestCaseError::fail(e.to_string()))?,
        None => data.q.clone(),
    };
    let (mut k, mut v) = (Vec::new(), Vec::new());
    let (mut cu_q, mut cu_k) = (vec![0i32], vec![0i32]);
    for b in 0..s.b {
        for j in 0..s.sk(b) {
            let (i0, i1) = s.slot(b, s.start(b) + j);
            k.extend_from_slice(&kc[((i0 * s.dim1 + i1) * s.hk) * s.d..][..s.hk * s.d]);
            v.extend_from_slice(&vc[((i0 * s.dim1 + i1) * s.hk) * s.dv..][..s.hk * s.dv]);
        }
        cu_q.push(((b + 1) * s.sq) as i32);
        cu_k.push(cu_k[b] + s.sk(b) as i32);
    }
    let tk = cu_k[s.b] as usize;
    let spec = s.spec(data, None).varlen(&cu_q, &cu_k);
    let (qt, kt, vt) = (
        Tensor::new(&q, &[s.b * s.sq, s.hq, s.d]),
        Tensor::new(&k, &[tk, s.hk, s.d]),
        Tensor::new(&v, &[tk, s.hk, s.dv]),
    );
    let oracle = reference::forward(&spec, &qt, &kt, &vt).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let naive = reference::naive(&spec, &qt, &kt, &vt).map_err(|e| TestCaseError::fail(e.to_string()))?;
    // Ours is [b, hq, sq]; the varlen oracle's is [hq, b·sq].
    let mut lse_v = vec![0.0f32; lse.len()];
    for b in 0..s.b {
        for h in 0..s.hq {
            for i in 0..s.sq {
                lse_v[h * s.b * s.sq + b * s.sq + i] = lse[(b * s.hq + h) * s.sq + i];
            }
        }
    }
    let rep = report(out, &lse_v, &oracle, &naive, T::DTYPE);
    prop_assert!(rep.passed(), "{rep}\n{s:?}");
    Ok(())
}

fn meets_contract(isa: Isa, seed: u64, dtype: DType, max_cached: usize) -> Result<(), TestCaseError> {
    if !Isa::available().contains(&isa) {
        eprintln!("skipped: the {isa} path is not available here (CPU or FLASH_ATTN_CPU_ISA)");
        return Ok(());
    }
    let mut rng = Rng::new(seed);
    let s = Setup::random(&mut rng, max_cached);
    with_dtype!(dtype, T => {
        let data = s.data::<T>(&mut rng);
        let (out, lse, kc, vc) = s.run(&data, Some(isa)).map_err(|e| TestCaseError::fail(format!("{e}\n{s:?}")))?;
        check_caches(&s, &data, &kc, &vc)?;
        check_attention(&s, &data, (&out, &lse, &kc, &vc))?;
    });
    Ok(())
}

for_each_isa! {
proptest! {
    #![proptest_config(common::config(48))]

    #[test]
    fn random_kv_cache_problems_meet_the_contract(seed in any::<u64>(), dtype in common::dtype()) {
        meets_contract(ISA, seed, dtype, 90)?;
    }
}
}

proptest! {
    #![proptest_config(common::config(24))]

    /// Long caches: several key chunks per split, the heuristic's splits and explicit ones.
    #[test]
    fn long_caches_meet_the_contract(seed in any::<u64>(), dtype in common::dtype()) {
        meets_contract(Isa::best(), seed, dtype, 1500)?;
    }
}

/// A fixed long decode problem run with 1 split and with several: both meet the contract (checked
/// in the random tests), and they agree within twice the contract's bound.
#[test]
fn split_and_unsplit_results_agree() {
    for seed in 0..6u64 {
        let mut rng = Rng::new(seed);
        let mut s = Setup::random(&mut rng, 2000);
        s.seqlens.iter_mut().for_each(|x| *x = (*x).max(1500));
        s.leftpad = None;
        s.rotary = None;
        s.page = Some(16);
        let max_pages = (1500 + s.sn + 8).div_ceil(16) + 100;
        s.dim1 = 16;
        s.dim0 = s.b * max_pages;
        s.batch_idx = None;
        s.table = Some(((0..(s.b * max_pages) as i32).collect(), max_pages));
        let data = s.data::<f32>(&mut rng);
        s.num_splits = 1;
        let (one, lse1, ..) = s.run(&data, None).unwrap();
        for n in [2usize, 5, 0] {
            s.num_splits = n;
            let (many, lsen, ..) = s.run(&data, None).unwrap();
            let err = one.iter().zip(&many).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(err < 1e-5, "seed {seed}, {n} splits: max diff {err}");
            for (a, b) in lse1.iter().zip(&lsen) {
                assert!((a - b).abs() < 1e-5 || (a == b), "lse {a} vs {b}");
            }
        }
    }
}

/// For a fixed split count the bits do not depend on the thread count.
#[test]
fn results_are_bitwise_identical_across_thread_counts() {
    for seed in 0..8u64 {
        let mut rng = Rng::new(100 + seed);
        let mut s = Setup::random(&mut rng, 1200);
        s.num_splits = [0, 1, 3, 4][seed as usize % 4];
        let data = s.data::<half::bf16>(&mut rng);
        let runs: Vec<_> = [1usize, 2, 3]
            .iter()
            .map(|&t| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap();
                pool.install(|| s.run(&data, None).unwrap())
            })
            .collect();
        for r in &runs[1..] {
            assert!(r.0.iter().zip(&runs[0].0).all(|(a, b)| a.to_bits() == b.to_bits()), "seed {seed}: out differs");
            assert!(r.1.iter().zip(&runs[0].1).all(|(a, b)| a.to_bits() == b.to_bits()), "seed {seed}: lse differs");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Bad input: a typed error, caches and outputs untouched.
// ---------------------------------------------------------------------------------------------

/// A small valid paged setup to break.
fn base() -> (Setup, Data<f32>) {
    let mut rng = Rng::new(7);
    let s = Setup {
        b: 2,
        sq: 1,
        hq: 4,
        hk: 2,
        d: 8,
        dv: 8,
        sn: 1,
        page: Some(4),
        dim0: 6,
        dim1: 4,
        seqlens: vec![5, 2],
        leftpad: None,
        batch_idx: None,
        table: Some((vec![0, 3, 5, 1, 2, 4], 3)),
        rotary: Some((4, false, 16)),
        causal: Causal::BottomRight,
        window: None,
        softcap: None,
        alibi: false,
        num_splits: 0,
    };
    let data = s.data::<f32>(&mut rng);
    (s, data)
}

/// Runs `s` into preset outputs and checks it fails with a KV-cache error naming `needle`, with
/// the caches and the outputs untouched.
fn fails_untouched(s: &Setup, data: &Data<f32>, needle: &str) {
    let (ks, vs) = s.cache_shapes();
    let (mut kc, mut vc) = (data.k_cache.clone(), data.v_cache.clone());
    let mut out = vec![7.0f32; s.b * s.sq * s.hq * s.dv];
    let mut lse = vec![7.0f32; s.b * s.hq * s.sq];
    let err = kvcache::forward_into(
        &s.spec(data, None),
        &Tensor::new(&data.q, &[s.b, s.sq, s.hq, s.d]),
        &mut TensorMut::new(&mut kc, &ks),
        &mut TensorMut::new(&mut vc, &vs),
        &s.cache(data),
        &mut TensorMut::new(&mut out, &[s.b, s.sq, s.hq, s.dv]),
        &mut lse,
    )
    .expect_err("the call must fail");
    assert!(matches!(err, Error::KvCache(_)), "{err:?}");
    assert!(err.to_string().contains(needle), "{err}");
    assert_eq!(kc, data.k_cache, "k_cache was written");
    assert_eq!(vc, data.v_cache, "v_cache was written");
    assert!(out.iter().chain(&lse).all(|&x| x == 7.0), "outputs were written");
}

#[test]
fn the_base_setup_is_valid() {
    let (s, data) = base();
    s.run(&data, None).unwrap();
}

#[test]
fn block_table_entry_past_the_pages_is_an_error() {
    let (mut s, data) = base();
    s.table.as_mut().unwrap().0[1] = 6;
    fails_untouched(&s, &data, "block_table[0][1]");
    s.table.as_mut().unwrap().0[1] = -2;
    fails_untouched(&s, &data, "block_table[0][1]");
}

#[test]
fn seqlens_past_the_cache_is_an_error() {
    let (mut s, data) = base();
    s.seqlens[1] = 12; // 12 + 1 new > 3 pages of 4
    fails_untouched(&s, &data, "sequence 1");
    s.seqlens[1] = -1;
    fails_untouched(&s, &data, "cache_seqlens[1]");
}

#[test]
fn new_tokens_that_do_not_fit_are_an_error() {
    let (mut s, data) = base();
    s.seqlens[0] = 11; // 11 + 1 fits exactly; + 2 would not
    s.run(&data, None).unwrap();
    s.sn = 2;
    let data2 = s.data::<f32>(&mut Rng::new(3));
    fails_untouched(&s, &data2, "sequence 0");
}

#[test]
fn two_sequences_writing_one_slot_is_an_error() {
    let (mut s, data) = base();
    s.table = Some((vec![0, 3, 5, 0, 2, 4], 3)); // both sequences' first pages are page 0
    s.seqlens = vec![1, 1];
    fails_untouched(&s, &data, "both write");
    // A contiguous cache with one row for two sequences.
    let (mut s, _) = base();
    s.page = None;
    s.table = None;
    s.dim0 = 3;
    s.dim1 = 12;
    s.batch_idx = Some(vec![2, 2]);
    s.seqlens = vec![3, 3];
    let data = s.data::<f32>(&mut Rng::new(5));
    fails_untouched(&s, &data, "both write");
    s.batch_idx = Some(vec![2, 3]);
    fails_untouched(&s, &data, "cache_batch_idx[1]");
}

#[test]
fn leftpad_past_the_sequence_is_an_error() {
    let (mut s, data) = base();
    s.leftpad = Some(vec![6, 0]);
    fails_untouched(&s, &data, "cache_leftpad[0]");
}

#[test]
fn rotary_positions_past_the_tables_are_an_error() {
    let (mut s, _) = base();
    s.rotary = Some((4, true, 5)); // sequence 0 writes position 5
    let data = s.data::<f32>(&mut Rng::new(9));
    fails_untouched(&s, &data, "rotary position 5");
}

#[test]
fn wrong_lengths_are_errors() {
    let (mut s, data) = base();
    s.seqlens = vec![1];
    fails_untouched(&s, &data, "cache_seqlens");
    let (mut s, data) = base();
    s.table = Some((vec![0, 3, 5], 3));
    let err = s.run(&data, None).unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. } | Error::KvCache(_)), "{err:?}");
}

#[test]
fn varlen_block_mask_and_dropout_are_refused() {
    let (s, data) = base();
    let (ks, vs) = s.cache_shapes();
    let (mut kc, mut vc) = (data.k_cache.clone(), data.v_cache.clone());
    let cu = [0, 1, 2];
    for spec in [AttentionSpec::new().varlen(&cu, &cu), AttentionSpec::new().dropout(0.1, 1, 0)] {
        let err = kvcache::forward(
            &spec,
            &Tensor::new(&data.q, &[s.b, s.sq, s.hq, s.d]),
            &mut TensorMut::new(&mut kc, &ks),
            &mut TensorMut::new(&mut vc, &vs),
            &s.cache(&data),
        )
        .unwrap_err();
        assert!(matches!(err, Error::Unsupported(_)), "{err:?}");
    }
    assert_eq!(kc, data.k_cache);
}

/// The same problems on the CUDA backend (f16 and bf16, `d == dv` a multiple of 8), against the
/// same oracle and cache checks; skipped where no GPU is present.
#[cfg(feature = "cuda-backend")]
mod cuda {
    use super::*;

    fn gpu_setup(rng: &mut Rng, max_cached: usize) -> Setup {
        let mut s = Setup::random(rng, max_cached);
        s.d = rng.pick(&[8usize, 16, 24, 64, 64, 128, 128, 256]);
        s.dv = s.d;
        if let Some((rd, inter, max_pos)) = s.rotary {
            s.rotary = Some(((rd.min(s.d) / 2).max(1) * 2, inter, max_pos));
        }
        s
    }

    fn gpu_meets_contract(seed: u64, bf16: bool, max_cached: usize) -> Result<(), TestCaseError> {
        if let Err(e) = flash_attn::cuda::default_device() {
            eprintln!("skipped: no CUDA device ({e})");
            return Ok(());
        }
        let mut rng = Rng::new(seed);
        let s = gpu_setup(&mut rng, max_cached);
        macro_rules! go {
            ($t:ty) => {{
                let data = s.data::<$t>(&mut rng);
                let (ks, vs) = s.cache_shapes();
                let (mut kc, mut vc) = (data.k_cache.clone(), data.v_cache.clone());
                let res = flash_attn::cuda::decode::forward_host(
                    &s.spec(&data, None),
                    &Tensor::new(&data.q, &[s.b, s.sq, s.hq, s.d]),
                    &mut TensorMut::new(&mut kc, &ks),
                    &mut TensorMut::new(&mut vc, &vs),
                    &s.cache(&data),
                )
                .map_err(|e| TestCaseError::fail(format!("{e}\n{s:?}")))?;
                check_caches(&s, &data, &kc, &vc)?;
                check_attention(&s, &data, (&res.out, &res.lse, &kc, &vc))?;
            }};
        }
        if bf16 {
            go!(half::bf16)
        } else {
            go!(half::f16)
        }
        Ok(())
    }

    /// `Device::kvcache_forward` on buffers that already live on the device (a framework's
    /// tensors): the caches updated in place there, `out` and `lse` under the contract.
    fn gpu_device_buffers_meet_contract(seed: u64, bf16: bool) -> Result<(), TestCaseError> {
        use flash_attn::cuda::decode::DeviceKvCache;
        use flash_attn::cuda::{DeviceTensor, DeviceTensorMut};
        let Ok(dev) = flash_attn::cuda::default_device() else {
            eprintln!("skipped: no CUDA device");
            return Ok(());
        };
        let mut rng = Rng::new(seed);
        let s = gpu_setup(&mut rng, 300);
        let fail = |e: String| TestCaseError::fail(format!("{e}\n{s:?}"));
        macro_rules! go {
            ($t:ty) => {{
                let data = s.data::<$t>(&mut rng);
                let (ks, vs) = s.cache_shapes();
                let stream = dev.stream();
                // Empty inputs (no new tokens, no rotary) still get a one-element buffer.
                let one = [<$t>::default()];
                let up =
                    |x: &[$t]| dev.upload(if x.is_empty() { &one[..] } else { x }).map_err(|e| fail(e.to_string()));
                let (dq, mut dk, mut dv) = (up(&data.q)?, up(&data.k_cache)?, up(&data.v_cache)?);
                let (dkn, dvn, dcos, dsin) = (up(&data.k_new)?, up(&data.v_new)?, up(&data.cos)?, up(&data.sin)?);
                let out_shape = [s.b, s.sq, s.hq, s.dv];
                let mut dout = stream
                    .alloc_zeros::<$t>(out_shape.iter().product::<usize>().max(1))
                    .map_err(|e| fail(format!("{e:?}")))?;
                let mut dlse =
                    stream.alloc_zeros::<f32>((s.b * s.hq * s.sq).max(1)).map_err(|e| fail(format!("{e:?}")))?;
                let kn_t = DeviceTensor::new(dkn.slice(..data.k_new.len()), &[s.b, s.sn, s.hk, s.d]);
                let vn_t = DeviceTensor::new(dvn.slice(..data.v_new.len()), &[s.b, s.sn, s.hk, s.dv]);
                let rot = s.rotary.map(|(rd, inter, max_pos)| {
                    (
                        DeviceTensor::new(dcos.slice(..data.cos.len()), &[max_pos, rd / 2]),
                        DeviceTensor::new(dsin.slice(..data.sin.len()), &[max_pos, rd / 2]),
                        inter,
                    )
                });
                let mut meta = DeviceKvCache::new(&s.seqlens).num_splits(s.num_splits);
                if let Some(idx) = &s.batch_idx {
                    meta = meta.batch_idx(idx);
                }
                if let Some((table, max_pages)) = &s.table {
                    meta = meta.paged(Tensor::new(table, &[s.b, *max_pages]));
                }
                if let Some(lp) = &s.leftpad {
                    meta = meta.leftpad(lp);
                }
                if s.sn > 0 {
                    meta = meta.append(&kn_t, &vn_t);
                }
                if let Some((c, sn, inter)) = &rot {
                    meta = meta.rotary(c, sn, *inter);
                }
                let lse_len = s.b * s.hq * s.sq;
                dev.kvcache_forward(
                    &s.spec(&data, None),
                    &DeviceTensor::new(dq.slice(..data.q.len()), &[s.b, s.sq, s.hq, s.d]),
                    &mut DeviceTensorMut::new(dk.as_view_mut(), &ks),
                    &mut DeviceTensorMut::new(dv.as_view_mut(), &vs),
                    &meta,
                    &mut DeviceTensorMut::new(dout.slice_mut(..out_shape.iter().product::<usize>()), &out_shape),
                    &mut dlse.slice_mut(..lse_len),
                )
                .map_err(|e| fail(e.to_string()))?;
                let down = |e: cudarc::driver::DriverError| fail(format!("{e:?}"));
                let (kc, vc) = (stream.clone_dtoh(&dk).map_err(down)?, stream.clone_dtoh(&dv).map_err(down)?);
                let mut out = stream.clone_dtoh(&dout).map_err(down)?;
                let mut lse = stream.clone_dtoh(&dlse).map_err(down)?;
                out.truncate(out_shape.iter().product());
                lse.truncate(lse_len);
                check_caches(&s, &data, &kc, &vc)?;
                check_attention(&s, &data, (&out, &lse, &kc, &vc))?;
            }};
        }
        if bf16 {
            go!(half::bf16)
        } else {
            go!(half::f16)
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(common::config(64))]

        #[test]
        fn gpu_kv_cache_problems_meet_the_contract(seed in any::<u64>(), bf16 in any::<bool>()) {
            gpu_meets_contract(seed, bf16, 90)?;
        }

        #[test]
        fn gpu_device_buffer_calls_meet_the_contract(seed in any::<u64>(), bf16 in any::<bool>()) {
            gpu_device_buffers_meet_contract(seed, bf16)?;
        }

        #[test]
        fn gpu_long_caches_meet_the_contract(seed in any::<u64>(), bf16 in any::<bool>()) {
            gpu_meets_contract(seed, bf16, 3000)?;
        }
    }

    /// A long decode problem with 1 split and with several agrees within rounding.
    #[test]
    fn gpu_split_and_unsplit_results_agree() {
        if flash_attn::cuda::default_device().is_err() {
            eprintln!("skipped: no CUDA device");
            return;
        }
        let mut rng = Rng::new(11);
        let mut s = gpu_setup(&mut rng, 3000);
        s.seqlens.iter_mut().for_each(|x| *x = (*x).max(2000));
        s.page = None;
        s.table = None;
        s.batch_idx = None;
        s.leftpad = None;
        s.rotary = None;
        s.dim0 = s.b;
        s.dim1 = 3000 + s.sn + 8;
        let data = s.data::<half::bf16>(&mut rng);
        let run = |n: usize| {
            let mut s = s.clone();
            s.num_splits = n;
            let (ks, vs) = s.cache_shapes();
            let (mut kc, mut vc) = (data.k_cache.clone(), data.v_cache.clone());
            flash_attn::cuda::decode::forward_host(
                &s.spec(&data, None),
                &Tensor::new(&data.q, &[s.b, s.sq, s.hq, s.d]),
                &mut TensorMut::new(&mut kc, &ks),
                &mut TensorMut::new(&mut vc, &vs),
                &s.cache(&data),
            )
            .unwrap()
        };
        let one = run(1);
        for n in [2, 7, 0] {
            let many = run(n);
            let err =
                one.out.iter().zip(&many.out).map(|(a, b)| (a.to_f32() - b.to_f32()).abs()).fold(0.0f32, f32::max);
            assert!(err <= 2f32.powi(-7), "{n} splits: max diff {err}");
        }
    }
}

/// `forward_readonly` (caches only read, for immutable frameworks) gives the bits `forward` gives
/// when nothing is appended, and refuses a call that appends.
#[test]
fn read_only_calls_equal_the_writing_ones_and_refuse_appends() {
    let mut rng = Rng::new(404);
    for _ in 0..48 {
        let mut s = Setup::random(&mut rng, 300);
        let data = s.data::<half::bf16>(&mut rng);
        let (ks, vs) = s.cache_shapes();
        let q = Tensor::new(&data.q, &[s.b, s.sq, s.hq, s.d]);
        let (kc, vc) = (Tensor::new(&data.k_cache, &ks), Tensor::new(&data.v_cache, &vs));
        let readonly = kvcache::forward_readonly(&s.spec(&data, None), &q, &kc, &vc, &s.cache(&data));
        if s.sn > 0 {
            assert!(matches!(readonly, Err(Error::KvCache(_))), "an append must be refused: {s:?}");
            s.sn = 0;
        }
        let readonly = kvcache::forward_readonly(&s.spec(&data, None), &q, &kc, &vc, &s.cache(&data));
        match (readonly, s.run(&data, None)) {
            (Ok(r), Ok((out, lse, _, _))) => {
                let bits = |x: &[half::bf16]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert!(bits(&r.out) == bits(&out), "out differs: {s:?}");
                assert!(r.lse.iter().zip(&lse).all(|(a, b)| a.to_bits() == b.to_bits()), "lse differs: {s:?}");
            }
            (Err(a), Err(b)) => assert_eq!(a, b),
            (a, b) => panic!("read-only {a:?} vs writing {b:?}: {s:?}"),
        }
    }
}
