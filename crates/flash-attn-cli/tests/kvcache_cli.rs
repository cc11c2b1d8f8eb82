//! `flash-attn run` in KV-cache mode (DESIGN §5, §6) as users see it: an input with `k_cache`,
//! `v_cache` and `cache_seqlens` gives `out`, `lse` and the updated caches, bit for bit what
//! `flash_attn::kvcache::forward` gives in-process on the same inputs; every bad input is one
//! line on stderr, exit code 2 and no output file.

use std::path::Path;
use std::process::{Command, Output};

use flash_attn::check::Rng;
use flash_attn::kvcache::{self, KvCache};
use flash_attn::{AttentionSpec, Element, Tensor, TensorMut};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

const BIN: &str = env!("CARGO_BIN_EXE_flash-attn");

// ---------------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------------

mod common;

use common::*;

fn run(input: &Path, output: &Path, extra: &[&str]) -> Output {
    let mut args: Vec<String> = vec![
        "run".into(),
        "--input".into(),
        input.display().to_string(),
        "--output".into(),
        output.display().to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    Command::new(BIN).args(&args).output().expect("run flash-attn")
}

/// A tensor with its shape.
#[derive(Debug, Clone)]
struct Owned<T> {
    data: Vec<T>,
    shape: Vec<usize>,
}

impl<T: Le> Owned<T> {
    fn view(&self) -> Tensor<'_, T> {
        Tensor::new(&self.data, &self.shape)
    }

    fn raw(&self) -> Raw {
        raw(&self.data, &self.shape)
    }
}

fn normal<T: Element>(rng: &mut Rng, shape: &[usize]) -> Owned<T> {
    Owned {
        data: (0..shape.iter().product::<usize>()).map(|_| T::from_f64(rng.normal())).collect(),
        shape: shape.to_vec(),
    }
}

fn shuffle<T>(rng: &mut Rng, xs: &mut [T]) {
    for i in (1..xs.len()).rev() {
        xs.swap(i, rng.range(0, i));
    }
}

/// Problem sizes: `q [b, sq, hq, d]`, new tokens `[b, sn, hk, d|dv]`.
#[derive(Debug, Clone, Copy)]
struct Dims {
    b: usize,
    sq: usize,
    sn: usize,
    hq: usize,
    hk: usize,
    d: usize,
    dv: usize,
}

/// The inputs of one KV-cache `run`, typed.
#[derive(Debug, Clone)]
struct KvInputs<T> {
    q: Owned<T>,
    k_cache: Owned<T>,
    v_cache: Owned<T>,
    seqlens: Vec<i32>,
    block_table: Option<Owned<i32>>,
    batch_idx: Option<Vec<i32>>,
    leftpad: Option<Vec<i32>>,
    new_kv: Option<(Owned<T>, Owned<T>)>,
    rotary: Option<(Owned<T>, Owned<T>)>,
    alibi: Option<Owned<f32>>,
}

impl<T: Element + Le> KvInputs<T> {
    /// A paged cache of `page_size`-token pages holding `seqlens[b]` tokens of sequence `b` (and
    /// room for `dims.sn` more), the pages shuffled, unused table entries `-1`.
    fn paged(seed: u64, dims: Dims, page_size: usize, seqlens: &[i32]) -> Self {
        let mut rng = Rng::new(seed);
        let Dims { b, sq, sn, hq, hk, d, dv } = dims;
        let need = seqlens.iter().map(|&s| s as usize + sn).max().unwrap_or(1);
        let max_pages = need.div_ceil(page_size) + 1;
        let pages = b * max_pages + 3;
        let mut all: Vec<i32> = (0..pages as i32).collect();
        shuffle(&mut rng, &mut all);
        let mut table = all[..b * max_pages].to_vec();
        for (bi, &s) in seqlens.iter().enumerate() {
            let used = (s as usize + sn).div_ceil(page_size);
            table[bi * max_pages + used..(bi + 1) * max_pages].fill(-1);
        }
        Self {
            q: normal(&mut rng, &[b, sq, hq, d]),
            k_cache: normal(&mut rng, &[pages, page_size, hk, d]),
            v_cache: normal(&mut rng, &[pages, page_size, hk, dv]),
            seqlens: seqlens.to_vec(),
            block_table: Some(Owned { data: table, shape: vec![b, max_pages] }),
            batch_idx: None,
            leftpad: None,
            new_kv: (sn > 0).then(|| (normal(&mut rng, &[b, sn, hk, d]), normal(&mut rng, &[b, sn, hk, dv]))),
            rotary: None,
            alibi: None,
        }
    }

    /// A contiguous cache of `rows` rows of `s_cache` positions; sequence `b` in row
    /// `batch_idx[b]` (a shuffled choice of rows).
    fn contiguous(seed: u64, dims: Dims, (rows, s_cache): (usize, usize), seqlens: &[i32]) -> Self {
        let mut rng = Rng::new(seed);
        let Dims { b, sq, sn, hq, hk, d, dv } = dims;
        let mut all: Vec<i32> = (0..rows as i32).collect();
        shuffle(&mut rng, &mut all);
        Self {
            q: normal(&mut rng, &[b, sq, hq, d]),
            k_cache: normal(&mut rng, &[rows, s_cache, hk, d]),
            v_cache: normal(&mut rng, &[rows, s_cache, hk, dv]),
            seqlens: seqlens.to_vec(),
            block_table: None,
            batch_idx: Some(all[..b].to_vec()),
            leftpad: None,
            new_kv: (sn > 0).then(|| (normal(&mut rng, &[b, sn, hk, d]), normal(&mut rng, &[b, sn, hk, dv]))),
            rotary: None,
            alibi: None,
        }
    }

    /// Rotary tables for `max_pos` positions rotating `rd` dimensions (GPT-NeoX frequencies).
    fn with_rotary(mut self, rd: usize, max_pos: usize) -> Self {
        let half = rd / 2;
        let angle = |pos: usize, f: usize| pos as f64 * 10000f64.powf(-((2 * f) as f64) / rd as f64);
        let table = |g: fn(f64) -> f64| Owned {
            data: (0..max_pos).flat_map(|p| (0..half).map(move |f| T::from_f64(g(angle(p, f))))).collect(),
            shape: vec![max_pos, half],
        };
        self.rotary = Some((table(f64::cos), table(f64::sin)));
        self
    }

    fn with_alibi(mut self, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let (b, hq) = (self.q.shape[0], self.q.shape[2]);
        self.alibi =
            Some(Owned { data: (0..b * hq).map(|_| 0.05 + rng.uniform() as f32).collect(), shape: vec![b, hq] });
        self
    }

    fn tensors(&self) -> Vec<(&'static str, Raw)> {
        let mut t = vec![
            ("q", self.q.raw()),
            ("k_cache", self.k_cache.raw()),
            ("v_cache", self.v_cache.raw()),
            ("cache_seqlens", raw(&self.seqlens, &[self.seqlens.len()])),
        ];
        if let Some(table) = &self.block_table {
            t.push(("block_table", table.raw()));
        }
        if let Some(idx) = &self.batch_idx {
            t.push(("cache_batch_idx", raw(idx, &[idx.len()])));
        }
        if let Some(lp) = &self.leftpad {
            t.push(("cache_leftpad", raw(lp, &[lp.len()])));
        }
        if let Some((k, v)) = &self.new_kv {
            t.push(("k", k.raw()));
            t.push(("v", v.raw()));
        }
        if let Some((cos, sin)) = &self.rotary {
            t.push(("rotary_cos", cos.raw()));
            t.push(("rotary_sin", sin.raw()));
        }
        if let Some(slopes) = &self.alibi {
            t.push(("alibi_slopes", slopes.raw()));
        }
        t
    }

    /// `kvcache::forward` in-process on copies of the caches: `out`, `lse`, `k_cache`, `v_cache`.
    fn library(&self, spec: &AttentionSpec<'_>, opts: &KvOpts) -> [Raw; 4] {
        let mut cache = KvCache::new(&self.seqlens).num_splits(opts.num_splits);
        if let Some(idx) = &self.batch_idx {
            cache = cache.batch_idx(idx);
        }
        if let Some(lp) = &self.leftpad {
            cache = cache.leftpad(lp);
        }
        if let Some(table) = &self.block_table {
            cache = cache.paged(table.view());
        }
        if let Some((k, v)) = &self.new_kv {
            cache = cache.append(k.view(), v.view());
        }
        if let Some((cos, sin)) = &self.rotary {
            cache = cache.rotary(cos.view(), sin.view(), opts.interleaved);
        }
        let (mut k_cache, mut v_cache) = (self.k_cache.clone(), self.v_cache.clone());
        let res = kvcache::forward(
            spec,
            &self.q.view(),
            &mut TensorMut::new(&mut k_cache.data, &k_cache.shape),
            &mut TensorMut::new(&mut v_cache.data, &v_cache.shape),
            &cache,
        )
        .expect("the in-process call succeeds");
        [raw(&res.out, &res.out_shape), raw(&res.lse, &res.lse_shape), k_cache.raw(), v_cache.raw()]
    }
}

/// The flags of one KV-cache `run`, as arguments and as a spec.
#[derive(Debug, Default)]
struct KvOpts {
    causal: bool,
    window: Option<(i64, i64)>,
    softcap: Option<f32>,
    scale: Option<f32>,
    interleaved: bool,
    num_splits: usize,
}

impl KvOpts {
    fn args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if self.causal {
            a.push("--causal".to_owned());
        }
        if let Some((l, r)) = self.window {
            a.push(format!("--window={l},{r}"));
        }
        if let Some(c) = self.softcap {
            a.extend(["--softcap".to_owned(), c.to_string()]);
        }
        if let Some(s) = self.scale {
            a.extend(["--scale".to_owned(), s.to_string()]);
        }
        if self.interleaved {
            a.push("--rotary-interleaved".to_owned());
        }
        if self.num_splits != 0 {
            a.extend(["--num-splits".to_owned(), self.num_splits.to_string()]);
        }
        a
    }

    fn spec<'a, T: Le>(&self, inputs: &'a KvInputs<T>) -> AttentionSpec<'a> {
        let mut spec = AttentionSpec::new();
        if self.causal {
            spec = spec.causal();
        }
        if let Some((l, r)) = self.window {
            spec = spec.window(l, r);
        }
        if let Some(c) = self.softcap {
            spec = spec.softcap(c);
        }
        if let Some(s) = self.scale {
            spec = spec.scale(s);
        }
        if let Some(slopes) = &inputs.alibi {
            spec = spec.alibi_slopes(slopes.view());
        }
        spec
    }
}

/// Runs the binary on `inputs` with `opts` and checks that `out`, `lse`, `k_cache` and `v_cache`
/// of the output file are, byte for byte, what the library gives in-process.
fn assert_run_matches_library<T: Element + Le>(inputs: &KvInputs<T>, opts: &KvOpts) {
    let dir = TempDir::new("ok");
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    save(&input, &inputs.tensors());
    let args = opts.args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let res = run(&input, &output, &args);
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "args {args:?}: {stderr}");
    assert!(stderr.is_empty(), "args {args:?}: {stderr}");
    assert_eq!(dir.files(), ["in.safetensors", "out.safetensors"], "no temporary files left behind");

    let bytes = std::fs::read(&output).expect("read output");
    let st = SafeTensors::deserialize(&bytes).expect("output is safetensors");
    let mut names = st.names();
    names.sort();
    assert_eq!(names, ["k_cache", "lse", "out", "v_cache"]);
    let expected = inputs.library(&opts.spec(inputs), opts);
    for (name, want) in ["out", "lse", "k_cache", "v_cache"].into_iter().zip(&expected) {
        let got = st.tensor(name).expect("tensor in output");
        assert_eq!(got.dtype(), want.dtype, "dtype of `{name}`");
        assert_eq!(got.shape(), want.shape, "shape of `{name}`");
        assert!(got.data() == want.bytes.as_slice(), "`{name}` differs from the library's");
    }
    // The caches keep the input's shapes and `out` has the layout of the contract.
    assert_eq!(expected[2].shape, inputs.k_cache.shape);
    assert_eq!(expected[3].shape, inputs.v_cache.shape);
    let (b, sq, hq, dv) = (inputs.q.shape[0], inputs.q.shape[1], inputs.q.shape[2], inputs.v_cache.shape[3]);
    assert_eq!(expected[0].shape, [b, sq, hq, dv]);
    assert_eq!(expected[1].shape, [b, hq, sq]);
    assert_eq!(expected[1].dtype, Dtype::F32);
}

// ---------------------------------------------------------------------------------------------
// Agreement with the library
// ---------------------------------------------------------------------------------------------

#[test]
fn paged_bf16_append_rotary_gqa_matches_the_library_bit_for_bit() {
    let dims = Dims { b: 3, sq: 2, sn: 2, hq: 8, hk: 2, d: 64, dv: 64 };
    let inputs = KvInputs::<bf16>::paged(1, dims, 16, &[37, 0, 100]).with_rotary(32, 128);
    assert_run_matches_library(&inputs, &KvOpts { causal: true, ..KvOpts::default() });
}

#[test]
fn paged_f32_interleaved_rotary_alibi_softcap_splits_matches_the_library_bit_for_bit() {
    let dims = Dims { b: 2, sq: 3, sn: 1, hq: 6, hk: 3, d: 32, dv: 16 };
    let inputs = KvInputs::<f32>::paged(2, dims, 7, &[700, 12]).with_rotary(16, 720).with_alibi(3);
    let opts = KvOpts { interleaved: true, softcap: Some(20.0), scale: Some(0.3), num_splits: 5, ..KvOpts::default() };
    assert_run_matches_library(&inputs, &opts);
}

#[test]
fn paged_f16_decode_without_append_matches_the_library_bit_for_bit() {
    let dims = Dims { b: 2, sq: 1, sn: 0, hq: 4, hk: 1, d: 16, dv: 16 };
    let inputs = KvInputs::<f16>::paged(4, dims, 1, &[9, 30]);
    assert_run_matches_library(&inputs, &KvOpts { window: Some((5, 0)), ..KvOpts::default() });
}

#[test]
fn contiguous_batch_idx_leftpad_matches_the_library_and_appends_in_the_mapped_rows() {
    let dims = Dims { b: 3, sq: 2, sn: 2, hq: 4, hk: 2, d: 32, dv: 24 };
    let (rows, s_cache) = (5, 40);
    let mut inputs = KvInputs::<f32>::contiguous(5, dims, (rows, s_cache), &[17, 3, 38]);
    inputs.leftpad = Some(vec![4, 0, 30]);
    assert_run_matches_library(&inputs, &KvOpts { causal: true, ..KvOpts::default() });

    // The library's cache (checked equal to the binary's above): sequence b's new tokens are at
    // positions seqlens[b].. of row batch_idx[b], every other slot as it was.
    let expected = inputs.library(&AttentionSpec::new().causal(), &KvOpts::default());
    let k_after: Vec<f32> =
        expected[2].bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let (Some(idx), Some((k_new, _))) = (&inputs.batch_idx, &inputs.new_kv) else { unreachable!() };
    let row = dims.hk * dims.d;
    let mut k_want = inputs.k_cache.data.clone();
    for (b, (&cache_row, &cached)) in idx.iter().zip(&inputs.seqlens).enumerate() {
        for t in 0..dims.sn {
            let dst = (cache_row as usize * s_cache + cached as usize + t) * row;
            let src = (b * dims.sn + t) * row;
            k_want[dst..dst + row].copy_from_slice(&k_new.data[src..src + row]);
        }
    }
    assert_eq!(k_after, k_want);
}

// ---------------------------------------------------------------------------------------------
// Bad input: one line on stderr, exit code 2, no output file
// ---------------------------------------------------------------------------------------------

/// Runs with `tensors` and `args` and checks the error contract; returns the stderr line.
fn assert_rejected(tensors: &[(&str, Raw)], args: &[&str]) -> String {
    let dir = TempDir::new("bad");
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    save(&input, tensors);
    let res = run(&input, &output, args);
    let stderr = String::from_utf8_lossy(&res.stderr).into_owned();
    assert_eq!(res.status.code(), Some(2), "args {args:?}, stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "exactly one stderr line, got {stderr:?}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(dir.files(), ["in.safetensors"], "no output or temporary file created");
    lines[0].to_owned()
}

/// Valid paged inputs: two sequences with 5 and 2 cached tokens, one new token each, rotary;
/// pages of 4 tokens.
fn valid() -> KvInputs<f32> {
    let dims = Dims { b: 2, sq: 1, sn: 1, hq: 4, hk: 2, d: 8, dv: 8 };
    KvInputs::<f32>::paged(6, dims, 4, &[5, 2]).with_rotary(8, 16)
}

/// `inputs`' tensors with `name` replaced (or added).
fn with(inputs: &KvInputs<f32>, name: &'static str, t: Raw) -> Vec<(&'static str, Raw)> {
    let mut v: Vec<_> = inputs.tensors().into_iter().filter(|(n, _)| *n != name).collect();
    v.push((name, t));
    v
}

fn without(name: &str) -> Vec<(&'static str, Raw)> {
    valid().tensors().into_iter().filter(|(n, _)| *n != name).collect()
}

#[test]
fn valid_control_input_succeeds() {
    assert_run_matches_library(&valid(), &KvOpts { causal: true, ..KvOpts::default() });
}

#[test]
fn fp8_is_rejected_in_kvcache_mode() {
    let msg = assert_rejected(&valid().tensors(), &["--dtype", "fp8e4m3"]);
    assert!(msg.contains("FP8") && msg.contains("KV-cache"), "{msg}");
    let cache = valid().k_cache;
    let bits = Raw { dtype: Dtype::F8_E4M3, shape: cache.shape.clone(), bytes: vec![0x38; cache.data.len()] };
    let msg = assert_rejected(&with(&valid(), "k_cache", bits), &[]);
    assert!(msg.contains("k_cache") && msg.contains("F8_E4M3"), "{msg}");
}

#[test]
fn block_table_entry_past_the_pages_is_rejected() {
    let mut inputs = valid();
    let table = inputs.block_table.as_mut().expect("paged");
    let pages = inputs.k_cache.shape[0] as i32;
    table.data[1] = pages; // sequence 0's second page: position 5 lives there
    let msg = assert_rejected(&inputs.tensors(), &[]);
    assert!(msg.contains("block_table[0][1]"), "{msg}");
}

#[test]
fn cache_seqlens_past_the_cache_is_rejected() {
    // No new tokens: the cached tokens alone overrun the sequence's pages.
    let mut inputs = valid();
    inputs.new_kv = None;
    let capacity = inputs.block_table.as_ref().expect("paged").shape[1] * inputs.k_cache.shape[1];
    let msg = assert_rejected(&with(&inputs, "cache_seqlens", raw(&[5, capacity as i32 + 1], &[2])), &[]);
    assert!(msg.contains("sequence 1"), "{msg}");
}

#[test]
fn new_tokens_that_do_not_fit_are_rejected() {
    let inputs = valid();
    let capacity = inputs.block_table.as_ref().expect("paged").shape[1] * inputs.k_cache.shape[1];
    // The cache is full for sequence 1: one more token does not fit.
    let msg = assert_rejected(&with(&inputs, "cache_seqlens", raw(&[5, capacity as i32], &[2])), &[]);
    assert!(msg.contains("new"), "{msg}");
}

#[test]
fn negative_cache_seqlens_are_rejected() {
    assert_rejected(&with(&valid(), "cache_seqlens", raw(&[5, -1], &[2])), &[]);
}

#[test]
fn contiguous_batch_idx_past_the_rows_is_rejected() {
    let dims = Dims { b: 2, sq: 1, sn: 1, hq: 2, hk: 2, d: 8, dv: 8 };
    let inputs = KvInputs::<f32>::contiguous(7, dims, (3, 10), &[4, 5]);
    assert_rejected(&with(&inputs, "cache_batch_idx", raw(&[0, 3], &[2])), &[]);
}

#[test]
fn leftpad_past_the_seqlens_is_rejected() {
    assert_rejected(&with(&valid(), "cache_leftpad", raw(&[6, 0], &[2])), &[]);
}

#[test]
fn backward_in_kv_mode_is_rejected() {
    let msg = assert_rejected(&valid().tensors(), &["--backward"]);
    assert!(msg.contains("--backward") && msg.contains("KV-cache"), "{msg}");
}

#[test]
fn dropout_in_kv_mode_is_rejected() {
    let msg = assert_rejected(&valid().tensors(), &["--dropout", "0.1", "--seed", "3"]);
    assert!(msg.contains("--dropout"), "{msg}");
}

#[test]
fn block_size_in_kv_mode_is_rejected() {
    let msg = assert_rejected(&valid().tensors(), &["--block-size", "4,4"]);
    assert!(msg.contains("--block-size"), "{msg}");
}

#[test]
fn block_mask_in_kv_mode_is_rejected() {
    let msg = assert_rejected(&with(&valid(), "block_mask", raw(&[1i32; 4], &[1, 2, 2])), &[]);
    assert!(msg.contains("block_mask"), "{msg}");
}

#[test]
fn cu_seqlens_in_kv_mode_are_rejected() {
    let msg = assert_rejected(&with(&valid(), "cu_seqlens_q", raw(&[0, 1, 2], &[3])), &[]);
    assert!(msg.contains("cu_seqlens_q"), "{msg}");
}

#[test]
fn k_without_v_is_rejected() {
    let msg = assert_rejected(&without("v"), &[]);
    assert!(msg.contains("`v`"), "{msg}");
}

#[test]
fn rotary_cos_without_sin_is_rejected() {
    let msg = assert_rejected(&without("rotary_sin"), &[]);
    assert!(msg.contains("rotary_sin"), "{msg}");
}

#[test]
fn rotary_interleaved_without_tables_is_rejected() {
    let tensors: Vec<_> = valid().tensors().into_iter().filter(|(n, _)| !n.starts_with("rotary_")).collect();
    assert_rejected(&tensors, &["--rotary-interleaved"]);
}

#[test]
fn rotary_tables_too_short_for_the_positions_are_rejected() {
    let short = valid().with_rotary(8, 5);
    assert_rejected(&short.tensors(), &[]);
}

#[test]
fn incomplete_kv_cache_input_is_rejected() {
    let msg = assert_rejected(&without("cache_seqlens"), &[]);
    assert!(msg.contains("cache_seqlens"), "{msg}");
}

#[test]
fn mixed_dtypes_are_rejected() {
    let inputs = valid();
    let v16: Vec<f16> = inputs.v_cache.data.iter().map(|&x| f16::from_f32(x)).collect();
    let msg = assert_rejected(&with(&inputs, "v_cache", raw(&v16, &inputs.v_cache.shape)), &[]);
    assert!(msg.contains("v_cache"), "{msg}");
}

#[test]
fn index_tensor_of_the_wrong_dtype_is_rejected() {
    let msg = assert_rejected(&with(&valid(), "cache_seqlens", raw(&[5.0f32, 2.0], &[2])), &[]);
    assert!(msg.contains("cache_seqlens"), "{msg}");
}

#[test]
fn cache_seqlens_of_the_wrong_rank_are_rejected() {
    assert_rejected(&with(&valid(), "cache_seqlens", raw(&[5, 2], &[2, 1])), &[]);
}

#[test]
fn cache_of_the_wrong_rank_is_rejected() {
    let inputs = valid();
    let s = &inputs.k_cache.shape;
    assert_rejected(&with(&inputs, "k_cache", raw(&inputs.k_cache.data, &[s[0] * s[1], s[2], s[3]])), &[]);
}

#[test]
fn num_splits_without_a_kv_cache_is_rejected() {
    let mut rng = Rng::new(8);
    let q = normal::<f32>(&mut rng, &[1, 3, 2, 8]);
    let (k, v) = (normal::<f32>(&mut rng, &[1, 5, 2, 8]), normal::<f32>(&mut rng, &[1, 5, 2, 8]));
    let tensors = [("q", q.raw()), ("k", k.raw()), ("v", v.raw())];
    let msg = assert_rejected(&tensors, &["--num-splits", "2"]);
    assert!(msg.contains("--num-splits"), "{msg}");
    let msg = assert_rejected(&tensors, &["--rotary-interleaved"]);
    assert!(msg.contains("--rotary-interleaved"), "{msg}");
}

#[test]
fn cuda_device_in_kv_mode_with_f32_or_without_a_gpu_is_an_error() {
    // Without the `cuda` feature or without a GPU the device is refused; with one, the CUDA
    // KV-cache kernels take f16 and bf16, and this input is f32: either way the error contract
    // holds.
    assert_rejected(&valid().tensors(), &["--device", "cuda"]);
}

#[test]
fn failed_call_leaves_an_existing_output_untouched() {
    let dir = TempDir::new("untouched");
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    let mut inputs = valid();
    inputs.block_table.as_mut().expect("paged").data[0] = -7;
    save(&input, &inputs.tensors());
    let sentinel: Vec<u8> = (0..=255u8).rev().cycle().take(777).collect();
    std::fs::write(&output, &sentinel).expect("write sentinel");
    let res = run(&input, &output, &[]);
    assert_eq!(res.status.code(), Some(2), "{}", String::from_utf8_lossy(&res.stderr));
    assert_eq!(std::fs::read(&output).expect("output still there"), sentinel, "output file was modified");
    assert_eq!(dir.files(), ["in.safetensors", "out.safetensors"], "no temporary files left behind");
}
