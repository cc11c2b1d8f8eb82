//! `flash-attn run`: attention on the tensors of a safetensors file (DESIGN §5): the forward pass,
//! optionally with dropout, and with `--backward` the gradients of a given `dout`; or, when the
//! file holds a KV cache, one inference step of `flash_attn::kvcache` (DESIGN §6).
//!
//! FP8: `F8_E4M3` inputs (with optional F32 scalar descale factors `q_descale`, `k_descale`,
//! `v_descale`, each 1 when absent), or float inputs with `--dtype fp8e4m3` (quantized per tensor
//! with `flash_attn::fp8::quantize`), run `flash_attn::forward_fp8` (on cuda its device version):
//! `out` in BF16, `lse` in F32; forward only, not in KV-cache mode.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use flash_attn::kvcache::{self, KvCache};
use flash_attn::{fp8, AttentionSpec, DType, Dropout, Element, Fp8E4m3, Fp8Scales, Output, Tensor, TensorMut};
use half::{bf16, f16};
use safetensors::Dtype;

use crate::dtype::{InputDType, DTYPE_VALUES};
use crate::gpu::{self, GpuElement};
use crate::progress::Progress;
use crate::safetensors_io::{self, Input, LeScalar, OwnedTensor};
use crate::{CliError, Device, Result};

/// Arguments of `flash-attn run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// safetensors file with `q`, `k`, `v` (F32, F16 or BF16; or F8_E4M3, see `--dtype`);
    /// optional `cu_seqlens_q` and `cu_seqlens_k` (I32, packed varlen), `alibi_slopes` (F32 [hq]
    /// or [b, hq]), `block_mask` (U8 or BOOL, nonzero = visible); `dout` (dtype of q, shape of
    /// out) for `--backward`; with F8_E4M3 inputs, their descale factors `q_descale`,
    /// `k_descale`, `v_descale` (F32, one element each; 1 when absent).
    /// KV-cache mode when it holds `k_cache`, `v_cache` ([b_cache, s_cache, hk, d|dv], or
    /// [num_pages, page_size, hk, d|dv] with `block_table` I32 [b, max_pages]) and
    /// `cache_seqlens` (I32 [b]): `q` is [b, sq, hq, d]; optional new tokens `k`, `v`
    /// ([b, sn, hk, d|dv], appended in place), `cache_batch_idx`, `cache_leftpad` (I32 [b]),
    /// `rotary_cos`, `rotary_sin` ([max_pos, rd/2]), `alibi_slopes`; one dtype but for the I32
    /// indices and the F32 slopes.
    #[arg(long, value_name = "IN.safetensors")]
    input: PathBuf,

    /// File to write `out` (dtype of q; BF16 for FP8) and `lse` (F32) to, with `--backward` also
    /// `dq`, `dk`, `dv`, in KV-cache mode also the updated `k_cache` and `v_cache`; untouched if
    /// anything fails.
    #[arg(long, value_name = "OUT.safetensors")]
    output: PathBuf,

    /// Element type to run in; by default that of `q`, `k`, `v`. `fp8e4m3` (aliases `fp8`,
    /// `e4m3`, `float8_e4m3fn`) runs the FP8 forward: F32, F16 or BF16 inputs are quantized per
    /// tensor (descale factor = max|x| / 448); F8_E4M3 inputs run it without the flag, their real
    /// values the elements times `q_descale`, `k_descale`, `v_descale`. `out` is then BF16. FP8 is
    /// forward only (no `--backward`) and not in KV-cache mode. `f32`, `f16`, `bf16` must match
    /// the inputs: `run` converts to FP8 only.
    #[arg(long, value_name = DTYPE_VALUES)]
    dtype: Option<InputDType>,

    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,

    /// Causal mask aligned bottom-right (`j <= i + sk - sq`).
    #[arg(long, conflicts_with = "causal_top_left")]
    causal: bool,

    /// Causal mask aligned top-left (`j <= i`), as torch SDPA's `is_causal`.
    #[arg(long)]
    causal_top_left: bool,

    /// Sliding window: query i sees keys i+off-LEFT ..= i+off+RIGHT; -1 = unbounded side.
    #[arg(long, value_name = "LEFT,RIGHT", value_parser = parse_pair::<i64>, allow_hyphen_values = true)]
    window: Option<(i64, i64)>,

    /// Soft-capping of scores: s = C·tanh(s/C).
    #[arg(long, value_name = "C", allow_hyphen_values = true)]
    softcap: Option<f32>,

    /// Softmax scale (default 1/sqrt(d)).
    #[arg(long, value_name = "S", allow_hyphen_values = true)]
    scale: Option<f32>,

    /// Block size of `block_mask` (query rows, key columns); required with a block mask.
    #[arg(long, value_name = "BQ,BK", value_parser = parse_pair::<usize>)]
    block_size: Option<(usize, usize)>,

    /// Dropout probability P in [0, 1) (training): each attention probability is kept with
    /// probability 1 - P and scaled by 1/(1 - P), the keep mask drawn from Philox4x32-10 keyed by
    /// `--seed` and `--offset`. P > 0 needs `--seed`.
    #[arg(long, value_name = "P", allow_hyphen_values = true)]
    dropout: Option<f32>,

    /// Key of the dropout mask (0 ..= 2^64 - 1); required with `--dropout P` for P > 0.
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    seed: Option<u64>,

    /// Counter offset of the dropout mask (0 ..= 2^32 - 1, default 0): give each dropout call
    /// that shares a seed its own.
    #[arg(long, value_name = "K", allow_hyphen_values = true)]
    offset: Option<u32>,

    /// Also run the backward pass on the input's `dout` (dtype of q, shape of out) and write
    /// `dq`, `dk`, `dv` (dtype of q; shapes of q, k, v).
    #[arg(long)]
    backward: bool,

    /// KV-cache mode: rotary embedding on GPT-J pairs (2i, 2i+1) rather than GPT-NeoX's
    /// half-split pairs (i, i + rd/2); needs `rotary_cos` and `rotary_sin` in the input.
    #[arg(long)]
    rotary_interleaved: bool,

    /// KV-cache mode: split each sequence's keys into N parts merged by their log-sum-exp
    /// (Flash-Decoding); 0, the default, lets the library's heuristic choose.
    #[arg(long, value_name = "N")]
    num_splits: Option<usize>,
}

/// Parses `A,B`.
pub fn parse_pair<T: std::str::FromStr>(s: &str) -> std::result::Result<(T, T), String>
where
    T::Err: std::fmt::Display,
{
    let (a, b) = s.split_once(',').ok_or_else(|| format!("expected two values `A,B`, got `{s}`"))?;
    let parse = |x: &str| x.trim().parse::<T>().map_err(|e| format!("`{}`: {e}", x.trim()));
    Ok((parse(a)?, parse(b)?))
}

/// Runs `flash-attn run`.
pub fn main(args: &RunArgs) -> Result<ExitCode> {
    args.device.ensure_available()?;
    let dropout = dropout_setting(args)?;
    if args.backward && args.dtype == Some(InputDType::Fp8E4m3) {
        return Err(no_fp8_backward());
    }
    let _spinner = Progress::spinner(if args.backward { "attention forward + backward" } else { "attention" });
    let bytes = safetensors_io::read_file(&args.input)?;
    let input = Input::parse(&bytes, &args.input)?;
    let outputs = if is_kvcache(&input)? {
        kvcache_flags(args, dropout)?;
        kvcache_attend(args, &input)?
    } else {
        attention_flags(args)?;
        attend(args, dropout, &input)?
    };
    safetensors_io::write_atomically(&args.output, &outputs)?;
    Ok(ExitCode::SUCCESS)
}

/// The dropout of `--dropout`, `--seed` and `--offset`, checked before any file is read.
///
/// The seed is required for `P > 0` rather than defaulted: a mask that silently repeats across
/// runs is rarely what a training step wants, and a caller that runs the backward pass later must
/// pass the same seed and offset to regenerate the same mask.
fn dropout_setting(args: &RunArgs) -> Result<Option<Dropout>> {
    let Some(p) = args.dropout else {
        return match (args.seed, args.offset) {
            (None, None) => Ok(None),
            (Some(_), _) => Err(CliError::new("`--seed` keys the dropout mask; it needs `--dropout P`")),
            (None, Some(_)) => Err(CliError::new("`--offset` offsets the dropout mask; it needs `--dropout P`")),
        };
    };
    // The library checks this too, but only once the inputs are read; a bad flag should not wait
    // for a large file.
    if !(p.is_finite() && (0.0..1.0).contains(&p)) {
        return Err(flash_attn::Error::Dropout(p).into());
    }
    let offset = args.offset.unwrap_or(0);
    match args.seed {
        Some(seed) => Ok(Some(Dropout { p, seed, offset })),
        None if p == 0.0 => Ok(Some(Dropout { p, seed: 0, offset })),
        None => Err(CliError::new(format!("`--dropout {p}` needs `--seed N`, the key of the dropout mask"))),
    }
}

/// The element type of the tensors `required` (which the file must have) and `optional` (where
/// present), which must agree; `group` names them all for the message.
fn input_dtype(input: &Input<'_>, required: &[&str], optional: &[&str], group: &str) -> Result<InputDType> {
    let mut first: Option<(Dtype, InputDType)> = None;
    for &name in required.iter().chain(optional) {
        let view = if required.contains(&name) {
            input.require(name)?
        } else if let Some(view) = input.get(name)? {
            view
        } else {
            continue;
        };
        let this = view.dtype();
        let Some(element) = element_type(this) else {
            return Err(CliError::new(format!("`{name}` has dtype {this:?}; expected F32, F16, BF16 or F8_E4M3")));
        };
        match first {
            None => first = Some((this, element)),
            Some((q, _)) if q != this => {
                return Err(CliError::new(format!(
                    "`{name}` is {this:?} but `q` is {q:?}; {group} must share one dtype"
                )))
            }
            Some(_) => {}
        }
    }
    first.map(|(_, element)| element).ok_or_else(|| CliError::new("no input tensors"))
}

/// The element type attention takes for a safetensors dtype, if any.
fn element_type(dtype: Dtype) -> Option<InputDType> {
    match dtype {
        Dtype::F32 => Some(InputDType::Float(DType::F32)),
        Dtype::F16 => Some(InputDType::Float(DType::F16)),
        Dtype::BF16 => Some(InputDType::Float(DType::BF16)),
        Dtype::F8_E4M3 => Some(InputDType::Fp8E4m3),
        _ => None,
    }
}

/// The dtype to run in: `--dtype` where given, else that of the inputs (`file`). The only
/// conversion is quantizing float inputs to FP8.
fn run_dtype(args: &RunArgs, file: InputDType) -> Result<InputDType> {
    match (args.dtype, file) {
        (None, file) => Ok(file),
        (Some(asked), file) if asked == file => Ok(file),
        (Some(InputDType::Fp8E4m3), InputDType::Float(_)) => Ok(InputDType::Fp8E4m3),
        (Some(asked), InputDType::Fp8E4m3) => Err(CliError::new(format!(
            "`q`, `k` and `v` are F8_E4M3 but `--dtype {asked}` was given; `run` does not dequantize \
             (drop `--dtype`, or give `fp8e4m3`)"
        ))),
        (Some(asked), InputDType::Float(file)) => Err(CliError::new(format!(
            "`q`, `k` and `v` are {} but `--dtype {asked}` was given; `run` converts only to fp8e4m3 \
             (per-tensor quantization), so a float `--dtype` must match the inputs",
            file.name().to_uppercase()
        ))),
    }
}

fn attend(args: &RunArgs, dropout: Option<Dropout>, input: &Input<'_>) -> Result<Vec<(&'static str, OwnedTensor)>> {
    let file = input_dtype(input, &["q", "k", "v"], &[], "q, k and v")?;
    if let InputDType::Float(dtype) = file {
        if let Some(name) = first_present(input, &DESCALE_TENSORS)? {
            return Err(CliError::new(format!(
                "`{name}` is a descale factor of F8_E4M3 inputs, but `q`, `k` and `v` are {}{}",
                dtype.name().to_uppercase(),
                if args.dtype == Some(InputDType::Fp8E4m3) {
                    " (`--dtype fp8e4m3` computes their factors when it quantizes them)"
                } else {
                    ""
                }
            )));
        }
    }
    match run_dtype(args, file)? {
        InputDType::Float(DType::F32) => attend_typed::<f32>(args, dropout, input),
        InputDType::Float(DType::F16) => attend_typed::<f16>(args, dropout, input),
        InputDType::Float(DType::BF16) => attend_typed::<bf16>(args, dropout, input),
        InputDType::Fp8E4m3 => attend_fp8(args, dropout, input, file),
    }
}

/// A decoded tensor and its shape.
struct Owned<T> {
    data: Vec<T>,
    shape: Vec<usize>,
}

impl<T> Owned<T> {
    fn view(&self) -> Tensor<'_, T> {
        Tensor::new(&self.data, &self.shape)
    }
}

/// The optional tensors of the file, decoded.
struct Extras {
    /// `cu_seqlens_q`, `cu_seqlens_k`.
    cu_seqlens: Option<(Vec<i32>, Vec<i32>)>,
    alibi: Option<Owned<f32>>,
    /// The mask and its block size `(BQ, BK)`.
    block_mask: Option<(Owned<u8>, (usize, usize))>,
}

fn read_extras(args: &RunArgs, input: &Input<'_>) -> Result<Extras> {
    let cu = |name: &str| index_vector(input, name, "[b + 1]");
    let cu_seqlens = match (cu("cu_seqlens_q")?, cu("cu_seqlens_k")?) {
        (Some(q), Some(k)) => Some((q, k)),
        (None, None) => None,
        (Some(_), None) => {
            return Err(CliError::new("`cu_seqlens_q` is present but `cu_seqlens_k` is not; varlen needs both"))
        }
        (None, Some(_)) => {
            return Err(CliError::new("`cu_seqlens_k` is present but `cu_seqlens_q` is not; varlen needs both"))
        }
    };

    let alibi = optional_tensor::<f32>(input, "alibi_slopes")?;

    let block_mask = match (input.get("block_mask")?, args.block_size) {
        (None, None) => None,
        (Some(_), None) => {
            return Err(CliError::new("the input has a `block_mask`; give its block size with `--block-size BQ,BK`"))
        }
        (None, Some(_)) => return Err(CliError::new("`--block-size` needs a `block_mask` tensor in the input")),
        (Some(t), Some(size)) => {
            let mask = match t.dtype() {
                Dtype::U8 | Dtype::BOOL => safetensors_io::decode_bytes::<u8>("block_mask", &t)?,
                other => return Err(CliError::new(format!("`block_mask` must be U8 or BOOL, got {other:?}"))),
            };
            Some((Owned { data: mask, shape: t.shape().to_vec() }, size))
        }
    };
    Ok(Extras { cu_seqlens, alibi, block_mask })
}

/// The I32 vector `name` (`layout` names its one dimension for the message), if the file has it.
fn index_vector(input: &Input<'_>, name: &str, layout: &str) -> Result<Option<Vec<i32>>> {
    let Some(t) = input.get(name)? else { return Ok(None) };
    if t.shape().len() != 1 {
        return Err(CliError::new(format!("`{name}` must have 1 dimension ({layout}), got shape {:?}", t.shape())));
    }
    safetensors_io::decode::<i32>(name, &t).map(Some)
}

/// The tensor `name` decoded as `T` (its dtype must be `T`'s), if the file has it.
fn optional_tensor<T: LeScalar>(input: &Input<'_>, name: &str) -> Result<Option<Owned<T>>> {
    let Some(t) = input.get(name)? else { return Ok(None) };
    Ok(Some(Owned { data: safetensors_io::decode::<T>(name, &t)?, shape: t.shape().to_vec() }))
}

/// The tensor `name` decoded as `T`, which the file must have.
fn required_tensor<T: LeScalar>(input: &Input<'_>, name: &str) -> Result<Owned<T>> {
    let t = input.require(name)?;
    Ok(Owned { data: safetensors_io::decode::<T>(name, &t)?, shape: t.shape().to_vec() })
}

/// The spec the flags and the file's optional tensors describe.
fn spec<'a>(args: &RunArgs, extras: &'a Extras, dropout: Option<Dropout>) -> AttentionSpec<'a> {
    let mut spec = AttentionSpec::new();
    if args.causal {
        spec = spec.causal();
    }
    if args.causal_top_left {
        spec = spec.causal_top_left();
    }
    if let Some((left, right)) = args.window {
        spec = spec.window(left, right);
    }
    if let Some(c) = args.softcap {
        spec = spec.softcap(c);
    }
    if let Some(s) = args.scale {
        spec = spec.scale(s);
    }
    if let Some(slopes) = &extras.alibi {
        spec = spec.alibi_slopes(slopes.view());
    }
    if let Some((mask, (bq, bk))) = &extras.block_mask {
        spec = spec.block_mask(mask.view(), *bq, *bk);
    }
    if let Some((cq, ck)) = &extras.cu_seqlens {
        spec = spec.varlen(cq, ck);
    }
    if let Some(d) = dropout {
        spec = spec.dropout(d.p, d.seed, d.offset);
    }
    spec
}

/// `dout` of the file for `--backward`: present, and in the dtype of `q`.
fn read_dout<T: LeScalar>(args: &RunArgs, input: &Input<'_>) -> Result<Owned<T>> {
    let Some(view) = input.get("dout")? else {
        return Err(CliError::new(format!(
            "`--backward` needs the gradient of the output: `{}` has no tensor `dout` (dtype of `q`, shape of `out`)",
            args.input.display()
        )));
    };
    if view.dtype() != T::DTYPE {
        return Err(CliError::new(format!(
            "`dout` is {:?} but `q` is {:?}; `dout` must have the dtype of `q`",
            view.dtype(),
            T::DTYPE
        )));
    }
    Ok(Owned { data: safetensors_io::decode::<T>("dout", &view)?, shape: view.shape().to_vec() })
}

/// Forward (with dropout if asked) and, with `--backward`, the backward pass by recomputation,
/// into buffers allocated here so that running out of memory is an error, not an abort.
fn attend_typed<T: GpuElement + LeScalar>(
    args: &RunArgs,
    dropout: Option<Dropout>,
    input: &Input<'_>,
) -> Result<Vec<(&'static str, OwnedTensor)>> {
    let [q, k, v] = [required_tensor::<T>(input, "q")?, required_tensor(input, "k")?, required_tensor(input, "v")?];
    let extras = read_extras(args, input)?;
    let dout = if args.backward { Some(read_dout::<T>(args, input)?) } else { None };
    let spec = spec(args, &extras, dropout);

    let (q, k, v) = (q.view(), k.view(), v.view());
    let geometry = spec.geometry(&q, &k, &v)?;
    let out_shape = geometry.out_shape();
    let lse_shape = geometry.lse_shape();
    // Checked before the forward runs, so that a wrong `dout` costs no compute.
    if let Some(dout) = &dout {
        if dout.shape != out_shape {
            return Err(CliError::new(format!(
                "`dout` has shape {:?} but `out` has shape {out_shape:?}; `dout` must have the shape of `out`",
                dout.shape
            )));
        }
    }
    let (out, lse) = match args.device {
        Device::Cpu => {
            let mut out = zeroed::<T>("out", &out_shape)?;
            let mut lse = zeroed::<f32>("lse", &lse_shape)?;
            flash_attn::forward_into(&spec, &q, &k, &v, &mut TensorMut::new(&mut out, &out_shape), &mut lse)?;
            (out, lse)
        }
        // Options the CUDA kernels do not support yet come back as the library's `Unsupported`.
        Device::Cuda => {
            let res = T::forward(&spec, &q, &k, &v)?;
            (res.out, res.lse)
        }
    };
    let mut outputs =
        vec![("out", OwnedTensor::encode(&out, &out_shape)), ("lse", OwnedTensor::encode(&lse, &lse_shape))];

    if let Some(dout) = &dout {
        // The gradients have the shapes of the (contiguous) inputs.
        let (dq, dk, dv) = match args.device {
            Device::Cpu => {
                let mut dq = zeroed::<T>("dq", q.shape())?;
                let mut dk = zeroed::<T>("dk", k.shape())?;
                let mut dv = zeroed::<T>("dv", v.shape())?;
                flash_attn::backward_into(
                    &spec,
                    &q,
                    &k,
                    &v,
                    &Tensor::new(&out, &out_shape),
                    &lse,
                    &dout.view(),
                    &mut TensorMut::new(&mut dq, q.shape()),
                    &mut TensorMut::new(&mut dk, k.shape()),
                    &mut TensorMut::new(&mut dv, v.shape()),
                )?;
                (dq, dk, dv)
            }
            Device::Cuda => {
                let g = T::backward(&spec, &q, &k, &v, &Tensor::new(&out, &out_shape), &lse, &dout.view())?;
                (g.dq, g.dk, g.dv)
            }
        };
        outputs.extend([
            ("dq", OwnedTensor::encode(&dq, q.shape())),
            ("dk", OwnedTensor::encode(&dk, k.shape())),
            ("dv", OwnedTensor::encode(&dv, v.shape())),
        ]);
    }
    Ok(outputs)
}

// ---------------------------------------------------------------------------------------------
// FP8 inputs (docs/semantics.md, "FP8 inputs")
// ---------------------------------------------------------------------------------------------

/// The optional descale factors of F8_E4M3 `q`, `k`, `v` (FlashAttention-3's `descale_q/k/v`):
/// F32, one element each, 1 when absent.
const DESCALE_TENSORS: [&str; 3] = ["q_descale", "k_descale", "v_descale"];

/// The error of `--backward` with FP8 inputs.
fn no_fp8_backward() -> CliError {
    CliError::new("`--backward` with FP8 (e4m3) inputs: there is no FP8 backward pass; FP8 runs forward only")
}

/// The first of `names` that the file has.
fn first_present<'n>(input: &Input<'_>, names: &[&'n str]) -> Result<Option<&'n str>> {
    for &name in names {
        if input.get(name)?.is_some() {
            return Ok(Some(name));
        }
    }
    Ok(None)
}

/// The descale factor `name` of the file: an F32 tensor of one element (any shape: `[]`, `[1]`,
/// FlashAttention-3's `[1, 1]`), 1 when absent. The library checks that it is positive and finite.
fn descale(input: &Input<'_>, name: &str) -> Result<f32> {
    let Some(t) = input.get(name)? else { return Ok(1.0) };
    match safetensors_io::decode::<f32>(name, &t)?[..] {
        [x] => Ok(x),
        _ => Err(CliError::new(format!(
            "`{name}` must hold one F32 value (a per-tensor descale factor), got shape {:?}",
            t.shape()
        ))),
    }
}

/// `q`, `k`, `v` of the file in FP8 and their descale factors: F8_E4M3 tensors as they are, with
/// the file's [`DESCALE_TENSORS`]; F32, F16 or BF16 tensors quantized per tensor.
fn fp8_inputs(input: &Input<'_>, file: InputDType) -> Result<([Owned<Fp8E4m3>; 3], Fp8Scales)> {
    match file {
        InputDType::Fp8E4m3 => {
            let [q, k, v] = ["q", "k", "v"].map(|name| required_tensor::<Fp8E4m3>(input, name));
            let [dq, dk, dv] = DESCALE_TENSORS.map(|name| descale(input, name));
            Ok(([q?, k?, v?], Fp8Scales { q: dq?, k: dk?, v: dv? }))
        }
        InputDType::Float(DType::F32) => quantized::<f32>(input),
        InputDType::Float(DType::F16) => quantized::<f16>(input),
        InputDType::Float(DType::BF16) => quantized::<bf16>(input),
    }
}

/// `q`, `k`, `v` of dtype `T` quantized per tensor with `flash_attn::fp8::quantize`.
fn quantized<T: Element + LeScalar>(input: &Input<'_>) -> Result<([Owned<Fp8E4m3>; 3], Fp8Scales)> {
    let one = |name: &str| -> Result<(Owned<Fp8E4m3>, f32)> {
        let t = required_tensor::<T>(input, name)?;
        let mut wide = zeroed::<f32>(name, &t.shape)?;
        wide.iter_mut().zip(&t.data).for_each(|(w, x)| *w = x.to_f32());
        let (data, scale) = fp8::quantize(&wide);
        Ok((Owned { data, shape: t.shape }, scale))
    };
    let [(q, dq), (k, dk), (v, dv)] = [one("q")?, one("k")?, one("v")?];
    Ok(([q, k, v], Fp8Scales { q: dq, k: dk, v: dv }))
}

/// The FP8 forward (`flash_attn::forward_fp8`, on cuda the FP8 kernel) on the file's inputs, F8_E4M3
/// or quantized from `file`'s float type: `out` in BF16, `lse` in F32. Options the CUDA FP8 kernel
/// lacks come back as the library's `Unsupported`.
fn attend_fp8(
    args: &RunArgs,
    dropout: Option<Dropout>,
    input: &Input<'_>,
    file: InputDType,
) -> Result<Vec<(&'static str, OwnedTensor)>> {
    if args.backward {
        return Err(no_fp8_backward());
    }
    let ([q, k, v], scales) = fp8_inputs(input, file)?;
    let extras = read_extras(args, input)?;
    let spec = spec(args, &extras, dropout);
    let (q, k, v) = (q.view(), k.view(), v.view());
    let res = match args.device {
        Device::Cpu => flash_attn::forward_fp8(&spec, &q, &k, &v, scales)?,
        Device::Cuda => gpu::forward_fp8(&spec, &q, &k, &v, scales)??,
    };
    Ok(vec![
        ("out", OwnedTensor::encode(&res.out, &res.out_shape)),
        ("lse", OwnedTensor::encode(&res.lse, &res.lse_shape)),
    ])
}

// ---------------------------------------------------------------------------------------------
// KV-cache mode (DESIGN §6)
// ---------------------------------------------------------------------------------------------

/// The tensors whose presence selects KV-cache mode; it needs all of them.
const KV_CACHE_TENSORS: [&str; 3] = ["k_cache", "v_cache", "cache_seqlens"];

/// Tensors of the KV-cache element type besides `q`, where present.
const KV_OPTIONAL_ELEMENTS: [&str; 4] = ["k", "v", "rotary_cos", "rotary_sin"];

/// Whether the file asks for KV-cache mode: all of [`KV_CACHE_TENSORS`], or none of them for
/// normal mode; some but not all is an error rather than a silent fall back to normal mode.
fn is_kvcache(input: &Input<'_>) -> Result<bool> {
    let mut missing = Vec::new();
    for name in KV_CACHE_TENSORS {
        if input.get(name)?.is_none() {
            missing.push(format!("`{name}`"));
        }
    }
    match missing.len() {
        0 => Ok(true),
        n if n == KV_CACHE_TENSORS.len() => Ok(false),
        _ => Err(CliError::new(format!(
            "KV-cache mode needs `k_cache`, `v_cache` and `cache_seqlens`; the input lacks {}",
            missing.join(" and ")
        ))),
    }
}

/// Flags that only KV-cache mode reads are errors in normal mode, not silently ignored.
fn attention_flags(args: &RunArgs) -> Result<()> {
    let flag = if args.rotary_interleaved {
        "--rotary-interleaved"
    } else if args.num_splits.is_some() {
        "--num-splits"
    } else {
        return Ok(());
    };
    Err(CliError::new(format!(
        "`{flag}` applies to KV-cache mode only (an input with `k_cache`, `v_cache` and `cache_seqlens`)"
    )))
}

/// Flags of training and of normal mode's options that a KV-cache call does not take.
fn kvcache_flags(args: &RunArgs, dropout: Option<Dropout>) -> Result<()> {
    let (flag, why) = if args.backward {
        ("--backward", "a KV-cache call is an inference forward pass, with no gradients")
    } else if dropout.is_some() {
        ("--dropout", "a KV-cache call is an inference forward pass, with no dropout")
    } else if args.block_size.is_some() {
        ("--block-size", "a KV-cache call takes no block mask")
    } else {
        return Ok(());
    };
    Err(CliError::new(format!(
        "`{flag}` is not available in KV-cache mode (the input holds `k_cache`, `v_cache` and `cache_seqlens`): {why}"
    )))
}

/// KV-cache mode: rejects the tensors of normal mode's options, then dispatches on the dtype.
fn kvcache_attend(args: &RunArgs, input: &Input<'_>) -> Result<Vec<(&'static str, OwnedTensor)>> {
    let unsupported = [
        ("block_mask", "a KV-cache call takes no block mask"),
        ("cu_seqlens_q", "lengths come from `cache_seqlens`"),
        ("cu_seqlens_k", "lengths come from `cache_seqlens`"),
        ("q_descale", "FP8 inputs are not available there"),
        ("k_descale", "FP8 inputs are not available there"),
        ("v_descale", "FP8 inputs are not available there"),
    ];
    for (name, why) in unsupported {
        if input.get(name)?.is_some() {
            return Err(CliError::new(format!(
                "`{name}` is not available in KV-cache mode (the input holds `k_cache`, `v_cache` and \
                 `cache_seqlens`): {why}"
            )));
        }
    }
    let group = "q, k_cache, v_cache, k, v, rotary_cos and rotary_sin";
    let file = input_dtype(input, &["q", "k_cache", "v_cache"], &KV_OPTIONAL_ELEMENTS, group)?;
    let InputDType::Float(dtype) = run_dtype(args, file)? else {
        return Err(CliError::new(
            "FP8 (e4m3) is not available in KV-cache mode (the input holds `k_cache`, `v_cache` and \
             `cache_seqlens`): the cache and `q` must be F32, F16 or BF16",
        ));
    };
    match dtype {
        DType::F32 => kvcache_typed::<f32>(args, input),
        DType::F16 => kvcache_typed::<f16>(args, input),
        DType::BF16 => kvcache_typed::<bf16>(args, input),
    }
}

/// Two tensors that come together (`k` and `v`, `rotary_cos` and `rotary_sin`): both or neither.
fn pair<T: LeScalar>(input: &Input<'_>, [a, b]: [&str; 2], what: &str) -> Result<Option<(Owned<T>, Owned<T>)>> {
    match (optional_tensor::<T>(input, a)?, optional_tensor::<T>(input, b)?) {
        (Some(x), Some(y)) => Ok(Some((x, y))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(CliError::new(format!("`{a}` is present but `{b}` is not; {what} needs both"))),
        (None, Some(_)) => Err(CliError::new(format!("`{b}` is present but `{a}` is not; {what} needs both"))),
    }
}

/// Appends the new tokens (if any) to the file's cache and attends; the outputs are `out`, `lse`
/// and the updated cache. Every check on the cache's indices is the library's, made before it
/// writes anything.
fn kvcache_typed<T: GpuElement + LeScalar>(
    args: &RunArgs,
    input: &Input<'_>,
) -> Result<Vec<(&'static str, OwnedTensor)>> {
    let q = required_tensor::<T>(input, "q")?;
    let mut k_cache = required_tensor::<T>(input, "k_cache")?;
    let mut v_cache = required_tensor::<T>(input, "v_cache")?;
    let seqlens = index_vector(input, "cache_seqlens", "[b]")?
        .ok_or_else(|| CliError::new("KV-cache mode needs `cache_seqlens` (I32 [b])"))?;
    let batch_idx = index_vector(input, "cache_batch_idx", "[b]")?;
    let leftpad = index_vector(input, "cache_leftpad", "[b]")?;
    let block_table = optional_tensor::<i32>(input, "block_table")?;
    let new_kv = pair::<T>(input, ["k", "v"], "appending new tokens")?;
    let rotary = pair::<T>(input, ["rotary_cos", "rotary_sin"], "rotary embedding")?;
    if args.rotary_interleaved && rotary.is_none() {
        return Err(CliError::new(
            "`--rotary-interleaved` needs the rotary tables `rotary_cos` and `rotary_sin` in the input",
        ));
    }
    let extras = Extras { cu_seqlens: None, alibi: optional_tensor::<f32>(input, "alibi_slopes")?, block_mask: None };
    let spec = spec(args, &extras, None);

    let mut cache = KvCache::new(&seqlens).num_splits(args.num_splits.unwrap_or(0));
    if let Some(idx) = &batch_idx {
        cache = cache.batch_idx(idx);
    }
    if let Some(lp) = &leftpad {
        cache = cache.leftpad(lp);
    }
    if let Some(table) = &block_table {
        cache = cache.paged(table.view());
    }
    if let Some((k, v)) = &new_kv {
        cache = cache.append(k.view(), v.view());
    }
    if let Some((cos, sin)) = &rotary {
        cache = cache.rotary(cos.view(), sin.view(), args.rotary_interleaved);
    }

    let q_view = q.view();
    let mut k_view = TensorMut::new(&mut k_cache.data, &k_cache.shape);
    let mut v_view = TensorMut::new(&mut v_cache.data, &v_cache.shape);
    let res = match args.device {
        Device::Cpu => kvcache::forward(&spec, &q_view, &mut k_view, &mut v_view, &cache)?,
        Device::Cuda => kvcache_cuda(&spec, &q_view, &mut k_view, &mut v_view, &cache)?,
    };
    Ok(vec![
        ("out", OwnedTensor::encode(&res.out, &res.out_shape)),
        ("lse", OwnedTensor::encode(&res.lse, &res.lse_shape)),
        ("k_cache", OwnedTensor::encode(&k_cache.data, &k_cache.shape)),
        ("v_cache", OwnedTensor::encode(&v_cache.data, &v_cache.shape)),
    ])
}

/// A KV-cache call on GPU 0, with [`kvcache::forward`]'s contract (the caches updated in place):
/// `flash_attn::cuda::decode::forward_host` in cuda builds (f16/bf16).
fn kvcache_cuda<T: GpuElement>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k_cache: &mut TensorMut<'_, T>,
    v_cache: &mut TensorMut<'_, T>,
    cache: &KvCache<'_, T>,
) -> Result<Output<T>> {
    T::kvcache(spec, q, k_cache, v_cache, cache)
}

/// A zeroed buffer for a tensor of `shape`, or an error (not an abort) if it cannot be had.
pub fn zeroed<T: Default + Clone>(name: &str, shape: &[usize]) -> Result<Vec<T>> {
    let too_big = || CliError::new(format!("cannot allocate `{name}` of shape {shape:?}: out of memory"));
    let n = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(too_big)?;
    let mut buf = Vec::new();
    buf.try_reserve_exact(n).map_err(|_| too_big())?;
    buf.resize(n, T::default());
    Ok(buf)
}
