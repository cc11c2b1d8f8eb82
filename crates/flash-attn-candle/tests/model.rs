//! A real model: a tiny randomly initialised Llama (RMSNorm, rotary embeddings, grouped-query
//! attention, SwiGLU; candle-nn layers) run with this crate's op and with candle's own eager
//! attention from the same weights: logits compared, then a few training steps with candle's
//! autograd and SGD, losses and gradients compared.
//!
//! candle-transformers' Llama cannot serve here on the CPU: its `flash-attn` feature (the only
//! way it calls a flash-attention function) turns on candle's `cuda` feature, which needs nvcc.
//! This model's attention call site is the same as candle-transformers' flash path
//! (`flash_attn(q, k, v, 1/sqrt(d), causal)` on `[b, s, h, d]`).

use candle::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{Optimizer, VarBuilder, VarMap};
#[derive(Debug, Clone, Copy)]
struct Config {
    vocab: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    layers: usize,
    mlp: usize,
}

const CFG: Config = Config { vocab: 96, hidden: 64, heads: 4, kv_heads: 2, layers: 2, mlp: 128 };

/// RMSNorm from differentiable tensor ops (candle-nn's fused one has no backward for its
/// weight).
struct RmsNorm(Tensor);

impl RmsNorm {
    fn new(dim: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self(vb.get_with_hints(dim, "weight", candle_nn::Init::Const(1.0))?))
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rms = (x.sqr()?.mean_keepdim(D::Minus1)? + 1e-5)?.sqrt()?;
        x.broadcast_div(&rms)?.broadcast_mul(&self.0)
    }
}

/// Which attention a model runs.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Attn {
    Ours,
    Eager,
}

struct Layer {
    norm1: RmsNorm,
    q: candle_nn::Linear,
    k: candle_nn::Linear,
    v: candle_nn::Linear,
    o: candle_nn::Linear,
    norm2: RmsNorm,
    gate: candle_nn::Linear,
    up: candle_nn::Linear,
    down: candle_nn::Linear,
}

struct Llama {
    embed: candle_nn::Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    head: candle_nn::Linear,
    attn: Attn,
}

/// Rotary embedding (GPT-NeoX halves) of `x [b, h, s, d]` at positions `0..s`.
fn rotary(x: &Tensor) -> Result<Tensor> {
    let (_, _, s, d) = x.dims4()?;
    let inv: Vec<f32> = (0..d / 2).map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / d as f32)).collect();
    let inv = Tensor::from_vec(inv, (1, d / 2), x.device())?;
    let pos = Tensor::arange(0u32, s as u32, x.device())?.to_dtype(DType::F32)?.reshape((s, 1))?;
    let angles = pos.broadcast_mul(&inv)?;
    let (cos, sin) = (angles.cos()?.to_dtype(x.dtype())?, angles.sin()?.to_dtype(x.dtype())?);
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
    let r1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let r2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    Tensor::cat(&[r1, r2], D::Minus1)
}

impl Llama {
    fn new(vb: VarBuilder, attn: Attn) -> Result<Self> {
        let c = CFG;
        let hd = c.hidden / c.heads;
        let lin = |i, o, vb: VarBuilder| candle_nn::linear_no_bias(i, o, vb);
        let mut layers = Vec::new();
        for l in 0..c.layers {
            let vb = vb.pp(format!("layer{l}"));
            layers.push(Layer {
                norm1: RmsNorm::new(c.hidden, vb.pp("norm1"))?,
                q: lin(c.hidden, c.heads * hd, vb.pp("q"))?,
                k: lin(c.hidden, c.kv_heads * hd, vb.pp("k"))?,
                v: lin(c.hidden, c.kv_heads * hd, vb.pp("v"))?,
                o: lin(c.heads * hd, c.hidden, vb.pp("o"))?,
                norm2: RmsNorm::new(c.hidden, vb.pp("norm2"))?,
                gate: lin(c.hidden, c.mlp, vb.pp("gate"))?,
                up: lin(c.hidden, c.mlp, vb.pp("up"))?,
                down: lin(c.mlp, c.hidden, vb.pp("down"))?,
            });
        }
        Ok(Self {
            embed: candle_nn::embedding(c.vocab, c.hidden, vb.pp("embed"))?,
            layers,
            norm: RmsNorm::new(c.hidden, vb.pp("norm"))?,
            head: lin(c.hidden, c.vocab, vb.pp("head"))?,
            attn,
        })
    }

    fn attention(&self, l: &Layer, x: &Tensor) -> Result<Tensor> {
        let c = CFG;
        let (b, s, _) = x.dims3()?;
        let hd = c.hidden / c.heads;
        let split = |t: Tensor, h: usize| t.reshape((b, s, h, hd))?.transpose(1, 2);
        let q = rotary(&split(l.q.forward(x)?, c.heads)?)?;
        let k = rotary(&split(l.k.forward(x)?, c.kv_heads)?)?;
        let v = split(l.v.forward(x)?, c.kv_heads)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let y = match self.attn {
            // The call site candle-transformers' flash path has: [b, s, h, d] in and out.
            Attn::Ours => flash_attn_candle::flash_attn(
                &q.transpose(1, 2)?,
                &k.transpose(1, 2)?,
                &v.transpose(1, 2)?,
                scale,
                true,
            )?,
            Attn::Eager => {
                let rep = c.heads / c.kv_heads;
                let expand =
                    |t: &Tensor| t.unsqueeze(2)?.expand((b, c.kv_heads, rep, s, hd))?.reshape((b, c.heads, s, hd));
                let (k, v) = (expand(&k)?, expand(&v)?);
                let att = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? * f64::from(scale))?;
                let mask: Vec<f32> = (0..s * s).map(|i| if i % s > i / s { f32::NEG_INFINITY } else { 0.0 }).collect();
                let mask = Tensor::from_vec(mask, (s, s), x.device())?.to_dtype(att.dtype())?;
                let att = candle_nn::ops::softmax(&att.broadcast_add(&mask)?, D::Minus1)?;
                att.matmul(&v.contiguous()?)?.transpose(1, 2)?
            }
        };
        l.o.forward(&y.reshape((b, s, c.hidden))?)
    }

    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let mut x = self.embed.forward(ids)?;
        for l in &self.layers {
            x = (&x + self.attention(l, &l.norm1.forward(&x)?)?)?;
            let h = l.norm2.forward(&x)?;
            let mlp = l.down.forward(&(candle_nn::ops::silu(&l.gate.forward(&h)?)? * l.up.forward(&h)?)?)?;
            x = (x + mlp)?;
        }
        self.head.forward(&self.norm.forward(&x)?)
    }

    fn loss(&self, ids: &Tensor) -> Result<Tensor> {
        let logits = self.forward(ids)?.to_dtype(DType::F32)?;
        let (b, s, v) = logits.dims3()?;
        candle_nn::loss::cross_entropy(&logits.reshape((b * s, v))?, &ids.reshape(b * s)?)
    }
}

/// Two models with the same random weights: `(ours, eager, their variables)`.
fn twins() -> Result<(Llama, Llama, VarMap, VarMap)> {
    let dev = Device::Cpu;
    let (a, b) = (VarMap::new(), VarMap::new());
    let ours = Llama::new(VarBuilder::from_varmap(&a, DType::F32, &dev), Attn::Ours)?;
    let eager = Llama::new(VarBuilder::from_varmap(&b, DType::F32, &dev), Attn::Eager)?;
    let wa = a.data().lock().map_err(|_| candle::Error::Msg("poisoned".into()))?;
    let wb = b.data().lock().map_err(|_| candle::Error::Msg("poisoned".into()))?;
    for (name, var) in wa.iter() {
        let twin = wb.get(name).ok_or_else(|| candle::Error::Msg(format!("no twin for {name}")))?;
        twin.set(var.as_tensor())?;
    }
    drop((wa, wb));
    Ok((ours, eager, a, b))
}

fn batch(seed: u64) -> Result<Tensor> {
    batch_on(seed, &Device::Cpu)
}

fn batch_on(seed: u64, dev: &Device) -> Result<Tensor> {
    let mut rng = flash_attn::check::Rng::new(seed);
    let ids: Vec<u32> = (0..2 * 40).map(|_| rng.range(0, CFG.vocab - 1) as u32).collect();
    Tensor::from_vec(ids, (2, 40), dev)
}

/// A model on `dev` in `dtype` with the weights of `master` (cast).
#[cfg(feature = "cuda")]
fn copy_of(master: &VarMap, dev: &Device, dtype: DType, attn: Attn) -> Result<(Llama, VarMap)> {
    let map = VarMap::new();
    let model = Llama::new(VarBuilder::from_varmap(&map, dtype, dev), attn)?;
    let src = master.data().lock().map_err(|_| candle::Error::Msg("poisoned".into()))?;
    let dst = map.data().lock().map_err(|_| candle::Error::Msg("poisoned".into()))?;
    for (name, var) in src.iter() {
        let twin = dst.get(name).ok_or_else(|| candle::Error::Msg(format!("no twin for {name}")))?;
        twin.set(&var.as_tensor().to_device(dev)?.to_dtype(dtype)?)?;
    }
    drop((src, dst));
    Ok((model, map))
}

/// On the GPU in bf16 (the CUDA kernels' dtypes): ours and candle's eager attention in bf16 each
/// against the f32 CPU model; ours may be at most twice as far (plus a floor), for the logits and
/// for the losses of three SGD steps.
#[cfg(feature = "cuda")]
#[test]
fn cuda_tiny_llama_in_bf16_matches_eager_attention() -> Result<()> {
    let gpu = Device::new_cuda(0)?;
    let (_, reference, _, master) = twins()?;
    let (ours, ours_vars) = copy_of(&master, &gpu, DType::BF16, Attn::Ours)?;
    let (eager, eager_vars) = copy_of(&master, &gpu, DType::BF16, Attn::Eager)?;
    let ids = batch(1)?;
    let want = reference.forward(&ids)?;
    let on_cpu = |t: Tensor| t.to_dtype(DType::F32)?.to_device(&Device::Cpu);
    let a = on_cpu(ours.forward(&ids.to_device(&gpu)?)?)?;
    let b = on_cpu(eager.forward(&ids.to_device(&gpu)?)?)?;
    let ((ea, scale), (eb, _)) = (max_diff(&a, &want)?, max_diff(&b, &want)?);
    assert!(ea <= 2.0 * eb + 1e-2 * scale.max(1.0), "logits: ours {ea}, eager bf16 {eb} (scale {scale})");
    let mut opt_a = candle_nn::SGD::new(ours_vars.all_vars(), 0.5)?;
    let mut opt_b = candle_nn::SGD::new(eager_vars.all_vars(), 0.5)?;
    let mut opt_r = candle_nn::SGD::new(master.all_vars(), 0.5)?;
    for step in 0..3 {
        let ids = batch_on(20 + step, &Device::Cpu)?;
        let (la, lb, lr) =
            (ours.loss(&ids.to_device(&gpu)?)?, eager.loss(&ids.to_device(&gpu)?)?, reference.loss(&ids)?);
        let (x, y, r) = (la.to_scalar::<f32>()?, lb.to_scalar::<f32>()?, lr.to_scalar::<f32>()?);
        assert!(
            (x - r).abs() <= 2.0 * (y - r).abs() + 2e-2 * r.abs(),
            "step {step}: loss ours {x}, eager {y}, f32 {r}"
        );
        opt_a.backward_step(&la)?;
        opt_b.backward_step(&lb)?;
        opt_r.backward_step(&lr)?;
    }
    Ok(())
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<(f32, f32)> {
    let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    Ok((diff, b.abs()?.max_all()?.to_scalar::<f32>()?))
}

#[test]
fn tiny_llama_logits_match_eager_attention() -> Result<()> {
    let (ours, eager, _, _) = twins()?;
    let ids = batch(1)?;
    let (diff, scale) = max_diff(&ours.forward(&ids)?, &eager.forward(&ids)?)?;
    assert!(diff <= 1e-5 * scale.max(1.0), "logits differ by {diff} (scale {scale})");
    Ok(())
}

#[test]
fn tiny_llama_trains_like_eager_attention() -> Result<()> {
    let (ours, eager, va, vb) = twins()?;
    let mut opt_a = candle_nn::SGD::new(va.all_vars(), 0.5)?;
    let mut opt_b = candle_nn::SGD::new(vb.all_vars(), 0.5)?;
    let names: Vec<String> =
        va.data().lock().map_err(|_| candle::Error::Msg("poisoned".into()))?.keys().cloned().collect();
    let mut first_loss = None;
    for step in 0..4 {
        let ids = batch(10 + step)?;
        let (la, lb) = (ours.loss(&ids)?, eager.loss(&ids)?);
        let (a, b) = (la.to_scalar::<f32>()?, lb.to_scalar::<f32>()?);
        assert!((a - b).abs() <= 1e-5 * b.abs(), "step {step}: loss {a} vs {b}");
        first_loss.get_or_insert(b);
        let (ga, gb) = (la.backward()?, lb.backward()?);
        let (wa, wb) = (
            va.data().lock().map_err(|_| candle::Error::Msg("poisoned".into()))?,
            vb.data().lock().map_err(|_| candle::Error::Msg("poisoned".into()))?,
        );
        for name in &names {
            let (Some(x), Some(y)) = (wa.get(name), wb.get(name)) else { panic!("{name}: no variable") };
            let (Some(gx), Some(gy)) = (ga.get(x.as_tensor()), gb.get(y.as_tensor())) else {
                panic!(
                    "{name}: a gradient is missing (ours: {}, eager: {})",
                    ga.get(x.as_tensor()).is_some(),
                    gb.get(y.as_tensor()).is_some()
                );
            };
            let (diff, scale) = max_diff(gx, gy)?;
            assert!(diff <= 1e-3 * scale.max(1e-6), "step {step}, {name}: gradients differ by {diff} (scale {scale})");
        }
        drop((wa, wb));
        opt_a.step(&ga)?;
        opt_b.step(&gb)?;
    }
    // The steps did train: the same first batch scores better now.
    let again = ours.loss(&batch(10)?)?.to_scalar::<f32>()?;
    assert!(again < first_loss.unwrap_or(f32::MAX), "loss {again} did not fall from {first_loss:?}");
    Ok(())
}
