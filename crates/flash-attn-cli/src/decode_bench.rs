//! `flash-attn bench --decode`: attention over a KV cache at decode shapes (DESIGN §6).
//!
//! The cache holds `SK` tokens of every sequence (`cache_seqlens = SK`, nothing appended), `SQ`
//! query tokens attend to it (causal, bottom-right), and the bandwidth is the bytes of the cached
//! keys and values, `b · SK · hk · 2d · size(dtype)`, over the median time of a call. With
//! `--page-size P` the cache is paged, its pages handed out in a shuffled order (as an allocator
//! that has run for a while does). On the CPU the same run measures the machine's read bandwidth
//! (all threads summing a buffer far larger than the caches), the ceiling to read `gbps` against.

use std::process::ExitCode;
use std::time::Instant;

use flash_attn::check::Rng;
use flash_attn::kvcache::{self, KvCache};
use flash_attn::{AttentionSpec, DType, Element, Tensor, TensorMut};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::bench::{json_number, Shape};
use crate::run::zeroed;
use crate::{CliError, Device, Result};

/// Bytes the read-bandwidth probe sums (well past any last-level cache).
const PROBE_BYTES: usize = 1 << 30;

/// One decode measurement.
#[derive(Debug, Clone, Copy)]
pub struct DecodeMeasurement {
    /// Median time of one call, ms.
    pub fwd_ms: f64,
    /// Cached K + V bytes over `fwd_ms`, GB/s (10⁹ bytes).
    pub gbps: f64,
    /// Timed calls behind the median.
    pub runs: usize,
    /// The split count the call used (0: chosen by the heuristic).
    pub num_splits: usize,
}

/// Cached K + V bytes of a problem.
pub fn kv_bytes(s: Shape, dtype: DType) -> f64 {
    (s.b * s.sk * s.hk * 2 * s.d * dtype.size()) as f64
}

/// Runs `bench --decode`.
pub fn main(
    device: Device,
    dtype: DType,
    shape: Shape,
    page_size: Option<usize>,
    num_splits: usize,
    json: bool,
) -> Result<ExitCode> {
    if page_size == Some(0) {
        return Err(CliError::new("--page-size must be at least 1"));
    }
    let gpu_name = device.ensure_available()?;
    let m = match (device, dtype) {
        (Device::Cpu, DType::F32) => measure_cpu::<f32>(shape, page_size, num_splits)?,
        (Device::Cpu, DType::F16) => measure_cpu::<f16>(shape, page_size, num_splits)?,
        (Device::Cpu, DType::BF16) => measure_cpu::<bf16>(shape, page_size, num_splits)?,
        (Device::Cuda, _) => crate::gpu::decode(dtype, shape, page_size, num_splits)?,
    };
    let mem = (device == Device::Cpu).then(read_bandwidth_gbps);
    let s = shape;
    if json {
        println!(
            "{{\"device\":\"{}\",\"dtype\":\"{}\",\"mode\":\"decode\",\"b\":{},\"hq\":{},\"hk\":{},\"sq\":{},\
             \"sk\":{},\"d\":{},\"page_size\":{},\"num_splits\":{},\"fwd_ms\":{},\"gbps\":{},\"runs\":{},\
             \"mem_gbps\":{}}}",
            device.name(),
            dtype.name(),
            s.b,
            s.hq,
            s.hk,
            s.sq,
            s.sk,
            s.d,
            page_size.map_or_else(|| "null".to_owned(), |p| p.to_string()),
            m.num_splits,
            json_number(m.fwd_ms),
            json_number(m.gbps),
            m.runs,
            mem.map_or_else(|| "null".to_owned(), json_number)
        );
    } else {
        let layout =
            page_size.map_or_else(|| "contiguous cache".to_owned(), |p| format!("paged cache, {p} tokens a page"));
        let on = gpu_name.unwrap_or_else(|| format!("{} threads", rayon::current_num_threads()));
        println!(
            "decode, {} {}, {layout}, on {on}: b {} hq {} hk {} sq {} sk {} d {}",
            device.name(),
            dtype,
            s.b,
            s.hq,
            s.hk,
            s.sq,
            s.sk,
            s.d
        );
        println!(
            "fwd_ms {:.4}  gbps {:.1}  (median of {} runs, K+V bytes of the cached tokens / time)",
            m.fwd_ms, m.gbps, m.runs
        );
        if let Some(g) = mem {
            println!("machine read bandwidth (all threads summing {} MiB): {g:.1} GB/s", PROBE_BYTES >> 20);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The inputs of a decode problem: `q`, the caches, `cache_seqlens` and the block table (paged).
pub struct DecodeInputs<T> {
    /// `[b, sq, hq, d]`.
    pub q: Vec<T>,
    /// The caches, `[b, sk, hk, d]` or `[pages, page_size, hk, d]`.
    pub k_cache: Vec<T>,
    /// Like `k_cache`.
    pub v_cache: Vec<T>,
    /// Shape of either cache.
    pub cache_shape: [usize; 4],
    /// `sk` for every sequence.
    pub seqlens: Vec<i32>,
    /// `[b, sk / page_size]`, a shuffled assignment of pages.
    pub block_table: Option<(Vec<i32>, [usize; 2])>,
}

/// Random inputs of `s` (seeded).
pub fn decode_inputs<T: Element>(s: Shape, page_size: Option<usize>) -> Result<DecodeInputs<T>> {
    let mut rng = Rng::new(1);
    let sk = i32::try_from(s.sk).map_err(|_| CliError::new("--shape: SK must fit an i32"))?;
    let (cache_shape, block_table) = match page_size {
        None => ([s.b, s.sk, s.hk, s.d], None),
        Some(p) => {
            let per_seq = s.sk.div_ceil(p);
            let pages = s.b * per_seq;
            let mut table: Vec<i32> = (0..pages)
                .map(|x| i32::try_from(x).map_err(|_| CliError::new("too many pages for an i32 block table")))
                .collect::<Result<_>>()?;
            for i in (1..table.len()).rev() {
                table.swap(i, rng.range(0, i));
            }
            ([pages, p, s.hk, s.d], Some((table, [s.b, per_seq])))
        }
    };
    // Uniform in [-1, 1), filled in parallel from per-chunk seeds (caches reach gigabytes).
    let random = |name: &str, shape: &[usize], seed: u64| -> Result<Vec<T>> {
        let mut buf = zeroed::<T>(name, shape)?;
        buf.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
            let mut r = Rng::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i as u64);
            c.iter_mut().for_each(|x| *x = T::from_f64(2.0 * r.uniform() - 1.0));
        });
        Ok(buf)
    };
    Ok(DecodeInputs {
        q: random("q", &[s.b, s.sq, s.hq, s.d], 2)?,
        k_cache: random("k_cache", &cache_shape, 3)?,
        v_cache: random("v_cache", &cache_shape, 4)?,
        cache_shape,
        seqlens: vec![sk; s.b],
        block_table,
    })
}

fn measure_cpu<T: Element>(s: Shape, page_size: Option<usize>, num_splits: usize) -> Result<DecodeMeasurement> {
    let mut inp = decode_inputs::<T>(s, page_size)?;
    let spec = AttentionSpec::new().causal();
    let mut cache = KvCache::new(&inp.seqlens).num_splits(num_splits);
    if let Some((table, shape)) = &inp.block_table {
        cache = cache.paged(Tensor::new(table, shape));
    }
    let q = Tensor::new(&inp.q, &[s.b, s.sq, s.hq, s.d]);
    let mut out = zeroed::<T>("out", &[s.b, s.sq, s.hq, s.d])?;
    let mut lse = zeroed::<f32>("lse", &[s.b, s.hq, s.sq])?;
    let shape = inp.cache_shape;
    let mut call = || -> Result<()> {
        kvcache::forward_into(
            &spec,
            &q,
            &mut TensorMut::new(&mut inp.k_cache, &shape),
            &mut TensorMut::new(&mut inp.v_cache, &shape),
            &cache,
            &mut TensorMut::new(&mut out, &[s.b, s.sq, s.hq, s.d]),
            &mut lse,
        )?;
        Ok(())
    };
    call()?;
    let (fwd_ms, runs) = crate::bench::time_calls(crate::bench::MIN_RUNS, call)?;
    Ok(DecodeMeasurement { fwd_ms, gbps: kv_bytes(s, T::DTYPE) / (fwd_ms * 1e6), runs, num_splits })
}

/// The machine's read bandwidth in GB/s: the best of a few passes of every thread summing its
/// share of a [`PROBE_BYTES`] buffer.
pub fn read_bandwidth_gbps() -> f64 {
    let words = PROBE_BYTES / 8;
    let mut buf: Vec<u64> = Vec::new();
    if buf.try_reserve_exact(words).is_err() {
        return f64::NAN;
    }
    buf.resize(words, 0);
    buf.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| c.iter_mut().for_each(|x| *x = i as u64));
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        let sum: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| {
                c.chunks_exact(8).fold([0u64; 8], |mut acc, w| {
                    for (a, &x) in acc.iter_mut().zip(w) {
                        *a = a.wrapping_add(x);
                    }
                    acc
                })
            })
            .map(|acc| acc.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(sum);
        best = best.min(t.elapsed().as_secs_f64());
    }
    PROBE_BYTES as f64 / best / 1e9
}
