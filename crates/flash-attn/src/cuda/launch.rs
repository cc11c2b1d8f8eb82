//! From a validated [`Geometry`] to one kernel launch: what the kernels support, the parameter
//! block, the grid.

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    PushKernelArg, SyncOnDrop,
};

use super::nvrtc::Arch;
use super::{
    driver_error, padded_head_dim, tile_width, BwdVariant, CudaElement, Device, DeviceTensor, DeviceTensorMut,
    ExtraPaths, Fp8Variant, Variant,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::philox::DropoutRng;
use crate::spec::{Causal, Geometry, RowLayout};

/// The kernel parameters; field for field `FwdParams` in `kernels/flash_fwd.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct FwdParams {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    cu_seqlens_q: u64,
    cu_seqlens_k: u64,
    q_batch: i64,
    q_row: i64,
    q_head: i64,
    k_batch: i64,
    k_row: i64,
    k_head: i64,
    v_batch: i64,
    v_row: i64,
    v_head: i64,
    o_batch: i64,
    o_row: i64,
    o_head: i64,
    lse_batch: i64,
    lse_head: i64,
    batch: i32,
    hq: i32,
    group: i32,
    d: i32,
    sq: i32,
    sk: i32,
    num_m_blocks: i32,
    causal: i32,
    window_left: i32,
    window_right: i32,
    scale_log2: f32,
    longest_first: i32,
    dropout: DropoutParams,
    score_mod: ScoreMod,
    block: BlockMaskParams,
}

/// Bytes of K and V that the heads of one causal chunk (`FwdParams::longest_first`) may hold
/// together: a third of the H100's 50 MB L2, so that two chunks' worth (one ending, one starting)
/// and the queries in flight fit. (Measured against 32 MiB and all heads at once: 16 MiB was the
/// best or level at d 128, level at d 64; docs/cuda-notes.md.)
const CAUSAL_CHUNK_BYTES: usize = 16 << 20;

/// Query heads a causal forward orders together (`fwd_item` in `flash_fwd.cuh`): as many as
/// [`CAUSAL_CHUNK_BYTES`] of 16-bit K and V hold, GQA's shared key/value heads counted once, at
/// least one, at most every head of the batch.
fn causal_chunk_heads(g: &Geometry<'_>) -> i32 {
    let kv_head_bytes = g.max_sk.max(1).saturating_mul(g.d + g.dv).saturating_mul(2);
    let kv_heads = (CAUSAL_CHUNK_BYTES / kv_head_bytes).max(1);
    let heads = g.seqs.len().saturating_mul(g.hq).max(1);
    kv_heads.saturating_mul(g.hq / g.hk.max(1)).min(heads).min(i32::MAX as usize) as i32
}

/// Bytes of the query-side tensors (Q, dO and the f32 dQ accumulator) that the kv heads of one
/// chunk of the warp-specialised backward's causal order (`BwdWsParams::longest_first`) may hold
/// together, as [`CAUSAL_CHUNK_BYTES`] for the forward's K and V.
const BACKWARD_CHUNK_BYTES: usize = 16 << 20;

/// The warp-specialised backward's tile order (`ws_key_tile_coords` in `flash_bwd.cuh`): under a
/// causal rule, chunks of this many (sequence, kv head)s, each chunk's first key tiles (the ones
/// the most query tiles see) first, so that the grid ends on its shortest tiles; as many as
/// [`BACKWARD_CHUNK_BYTES`] of their query heads' Q, dO (16-bit) and dQ accumulator (f32) hold,
/// at least one, at most every one. 0 (the plain order, each head's tiles together) without a
/// causal rule, where every tile has the same query tiles.
fn backward_chunk_kv_heads(g: &Geometry<'_>) -> i32 {
    if g.causal == Causal::None {
        return 0;
    }
    let q_head_bytes = g.max_sq.max(1).saturating_mul(2 * g.d + 2 * g.dv + 4 * g.d);
    let kv_head_bytes = q_head_bytes.saturating_mul((g.hq / g.hk.max(1)).max(1));
    let heads = g.seqs.len().saturating_mul(g.hk).max(1);
    (BACKWARD_CHUNK_BYTES / kv_head_bytes).clamp(1, heads).min(i32::MAX as usize) as i32
}

/// Device addresses of a forward call's buffers.
#[derive(Debug, Clone, Copy)]
struct FwdBuffers {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
}

impl FwdParams {
    /// The parameter block of a forward over `g` into `bufs`: strides of q, k, v as the geometry
    /// holds them and the output's `o_layout` (in elements), lse contiguous (`[b, hq, sq]`, or
    /// `[hq, tq]` for varlen), the visibility rule, the softmax scale in exp2 units; no
    /// `cu_seqlens`, no softcap, ALiBi or block mask, dropout as `g` has it. Callers override what
    /// their kernel reads differently.
    fn of(g: &Geometry<'_>, bufs: FwdBuffers, o_layout: &RowLayout, num_m_blocks: usize) -> Result<Self> {
        let (lse_batch, lse_head) = if g.varlen { (0, g.total_q) } else { (g.hq * g.max_sq, g.max_sq) };
        let (window_left, window_right) = g.window.map_or((-1, -1), |(l, r)| (window_side(l), window_side(r)));
        Ok(FwdParams {
            q: bufs.q,
            k: bufs.k,
            v: bufs.v,
            o: bufs.o,
            lse: bufs.lse,
            cu_seqlens_q: 0,
            cu_seqlens_k: 0,
            q_batch: g.q.batch_stride as i64,
            q_row: g.q.token_stride as i64,
            q_head: g.q.head_stride as i64,
            k_batch: g.k.batch_stride as i64,
            k_row: g.k.token_stride as i64,
            k_head: g.k.head_stride as i64,
            v_batch: g.v.batch_stride as i64,
            v_row: g.v.token_stride as i64,
            v_head: g.v.head_stride as i64,
            o_batch: o_layout.batch_stride as i64,
            o_row: o_layout.token_stride as i64,
            o_head: o_layout.head_stride as i64,
            lse_batch: lse_batch as i64,
            lse_head: lse_head as i64,
            batch: i32_of("batch", g.seqs.len())?,
            hq: i32_of("hq", g.hq)?,
            group: i32_of("hq / hk", g.hq / g.hk)?,
            d: i32_of("d", g.d)?,
            sq: i32_of("sq", g.max_sq)?,
            sk: i32_of("sk", g.max_sk)?,
            num_m_blocks: i32_of("query tiles", num_m_blocks)?,
            causal: match g.causal {
                Causal::None => 0,
                Causal::BottomRight => 1,
                Causal::TopLeft => 2,
            },
            window_left,
            window_right,
            scale_log2: g.scale * std::f32::consts::LOG2_E,
            // Causal: all heads' longest query blocks first (the warp-specialised launcher orders
            // in L2-sized chunks of heads instead).
            longest_first: if g.causal == Causal::None { 0 } else { i32_of("heads", g.seqs.len() * g.hq)? },
            dropout: DropoutParams::of(g),
            score_mod: ScoreMod::new(0, None, g.scale),
            block: BlockMaskParams::default(),
        })
    }
}

/// `BlockMask` in `kernels/mask.cuh`: the block-sparse mask's bytes on the device, with the
/// strides of `[b, h, qb, kb]` in elements (0 for broadcast dimensions) and the block size.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct BlockMaskParams {
    data: u64,
    strides: [i64; 4],
    block_q: i32,
    block_k: i32,
}

/// `ScoreMod` in `kernels/mask.cuh`: softcap and ALiBi, with the constants the kernels fold the
/// softmax scale and the softcap into.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct ScoreMod {
    alibi: u64,
    softcap: f32,
    scale: f32,
    scale_log2: f32,
    tanh_scale: f32,
    cap_log2: f32,
    inv_cap_log2: f32,
}

impl ScoreMod {
    /// The modifiers of softmax scale `scale`, softcap `softcap` (if any) and ALiBi slopes at
    /// device address `alibi` (0 for none); the derived constants are computed in f64.
    fn new(alibi: u64, softcap: Option<f32>, scale: f32) -> Self {
        let log2e = std::f64::consts::LOG2_E;
        let (s, c) = (f64::from(scale), f64::from(softcap.unwrap_or(0.0)));
        let capped = c > 0.0;
        Self {
            alibi,
            softcap: c as f32,
            scale,
            scale_log2: (s * log2e) as f32,
            tanh_scale: if capped { (s / c) as f32 } else { 0.0 },
            cap_log2: (c * log2e) as f32,
            inv_cap_log2: if capped { (1.0 / (c * log2e)) as f32 } else { 0.0 },
        }
    }
}

/// The optional kernel paths a problem uses.
pub(crate) fn needs_extras(g: &Geometry<'_>) -> ExtraPaths {
    ExtraPaths {
        dropout: g.dropout.is_some_and(|d| d.p > 0.0),
        softcap: g.softcap.is_some(),
        blocks: g.block.is_some(),
        alibi: g.alibi.is_some(),
    }
}

/// A variant cannot run a problem that uses an optional path it does not hold.
fn check_extras(g: &Geometry<'_>, have: ExtraPaths, name: &str) -> Result<()> {
    let need = needs_extras(g);
    if !have.covers(need) {
        return Err(Error::Unsupported(format!(
            "variant {name} lacks an optional path this problem uses; use its `{}` twin",
            need.suffix()
        )));
    }
    Ok(())
}

/// The device address of an optional buffer (0 for none) and the guard that orders its use on
/// `stream`; keep the guard until the launch is enqueued.
fn optional_ptr<'a, T>(buf: Option<&'a CudaSlice<T>>, stream: &'a CudaStream) -> (u64, Option<SyncOnDrop<'a>>) {
    match buf {
        Some(b) => {
            let (p, sync) = b.device_ptr(stream);
            (p, Some(sync))
        }
        None => (0, None),
    }
}

/// [`optional_ptr`] for a buffer the kernel writes (the tile scheduler's counter).
fn optional_ptr_mut<'a, T>(buf: Option<&'a mut CudaSlice<T>>, stream: &'a CudaStream) -> (u64, Option<SyncOnDrop<'a>>) {
    match buf {
        Some(b) => {
            let (p, sync) = b.device_ptr_mut(stream);
            (p, Some(sync))
        }
        None => (0, None),
    }
}

/// The block-sparse mask's bytes on the device, as the geometry validated them (`None` without).
fn upload_block_mask(dev: &Device, g: &Geometry<'_>) -> Result<Option<CudaSlice<u8>>> {
    match &g.block {
        None => Ok(None),
        Some(b) => Ok(Some(dev.stream().clone_htod(b.data).map_err(|e| driver_error("upload block mask", e))?)),
    }
}

/// The kernel's view of the block mask at device address `ptr` (0: none).
fn block_params(g: &Geometry<'_>, ptr: u64) -> Result<BlockMaskParams> {
    let Some(b) = &g.block else {
        return Ok(BlockMaskParams::default());
    };
    let s = |x: usize| i64::try_from(x).map_err(|_| Error::Unsupported(format!("block mask stride {x}")));
    Ok(BlockMaskParams {
        data: ptr,
        strides: [s(b.strides[0])?, s(b.strides[1])?, s(b.strides[2])?, s(b.strides[3])?],
        block_q: i32_of("block_q", b.block_q)?,
        block_k: i32_of("block_k", b.block_k)?,
    })
}

/// ALiBi slopes as the kernels read them, `[batch][hq]`, on the device (`None` without ALiBi).
fn upload_alibi(dev: &Device, g: &Geometry<'_>) -> Result<Option<CudaSlice<f32>>> {
    if g.alibi.is_none() {
        return Ok(None);
    }
    let mut slopes = Vec::with_capacity(g.seqs.len() * g.hq);
    for seq in &g.seqs {
        for h in 0..g.hq {
            slopes.push(g.alibi_slope(seq, h).unwrap_or(0.0));
        }
    }
    if slopes.is_empty() {
        return Ok(None);
    }
    Ok(Some(dev.stream().clone_htod(&slopes).map_err(|e| driver_error("upload ALiBi slopes", e))?))
}

/// The backward kernels' parameters; field for field `BwdParams` in `kernels/flash_bwd.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct BwdParams {
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    dout: u64,
    lse: u64,
    dpsum: u64,
    dq_accum: u64,
    dq_sem: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    cu_seqlens_q: u64,
    cu_seqlens_k: u64,
    strides: [i64; 26],
    batch: i32,
    hq: i32,
    hk: i32,
    group: i32,
    d: i32,
    sq: i32,
    sk: i32,
    total_q: i32,
    total_k: i32,
    k_covered: i32,
    num_m_blocks: i32,
    num_n_blocks: i32,
    causal: i32,
    window_left: i32,
    window_right: i32,
    scale_log2: f32,
    scale: f32,
    deterministic: i32,
    dropout: DropoutParams,
    score_mod: ScoreMod,
    block: BlockMaskParams,
}

/// `DropoutParams` in `kernels/philox.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct DropoutParams {
    seed_lo: u32,
    seed_hi: u32,
    offset: u32,
    threshold: u32,
    scale: f32,
    enabled: i32,
}

impl DropoutParams {
    /// The kernel's view of the geometry's dropout: the same `DropoutRng` the CPU uses, so both
    /// draw the same keep mask.
    fn of(g: &Geometry<'_>) -> Self {
        match g.dropout {
            Some(d) if d.p > 0.0 => {
                let rng = DropoutRng::new(d.p, d.seed, d.offset);
                let [seed_lo, seed_hi] = rng.key();
                Self {
                    seed_lo,
                    seed_hi,
                    offset: rng.offset(),
                    threshold: rng.threshold(),
                    scale: rng.scale(),
                    enabled: 1,
                }
            }
            _ => Self::default(),
        }
    }
}

// SAFETY: plain old data with the C layout of the kernel's `FwdParams` (pointers as u64).
unsafe impl DeviceRepr for FwdParams {}
// SAFETY: plain old data with the C layout of the kernel's `BwdParams` (pointers as u64).
unsafe impl DeviceRepr for BwdParams {}

/// The warp-specialised backward's parameters ([`BwdVariant::ws`]); field for field `BwdWsParams`
/// in `kernels/flash_bwd.cuh`.
#[repr(C, align(128))]
#[derive(Debug, Clone, Copy)]
struct BwdWsParams {
    q: TmaDesc,
    k: TmaDesc,
    v: TmaDesc,
    dout: TmaDesc,
    /// The f32 dQ accumulator, for the TMA's reductions.
    dq: TmaDesc,
    base: BwdParams,
    /// The tile scheduler's counter: one `i32` of the scratch, zero at launch.
    next_tile: u64,
    /// The block-mask variant's tile list (`flash_bwd_ws_tiles` writes it), or 0.
    tile_list: u64,
    /// `i32`s a row of the tile list.
    tile_stride: i64,
    /// The tile order's chunk of (sequence, kv head)s ([`backward_chunk_kv_heads`]), or 0.
    longest_first: i32,
}

// SAFETY: plain-old-data `#[repr(C)]`, mirrored by the kernel.
unsafe impl DeviceRepr for BwdWsParams {}

/// Why the CUDA kernels cannot run this problem, if they cannot; else the compiled tile width
/// that runs its head dim.
pub(crate) fn check_supported(g: &Geometry<'_>, dtype: DType, backward: bool) -> Result<usize> {
    let pass = if backward { "backward" } else { "forward" };
    let unsupported = |what: &str| Err(Error::Unsupported(format!("the CUDA {pass} does not support {what} yet")));
    if dtype == DType::F32 {
        return unsupported("f32 inputs (use f16 or bf16)");
    }
    if g.d != g.dv {
        return unsupported(&format!("d = {} with dv = {}", g.d, g.dv));
    }
    if !g.d.is_multiple_of(8) {
        return unsupported(&format!("head dim {} (a multiple of 8 is needed)", g.d));
    }
    let backend = if backward { "cuda backward (multiples of 8)" } else { "cuda forward (multiples of 8)" };
    padded_head_dim(g.d, backward).ok_or(Error::HeadDim { tensor: "q", dim: g.d, backend, min: 8, max: 256 })
}

/// The forward variant for this problem on `arch` ([`Variant::for_problem`]), or why the CUDA
/// forward cannot run it.
pub(crate) fn supported(g: &Geometry<'_>, dtype: DType, arch: &Arch) -> Result<Variant> {
    check_supported(g, dtype, false)?;
    // The Hopper kernels have tile widths between the mma.sync ones (96, 192).
    let width = tile_width(g.d, false, arch.has_wgmma())
        .ok_or_else(|| Error::Unsupported(format!("no forward tile width for d = {}", g.d)))?;
    // The warp-specialised kernel takes fixed-length batches with keys and a positive scale (it
    // takes the row max of the raw scores and scales it after).
    // With a block mask, its tile list (128-row items of 128-key tiles) within its budget.
    let list_bytes = |g: &Geometry<'_>| 4 * g.max_sq.div_ceil(128) * g.seqs.len() * g.hq * ws_tile_stride(g, 64);
    let ws_ok =
        !g.varlen && g.max_sk > 0 && g.scale > 0.0 && (g.block.is_none() || list_bytes(g) <= WS_TILE_LIST_BUDGET);
    let variant = Variant::for_problem(arch, dtype, width, needs_extras(g), ws_ok)
        .ok_or_else(|| Error::Unsupported(format!("no forward kernel for {dtype}")))?;
    // Three consumer warpgroups where there are enough query rows to fill 192-row blocks: where
    // every work item has the same length (no causal rule, no window) from s = 1152 (1.03-1.13x
    // two at 1152-1536, session 44; level at 512 and 1024, session 43; 1.03-1.11x from 2048,
    // session 41, and 1.05-1.08x more with items fused, session 42; with dropout from 1280:
    // 1.01-1.09x at 1280-2048, session 44), and
    // under a causal rule without a window or optional path from s = 8192 (1.05-1.10x; 0.97x at
    // 2048, 1.02x at 4096: the 192-row blocks' diagonal tiles hide more of their scores).
    let three = if uniform_items(g) {
        let min_rows =
            if variant.extras == ExtraPaths::NONE { THREE_GROUPS_MIN_ROWS } else { THREE_GROUPS_DROPOUT_MIN_ROWS };
        g.max_sq >= min_rows
    } else {
        g.window.is_none() && variant.extras == ExtraPaths::NONE && g.max_sq >= THREE_GROUPS_CAUSAL_MIN_ROWS
    };
    // Block masks of blocks 64 to 127 keys wide: key tiles of 64 on the warp-specialised kernel.
    let narrow = variant.ws
        && variant.extras == crate::cuda::WS_BLOCKS
        && g.block.as_ref().is_some_and(|b| NARROW_TILE_BLOCK_KEYS.contains(&b.block_k));
    if narrow {
        return Ok(Variant { bc: 64, ..variant });
    }
    Ok(match variant.three_groups() {
        Some(wide) if three => wide,
        _ => variant,
    })
}

/// Mask block widths (keys) for which a block-masked problem runs on the warp-specialised
/// forward's 64-key tiles ([`Variant::hopper_ws_narrow_blocks_for`]). H200, bf16 4 × 16 × 4096²,
/// d 128, forward (session 49, 2 rounds): 64 × 64 blocks at 25% 0.74 ms on 64-key tiles against
/// 0.92 on 128 (a 64-key tile is skipped at 56% where a 128-key one at 32%), causal at 50% 0.59
/// against 0.61; narrower blocks leave every tile partly on either way, and the narrow tiles
/// then lose (32 × 32 at 25% 1.41 against 1.22, 16 × 16 1.54 against 1.22). 65-127: not measured.
const NARROW_TILE_BLOCK_KEYS: std::ops::Range<usize> = 64..128;

/// Query rows from which a problem without a causal rule, window or optional path runs on the
/// warp-specialised forward's three consumer warpgroups ([`Variant::three_groups`]). H100, bf16,
/// d 64, two's time over three's (3 rounds, session 44): 1152 1.13, 1280 1.07, 1408 1.03, 1536
/// 1.12; at 1024 level (session 43). 1025-1151 not measured: two.
const THREE_GROUPS_MIN_ROWS: usize = 1152;

/// The same with dropout (the one optional path that has the three-warpgroup shape): 1280 1.04,
/// 1536 1.09, 1792 1.01, 2048 1.06 (session 44); below 1280 not measured.
const THREE_GROUPS_DROPOUT_MIN_ROWS: usize = 1280;

/// Query rows from which a causal problem without a window or optional path runs on the
/// warp-specialised forward's three consumer warpgroups.
const THREE_GROUPS_CAUSAL_MIN_ROWS: usize = 8192;

/// Whether every query block of a (sequence, head) has the same keys to visit: no causal rule and
/// no window, so the warp-specialised forward's work items are of one length.
fn uniform_items(g: &Geometry<'_>) -> bool {
    g.causal == Causal::None && g.window.is_none()
}

/// Whether the FP8 forward kernel can run this problem (any GPU): what it leaves out is a typed
/// error, said before a device is opened.
pub(crate) fn check_fp8_supported(g: &Geometry<'_>, scales: crate::Fp8Scales) -> Result<Fp8Variant> {
    let unsupported = |what: &str| Err(Error::Unsupported(format!("the CUDA FP8 forward does not support {what} yet")));
    if g.varlen {
        return unsupported("varlen batches");
    }
    let extras = needs_extras(g);
    if extras.any() {
        let used: Vec<&str> = [
            (extras.dropout, "dropout"),
            (extras.softcap, "softcap"),
            (extras.alibi, "ALiBi"),
            (extras.blocks, "block masks"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        return unsupported(&used.join(", "));
    }
    if g.d != g.dv {
        return unsupported(&format!("d = {} with dv = {}", g.d, g.dv));
    }
    // The kernels take the row max of the raw scores and scale it after (one multiply an element
    // less), which needs the combined factor positive and a normal f32.
    let factor = fp8_scale_log2(g, scales);
    if !(factor.is_finite() && factor >= f32::MIN_POSITIVE) {
        return unsupported(&format!(
            "a softmax scale times descale_q times descale_k of {} (it must be positive and a normal f32)",
            f64::from(g.scale) * f64::from(scales.q) * f64::from(scales.k)
        ));
    }
    let variant = Fp8Variant::for_head_dim(g.d).ok_or(Error::HeadDim {
        tensor: "q",
        dim: g.d,
        backend: "cuda fp8 forward (multiples of 16)",
        min: 16,
        max: 256,
    })?;
    // The tile scheduler where items differ in length (`Fp8Variant::scheduled`).
    Ok(Fp8Variant { scheduled: !uniform_items(g), ..variant })
}

/// The FP8 kernels' exp2 scale of a raw e4m3 score: softmax scale · descale_q · descale_k · log2 e,
/// computed in f64 and rounded once.
fn fp8_scale_log2(g: &Geometry<'_>, scales: crate::Fp8Scales) -> f32 {
    (f64::from(g.scale) * f64::from(scales.q) * f64::from(scales.k) * std::f64::consts::LOG2_E) as f32
}

/// A caller's kernel variant of the warp-specialised kind must have a shape its kernel is
/// written for (two consumer warpgroups of 64 rows, 128 keys a tile, or three where
/// `three_ok`: [`Variant::three_groups`]; 64 keys where `narrow_ok`:
/// [`Variant::hopper_ws_narrow_blocks_for`]): another shape would leave it waiting for a producer
/// or a warpgroup that does not exist, or spill.
pub(crate) fn check_ws_shape(
    name: &str,
    ws: bool,
    (warps, mt, bc): (usize, usize, usize),
    three_ok: bool,
    narrow_ok: bool,
) -> Result<()> {
    let warps_ok = warps == 8 || (warps == 12 && three_ok);
    let bc_ok = bc == 128 || (bc == 64 && narrow_ok);
    if ws && (!warps_ok || mt != 1 || !bc_ok) {
        return Err(Error::Unsupported(format!(
            "variant {name}: the warp-specialised kernel runs 8 consumer warps (12 at d = 64 without \
             softcap, 16-bit inputs), 16 rows each, 128 keys a tile (64 with block masks alone)"
        )));
    }
    Ok(())
}

/// The FP8 forward variant for this problem on `arch`, or why it cannot run there.
pub(crate) fn fp8_supported(g: &Geometry<'_>, arch: &Arch, scales: crate::Fp8Scales) -> Result<Fp8Variant> {
    let variant = check_fp8_supported(g, scales)?;
    if !variant.runs_on(arch) {
        return Err(Error::Unsupported(format!(
            "the CUDA FP8 forward needs sm_90a (Hopper's 8-bit warpgroup MMAs); this GPU is {}",
            arch.0
        )));
    }
    Ok(variant)
}

/// The backward variant for this problem, or why the CUDA backward cannot run it.
pub(crate) fn supported_backward(g: &Geometry<'_>, dtype: DType, arch: &Arch) -> Result<BwdVariant> {
    let width = check_supported(g, dtype, true)?;
    // (No query rows: the other kernel, which only writes zero dk and dv, and needs no tensor map
    // of the empty q and dout.)
    // With a block mask, the warp-specialised kernel's tile list (an entry a query tile of 64 for
    // each key tile of 128) within its budget.
    let list_bytes = 4 * g.max_sk.div_ceil(128) * g.seqs.len() * g.hk * (g.max_sq.div_ceil(64) + 1);
    let ws_ok = !g.varlen && g.max_sq > 0 && (g.block.is_none() || list_bytes <= WS_TILE_LIST_BUDGET);
    let variant = BwdVariant::for_problem(arch, dtype, width, needs_extras(g), ws_ok)
        .ok_or_else(|| Error::Unsupported(format!("no backward kernel for {dtype}")))?;
    // 80 queries a tile at d = 128 where there are enough query rows (H200, bf16 and f16, the
    // 64-query kernel's time over the 80's, 2 rounds, session 57): without a causal rule 1.03 at
    // 1k, 1.05-1.07 at 2k, 1.06-1.09 at 4k and 16k, 0.94-0.97 at 512; under one 1.03-1.04 at 4k,
    // 1.04-1.09 at 16k, level at 2k and 0.88-0.95 below (80-row tiles end off the 128-key tiles'
    // diagonal). Windows: not measured, 64.
    let min_rows = match (uniform_items(g), g.window) {
        (true, _) => EIGHTY_QUERY_MIN_ROWS,
        (false, None) => EIGHTY_QUERY_CAUSAL_MIN_ROWS,
        (false, Some(_)) => usize::MAX,
    };
    Ok(match variant.eighty_queries() {
        Some(eighty) if g.max_sq >= min_rows => eighty,
        _ => variant,
    })
}

/// Query rows from which a d = 128 backward without a causal rule, window or optional path runs
/// on 80 queries a tile ([`BwdVariant::eighty_queries`]); measured at 512, 1k, 2k, 4k and 16k.
const EIGHTY_QUERY_MIN_ROWS: usize = 1024;

/// The same under a causal rule (no window, no optional path).
const EIGHTY_QUERY_CAUSAL_MIN_ROWS: usize = 4096;

fn i32_of(what: &str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| Error::Unsupported(format!("{what} = {x} exceeds the CUDA kernel's 32-bit range")))
}

/// A window side as the kernel takes it: -1 unbounded; sides past any sequence clamp to -1
/// (they hide nothing).
fn window_side(x: i64) -> i32 {
    if x < 0 || x > i64::from(i32::MAX / 4) {
        -1
    } else {
        x as i32
    }
}

/// Varlen: `cu_seqlens_q` then `cu_seqlens_k` (each `batch + 1` entries, starting at 0) in one
/// device buffer; `None` for fixed-length batches.
fn upload_cu_seqlens(dev: &Device, g: &Geometry<'_>) -> Result<Option<CudaSlice<i32>>> {
    if !g.varlen {
        return Ok(None);
    }
    let mut cq = Vec::with_capacity(g.seqs.len() + 1);
    let mut ck = Vec::with_capacity(g.seqs.len() + 1);
    cq.push(0i32);
    ck.push(0i32);
    for s in &g.seqs {
        cq.push(i32_of("cu_seqlens_q", s.q_start + s.sq)?);
        ck.push(i32_of("cu_seqlens_k", s.k_start + s.sk)?);
    }
    cq.extend(ck);
    Ok(Some(dev.stream().clone_htod(&cq).map_err(|e| driver_error("upload cu_seqlens", e))?))
}

fn strides_of(l: &RowLayout) -> [i64; 3] {
    [l.batch_stride as i64, l.token_stride as i64, l.head_stride as i64]
}

/// cp.async moves 16-byte rows: every row start must be 16-byte aligned.
fn check_alignment(name: &str, ptr: u64, layout: &RowLayout, elem: usize) -> Result<()> {
    let strides = [layout.batch_stride, layout.token_stride, layout.head_stride];
    if !ptr.is_multiple_of(16) || strides.iter().any(|s| !(s * elem).is_multiple_of(16)) {
        return Err(Error::Unsupported(format!(
            "`{name}` must be 16-byte aligned with strides that are multiples of {} elements for the CUDA forward \
             (strides {strides:?})",
            16 / elem
        )));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn forward<T: CudaElement>(
    dev: &Device,
    f: &CudaFunction,
    variant: &Variant,
    g: &Geometry<'_>,
    q: &DeviceTensor<'_, T>,
    k: &DeviceTensor<'_, T>,
    v: &DeviceTensor<'_, T>,
    out: &mut DeviceTensorMut<'_, T>,
    o_layout: RowLayout,
    lse: &mut cudarc::driver::CudaViewMut<'_, f32>,
) -> Result<()> {
    let stream = dev.stream();
    if g.seqs.is_empty() || g.total_q == 0 {
        return Ok(());
    }
    let br = variant.block_rows();
    let (num_m_blocks, blocks) = work_items(g, br, false)?;

    if variant.ws {
        return forward_ws(dev, f, variant, g, (q, k, v), out, o_layout, lse);
    }
    let cu = upload_cu_seqlens(dev, g)?;
    check_extras(g, variant.extras, &variant.name())?;
    let alibi = upload_alibi(dev, g)?;
    let (alibi_ptr, _alibi_sync) = optional_ptr(alibi.as_ref(), stream);
    let score_mod = ScoreMod::new(alibi_ptr, g.softcap, g.scale);
    let block_mask = upload_block_mask(dev, g)?;
    let (block_ptr, _block_sync) = optional_ptr(block_mask.as_ref(), stream);
    let block = block_params(g, block_ptr)?;

    let elem = std::mem::size_of::<T>();
    let (qp, _q_sync) = q.data.device_ptr(stream);
    let (kp, _k_sync) = k.data.device_ptr(stream);
    let (vp, _v_sync) = v.data.device_ptr(stream);
    let (op, _o_sync) = out.data.device_ptr_mut(stream);
    let (lp, _l_sync) = lse.device_ptr_mut(stream);
    check_alignment("q", qp, &g.q, elem)?;
    check_alignment("k", kp, &g.k, elem)?;
    check_alignment("v", vp, &g.v, elem)?;
    check_alignment("out", op, &o_layout, elem)?;
    // cu_seqlens_k follows cu_seqlens_q (batch + 1 entries of 4 bytes) in the same buffer.
    let (cq, _cu_sync) = optional_ptr(cu.as_ref(), stream);
    let ck = if cq == 0 { 0 } else { cq + 4 * (g.seqs.len() as u64 + 1) };

    let bufs = FwdBuffers { q: qp, k: kp, v: vp, o: op, lse: lp };
    let params = FwdParams {
        cu_seqlens_q: cq,
        cu_seqlens_k: ck,
        score_mod,
        block,
        ..FwdParams::of(g, bufs, &o_layout, num_m_blocks)?
    };
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (variant.threads() as u32, 1, 1),
        shared_mem_bytes: variant.smem_bytes() as u32,
    };
    let mut builder = stream.launch_builder(f);
    builder.arg(&params);
    // SAFETY: the parameter block matches the kernel's `FwdParams`; every pointer in it is a live
    // device buffer checked (through `Geometry`) to hold every element the kernel touches, and
    // the sync guards above keep them ordered on this stream until the launch is enqueued.
    unsafe { builder.launch(cfg) }.map_err(|e| driver_error("launch flash_fwd", e))?;
    fill_varlen_tail(stream, g, (op, o_layout, elem), lp)
}

/// The FP8 forward's kernels: `flash_fwd_fp8` and the V transpose it reads.
#[derive(Clone)]
pub(crate) struct Fp8Functions {
    pub forward: CudaFunction,
    pub transpose_v: CudaFunction,
}

/// The FP8 kernel's parameters; field for field `Fp8FwdParams` in `kernels/flash_fwd_fp8.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Fp8FwdParams {
    base: FwdParams,
    v_descale: f32,
}

/// `Fp8TransposeParams` in `kernels/flash_fwd_fp8.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Fp8TransposeParams {
    v: u64,
    vt: u64,
    v_batch: i64,
    v_row: i64,
    v_head: i64,
    vt_plane: i64,
    hk: i32,
    sk: i32,
    d: i32,
    sk_pad: i32,
}

/// `TmaDesc` in `kernels/tma.cuh`: a `CUtensorMap`'s 128 bytes, 128-byte aligned.
#[repr(C, align(128))]
#[derive(Debug, Clone, Copy)]
struct TmaDesc([u64; 16]);

/// The warp-specialised kernel's parameters (FP8 and 16-bit); field for field `WsParams` in
/// `kernels/flash_fwd_ws.cuh`.
#[repr(C, align(128))]
#[derive(Debug, Clone, Copy)]
struct WsParams {
    q: TmaDesc,
    k: TmaDesc,
    v: TmaDesc,
    f: Fp8FwdParams,
    /// The tile scheduler's counter: one `i32` on the device, zero at launch.
    next_item: u64,
    /// The block-mask variant's tile list (`flash_fwd_ws_tiles` writes it), or 0.
    tile_list: u64,
    /// `i32`s a row of the tile list.
    tile_stride: i64,
}

/// The warp-specialised kernels' tile-scheduler counter: one zeroed `i32` for one launch,
/// allocated on the stream (freed there after the kernel).
fn scheduler_counter(stream: &std::sync::Arc<CudaStream>) -> Result<cudarc::driver::CudaSlice<i32>> {
    stream.alloc_zeros::<i32>(1).map_err(|e| driver_error("alloc the tile scheduler's counter", e))
}

/// A TMA descriptor for an e4m3 tensor at `ptr` with sizes `dims` (innermost first, in elements),
/// byte strides `strides` of the outer dimensions, copied in boxes of `boxes` elements, 128-byte
/// swizzled (the layout the warpgroup MMAs read); elements outside the tensor read as zero.
fn tensor_map(what: &str, ptr: u64, dims: &[u64], strides: &[u64], boxes: &[u32]) -> Result<TmaDesc> {
    tensor_map_of(what, ptr, 1, dims, strides, boxes)
}

/// [`tensor_map`] for elements of `elem` bytes: 1 or 2 (integers: e4m3, bf16, f16 move as
/// bits), or 4 (`f32`, for the TMA's reductions).
fn tensor_map_of(what: &str, ptr: u64, elem: usize, dims: &[u64], strides: &[u64], boxes: &[u32]) -> Result<TmaDesc> {
    use cudarc::driver::sys;
    let rank = dims.len();
    let data_type = match elem {
        1 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        2 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
        4 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        _ => {
            return Err(Error::Unsupported(format!(
                "`{what}`: TMA descriptors here take 1-, 2- or 4-byte elements, not {elem}"
            )))
        }
    };
    if strides.len() + 1 != rank || boxes.len() != rank || strides.iter().any(|&s| s % 16 != 0 || s >= 1 << 40) {
        return Err(Error::Unsupported(format!(
            "`{what}`: strides {strides:?} cannot be described to the TMA (multiples of 16 bytes below 2^40)"
        )));
    }
    let elem_strides = vec![1u32; rank];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every array has `rank` entries (`strides` rank - 1), as the call reads; the driver
    // only encodes the descriptor (the address is not dereferenced here).
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            data_type,
            rank as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::CudaLaunch(format!("cuTensorMapEncodeTiled for `{what}`: {r:?}")));
    }
    Ok(TmaDesc(map.opaque))
}

// SAFETY: plain-old-data `#[repr(C)]` structs of integers and floats, mirrored by the kernels.
unsafe impl DeviceRepr for WsParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for Fp8FwdParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for Fp8TransposeParams {}

/// FP8 forward: transposes V into the key-permuted Vᵀ planes the kernel reads (a buffer of
/// `batch · hk · tile width · sk` rounded up to 128 keys, bytes, allocated for the call on the
/// stream), then runs `flash_fwd_fp8`. `q`, `k`, `v` hold e4m3 bytes; `scales` their descale factors.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward_fp8(
    dev: &Device,
    f: &Fp8Functions,
    variant: &Fp8Variant,
    g: &Geometry<'_>,
    (q, k, v): (&DeviceTensor<'_, u8>, &DeviceTensor<'_, u8>, &DeviceTensor<'_, u8>),
    scales: crate::fp8::Fp8Scales,
    out: &mut DeviceTensorMut<'_, half::bf16>,
    o_layout: RowLayout,
    lse: &mut cudarc::driver::CudaViewMut<'_, f32>,
) -> Result<()> {
    let stream = dev.stream();
    if g.seqs.is_empty() || g.total_q == 0 {
        return Ok(());
    }
    let br = variant.block_rows();
    let (num_m_blocks, blocks) = work_items(g, br, true)?;
    let (qp, _q_sync) = q.data.device_ptr(stream);
    let (kp, _k_sync) = k.data.device_ptr(stream);
    let (vp, _v_sync) = v.data.device_ptr(stream);
    let (op, _o_sync) = out.data.device_ptr_mut(stream);
    let (lp, _l_sync) = lse.device_ptr_mut(stream);
    check_alignment("q", qp, &g.q, 1)?;
    check_alignment("k", kp, &g.k, 1)?;
    check_alignment("v", vp, &g.v, 1)?;
    check_alignment("out", op, &o_layout, 2)?;

    // The Vᵀ planes: [batch · hk][tile width][sk_pad]; the transpose writes every byte (zeros for
    // the rows past d and the keys past sk: P·V reads them with P = 0, and 0 · NaN would not be 0).
    let sk_pad = g.max_sk.div_ceil(variant.bc) * variant.bc;
    // With no keys (sk = 0) nothing is transposed and no V tile is read; the planes then keep one
    // zeroed tile of keys so that their descriptor is that of an ordinary problem.
    let keys = sk_pad.max(variant.bc);
    let planes = g.seqs.len() * g.hk;
    let plane = variant.d.checked_mul(keys);
    let Some(vt_len) = plane.and_then(|p| p.checked_mul(planes)).filter(|&n| n <= i64::MAX as usize) else {
        return Err(Error::Unsupported(format!("{planes} transposed V planes of {sk_pad} keys is too large")));
    };
    let plane = variant.d * keys;
    let mut vt = if sk_pad == 0 {
        stream.alloc_zeros::<u8>(vt_len.max(1))
    } else {
        // SAFETY: the buffer is only read by the forward launched after the transpose on this
        // stream, and the transpose's grid writes all of it (every plane, row and key position).
        unsafe { stream.alloc::<u8>(vt_len.max(1)) }
    }
    .map_err(|e| driver_error("alloc transposed v", e))?;
    let (vtp, _vt_sync) = vt.device_ptr_mut(stream);
    let tp = Fp8TransposeParams {
        v: vp,
        vt: vtp,
        v_batch: g.v.batch_stride as i64,
        v_row: g.v.token_stride as i64,
        v_head: g.v.head_stride as i64,
        vt_plane: plane as i64,
        hk: i32_of("hk", g.hk)?,
        sk: i32_of("sk", g.max_sk)?,
        d: i32_of("d", g.d)?,
        sk_pad: i32_of("sk (padded)", keys)?,
    };
    let grid_z = u32::try_from(planes).ok().filter(|&z| z <= 65_535);
    let Some(grid_z) = grid_z else {
        return Err(Error::Unsupported(format!("{planes} (batch x kv head) planes exceed the transpose's grid")));
    };
    // No keys (sk = 0): nothing to transpose; every row sees no key (out 0, lse -inf) and the
    // kernel reads no K or V tile.
    if sk_pad > 0 {
        let cfg = LaunchConfig {
            grid_dim: ((sk_pad / 32) as u32, (variant.d / 128) as u32, grid_z),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = stream.launch_builder(&f.transpose_v);
        builder.arg(&tp);
        // SAFETY: the parameters match `Fp8TransposeParams`; `v` holds every element the geometry
        // checked (rows < sk, columns < d, 16-byte aligned strides), and `vt` was allocated above
        // with `planes` planes of `d_tile` rows of `sk_pad` bytes, the extent the grid covers.
        unsafe { builder.launch(cfg) }.map_err(|e| driver_error("launch fp8_transpose_v", e))?;
    }

    // V is read from the Vᵀ planes: [batch · hk][tile width][keys].
    let bufs = FwdBuffers { q: qp, k: kp, v: vtp, o: op, lse: lp };
    // On the tile scheduler, a causal launch orders its heads in L2-sized chunks, as the 16-bit
    // kernels do (`causal_chunk_heads`, counted in 16-bit bytes: the chunks measured 1.01-1.10x
    // all heads at once from 1k to 16k, against 0.98-1.08x with twice the heads; H100, session 44).
    // Else all heads' longest query blocks first under a causal rule (FwdParams::of): L2-sized
    // head chunks on the fixed stride were slower at 16k keys.
    let scheduled = variant.ws && variant.scheduled;
    let chunked = scheduled && g.causal != Causal::None;
    let defaults = FwdParams::of(g, bufs, &o_layout, num_m_blocks)?;
    let base = FwdParams {
        v_batch: (g.hk * plane) as i64,
        v_row: keys as i64,
        v_head: plane as i64,
        scale_log2: fp8_scale_log2(g, scales),
        longest_first: if chunked { causal_chunk_heads(g) } else { defaults.longest_first },
        ..defaults
    };
    let params = Fp8FwdParams { base, v_descale: scales.v };
    let mut counter = if scheduled { Some(scheduler_counter(stream)?) } else { None };
    let (counter_ptr, _counter_sync) = optional_ptr_mut(counter.as_mut(), stream);
    // The persistent kernel: a block a multiprocessor (fewer for fewer items).
    let grid = if variant.persistent() { blocks.min(multiprocessors(dev)?) } else { blocks };
    let cfg = LaunchConfig {
        grid_dim: (grid as u32, 1, 1),
        block_dim: (variant.threads() as u32, 1, 1),
        shared_mem_bytes: variant.smem_bytes() as u32,
    };
    let mut builder = stream.launch_builder(&f.forward);
    let ws_params;
    if variant.ws {
        let u = |x: usize| x as u64;
        let (rows, bc) = (i32_of("rows", br)? as u32, i32_of("keys a tile", variant.bc)? as u32);
        let (b, d) = (u(g.seqs.len()), u(g.d));
        let q_strides = [u(g.q.token_stride), u(g.q.head_stride), u(g.q.batch_stride)];
        let k_strides = [u(g.k.token_stride), u(g.k.head_stride), u(g.k.batch_stride)];
        // With no keys no K or V tile is read; K's descriptor still needs a size of at least 1.
        let sk = u(g.max_sk.max(1));
        ws_params = WsParams {
            q: tensor_map("q", qp, &[d, u(g.max_sq), u(g.hq), b], &q_strides, &[128, rows, 1, 1])?,
            k: tensor_map("k", kp, &[d, sk, u(g.hk), b], &k_strides, &[128, bc, 1, 1])?,
            v: tensor_map(
                "v (transposed)",
                vtp,
                &[u(keys), u(variant.d), u(planes)],
                &[u(keys), u(plane)],
                &[bc, variant.d as u32, 1],
            )?,
            f: params,
            // Zero: the fixed stride (the kernel built without the scheduler ignores it).
            next_item: counter_ptr,
            tile_list: 0,
            tile_stride: 0,
        };
        builder.arg(&ws_params);
    } else {
        builder.arg(&params);
    }
    // SAFETY: the parameter block matches `Fp8FwdParams`; q, k, out and lse are live buffers the
    // geometry checked to hold every element the kernel touches, the Vᵀ planes were allocated and
    // filled above (freed on the stream after the kernel), and the sync guards keep them ordered
    // on this stream until the launch is enqueued.
    unsafe { builder.launch(cfg) }.map_err(|e| driver_error(&format!("launch {}", variant.entry()), e))?;
    Ok(())
}

/// A forward's query tiles of `br` rows a (sequence, head) and its work items (tiles × heads),
/// or an error where the items do not fit the kernels' `i32` indices: below `i32::MAX`, or half
/// of it for a `persistent` kernel, whose loop steps an item index by the grid.
fn work_items(g: &Geometry<'_>, br: usize, persistent: bool) -> Result<(usize, usize)> {
    let num_m_blocks = g.max_sq.div_ceil(br);
    let heads = g.seqs.len() * g.hq;
    let limit = if persistent { i32::MAX / 2 } else { i32::MAX } as usize;
    match num_m_blocks.checked_mul(heads).filter(|&n| n <= limit) {
        Some(items) => Ok((num_m_blocks, items)),
        None => Err(Error::Unsupported(format!("{num_m_blocks} query tiles x {heads} heads is too large a grid"))),
    }
}

/// The multiprocessors of `dev`: the grid of a persistent kernel.
fn multiprocessors(dev: &Device) -> Result<usize> {
    let sms = dev
        .context()
        .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| driver_error("multiprocessor count", e))?;
    Ok(usize::try_from(sms).unwrap_or(1).max(1))
}

/// `i32`s a row of the warp-specialised forward's tile list at key tiles of `bc`: a count and an
/// entry for every key tile.
fn ws_tile_stride(g: &Geometry<'_>, bc: usize) -> usize {
    g.max_sk.div_ceil(bc) + 1
}

/// Most bytes of tile list ([`ws_tile_stride`] ints for each work item) a block-masked problem may
/// take to run on the warp-specialised forward; past it, the other Hopper kernel (which
/// classifies its tiles in place).
const WS_TILE_LIST_BUDGET: usize = 256 << 20;

/// The warp-specialised 16-bit forward ([`Variant::ws`]): TMA descriptors of q, k and v, the
/// parameter block, the tile scheduler's counter, a persistent grid. Fixed-length batches with
/// keys and a positive scale, with the optional paths the variant holds (dropout, softcap or a
/// block mask: then a pass before it lists each work item's key tiles with a visible block).
#[allow(clippy::too_many_arguments)]
fn forward_ws<T: CudaElement>(
    dev: &Device,
    f: &CudaFunction,
    variant: &Variant,
    g: &Geometry<'_>,
    (q, k, v): (&DeviceTensor<'_, T>, &DeviceTensor<'_, T>, &DeviceTensor<'_, T>),
    out: &mut DeviceTensorMut<'_, T>,
    o_layout: RowLayout,
    lse: &mut cudarc::driver::CudaViewMut<'_, f32>,
) -> Result<()> {
    let name = variant.name();
    if g.varlen || g.max_sk == 0 || g.scale <= 0.0 || g.scale.is_nan() {
        return Err(Error::Unsupported(format!(
            "variant {name} takes fixed-length batches with keys and a positive softmax scale"
        )));
    }
    check_extras(g, variant.extras, &name)?;
    let stream = dev.stream();
    let br = variant.block_rows();
    let (num_m_blocks, items) = work_items(g, br, true)?;
    let elem = std::mem::size_of::<T>();
    let (qp, _q_sync) = q.data.device_ptr(stream);
    let (kp, _k_sync) = k.data.device_ptr(stream);
    let (vp, _v_sync) = v.data.device_ptr(stream);
    let (op, _o_sync) = out.data.device_ptr_mut(stream);
    let (lp, _l_sync) = lse.device_ptr_mut(stream);
    check_alignment("q", qp, &g.q, elem)?;
    check_alignment("k", kp, &g.k, elem)?;
    check_alignment("v", vp, &g.v, elem)?;
    check_alignment("out", op, &o_layout, elem)?;
    // A block mask where the variant holds one (check_extras refused ALiBi).
    let block_mask = upload_block_mask(dev, g)?;
    let (block_ptr, _block_sync) = optional_ptr(block_mask.as_ref(), stream);
    let base = FwdParams {
        // Softcap where the variant holds it.
        score_mod: ScoreMod::new(0, g.softcap, g.scale),
        block: block_params(g, block_ptr)?,
        // Causal: L2-sized chunks of heads, longest query blocks first within each (fwd_item),
        // which the tile scheduler balances.
        longest_first: if g.causal == Causal::None { 0 } else { causal_chunk_heads(g) },
        ..FwdParams::of(g, FwdBuffers { q: qp, k: kp, v: vp, o: op, lse: lp }, &o_layout, num_m_blocks)?
    };
    // The tile scheduler where items differ in length (a causal rule or a window); items of one
    // length go by the stride (no counter), whose loop measured faster at d 64 (the kernel's
    // `consume`).
    let mut counter = if uniform_items(g) { None } else { Some(scheduler_counter(stream)?) };
    let (counter_ptr, _counter_sync) = optional_ptr_mut(counter.as_mut(), stream);
    // TMA boxes: 64 columns (128 bytes, one swizzle row) by the tile's rows.
    let u = |x: usize| x as u64;
    let (rows, bc) = (i32_of("rows", br)? as u32, i32_of("keys a tile", variant.bc)? as u32);
    let (b, d) = (u(g.seqs.len()), u(g.d));
    let bytes = |l: &RowLayout| [u(l.token_stride * elem), u(l.head_stride * elem), u(l.batch_stride * elem)];
    let params = WsParams {
        q: tensor_map_of("q", qp, elem, &[d, u(g.max_sq), u(g.hq), b], &bytes(&g.q), &[64, rows, 1, 1])?,
        k: tensor_map_of("k", kp, elem, &[d, u(g.max_sk), u(g.hk), b], &bytes(&g.k), &[64, bc, 1, 1])?,
        v: tensor_map_of("v", vp, elem, &[d, u(g.max_sk), u(g.hk), b], &bytes(&g.v), &[64, bc, 1, 1])?,
        f: Fp8FwdParams { base, v_descale: 1.0 },
        next_item: counter_ptr,
        tile_list: 0,
        tile_stride: 0,
    };
    // With a block mask: each item's key tiles with a visible block, listed by a pass of its own
    // on the stream before the forward (its producer and consumers walk the list).
    let mut list = None;
    let params = if block_ptr == 0 {
        params
    } else {
        let stride = ws_tile_stride(g, variant.bc);
        let rows = num_m_blocks * g.seqs.len() * g.hq;
        // SAFETY: `flash_fwd_ws_tiles` writes every row's count and the entries it counts, and the
        // forward, after it on this stream, reads no others.
        let buf = unsafe { stream.alloc::<i32>((rows * stride).max(1)) }
            .map_err(|e| driver_error("alloc the block mask's tile list", e))?;
        let list = list.insert(buf);
        let (lp, _list_sync) = list.device_ptr_mut(stream);
        let params = WsParams { tile_list: lp, tile_stride: stride as i64, ..params };
        let tiles = dev.ws_tiles_function(variant)?;
        let cfg =
            LaunchConfig { grid_dim: (rows.div_ceil(4) as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        let mut builder = stream.launch_builder(&tiles);
        builder.arg(&params);
        // SAFETY: the parameter block matches `WsParams`; the kernel reads the block mask (a live
        // buffer the geometry validated for every (sequence, head, query block, key block)) and
        // writes rows · stride ints of the list allocated above.
        unsafe { builder.launch(cfg) }.map_err(|e| driver_error("launch flash_fwd_ws_tiles", e))?;
        params
    };
    let cfg = LaunchConfig {
        grid_dim: (items.min(multiprocessors(dev)?) as u32, 1, 1),
        block_dim: (variant.threads() as u32, 1, 1),
        shared_mem_bytes: variant.smem_bytes() as u32,
    };
    let (_, _list_sync) = optional_ptr_mut(list.as_mut(), stream);
    let mut builder = stream.launch_builder(f);
    builder.arg(&params);
    // SAFETY: the parameter block matches `WsParams`; the tensor maps describe q, k and v
    // within the extents the geometry checked (the TMA reads nothing outside them), out and lse
    // are live buffers holding every element the kernel writes, and the sync guards keep them
    // ordered on this stream until the launch is enqueued.
    unsafe { builder.launch(cfg) }.map_err(|e| driver_error(&format!("launch {}", variant.entry()), e))?;
    Ok(())
}

/// Varlen tokens past the last sequence belong to none: their `out` rows are 0 and their `lse`
/// entries `-inf` (DESIGN §2). The kernel only visits sequences, so those rows are set here, on
/// the stream, whatever the caller's buffers held.
fn fill_varlen_tail(
    stream: &CudaStream,
    g: &Geometry<'_>,
    (op, o, elem): (u64, RowLayout, usize),
    lp: u64,
) -> Result<()> {
    let covered = g.seqs.last().map_or(0, |s| s.q_start + s.sq);
    if !g.varlen || covered >= g.total_q {
        return Ok(());
    }
    let (rows, row_bytes) = (g.total_q - covered, g.dv * elem);
    let memset = |ptr: u64, bytes: usize| {
        // SAFETY: `ptr .. ptr + bytes` lies inside `out`, whose extent the geometry checked.
        unsafe { cudarc::driver::sys::cuMemsetD8Async(ptr, 0, bytes, stream.cu_stream()) }
            .result()
            .map_err(|e| driver_error("zero the rows past the last sequence", e))
    };
    if o.head_stride == g.dv && o.token_stride == g.hq * g.dv {
        memset(op + (covered * o.token_stride * elem) as u64, rows * g.hq * row_bytes)?;
    } else {
        for t in covered..g.total_q {
            for h in 0..g.hq {
                memset(op + ((t * o.token_stride + h * o.head_stride) * elem) as u64, row_bytes)?;
            }
        }
    }
    for h in 0..g.hq {
        let at = lp + (4 * (h * g.total_q + covered)) as u64;
        // SAFETY: `lse` is contiguous `[hq, tq]` (its length checked): `rows` floats per head.
        unsafe { cudarc::driver::sys::cuMemsetD32Async(at, f32::NEG_INFINITY.to_bits(), rows, stream.cu_stream()) }
            .result()
            .map_err(|e| driver_error("set lse past the last sequence", e))?;
    }
    Ok(())
}

/// The three loaded backward kernels of one variant.
#[derive(Debug, Clone)]
pub(crate) struct BwdFunctions {
    pub prep: CudaFunction,
    pub main: CudaFunction,
    pub convert: CudaFunction,
    /// The warp-specialised block-mask variants' tile-list pass (`flash_bwd_ws_tiles`).
    pub ws_tiles: Option<CudaFunction>,
}

/// The inputs and outputs of one backward launch, checked against the geometry.
pub(crate) struct BwdBuffers<'x, 'a, 'dq, 'dk, 'dv, T> {
    pub q: &'x DeviceTensor<'a, T>,
    pub k: &'x DeviceTensor<'a, T>,
    pub v: &'x DeviceTensor<'a, T>,
    pub out: &'x DeviceTensor<'a, T>,
    pub out_layout: RowLayout,
    pub lse: &'x CudaView<'a, f32>,
    pub dout: &'x DeviceTensor<'a, T>,
    pub dout_layout: RowLayout,
    pub dq: &'x mut DeviceTensorMut<'dq, T>,
    pub dq_layout: RowLayout,
    pub dk: &'x mut DeviceTensorMut<'dk, T>,
    pub dk_layout: RowLayout,
    pub dv: &'x mut DeviceTensorMut<'dv, T>,
    pub dv_layout: RowLayout,
}

/// Threads `flash_bwd_prep` and `flash_bwd_convert` give a (token, head) row at tile width `d`,
/// each on 8 columns: the power of two at or above `d / 8`, at most 32 (`PREP_G` in
/// `kernels/flash_bwd.cuh`).
pub(crate) fn aux_row_threads(d: usize) -> usize {
    (d / 8).next_power_of_two().clamp(1, 32)
}

/// Blocks of 256 threads for `rows` rows of [`aux_row_threads`]`(d)` threads each.
fn aux_grid(rows: usize, d: usize) -> Result<u32> {
    let threads = rows.checked_mul(aux_row_threads(d));
    threads
        .and_then(|t| u32::try_from(t.div_ceil(256)).ok())
        .ok_or_else(|| Error::Unsupported(format!("{rows} rows is too large a grid")))
}

/// Where the backward's scratch buffers sit in one allocation (offsets 256-byte aligned):
/// the f32 dQ accumulator (`total_q · hq · w` floats, `w` the tile width: d rounded up to 64,
/// 128 or 256; the kernels address it by rows of `w`) and D (one float per query row and head),
/// both written whole by `flash_bwd_prep` (the accumulator zeroed), then the `i32` semaphores
/// (one per (sequence, head, query tile) in deterministic mode, else one) and the tile counter,
/// zeroed on the stream before it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BwdScratch {
    pub d_offset: usize,
    pub sem_offset: usize,
    /// The warp-specialised kernel's tile-scheduler counter (one `i32`).
    pub counter_offset: usize,
    pub bytes: usize,
}

impl BwdScratch {
    pub(crate) fn of(g: &Geometry<'_>, variant: &BwdVariant, deterministic: bool) -> Self {
        let align = |x: usize| x.div_ceil(256) * 256;
        let accum = 4 * (g.total_q * g.hq * variant.d).max(1);
        let d_offset = align(accum);
        let sem_offset = align(d_offset + 4 * g.lse_len().max(1));
        let num_m_blocks = g.max_sq.div_ceil(variant.br).max(1);
        let sems = if deterministic { g.seqs.len() * g.hq * num_m_blocks } else { 1 };
        let counter_offset = sem_offset + 4 * sems.max(1);
        Self { d_offset, sem_offset, counter_offset, bytes: counter_offset + 4 }
    }
}

/// The backward pass: D (and the dQ accumulator zeroed), then the main kernel, then dq's
/// conversion, all on the device's stream. Scratch memory ([`BwdScratch`]) comes from
/// `workspace` when given, else from a stream-ordered allocation freed after the call's work;
/// either way only its semaphores and counter are zeroed here (a memset of the whole
/// accumulator would be one more pass over it).
pub(crate) fn backward<T: CudaElement>(
    dev: &Device,
    f: &BwdFunctions,
    variant: &BwdVariant,
    g: &Geometry<'_>,
    deterministic: bool,
    x: BwdBuffers<'_, '_, '_, '_, '_, T>,
    workspace: Option<&mut CudaViewMut<'_, u8>>,
) -> Result<()> {
    let stream = dev.stream();
    let elem = std::mem::size_of::<T>();
    let (br, bc) = (variant.br, variant.block_keys());
    let batch = g.seqs.len();
    if variant.ws && g.varlen {
        return Err(Error::Unsupported(format!("variant {} takes fixed-length batches", variant.name())));
    }
    let num_m_blocks = g.max_sq.div_ceil(br).max(1);
    let num_n_blocks = g.max_sk.div_ceil(bc);
    let scratch = BwdScratch::of(g, variant, deterministic);
    let mut owned = None;
    let (base, _ws_sync) = match workspace {
        Some(ws) => {
            if ws.len() < scratch.bytes {
                return Err(Error::BufferLength { tensor: "workspace", expected: scratch.bytes, got: ws.len() });
            }
            // The dQ accumulator is zeroed by `flash_bwd_prep` and D written whole by it: only
            // the semaphores and the counter are zeroed here.
            let mut counters = ws.slice_mut(scratch.sem_offset..scratch.bytes);
            stream.memset_zeros(&mut counters).map_err(|e| driver_error("zero the workspace", e))?;
            let (p, sync) = ws.device_ptr_mut(stream);
            if p % 256 != 0 {
                return Err(Error::Unsupported("the backward's workspace must be 256-byte aligned".into()));
            }
            (p, Some(sync))
        }
        None => {
            // SAFETY: the allocation is stream-ordered; its bytes are written before they are read:
            // the semaphores and the counter by the memset below, the dQ accumulator and D by
            // `flash_bwd_prep`, which runs first on this stream.
            let buf = owned.insert(
                unsafe { stream.alloc::<u8>(scratch.bytes) }
                    .map_err(|e| driver_error("alloc the backward's scratch", e))?,
            );
            let mut counters = buf.slice_mut(scratch.sem_offset..scratch.bytes);
            stream.memset_zeros(&mut counters).map_err(|e| driver_error("zero the backward's scratch", e))?;
            let (p, _) = buf.device_ptr_mut(stream);
            (p, None)
        }
    };
    let cu = upload_cu_seqlens(dev, g)?;
    check_extras(g, variant.extras, &variant.name())?;
    let alibi = upload_alibi(dev, g)?;
    let (alibi_ptr, _alibi_sync) = optional_ptr(alibi.as_ref(), stream);
    let score_mod = ScoreMod::new(alibi_ptr, g.softcap, g.scale);
    let block_mask = upload_block_mask(dev, g)?;
    let (block_ptr, _block_sync) = optional_ptr(block_mask.as_ref(), stream);
    let block = block_params(g, block_ptr)?;

    let (qp, _q_sync) = x.q.data.device_ptr(stream);
    let (kp, _k_sync) = x.k.data.device_ptr(stream);
    let (vp, _v_sync) = x.v.data.device_ptr(stream);
    let (op, _o_sync) = x.out.data.device_ptr(stream);
    let (lp, _l_sync) = x.lse.device_ptr(stream);
    let (dop, _do_sync) = x.dout.data.device_ptr(stream);
    let (dqp, _dq_sync) = x.dq.data.device_ptr_mut(stream);
    let (dkp, _dk_sync) = x.dk.data.device_ptr_mut(stream);
    let (dvp, _dv_sync) = x.dv.data.device_ptr_mut(stream);
    let (accp, dpp, semp) = (base, base + scratch.d_offset as u64, base + scratch.sem_offset as u64);
    for (name, ptr, layout) in [
        ("q", qp, &g.q),
        ("k", kp, &g.k),
        ("v", vp, &g.v),
        ("out", op, &x.out_layout),
        ("dout", dop, &x.dout_layout),
        ("dq", dqp, &x.dq_layout),
        ("dk", dkp, &x.dk_layout),
        ("dv", dvp, &x.dv_layout),
    ] {
        check_alignment(name, ptr, layout, elem)?;
    }
    // cu_seqlens_k follows cu_seqlens_q (batch + 1 entries of 4 bytes) in the same buffer.
    let (cq, _cu_sync) = optional_ptr(cu.as_ref(), stream);
    let ck = if cq == 0 { 0 } else { cq + 4 * (g.seqs.len() as u64 + 1) };
    let (lse_batch, lse_head) = if g.varlen { (0, g.total_q) } else { (g.hq * g.max_sq, g.max_sq) };
    let (window_left, window_right) = g.window.map_or((-1, -1), |(l, r)| (window_side(l), window_side(r)));
    let k_covered = g.seqs.last().map_or(0, |s| s.k_start + s.sk);
    let mut strides = [0i64; 26];
    for (i, l) in [&g.q, &g.k, &g.v, &x.out_layout, &x.dout_layout, &x.dq_layout, &x.dk_layout, &x.dv_layout]
        .into_iter()
        .enumerate()
    {
        strides[3 * i..3 * i + 3].copy_from_slice(&strides_of(l));
    }
    strides[24] = lse_batch as i64;
    strides[25] = lse_head as i64;
    let params = BwdParams {
        q: qp,
        k: kp,
        v: vp,
        o: op,
        dout: dop,
        lse: lp,
        dpsum: dpp,
        dq_accum: accp,
        dq_sem: semp,
        dq: dqp,
        dk: dkp,
        dv: dvp,
        cu_seqlens_q: cq,
        cu_seqlens_k: ck,
        strides,
        batch: i32_of("batch", batch)?,
        hq: i32_of("hq", g.hq)?,
        hk: i32_of("hk", g.hk)?,
        group: i32_of("hq / hk", g.hq / g.hk)?,
        d: i32_of("d", g.d)?,
        sq: i32_of("sq", g.max_sq)?,
        sk: i32_of("sk", g.max_sk)?,
        total_q: i32_of("query tokens", g.total_q)?,
        total_k: i32_of("key tokens", g.total_k)?,
        k_covered: i32_of("key tokens", k_covered)?,
        num_m_blocks: i32_of("query tiles", num_m_blocks)?,
        num_n_blocks: i32_of("key tiles", num_n_blocks)?,
        causal: match g.causal {
            Causal::None => 0,
            Causal::BottomRight => 1,
            Causal::TopLeft => 2,
        },
        window_left,
        window_right,
        scale_log2: g.scale * std::f32::consts::LOG2_E,
        scale: g.scale,
        deterministic: i32::from(deterministic),
        dropout: DropoutParams::of(g),
        score_mod,
        block,
    };
    i32_of("query rows x heads", g.total_q * g.hq)?;
    i32_of("key rows x heads", g.total_k * g.hk)?;

    let rows = g.total_q * g.hq;
    if rows > 0 {
        let cfg =
            LaunchConfig { grid_dim: (aux_grid(rows, variant.d)?, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = stream.launch_builder(&f.prep);
        b.arg(&params);
        // SAFETY: `BwdParams` matches the kernel's; `out`, `dout` and D hold every row the
        // geometry names (checked above), and the guards keep the buffers alive on this stream.
        unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch flash_bwd_prep", e))?;
    }
    let blocks = num_n_blocks * batch * g.hk;
    if blocks > 0 {
        // The warp-specialised kernel is persistent: a block a multiprocessor (fewer for fewer
        // tiles), taking key tiles from the scheduler's counter.
        let blocks = if variant.ws { blocks.min(multiprocessors(dev)?) } else { blocks };
        let grid =
            u32::try_from(blocks).map_err(|_| Error::Unsupported(format!("{blocks} key tiles is too large a grid")))?;
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (variant.threads() as u32, 1, 1),
            shared_mem_bytes: variant.smem_bytes() as u32,
        };
        let key_tiles = num_n_blocks * batch * g.hk;
        let mut ws_params;
        let mut tile_list = None;
        let mut b = stream.launch_builder(&f.main);
        if variant.ws {
            // TMA boxes of 64 columns (one 128-byte swizzle row) by a tile's rows: query tiles of
            // q and dout, key tiles of k and v; rows and columns outside the tensors read as zero.
            let u = |x: usize| x as u64;
            let bytes = |l: &RowLayout| [u(l.token_stride * elem), u(l.head_stride * elem), u(l.batch_stride * elem)];
            let (rows, keys) = (i32_of("rows", br)? as u32, i32_of("keys a tile", bc)? as u32);
            let (bn, d) = (u(batch), u(g.d));
            // (No query: no item reads q or dout, but a tensor map has no empty dimension.)
            let (qd, kd) = ([d, u(g.max_sq.max(1)), u(g.hq), bn], [d, u(g.max_sk), u(g.hk), bn]);
            ws_params = BwdWsParams {
                q: tensor_map_of("q", qp, elem, &qd, &bytes(&g.q), &[64, rows, 1, 1])?,
                k: tensor_map_of("k", kp, elem, &kd, &bytes(&g.k), &[64, keys, 1, 1])?,
                v: tensor_map_of("v", vp, elem, &kd, &bytes(&g.v), &[64, keys, 1, 1])?,
                dout: tensor_map_of("dout", dop, elem, &qd, &bytes(&x.dout_layout), &[64, rows, 1, 1])?,
                // dQaccum, [b][sq][hq][w] (w the tile width) in f32, boxes of 32 columns (128
                // bytes) by a tile's rows; columns past d are outside it.
                dq: tensor_map_of(
                    "dq_accum",
                    accp,
                    4,
                    &[d, u(g.hq), u(g.max_sq.max(1)), bn],
                    &[u(variant.d * 4), u(g.hq * variant.d * 4), u(g.max_sq.max(1) * g.hq * variant.d * 4)],
                    &[32, 1, rows, 1],
                )?,
                base: params,
                next_tile: base + scratch.counter_offset as u64,
                tile_list: 0,
                tile_stride: 0,
                longest_first: backward_chunk_kv_heads(g),
            };
            // With a block mask (not in deterministic mode, where every key tile takes its turn
            // on each query tile's dQ): each key tile's query tiles with a visible block, listed
            // by a pass of its own before the backward.
            if let (Some(tiles_fn), true, false) = (&f.ws_tiles, block_ptr != 0, deterministic) {
                let stride = num_m_blocks + 1;
                // SAFETY: `flash_bwd_ws_tiles` writes every row's count and the entries it counts,
                // and the backward, after it on this stream, reads no others.
                let buf = unsafe { stream.alloc::<i32>((key_tiles * stride).max(1)) }
                    .map_err(|e| driver_error("alloc the block mask's tile list", e))?;
                let list = tile_list.insert(buf);
                let (lp, _list_sync) = list.device_ptr_mut(stream);
                ws_params = BwdWsParams { tile_list: lp, tile_stride: stride as i64, ..ws_params };
                let cfg = LaunchConfig {
                    grid_dim: (key_tiles.div_ceil(4) as u32, 1, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut tb = stream.launch_builder(tiles_fn);
                tb.arg(&ws_params);
                // SAFETY: the parameter block matches `BwdWsParams`; the pass reads the block mask
                // (a live buffer the geometry validated) and writes key_tiles · stride ints of the
                // list allocated above.
                unsafe { tb.launch(cfg) }.map_err(|e| driver_error("launch flash_bwd_ws_tiles", e))?;
            }
            b.arg(&ws_params);
        } else {
            b.arg(&params);
        }
        // SAFETY: as above; the main kernel reads q, k, v, dout, lse and D (the warp-specialised
        // one q, k, v and dout through tensor maps of their extents), writes dk and dv rows of its
        // key tile and adds into the dQ accumulator, all sized by the geometry.
        unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch flash_bwd", e))?;
    }
    let tail = if g.varlen { (g.total_k - k_covered) * g.hk } else { 0 };
    let items = rows.max(tail);
    if items > 0 {
        let cfg =
            LaunchConfig { grid_dim: (aux_grid(items, variant.d)?, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = stream.launch_builder(&f.convert);
        b.arg(&params);
        // SAFETY: as above; writes every dq row and the dk/dv rows of uncovered varlen tokens.
        unsafe { b.launch(cfg) }.map_err(|e| driver_error("launch flash_bwd_convert", e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::AttentionSpec;
    use crate::tensor::Tensor;

    #[test]
    fn auxiliary_backward_grids_give_each_row_its_threads() {
        // `PREP_G` in flash_bwd.cuh: 8, 16, 32 threads at widths 64, 128, 256, each thread on 8
        // columns, so one pass covers a row; groups of a power of two that tile a warp.
        for (d, want) in [(64, 8), (128, 16), (256, 32)] {
            assert_eq!(aux_row_threads(d), want, "width {d}");
        }
        for &d in &crate::cuda::kernels::BWD_HEAD_DIMS {
            let t = aux_row_threads(d);
            assert!(t.is_power_of_two() && t <= 32 && 8 * t >= d, "width {d}: {t} threads");
            for rows in [1usize, 7, 8, 31, 32, 33, 1000, 16384 * 32 + 5] {
                let blocks = aux_grid(rows, d).expect("grid") as usize;
                assert!(blocks * 256 >= rows * t && (blocks - 1) * 256 < rows * t, "{rows} rows at width {d}");
            }
        }
        assert!(matches!(aux_grid(usize::MAX / 4, 256), Err(Error::Unsupported(_))));
        assert!(matches!(aux_grid(1 << 40, 64), Err(Error::Unsupported(_))));
    }

    #[test]
    fn forward_parameters_follow_the_geometry() {
        // Fixed length, strided q (rows of 3 heads' worth: a packed qkv), GQA, a window.
        let (b, sq, sk, hq, hk, d) = (2, 5, 7, 4, 2, 16);
        let q = vec![(); b * sq * 3 * hq * d];
        let kv = vec![(); b * sk * hk * d];
        let qt = Tensor::with_strides(&q, &[b, sq, hq, d], &[sq * 3 * hq * d, 3 * hq * d, d, 1]);
        let kt = Tensor::new(&kv, &[b, sk, hk, d]);
        let spec = AttentionSpec::new().scale(0.5).window(3, 1);
        let g = Geometry::new(&spec, &qt, &kt, &kt).expect("geometry");
        let o = RowLayout { batch_stride: sq * hq * d, token_stride: hq * d, head_stride: d };
        let bufs = FwdBuffers { q: 1, k: 2, v: 3, o: 4, lse: 5 };
        let p = FwdParams::of(&g, bufs, &o, 1).expect("params");
        assert_eq!((p.q, p.k, p.v, p.o, p.lse, p.cu_seqlens_q, p.cu_seqlens_k), (1, 2, 3, 4, 5, 0, 0));
        assert_eq!((p.q_batch, p.q_row, p.q_head), ((sq * 3 * hq * d) as i64, (3 * hq * d) as i64, d as i64));
        assert_eq!((p.k_batch, p.k_row, p.k_head), ((sk * hk * d) as i64, (hk * d) as i64, d as i64));
        assert_eq!((p.v_batch, p.v_row, p.v_head), (p.k_batch, p.k_row, p.k_head));
        assert_eq!((p.o_batch, p.o_row, p.o_head), ((sq * hq * d) as i64, (hq * d) as i64, d as i64));
        assert_eq!((p.lse_batch, p.lse_head), ((hq * sq) as i64, sq as i64));
        assert_eq!((p.batch, p.hq, p.group, p.d, p.sq, p.sk), (2, 4, 2, 16, 5, 7));
        assert_eq!((p.causal, p.window_left, p.window_right, p.longest_first), (0, 3, 1, 0));
        assert_eq!(p.scale_log2, 0.5 * std::f32::consts::LOG2_E);
        let g = Geometry::new(&AttentionSpec::new().causal_mode(Causal::TopLeft), &qt, &kt, &kt).expect("geometry");
        let p = FwdParams::of(&g, bufs, &o, 1).expect("params");
        assert_eq!((p.causal, p.window_left, p.window_right, p.longest_first), (2, -1, -1, (b * hq) as i32));
        // Varlen: lse is [hq, tq].
        let (cu_q, cu_k) = ([0i32, 2, 5], [0i32, 3, 7]);
        let q = vec![(); 5 * hq * d];
        let kv = vec![(); 7 * hk * d];
        let spec = AttentionSpec::new().varlen(&cu_q, &cu_k);
        let g = Geometry::new(
            &spec,
            &Tensor::new(&q, &[5, hq, d]),
            &Tensor::new(&kv, &[7, hk, d]),
            &Tensor::new(&kv, &[7, hk, d]),
        )
        .expect("geometry");
        let o = RowLayout { batch_stride: 0, token_stride: hq * d, head_stride: d };
        let p = FwdParams::of(&g, bufs, &o, 1).expect("params");
        assert_eq!((p.lse_batch, p.lse_head, p.causal, p.longest_first), (0, 5, 0, 0));
    }

    #[test]
    fn hopper_problems_run_on_the_kernels_measured_fastest_for_them() {
        let (b, s, h) = (2, 64, 4);
        let name = |d: usize, spec: AttentionSpec<'_>| {
            let x = vec![(); b * s * h * d];
            let t = Tensor::new(&x, &[b, s, h, d]);
            let g = Geometry::new(&spec, &t, &t, &t).expect("geometry");
            supported(&g, DType::BF16, &Arch("sm_90a".into())).expect("a variant").name()
        };
        let plain = || AttentionSpec::new().causal();
        // Plain, dropout alone and softcap alone: the warp-specialised kernel at 64, 96 (d 72-96)
        // and 128.
        for d in [64, 72, 96, 128] {
            assert!(name(d, plain()).ends_with("_h_ws"), "{}", name(d, plain()));
            assert!(name(d, plain().dropout(0.1, 1, 0)).ends_with("_h_xd_ws"));
            assert!(name(d, plain().softcap(30.0)).ends_with("_h_xs_ws"));
        }
        // Both, or another width: the other Hopper kernel.
        assert!(!name(128, plain().softcap(30.0).dropout(0.1, 1, 0)).ends_with("_ws"));
        assert!(!name(192, plain().dropout(0.1, 1, 0)).ends_with("_ws"));
        assert!(!name(160, plain()).ends_with("_ws"));
        // Sm_80 has no warp-specialised kernel.
        let x = vec![(); b * s * h * 64];
        let t = Tensor::new(&x, &[b, s, h, 64]);
        let spec = plain().dropout(0.1, 1, 0);
        let g = Geometry::new(&spec, &t, &t, &t).expect("geometry");
        assert!(!supported(&g, DType::BF16, &Arch("sm_80".into())).expect("a variant").ws);
    }

    #[test]
    fn the_d_128_backward_runs_long_problems_on_80_query_tiles() {
        let name = |s: usize, d: usize, spec: AttentionSpec<'_>| {
            let x = vec![(); s * 2 * d];
            let t = Tensor::new(&x, &[1, s, 2, d]);
            let g = Geometry::new(&spec, &t, &t, &t).expect("geometry");
            supported_backward(&g, DType::BF16, &Arch("sm_90a".into())).expect("a variant").name()
        };
        let plain = AttentionSpec::new;
        assert_eq!(name(1024, 128, plain()), "flash_bwd_bf16_d128_r80_w8_h_ws");
        assert_eq!(name(16384, 128, plain()), "flash_bwd_bf16_d128_r80_w8_h_ws");
        assert_eq!(name(4096, 128, plain().causal()), "flash_bwd_bf16_d128_r80_w8_h_ws");
        // Shorter, causal below 4096 rows, windowed, with an optional path, another width: 64.
        assert_eq!(name(1023, 128, plain()), "flash_bwd_bf16_d128_r64_w8_h_ws");
        assert_eq!(name(4095, 128, plain().causal()), "flash_bwd_bf16_d128_r64_w8_h_ws");
        assert_eq!(name(4096, 128, plain().window(64, 64)), "flash_bwd_bf16_d128_r64_w8_h_ws");
        assert_eq!(name(4096, 128, plain().dropout(0.1, 1, 0)), "flash_bwd_bf16_d128_r64_w8_h_ws_xd");
        assert_eq!(name(4096, 128, plain().softcap(30.0)), "flash_bwd_bf16_d128_r64_w8_h_ws_xs");
        assert_eq!(name(4096, 120, plain()), "flash_bwd_bf16_d128_r80_w8_h_ws");
        assert_eq!(name(4096, 64, plain()), "flash_bwd_bf16_d64_r128_w8_h_ws");
        // Only the plain warp-specialised d = 128 kernel has the shape.
        for v in BwdVariant::all() {
            let e = v.eighty_queries();
            assert_eq!(e.is_some(), v.ws && v.d == 128 && v.br == 64 && v.extras == ExtraPaths::NONE, "{}", v.name());
            if let Some(e) = e {
                assert!(BwdVariant::all().contains(&e) && e.smem_bytes() <= 232448 - 128, "{}", e.name());
            }
        }
    }

    #[test]
    fn three_consumer_warpgroups_run_long_problems_at_d_64() {
        let name = |s: usize, d: usize, spec: AttentionSpec<'_>| {
            let x = vec![(); s * 2 * d];
            let t = Tensor::new(&x, &[1, s, 2, d]);
            let g = Geometry::new(&spec, &t, &t, &t).expect("geometry");
            supported(&g, DType::F16, &Arch("sm_90a".into())).expect("a variant").name()
        };
        let plain = AttentionSpec::new;
        assert!(name(2048, 64, plain()).ends_with("_w12_h_ws"), "{}", name(2048, 64, plain()));
        assert!(name(1536, 64, plain()).ends_with("_w12_h_ws"), "{}", name(1536, 64, plain()));
        assert!(name(1152, 64, plain()).ends_with("_w12_h_ws"), "{}", name(1152, 64, plain()));
        assert!(name(1280, 64, plain().dropout(0.1, 1, 0)).ends_with("_w12_h_xd_ws"));
        assert!(name(4096, 48, plain().dropout(0.1, 1, 0)).ends_with("_w12_h_xd_ws"));
        assert!(name(2048, 64, plain().dropout(0.1, 1, 0)).ends_with("_w12_h_xd_ws"));
        // Shorter, dropout below 1280 rows, causal below 8192 rows, windowed, softcap or another
        // width: two.
        assert!(name(1024, 64, plain()).ends_with("_w8_h_ws"));
        assert!(name(1151, 64, plain()).ends_with("_w8_h_ws"));
        assert!(name(1279, 64, plain().dropout(0.1, 1, 0)).ends_with("_w8_h_xd_ws"));
        assert!(name(4096, 64, plain().causal()).ends_with("_w8_h_ws"));
        // Causal from 8192 rows, without a window or optional path.
        assert!(name(8192, 64, plain().causal()).ends_with("_w12_h_ws"));
        assert!(name(8192, 64, plain().causal().window(64, 0)).ends_with("_w8_h_ws"));
        assert!(name(8192, 64, plain().causal().dropout(0.1, 1, 0)).ends_with("_w8_h_xd_ws"));
        assert!(name(4096, 64, plain().window(64, 0)).ends_with("_w8_h_ws"));
        assert!(name(4096, 64, plain().softcap(30.0)).ends_with("_w8_h_xs_ws"));
        // Block masks alone: the warp-specialised kernel, on 64-key tiles for blocks 64 to 127
        // keys wide (never three warpgroups).
        let mask = vec![1u8; 4096usize.div_ceil(16) * 4096usize.div_ceil(16)];
        for (block_k, tile) in [(16, "_n128_"), (32, "_n128_"), (64, "_n64_"), (96, "_n64_"), (128, "_n128_")] {
            let blocks = (4096usize.div_ceil(16), 4096usize.div_ceil(block_k));
            let m = Tensor::new(&mask[..blocks.0 * blocks.1], &[blocks.0, blocks.1]);
            let n = name(4096, 64, plain().block_mask(m, 16, block_k));
            assert!(n.ends_with("_w8_h_xb_ws") && n.contains(tile), "{block_k}: {n}");
        }
        assert!(name(4096, 128, plain()).ends_with("_w8_h_ws"));
        // A caller's variant: three warpgroups only where the shape exists.
        for (d, extras) in [(64, ExtraPaths::NONE), (128, ExtraPaths::NONE), (64, crate::cuda::WS_EXTRAS[1])] {
            let two = Variant::hopper_ws_extras_for(DType::BF16, d, extras)
                .or(Variant::hopper_ws_for(DType::BF16, d))
                .expect("a ws variant");
            let three = Variant { warps: 12, ..two };
            let ok = |v: Variant| {
                let narrow = Variant::hopper_ws_narrow_blocks_for(v.dtype, v.d) == Some(v);
                check_ws_shape(&v.name(), v.ws, (v.warps, v.mt, v.bc), v.three_groups() == Some(v), narrow)
            };
            assert!(ok(two).is_ok());
            assert_eq!(ok(three).is_ok(), d == 64 && !extras.softcap, "{}", three.name());
            assert!(ok(Variant { warps: 4, ..two }).is_err());
            assert!(ok(Variant { bc: 64, ..two }).is_err());
            let narrow = Variant::hopper_ws_narrow_blocks_for(DType::BF16, d).expect("a narrow ws variant");
            assert!(ok(narrow).is_ok());
        }
    }

    #[test]
    fn hopper_backward_problems_run_on_the_kernels_measured_fastest_for_them() {
        let (b, s, h) = (2, 64, 4);
        let name = |d: usize, spec: AttentionSpec<'_>, arch: &str| {
            let x = vec![(); b * s * h * d];
            let t = Tensor::new(&x, &[b, s, h, d]);
            let g = Geometry::new(&spec, &t, &t, &t).expect("geometry");
            supported_backward(&g, DType::BF16, &Arch(arch.into())).expect("a variant").name()
        };
        let plain = || AttentionSpec::new().causal();
        // Fixed length, no optional path: the warp-specialised kernel at 64 and 128, deterministic
        // or not.
        for d in [64, 128] {
            assert!(name(d, plain(), "sm_90a").ends_with("_w8_h_ws"), "{}", name(d, plain(), "sm_90a"));
            assert!(name(d, plain().deterministic(), "sm_90a").ends_with("_h_ws"));
            // Dropout alone or softcap alone: the warp-specialised kernel (dropout on 64 queries a
            // tile; softcap on the plain kernel's tile).
            assert!(name(d, plain().dropout(0.1, 1, 0), "sm_90a").ends_with("_r64_w8_h_ws_xd"));
            let br = if d == 64 { 128 } else { 64 };
            assert!(name(d, plain().softcap(30.0), "sm_90a").ends_with(&format!("_r{br}_w8_h_ws_xs")));
            // A block mask alone: the warp-specialised kernel (deterministic too: without its
            // tile list, every item masked), on the plain kernel's tile.
            let mask = vec![1u8; 4];
            let blocks = || plain().block_mask(Tensor::new(&mask, &[2, 2]), 32, 32);
            assert!(name(d, blocks(), "sm_90a").ends_with(&format!("_r{br}_w8_h_ws_xb")));
            assert!(name(d, blocks().deterministic(), "sm_90a").ends_with("_h_ws_xb"));
            assert!(!name(d, blocks(), "sm_80").contains("_ws"));
            // Both, another optional path, or sm_80: the other kernels.
            assert!(!name(d, plain().dropout(0.1, 1, 0).softcap(30.0), "sm_90a").contains("_ws"));
            assert!(!name(d, plain().dropout(0.1, 1, 0), "sm_80").contains("_ws"));
            assert!(!name(d, plain(), "sm_80").contains("_ws"));
        }
        // Every variant the router picks for no optional path or one is one that
        // `BwdVariant::all` builds, which the compile gate and the GPU tests' variant sweeps run
        // (combinations compile on demand: `ExtraPaths::gated`).
        let all = BwdVariant::all();
        for d in [64, 96, 128, 256] {
            for spec in [plain(), plain().dropout(0.1, 1, 0), plain().softcap(30.0)] {
                for (arch, dtype) in [("sm_80", DType::BF16), ("sm_90a", DType::BF16), ("sm_90a", DType::F16)] {
                    let x = vec![(); b * s * h * d];
                    let t = Tensor::new(&x, &[b, s, h, d]);
                    let g = Geometry::new(&spec, &t, &t, &t).expect("geometry");
                    let v = supported_backward(&g, dtype, &Arch(arch.into())).expect("a variant");
                    assert!(all.contains(&v), "{} on {arch} is not built", v.name());
                }
            }
        }
        // Head dims the 128 tile pads take it too (its TMA boxes read zeros past d).
        assert!(name(96, plain(), "sm_90a").ends_with("_d128_r64_w8_h_ws"), "{}", name(96, plain(), "sm_90a"));
        // Tile width 256 (the split kernel: two warpgroups on the same 64 keys), d 160 padded to
        // it too, deterministic or not, with no optional path, dropout alone or softcap alone; not
        // with a block mask, two paths, or on sm_80.
        for d in [160, 256] {
            assert!(name(d, plain(), "sm_90a").ends_with("_d256_r64_w8_h_ws"), "{}", name(d, plain(), "sm_90a"));
            assert!(name(d, plain().deterministic(), "sm_90a").ends_with("_d256_r64_w8_h_ws"));
            assert!(name(d, plain().dropout(0.1, 1, 0), "sm_90a").ends_with("_d256_r64_w8_h_ws_xd"));
            assert!(name(d, plain().softcap(30.0), "sm_90a").ends_with("_d256_r64_w8_h_ws_xs"));
            let mask = vec![1u8; 4];
            let blocks = plain().block_mask(Tensor::new(&mask, &[2, 2]), 32, 32);
            assert!(!name(d, blocks, "sm_90a").contains("_ws"));
            assert!(!name(d, plain().dropout(0.1, 1, 0).softcap(30.0), "sm_90a").contains("_ws"));
            assert!(!name(d, plain(), "sm_80").contains("_ws"));
        }
        // No query rows: the other Hopper kernel (it writes zero dk and dv; no tensor map of q).
        let (xq, xk) = (vec![(); 0], vec![(); b * s * h * 64]);
        let (tq, tk) = (Tensor::new(&xq, &[b, 0, h, 64]), Tensor::new(&xk, &[b, s, h, 64]));
        let g = Geometry::new(&plain(), &tq, &tk, &tk).expect("geometry");
        let v = supported_backward(&g, DType::BF16, &Arch("sm_90a".into())).expect("a variant");
        assert!(v.wgmma && !v.ws, "{}", v.name());
        // Varlen: the other Hopper kernel.
        let x = vec![(); 100 * h * 64];
        let t = Tensor::new(&x, &[100, h, 64]);
        let cu = [0, 40, 100];
        let spec = plain().varlen(&cu, &cu);
        let g = Geometry::new(&spec, &t, &t, &t).expect("geometry");
        let v = supported_backward(&g, DType::BF16, &Arch("sm_90a".into())).expect("a variant");
        assert!(v.wgmma && !v.ws, "{}", v.name());
    }

    #[test]
    fn causal_chunks_hold_the_heads_whose_k_and_v_fit_the_budget() {
        let chunk = |b: usize, sk: usize, hq: usize, hk: usize, d: usize| {
            let q = vec![(); b * 4 * hq * d];
            let kv = vec![(); b * sk * hk * d];
            let g = Geometry::new(
                &AttentionSpec::new().causal(),
                &Tensor::new(&q, &[b, 4, hq, d]),
                &Tensor::new(&kv, &[b, sk, hk, d]),
                &Tensor::new(&kv, &[b, sk, hk, d]),
            )
            .expect("geometry");
            causal_chunk_heads(&g)
        };
        // 16 MiB of K and V: 1k keys of d 128 take 512 KiB a head, so 32 heads of 16 x 16.
        assert_eq!(chunk(16, 1024, 16, 16, 128), 32);
        // GQA: the kv heads fit, the query heads sharing them come along (4 a kv head).
        assert_eq!(chunk(16, 1024, 16, 4, 128), 128);
        // All heads fit: one chunk (the order of all heads' longest first).
        assert_eq!(chunk(2, 1024, 4, 4, 128), 8);
        // One head past the budget: a chunk a head.
        assert_eq!(chunk(1, 65_600, 2, 2, 64), 1);
        // The GPU test `causal_launches_in_head_chunks_meet_the_contract`: two kv heads of 8.2 MB
        // fit, so chunks of four query heads (GQA groups of 2), the last of six short.
        assert_eq!(chunk(1, 16_000, 6, 3, 128), 4);
        assert_eq!(chunk(1, 1 << 20, 4, 1, 256), 4);
    }

    #[test]
    fn backward_chunks_hold_the_kv_heads_whose_queries_fit_the_budget() {
        let chunk = |b: usize, sq: usize, hq: usize, hk: usize, d: usize, causal: bool| {
            let q = vec![(); b * sq * hq * d];
            let kv = vec![(); b * 8 * hk * d];
            let spec = if causal { AttentionSpec::new().causal() } else { AttentionSpec::new() };
            let g = Geometry::new(
                &spec,
                &Tensor::new(&q, &[b, sq, hq, d]),
                &Tensor::new(&kv, &[b, 8, hk, d]),
                &Tensor::new(&kv, &[b, 8, hk, d]),
            )
            .expect("geometry");
            backward_chunk_kv_heads(&g)
        };
        // Without a causal rule, the plain order.
        assert_eq!(chunk(16, 1024, 16, 16, 128, false), 0);
        // 1k queries of d 128: Q and dO (2 x 256 KiB) and the f32 dQ accumulator (512 KiB) a head,
        // so 16 heads in 16 MiB (of the 256 here).
        assert_eq!(chunk(16, 1024, 16, 16, 128, true), 16);
        // GQA: a kv head counts its group's query heads (8 here: 2 kv heads a chunk).
        assert_eq!(chunk(16, 1024, 16, 2, 128, true), 2);
        // All fit: every (sequence, kv head) in one chunk.
        assert_eq!(chunk(2, 512, 4, 4, 64, true), 8);
        // One past the budget: a chunk of one.
        assert_eq!(chunk(1, 40_000, 2, 2, 128, true), 1);
        // The GPU test `causal_backward_in_head_chunks_meets_the_contract`: 650 queries, groups
        // of 8, 5.3 MB a kv head: chunks of three.
        assert_eq!(chunk(2, 650, 16, 2, 128, true), 3);
    }
}
