//! Attention over a KV cache on the GPU (DESIGN §6): `kernels/flash_decode.cuh` behind the
//! library's KV-cache semantics.
//!
//! A call is validated on the host exactly as the CPU's ([`crate::kvcache`]), so bad input is the
//! same typed error with nothing written. Then, on the device's stream: the new keys and values
//! (rotated when rotary is on) go into the cache (`flash_decode_append`), the queries are rotated
//! into a scratch buffer (`flash_decode_rotary_q`), and `flash_decode` attends with the key range
//! of every (sequence, kv head) cut into splits ([`splits_for`]) whose partial results
//! `flash_decode_combine` merges. [`DecodeRun`] keeps every buffer on the device, so a benchmark
//! times the launches alone; [`Device::kvcache_forward`] runs a call on buffers that already
//! live on the device (a framework's tensors), on the device's (or the framework's) stream.

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::{driver_error, CudaElement, Device, DeviceTensor, DeviceTensorMut};
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

/// Device addresses of a call's tensors (0: absent).
#[derive(Debug, Clone, Copy, Default)]
struct Addrs {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    k_new: u64,
    v_new: u64,
    cos: u64,
    sin: u64,
}

/// What the CUDA kernels refuse beyond the shared validation: `d != dv`, `d` not a multiple of 8,
/// strides of `q` and the caches not multiples of 8 elements.
fn check_kernel_limits<U>(p: &KvProblem<'_, U>, strides: [&[usize]; 3]) -> Result<()> {
    if p.d != p.dv || !p.d.is_multiple_of(8) {
        return Err(Error::Unsupported(format!(
            "the CUDA KV-cache kernels need d == dv, a multiple of 8 (got d = {}, dv = {})",
            p.d, p.dv
        )));
    }
    let strides_ok = |s: &[usize]| s.iter().all(|x| x % 8 == 0 || *x == 1);
    if !strides.iter().all(|s| strides_ok(s)) {
        return Err(Error::Unsupported(
            "the CUDA KV-cache kernels need strides that are multiples of 8 elements".into(),
        ));
    }
    if let Slots::Paged { strides, .. } = p.slots {
        if strides.1 != 1 {
            return Err(Error::Unsupported(
                "the CUDA KV-cache kernels need a block table with unit column stride".into(),
            ));
        }
    }
    Ok(())
}

/// The launches of one validated call, with the small device buffers they read (lengths, rows,
/// block table, ALiBi slopes, split partials, rotated queries) owned here.
struct Plan {
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
    splits: usize,
    // Held for the pointers in the parameter blocks.
    _held: Vec<CudaSlice<i32>>,
    _held_f32: Vec<CudaSlice<f32>>,
    _held_u8: Option<CudaSlice<u8>>,
}

impl Plan {
    /// Builds the parameter blocks of problem `p` (element type `T`) on `dev`'s stream, for the
    /// tensors at `a`; `num_splits` 0 lets [`splits_for`] choose.
    fn new<T: CudaElement, U>(dev: &Device, p: &KvProblem<'_, U>, num_splits: usize, a: Addrs) -> Result<Self> {
        let (b, sq, hq) = (p.batch, p.sq, p.hq);
        let group = p.hq / p.hk;
        let m = p.sq * group;
        let variant = DecodeVariant::for_problem(T::DTYPE, p.d)?;
        let f = dev.decode_functions(&variant)?;
        let stream = dev.stream();
        let alloc_err = |what: &'static str| move |e| driver_error(what, e);

        let row_groups = m.div_ceil(MAX_ROWS_PER_BLOCK);
        let max_sk = p.seqs.iter().map(|s| s.sk).max().unwrap_or(0);
        let chunks = max_sk.div_ceil(64).max(1);
        let splits = match num_splits {
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
        let alibi: Option<CudaSlice<f32>> = match p.alibi {
            None => None,
            Some(al) => {
                let mut dense = vec![0.0f32; p.batch * p.hq];
                for bi in 0..p.batch {
                    for h in 0..p.hq {
                        dense[bi * p.hq + h] = al.data[bi * al.strides.0 + h * al.strides.1];
                    }
                }
                Some(stream.clone_htod(&dense).map_err(alloc_err("upload alibi"))?)
            }
        };
        let parts = if splits > 1 { p.batch * p.hk * splits * m } else { 0 };
        let part_o = stream.alloc_zeros::<f32>((parts * p.d).max(1)).map_err(alloc_err("alloc split outputs"))?;
        let part_lse = stream.alloc_zeros::<f32>(parts.max(1)).map_err(alloc_err("alloc split lse"))?;

        let ptr_i32 = |s: &CudaSlice<i32>| s.device_ptr(stream).0;
        let causal_or_window = p.causal != Causal::None || p.window.is_some();
        let (cos_row, sin_row, rd, inter) = match &p.rotary {
            Some(r) => (r.strides.0, r.strides.1, r.rd, r.interleaved),
            None => (0, 0, 0, false),
        };
        let base_append = AppendParams {
            k: a.k,
            v: a.v,
            q: a.q,
            cos: a.cos,
            sin: a.sin,
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
        let append = match (p.new_k, p.new_v) {
            (Some((_, kl)), Some((_, vl))) => Some(AppendParams {
                k_new: a.k_new,
                v_new: a.v_new,
                kn_batch: i64_of(kl.batch_stride),
                kn_row: i64_of(kl.token_stride),
                kn_head: i64_of(kl.head_stride),
                vn_batch: i64_of(vl.batch_stride),
                vn_row: i64_of(vl.token_stride),
                vn_head: i64_of(vl.head_stride),
                ..base_append
            }),
            _ => None,
        };
        let mut q_ptr = a.q;
        let (mut qb, mut qr, mut qh) = (p.q.batch_stride, p.q.token_stride, p.q.head_stride);
        let (mut rotary_q, mut q_rot) = (None, None);
        if p.rotary.is_some() {
            let bytes = (b * sq * hq * p.d).max(1) * std::mem::size_of::<T>();
            let buf = stream.alloc_zeros::<u8>(bytes).map_err(alloc_err("alloc q_rot"))?;
            let ptr = buf.device_ptr(stream).0;
            rotary_q = Some(AppendParams { q_rot: ptr, ..base_append });
            q_ptr = ptr;
            (qb, qr, qh) = (sq * hq * p.d, hq * p.d, p.d);
            q_rot = Some(buf);
        }
        let (window_left, window_right) = p.window.map_or((-1, -1), |(l, r)| (window_side(l), window_side(r)));
        let decode = DecodeParams {
            q: q_ptr,
            k: a.k,
            v: a.v,
            o: a.o,
            lse: a.lse,
            part_o: part_o.device_ptr(stream).0,
            part_lse: part_lse.device_ptr(stream).0,
            sk: ptr_i32(&d_sk),
            start: ptr_i32(&d_start),
            cache_row: ptr_i32(&d_rows),
            block_table: table.as_ref().map_or(0, ptr_i32),
            alibi: alibi.as_ref().map_or(0, |al| al.device_ptr(stream).0),
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
            o_batch: i64_of(p.out.batch_stride),
            o_row: i64_of(p.out.token_stride),
            o_head: i64_of(p.out.head_stride),
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
            _held: held,
            _held_f32: held_f32,
            _held_u8: q_rot,
        })
    }

    /// Enqueues on `dev`'s stream the append (if any and `with_append`), the query rotation (if
    /// any), the attention and the merge of the splits; nothing for an empty problem.
    fn launch(&self, dev: &Device, with_append: bool) -> Result<()> {
        if self.empty {
            return Ok(());
        }
        if let (true, Some(a)) = (with_append, self.append) {
            launch_one(dev, &self.f.append, self.append_grid, 0, &a, "flash_decode_append")?;
        }
        if let Some(r) = self.rotary_q {
            launch_one(dev, &self.f.rotary_q, self.rotary_grid, 0, &r, "flash_decode_rotary_q")?;
        }
        launch_one(dev, &self.f.decode, self.grid, self.smem, &self.decode, "flash_decode")?;
        if let Some(grid) = self.combine_grid {
            launch_one(dev, &self.f.combine, grid, 0, &self.decode, "flash_decode_combine")?;
        }
        Ok(())
    }
}

/// One launch of 128 threads a block on `dev`'s stream.
fn launch_one<P: DeviceRepr>(
    dev: &Device,
    f: &CudaFunction,
    grid: (u32, u32, u32),
    smem: u32,
    params: &P,
    what: &str,
) -> Result<()> {
    let cfg = LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: smem };
    let mut builder = dev.stream().launch_builder(f);
    builder.arg(params);
    // SAFETY: the parameter block matches the kernel's struct; every pointer in it is a live
    // device buffer (the caller's tensors, checked against the validated problem, or buffers the
    // plan owns and frees only after the stream's work), sized from the validated problem, which
    // bounds every index the kernels form.
    unsafe { builder.launch(cfg) }.map_err(|e| driver_error(what, e))?;
    Ok(())
}

/// A KV-cache call with every buffer on the device: validated and uploaded once, launched any
/// number of times ([`DecodeRun::launch`]), read back with [`DecodeRun::download`].
pub struct DecodeRun<T: CudaElement> {
    dev: &'static Device,
    plan: Plan,
    /// The split count in use.
    pub splits: usize,
    _q: CudaSlice<T>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    o: CudaSlice<T>,
    lse: CudaSlice<f32>,
    out_shape: Vec<usize>,
    lse_shape: Vec<usize>,
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
        check_kernel_limits(&p, [q.strides(), k_cache.strides(), v_cache.strides()])?;
        let dev = super::default_device()?;
        let stream = dev.stream();
        let alloc_err = |what: &'static str| move |e| driver_error(what, e);
        let upload = |xs: &[T], what: &'static str| stream.clone_htod(xs).map_err(alloc_err(what));
        let dq = upload(q.data(), "upload q")?;
        let dk = upload(k_cache.data(), "upload k_cache")?;
        let dvv = upload(v_cache.data(), "upload v_cache")?;
        let o = stream.alloc_zeros::<T>((b * sq * hq * dv).max(1)).map_err(alloc_err("alloc out"))?;
        let lse = stream.alloc_zeros::<f32>((b * hq * sq).max(1)).map_err(alloc_err("alloc lse"))?;
        let mut held_t = Vec::new();
        let ptr = |s: &CudaSlice<T>| s.device_ptr(stream).0;
        let mut a = Addrs {
            q: ptr(&dq),
            k: ptr(&dk),
            v: ptr(&dvv),
            o: ptr(&o),
            lse: lse.device_ptr(stream).0,
            ..Addrs::default()
        };
        if let (Some((kn, _)), Some((vn, _))) = (p.new_k, p.new_v) {
            let (dkn, dvn) = (upload(kn, "upload k")?, upload(vn, "upload v")?);
            (a.k_new, a.v_new) = (ptr(&dkn), ptr(&dvn));
            held_t.extend([dkn, dvn]);
        }
        if let Some(r) = &p.rotary {
            let (cos, sin) = (upload(r.cos, "upload rotary_cos")?, upload(r.sin, "upload rotary_sin")?);
            (a.cos, a.sin) = (ptr(&cos), ptr(&sin));
            held_t.extend([cos, sin]);
        }
        let plan = Plan::new::<T, T>(dev, &p, cache.split_count(), a)?;
        Ok(Self {
            dev,
            splits: plan.splits,
            plan,
            _q: dq,
            k: dk,
            v: dvv,
            o,
            lse,
            out_shape,
            lse_shape: vec![b, hq, sq],
            _held_t: held_t,
        })
    }

    /// Enqueues the whole call: the append (if any), the query rotation (if any), the attention
    /// and the merge of the splits. An empty batch (no sequence, no query, no head) launches
    /// nothing.
    pub fn launch(&mut self) -> Result<()> {
        self.plan.launch(self.dev, true)
    }

    /// Enqueues the query rotation (if any), the attention and the merge: what a decode step
    /// costs once the cache holds the token (for timing).
    pub fn launch_attention(&mut self) -> Result<()> {
        self.plan.launch(self.dev, false)
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

/// The cache-side inputs of [`Device::kvcache_forward`]: as [`KvCache`], with the new tokens and
/// the rotary tables on the device; the index tensors (`cache_seqlens`, `cache_batch_idx`,
/// `block_table`, `cache_leftpad`) stay on the host (they are validated there, then copied to
/// the device for the launch).
#[derive(Debug)]
pub struct DeviceKvCache<'a, 'd, T> {
    seqlens: &'a [i32],
    batch_idx: Option<&'a [i32]>,
    block_table: Option<Tensor<'a, i32>>,
    leftpad: Option<&'a [i32]>,
    new_kv: Option<(&'d DeviceTensor<'d, T>, &'d DeviceTensor<'d, T>)>,
    rotary: Option<(&'d DeviceTensor<'d, T>, &'d DeviceTensor<'d, T>, bool)>,
    num_splits: usize,
}

impl<'a, 'd, T> DeviceKvCache<'a, 'd, T> {
    /// See [`KvCache::new`].
    pub fn new(cache_seqlens: &'a [i32]) -> Self {
        Self {
            seqlens: cache_seqlens,
            batch_idx: None,
            block_table: None,
            leftpad: None,
            new_kv: None,
            rotary: None,
            num_splits: 0,
        }
    }

    /// See [`KvCache::batch_idx`].
    #[must_use]
    pub fn batch_idx(mut self, idx: &'a [i32]) -> Self {
        self.batch_idx = Some(idx);
        self
    }

    /// See [`KvCache::paged`]; the block table is a host tensor.
    #[must_use]
    pub fn paged(mut self, block_table: Tensor<'a, i32>) -> Self {
        self.block_table = Some(block_table);
        self
    }

    /// See [`KvCache::leftpad`].
    #[must_use]
    pub fn leftpad(mut self, leftpad: &'a [i32]) -> Self {
        self.leftpad = Some(leftpad);
        self
    }

    /// See [`KvCache::append`]; `k`, `v` on the device.
    #[must_use]
    pub fn append(mut self, k: &'d DeviceTensor<'d, T>, v: &'d DeviceTensor<'d, T>) -> Self {
        self.new_kv = Some((k, v));
        self
    }

    /// See [`KvCache::rotary`]; `cos`, `sin` on the device.
    #[must_use]
    pub fn rotary(mut self, cos: &'d DeviceTensor<'d, T>, sin: &'d DeviceTensor<'d, T>, interleaved: bool) -> Self {
        self.rotary = Some((cos, sin, interleaved));
        self
    }

    /// See [`KvCache::num_splits`] (0: the GPU's heuristic, [`splits_for`]).
    #[must_use]
    pub fn num_splits(mut self, n: usize) -> Self {
        self.num_splits = n;
        self
    }
}

/// A view of zero-sized elements with `t`'s length, shape and strides: what validation needs of
/// a device tensor (its layout), without its data.
fn units<T>(t: &DeviceTensor<'_, T>) -> Tensor<'static, ()> {
    let data: &'static [()] = vec![(); t.data.len()].leak(); // no allocation: `()` is zero-sized
    Tensor::with_strides(data, &t.shape, &t.strides)
}

fn units_mut<T>(t: &DeviceTensorMut<'_, T>) -> TensorMut<'static, ()> {
    let data: &'static mut [()] = vec![(); t.data.len()].leak();
    TensorMut::with_strides(data, &t.shape, &t.strides)
}

impl Device {
    /// Attention with a KV cache on device buffers, enqueued on [`Device::stream`]
    /// (asynchronous): appends the new tokens of `cache` (rotated when rotary is on) into
    /// `k_cache` / `v_cache` in place, then attends, writing `out [b, sq, hq, d]` (any strides
    /// that are multiples of 8 elements) and `lse` (contiguous `[b, hq, sq]`). The semantics and
    /// the validation are the CPU's ([`crate::kvcache`]): any invalid input is an [`Error`] with
    /// nothing enqueued. Limits: `d == dv`, a multiple of 8, at most 256; strides of `q` and the
    /// caches multiples of 8 elements. Small scratch buffers (lengths, split partials, rotated
    /// queries) are stream-ordered allocations of the device's pool.
    #[allow(clippy::too_many_arguments)]
    pub fn kvcache_forward<T: CudaElement>(
        &self,
        spec: &AttentionSpec<'_>,
        q: &DeviceTensor<'_, T>,
        k_cache: &mut DeviceTensorMut<'_, T>,
        v_cache: &mut DeviceTensorMut<'_, T>,
        cache: &DeviceKvCache<'_, '_, T>,
        out: &mut DeviceTensorMut<'_, T>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let (uq, uk, uv, uo) = (units(q), units_mut(k_cache), units_mut(v_cache), units_mut(out));
        let mut meta = KvCache::<()>::new(cache.seqlens).num_splits(cache.num_splits);
        if let Some(x) = cache.batch_idx {
            meta = meta.batch_idx(x);
        }
        if let Some(t) = &cache.block_table {
            meta = meta.paged(t.clone());
        }
        if let Some(x) = cache.leftpad {
            meta = meta.leftpad(x);
        }
        if let Some((kn, vn)) = cache.new_kv {
            meta = meta.append(units(kn), units(vn));
        }
        if let Some((c, s, inter)) = cache.rotary {
            meta = meta.rotary(units(c), units(s), inter);
        }
        let p = KvProblem::new(spec, &uq, &uk, &uv, &meta, &uo, lse.len())?;
        check_kernel_limits(&p, [&q.strides, &k_cache.strides, &v_cache.strides])?;
        if !out.strides.iter().all(|x| x % 8 == 0 || *x == 1) {
            return Err(Error::Unsupported(
                "the CUDA KV-cache kernels need `out` strides that are multiples of 8".into(),
            ));
        }
        let stream = self.stream();
        let mut a = Addrs {
            q: q.data.device_ptr(stream).0,
            k: k_cache.data.device_ptr_mut(stream).0,
            v: v_cache.data.device_ptr_mut(stream).0,
            o: out.data.device_ptr_mut(stream).0,
            lse: lse.device_ptr_mut(stream).0,
            ..Addrs::default()
        };
        if let Some((kn, vn)) = cache.new_kv {
            (a.k_new, a.v_new) = (kn.data.device_ptr(stream).0, vn.data.device_ptr(stream).0);
        }
        if let Some((c, s, _)) = cache.rotary {
            (a.cos, a.sin) = (c.data.device_ptr(stream).0, s.data.device_ptr(stream).0);
        }
        Plan::new::<T, ()>(self, &p, cache.num_splits, a)?.launch(self, true)
    }

    /// [`Device::kvcache_forward`] over caches the call only reads (for frameworks whose tensors
    /// are immutable, like candle): `cache` must not append (an [`Error::KvCache`]).
    #[allow(clippy::too_many_arguments)]
    pub fn kvcache_forward_readonly<T: CudaElement>(
        &self,
        spec: &AttentionSpec<'_>,
        q: &DeviceTensor<'_, T>,
        k_cache: &DeviceTensor<'_, T>,
        v_cache: &DeviceTensor<'_, T>,
        cache: &DeviceKvCache<'_, '_, T>,
        out: &mut DeviceTensorMut<'_, T>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        if cache.new_kv.is_some() {
            return Err(Error::KvCache("a read-only KV-cache call cannot append new tokens".into()));
        }
        let (uq, uk, uv, uo) = (units(q), units(k_cache), units(v_cache), units_mut(out));
        let mut meta = KvCache::<()>::new(cache.seqlens).num_splits(cache.num_splits);
        if let Some(x) = cache.batch_idx {
            meta = meta.batch_idx(x);
        }
        if let Some(t) = &cache.block_table {
            meta = meta.paged(t.clone());
        }
        if let Some(x) = cache.leftpad {
            meta = meta.leftpad(x);
        }
        if let Some((c, s, inter)) = cache.rotary {
            meta = meta.rotary(units(c), units(s), inter);
        }
        let p = KvProblem::new(spec, &uq, &uk, &uv, &meta, &uo, lse.len())?;
        check_kernel_limits(&p, [&q.strides, &k_cache.strides, &v_cache.strides])?;
        if !out.strides.iter().all(|x| x % 8 == 0 || *x == 1) {
            return Err(Error::Unsupported(
                "the CUDA KV-cache kernels need `out` strides that are multiples of 8".into(),
            ));
        }
        let stream = self.stream();
        let mut a = Addrs {
            q: q.data.device_ptr(stream).0,
            k: k_cache.data.device_ptr(stream).0,
            v: v_cache.data.device_ptr(stream).0,
            o: out.data.device_ptr_mut(stream).0,
            lse: lse.device_ptr_mut(stream).0,
            ..Addrs::default()
        };
        if let Some((c, s, _)) = cache.rotary {
            (a.cos, a.sin) = (c.data.device_ptr(stream).0, s.data.device_ptr(stream).0);
        }
        Plan::new::<T, ()>(self, &p, cache.num_splits, a)?.launch(self, false)
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
