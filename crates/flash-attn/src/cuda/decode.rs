//! Attention over a KV cache on the GPU (DESIGN §6): `kernels/flash_decode.cuh` behind the
//! library's KV-cache semantics.
//!
//! A call is validated on the host exactly as the CPU's ([`crate::kvcache`]), so bad input is the
//! same typed error with nothing written. Then, on the device's stream: the new keys and values
//! (rotated when rotary is on) go into the cache (`flash_decode_append`), the queries are rotated
//! into a scratch buffer (`flash_decode_rotary_q`), and `flash_decode` attends with the key range
//! of every (sequence, kv head) cut into splits ([`splits_for`]) whose partial results
//! `flash_decode_combine` merges. [`DecodeRun`] keeps every buffer on the device, so a benchmark
//! times the launches alone.

use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};

use super::{driver_error, CudaElement, Device};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kvcache::{KvCache, KvProblem, Slots};
use crate::spec::{AttentionSpec, Causal};
use crate::tensor::{Tensor, TensorMut};
use crate::Output;

/// Packed query rows a block takes at most, one m16 tile of the tensor cores (more rows go to
/// more blocks).
pub const MAX_ROWS_PER_BLOCK: usize = 16;

/// Keys a split holds at least (below it the merge costs more than the parallelism buys).
pub const MIN_KEYS_PER_SPLIT: usize = 128;

/// Largest number of splits the heuristic picks.
pub const MAX_SPLITS: usize = 128;

/// The split count for `units` blocks without splitting (sequences × kv heads × row groups) on a
/// device of `sms` multiprocessors that hold `resident` decode blocks each at once, `max_sk` keys
/// in the longest sequence: one full wave of resident blocks (a second, partial wave would leave
/// most of the device idle while it runs; measured on the H100 at b = 1, 32k keys: 32 splits
/// 1948 GB/s where 66 gave 1358), no split shorter than [`MIN_KEYS_PER_SPLIT`] keys, at most
/// [`MAX_SPLITS`].
pub fn splits_for(units: usize, sms: usize, resident: usize, max_sk: usize) -> usize {
    let wanted = (sms * resident.max(1)) / units.max(1);
    let by_length = (max_sk / MIN_KEYS_PER_SPLIT).max(1);
    wanted.min(by_length).clamp(1, MAX_SPLITS)
}

/// Field for field `DecodeParams` in `kernels/flash_decode.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct DecodeParams {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    part_o: u64,
    part_lse: u64,
    sk: u64,
    start: u64,
    cache_row: u64,
    block_table: u64,
    alibi: u64,
    bt_batch: i64,
    q_batch: i64,
    q_row: i64,
    q_head: i64,
    k_page: i64,
    k_row: i64,
    k_head: i64,
    v_page: i64,
    v_row: i64,
    v_head: i64,
    o_batch: i64,
    o_row: i64,
    o_head: i64,
    page_size: i32,
    page_shift: i32,
    batch: i32,
    hq: i32,
    hk: i32,
    group: i32,
    sq: i32,
    d: i32,
    m: i32,
    splits: i32,
    row_groups: i32,
    causal: i32,
    window_left: i32,
    window_right: i32,
    scale: f32,
    scale_log2: f32,
    softcap: f32,
}

/// Field for field `AppendParams` in `kernels/flash_decode.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct AppendParams {
    k_new: u64,
    v_new: u64,
    k: u64,
    v: u64,
    q: u64,
    q_rot: u64,
    cos: u64,
    sin: u64,
    seqlens: u64,
    cache_row: u64,
    block_table: u64,
    bt_batch: i64,
    kn_batch: i64,
    kn_row: i64,
    kn_head: i64,
    vn_batch: i64,
    vn_row: i64,
    vn_head: i64,
    q_batch: i64,
    q_row: i64,
    q_head: i64,
    k_page: i64,
    k_row: i64,
    k_head: i64,
    v_page: i64,
    v_row: i64,
    v_head: i64,
    cos_row: i64,
    sin_row: i64,
    page_size: i32,
    batch: i32,
    sn: i32,
    sq: i32,
    hq: i32,
    hk: i32,
    d: i32,
    rd: i32,
    interleaved: i32,
    q_positions_advance: i32,
}

// SAFETY: plain `repr(C)` structs of integers and floats, laid out as the kernels' structs.
unsafe impl DeviceRepr for DecodeParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for AppendParams {}

/// One compiled instance of the decode kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeVariant {
    /// `bf16` or `f16`.
    pub dtype: DType,
    /// Row width: the head dim padded to 64, 128 or 256.
    pub d: usize,
}

impl DecodeVariant {
    /// The variant for a problem: the smallest row width that holds its head dim.
    pub fn for_problem(dtype: DType, d: usize) -> Result<Self> {
        let width = [64, 128, 256].into_iter().find(|&w| d <= w).ok_or_else(|| {
            Error::Unsupported(format!("the CUDA KV-cache kernels take head dims up to 256, got {d}"))
        })?;
        Ok(Self { dtype, d: width })
    }

    /// Every variant (for `compile_all`).
    pub fn all() -> Vec<DecodeVariant> {
        [DType::F16, DType::BF16]
            .into_iter()
            .flat_map(|dtype| [64, 128, 256].map(|d| DecodeVariant { dtype, d }))
            .collect()
    }

    /// Dynamic shared memory of `flash_decode` (`FD_SMEM_BYTES`): the query tile and the
    /// pipeline's stages of 64-key K and V tiles.
    pub fn smem_bytes(&self) -> usize {
        let stages = match self.d {
            256 => 2,
            128 => 3,
            _ => 4,
        };
        MAX_ROWS_PER_BLOCK * self.d * 2 + stages * 2 * 64 * self.d * 2
    }

    /// Decode blocks a multiprocessor with `smem_per_sm` bytes of shared memory holds at once
    /// (shared memory bounds them; 1 KB a block is the driver's reserve).
    pub fn resident_blocks(&self, smem_per_sm: usize) -> usize {
        (smem_per_sm / (self.smem_bytes() + 1024)).max(1)
    }

    /// Kernel name for the cache.
    pub fn name(&self) -> String {
        format!("flash_decode_{}_d{}", self.dtype.name(), self.d)
    }

    /// NVRTC options selecting this variant.
    pub fn options(&self) -> Vec<String> {
        vec![
            "--std=c++17".into(),
            "-Xptxas".into(),
            "-v".into(),
            format!("-DFD_D={}", self.d),
            format!("-DFD_BF16={}", u8::from(self.dtype == DType::BF16)),
        ]
    }
}

/// The decode kernels' program (`flash_decode`, `flash_decode_combine`, `flash_decode_append`,
/// `flash_decode_rotary_q`).
pub(crate) fn decode_source() -> String {
    [include_str!("kernels/tile.cuh"), include_str!("kernels/flash_decode.cuh")].join("\n")
}

/// The loaded kernels of one variant.
#[derive(Debug, Clone)]
pub(crate) struct DecodeFunctions {
    decode: CudaFunction,
    combine: CudaFunction,
    append: CudaFunction,
    rotary_q: CudaFunction,
}

impl Device {
    /// The decode kernels of `variant`, compiling (or reading the cache) on first use.
    pub(crate) fn decode_functions(&self, variant: &DecodeVariant) -> Result<DecodeFunctions> {
        let mut map = self.decode_functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = map.get(variant) {
            return Ok(f.clone());
        }
        let module = self.load_module(&variant.name(), &decode_source(), &variant.options())?;
        let load = |name: &str| module.load_function(name).map_err(|e| driver_error("cuModuleGetFunction", e));
        let f = DecodeFunctions {
            decode: load("flash_decode")?,
            combine: load("flash_decode_combine")?,
            append: load("flash_decode_append")?,
            rotary_q: load("flash_decode_rotary_q")?,
        };
        super::allow_dynamic_smem(&f.decode, variant.smem_bytes())?;
        map.insert(*variant, f.clone());
        Ok(f)
    }

    /// Shared memory of one multiprocessor, bytes.
    pub fn shared_memory_per_multiprocessor(&self) -> Result<usize> {
        use cudarc::driver::sys::CUdevice_attribute;
        let n = self
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
            .map_err(|e| driver_error("cuDeviceGetAttribute", e))?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Multiprocessors of the device.
    pub fn multiprocessors(&self) -> Result<usize> {
        use cudarc::driver::sys::CUdevice_attribute;
        let n = self
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_error("cuDeviceGetAttribute", e))?;
        Ok(usize::try_from(n).unwrap_or(1).max(1))
    }
}

fn i32_of(what: &str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| Error::Unsupported(format!("{what} = {x} exceeds the CUDA kernels' 32-bit range")))
}

fn i64_of(x: usize) -> i64 {
    x as i64
}

/// A window side as the kernel takes it: -1 unbounded (sides past any sequence hide nothing).
fn window_side(x: i64) -> i32 {
    if x < 0 || x > i64::from(i32::MAX / 4) {
        -1
    } else {
        x as i32
    }
}

/// A KV-cache call with every buffer on the device: validated and uploaded once, launched any
/// number of times ([`DecodeRun::launch`]), read back with [`DecodeRun::download`].
pub struct DecodeRun<T: CudaElement> {
    dev: &'static Device,
    f: DecodeFunctions,
    decode: DecodeParams,
    append: Option<AppendParams>,
    rotary_q: Option<AppendParams>,
    grid: (u32, u32, u32),
    combine_grid: Option<(u32, u32, u32)>,
    append_grid: (u32, u32, u32),
    rotary_grid: (u32, u32, u32),
    smem: u32,
    /// Nothing to compute (a zero-sized batch, query or head dimension).
    empty: bool,
    /// The split count in use.
    pub splits: usize,
    _q: CudaSlice<T>,
    _q_rot: Option<CudaSlice<T>>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    o: CudaSlice<T>,
    lse: CudaSlice<f32>,
    out_shape: Vec<usize>,
    lse_shape: Vec<usize>,
    // Held for the pointers in the parameter blocks.
    _held: Vec<CudaSlice<i32>>,
    _held_f32: Vec<CudaSlice<f32>>,
    _held_t: Vec<CudaSlice<T>>,
}

impl<T: CudaElement> DecodeRun<T> {
    /// Validates the call (the CPU's rules, [`crate::kvcache`]) and uploads everything to GPU 0.
    /// Head dims: `d == dv`, a multiple of 8, at most 256; all strides multiples of 8 elements.
    pub fn new(
        spec: &AttentionSpec<'_>,
        q: &Tensor<'_, T>,
        k_cache: &TensorMut<'_, T>,
        v_cache: &TensorMut<'_, T>,
        cache: &KvCache<'_, T>,
    ) -> Result<Self> {
        let dim = |shape: &[usize], i: usize| shape.get(i).copied().unwrap_or(0);
        let (b, sq, hq, dv) = (dim(q.shape(), 0), dim(q.shape(), 1), dim(q.shape(), 2), dim(v_cache.shape(), 3));
        let mut units_out = vec![(); b * sq * hq * dv];
        let out_shape = vec![b, sq, hq, dv];
        // Validation wants an output view of the right shape: one of zero-sized elements.
        let out_view = TensorMut::new(&mut units_out, &out_shape);
        let p = KvProblem::new(spec, q, k_cache, v_cache, cache, &out_view, b * hq * sq)?;
        if p.d != p.dv || p.d % 8 != 0 {
            return Err(Error::Unsupported(format!(
                "the CUDA KV-cache kernels need d == dv, a multiple of 8 (got d = {}, dv = {})",
                p.d, p.dv
            )));
        }
        let strides_ok = |s: &[usize]| s.iter().all(|x| x % 8 == 0 || *x == 1);
        if !strides_ok(q.strides()) || !strides_ok(k_cache.strides()) || !strides_ok(v_cache.strides()) {
            return Err(Error::Unsupported(
                "the CUDA KV-cache kernels need strides that are multiples of 8 elements".into(),
            ));
        }
        let group = p.hq / p.hk;
        let m = p.sq * group;
        let variant = DecodeVariant::for_problem(T::DTYPE, p.d)?;
        let dev = super::default_device()?;
        let f = dev.decode_functions(&variant)?;
        let stream = dev.stream();
        let alloc_err = |what: &'static str| move |e| driver_error(what, e);

        let row_groups = m.div_ceil(MAX_ROWS_PER_BLOCK);
        let max_sk = p.seqs.iter().map(|s| s.sk).max().unwrap_or(0);
        let chunks = max_sk.div_ceil(64).max(1);
        let splits = match cache.split_count() {
            0 => splits_for(
                p.batch * p.hk * row_groups,
                dev.multiprocessors()?,
                variant.resident_blocks(dev.shared_memory_per_multiprocessor()?),
                max_sk,
            ),
            n => n,
        }
        .min(chunks);

        let upload_i32 = |xs: &[i32]| -> Result<CudaSlice<i32>> { stream.clone_htod(xs).map_err(alloc_err("upload")) };
        let sk: Vec<i32> = p.seqs.iter().map(|s| s.sk as i32).collect();
        let start: Vec<i32> = p.seqs.iter().map(|s| s.start as i32).collect();
        let rows: Vec<i32> = p.seqs.iter().map(|s| s.row as i32).collect();
        let cached: Vec<i32> = p.seqs.iter().map(|s| s.cached as i32).collect();
        let (d_sk, d_start, d_rows, d_cached) =
            (upload_i32(&sk)?, upload_i32(&start)?, upload_i32(&rows)?, upload_i32(&cached)?);
        let (table, bt_batch, page_size) = match p.slots {
            Slots::Contiguous => (None, 0, 1),
            Slots::Paged { table, strides, page_size } => (Some(upload_i32(table)?), strides.0, page_size),
        };
        if let Slots::Paged { strides, .. } = p.slots {
            if strides.1 != 1 {
                return Err(Error::Unsupported(
                    "the CUDA KV-cache kernels need a block table with unit column stride".into(),
                ));
            }
        }
        let alibi: Option<CudaSlice<f32>> = match p.alibi {
            None => None,
            Some(a) => {
                let mut dense = vec![0.0f32; p.batch * p.hq];
                for bi in 0..p.batch {
                    for h in 0..p.hq {
                        dense[bi * p.hq + h] = a.data[bi * a.strides.0 + h * a.strides.1];
                    }
                }
                Some(stream.clone_htod(&dense).map_err(alloc_err("upload alibi"))?)
            }
        };

        let dq = stream.clone_htod(q.data()).map_err(alloc_err("upload q"))?;
        let dk = stream.clone_htod(k_cache.data()).map_err(alloc_err("upload k_cache"))?;
        let dvv = stream.clone_htod(v_cache.data()).map_err(alloc_err("upload v_cache"))?;
        let out_len = (b * sq * hq * dv).max(1);
        let o = stream.alloc_zeros::<T>(out_len).map_err(alloc_err("alloc out"))?;
        let lse = stream.alloc_zeros::<f32>((b * hq * sq).max(1)).map_err(alloc_err("alloc lse"))?;
        let parts = if splits > 1 { p.batch * p.hk * splits * m } else { 0 };
        let part_o = stream.alloc_zeros::<f32>((parts * p.d).max(1)).map_err(alloc_err("alloc split outputs"))?;
        let part_lse = stream.alloc_zeros::<f32>(parts.max(1)).map_err(alloc_err("alloc split lse"))?;

        let mut held_t = Vec::new();
        let (mut append, mut rotary_q) = (None, None);
        let mut q_rot = None;
        let ptr_i32 = |s: &CudaSlice<i32>| s.device_ptr(stream).0;
        let causal_or_window = p.causal != Causal::None || p.window.is_some();
        let rot = p.rotary;
        let (cos_ptr, sin_ptr, cos_row, sin_row, rd, inter) = match &rot {
            Some(r) => {
                let cos = stream.clone_htod(r.cos).map_err(alloc_err("upload rotary_cos"))?;
                let sin = stream.clone_htod(r.sin).map_err(alloc_err("upload rotary_sin"))?;
                let (cp, sp) = (cos.device_ptr(stream).0, sin.device_ptr(stream).0);
                held_t.push(cos);
                held_t.push(sin);
                (cp, sp, r.strides.0, r.strides.1, r.rd, r.interleaved)
            }
            None => (0, 0, 0, 0, 0, false),
        };
        let base_append = AppendParams {
            k: dk.device_ptr(stream).0,
            v: dvv.device_ptr(stream).0,
            q: dq.device_ptr(stream).0,
            cos: cos_ptr,
            sin: sin_ptr,
            seqlens: ptr_i32(&d_cached),
            cache_row: ptr_i32(&d_rows),
            block_table: table.as_ref().map_or(0, ptr_i32),
            bt_batch: i64_of(bt_batch),
            q_batch: i64_of(p.q.batch_stride),
            q_row: i64_of(p.q.token_stride),
            q_head: i64_of(p.q.head_stride),
            k_page: i64_of(p.k_strides[0]),
            k_row: i64_of(p.k_strides[1]),
            k_head: i64_of(p.k_strides[2]),
            v_page: i64_of(p.v_strides[0]),
            v_row: i64_of(p.v_strides[1]),
            v_head: i64_of(p.v_strides[2]),
            cos_row: i64_of(cos_row),
            sin_row: i64_of(sin_row),
            page_size: i32_of("page size", page_size)?,
            batch: i32_of("batch", p.batch)?,
            sn: i32_of("sn", p.sn)?,
            sq: i32_of("sq", p.sq)?,
            hq: i32_of("hq", p.hq)?,
            hk: i32_of("hk", p.hk)?,
            d: i32_of("d", p.d)?,
            rd: i32_of("rd", rd)?,
            interleaved: i32::from(inter),
            q_positions_advance: i32::from(causal_or_window),
            ..Default::default()
        };
        if let (Some((kn, kl)), Some((vn, vl))) = (p.new_k, p.new_v) {
            let dkn = stream.clone_htod(kn).map_err(alloc_err("upload k"))?;
            let dvn = stream.clone_htod(vn).map_err(alloc_err("upload v"))?;
            append = Some(AppendParams {
                k_new: dkn.device_ptr(stream).0,
                v_new: dvn.device_ptr(stream).0,
                kn_batch: i64_of(kl.batch_stride),
                kn_row: i64_of(kl.token_stride),
                kn_head: i64_of(kl.head_stride),
                vn_batch: i64_of(vl.batch_stride),
                vn_row: i64_of(vl.token_stride),
                vn_head: i64_of(vl.head_stride),
                ..base_append
            });
            held_t.push(dkn);
            held_t.push(dvn);
        }
        let mut q_ptr = dq.device_ptr(stream).0;
        let (mut qb, mut qr, mut qh) = (p.q.batch_stride, p.q.token_stride, p.q.head_stride);
        if rot.is_some() {
            let qr_buf = stream.alloc_zeros::<T>((b * sq * hq * p.d).max(1)).map_err(alloc_err("alloc q_rot"))?;
            rotary_q = Some(AppendParams { q_rot: qr_buf.device_ptr(stream).0, ..base_append });
            q_ptr = qr_buf.device_ptr(stream).0;
            (qb, qr, qh) = (sq * hq * p.d, hq * p.d, p.d);
            q_rot = Some(qr_buf);
        }
        let (window_left, window_right) = p.window.map_or((-1, -1), |(l, r)| (window_side(l), window_side(r)));
        let decode = DecodeParams {
            q: q_ptr,
            k: dk.device_ptr(stream).0,
            v: dvv.device_ptr(stream).0,
            o: o.device_ptr(stream).0,
            lse: lse.device_ptr(stream).0,
            part_o: part_o.device_ptr(stream).0,
            part_lse: part_lse.device_ptr(stream).0,
            sk: ptr_i32(&d_sk),
            start: ptr_i32(&d_start),
            cache_row: ptr_i32(&d_rows),
            block_table: table.as_ref().map_or(0, ptr_i32),
            alibi: alibi.as_ref().map_or(0, |a| a.device_ptr(stream).0),
            bt_batch: i64_of(bt_batch),
            q_batch: i64_of(qb),
            q_row: i64_of(qr),
            q_head: i64_of(qh),
            k_page: i64_of(p.k_strides[0]),
            k_row: i64_of(p.k_strides[1]),
            k_head: i64_of(p.k_strides[2]),
            v_page: i64_of(p.v_strides[0]),
            v_row: i64_of(p.v_strides[1]),
            v_head: i64_of(p.v_strides[2]),
            o_batch: i64_of(sq * hq * dv),
            o_row: i64_of(hq * dv),
            o_head: i64_of(dv),
            page_size: i32_of("page size", page_size)?,
            page_shift: if page_size.is_power_of_two() { page_size.trailing_zeros() as i32 } else { -1 },
            batch: i32_of("batch", p.batch)?,
            hq: i32_of("hq", p.hq)?,
            hk: i32_of("hk", p.hk)?,
            group: i32_of("group", group)?,
            sq: i32_of("sq", p.sq)?,
            d: i32_of("d", p.d)?,
            m: i32_of("packed rows", m)?,
            splits: i32_of("splits", splits)?,
            row_groups: i32_of("row groups", row_groups)?,
            causal: match p.causal {
                Causal::None => 0,
                Causal::BottomRight => 1,
                Causal::TopLeft => 2,
            },
            window_left,
            window_right,
            scale: p.scale,
            scale_log2: p.scale * std::f32::consts::LOG2_E,
            softcap: p.softcap.unwrap_or(0.0),
        };
        let grid_u32 = |what: &str, x: usize| {
            u32::try_from(x).map_err(|_| Error::Unsupported(format!("{what} = {x} is too large a grid")))
        };
        let grid = (
            grid_u32("splits", splits)?,
            grid_u32("kv heads x row groups", p.hk * row_groups)?,
            grid_u32("batch", p.batch)?,
        );
        if grid.1 > 65535 || grid.2 > 65535 {
            return Err(Error::Unsupported("too many kv heads or sequences for one launch".into()));
        }
        let combine_grid = (splits > 1).then_some((m as u32, p.hk as u32, p.batch as u32));
        let append_grid = (p.sn.max(1) as u32, p.hk as u32, p.batch as u32);
        let rotary_grid = (p.sq as u32, p.hq as u32, p.batch as u32);
        let mut held = vec![d_sk, d_start, d_rows, d_cached];
        held.extend(table);
        let mut held_f32 = vec![part_o, part_lse];
        held_f32.extend(alibi);
        Ok(Self {
            dev,
            f,
            decode,
            append,
            rotary_q,
            grid,
            combine_grid,
            append_grid,
            rotary_grid,
            smem: variant.smem_bytes() as u32,
            empty: p.batch == 0 || p.sq == 0 || p.hq == 0,
            splits,
            _q: dq,
            _q_rot: q_rot,
            k: dk,
            v: dvv,
            o,
            lse,
            out_shape,
            lse_shape: vec![b, hq, sq],
            _held: held,
            _held_f32: held_f32,
            _held_t: held_t,
        })
    }

    /// Enqueues the whole call: the append (if any), the query rotation (if any), the attention
    /// and the merge of the splits. An empty batch (no sequence, no query, no head) launches
    /// nothing.
    pub fn launch(&mut self) -> Result<()> {
        if self.empty {
            return Ok(());
        }
        if let Some(a) = self.append {
            self.launch_one(&self.f.append.clone(), self.append_grid, 128, 0, &a, "flash_decode_append")?;
        }
        self.launch_attention()
    }

    /// Enqueues the query rotation (if any), the attention and the merge: what a decode step
    /// costs once the cache holds the token (for timing).
    pub fn launch_attention(&mut self) -> Result<()> {
        if self.empty {
            return Ok(());
        }
        if let Some(r) = self.rotary_q {
            self.launch_one(&self.f.rotary_q.clone(), self.rotary_grid, 128, 0, &r, "flash_decode_rotary_q")?;
        }
        let params = self.decode;
        self.launch_one(&self.f.decode.clone(), self.grid, 128, self.smem, &params, "flash_decode")?;
        if let Some(grid) = self.combine_grid {
            self.launch_one(&self.f.combine.clone(), grid, 128, 0, &params, "flash_decode_combine")?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_one<P: DeviceRepr>(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        threads: u32,
        smem: u32,
        params: &P,
        what: &str,
    ) -> Result<()> {
        let stream = self.dev.stream();
        let cfg = LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: smem };
        let mut builder = stream.launch_builder(f);
        builder.arg(params);
        // SAFETY: the parameter block matches the kernel's struct; every pointer in it is a live
        // device buffer owned by `self` (or freed only after the stream's work, by cudarc's
        // stream-ordered frees), sized from the validated problem, which bounds every index the
        // kernels form.
        unsafe { builder.launch(cfg) }.map_err(|e| driver_error(what, e))?;
        Ok(())
    }

    /// The device the run is on.
    pub fn device(&self) -> &'static Device {
        self.dev
    }

    /// Copies `out`, `lse` and the caches back: `(output, k_cache, v_cache)` (the caches as the
    /// whole buffers that were uploaded).
    pub fn download(&self) -> Result<(Output<T>, Vec<T>, Vec<T>)> {
        let stream = self.dev.stream();
        let err = |what: &'static str| move |e| driver_error(what, e);
        let mut out = stream.clone_dtoh(&self.o).map_err(err("download out"))?;
        let mut lse = stream.clone_dtoh(&self.lse).map_err(err("download lse"))?;
        let k = stream.clone_dtoh(&self.k).map_err(err("download k_cache"))?;
        let v = stream.clone_dtoh(&self.v).map_err(err("download v_cache"))?;
        stream.synchronize().map_err(err("synchronize"))?;
        out.truncate(self.out_shape.iter().product());
        lse.truncate(self.lse_shape.iter().product());
        Ok((Output { out, out_shape: self.out_shape.clone(), lse, lse_shape: self.lse_shape.clone() }, k, v))
    }
}

/// Attention with a KV cache on GPU 0 for host buffers: validates (as the CPU), uploads, appends
/// and attends on the device, and copies `out`, `lse` and the updated caches back (the caches in
/// place, into `k_cache` and `v_cache`).
pub fn forward_host<T: CudaElement>(
    spec: &AttentionSpec<'_>,
    q: &Tensor<'_, T>,
    k_cache: &mut TensorMut<'_, T>,
    v_cache: &mut TensorMut<'_, T>,
    cache: &KvCache<'_, T>,
) -> Result<Output<T>> {
    let mut run = DecodeRun::new(spec, q, k_cache, v_cache, cache)?;
    run.launch()?;
    let (out, k, v) = run.download()?;
    k_cache.data_mut().copy_from_slice(&k);
    v_cache.data_mut().copy_from_slice(&v);
    Ok(out)
}
