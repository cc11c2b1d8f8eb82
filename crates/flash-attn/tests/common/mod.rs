//! Shared by the integration tests: proptest strategies that build [`Case`]s, a way to run a case
//! through the public API and keep its outputs, and DESIGN §2's visibility rule written out
//! independently of `flash_attn::mask`.

// Each test crate uses a different subset of these helpers.
#![allow(dead_code)]

use flash_attn::check::{BlockCase, Case, CaseData, CaseReport, Storage};
use flash_attn::cpu::Tiles;
use flash_attn::{Causal, DType, Element, TensorMut};
use proptest::prelude::*;
use proptest::sample::select;

/// Runs `$body` with `$t` bound to the element type of `$dtype`.
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            flash_attn::DType::F32 => {
                type $t = f32;
                $body
            }
            flash_attn::DType::F16 => {
                type $t = half::f16;
                $body
            }
            flash_attn::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
        }
    };
}

/// The items `$body` once per CPU instruction-set path this target can have, each copy in a
/// module named after the path (`portable`, `avx2`, `avx512`, `amx` on x86-64; `portable`, `neon` on
/// aarch64) with `ISA` bound to it, so that the log names every test of every path. A copy whose
/// path this CPU lacks (or `FLASH_ATTN_CPU_ISA` caps) skips its tests with a message: use
/// [`on_isa`] to attach the path to a case.
#[macro_export]
macro_rules! for_each_isa {
    ($($body:tt)*) => {
        mod portable {
            #[allow(unused_imports)]
            use super::*;
            const ISA: flash_attn::cpu::Isa = flash_attn::cpu::Isa::Portable;
            $($body)*
        }
        #[cfg(target_arch = "x86_64")]
        mod avx2 {
            #[allow(unused_imports)]
            use super::*;
            const ISA: flash_attn::cpu::Isa = flash_attn::cpu::Isa::Avx2;
            $($body)*
        }
        #[cfg(target_arch = "x86_64")]
        mod avx512 {
            #[allow(unused_imports)]
            use super::*;
            const ISA: flash_attn::cpu::Isa = flash_attn::cpu::Isa::Avx512;
            $($body)*
        }
        #[cfg(target_arch = "x86_64")]
        mod amx {
            #[allow(unused_imports)]
            use super::*;
            const ISA: flash_attn::cpu::Isa = flash_attn::cpu::Isa::Amx;
            $($body)*
        }
        #[cfg(target_arch = "aarch64")]
        mod neon {
            #[allow(unused_imports)]
            use super::*;
            const ISA: flash_attn::cpu::Isa = flash_attn::cpu::Isa::Neon;
            $($body)*
        }
    };
}

/// `case` on path `isa`, or `None` (after saying so once per test) when this CPU lacks the path
/// or `FLASH_ATTN_CPU_ISA` caps it.
pub fn on_isa(isa: flash_attn::cpu::Isa, case: Case) -> Option<Case> {
    if flash_attn::cpu::Isa::available().contains(&isa) {
        return Some(Case { isa: Some(isa), ..case });
    }
    thread_local!(static SAID: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    if !SAID.with(|s| s.replace(true)) {
        eprintln!("skipped: the {isa} path is not available here (CPU or FLASH_ATTN_CPU_ISA)");
    }
    None
}

/// `cases` random cases, or `$PROPTEST_CASES` when set (for long soak runs).
pub fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(cases);
    ProptestConfig::with_cases(cases)
}

// ---------------------------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------------------------

pub fn dtype() -> impl Strategy<Value = DType> {
    select(vec![DType::F32, DType::F16, DType::BF16])
}

/// `(hq, hk)` with `hk | hq`, both in `1..=8`: MHA, GQA and MQA.
pub fn heads() -> impl Strategy<Value = (usize, usize)> {
    (1usize..=8).prop_flat_map(|hk| (1usize..=8 / hk).prop_map(move |group| (hk * group, hk)))
}

/// Head dims `(d, dv)`: the usual powers of two or anything up to `max`, `dv` often `!= d`.
pub fn head_dims(max: usize) -> impl Strategy<Value = (usize, usize)> {
    let d = prop_oneof![select(vec![16usize, 32, 64, 128]).prop_map(move |d| d.min(max)), 1..=max];
    d.prop_flat_map(move |d| (Just(d), prop_oneof![Just(d), 1..=max]))
}

/// Head dims beyond the usual: `256..=512` or anything from 129 up to the CPU limit of 512.
pub fn large_head_dims() -> impl Strategy<Value = (usize, usize)> {
    let d = prop_oneof![select(vec![256usize, 512]), 129usize..=512];
    d.prop_flat_map(|d| (Just(d), prop_oneof![Just(d), 1usize..=512]))
}

/// A sequence length in `1..=max`: often 1 (decoding) or shorter than any tile, never a
/// multiple of anything in particular.
pub fn seq_len(max: usize) -> impl Strategy<Value = usize> {
    prop_oneof![1 => Just(1), 2 => 2..=17usize, 4 => 1..=max]
}

/// `(sq, sk)` of a fixed-length batch: equal, or different either way.
pub fn fixed_lens(max: usize) -> impl Strategy<Value = (usize, usize)> {
    prop_oneof![seq_len(max).prop_map(|n| (n, n)), (seq_len(max), seq_len(max))]
}

/// The `(sq, sk)` of each sequence and whether the batch is packed (varlen); varlen sequences
/// may be empty on either side.
pub fn batch_lens(max: usize) -> impl Strategy<Value = (Vec<(usize, usize)>, bool)> {
    let varlen_len = prop_oneof![1 => Just(0usize), 4 => seq_len(max)];
    prop_oneof![
        (1usize..=3, fixed_lens(max)).prop_map(|(b, lens)| (vec![lens; b], false)),
        prop::collection::vec((varlen_len.clone(), varlen_len), 1..=4).prop_map(|lens| (lens, true)),
    ]
}

pub fn causal() -> impl Strategy<Value = Causal> {
    select(vec![Causal::None, Causal::BottomRight, Causal::TopLeft])
}

/// A window side: unbounded (`-1`), narrow, or wider than any sequence.
pub fn window_side() -> impl Strategy<Value = i64> {
    prop_oneof![1 => Just(-1i64), 3 => 0i64..=48, 1 => Just(1_000_000i64)]
}

pub fn window() -> impl Strategy<Value = Option<(i64, i64)>> {
    prop::option::weighted(0.3, (window_side(), window_side()))
}

/// Block masks of any block size (1 and non-powers of two included), `[qb, kb]` or
/// `[b, hq, qb, kb]`, from empty to dense.
pub fn block_case() -> impl Strategy<Value = BlockCase> {
    let size = prop_oneof![Just(1usize), 2..=70usize, select(vec![16usize, 64, 128])];
    (size.clone(), size, any::<bool>(), select(vec![0u8, 30, 70, 100]))
        .prop_map(|(block_q, block_k, per_head, density_pct)| BlockCase { block_q, block_k, per_head, density_pct })
}

/// Heads-major storage with padded rows, seen through strides, or row-major.
pub fn storage() -> impl Strategy<Value = Storage> {
    prop_oneof![3 => Just(Storage::Contiguous), 1 => (0usize..=3).prop_map(|pad| Storage::Strided { pad })]
}

/// Every option of DESIGN §2, each present or not.
#[derive(Debug, Clone)]
pub struct Options {
    pub causal: Causal,
    pub window: Option<(i64, i64)>,
    pub softcap: Option<f32>,
    pub scale: Option<f32>,
    pub alibi: Option<bool>,
    pub block: Option<BlockCase>,
}

pub fn options() -> impl Strategy<Value = Options> {
    let softcap = prop::option::weighted(0.2, prop_oneof![0.5f32..5.0, 5.0f32..50.0]);
    let scale = prop::option::weighted(0.2, prop_oneof![0.01f32..2.0, -1.0f32..-0.01, Just(0.0f32)]);
    let alibi = prop::option::weighted(0.2, any::<bool>());
    let block = prop::option::weighted(0.25, block_case());
    (causal(), window(), softcap, scale, alibi, block).prop_map(|(causal, window, softcap, scale, alibi, block)| {
        Options { causal, window, softcap, scale, alibi, block }
    })
}

/// Assembles a case from its parts.
pub fn make_case(
    dtype: DType,
    (hq, hk): (usize, usize),
    (d, dv): (usize, usize),
    (seqlens, varlen): (Vec<(usize, usize)>, bool),
    o: Options,
    storage: Storage,
    seed: u64,
) -> Case {
    Case {
        dtype,
        hq,
        hk,
        d,
        dv,
        seqlens,
        varlen,
        causal: o.causal,
        window: o.window,
        softcap: o.softcap,
        scale: o.scale,
        alibi: o.alibi,
        block: o.block,
        storage,
        seed,
        isa: None,
    }
}

/// Random cases with every option; sequences up to `max_len`, head dims from `dims`.
pub fn cases_with(
    max_len: usize,
    dims: impl Strategy<Value = (usize, usize)>,
    heads: impl Strategy<Value = (usize, usize)>,
) -> impl Strategy<Value = Case> {
    (dtype(), heads, dims, batch_lens(max_len), options(), storage(), any::<u64>())
        .prop_map(|(t, h, dims, lens, o, st, seed)| make_case(t, h, dims, lens, o, st, seed))
}

/// The workhorse: every option, sequences up to 200, head dims up to 160.
pub fn cases() -> impl Strategy<Value = Case> {
    cases_with(200, head_dims(160), heads())
}

/// Explicit tiles: mostly small (`Br, Bc` in `1..=33`), sometimes larger than any sequence.
pub fn explicit_tiles() -> impl Strategy<Value = Tiles> {
    let size = prop_oneof![6 => 1usize..=33, 1 => Just(4096usize)];
    (size.clone(), size).prop_map(|(br, bc)| Tiles { br, bc })
}

// ---------------------------------------------------------------------------------------------
// Fixed cases for the dedicated tests
// ---------------------------------------------------------------------------------------------

/// A plain fixed-length problem (no options), data from `seed`.
pub fn plain(dtype: DType, b: usize, (sq, sk): (usize, usize), (hq, hk): (usize, usize), d: usize) -> Case {
    Case {
        dtype,
        hq,
        hk,
        d,
        dv: d,
        seqlens: vec![(sq, sk); b],
        varlen: false,
        causal: Causal::None,
        window: None,
        softcap: None,
        scale: None,
        alibi: None,
        block: None,
        storage: Storage::Contiguous,
        seed: 0x5eed ^ (b * 1000 + sq * 100 + sk * 10 + d) as u64,
        isa: None,
    }
}

/// A packed batch with the given `(sq, sk)` per sequence.
pub fn packed(dtype: DType, seqlens: &[(usize, usize)], (hq, hk): (usize, usize), d: usize) -> Case {
    Case { seqlens: seqlens.to_vec(), varlen: true, ..plain(dtype, 1, (1, 1), (hq, hk), d) }
}

// ---------------------------------------------------------------------------------------------
// Running cases
// ---------------------------------------------------------------------------------------------

/// The outputs of one forward pass, widened (exactly) to `f32`.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
}

impl Run {
    /// Bit patterns, so that `==` means bitwise identical (and NaN equals NaN).
    pub fn bits(&self) -> (Vec<u32>, Vec<u32>) {
        (self.out.iter().map(|x| x.to_bits()).collect(), self.lse.iter().map(|x| x.to_bits()).collect())
    }
}

/// Runs `case` on its own data through [`flash_attn::forward`] (`tiles = None`) or
/// [`flash_attn::cpu::forward_into_tiled`].
pub fn run<T: Element>(case: &Case, tiles: Option<Tiles>) -> Run {
    run_on(case, &case.data::<T>(), tiles)
}

/// [`run`] on given data (which may have been edited).
pub fn run_on<T: Element>(case: &Case, data: &CaseData<T>, tiles: Option<Tiles>) -> Run {
    let spec = case.spec(data);
    let [q, k, v] = data.views();
    let (out, lse) = match tiles {
        None => {
            let res = flash_attn::forward(&spec, &q, &k, &v).expect("valid case");
            (res.out, res.lse)
        }
        Some(t) => {
            let g = spec.geometry(&q, &k, &v).expect("valid case");
            let shape = g.out_shape();
            let mut out = vec![T::default(); shape.iter().product()];
            let mut lse = vec![0.0f32; g.lse_len()];
            flash_attn::cpu::forward_into_tiled(&g, &q, &k, &v, &mut TensorMut::new(&mut out, &shape), &mut lse, t)
                .expect("valid case");
            (out, lse)
        }
    };
    Run { out: out.iter().map(|x| x.to_f32()).collect(), lse }
}

/// The contract report of `case` on given data (which may have been edited).
pub fn report_on<T: Element>(case: &Case, data: &CaseData<T>, tiles: Option<Tiles>) -> CaseReport {
    let spec = case.spec(data);
    let [q, k, v] = data.views();
    let ours = run_on(case, data, tiles);
    let out: Vec<T> = ours.out.iter().map(|&x| T::from_f32(x)).collect(); // exact: x came from T
    let oracle = flash_attn::reference::forward(&spec, &q, &k, &v).expect("valid case");
    let naive = flash_attn::reference::naive(&spec, &q, &k, &v).expect("valid case");
    flash_attn::check::report(&out, &ours.lse, &oracle, &naive, case.dtype)
}

/// Runs `case` in its dtype.
pub fn run_case(case: &Case, tiles: Option<Tiles>) -> Run {
    with_dtype!(case.dtype, T => run::<T>(case, tiles))
}

/// The query rows of a case: `(batch, token in the token dimension of q/out, position i in its
/// sequence, sq, sk)`, for fixed length and varlen alike.
pub fn rows(case: &Case) -> Vec<(usize, usize, usize, usize, usize)> {
    let mut rows = Vec::new();
    let mut start = 0;
    for (b, &(sq, sk)) in case.seqlens.iter().enumerate() {
        for i in 0..sq {
            rows.push((b, start + i, i, sq, sk));
        }
        start += sq;
    }
    rows
}

/// Index of `(token t, head h)` in the `lse` of a case: `[b, hq, sq]` or `[hq, tq]`.
pub fn lse_index(case: &Case, b: usize, t: usize, i: usize, h: usize) -> usize {
    if case.varlen {
        let tq: usize = case.seqlens.iter().map(|s| s.0).sum();
        h * tq + t
    } else {
        let sq = case.seqlens[0].0;
        (b * case.hq + h) * sq + i
    }
}

// ---------------------------------------------------------------------------------------------
// DESIGN §2, step 4, written out on its own
// ---------------------------------------------------------------------------------------------

/// Whether query `i` of sequence `b` (lengths `sq`, `sk`) sees key `j` in head `h`, straight
/// from DESIGN §2 step 4; `mask` is the case's block mask and its shape.
#[allow(clippy::too_many_arguments)]
pub fn design_visible(
    case: &Case,
    mask: Option<&(Vec<u8>, Vec<usize>)>,
    b: usize,
    h: usize,
    (sq, sk): (usize, usize),
    i: usize,
    j: usize,
) -> bool {
    let (i, j, off) = (i as i64, j as i64, sk as i64 - sq as i64);
    let causal_ok = match case.causal {
        Causal::None => true,
        Causal::BottomRight => j <= i + off,
        Causal::TopLeft => j <= i,
    };
    let window_ok = case
        .window
        .is_none_or(|(left, right)| (left == -1 || i + off - left <= j) && (right == -1 || j <= i + off + right));
    let block_ok = match (case.block, mask) {
        (Some(bc), Some((m, shape))) => {
            let (bi, bj) = (i as usize / bc.block_q, j as usize / bc.block_k);
            let idx = match shape.as_slice() {
                [_, kb] => bi * kb + bj,
                [_, hq, qb, kb] => ((b * hq + h) * qb + bi) * kb + bj,
                other => panic!("block mask of shape {other:?}"),
            };
            m[idx] != 0
        }
        _ => true,
    };
    causal_ok && window_ok && block_ok
}
