//! The kernel variants: which embedded sources, with which compile-time tile shape, for which
//! dtype and head dimension.

use super::nvrtc::Arch;
use crate::dtype::DType;

/// The forward kernel's program: helpers first, then the mask rule, the online softmax and the
/// kernel (they carry no `#include`, so they are joined here in dependency order).
pub(crate) fn forward_source() -> String {
    [
        include_str!("kernels/tile.cuh"),
        include_str!("kernels/mask.cuh"),
        include_str!("kernels/philox.cuh"),
        include_str!("kernels/softmax.cuh"),
        include_str!("kernels/wgmma.cuh"),
        include_str!("kernels/flash_fwd.cuh"),
    ]
    .join("\n")
}

/// The backward kernels' program (`flash_bwd_prep`, `flash_bwd`, `flash_bwd_convert`).
pub(crate) fn backward_source() -> String {
    [
        include_str!("kernels/tile.cuh"),
        include_str!("kernels/mask.cuh"),
        include_str!("kernels/philox.cuh"),
        include_str!("kernels/wgmma.cuh"),
        include_str!("kernels/tma.cuh"),
        include_str!("kernels/flash_bwd.cuh"),
    ]
    .join("\n")
}

/// The program of the FP8 and warp-specialised forward kernels: the forward's helpers and
/// parameter block (its own `flash_fwd` entry compiled out by `FA_FWD_ENTRY=0`), the e4m3
/// warpgroup MMAs, the FP8 kernel `flash_fwd_fp8` with the V transpose the FP8 kernels read
/// (`fp8_transpose_v`), the TMA and mbarrier helpers, and `flash_fwd_ws`.
pub(crate) fn ws_forward_source() -> String {
    [
        include_str!("kernels/tile.cuh"),
        include_str!("kernels/mask.cuh"),
        include_str!("kernels/philox.cuh"),
        include_str!("kernels/softmax.cuh"),
        include_str!("kernels/wgmma.cuh"),
        include_str!("kernels/flash_fwd.cuh"),
        include_str!("kernels/wgmma_fp8.cuh"),
        include_str!("kernels/flash_fwd_fp8.cuh"),
        include_str!("kernels/tma.cuh"),
        include_str!("kernels/flash_fwd_ws.cuh"),
    ]
    .join("\n")
}

/// The optional paths a kernel variant has compiled in (the kernels' `FA_EXTRAS` bits): a
/// problem runs on a variant that holds every path it uses and, by default, on the one that holds
/// nothing else, so that one feature's registers and instructions are not paid by problems that
/// use another (docs/cuda-notes.md, "Dropout on 8-bit draws").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ExtraPaths {
    /// Dropout (`d` in a variant's name).
    pub dropout: bool,
    /// The softcap score modifier (`s`).
    pub softcap: bool,
    /// Block-sparse masks (`b`).
    pub blocks: bool,
    /// The ALiBi score bias (`a`): a path of its own, so that softcap alone does not pay its
    /// registers (the Hopper forward at d = 128 keeps its QKᵀ/PV overlap with softcap alone).
    pub alibi: bool,
}

impl ExtraPaths {
    /// No optional path: the plain kernels.
    pub const NONE: ExtraPaths = ExtraPaths { dropout: false, softcap: false, blocks: false, alibi: false };
    /// Every optional path.
    pub const ALL: ExtraPaths = ExtraPaths { dropout: true, softcap: true, blocks: true, alibi: true };

    /// The paths in bit order, with their letters.
    fn paths(self) -> [(bool, char); 4] {
        [(self.dropout, 'd'), (self.softcap, 's'), (self.blocks, 'b'), (self.alibi, 'a')]
    }

    /// How many paths are compiled in.
    pub fn count(self) -> u32 {
        self.paths().iter().map(|p| u32::from(p.0)).sum()
    }

    /// Whether any path is compiled in.
    pub fn any(self) -> bool {
        self.count() > 0
    }

    /// Whether every path of `need` is compiled in.
    pub fn covers(self, need: ExtraPaths) -> bool {
        self.paths().iter().zip(need.paths()).all(|(have, need)| have.0 || !need.0)
    }

    /// The kernels' `FA_EXTRAS` value: bit 0 dropout, 1 softcap, 2 block masks, 3 ALiBi.
    pub fn bits(self) -> u8 {
        self.paths().iter().enumerate().map(|(i, p)| u8::from(p.0) << i).sum()
    }

    /// The part of a variant's name that says which paths it holds: empty for none, else `_x`
    /// and a letter per path, in bit order (`_xd`, `_xs`, `_xb`, `_xa`, `_xdsba`, ...).
    pub fn suffix(self) -> String {
        if !self.any() {
            return String::new();
        }
        let letters = self.paths().into_iter().filter(|l| l.0).map(|l| l.1);
        "_x".chars().chain(letters).collect()
    }

    /// What the compile gate compiles of each shape with optional paths: each path alone, and
    /// all of them (any other combination holds a subset of the code of all four).
    pub fn gated() -> [ExtraPaths; 5] {
        let none = ExtraPaths::NONE;
        [
            ExtraPaths { dropout: true, ..none },
            ExtraPaths { softcap: true, ..none },
            ExtraPaths { blocks: true, ..none },
            ExtraPaths { alibi: true, ..none },
            ExtraPaths::ALL,
        ]
    }
}

/// One compiled instance of the forward kernel (`flash_fwd.cuh`'s compile-time parameters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Variant {
    /// `bf16` or `f16`.
    pub dtype: DType,
    /// Tile width: the head dimension of q, k and v, or the compiled width that pads it.
    pub d: usize,
    /// 16-row tiles per warp: a warp owns `16 · mt` query rows.
    pub mt: usize,
    /// Keys per key/value tile (`Bc`).
    pub bc: usize,
    /// Warps per block.
    pub warps: usize,
    /// The optional paths compiled in (`FA_EXTRAS`); the variants without them keep the plain
    /// path's registers.
    pub extras: ExtraPaths,
    /// Whether this is the Hopper kernel (`FA_WGMMA`: warpgroup MMAs, sm_90a only; `mt` is 1
    /// and `warps` a multiple of 4) rather than the mma.sync kernel that runs on sm_80 and up.
    pub wgmma: bool,
    /// Whether this is the warp-specialised Hopper kernel (`flash_fwd_ws` in
    /// `flash_fwd_ws.cuh`: a TMA producer warpgroup, K and V rings of mbarrier-guarded stages,
    /// two consumer warpgroups (three at d = 64: [`Variant::three_groups`]) taking turns at the
    /// tensor cores, a persistent grid; `warps` counts the consumers). Fixed-length batches,
    /// with no optional path, one of [`WS_EXTRAS`] or [`WS_BLOCKS`].
    pub ws: bool,
}

/// Tile widths the forward kernels are compiled for. A head dim (`d == dv`, a multiple of 8)
/// runs on the smallest width that holds it: the columns past `d` load as zeros and are never
/// stored ([`padded_head_dim`]).
pub const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Tile widths the Hopper forward kernels (sm_90a) are compiled for: [`HEAD_DIMS`] and the widths
/// between them, 96 and 192, so that d 96 (Phi-3) and d 136-192 do not pay a third of their
/// products on zero columns. The tiles sit in shared memory as 64-column blocks, so a 96 tile
/// takes the memory of a 128 one; only the products shrink.
pub const HOPPER_HEAD_DIMS: [usize; 5] = [64, 96, 128, 192, 256];

/// Tile widths the warp-specialised 16-bit Hopper forward is compiled for ([`Variant::ws`]). The
/// 96 tile lies in shared memory as the 128 one does (two 64-column blocks a row), with the
/// products of its own width.
pub const WS_HEAD_DIMS: [usize; 3] = [64, 96, 128];

/// The optional-path sets the warp-specialised kernels (forward and backward) are compiled with
/// besides none: dropout alone and softcap alone.
pub const WS_EXTRAS: [ExtraPaths; 2] = [
    ExtraPaths { dropout: true, softcap: false, blocks: false, alibi: false },
    ExtraPaths { dropout: false, softcap: true, blocks: false, alibi: false },
];

/// The other optional-path set the warp-specialised kernels (forward and backward) are compiled
/// with: block masks alone. A pass before the kernel lists each work item's tiles with a visible
/// mask block (`flash_fwd_ws_tiles`: the key tiles of a query block; `flash_bwd_ws_tiles`: the
/// query tiles of a key tile), so that the producer loads only those and the consumers mask only
/// the tiles whose blocks are not all on.
pub const WS_BLOCKS: ExtraPaths = ExtraPaths { dropout: false, softcap: false, blocks: true, alibi: false };

/// Every optional-path set besides none the warp-specialised kernels are compiled with.
const WS_EXTRA_SETS: [ExtraPaths; 3] = [WS_EXTRAS[0], WS_EXTRAS[1], WS_BLOCKS];

/// Tile widths the backward kernels are compiled for. A warp's dK and dV rows live in registers;
/// at 256 two warps (on Hopper two warpgroups) share the same keys, each holding half the
/// columns ([`BwdVariant::split`]).
pub const BWD_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// The compiled tile width that runs head dim `d` (forward, or backward when `backward`) on the
/// mma.sync kernels: the smallest of [`HEAD_DIMS`] (or [`BWD_HEAD_DIMS`]) that is at least `d`;
/// `None` if `d` is 0, not a multiple of 8 (loads move 16-byte chunks) or wider than the widest.
/// On sm_90a the forward runs [`HOPPER_HEAD_DIMS`] ([`tile_width`]).
pub fn padded_head_dim(d: usize, backward: bool) -> Option<usize> {
    let widths: &[usize] = if backward { &BWD_HEAD_DIMS } else { &HEAD_DIMS };
    smallest_width(widths, d)
}

/// The tile width that runs head dim `d` on the Hopper kernels (`wgmma`) or the mma.sync ones:
/// for the forward on Hopper the smallest of [`HOPPER_HEAD_DIMS`] holding `d`, else
/// [`padded_head_dim`].
pub fn tile_width(d: usize, backward: bool, wgmma: bool) -> Option<usize> {
    if wgmma && !backward {
        smallest_width(&HOPPER_HEAD_DIMS, d)
    } else {
        padded_head_dim(d, backward)
    }
}

fn smallest_width(widths: &[usize], d: usize) -> Option<usize> {
    if d == 0 || !d.is_multiple_of(8) {
        return None;
    }
    widths.iter().copied().find(|&w| w >= d)
}

impl Variant {
    /// Query rows per block (`Br`).
    pub fn block_rows(&self) -> usize {
        self.warps * 16 * self.mt
    }

    /// Threads per block (the warp-specialised kernel adds its producer warpgroup).
    pub fn threads(&self) -> usize {
        self.warps * 32 + if self.ws { 128 } else { 0 }
    }

    /// Columns a row of a Hopper kernel's shared-memory tiles takes: whole 64-column (128-byte)
    /// blocks, so the 96 tile lies as the 128 one does (`DP` in `FlashFwdSm90` and `FlashFwdWs`).
    fn smem_row(&self) -> usize {
        self.d.next_multiple_of(64)
    }

    /// Stages of each of the warp-specialised kernel's K and V rings (`STAGES` in `FlashFwdWs`,
    /// which must agree): 4 where a tile takes at most 16 KiB, else 2.
    pub fn ws_stages(&self) -> usize {
        if self.bc * self.smem_row() * 2 <= 16384 {
            4
        } else {
            2
        }
    }

    /// Dynamic shared memory, 2 bytes an element: the Q tile plus one K and one V tile; the
    /// Hopper kernel keeps two buffers each of K and V in 64-column blocks (a 96 tile takes two,
    /// as a 128 one does), and 1 KiB of slack to align the tiles to the 1024-byte period of the
    /// 128-byte swizzle. The warp-specialised kernel: two Q tiles, its rings, its mbarriers and
    /// the item slots of the Q tiles (32 bytes each).
    pub fn smem_bytes(&self) -> usize {
        if self.ws {
            let stages = self.ws_stages();
            (2 * self.block_rows() + 2 * stages * self.bc) * self.smem_row() * 2 + 8 * (4 + 4 * stages) + 64 + 1024
        } else if self.wgmma {
            (self.block_rows() + 4 * self.bc) * self.smem_row() * 2 + 1024
        } else {
            (self.block_rows() + 2 * self.bc) * self.d * 2
        }
    }

    /// A name that says everything that changes the binary, e.g. `flash_fwd_bf16_d128_m1_n64_w8`
    /// (`_h`: the Hopper kernel, `_x…`: with optional paths, [`ExtraPaths::suffix`]).
    pub fn name(&self) -> String {
        let h = if self.wgmma { "_h" } else { "" };
        let x = self.extras.suffix();
        let ws = if self.ws { "_ws" } else { "" };
        format!("flash_fwd_{}_d{}_m{}_n{}_w{}{h}{x}{ws}", self.dtype.name(), self.d, self.mt, self.bc, self.warps)
    }

    /// The kernel's entry point in its program.
    pub(crate) fn entry(&self) -> &'static str {
        if self.ws {
            "flash_fwd_ws"
        } else {
            "flash_fwd"
        }
    }

    /// Spill bytes that `kernels --compile-all` tolerates for this variant: zero for the plain
    /// kernels and for one optional path on the Hopper kernel. With optional paths at d >= 128,
    /// ptxas spills a few words at 255 registers: 4-36 bytes on the mma.sync kernel (every path,
    /// softcap alone at d = 128 on sm_80, block masks alone at d = 256) and 8-12 bytes on the
    /// Hopper kernel with every path (docs/cuda-notes.md, "Dropout on 8-bit draws"). (The
    /// warp-specialised kernel with softcap at d = 128 spilled 36 bytes of per-item scalars until
    /// softcap ran on `tanh.approx`, session 38; it is held to zero since.) The budget is there
    /// so that a change that spills more, or spills anywhere else, fails. The warp-specialised
    /// kernel's three consumer warpgroups (160 registers a thread) spill 28-32 bytes of per-item
    /// scalars, stored once a launch and read once an item, outside the loop over key tiles.
    pub fn spill_budget(&self) -> u32 {
        if self.ws && self.warps == 12 {
            return 32;
        }
        match (self.wgmma, self.extras.count()) {
            (_, 0) => 0,
            _ if self.d < 128 => 0,
            (false, _) => 40,
            (true, 1) => 0,
            (true, _) => 16,
        }
    }

    /// Whether the variant runs on `arch`: the Hopper kernel needs sm_90a (its warpgroup MMAs
    /// exist on no other target); the mma.sync kernel runs on sm_80 and everything after.
    pub fn runs_on(&self, arch: &Arch) -> bool {
        !self.wgmma || arch.has_wgmma()
    }

    /// NVRTC options selecting this variant.
    pub fn options(&self) -> Vec<String> {
        let mut options = vec![
            "--std=c++17".into(),
            "-Xptxas".into(),
            "-v".into(),
            format!("-DFA_D={}", self.d),
            format!("-DFA_MT={}", self.mt),
            format!("-DFA_BC={}", self.bc),
            format!("-DFA_WARPS={}", self.warps),
            format!("-DFA_BF16={}", u8::from(self.dtype == DType::BF16)),
            format!("-DFA_EXTRAS={}", self.extras.bits()),
            format!("-DFA_WGMMA={}", u8::from(self.wgmma)),
        ];
        if self.extras.any() {
            // Without it ptxas gives the d = 64 mma.sync shape 168 registers and spills.
            options.push("-maxrregcount=255".into());
        }
        if self.ws {
            options.extend(["-DFA_FWD_ENTRY=0".into(), "-DFA_E4M3=0".into(), "-DFA_WS=1".into()]);
        }
        options
    }

    /// The variant a problem runs on by default: on sm_90a, where `ws_ok` (the problem is one the
    /// warp-specialised kernel takes: a fixed-length batch with keys and a positive softmax
    /// scale), the warp-specialised kernel at tile widths 64, 96 and 128 for problems without
    /// optional paths (1.1-1.46x the other Hopper kernel at 64 and 128, 1.31-1.47x at 96), with
    /// dropout alone (1.06-1.25x the other's dropout variant; 1.26-1.38x at 96) and with softcap
    /// alone (1.26-1.28x at 128, 1.30-1.40x at 96; at 64 1.01-1.05x the other kernel's 64-key
    /// tiles since softcap runs on `tanh.approx`) and with a block mask alone (its tiles listed by
    /// a pass before the forward, the empty ones never loaded: at bf16 4 × 16 × 4096², d 128 on an
    /// H200 1.8-2.1× the other kernel's block-mask variant, session 49); docs/cuda-notes.md. Else
    /// [`Variant::extras_on`].
    pub fn for_problem(arch: &Arch, dtype: DType, d: usize, extras: ExtraPaths, ws_ok: bool) -> Option<Variant> {
        if arch.has_wgmma() && ws_ok {
            let ws = if !extras.any() {
                Variant::hopper_ws_for(dtype, d)
            } else {
                Variant::hopper_ws_extras_for(dtype, d, extras)
            };
            if let Some(ws) = ws {
                return Some(ws);
            }
        }
        Variant::extras_on(arch, dtype, d, extras)
    }

    /// The warp-specialised Hopper variant for `dtype` and tile width `d` (64, 96 or 128): 128
    /// query rows (two consumer warpgroups), 128 keys a tile. At d = 64 there is also a shape of
    /// three ([`Variant::three_groups`]).
    pub fn hopper_ws_for(dtype: DType, d: usize) -> Option<Variant> {
        if dtype == DType::F32 || !WS_HEAD_DIMS.contains(&d) {
            return None;
        }
        Some(Variant { dtype, d, mt: 1, bc: 128, warps: 8, extras: ExtraPaths::NONE, wgmma: true, ws: true })
    }

    /// This warp-specialised variant with three consumer warpgroups (192 query rows a block,
    /// FlashAttention-3's shape at d = 64: the softmax of one runs under the products of two),
    /// where that shape exists: at d = 64, plain or with dropout (softcap spills in three
    /// warpgroups' 160 registers a thread). On an H100 it measured 1.03-1.11x the two-warpgroup
    /// shape on problems without a causal rule from s = 2048 (1.10-1.14x at 1536, level at 512 and
    /// 1024, session 43; 1.03-1.13x at 1152-1408, session 44), and 0.84-0.96x on causal ones
    /// ([`Variant::for_problem`] and the launcher choose; docs/cuda-notes.md, session 41).
    pub fn three_groups(&self) -> Option<Variant> {
        (self.ws && self.d == 64 && !self.extras.softcap && !self.extras.blocks)
            .then_some(Variant { warps: 12, ..*self })
    }

    /// The warp-specialised Hopper variant holding the optional paths `extras`, where it has
    /// them: dropout alone or softcap alone ([`WS_EXTRAS`]), block masks alone
    /// ([`WS_BLOCKS`]); [`Variant::for_problem`] says where they are the default.
    pub fn hopper_ws_extras_for(dtype: DType, d: usize, extras: ExtraPaths) -> Option<Variant> {
        if !WS_EXTRAS.contains(&extras) && extras != WS_BLOCKS {
            return None;
        }
        Variant::hopper_ws_for(dtype, d).map(|v| Variant { extras, ..v })
    }

    /// The warp-specialised block-mask variant ([`WS_BLOCKS`]) on key tiles of 64 instead of
    /// 128, for masks whose blocks are 64 to 127 keys wide: a tile is skipped when every block
    /// under its 128 rows and 64 keys is off, where a 128-key tile needs more blocks off.
    pub fn hopper_ws_narrow_blocks_for(dtype: DType, d: usize) -> Option<Variant> {
        Variant::hopper_ws_extras_for(dtype, d, WS_BLOCKS).map(|v| Variant { bc: 64, ..v })
    }

    /// The variant used on `arch` for `dtype` and tile width `d` (one of [`HEAD_DIMS`], or on
    /// sm_90a of [`HOPPER_HEAD_DIMS`]: [`tile_width`]): the Hopper kernel where the target has
    /// warpgroup MMAs ([`Variant::hopper_for`]), else [`Variant::default_for`].
    pub fn default_on(arch: &Arch, dtype: DType, d: usize) -> Option<Variant> {
        if arch.has_wgmma() {
            Variant::hopper_for(dtype, d)
        } else {
            Variant::default_for(dtype, d)
        }
    }

    /// The variant for a problem that uses the optional paths `extras` on `arch` (the plain
    /// [`Variant::default_on`] for none).
    pub fn extras_on(arch: &Arch, dtype: DType, d: usize, extras: ExtraPaths) -> Option<Variant> {
        match (extras.any(), arch.has_wgmma()) {
            (false, _) => Variant::default_on(arch, dtype, d),
            (true, true) => Variant::hopper_extras_for(dtype, d, extras),
            (true, false) => Variant::extras_for(dtype, d, extras),
        }
    }

    /// The Hopper (sm_90a) variant for `dtype` and tile width `d` (one of [`HOPPER_HEAD_DIMS`]),
    /// the fastest measured on an H100 (docs/cuda-notes.md, Hopper v2): two warpgroups (128 query
    /// rows); 64 keys per tile at d = 64 (122 registers: two blocks per multiprocessor), 192 and
    /// 256 (O alone takes 96 and 128 registers a thread), 128 at d = 96 and 128.
    pub fn hopper_for(dtype: DType, d: usize) -> Option<Variant> {
        if dtype == DType::F32 || !HOPPER_HEAD_DIMS.contains(&d) {
            return None;
        }
        let bc = if d == 96 || d == 128 { 128 } else { 64 };
        Some(Variant { dtype, d, mt: 1, bc, warps: 8, extras: ExtraPaths::NONE, wgmma: true, ws: false })
    }

    /// The Hopper variant with the optional paths `extras` compiled in: as
    /// [`Variant::hopper_for`], but at d = 64 128 keys per tile unless the one path is dropout or
    /// softcap (64 keys and two blocks a multiprocessor, as the plain kernel: those fit 128
    /// registers without spilling; block masks, ALiBi or several paths would not).
    pub fn hopper_extras_for(dtype: DType, d: usize, extras: ExtraPaths) -> Option<Variant> {
        let v = Variant::hopper_for(dtype, d)?.with_extras(extras);
        let one = ExtraPaths::NONE;
        let fits_two_blocks =
            [ExtraPaths { dropout: true, ..one }, ExtraPaths { softcap: true, ..one }].contains(&extras);
        Some(if d == 64 && !fits_two_blocks { Variant { bc: 128, ..v } } else { v })
    }

    /// The mma.sync variant (sm_80 and up) used for `dtype` and tile width `d` (one of
    /// [`HEAD_DIMS`]), if supported: the fastest spill-free tile shape measured on an H100
    /// (docs/cuda-notes.md): d = 64, 32 rows
    /// per warp, 64 keys per tile, 4 warps (FlashAttention-2's shape); d = 128, 16 rows per warp,
    /// 128 keys, 8 warps (32 rows per warp spills at d = 128 and was slower from s = 1024 on);
    /// d = 256, 16 rows per warp, 64 keys, 8 warps (128 keys spill).
    pub fn default_for(dtype: DType, d: usize) -> Option<Variant> {
        if dtype == DType::F32 || !HEAD_DIMS.contains(&d) {
            return None;
        }
        let (mt, bc, warps) = match d {
            256 => (1, 64, 8),
            128 => (1, 128, 8),
            _ => (2, 64, 4),
        };
        Some(Variant { dtype, d, mt, bc, warps, extras: ExtraPaths::NONE, wgmma: false, ws: false })
    }

    /// This variant with the optional paths `extras` compiled in.
    pub fn with_extras(self, extras: ExtraPaths) -> Variant {
        Variant { extras, ..self }
    }

    /// The mma.sync variant for a problem that uses the optional paths `extras`: the default shape
    /// with them compiled in, except at d = 64, where that spills on sm_80 (4 B) and 32 keys per
    /// tile does not (3-6% slower on plain attention, measured in v3).
    pub fn extras_for(dtype: DType, d: usize, extras: ExtraPaths) -> Option<Variant> {
        let v = Variant::default_for(dtype, d)?.with_extras(extras);
        Some(if d == 64 { Variant { bc: 32, ..v } } else { v })
    }

    /// Every variant that is compiled by `compile_all` (each for the targets it
    /// [`runs_on`](Variant::runs_on)) and can be benchmarked.
    pub fn all() -> Vec<Variant> {
        let mut v = Vec::new();
        for dtype in [DType::BF16, DType::F16] {
            for d in [96, 192] {
                if let Some(h) = Variant::hopper_for(dtype, d) {
                    v.push(h);
                    v.extend(ExtraPaths::gated().into_iter().filter_map(|x| Variant::hopper_extras_for(dtype, d, x)));
                    v.extend(Variant::hopper_ws_for(dtype, d));
                    v.extend(WS_EXTRA_SETS.into_iter().filter_map(|x| Variant::hopper_ws_extras_for(dtype, d, x)));
                    v.extend(Variant::hopper_ws_narrow_blocks_for(dtype, d));
                }
            }
            for d in HEAD_DIMS {
                // 32 rows per warp (mt 2) at d = 128 holds 128 f32 of O per thread and spills.
                let shapes: &[(usize, usize, usize)] = match d {
                    256 => &[(1, 64, 8)],
                    128 => &[(1, 64, 8), (1, 128, 8)],
                    _ => &[(1, 64, 8), (2, 64, 4), (1, 128, 8), (2, 32, 4)],
                };
                for &(mt, bc, warps) in shapes {
                    v.push(Variant { dtype, d, mt, bc, warps, extras: ExtraPaths::NONE, wgmma: false, ws: false });
                }
                v.extend(ExtraPaths::gated().into_iter().filter_map(|x| Variant::extras_for(dtype, d, x)));
                if let Some(h) = Variant::hopper_for(dtype, d) {
                    v.push(h);
                    v.extend(ExtraPaths::gated().into_iter().filter_map(|x| Variant::hopper_extras_for(dtype, d, x)));
                    // The other key-tile width at d = 64 and 128 (measured slower; kept for bench).
                    if d <= 128 {
                        v.push(Variant { bc: 192 - h.bc, ..h });
                    }
                    let ws: Vec<Variant> = Variant::hopper_ws_for(dtype, d)
                        .into_iter()
                        .chain(WS_EXTRA_SETS.into_iter().filter_map(|x| Variant::hopper_ws_extras_for(dtype, d, x)))
                        .collect();
                    v.extend(&ws);
                    v.extend(ws.iter().filter_map(Variant::three_groups));
                    v.extend(Variant::hopper_ws_narrow_blocks_for(dtype, d));
                }
            }
        }
        v
    }
}

/// One compiled instance of the backward kernels (`flash_bwd.cuh`'s compile-time parameters).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BwdVariant {
    /// `bf16` or `f16`.
    pub dtype: DType,
    /// Tile width: the head dimension of q, k and v, or the compiled width that pads it.
    pub d: usize,
    /// Query rows per tile (`Br`): a multiple of 64, or 80 in the warp-specialised kernel at
    /// `d` = 128 without optional paths (FlashAttention-3's shape there; dQ is then computed
    /// transposed, `SWAP_DQ` in `flash_bwd.cuh`).
    pub br: usize,
    /// Warps per block; each owns 16 keys, so a block holds `16 · warps` keys (`Bc`).
    pub warps: usize,
    /// The optional paths compiled in (`FA_EXTRAS`).
    pub extras: ExtraPaths,
    /// Whether the products run on Hopper's warpgroup MMAs (`FA_WGMMA`, sm_90a only; `warps` a
    /// multiple of 4, a warpgroup's 64 keys per product).
    pub wgmma: bool,
    /// Whether this is the warp-specialised Hopper kernel (`FA_BWD_WS`: a producer warpgroup
    /// more, loading each work item's tiles by TMA into a ring of mbarrier-guarded buffers and
    /// adding each item's dQ tile to the accumulator by TMA reductions, the `warps` consumer warps
    /// without a block-wide barrier an item): `wgmma`, 8 warps, fixed-length batches, tile widths
    /// 64 and 128 (with a block-sparse mask, dropout or softcap as built) and 256 (the split
    /// kernel, [`BwdVariant::split`]: no block mask, and its consumers add dQ with `red`, there
    /// being no room for a dQ tile).
    pub ws: bool,
}

/// Buffers of the warp-specialised backward's ring ([`BwdVariant::ws`]; `FA_BWD_STAGES`).
const BWD_WS_STAGES: usize = 2;

impl BwdVariant {
    /// Warps (Hopper: warpgroups) that share the same keys (`SPLIT` in `flash_bwd.cuh`, which
    /// must agree): 2 at tile widths past 128, where each holds half the columns of dK and dV and
    /// computes Sᵀ and dPᵀ for half the queries; else 1.
    pub fn split(&self) -> usize {
        if self.d > 128 {
            2
        } else {
            1
        }
    }

    /// Keys per block (`Bc`).
    pub fn block_keys(&self) -> usize {
        16 * self.warps / self.split()
    }

    /// Threads per block (the warp-specialised kernel: a producer warpgroup more).
    pub fn threads(&self) -> usize {
        self.warps * 32 + if self.ws { 128 } else { 0 }
    }

    /// Buffers of each item's Q, dO, lse and D: the ring of the warp-specialised kernel, else 2.
    fn stages(&self) -> usize {
        if self.ws {
            BWD_WS_STAGES
        } else {
            2
        }
    }

    /// Whether the kernel leaves each item's dQ product in flight under the next item (the
    /// two-warpgroup Hopper kernel; `DEFER_DQ` in `flash_bwd.cuh`, which must agree), with dSᵀ
    /// double-buffered.
    fn defers_dq(&self) -> bool {
        self.wgmma && self.warps == 8 && self.split() == 1 && !self.ws
    }

    /// Dynamic shared memory: K and V tiles, two buffers each of Q and dO (the warp-specialised
    /// kernel: its ring's), dSᵀ (two buffers in the two-warpgroup Hopper kernel, whose dQ product
    /// runs under the next item's start), Pᵀ where warps share keys ([`BwdVariant::split`]), as
    /// many buffers each of a tile's lse and D, and the warp-specialised kernel's mbarriers. The
    /// Hopper kernel adds 1 KiB to align its tiles to the 128-byte swizzle's 1024-byte period.
    pub fn smem_bytes(&self) -> usize {
        let bc = self.block_keys();
        let align = if self.wgmma { 1024 } else { 0 };
        let ds_buffers = if self.defers_dq() || self.ws { 2 } else { 1 };
        // Pᵀ where warps share keys: two buffers in the warp-specialised kernel, like dSᵀ.
        let p_buffers = if self.split() == 1 {
            0
        } else if self.ws {
            2
        } else {
            1
        };
        let stages = self.stages();
        // The warp-specialised kernel's f32 dQ tile (not in the split one: no room, its consumers
        // add dQ with `red`) and mbarriers.
        let dq_tile = if self.ws && self.split() == 1 { self.br * self.d * 4 } else { 0 };
        let barriers = if self.ws { 8 * (4 + 2 * stages) } else { 0 };
        2 * bc * self.d * 2
            + 2 * stages * self.br * self.d * 2
            + (ds_buffers + p_buffers) * bc * self.br * 2
            + 2 * stages * self.br * 4
            + dq_tile
            + barriers
            + align
    }

    /// A name that says everything that changes the binary, e.g. `flash_bwd_bf16_d128_r64_w4`
    /// (`_h`: the Hopper kernel, `_x…`: with optional paths, [`ExtraPaths::suffix`]).
    pub fn name(&self) -> String {
        let h = if self.wgmma { "_h" } else { "" };
        let ws = if self.ws { "_ws" } else { "" };
        let x = self.extras.suffix();
        format!("flash_bwd_{}_d{}_r{}_w{}{h}{ws}{x}", self.dtype.name(), self.d, self.br, self.warps)
    }

    /// Whether the variant runs on `arch` (the Hopper kernel: sm_90a only).
    pub fn runs_on(&self, arch: &Arch) -> bool {
        !self.wgmma || arch.has_wgmma()
    }

    /// Spill bytes that `kernels --compile-all` tolerates for this variant. Zero, except at
    /// d = 128 on the mma.sync path: a warp's dK and dV accumulators take 128 of the 255
    /// registers, and ptxas spills 24 to 72 bytes of loop-invariant values (tile bases, loop
    /// bounds, read once per query tile) in every arrangement tried (docs/cuda-notes.md, v3 and
    /// backward v3). The budget is there so that a change that spills more, or spills anywhere
    /// else, fails.
    ///
    /// The mma.sync split kernel at d = 256 with all four optional paths on spills 132 B (sm_90a)
    /// to 216 B (sm_80): next to dK and dV (128 registers) it holds Pᵀ, dPᵀ, the keep bits and
    /// the softcap, ALiBi and block-mask operands of one element at once. That variant runs only
    /// problems that combine several optional paths at d > 128 on sm_80-class GPUs; its budget is
    /// 256 B.
    ///
    /// The warp-specialised kernel's producer warp runs on 24 registers (`setmaxnreg`, which
    /// leaves the consumers 240): ptxas spills a few of its per-tile scalars (the scheduler's
    /// loop bounds, hoisted out of the tile loop) there, 8 B at d = 64 and none at d = 128 or 256 (24 and
    /// 4 before the producer passed tiles no query sees on to the consumers, session 49), one
    /// warp's loads and stores once a tile; the consumers spill nothing. Its budget is 32 B.
    pub fn spill_budget(&self) -> u32 {
        if self.ws {
            32
        } else if self.split() > 1 && self.extras == ExtraPaths::ALL && !self.wgmma {
            256
        } else if self.d >= 128 && !self.wgmma {
            80
        } else {
            0
        }
    }

    /// NVRTC options selecting this variant.
    pub fn options(&self) -> Vec<String> {
        vec![
            "--std=c++17".into(),
            "-Xptxas".into(),
            "-v".into(),
            format!("-DFA_D={}", self.d),
            format!("-DFA_BR={}", self.br),
            format!("-DFA_WARPS={}", self.warps),
            format!("-DFA_BF16={}", u8::from(self.dtype == DType::BF16)),
            format!("-DFA_EXTRAS={}", self.extras.bits()),
            format!("-DFA_WGMMA={}", u8::from(self.wgmma)),
            format!("-DFA_BWD_WS={}", u8::from(self.ws)),
            format!("-DFA_BWD_STAGES={}", self.stages()),
        ]
    }

    /// The variant used for `dtype` and head dim `d` on the sm_80 path, if supported: the fastest
    /// measured on an H100 (docs/cuda-notes.md, v3: 64 keys per block, 4 warps, at every length of
    /// the grid); at d = 256, 64 keys on 8 warps, two to each 16 keys ([`BwdVariant::split`]).
    pub fn default_for(dtype: DType, d: usize) -> Option<BwdVariant> {
        if dtype == DType::F32 || !BWD_HEAD_DIMS.contains(&d) {
            return None;
        }
        let warps = if d > 128 { 8 } else { 4 };
        Some(BwdVariant { dtype, d, br: 64, warps, extras: ExtraPaths::NONE, wgmma: false, ws: false })
    }

    /// The Hopper (sm_90a) variant for `dtype` and head dim `d`, the fastest measured on an H100
    /// (docs/cuda-notes.md, Hopper backward): two warpgroups (128 keys); 64 queries per tile at
    /// d = 128, 128 at d = 64 (a warpgroup's piece of dQ is then 64 queries x 64 columns). (The
    /// warp-specialised kernel at d = 128 runs long problems on 80,
    /// [`BwdVariant::eighty_queries`].) One
    /// warpgroup per block (two blocks per multiprocessor), and d = 64 on 64 queries, measured
    /// slower. At d = 256 the two warpgroups share 64 keys ([`BwdVariant::split`]).
    pub fn hopper_for(dtype: DType, d: usize) -> Option<BwdVariant> {
        if dtype == DType::F32 || !BWD_HEAD_DIMS.contains(&d) {
            return None;
        }
        let br = if d == 64 { 128 } else { 64 };
        Some(BwdVariant { dtype, d, br, warps: 8, extras: ExtraPaths::NONE, wgmma: true, ws: false })
    }

    /// The Hopper (sm_90a) variant with the optional paths `extras` (some) compiled in: 64
    /// queries a tile; at d = 64 two warpgroups with Sᵀ and dPᵀ in flight together, at d = 128 one
    /// warpgroup with dPᵀ issued after dV (the other arrangements spill), at d = 256 the two
    /// warpgroups of [`BwdVariant::split`].
    pub fn hopper_extras_for(dtype: DType, d: usize, extras: ExtraPaths) -> Option<BwdVariant> {
        if dtype == DType::F32 || !BWD_HEAD_DIMS.contains(&d) {
            return None;
        }
        let warps = if d == 128 { 4 } else { 8 };
        Some(BwdVariant { dtype, d, br: 64, warps, extras, wgmma: true, ws: false })
    }

    /// The variant used on `arch` for `dtype`, head dim `d` and the optional paths `extras`: on
    /// sm_90a the Hopper kernel ([`BwdVariant::hopper_for`], [`BwdVariant::hopper_extras_for`]),
    /// else [`BwdVariant::default_for`] with them.
    pub fn default_on(arch: &Arch, dtype: DType, d: usize, extras: ExtraPaths) -> Option<BwdVariant> {
        match (arch.has_wgmma(), extras.any()) {
            (true, false) => BwdVariant::hopper_for(dtype, d),
            (true, true) => BwdVariant::hopper_extras_for(dtype, d, extras),
            (false, _) => BwdVariant::default_for(dtype, d).map(|v| v.with_extras(extras)),
        }
    }

    /// The variant for a problem on `arch`: [`BwdVariant::default_on`], or the warp-specialised
    /// kernel ([`BwdVariant::ws`]) where the problem suits it: a fixed-length batch
    /// (`fixed_length`) at tile widths 64 and 128, with no optional path (measured 1.11-1.34x the
    /// other Hopper kernel's backward on an H100, docs/cuda-notes.md) or with dropout alone or
    /// softcap alone ([`WS_EXTRAS`]; measured 1.09-1.44x the other Hopper kernels' backward on an
    /// H100; dropout at d = 64 on 64 queries a tile, where 128 spill its keep bits); at tile
    /// width 256 with no optional path, dropout alone or softcap alone (the split kernel:
    /// 1.05-1.14x, 1.09-1.17x and 1.08-1.13x the other Hopper kernels on an H200, session 51).
    pub fn for_problem(
        arch: &Arch,
        dtype: DType,
        d: usize,
        extras: ExtraPaths,
        fixed_length: bool,
    ) -> Option<BwdVariant> {
        let v = BwdVariant::default_on(arch, dtype, d, extras)?;
        let ws_paths = !extras.any() || WS_EXTRAS.contains(&extras) || extras == WS_BLOCKS;
        // d = 256 (the split kernel): no block mask.
        let ws_width = d == 64 || d == 128 || (d == 256 && !extras.blocks);
        if !(fixed_length && v.wgmma && ws_paths && ws_width) {
            return Some(v);
        }
        let h = BwdVariant::hopper_for(dtype, d)?;
        let br = if extras.dropout { 64 } else { h.br };
        Some(BwdVariant { extras, br, ws: true, ..h })
    }

    /// The same kernel on 80 queries a tile (`FA_BR = 80`: dQ computed transposed, as
    /// FlashAttention-3's d = 128 backward runs without a causal rule), where this variant is the
    /// warp-specialised d = 128 kernel on 64 without optional paths; else `None`.
    pub fn eighty_queries(&self) -> Option<BwdVariant> {
        let fits = self.ws && self.wgmma && self.d == 128 && self.br == 64 && self.warps == 8;
        (fits && self.extras == ExtraPaths::NONE).then_some(BwdVariant { br: 80, ..*self })
    }

    /// This variant with the optional paths `extras` compiled in.
    pub fn with_extras(self, extras: ExtraPaths) -> BwdVariant {
        BwdVariant { extras, ..self }
    }

    /// Every variant that is compiled by `compile_all` and can be benchmarked.
    pub fn all() -> Vec<BwdVariant> {
        let mut v = Vec::new();
        for dtype in [DType::BF16, DType::F16] {
            for d in BWD_HEAD_DIMS {
                // (128, 4) was measured too (docs/cuda-notes.md): slower everywhere and it spills.
                // At d = 256 only the split shape (8 warps, 64 keys) holds dK and dV.
                let shapes: &[(usize, usize)] = if d > 128 { &[(64, 8)] } else { &[(64, 4), (64, 8)] };
                for &(br, warps) in shapes {
                    v.push(BwdVariant { dtype, d, br, warps, extras: ExtraPaths::NONE, wgmma: false, ws: false });
                }
                if let Some(x) = BwdVariant::default_for(dtype, d) {
                    v.extend(ExtraPaths::gated().into_iter().map(|e| x.with_extras(e)));
                }
                if let Some(h) = BwdVariant::hopper_for(dtype, d) {
                    v.push(h);
                    // The warp-specialised kernel, at the tile widths of whole TMA boxes.
                    if d == 64 || d == 128 {
                        v.push(BwdVariant { ws: true, ..h });
                        // d = 128 on 80 queries a tile (dQ computed transposed; no optional path).
                        v.extend(BwdVariant { ws: true, ..h }.eighty_queries());
                        // Dropout alone, softcap alone (WS_EXTRAS): dropout at d = 64 on 64
                        // queries a tile (with 128 its keep bits spill 332 bytes). (Softcap at d =
                        // 64 on 64 queries measured 1.13-1.18x the time of 128: not built.)
                        for e in WS_EXTRA_SETS {
                            let br = if e.dropout && d == 64 { 64 } else { h.br };
                            v.push(BwdVariant { ws: true, extras: e, br, ..h });
                        }
                    }
                    // d = 256: the two consumer warpgroups share 64 keys ([`BwdVariant::split`]);
                    // no optional path, dropout alone, softcap alone (no block mask).
                    if d == 256 {
                        v.push(BwdVariant { ws: true, ..h });
                        for e in WS_EXTRAS {
                            v.push(BwdVariant { ws: true, extras: e, ..h });
                        }
                    }
                    // One warpgroup per block, 64 queries (two blocks per multiprocessor); not at
                    // d = 256, where two warpgroups split the columns.
                    if d <= 128 {
                        v.push(BwdVariant { br: 64, warps: 4, ..h });
                    }
                    // d = 64 on 64 queries a tile (dQ pieces of 32 columns, Sᵀ and dPᵀ in flight
                    // together): correct, measured 9-14% slower than 128 queries.
                    if d == 64 {
                        v.push(BwdVariant { br: 64, ..h });
                    }
                }
                for e in ExtraPaths::gated() {
                    if let Some(x) = BwdVariant::hopper_extras_for(dtype, d, e) {
                        v.push(x);
                    }
                }
                // d = 64 with every optional path on one warpgroup (two blocks per multiprocessor).
                if let Some(x) = BwdVariant::hopper_extras_for(dtype, d, ExtraPaths::ALL).filter(|_| d == 64) {
                    v.push(BwdVariant { warps: 4, ..x });
                }
            }
        }
        v
    }
}

/// Tile widths of the FP8 forward (e4m3 inputs, sm_90a): a row of q or k is one or two 128-byte
/// swizzle rows. Head dims up to 128 run on the 128 tile, up to 256 on the 256 one (multiples of
/// 16: tiles move in 16-byte chunks of 16 elements).
pub const FP8_HEAD_DIMS: [usize; 2] = [128, 256];

/// One compiled instance of the FP8 forward (`flash_fwd_fp8.cuh`): e4m3 q, k, v, bf16 output, on
/// Hopper's 8-bit warpgroup MMAs (sm_90a only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fp8Variant {
    /// Tile width: one of [`FP8_HEAD_DIMS`].
    pub d: usize,
    /// Keys per key/value tile: 128 (a row of the transposed V tile is one 128-byte swizzle row).
    pub bc: usize,
    /// Warps per block, a multiple of 4 (a warpgroup's 64 query rows each); the warp-specialised
    /// kernel adds a producer warpgroup to its two consumer warpgroups.
    pub warps: usize,
    /// Whether this is the warp-specialised kernel (`FA_WS`: TMA loads by a producer warpgroup
    /// into a ring of mbarrier-guarded stages, the consumer warpgroups taking turns at the tensor
    /// cores, a persistent grid) rather than the one whose warps all load and compute
    /// (`cp.async`, a block-wide barrier per key tile, a block per work item).
    pub ws: bool,
    /// Whether the warp-specialised kernel's blocks take work items from the tile scheduler (an
    /// atomic counter; `FA_FP8_SCHED`) and a causal launch orders its heads in L2-sized chunks,
    /// as the 16-bit kernels do: the default where items differ in length (a causal rule or a
    /// window). Items of one length keep the fixed stride: the scheduler's code in the kernel
    /// measured 0.89x at 4k without a causal rule (H100, session 44; docs/cuda-notes.md).
    pub scheduled: bool,
}

impl Fp8Variant {
    /// The variant for head dim `d` (a multiple of 16 up to 256): two warpgroups (128 query rows),
    /// 128 keys a tile, on the smallest of [`FP8_HEAD_DIMS`] holding `d`.
    pub fn for_head_dim(d: usize) -> Option<Fp8Variant> {
        if d == 0 || !d.is_multiple_of(16) {
            return None;
        }
        let width = FP8_HEAD_DIMS.iter().copied().find(|&w| w >= d)?;
        Some(Fp8Variant { d: width, bc: 128, warps: 8, ws: true, scheduled: false })
    }

    /// Query rows per block (the consumer warps' rows in the warp-specialised kernel).
    pub fn block_rows(&self) -> usize {
        self.warps * 16
    }

    /// Threads per block: the warp-specialised kernel adds its producer warpgroup.
    pub fn threads(&self) -> usize {
        self.warps * 32 + if self.ws { 128 } else { 0 }
    }

    /// Stages of each of the warp-specialised kernel's two rings, K and Vᵀ (`STAGES` in
    /// `FlashFwdWs`, which must agree); the other kernel double-buffers.
    pub fn stages(&self) -> usize {
        if !self.ws {
            2
        } else if self.d <= 128 {
            4
        } else {
            2
        }
    }

    /// Dynamic shared memory: the Q tile (two in the warp-specialised kernel, whose producer loads
    /// the next work item's while the consumers finish one) and the stages of K and transposed V
    /// tiles (one byte an element), the warp-specialised kernel's mbarriers and item slots, and
    /// 1 KiB of slack to align the tiles to the 128-byte swizzle's 1024-byte period.
    pub fn smem_bytes(&self) -> usize {
        let (q_tiles, bars) = if self.ws { (2, 8 * (4 + 4 * self.stages()) + 64) } else { (1, 0) };
        (q_tiles * self.block_rows() + 2 * self.stages() * self.bc) * self.d + bars + 1024
    }

    /// Whether the kernel is persistent: a grid of one block a multiprocessor walking the work
    /// items (the warp-specialised kernel), rather than one block an item.
    pub fn persistent(&self) -> bool {
        self.ws
    }

    /// A name that says everything that changes the binary, e.g.
    /// `flash_fwd_fp8e4m3_d128_n128_w8_h_ws` (`_ws`: warp-specialised; `_sched`: on the tile
    /// scheduler).
    pub fn name(&self) -> String {
        let ws = if self.ws { "_ws" } else { "" };
        let sched = if self.ws && self.scheduled { "_sched" } else { "" };
        format!("flash_fwd_fp8e4m3_d{}_n{}_w{}_h{ws}{sched}", self.d, self.bc, self.warps)
    }

    /// The kernel's entry point in its program.
    pub(crate) fn entry(&self) -> &'static str {
        if self.ws {
            "flash_fwd_ws"
        } else {
            "flash_fwd_fp8"
        }
    }

    /// Whether the variant runs on `arch`: e4m3 warpgroup MMAs exist on sm_90a only.
    pub fn runs_on(&self, arch: &Arch) -> bool {
        arch.has_wgmma()
    }

    /// NVRTC options selecting this variant.
    pub fn options(&self) -> Vec<String> {
        vec![
            "--std=c++17".into(),
            "-Xptxas".into(),
            "-v".into(),
            format!("-DFA_D={}", self.d),
            "-DFA_MT=1".into(),
            format!("-DFA_BC={}", self.bc),
            format!("-DFA_WARPS={}", self.warps),
            "-DFA_BF16=1".into(),
            "-DFA_EXTRAS=0".into(),
            "-DFA_WGMMA=1".into(),
            "-DFA_FWD_ENTRY=0".into(),
            "-DFA_E4M3=1".into(),
            format!("-DFA_WS={}", u8::from(self.ws)),
            format!("-DFA_FP8_SCHED={}", u8::from(self.ws && self.scheduled)),
        ]
    }

    /// Every FP8 variant that is compiled by `compile_all`: each width warp-specialised (the
    /// default), on the tile scheduler (the default for causal and windowed problems), and not
    /// warp-specialised (kept for comparison).
    pub fn all() -> Vec<Fp8Variant> {
        let ws = FP8_HEAD_DIMS.iter().filter_map(|&d| Fp8Variant::for_head_dim(d));
        ws.flat_map(|v| [v, Fp8Variant { scheduled: true, ..v }, Fp8Variant { ws: false, ..v }]).collect()
    }
}
