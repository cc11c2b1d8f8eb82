//! The `flash-attn` command as users and outside test suites see it (DESIGN §5, BENCH.md): `run`
//! (forward, dropout, `--backward`) agrees with the oracle, every bad input is one line on stderr
//! with exit code 2 and an untouched output file, `check` and `bench --json` print what their
//! contracts say.

use std::path::Path;
use std::process::{Command, Output};

use flash_attn::check::{compare, compare_fp8, compare_gradient, max_abs, Rng};
use flash_attn::{fp8, AttentionSpec, Causal, Element, Fp8E4m3, Tensor};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

const BIN: &str = env!("CARGO_BIN_EXE_flash-attn");

// ---------------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------------

mod common;

use common::*;

/// The inputs of one `run`, typed, with the optional tensors.
struct Inputs<T> {
    q: (Vec<T>, Vec<usize>),
    k: (Vec<T>, Vec<usize>),
    v: (Vec<T>, Vec<usize>),
    cu_seqlens: Option<(Vec<i32>, Vec<i32>)>,
    alibi: Option<(Vec<f32>, Vec<usize>)>,
    block_mask: Option<(Vec<u8>, Vec<usize>, Dtype)>,
}

impl<T: Element + Le> Inputs<T> {
    /// Fixed-length `q [b, sq, hq, d]`, `k [b, sk, hk, d]`, `v [b, sk, hk, dv]`.
    fn fixed(seed: u64, b: usize, (sq, sk): (usize, usize), (hq, hk): (usize, usize), (d, dv): (usize, usize)) -> Self {
        let mut rng = Rng::new(seed);
        let (qs, ks, vs) = (vec![b, sq, hq, d], vec![b, sk, hk, d], vec![b, sk, hk, dv]);
        Self {
            q: (normal(&mut rng, &qs), qs),
            k: (normal(&mut rng, &ks), ks),
            v: (normal(&mut rng, &vs), vs),
            cu_seqlens: None,
            alibi: None,
            block_mask: None,
        }
    }

    /// Packed varlen with the given `(sq, sk)` per sequence.
    fn varlen(seed: u64, lens: &[(usize, usize)], hq: usize, hk: usize, d: usize) -> Self {
        let mut rng = Rng::new(seed);
        let (mut cq, mut ck) = (vec![0i32], vec![0i32]);
        for &(sq, sk) in lens {
            cq.push(cq[cq.len() - 1] + sq as i32);
            ck.push(ck[ck.len() - 1] + sk as i32);
        }
        let (tq, tk) = (cq[cq.len() - 1] as usize, ck[ck.len() - 1] as usize);
        let (qs, ks) = (vec![tq, hq, d], vec![tk, hk, d]);
        Self {
            q: (normal(&mut rng, &qs), qs),
            k: (normal(&mut rng, &ks), ks.clone()),
            v: (normal(&mut rng, &ks), ks),
            cu_seqlens: Some((cq, ck)),
            alibi: None,
            block_mask: None,
        }
    }

    fn views(&self) -> (Tensor<'_, T>, Tensor<'_, T>, Tensor<'_, T>) {
        (Tensor::new(&self.q.0, &self.q.1), Tensor::new(&self.k.0, &self.k.1), Tensor::new(&self.v.0, &self.v.1))
    }

    fn tensors(&self) -> Vec<(&'static str, Raw)> {
        let mut t =
            vec![("q", raw(&self.q.0, &self.q.1)), ("k", raw(&self.k.0, &self.k.1)), ("v", raw(&self.v.0, &self.v.1))];
        if let Some((cq, ck)) = &self.cu_seqlens {
            t.push(("cu_seqlens_q", raw(cq, &[cq.len()])));
            t.push(("cu_seqlens_k", raw(ck, &[ck.len()])));
        }
        if let Some((slopes, shape)) = &self.alibi {
            t.push(("alibi_slopes", raw(slopes, shape)));
        }
        if let Some((mask, shape, dtype)) = &self.block_mask {
            t.push(("block_mask", Raw { dtype: *dtype, ..raw(mask, shape) }));
        }
        t
    }
}

/// The options of one `run`, as arguments and as a spec.
#[derive(Default)]
struct Opts {
    causal: Causal,
    /// `(left, right, as one "--window=L,R" argument)`.
    window: Option<(i64, i64, bool)>,
    softcap: Option<f32>,
    scale: Option<f32>,
    block_size: Option<(usize, usize)>,
    /// `(p, seed, offset)`.
    dropout: Option<(f32, u64, u32)>,
}

impl Opts {
    fn args(&self) -> Vec<String> {
        let mut a = Vec::new();
        match self.causal {
            Causal::None => {}
            Causal::BottomRight => a.push("--causal".to_owned()),
            Causal::TopLeft => a.push("--causal-top-left".to_owned()),
        }
        if let Some((l, r, joined)) = self.window {
            if joined {
                a.push(format!("--window={l},{r}"));
            } else {
                a.extend(["--window".to_owned(), format!("{l},{r}")]);
            }
        }
        if let Some(c) = self.softcap {
            a.extend(["--softcap".to_owned(), c.to_string()]);
        }
        if let Some(s) = self.scale {
            a.extend(["--scale".to_owned(), s.to_string()]);
        }
        if let Some((bq, bk)) = self.block_size {
            a.extend(["--block-size".to_owned(), format!("{bq},{bk}")]);
        }
        if let Some((p, seed, offset)) = self.dropout {
            a.extend(["--dropout".to_owned(), p.to_string(), "--seed".to_owned(), seed.to_string()]);
            a.extend(["--offset".to_owned(), offset.to_string()]);
        }
        a
    }

    /// The spec these options and the optional tensors of `inputs` describe.
    fn spec<'a, T>(&self, inputs: &'a Inputs<T>) -> AttentionSpec<'a> {
        let mut spec = AttentionSpec::new().causal_mode(self.causal);
        if let Some((l, r, _)) = self.window {
            spec = spec.window(l, r);
        }
        if let Some(c) = self.softcap {
            spec = spec.softcap(c);
        }
        if let Some(s) = self.scale {
            spec = spec.scale(s);
        }
        if let Some((slopes, shape)) = &inputs.alibi {
            spec = spec.alibi_slopes(Tensor::new(slopes, shape));
        }
        if let (Some((mask, shape, _)), Some((bq, bk))) = (&inputs.block_mask, self.block_size) {
            spec = spec.block_mask(Tensor::new(mask, shape), bq, bk);
        }
        if let Some((cq, ck)) = &inputs.cu_seqlens {
            spec = spec.varlen(cq, ck);
        }
        if let Some((p, seed, offset)) = self.dropout {
            spec = spec.dropout(p, seed, offset);
        }
        spec
    }
}

fn flash_attn(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("run flash-attn")
}

fn run(input: &Path, output: &Path, extra: &[String]) -> Output {
    let mut args: Vec<String> = vec![
        "run".into(),
        "--input".into(),
        input.display().to_string(),
        "--output".into(),
        output.display().to_string(),
    ];
    args.extend(extra.iter().cloned());
    Command::new(BIN).args(&args).output().expect("run flash-attn")
}

/// Runs the binary on `tensors` with `args` over an older output file, checks that it succeeds
/// silently and leaves no temporary file, and returns the output file's bytes.
fn run_ok(tensors: &[(&str, Raw)], args: &[String]) -> Vec<u8> {
    let dir = TempDir::new("ok");
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    save(&input, tensors);
    std::fs::write(&output, b"an older output, to be replaced").expect("write old output");
    let res = run(&input, &output, args);
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "args {args:?}: {stderr}");
    assert!(stderr.is_empty(), "args {args:?}: {stderr}");
    assert_eq!(dir.files(), ["in.safetensors", "out.safetensors"], "no temporary files left behind");
    std::fs::read(&output).expect("read output")
}

/// The tensor `name` of an output file, checked for dtype and shape, widened to f64.
fn output_tensor<T: Le + Element>(st: &SafeTensors<'_>, name: &str, shape: &[usize]) -> Vec<f64> {
    let t = st.tensor(name).unwrap_or_else(|_| panic!("output has no `{name}`"));
    assert_eq!(t.dtype(), T::ST_DTYPE, "dtype of `{name}`");
    assert_eq!(t.shape(), shape, "shape of `{name}`");
    decode::<T>(t.data()).iter().map(|x| x.to_f64()).collect()
}

/// Checks `out` and `lse` of an output file against the f64 oracle under the numerics contract.
fn assert_forward_matches_oracle<T: Element + Le>(st: &SafeTensors<'_>, inputs: &Inputs<T>, opts: &Opts) {
    let (q, k, v) = inputs.views();
    let spec = opts.spec(inputs);
    let g = spec.geometry(&q, &k, &v).expect("valid problem");
    let ours_out = output_tensor::<T>(st, "out", &g.out_shape());
    let lse = st.tensor("lse").expect("lse");
    assert_eq!(lse.dtype(), Dtype::F32);
    assert_eq!(lse.shape(), g.lse_shape().as_slice());
    let ours_lse: Vec<f64> = decode::<f32>(lse.data()).iter().map(|&x| f64::from(x)).collect();

    let oracle = flash_attn::reference::forward(&spec, &q, &k, &v).expect("oracle");
    let naive = flash_attn::reference::naive(&spec, &q, &k, &v).expect("naive");
    let c_out = compare(&ours_out, &oracle.out, &naive.out, <T as Element>::DTYPE);
    let c_lse = compare(&ours_lse, &oracle.lse, &naive.lse, <T as Element>::DTYPE);
    assert!(c_out.passed(), "out: {c_out} (args {:?})", opts.args());
    assert!(c_lse.passed(), "lse: {c_lse} (args {:?})", opts.args());
}

/// Runs the binary on `inputs` with `opts` and checks `out` and `lse` against the f64 oracle under
/// the numerics contract, plus their dtypes and shapes.
fn assert_run_matches_oracle<T: Element + Le>(inputs: &Inputs<T>, opts: &Opts) {
    let bytes = run_ok(&inputs.tensors(), &opts.args());
    let st = SafeTensors::deserialize(&bytes).expect("output is safetensors");
    assert_forward_matches_oracle(&st, inputs, opts);
}

/// Runs the binary with `--backward` on `inputs` plus a random `dout`, and checks `out`, `lse`
/// and `dq`, `dk`, `dv` (dtype of q, shapes of q, k, v) against the f64 oracle under the numerics
/// contract, the gradients' floor set by the largest oracle gradient.
fn assert_backward_matches_oracle<T: Element + Le>(inputs: &Inputs<T>, opts: &Opts) {
    let (q, k, v) = inputs.views();
    let spec = opts.spec(inputs);
    let out_shape = spec.geometry(&q, &k, &v).expect("valid problem").out_shape();
    let dout: Vec<T> = normal(&mut Rng::new(0xD0), &out_shape);
    let mut tensors = inputs.tensors();
    tensors.push(("dout", raw(&dout, &out_shape)));
    let mut args = opts.args();
    args.push("--backward".into());
    let bytes = run_ok(&tensors, &args);
    let st = SafeTensors::deserialize(&bytes).expect("output is safetensors");
    assert_forward_matches_oracle(&st, inputs, opts);

    let dout = Tensor::new(&dout, &out_shape);
    let oracle = flash_attn::reference::backward(&spec, &q, &k, &v, &dout).expect("oracle backward");
    let naive = flash_attn::reference::naive_backward(&spec, &q, &k, &v, &dout).expect("naive backward");
    let magnitude = max_abs(&oracle.dq).max(max_abs(&oracle.dk)).max(max_abs(&oracle.dv));
    for (name, input_shape, oracle, naive) in [
        ("dq", &inputs.q.1, &oracle.dq, &naive.dq),
        ("dk", &inputs.k.1, &oracle.dk, &naive.dk),
        ("dv", &inputs.v.1, &oracle.dv, &naive.dv),
    ] {
        let ours = output_tensor::<T>(&st, name, input_shape);
        let c = compare_gradient(&ours, oracle, naive, <T as Element>::DTYPE, magnitude);
        assert!(c.passed(), "{name}: {c} (args {args:?})");
    }
}

// ---------------------------------------------------------------------------------------------
// `run` agrees with the oracle
// ---------------------------------------------------------------------------------------------

#[test]
fn run_plain_gqa_f32_matches_oracle() {
    let inputs = Inputs::<f32>::fixed(1, 2, (33, 47), (4, 2), (16, 16));
    assert_run_matches_oracle(&inputs, &Opts::default());
}

#[test]
fn run_causal_softcap_scale_f16_matches_oracle() {
    let inputs = Inputs::<f16>::fixed(2, 1, (40, 70), (2, 1), (32, 24));
    let opts = Opts { causal: Causal::BottomRight, softcap: Some(20.0), scale: Some(0.3), ..Opts::default() };
    assert_run_matches_oracle(&inputs, &opts);
}

#[test]
fn run_causal_top_left_bf16_matches_oracle() {
    let inputs = Inputs::<bf16>::fixed(3, 2, (50, 30), (3, 3), (64, 64));
    assert_run_matches_oracle(&inputs, &Opts { causal: Causal::TopLeft, ..Opts::default() });
}

#[test]
fn run_varlen_causal_window_matches_oracle() {
    let inputs = Inputs::<f32>::varlen(4, &[(17, 30), (0, 5), (25, 25), (9, 3)], 4, 1, 16);
    let opts = Opts { causal: Causal::BottomRight, window: Some((6, 0, true)), ..Opts::default() };
    assert_run_matches_oracle(&inputs, &opts);
}

#[test]
fn run_alibi_with_negative_window_as_one_argument_matches_oracle() {
    let mut inputs = Inputs::<f32>::fixed(5, 2, (30, 30), (4, 2), (16, 16));
    inputs.alibi = Some(((0..8).map(|i| 0.05 * (i + 1) as f32).collect(), vec![2, 4]));
    assert_run_matches_oracle(&inputs, &Opts { window: Some((-1, 3, true)), ..Opts::default() });
}

#[test]
fn run_alibi_per_head_with_negative_window_as_two_arguments_matches_oracle() {
    let mut inputs = Inputs::<bf16>::varlen(6, &[(20, 31), (12, 12)], 2, 2, 32);
    inputs.alibi = Some((vec![0.25, 0.0625], vec![2]));
    assert_run_matches_oracle(&inputs, &Opts { window: Some((-1, 0, false)), ..Opts::default() });
}

#[test]
fn run_block_mask_u8_matches_oracle() {
    let mut inputs = Inputs::<f32>::fixed(7, 1, (37, 45), (2, 2), (16, 16));
    // qb = ceil(37 / 8) = 5, kb = ceil(45 / 16) = 3.
    let mask: Vec<u8> = (0..15).map(|i| u8::from(i % 3 != 1) * 7).collect();
    inputs.block_mask = Some((mask, vec![5, 3], Dtype::U8));
    assert_run_matches_oracle(&inputs, &Opts { block_size: Some((8, 16)), ..Opts::default() });
}

#[test]
fn run_block_mask_bool_per_head_matches_oracle() {
    let mut inputs = Inputs::<f16>::fixed(8, 2, (20, 20), (2, 1), (16, 8));
    // [b, hq, qb, kb] = [2, 2, 4, 2] for blocks of (5, 10).
    let mask: Vec<u8> = (0..32).map(|i| u8::from(i % 5 != 0)).collect();
    inputs.block_mask = Some((mask, vec![2, 2, 4, 2], Dtype::BOOL));
    let opts = Opts { causal: Causal::BottomRight, block_size: Some((5, 10)), ..Opts::default() };
    assert_run_matches_oracle(&inputs, &opts);
}

// ---------------------------------------------------------------------------------------------
// `run --dropout` and `run --backward` agree with the oracle
// ---------------------------------------------------------------------------------------------

#[test]
fn run_dropout_forward_matches_oracle_with_the_same_mask() {
    let inputs = Inputs::<f32>::fixed(20, 2, (30, 41), (4, 2), (16, 16));
    assert_run_matches_oracle(&inputs, &Opts { dropout: Some((0.3, 1234, 5)), ..Opts::default() });
}

#[test]
fn run_dropout_varlen_causal_bf16_matches_oracle() {
    let inputs = Inputs::<bf16>::varlen(21, &[(20, 31), (0, 4), (12, 12)], 4, 1, 32);
    let opts = Opts { causal: Causal::BottomRight, dropout: Some((0.5, u64::MAX, u32::MAX)), ..Opts::default() };
    assert_run_matches_oracle(&inputs, &opts);
}

#[test]
fn dropout_mask_is_reproducible_and_keyed_by_seed_and_offset() {
    let tensors = Inputs::<f32>::fixed(22, 1, (16, 16), (2, 2), (8, 8)).tensors();
    let out = |dropout: &[&str]| {
        let args: Vec<String> = dropout.iter().map(|s| s.to_string()).collect();
        let bytes = run_ok(&tensors, &args);
        let st = SafeTensors::deserialize(&bytes).expect("output is safetensors");
        output_tensor::<f32>(&st, "out", &[1, 16, 2, 8])
    };
    let base = out(&["--dropout", "0.5", "--seed", "1"]);
    assert_eq!(base, out(&["--dropout", "0.5", "--seed", "1", "--offset", "0"]), "same seed and offset");
    assert_ne!(base, out(&["--dropout", "0.5", "--seed", "2"]), "another seed");
    assert_ne!(base, out(&["--dropout", "0.5", "--seed", "1", "--offset", "1"]), "another offset");
    assert_ne!(base, out(&[]), "no dropout");
    assert_eq!(out(&[]), out(&["--dropout", "0"]), "p = 0 is no dropout and needs no seed");
}

#[test]
fn run_backward_gqa_causal_f32_matches_oracle() {
    let inputs = Inputs::<f32>::fixed(30, 2, (33, 47), (4, 2), (16, 24));
    assert_backward_matches_oracle(&inputs, &Opts { causal: Causal::BottomRight, ..Opts::default() });
}

#[test]
fn run_backward_softcap_scale_causal_top_left_f16_matches_oracle() {
    let inputs = Inputs::<f16>::fixed(31, 1, (40, 70), (2, 1), (32, 32));
    let opts = Opts { causal: Causal::TopLeft, softcap: Some(20.0), scale: Some(0.3), ..Opts::default() };
    assert_backward_matches_oracle(&inputs, &opts);
}

#[test]
fn run_backward_varlen_gqa_window_bf16_matches_oracle() {
    let inputs = Inputs::<bf16>::varlen(32, &[(17, 30), (0, 5), (25, 25), (9, 3)], 4, 2, 32);
    let opts = Opts { causal: Causal::BottomRight, window: Some((8, 0, true)), ..Opts::default() };
    assert_backward_matches_oracle(&inputs, &opts);
}

#[test]
fn run_backward_alibi_dropout_f32_matches_oracle() {
    let mut inputs = Inputs::<f32>::fixed(33, 2, (30, 30), (4, 2), (16, 16));
    inputs.alibi = Some(((0..8).map(|i| 0.05 * (i + 1) as f32).collect(), vec![2, 4]));
    assert_backward_matches_oracle(&inputs, &Opts { dropout: Some((0.3, 42, 7)), ..Opts::default() });
}

#[test]
fn run_backward_varlen_mqa_causal_dropout_matches_oracle() {
    let inputs = Inputs::<f32>::varlen(34, &[(20, 31), (12, 12), (7, 0)], 6, 1, 16);
    let opts = Opts { causal: Causal::BottomRight, dropout: Some((0.5, 9, 0)), ..Opts::default() };
    assert_backward_matches_oracle(&inputs, &opts);
}

#[test]
fn run_backward_block_mask_softcap_dropout_f16_matches_oracle() {
    let mut inputs = Inputs::<f16>::fixed(35, 2, (20, 20), (2, 1), (16, 8));
    // [b, hq, qb, kb] = [2, 2, 4, 2] for blocks of (5, 10).
    let mask: Vec<u8> = (0..32).map(|i| u8::from(i % 5 != 0)).collect();
    inputs.block_mask = Some((mask, vec![2, 2, 4, 2], Dtype::BOOL));
    let opts = Opts { block_size: Some((5, 10)), softcap: Some(10.0), dropout: Some((0.1, 77, 3)), ..Opts::default() };
    assert_backward_matches_oracle(&inputs, &opts);
}

// ---------------------------------------------------------------------------------------------
// Bad input: one line on stderr, exit code 2, output untouched
// ---------------------------------------------------------------------------------------------

/// What the input file holds in a rejection test.
enum Content {
    Tensors(Vec<(&'static str, Raw)>),
    Bytes(Vec<u8>),
    Missing,
}

/// Runs with `content` and `args` over an existing output file and checks the error contract.
fn assert_rejected(content: Content, args: &[&str]) -> String {
    let dir = TempDir::new("bad");
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    match &content {
        Content::Tensors(t) => save(&input, t),
        Content::Bytes(b) => std::fs::write(&input, b).expect("write input"),
        Content::Missing => {}
    }
    let sentinel: Vec<u8> = (0..=255u8).rev().cycle().take(777).collect();
    std::fs::write(&output, &sentinel).expect("write sentinel");
    let extra: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let res = run(&input, &output, &extra);
    let stderr = String::from_utf8_lossy(&res.stderr).into_owned();
    assert_eq!(res.status.code(), Some(2), "args {args:?}, stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "exactly one stderr line, got {stderr:?}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(std::fs::read(&output).expect("output still there"), sentinel, "output file was modified");
    let mut expected = vec!["out.safetensors".to_owned()];
    if !matches!(content, Content::Missing) {
        expected.insert(0, "in.safetensors".to_owned());
    }
    assert_eq!(dir.files(), expected, "no temporary files left behind");
    lines[0].to_owned()
}

/// Valid fixed-length inputs: q [1, 5, 4, 8], k, v [1, 7, 2, 8].
fn valid() -> Vec<(&'static str, Raw)> {
    Inputs::<f32>::fixed(9, 1, (5, 7), (4, 2), (8, 8)).tensors()
}

/// [`valid`] with `name` replaced (or added).
fn with(name: &'static str, t: Raw) -> Vec<(&'static str, Raw)> {
    let mut v: Vec<_> = valid().into_iter().filter(|(n, _)| *n != name).collect();
    v.push((name, t));
    v
}

fn without(name: &str) -> Vec<(&'static str, Raw)> {
    valid().into_iter().filter(|(n, _)| *n != name).collect()
}

/// Valid varlen inputs: two sequences, q [9, 4, 8], k, v [11, 2, 8].
fn valid_varlen() -> Vec<(&'static str, Raw)> {
    Inputs::<f32>::varlen(10, &[(4, 5), (5, 6)], 4, 2, 8).tensors()
}

fn varlen_with(name: &'static str, cu: &[i32]) -> Content {
    let mut v: Vec<_> = valid_varlen().into_iter().filter(|(n, _)| *n != name).collect();
    v.push((name, raw(cu, &[cu.len()])));
    Content::Tensors(v)
}

fn zeros_f32(shape: &[usize]) -> Raw {
    raw(&vec![0.0f32; shape.iter().product()], shape)
}

#[test]
fn valid_control_input_succeeds() {
    let dir = TempDir::new("control");
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    save(&input, &valid());
    let res = run(&input, &output, &[]);
    assert!(res.status.success(), "{}", String::from_utf8_lossy(&res.stderr));
    assert!(res.stderr.is_empty());
}

#[test]
fn missing_tensor_is_rejected() {
    let line = assert_rejected(Content::Tensors(without("v")), &[]);
    assert!(line.contains("`v`"), "{line}");
}

#[test]
fn wrong_dtype_is_rejected() {
    let line = assert_rejected(Content::Tensors(with("q", raw(&[1i64; 160], &[1, 5, 4, 8]))), &[]);
    assert!(line.contains("I64"), "{line}");
}

#[test]
fn mixed_dtypes_are_rejected() {
    let k: Vec<f16> = vec![f16::from_f32(0.5); 7 * 2 * 8];
    assert_rejected(Content::Tensors(with("k", raw(&k, &[1, 7, 2, 8]))), &[]);
}

#[test]
fn corrupt_file_is_rejected() {
    let mut bytes = b"\x13\x00\x00\x00\x00\x00\x00\x00{not json at all}".to_vec();
    bytes.extend(0..=255u8);
    assert_rejected(Content::Bytes(bytes), &[]);
}

#[test]
fn empty_file_is_rejected() {
    assert_rejected(Content::Bytes(Vec::new()), &[]);
}

#[test]
fn truncated_file_is_rejected() {
    let bytes = safetensors::serialize(valid().iter().map(|(n, t)| (*n, t)), &None).expect("serialize");
    assert_rejected(Content::Bytes(bytes[..bytes.len() - 17].to_vec()), &[]);
    assert_rejected(Content::Bytes(bytes[..bytes.len() / 2].to_vec()), &[]);
}

#[test]
fn missing_input_file_is_rejected() {
    assert_rejected(Content::Missing, &[]);
}

#[test]
fn wrong_rank_is_rejected() {
    assert_rejected(Content::Tensors(with("q", zeros_f32(&[5, 4, 8]))), &[]);
}

#[test]
fn mismatched_heads_are_rejected() {
    assert_rejected(Content::Tensors(with("v", zeros_f32(&[1, 7, 1, 8]))), &[]);
}

#[test]
fn mismatched_head_dims_are_rejected() {
    assert_rejected(Content::Tensors(with("k", zeros_f32(&[1, 7, 2, 6]))), &[]);
}

#[test]
fn head_ratio_not_integral_is_rejected() {
    assert_rejected(Content::Tensors(with("q", zeros_f32(&[1, 5, 3, 8]))), &[]);
}

#[test]
fn cu_seqlens_not_starting_at_zero_is_rejected() {
    assert_rejected(varlen_with("cu_seqlens_q", &[1, 4, 9]), &[]);
}

#[test]
fn decreasing_cu_seqlens_are_rejected() {
    assert_rejected(varlen_with("cu_seqlens_k", &[0, 6, 5]), &[]);
}

#[test]
fn cu_seqlens_past_the_end_are_rejected() {
    assert_rejected(varlen_with("cu_seqlens_k", &[0, 5, 12]), &[]);
}

#[test]
fn cu_seqlens_of_the_wrong_length_are_rejected() {
    assert_rejected(varlen_with("cu_seqlens_k", &[0, 3, 5, 11]), &[]);
}

#[test]
fn cu_seqlens_of_the_wrong_dtype_are_rejected() {
    let mut v: Vec<_> = valid_varlen().into_iter().filter(|(n, _)| *n != "cu_seqlens_q").collect();
    v.push(("cu_seqlens_q", raw(&[0i64, 4, 9], &[3])));
    assert_rejected(Content::Tensors(v), &[]);
}

#[test]
fn cu_seqlens_without_their_pair_are_rejected() {
    let v: Vec<_> = valid_varlen().into_iter().filter(|(n, _)| *n != "cu_seqlens_k").collect();
    assert_rejected(Content::Tensors(v), &[]);
}

#[test]
fn window_below_minus_one_is_rejected() {
    assert_rejected(Content::Tensors(valid()), &["--window=-2,0"]);
    assert_rejected(Content::Tensors(valid()), &["--window", "0,-5"]);
}

#[test]
fn malformed_window_is_rejected() {
    assert_rejected(Content::Tensors(valid()), &["--window", "3"]);
}

#[test]
fn nan_scale_is_rejected() {
    assert_rejected(Content::Tensors(valid()), &["--scale", "NaN"]);
}

#[test]
fn infinite_scale_is_rejected() {
    assert_rejected(Content::Tensors(valid()), &["--scale", "inf"]);
    assert_rejected(Content::Tensors(valid()), &["--scale=-inf"]);
}

#[test]
fn non_positive_softcap_is_rejected() {
    assert_rejected(Content::Tensors(valid()), &["--softcap", "0"]);
    assert_rejected(Content::Tensors(valid()), &["--softcap", "-1.5"]);
}

#[test]
fn block_mask_of_the_wrong_shape_is_rejected() {
    // sq 5, sk 7 with blocks (4, 4) need [2, 2].
    assert_rejected(Content::Tensors(with("block_mask", raw(&[1u8; 9], &[3, 3]))), &["--block-size", "4,4"]);
}

#[test]
fn block_mask_of_the_wrong_dtype_is_rejected() {
    assert_rejected(Content::Tensors(with("block_mask", zeros_f32(&[2, 2]))), &["--block-size", "4,4"]);
}

#[test]
fn zero_block_size_is_rejected() {
    assert_rejected(Content::Tensors(with("block_mask", raw(&[1u8], &[1, 1]))), &["--block-size", "0,16"]);
}

#[test]
fn block_mask_without_block_size_is_rejected() {
    assert_rejected(Content::Tensors(with("block_mask", raw(&[1u8; 4], &[2, 2]))), &[]);
}

#[test]
fn block_size_without_block_mask_is_rejected() {
    assert_rejected(Content::Tensors(valid()), &["--block-size", "4,4"]);
}

#[test]
fn alibi_slopes_of_the_wrong_shape_are_rejected() {
    assert_rejected(Content::Tensors(with("alibi_slopes", zeros_f32(&[5]))), &[]);
    assert_rejected(Content::Tensors(with("alibi_slopes", zeros_f32(&[2, 4]))), &[]);
}

#[test]
fn alibi_slopes_of_the_wrong_dtype_are_rejected() {
    assert_rejected(Content::Tensors(with("alibi_slopes", raw(&[1i32; 4], &[4]))), &[]);
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_device_is_rejected_in_a_cpu_build() {
    let line = assert_rejected(Content::Tensors(valid()), &["--device", "cuda"]);
    assert!(line.contains("cuda backend is not available"), "{line}");
}

#[test]
fn backward_without_dout_is_rejected() {
    let line = assert_rejected(Content::Tensors(valid()), &["--backward"]);
    assert!(line.contains("`dout`"), "{line}");
}

#[test]
fn dout_of_the_wrong_shape_is_rejected() {
    // out is [1, 5, 4, 8].
    for shape in [[1, 5, 4, 7], [1, 5, 2, 8], [1, 6, 4, 8]] {
        let line = assert_rejected(Content::Tensors(with("dout", zeros_f32(&shape))), &["--backward"]);
        assert!(line.contains("`dout`"), "{line}");
    }
    assert_rejected(Content::Tensors(with("dout", zeros_f32(&[5, 4, 8]))), &["--backward"]);
}

#[test]
fn dout_of_the_wrong_dtype_is_rejected() {
    let dout = vec![f16::from_f32(0.5); 5 * 4 * 8];
    let line = assert_rejected(Content::Tensors(with("dout", raw(&dout, &[1, 5, 4, 8]))), &["--backward"]);
    assert!(line.contains("`dout`") && line.contains("F16"), "{line}");
    assert_rejected(Content::Tensors(with("dout", raw(&[0i32; 160], &[1, 5, 4, 8]))), &["--backward"]);
}

#[test]
fn dropout_outside_zero_to_one_is_rejected() {
    for p in ["1.0", "1", "-0.1", "nan", "NaN", "inf", "1.5"] {
        let line = assert_rejected(Content::Tensors(valid()), &["--dropout", p, "--seed", "3"]);
        assert!(line.contains("dropout"), "{line}");
        assert_rejected(Content::Tensors(valid()), &["--dropout", p]);
        assert_rejected(Content::Tensors(valid()), &["--dropout", p, "--seed", "3", "--backward"]);
    }
    assert_rejected(Content::Tensors(valid()), &["--dropout=-0.1", "--seed", "3"]);
}

#[test]
fn malformed_dropout_is_rejected() {
    assert_rejected(Content::Tensors(valid()), &["--dropout", "ten percent", "--seed", "3"]);
}

#[test]
fn dropout_without_seed_is_rejected() {
    let line = assert_rejected(Content::Tensors(valid()), &["--dropout", "0.1"]);
    assert!(line.contains("--seed"), "{line}");
    assert_rejected(Content::Tensors(valid()), &["--dropout", "0.1", "--offset", "4"]);
}

#[test]
fn seed_or_offset_without_dropout_is_rejected() {
    let line = assert_rejected(Content::Tensors(valid()), &["--seed", "3"]);
    assert!(line.contains("--dropout"), "{line}");
    assert_rejected(Content::Tensors(valid()), &["--offset", "3"]);
}

#[test]
fn seed_and_offset_out_of_range_are_rejected() {
    assert_rejected(Content::Tensors(valid()), &["--dropout", "0.1", "--seed", "-1"]);
    assert_rejected(Content::Tensors(valid()), &["--dropout", "0.1", "--seed", "1", "--offset", "4294967296"]);
}

#[test]
fn conflicting_causal_flags_are_rejected() {
    assert_rejected(Content::Tensors(valid()), &["--causal", "--causal-top-left"]);
}

// ---------------------------------------------------------------------------------------------
// FP8 (e4m3): F8_E4M3 inputs and `--dtype fp8e4m3`, forward only, `out` in BF16
// ---------------------------------------------------------------------------------------------

/// One FP8 input tensor: e4m3 elements and, where the file names one, its descale factor.
struct Fp8Tensor {
    data: Vec<Fp8E4m3>,
    shape: Vec<usize>,
    /// Written as `<name>_descale`; `None` leaves it out of the file (factor 1).
    descale: Option<f32>,
}

impl Fp8Tensor {
    /// Normals of amplitude `amp` quantized per tensor (a factor that is not 1).
    fn quantized(rng: &mut Rng, shape: &[usize], amp: f32) -> Self {
        let x: Vec<f32> = normal::<f32>(rng, shape).iter().map(|x| x * amp).collect();
        let (data, scale) = fp8::quantize(&x);
        Self { data, shape: shape.to_vec(), descale: Some(scale) }
    }

    /// Normals of amplitude `amp` rounded to e4m3 as they are: real values without a factor.
    fn unscaled(rng: &mut Rng, shape: &[usize], amp: f32) -> Self {
        let data = normal::<f32>(rng, shape).iter().map(|x| Fp8E4m3::from_f32(x * amp)).collect();
        Self { data, shape: shape.to_vec(), descale: None }
    }

    fn raw(&self) -> Raw {
        Raw { dtype: Dtype::F8_E4M3, shape: self.shape.clone(), bytes: self.data.iter().map(|x| x.to_bits()).collect() }
    }

    /// The real values: the elements times the factor (1 without one).
    fn dequantized(&self) -> Vec<f32> {
        fp8::dequantize(&self.data, self.descale.unwrap_or(1.0))
    }
}

/// F8_E4M3 `q [1, 24, 4, 32]` and `k`, `v [1, 40, 2, 32]`: `q` and `k` with descale factors in the
/// file, `v` without one.
fn fp8_inputs() -> [Fp8Tensor; 3] {
    let mut rng = Rng::new(0xF8);
    [
        Fp8Tensor::quantized(&mut rng, &[1, 24, 4, 32], 3.0),
        Fp8Tensor::quantized(&mut rng, &[1, 40, 2, 32], 0.5),
        Fp8Tensor::unscaled(&mut rng, &[1, 40, 2, 32], 2.0),
    ]
}

fn fp8_tensors(inputs: &[Fp8Tensor; 3]) -> Vec<(&'static str, Raw)> {
    let mut t = Vec::new();
    for (name, descale, x) in
        [("q", "q_descale", &inputs[0]), ("k", "k_descale", &inputs[1]), ("v", "v_descale", &inputs[2])]
    {
        t.push((name, x.raw()));
        if let Some(f) = x.descale {
            t.push((descale, raw(&[f], &[])));
        }
    }
    t
}

/// Checks `out` (BF16) and `lse` (F32) of an output file against the oracle and `naive_fp8` on the
/// real (dequantized) inputs `[q, k, v]`, under the FP8 contract.
fn assert_fp8_output_meets_the_contract(bytes: &[u8], spec: &AttentionSpec<'_>, real: [(&[f32], &[usize]); 3]) {
    let st = SafeTensors::deserialize(bytes).expect("output is safetensors");
    let [q, k, v] = real.map(|(x, shape)| Tensor::new(x, shape));
    let g = spec.geometry(&q, &k, &v).expect("valid problem");
    let out = output_tensor::<bf16>(&st, "out", &g.out_shape());
    let lse = output_tensor::<f32>(&st, "lse", &g.lse_shape());
    let oracle = flash_attn::reference::forward(spec, &q, &k, &v).expect("oracle");
    let naive = flash_attn::reference::naive_fp8(spec, &q, &k, &v).expect("naive fp8");
    let c_out = compare_fp8(&out, &oracle.out, &naive.out);
    let c_lse = compare_fp8(&lse, &oracle.lse, &naive.lse);
    assert!(c_out.passed() && c_out.max_ref > 0.0, "out: {c_out}");
    assert!(c_lse.passed(), "lse: {c_lse}");
}

#[test]
fn run_f8_e4m3_inputs_with_descale_factors_meet_the_fp8_contract() {
    let inputs = fp8_inputs();
    let bytes = run_ok(&fp8_tensors(&inputs), &["--causal".to_owned()]);
    let real = inputs.each_ref().map(Fp8Tensor::dequantized);
    let real = [0, 1, 2].map(|i| (real[i].as_slice(), inputs[i].shape.as_slice()));
    assert_fp8_output_meets_the_contract(&bytes, &AttentionSpec::new().causal(), real);
}

#[test]
fn run_float_inputs_with_dtype_fp8_are_quantized_per_tensor() {
    let inputs = Inputs::<bf16>::fixed(40, 2, (20, 33), (2, 1), (16, 16));
    let bytes = run_ok(&inputs.tensors(), &["--dtype".to_owned(), "e4m3".to_owned(), "--window=8,2".to_owned()]);
    // The oracle sees what the command ran on: each tensor widened, quantized and dequantized.
    let real = [&inputs.q, &inputs.k, &inputs.v].map(|(x, _)| {
        let (q8, scale) = fp8::quantize(&x.iter().map(|x| x.to_f32()).collect::<Vec<_>>());
        fp8::dequantize(&q8, scale)
    });
    let shapes = [&inputs.q.1, &inputs.k.1, &inputs.v.1];
    let real = [0, 1, 2].map(|i| (real[i].as_slice(), shapes[i].as_slice()));
    assert_fp8_output_meets_the_contract(&bytes, &AttentionSpec::new().window(8, 2), real);
}

#[test]
fn run_fp8_with_backward_is_rejected() {
    let line = assert_rejected(Content::Tensors(fp8_tensors(&fp8_inputs())), &["--backward"]);
    assert!(line.contains("backward") && line.contains("FP8"), "{line}");
    let line = assert_rejected(Content::Tensors(valid()), &["--dtype", "fp8e4m3", "--backward"]);
    assert!(line.contains("backward") && line.contains("FP8"), "{line}");
}

#[test]
fn descale_factors_of_float_inputs_are_rejected() {
    let line = assert_rejected(Content::Tensors(with("k_descale", raw(&[0.5f32], &[]))), &[]);
    assert!(line.contains("k_descale") && line.contains("F8_E4M3"), "{line}");
    assert_rejected(Content::Tensors(with("q_descale", raw(&[0.5f32], &[]))), &["--dtype", "fp8"]);
}

#[test]
fn descale_factor_that_is_not_one_positive_f32_is_rejected() {
    let bad = [
        raw(&[0.5f32, 0.5], &[2]),
        raw(&[f16::from_f32(0.5)], &[1]),
        raw(&[0.0f32], &[]),
        raw(&[f32::INFINITY], &[1, 1]),
    ];
    for descale in bad {
        let mut tensors = fp8_tensors(&fp8_inputs());
        tensors.retain(|(n, _)| *n != "k_descale");
        tensors.push(("k_descale", descale));
        let line = assert_rejected(Content::Tensors(tensors), &[]);
        assert!(line.contains("k_descale") || line.contains("descale factor of `k`"), "{line}");
    }
}

#[test]
fn float_dtype_that_does_not_match_the_inputs_is_rejected() {
    let line = assert_rejected(Content::Tensors(valid()), &["--dtype", "bf16"]);
    assert!(line.contains("--dtype bf16") && line.contains("F32"), "{line}");
    let line = assert_rejected(Content::Tensors(fp8_tensors(&fp8_inputs())), &["--dtype", "f16"]);
    assert!(line.contains("F8_E4M3") && line.contains("dequantize"), "{line}");
    assert_rejected(Content::Tensors(valid()), &["--dtype", "fp4"]);
}

#[test]
fn f8_e4m3_mixed_with_float_inputs_is_rejected() {
    // `valid()`'s q shape [1, 5, 4, 8], all ones in e4m3.
    let q = Raw { dtype: Dtype::F8_E4M3, shape: vec![1, 5, 4, 8], bytes: vec![0x38; 160] };
    let line = assert_rejected(Content::Tensors(with("q", q)), &[]);
    assert!(line.contains("F8_E4M3") && line.contains("one dtype"), "{line}");
}

#[test]
fn help_documents_fp8e4m3_where_a_dtype_is_taken() {
    for command in ["run", "bench", "check"] {
        let res = flash_attn(&[command, "--help"]);
        let help = String::from_utf8_lossy(&res.stdout);
        assert!(res.status.success() && help.contains("fp8e4m3") && help.contains("float8_e4m3fn"), "{help}");
    }
}

// ---------------------------------------------------------------------------------------------
// check and bench
// ---------------------------------------------------------------------------------------------

#[test]
fn check_reports_all_cases_passed_forward_and_backward() {
    let res = flash_attn(&["check", "--cases", "10"]);
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(res.status.success(), "{stdout}{}", String::from_utf8_lossy(&res.stderr));
    assert_eq!(stdout.lines().last(), Some("10 passed, 0 failed"), "{stdout}");
}

#[test]
fn check_forward_only_reports_all_cases_passed() {
    let res = flash_attn(&["check", "--cases", "20", "--seed", "7", "--forward-only"]);
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(res.status.success(), "{stdout}{}", String::from_utf8_lossy(&res.stderr));
    assert_eq!(stdout.lines().last(), Some("20 passed, 0 failed"), "{stdout}");
}

#[test]
fn check_fp8_reports_all_cases_passed() {
    let res = flash_attn(&["check", "--dtype", "fp8e4m3", "--cases", "30", "--seed", "3"]);
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(res.status.success(), "{stdout}{}", String::from_utf8_lossy(&res.stderr));
    assert_eq!(stdout.lines().last(), Some("30 passed, 0 failed"), "{stdout}");
}

/// A flat JSON object (`"key": string | number | bool | null`), as `bench --json` prints.
fn parse_flat_json(line: &str) -> Option<Vec<(String, String)>> {
    let body = line.trim().strip_prefix('{')?.strip_suffix('}')?;
    body.split(',')
        .map(|pair| {
            let (k, v) = pair.split_once(':')?;
            let key = k.trim().strip_prefix('"')?.strip_suffix('"')?;
            let v = v.trim();
            let valid = (v.starts_with('"') && v.ends_with('"') && v.len() >= 2)
                || v == "true"
                || v == "false"
                || v == "null"
                || v.parse::<f64>().is_ok();
            valid.then(|| (key.to_owned(), v.to_owned()))
        })
        .collect()
}

/// The last line of a successful `bench ... --json`, parsed.
fn bench_json(args: &[&str]) -> (String, Vec<(String, String)>) {
    let res = flash_attn(args);
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(res.status.success(), "{stdout}{}", String::from_utf8_lossy(&res.stderr));
    let line = stdout.lines().last().expect("a JSON line").to_owned();
    let fields = parse_flat_json(&line).unwrap_or_else(|| panic!("not a flat JSON object: {line}"));
    (line, fields)
}

#[test]
fn bench_json_line_has_the_contract_keys() {
    let (line, fields) =
        bench_json(&["bench", "--device", "cpu", "--dtype", "bf16", "--shape", "1,2,1,64,80,32", "--causal", "--json"]);
    let get = |k: &str| fields.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
    for key in ["device", "dtype", "b", "hq", "hk", "sq", "sk", "d", "causal", "fwd_ms", "gflops", "peak_extra_bytes"] {
        assert!(get(key).is_some(), "key {key} missing in {line}");
    }
    assert_eq!(get("device"), Some("\"cpu\""));
    assert_eq!(get("dtype"), Some("\"bf16\""));
    assert_eq!((get("b"), get("hq"), get("hk")), (Some("1"), Some("2"), Some("1")));
    assert_eq!((get("sq"), get("sk"), get("d")), (Some("64"), Some("80"), Some("32")));
    assert_eq!(get("causal"), Some("true"));
    assert!(get("fwd_ms").is_some_and(|v| v.parse::<f64>().is_ok()), "{line}");
    assert!(get("fwdbwd_ms").is_none(), "{line}");
}

#[test]
fn bench_with_a_block_mask_runs_forward_and_backward_and_names_the_mask() {
    let (line, fields) = bench_json(&[
        "bench",
        "--shape",
        "1,2,2,96,80,32",
        "--block-size",
        "16,24",
        "--density",
        "40",
        "--causal",
        "--backward",
        "--json",
    ]);
    let get = |k: &str| fields.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
    assert_eq!((get("block_q"), get("block_k"), get("density_pct")), (Some("16"), Some("24"), Some("40")), "{line}");
    let fraction = get("visible_fraction").and_then(|v| v.parse::<f64>().ok());
    assert!(fraction.is_some_and(|f| f > 0.0 && f < 0.6), "{line}");
    for key in ["fwd_ms", "fwdbwd_ms"] {
        assert!(get(key).and_then(|v| v.parse::<f64>().ok()).is_some_and(|x| x > 0.0), "{key} in {line}");
    }
}

#[test]
fn bench_backward_json_line_adds_fwdbwd_ms() {
    let (line, fields) = bench_json(&["bench", "--dtype", "f16", "--shape", "1,4,2,48,64,32", "--backward", "--json"]);
    let get = |k: &str| fields.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
    for key in ["fwd_ms", "fwdbwd_ms", "fwdbwd_gflops", "bwd_peak_extra_bytes"] {
        let value = get(key).and_then(|v| v.parse::<f64>().ok());
        assert!(value.is_some_and(|x| x > 0.0), "{key} missing or not positive in {line}");
    }
    assert_eq!(get("causal"), Some("false"));
}

#[test]
fn bench_backward_table_has_forward_and_backward_columns() {
    let res = flash_attn(&["bench", "--shape", "1,2,2,32,32,16", "--causal", "--backward"]);
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(res.status.success(), "{stdout}{}", String::from_utf8_lossy(&res.stderr));
    let header = stdout.lines().find(|l| l.starts_with("| b×hq×s×d")).unwrap_or_else(|| panic!("no table: {stdout}"));
    for column in ["fwd ms", "fwd+bwd ms", "fwd+bwd GFLOP/s", "bwd peak extra"] {
        assert!(header.contains(column), "{column} missing in {header}");
    }
}

#[test]
fn bench_fp8_json_line_names_the_dtype() {
    for alias in ["fp8e4m3", "float8_e4m3fn"] {
        let (line, fields) = bench_json(&[
            "bench",
            "--device",
            "cpu",
            "--dtype",
            alias,
            "--shape",
            "1,4,2,48,64,32",
            "--causal",
            "--json",
        ]);
        let get = |k: &str| fields.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
        assert_eq!((get("device"), get("dtype")), (Some("\"cpu\""), Some("\"fp8e4m3\"")), "{line}");
        assert_eq!(
            (get("hq"), get("hk"), get("sq"), get("sk"), get("d")),
            (Some("4"), Some("2"), Some("48"), Some("64"), Some("32"))
        );
        for key in ["fwd_ms", "gflops"] {
            assert!(get(key).and_then(|v| v.parse::<f64>().ok()).is_some_and(|x| x > 0.0), "{key} in {line}");
        }
        assert!(get("fwdbwd_ms").is_none(), "{line}");
    }
}

#[test]
fn bench_fp8_with_backward_or_decode_is_a_one_line_error() {
    let args = ["bench", "--dtype", "fp8", "--shape", "1,2,2,32,32,16", "--backward", "--json"];
    let line = assert_error_output(&args, &flash_attn(&args));
    assert!(line.contains("--backward") && line.contains("FP8"), "{line}");
    let args = ["bench", "--dtype", "e4m3", "--decode", "--shape", "1,2,2,1,32,16"];
    let line = assert_error_output(&args, &flash_attn(&args));
    assert!(line.contains("--decode"), "{line}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn bench_rejects_cuda_in_a_cpu_build() {
    let res = flash_attn(&["bench", "--device", "cuda"]);
    assert_eq!(res.status.code(), Some(2));
    assert_eq!(String::from_utf8_lossy(&res.stderr).lines().count(), 1);
}

#[test]
fn bench_rejects_backward_with_the_memory_table() {
    let res = flash_attn(&["bench", "--memory", "--backward"]);
    assert_eq!(res.status.code(), Some(2));
    assert_eq!(String::from_utf8_lossy(&res.stderr).lines().count(), 1);
}

#[test]
fn bench_rejects_an_invalid_shape() {
    let res = flash_attn(&["bench", "--shape", "1,3,2,16,16,16", "--json"]);
    assert_eq!(res.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&res.stderr).contains("multiple"));
}

// ---------------------------------------------------------------------------------------------
// Figures: `bench --memory --plot` and `plot --from`
// ---------------------------------------------------------------------------------------------

#[test]
fn bench_memory_plot_draws_algorithm_0_and_flash_attn_from_the_table_sweep() {
    let dir = TempDir::new("memory-plot");
    let svg = dir.path("memory.svg");
    let res = flash_attn(&["bench", "--memory", "--max-n", "2048", "--plot", svg.to_str().expect("utf-8 path")]);
    assert!(res.status.success(), "{res:?}");
    let table = String::from_utf8_lossy(&res.stdout);
    assert!(table.contains("| 2k ") && !table.contains("| 4k "), "{table}");
    let svg = std::fs::read_to_string(&svg).expect("figure written");
    for text in ["<svg", "Algorithm 0", "FlashAttention", "runtime", "peak extra memory"] {
        assert!(svg.contains(text), "{text} missing from the figure");
    }
}

#[test]
fn plot_draws_one_series_per_label_from_bench_json_lines() {
    let dir = TempDir::new("plot-json");
    let (json, svg) = (dir.path("bench.json"), dir.path("fwd.svg"));
    let lines = [
        r#"{"device":"cuda","dtype":"bf16","d":64,"causal":false,"sq":1024,"fwd_ms":0.5,"peak_extra_bytes":null}"#,
        r#"{"device":"cuda","dtype":"bf16","d":64,"causal":false,"sq":2048,"fwd_ms":1.5,"peak_extra_bytes":null}"#,
        r#"{"label":"torch sdpa","sq":1024,"fwd_ms":0.4}"#,
        r#"{"label":"torch sdpa","sq":2048,"fwd_ms":1.2}"#,
    ];
    std::fs::write(&json, lines.join("\n")).expect("write json");
    let res = flash_attn(&["plot", "--from", json.to_str().expect("utf-8"), "--output", svg.to_str().expect("utf-8")]);
    assert!(res.status.success(), "{res:?}");
    let svg = std::fs::read_to_string(&svg).expect("figure written");
    assert!(svg.contains("flash-attn cuda bf16 d=64") && svg.contains("torch sdpa"), "labels missing");
    assert!(!svg.contains("peak extra memory"), "no memory panel without peaks");
}

#[test]
fn plot_to_an_unwritable_path_is_one_line_and_writes_nothing() {
    let dir = TempDir::new("plot-unwritable");
    let json = dir.path("bench.json");
    std::fs::write(&json, r#"{"sq":1024,"fwd_ms":1.0}"#).expect("write json");
    let missing = dir.path("no-such-dir").join("fwd.svg");
    let args = ["plot", "--from", json.to_str().expect("utf-8"), "--output", missing.to_str().expect("utf-8")];
    let res = flash_attn(&args);
    assert_error_output(&args, &res);
    assert_eq!(dir.files(), ["bench.json"]);
}

#[test]
fn plot_rejects_json_lines_without_fwd_ms() {
    let dir = TempDir::new("plot-bad-json");
    let (json, svg) = (dir.path("bench.json"), dir.path("fwd.svg"));
    std::fs::write(&json, "{\"sq\":1024}\n").expect("write json");
    let args = ["plot", "--from", json.to_str().expect("utf-8"), "--output", svg.to_str().expect("utf-8")];
    let res = flash_attn(&args);
    assert_error_output(&args, &res);
    assert!(String::from_utf8_lossy(&res.stderr).contains("fwd_ms"));
    assert_eq!(dir.files(), ["bench.json"]);
}

#[test]
fn bench_memory_plot_into_a_missing_directory_fails_before_the_sweep() {
    let dir = TempDir::new("memory-plot-missing");
    let missing = dir.path("no-such-dir").join("memory.svg");
    for args in [
        ["bench", "--memory", "--plot", missing.to_str().expect("utf-8")].as_slice(),
        // `--plot` alone implies `--memory` (issue 7's `flash-attn bench --plot FILE.svg`).
        ["bench", "--plot", missing.to_str().expect("utf-8")].as_slice(),
    ] {
        let res = flash_attn(args);
        let line = assert_error_output(args, &res);
        assert!(line.contains("directory"), "{line}");
        assert!(res.stdout.is_empty(), "no table before the error");
    }
}

// ---------------------------------------------------------------------------------------------
// The CUDA backend: `--device cuda` and `kernels` (cargo feature `cuda`)
// ---------------------------------------------------------------------------------------------

/// Checks the error contract of a command that must fail: exit code 2, one `error: ` line on
/// stderr, no panic; returns the line.
fn assert_one_line_error(args: &[&str]) -> String {
    assert_error_output(args, &flash_attn(args))
}

fn assert_error_output(args: &[&str], res: &Output) -> String {
    let stderr = String::from_utf8_lossy(&res.stderr).into_owned();
    assert_eq!(res.status.code(), Some(2), "args {args:?}, stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "exactly one stderr line for {args:?}, got {stderr:?}");
    assert!(lines[0].starts_with("error: ") && !stderr.contains("panicked"), "{stderr}");
    lines[0].to_owned()
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_check_and_kernels_are_rejected_in_a_cpu_build() {
    for args in [
        &["check", "--device", "cuda", "--cases", "1"][..],
        &["kernels", "--compile-all"],
        &["kernels", "--compile-all", "--arch", "sm_80,sm_90a"],
        &["kernels", "--compile-all", "--only", "_xd"],
        &["kernels"],
    ] {
        let line = assert_one_line_error(args);
        assert!(line.contains("not available in this build") && line.contains("`cuda`"), "{args:?}: {line}");
    }
}

/// In a cuda build, on any machine: f32 inputs are rejected (no GPU: CUDA is unavailable; a GPU:
/// the CUDA forward takes f16/bf16 only), one line, exit 2, output untouched.
#[cfg(feature = "cuda")]
#[test]
fn cuda_run_of_f32_inputs_is_a_one_line_error_with_or_without_a_gpu() {
    let line = assert_rejected(Content::Tensors(valid()), &["--device", "cuda"]);
    assert!(line.contains("CUDA") || line.contains("f32"), "{line}");
}

/// In a cuda build: without a GPU (or driver, or NVRTC) every `--device cuda` command is one line
/// and exit 2, never a panic; with one, `check` and `bench` run.
#[cfg(feature = "cuda")]
#[test]
fn cuda_device_without_a_gpu_is_a_one_line_error() {
    for args in [
        &["check", "--device", "cuda", "--cases", "2"][..],
        &["bench", "--device", "cuda", "--dtype", "bf16", "--shape", "1,2,2,64,64,64", "--json"],
    ] {
        let res = flash_attn(args);
        if res.status.success() {
            continue; // a GPU is present
        }
        let line = assert_error_output(args, &res);
        assert!(line.contains("CUDA") || line.contains("NVRTC"), "{args:?}: {line}");
    }
}

/// In a cuda build: `bench --backward` on cuda times forward+backward where a GPU is present and
/// is one line, exit 2, without one (`check --device cuda` above runs the backward pass too).
#[cfg(feature = "cuda")]
#[test]
fn cuda_backward_bench_runs_or_reports_a_missing_gpu() {
    let args = ["bench", "--device", "cuda", "--dtype", "bf16", "--shape", "1,2,2,64,64,64", "--backward", "--json"];
    let res = flash_attn(&args);
    if res.status.success() {
        let stdout = String::from_utf8_lossy(&res.stdout);
        assert!(stdout.contains("\"fwdbwd_ms\":"), "{stdout}");
        return;
    }
    let line = assert_error_output(&args, &res);
    assert!(line.contains("CUDA") || line.contains("NVRTC"), "{line}");
}

/// In a cuda build: the FP8 forward of `run`, `bench` and `check` on cuda meets the FP8 contract,
/// times, or skips its cases on a GPU without sm_90a; without a GPU each is one line, exit 2.
#[cfg(feature = "cuda")]
#[test]
fn cuda_fp8_runs_or_reports_why_not() {
    let inputs = fp8_inputs();
    let dir = TempDir::new("fp8-cuda");
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    save(&input, &fp8_tensors(&inputs));
    let args = ["--device".to_owned(), "cuda".to_owned(), "--causal".to_owned()];
    let res = run(&input, &output, &args);
    if res.status.success() {
        let real = inputs.each_ref().map(Fp8Tensor::dequantized);
        let real = [0, 1, 2].map(|i| (real[i].as_slice(), inputs[i].shape.as_slice()));
        let bytes = std::fs::read(&output).expect("read output");
        assert_fp8_output_meets_the_contract(&bytes, &AttentionSpec::new().causal(), real);
    } else {
        let line = assert_error_output(&["run", "--device", "cuda"], &res);
        assert!(line.contains("CUDA") || line.contains("NVRTC") || line.contains("sm_90a"), "{line}");
    }
    let args = ["bench", "--device", "cuda", "--dtype", "fp8e4m3", "--shape", "1,2,2,256,256,64", "--json"];
    let res = flash_attn(&args);
    if res.status.success() {
        assert!(String::from_utf8_lossy(&res.stdout).contains("\"dtype\":\"fp8e4m3\""));
    } else {
        let line = assert_error_output(&args, &res);
        assert!(line.contains("CUDA") || line.contains("NVRTC") || line.contains("sm_90a"), "{line}");
    }
    let args = ["check", "--device", "cuda", "--dtype", "fp8", "--cases", "6"];
    let res = flash_attn(&args);
    let stdout = String::from_utf8_lossy(&res.stdout);
    if res.status.success() {
        let last = stdout.lines().last().unwrap_or("");
        assert!(last == "6 passed, 0 failed" || last == "0 passed, 0 failed, 6 skipped", "{stdout}");
    } else {
        let line = assert_error_output(&args, &res);
        assert!(line.contains("CUDA") || line.contains("NVRTC"), "{line}");
    }
}

#[cfg(feature = "cuda")]
#[test]
fn kernels_rejects_a_malformed_architecture_and_a_missing_action() {
    let line = assert_one_line_error(&["kernels", "--compile-all", "--arch", "sm_80,sm9"]);
    assert!(line.contains("sm9"), "{line}");
    let line = assert_one_line_error(&["kernels"]);
    assert!(line.contains("--compile-all"), "{line}");
}

/// Without NVRTC on the library path, `kernels --compile-all` is one line and exit 2; where NVRTC
/// is installed system-wide it compiles, one line per variant (exit 1 if any variant spills).
#[cfg(feature = "cuda")]
#[test]
fn kernels_compile_all_reports_every_variant_or_a_missing_nvrtc() {
    let args = ["kernels", "--compile-all", "--arch", "sm_80"];
    let res = Command::new(BIN).args(args).env_remove("LD_LIBRARY_PATH").output().expect("run flash-attn");
    if res.status.code() == Some(2) {
        let line = assert_error_output(&args, &res);
        assert!(line.contains("NVRTC"), "{line}");
        return;
    }
    let stdout = String::from_utf8_lossy(&res.stdout);
    let variants = stdout.lines().filter(|l| l.starts_with("flash_fwd_") && l.contains(" sm_80 ")).count();
    assert!(variants > 0 && stdout.contains(" variants: "), "{stdout}");
    assert!(matches!(res.status.code(), Some(0 | 1)), "{stdout}");
}

/// `--only TEXT` compiles the variants whose name contains TEXT: one here; a text that names none
/// is one line and exit 2 (as is a missing NVRTC, checked first).
#[cfg(feature = "cuda")]
#[test]
fn kernels_only_compiles_the_variants_it_names() {
    let name = "flash_fwd_bf16_d64_m2_n32_w4_xs";
    let args = ["kernels", "--compile-all", "--arch", "sm_80", "--only", name];
    let res = flash_attn(&args);
    if res.status.code() == Some(2) {
        let line = assert_error_output(&args, &res);
        assert!(line.contains("NVRTC"), "{line}");
    } else {
        let stdout = String::from_utf8_lossy(&res.stdout);
        let lines: Vec<&str> = stdout.lines().filter(|l| l.starts_with("flash_")).collect();
        assert_eq!(lines.len(), 1, "{stdout}");
        assert!(lines[0].starts_with(name) && stdout.contains("1 variants: "), "{stdout}");
    }
    let args = ["kernels", "--compile-all", "--arch", "sm_80", "--only", "no_such_variant"];
    let line = assert_one_line_error(&args);
    assert!(line.contains("NVRTC") || line.contains("no_such_variant"), "{line}");
}

// ---------------------------------------------------------------------------------------------
// FLASH_ATTN_CPU_ISA: a cap on the CPU path, never a request for one the CPU lacks
// ---------------------------------------------------------------------------------------------

#[test]
fn an_unknown_or_missing_cpu_isa_is_a_one_line_error() {
    // `neon` on x86-64 and `avx2` on aarch64 name a path this CPU cannot have.
    let missing = if cfg!(target_arch = "x86_64") { "neon" } else { "avx2" };
    for value in ["sse9", missing] {
        let args = ["check", "--cases", "2"];
        let res = Command::new(BIN).args(args).env("FLASH_ATTN_CPU_ISA", value).output().expect("run flash-attn");
        let line = assert_error_output(&args, &res);
        assert!(line.contains("FLASH_ATTN_CPU_ISA"), "{value}: {line}");
    }
}

#[test]
fn the_portable_cap_passes_check() {
    let res =
        Command::new(BIN).args(["check", "--cases", "20"]).env("FLASH_ATTN_CPU_ISA", "portable").output().expect("run");
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(res.status.success(), "{stdout} {}", String::from_utf8_lossy(&res.stderr));
    assert!(stdout.contains("20 passed, 0 failed"), "{stdout}");
}

#[test]
fn bench_fma_peak_reports_a_positive_rate_on_the_capped_path() {
    let res = Command::new(BIN)
        .args(["bench", "--fma-peak"])
        .env("RAYON_NUM_THREADS", "1")
        .env("FLASH_ATTN_CPU_ISA", "portable")
        .output()
        .expect("run flash-attn");
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(res.status.success(), "{stdout} {}", String::from_utf8_lossy(&res.stderr));
    let rate: f64 = stdout
        .split("threads: ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no rate in {stdout:?}"));
    assert!(stdout.contains("portable path, 1 threads") && rate > 0.0, "{stdout}");
}
