//! The forward loop over one query tile: Algorithm 1 with FlashAttention-2's loop order (the
//! query tile stays put, key/value tiles stream past it).

use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicU8, Ordering};

use super::blocking::{Strides, Tiles};
use super::gemm::{gemm_acc_skipping_zeros, gemm_b, gemm_bf16, BLayout, Bf16Pair, PANEL_WIDTH};
use super::isa::Isa;
use super::lines::{LineVec, Word, LINE_WORDS};
use super::pairs::{narrow_to_pairs, pack_row_pairs, pack_rows, pack_rows_transposed};
use super::softmax::OnlineSoftmax;
use super::tile::{
    load_rows, pack_panels, panels, rows_f32, score_tile, transpose_panels, QkOperands, ScoreMod, PANEL,
};
use super::vexp::scale_row;
use super::Sink;
use crate::dtype::Element;
use crate::mask::TileClass;
use crate::philox::DropoutRng;
use crate::spec::{Geometry, RowLayout};

/// Per-thread scratch: one query tile, one key/value tile, one score tile, one output
/// accumulator — `O(Br·d + Bc·(d + dv) + Br·Bc + Br·dv)` — and the packed key/value tiles of the
/// current work unit, bounded by a byte budget ([`super::blocking::KV_CACHE_BUDGET`] unless a
/// test says otherwise).
pub(super) struct Scratch {
    q: LineVec<f32>,
    k: LineVec<f32>,
    kt: LineVec<f32>,
    v: LineVec<f32>,
    s: LineVec<f32>,
    o: LineVec<f32>,
    softmax: OnlineSoftmax,
    /// `K_jᵀ` tiles of the unit's (sequence, kv head), for the `f32` products, in panels of
    /// [`PANEL_WIDTH`] keys ([`BLayout::panels`] of `d` rows): each GEMM micro-tile reads its
    /// keys' slice as one sequential stream.
    kt_cache: TileCache<f32>,
    /// `V_j` tiles of the unit's (sequence, kv head) in panels of [`PANEL_WIDTH`] columns
    /// ([`BLayout::panels`] of `Bc` rows), for the `f32` product `P·V`, unless `V` is `f32` with
    /// rows at the padded stride (then it is read in place). Read in place, rows a token stride
    /// apart (4 KB at 8 heads of d = 128) are one page per key, and the forward ran 5–9% slower
    /// at s ≥ 2k; inputs of other types are widened once per unit instead of once per query
    /// tile.
    v_cache: TileCache<f32>,
    /// The operand tiles as `bf16` pairs, when the products run on them (then `q`, `k`, `kt`, `v`
    /// and `kt_cache` stay empty).
    pairs: Option<PairTiles>,
}

/// `Q_i`, `K_jᵀ`, `V_j` and `P_ij` in the pair layout of [`gemm_bf16`].
struct PairTiles {
    q: LineVec<Bf16Pair>,
    kt: LineVec<Bf16Pair>,
    v: LineVec<Bf16Pair>,
    p: LineVec<Bf16Pair>,
    kt_cache: TileCache<Bf16Pair>,
    v_cache: TileCache<Bf16Pair>,
}

/// Packed key/value tiles of one (sequence, kv head), filled on first use and reused by every
/// query tile and GQA head of a work unit: each key tile is read and transposed once per unit
/// instead of once per query tile, and tiles a causal unit never visits are never packed.
struct TileCache<E> {
    data: LineVec<E>,
    slot_len: usize,
    filled: Vec<bool>,
}

impl<E: Word> TileCache<E> {
    /// Room for the first `slots` key tiles of `slot_len` elements each (each slot starting a
    /// line), in `old`'s memory where there is one (zeroed, as a fresh allocation).
    fn new_in(old: Option<Self>, slots: usize, slot_len: usize) -> Self {
        let slot_len = slot_len.next_multiple_of(LINE_WORDS);
        let (data, filled) = old.map_or((LineVec::new(), Vec::new()), |c| (c.data, c.filled));
        Self { data: data.into_zeros(slots * slot_len), slot_len, filled: zeros(filled, slots) }
    }

    fn bytes(&self) -> usize {
        self.data.capacity() * std::mem::size_of::<E>() + self.filled.capacity()
    }

    /// Whether key tile `tile` has a cache slot.
    fn holds(&self, tile: usize) -> bool {
        tile < self.filled.len()
    }

    /// Forgets every tile (a new sequence or kv head).
    fn clear(&mut self) {
        self.filled.fill(false);
    }

    /// Key tile `tile`: from the cache, packed there by `fill` on first use; past the cache's
    /// slots, packed into `spill` by `fill` every time. `fill` gets the destination and whether
    /// it is a cache slot (which must then hold the whole key tile, not only the columns the
    /// current query tile sees).
    fn tile<'a>(&'a mut self, tile: usize, spill: &'a mut [E], fill: impl FnOnce(&mut [E], bool)) -> &'a [E] {
        match self.filled.get_mut(tile) {
            Some(filled) => {
                let slot = &mut self.data[tile * self.slot_len..(tile + 1) * self.slot_len];
                if !*filled {
                    fill(slot, true);
                    *filled = true;
                }
                slot
            }
            None => {
                fill(spill, false);
                spill
            }
        }
    }
}

/// `v` as `n` zeros (its memory reused, its contents those of a fresh `vec![0; n]`).
fn zeros<E: Copy + Default>(mut v: Vec<E>, n: usize) -> Vec<E> {
    v.clear();
    v.resize(n, E::default());
    v
}

/// Bytes of forward scratch a thread keeps between calls ([`Pooled`]): the two tile caches at
/// their budget ([`super::blocking::KV_CACHE_BUDGET`] each) and the tiles.
const KEPT_BYTES: usize = 16 << 20;

thread_local! {
    /// This thread's forward scratch from its last call, for the next one.
    static KEPT: RefCell<Option<Scratch>> = const { RefCell::new(None) };
}

/// A thread's forward scratch for one call: built in the memory of the scratch the thread kept
/// from its last call (zeroed, so the same contents as freshly allocated), and kept again when the
/// call's work on the thread ends (up to [`KEPT_BYTES`]). Allocating the key/value tile caches
/// afresh on every call (up to 4 MiB each per thread) faulted their pages in again on every call:
/// about 2 000 page faults a call in `f32` at 8 heads × 16 rows × 4096 keys, d 128, 2 threads.
pub(super) struct Pooled(Scratch);

impl Pooled {
    /// The scratch of [`Scratch::new_in`], in this thread's kept memory.
    pub(super) fn new(g: &Geometry<'_>, t: Tiles, pairs: bool, pack_v: bool, cache_budget: usize) -> Self {
        let old = KEPT.try_with(|k| k.borrow_mut().take()).ok().flatten();
        Pooled(Scratch::new_in(old, g, t, pairs, pack_v, cache_budget))
    }

    pub(super) fn get(&mut self) -> &mut Scratch {
        &mut self.0
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let sc = std::mem::replace(&mut self.0, Scratch::empty());
        if sc.bytes() <= KEPT_BYTES {
            // A thread being torn down keeps nothing.
            let _ = KEPT.try_with(|k| *k.borrow_mut() = Some(sc));
        }
    }
}

/// Most bytes of key/value tiles one call shares between its work units ([`SharedTiles`]); a call
/// that would need more packs per unit instead. The memory is kept for the next call, as the
/// threads keep their scratch ([`Pooled`]).
pub(super) const SHARED_BUDGET: usize = 64 << 20;

/// A shared slot's states: no unit has claimed it, a unit is packing it, it is packed.
const FREE: u8 = 0;
const PACKING: u8 = 1;
const READY: u8 = 2;

/// Key/value tiles shared by the work units of a (sequence, kv head) whose query tiles are split
/// over several units: each such unit would otherwise pack every key tile it visits for itself
/// (`f32` at 1 × 2 heads × 1024², d 128 on 16 threads: eight units a head, each transposing the
/// head's 1024 keys). The first unit to need a tile claims its slot and packs it; a unit that
/// finds it being packed packs another free tile of the same (sequence, kv head) meanwhile, or
/// waits: the units of a pair, which start together, pack its tiles between them, once, with no
/// pass of their own before the units start. A slot holds what a unit's cache slot
/// ([`TileCache`]) holds for the same key tile, packed by the same code, so the results are the
/// same bits either way.
pub(super) struct SharedTiles {
    /// Per `seq · hk + kv_head`: the slot of its first key tile and the key tiles with slots
    /// (those its query rows can see), or `None` (its units pack their own).
    groups: Vec<Option<(usize, Range<usize>)>>,
    /// Per slot: [`FREE`], [`PACKING`] or [`READY`]. A slot is written only by the unit that moved
    /// it from free to packing, and read only after a load that saw it ready (acquire, against the
    /// packer's release).
    state: Vec<AtomicU8>,
    /// `Kᵀ` and `V` slots of the path in use (`f32` panels, or `bf16` pairs), written and read
    /// through raw slices of one slot each (`buffers` owns the memory).
    kt: Sink<f32>,
    v: Sink<f32>,
    pair_kt: Sink<Bf16Pair>,
    pair_v: Sink<Bf16Pair>,
    buffers: SharedBuffers,
    kt_len: usize,
    v_len: usize,
}

/// The buffers of a [`SharedTiles`]: `Kᵀ` and `V` in `f32`, and as `bf16` pairs.
type SharedBuffers = (LineVec<f32>, LineVec<f32>, LineVec<Bf16Pair>, LineVec<Bf16Pair>);

/// Memory of the last call's [`SharedTiles`], kept for the next call (up to [`SHARED_BUDGET`]):
/// growing it on first use is the only time it is zeroed.
static SHARED_KEPT: std::sync::Mutex<Option<SharedBuffers>> = std::sync::Mutex::new(None);

impl SharedTiles {
    /// Slots for the key tiles of the (sequence, kv head) pairs in `shared_groups` (indexed
    /// `seq · hk + kv_head`) that their query rows can see, none packed yet, for the pairs that see
    /// at least `min_tiles` key tiles; no slots at all where they would take more than
    /// [`SHARED_BUDGET`] bytes (every unit then packs its own). `pairs`:
    /// the products run on `bf16` pairs; `pack_v`: the `f32` path packs `V` (else it reads `V` in
    /// place, and only `Kᵀ` is shared).
    pub(super) fn new(
        g: &Geometry<'_>,
        tiles: Tiles,
        shared_groups: &[bool],
        min_tiles: usize,
        pairs: bool,
        pack_v: bool,
    ) -> crate::error::Result<Self> {
        let bc = tiles.bc;
        let panels = |n: usize| n.div_ceil(PANEL_WIDTH) * PANEL_WIDTH;
        let (kt_len, v_len) = if pairs {
            (g.d.div_ceil(2) * bc, bc.div_ceil(2) * g.dv)
        } else {
            (g.d * panels(bc), if pack_v { bc * panels(g.dv) } else { 0 })
        };
        // Every slot starts a line.
        let (kt_len, v_len) = (kt_len.next_multiple_of(LINE_WORDS), v_len.next_multiple_of(LINE_WORDS));
        let mut groups = vec![None; shared_groups.len()];
        let mut slots = 0;
        for (s, seq) in g.seqs.iter().enumerate() {
            for kv_head in 0..g.hk {
                if !shared_groups.get(s * g.hk + kv_head).copied().unwrap_or(false) || seq.sq == 0 {
                    continue;
                }
                let keys = g.visibility(seq, kv_head * (g.hq / g.hk)).key_range(0..seq.sq);
                let tiles = keys.start / bc..keys.end.div_ceil(bc);
                if keys.is_empty() || tiles.len() < min_tiles {
                    continue;
                }
                groups[s * g.hk + kv_head] = Some((slots, tiles.clone()));
                slots += tiles.len();
            }
        }
        if slots == 0 || 4 * slots * (kt_len + v_len) > SHARED_BUDGET {
            return Ok(SharedTiles::none());
        }
        let kept = SHARED_KEPT.try_lock().ok().and_then(|mut k| k.take());
        let (kt, v, pair_kt, pair_v) = kept.unwrap_or_default();
        let (f32_len, pair_len) = if pairs { (0, slots) } else { (slots, 0) };
        let mut buffers = (
            resized(kt, f32_len * kt_len, "shared key tiles")?,
            resized(v, f32_len * v_len, "shared value tiles")?,
            resized(pair_kt, pair_len * kt_len, "shared key tiles")?,
            resized(pair_v, pair_len * v_len, "shared value tiles")?,
        );
        #[cfg(test)]
        if POISON_SHARED.get() {
            buffers.0.fill(f32::NAN);
            buffers.1.fill(f32::NAN);
            buffers.2.fill(0x7fc0_7fc0);
            buffers.3.fill(0x7fc0_7fc0);
        }
        Ok(SharedTiles {
            groups,
            state: (0..slots).map(|_| AtomicU8::new(FREE)).collect(),
            kt: Sink::new(&mut buffers.0),
            v: Sink::new(&mut buffers.1),
            pair_kt: Sink::new(&mut buffers.2),
            pair_v: Sink::new(&mut buffers.3),
            buffers,
            kt_len,
            v_len,
        })
    }

    /// No shared tiles: every unit packs its own.
    pub(super) fn none() -> Self {
        let mut buffers: SharedBuffers = Default::default();
        SharedTiles {
            groups: Vec::new(),
            state: Vec::new(),
            kt: Sink::new(&mut buffers.0),
            v: Sink::new(&mut buffers.1),
            pair_kt: Sink::new(&mut buffers.2),
            pair_v: Sink::new(&mut buffers.3),
            buffers,
            kt_len: 0,
            v_len: 0,
        }
    }

    /// Whether (`seq`, `kv_head`) shares its key tiles.
    pub(super) fn shares(&self, hk: usize, seq: usize, kv_head: usize) -> bool {
        matches!(self.groups.get(seq * hk + kv_head), Some(Some(_)))
    }

    /// Key tiles packed into shared slots so far.
    pub(super) fn packed(&self) -> usize {
        self.state.iter().filter(|s| s.load(Ordering::Acquire) == READY).count()
    }

    /// The slot of key tile `tile` of (`seq`, `kv_head`), if shared.
    fn slot(&self, hk: usize, seq: usize, kv_head: usize, tile: usize) -> Option<usize> {
        match self.groups.get(seq * hk + kv_head) {
            Some(Some((first, tiles))) if tiles.contains(&tile) => Some(first + tile - tiles.start),
            _ => None,
        }
    }

    /// Packed slot `slot`'s `Kᵀ` (`f32` path).
    ///
    /// # Safety
    /// This thread saw the slot [`READY`] (so it is never written again in this call).
    unsafe fn kt(&self, slot: usize) -> &[f32] {
        // SAFETY: in bounds (the buffer has every slot); no writer by the caller's contract.
        unsafe { self.kt.slice_mut(slot * self.kt_len, self.kt_len) }
    }

    /// Packed slot `slot`'s `V` (`f32` path; empty where `V` is read in place).
    ///
    /// # Safety
    /// As [`Self::kt`].
    unsafe fn v(&self, slot: usize) -> &[f32] {
        // SAFETY: as in `kt`.
        unsafe { self.v.slice_mut(slot * self.v_len, self.v_len) }
    }

    /// Packed slot `slot`'s `Kᵀ` as `bf16` pairs.
    ///
    /// # Safety
    /// As [`Self::kt`].
    unsafe fn pair_kt(&self, slot: usize) -> &[Bf16Pair] {
        // SAFETY: as in `kt`.
        unsafe { self.pair_kt.slice_mut(slot * self.kt_len, self.kt_len) }
    }

    /// Packed slot `slot`'s `V` as `bf16` pairs.
    ///
    /// # Safety
    /// As [`Self::kt`].
    unsafe fn pair_v(&self, slot: usize) -> &[Bf16Pair] {
        // SAFETY: as in `kt`.
        unsafe { self.pair_v.slice_mut(slot * self.v_len, self.v_len) }
    }

    /// Hands the memory back for the next call.
    pub(super) fn keep(self) {
        let (kt, v, pair_kt, pair_v) = self.buffers;
        let bytes = 4 * (kt.capacity() + v.capacity() + pair_kt.capacity() + pair_v.capacity());
        if bytes <= SHARED_BUDGET {
            if let Ok(mut kept) = SHARED_KEPT.try_lock() {
                *kept = Some((kt, v, pair_kt, pair_v));
            }
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Tests: [`SharedTiles::new`] on this thread fills its slot memory with NaN before any unit
    /// packs a slot (a slot that is not zeroed before it is packed must be written whole).
    pub(super) static POISON_SHARED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A unit's scratch for `K` and `V` rows widened to `f32` (`rows_f32`), lent to the packing of
/// shared slots.
type RowBufs<'a> = (&'a mut LineVec<f32>, &'a mut LineVec<f32>);

/// A shared slot this thread has claimed ([`PACKING`]): [`Claim::ready`] publishes it; dropped
/// without that (the packing panicked), it is free again, so that a unit waiting for it packs it
/// (and meets the panic itself) instead of waiting for ever.
struct Claim<'a>(&'a AtomicU8);

impl Claim<'_> {
    /// The slot is packed: readers that load it ready see its contents.
    fn ready(self) {
        self.0.store(READY, Ordering::Release);
        std::mem::forget(self);
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.0.store(FREE, Ordering::Release);
    }
}

/// `v` resized to `n` elements, its memory reused; only growth is zeroed (a slot is zeroed by the
/// unit that packs it, before it packs it).
fn resized<E: Word>(mut v: LineVec<E>, n: usize, what: &'static str) -> crate::error::Result<LineVec<E>> {
    if n > v.len() {
        v.try_reserve_total(n).map_err(|_| crate::error::Error::OutOfMemory {
            what,
            elements: n,
            element_bytes: std::mem::size_of::<E>(),
        })?;
    }
    v.resize(n, E::default());
    Ok(v)
}

impl<T: Element> Context<'_, T> {
    /// Returns once shared slot `slot` (key tile `tile` of sequence `s`, kv head `kv_head`) is
    /// packed: packs it if no unit has claimed it; while another unit packs it, packs the group's
    /// other free tiles, then waits. `bufs`: the unit's scratch for widened rows.
    fn shared_ready(&self, bufs: RowBufs<'_>, s: usize, kv_head: usize, tile: usize, slot: usize) {
        let (k_buf, v_buf) = bufs;
        let mut spins = 0u32;
        while self.shared.state[slot].load(Ordering::Acquire) != READY {
            if self.try_pack((&mut *k_buf, &mut *v_buf), s, kv_head, tile, slot) {
                return;
            }
            if !self.help_pack((&mut *k_buf, &mut *v_buf), s, kv_head) {
                spins += 1;
                if spins < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }

    /// Packs one free shared tile of (`s`, `kv_head`), if any is left; whether it did.
    fn help_pack(&self, bufs: RowBufs<'_>, s: usize, kv_head: usize) -> bool {
        let Some(Some((first, tiles))) = self.shared.groups.get(s * self.g.hk + kv_head) else { return false };
        let (k_buf, v_buf) = bufs;
        tiles
            .clone()
            .enumerate()
            .any(|(i, tile)| self.try_pack((&mut *k_buf, &mut *v_buf), s, kv_head, tile, first + i))
    }

    /// Claims shared slot `slot` (key tile `tile` of (`s`, `kv_head`)) if it is free, packs it and
    /// marks it ready; whether it did.
    fn try_pack(&self, bufs: RowBufs<'_>, s: usize, kv_head: usize, tile: usize, slot: usize) -> bool {
        let state = &self.shared.state[slot];
        if state.load(Ordering::Relaxed) != FREE
            || state.compare_exchange(FREE, PACKING, Ordering::Acquire, Ordering::Relaxed).is_err()
        {
            return false;
        }
        let claim = Claim(state);
        self.pack_shared_slot(bufs, s, kv_head, tile, slot);
        claim.ready();
        true
    }

    /// Packs key tile `tile` of (`s`, `kv_head`) whole into shared slot `slot`, which this thread
    /// has claimed (moved from [`FREE`] to [`PACKING`]).
    fn pack_shared_slot(&self, (k_buf, v_buf): RowBufs<'_>, s: usize, kv_head: usize, tile: usize, slot: usize) {
        let (g, bc, sh) = (self.g, self.tiles.bc, self.shared);
        let seq = &g.seqs[s];
        let whole = tile * bc..((tile + 1) * bc).min(seq.sk);
        // A slot keeps what an earlier tile or call left in it: it is zeroed first unless the
        // packing below writes every element a product reads (a whole key tile, and on the `f32`
        // path whole panels of 16 keys and of 16 value columns), which saves a memset of both
        // tiles per slot (`bf16` at d 128: 64 KB).
        let full = whole.len() == bc;
        if let Some(bits) = self.bf16 {
            // SAFETY: this thread claimed the slot: no other thread reads or writes it until it is
            // marked ready; the buffers hold every slot.
            let (kt, v) = unsafe {
                (sh.pair_kt.slice_mut(slot * sh.kt_len, sh.kt_len), sh.pair_v.slice_mut(slot * sh.v_len, sh.v_len))
            };
            // Whole: `d.div_ceil(2)` pair rows of `bc` keys and `bc.div_ceil(2)` rows of `dv`.
            if !full {
                kt.fill(0);
                v.fill(0);
            }
            pack_rows_transposed(self.isa, kt, bc, bits.k, g.k, seq, seq.k_start, whole.clone(), kv_head, g.d);
            pack_row_pairs(v, g.dv, bits.v, g.v, seq, seq.k_start, whole, kv_head, g.dv);
        } else {
            // SAFETY: as above.
            let (kt, v) =
                unsafe { (sh.kt.slice_mut(slot * sh.kt_len, sh.kt_len), sh.v.slice_mut(slot * sh.v_len, sh.v_len)) };
            let n = whole.len();
            // Panels of 16 columns: whole when the tile is and `width` is a multiple of 16.
            let whole_panels = |width: usize| full && width.is_multiple_of(PANEL_WIDTH);
            if !whole_panels(n) {
                kt.fill(0.0);
            }
            let (k, ldk) = rows_f32(self.isa, k_buf, self.k, g.k, seq, seq.k_start, whole.clone(), kv_head, g.d);
            transpose_panels(self.isa, kt, k, ldk, n, g.d);
            if sh.v_len > 0 {
                if !whole_panels(g.dv) {
                    v.fill(0.0);
                }
                let (rows, ld) = rows_f32(self.isa, v_buf, self.v, g.v, seq, seq.k_start, whole, kv_head, g.dv);
                pack_panels(v, bc, rows, ld, n, g.dv);
            }
        }
    }
}

impl Scratch {
    fn empty() -> Self {
        Scratch {
            q: LineVec::new(),
            k: LineVec::new(),
            kt: LineVec::new(),
            v: LineVec::new(),
            s: LineVec::new(),
            o: LineVec::new(),
            softmax: OnlineSoftmax::default(),
            kt_cache: TileCache::new_in(None, 0, 0),
            v_cache: TileCache::new_in(None, 0, 0),
            pairs: None,
        }
    }

    /// Scratch for tiles `t`, in `old`'s memory where there is one; `pairs`: the products run on
    /// `bf16` pairs; `pack_v`: the `f32` path packs `V` tiles (the `v_cache` field);
    /// `cache_budget`: bytes for each cache. Every buffer starts zeroed, reused or not.
    pub(super) fn new_in(
        old: Option<Scratch>,
        g: &Geometry<'_>,
        t: Tiles,
        pairs: bool,
        pack_v: bool,
        cache_budget: usize,
    ) -> Self {
        let old = old.unwrap_or_else(Scratch::empty);
        // The caches of the other kind of products are let go, not kept empty.
        let (old_kt_cache, old_v_cache) = if pairs { (None, None) } else { (Some(old.kt_cache), Some(old.v_cache)) };
        let old_pairs = if pairs { old.pairs } else { None };
        let f32_tile = |v: LineVec<f32>, n: usize| v.into_zeros(if pairs { 0 } else { n });
        let key_tiles = g.max_sk.div_ceil(t.bc);
        let (kt_len, v_len) = (g.d.div_ceil(2) * t.bc, t.bc.div_ceil(2) * g.dv);
        let pair_slots = key_tiles.min(cache_budget / (4 * (kt_len + v_len)).max(1));
        // The f32 path's tiles at padded row strides (`Strides`).
        let st = Strides::new(g.d, g.dv, t.bc, pairs);
        let panels = |n: usize| n.div_ceil(PANEL_WIDTH) * PANEL_WIDTH;
        let (f32_kt_len, f32_v_len) = (g.d * panels(t.bc), t.bc * panels(g.dv));
        let f32_slots = |len: usize| if pairs { 0 } else { key_tiles.min(cache_budget / (4 * len).max(1)) };
        let (pq, pkt, pv, pp, pkc, pvc) = match old_pairs {
            Some(p) => (p.q, p.kt, p.v, p.p, Some(p.kt_cache), Some(p.v_cache)),
            None => (LineVec::new(), LineVec::new(), LineVec::new(), LineVec::new(), None, None),
        };
        Self {
            // Sized on first use: `k` and `v` stay empty for `f32` rows read in place (`rows_f32`).
            q: old.q.into_zeros(0),
            k: old.k.into_zeros(0),
            kt: f32_tile(old.kt, f32_kt_len),
            v: old.v.into_zeros(0),
            s: old.s.into_zeros(t.br * st.s),
            o: old.o.into_zeros(t.br * g.dv),
            softmax: OnlineSoftmax::default(),
            kt_cache: TileCache::new_in(old_kt_cache, f32_slots(f32_kt_len), f32_kt_len),
            v_cache: TileCache::new_in(old_v_cache, if pack_v { f32_slots(f32_v_len) } else { 0 }, f32_v_len),
            pairs: pairs.then(|| PairTiles {
                q: pq.into_zeros(t.br * g.d.div_ceil(2)),
                kt: pkt.into_zeros(kt_len),
                v: pv.into_zeros(v_len),
                p: pp.into_zeros(t.br * t.bc.div_ceil(2)),
                kt_cache: TileCache::new_in(pkc, pair_slots, kt_len),
                v_cache: TileCache::new_in(pvc, pair_slots, v_len),
            }),
        }
    }

    /// Bytes this scratch holds.
    fn bytes(&self) -> usize {
        let f = |v: &LineVec<f32>| 4 * v.capacity();
        let w = |v: &LineVec<Bf16Pair>| std::mem::size_of::<Bf16Pair>() * v.capacity();
        let mut n = f(&self.q) + f(&self.k) + f(&self.kt) + f(&self.v) + f(&self.s) + f(&self.o);
        n += self.kt_cache.bytes() + self.v_cache.bytes();
        if let Some(p) = &self.pairs {
            n += w(&p.q) + w(&p.kt) + w(&p.v) + w(&p.p) + p.kt_cache.bytes() + p.v_cache.bytes();
        }
        n
    }

    /// Starts a work unit: the cached key/value tiles belong to the previous one.
    fn clear_cache(&mut self) {
        self.kt_cache.clear();
        self.v_cache.clear();
        if let Some(pt) = self.pairs.as_mut() {
            pt.kt_cache.clear();
            pt.v_cache.clear();
        }
    }
}

/// The raw bits of `bf16` inputs, for the products on `bf16` pairs.
#[derive(Clone, Copy)]
pub(super) struct Bf16Inputs<'a> {
    pub q: &'a [u16],
    pub k: &'a [u16],
    pub v: &'a [u16],
}

/// Everything the query tiles of one call share.
pub(super) struct Context<'a, T> {
    pub g: &'a Geometry<'a>,
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub out: &'a Sink<T>,
    pub out_layout: RowLayout,
    pub lse: &'a Sink<f32>,
    pub tiles: Tiles,
    /// Whether every value of `v` is finite (the fast GEMM is then exact for masked keys).
    pub v_finite: bool,
    /// `Some` when the inputs are `bf16`, `v` is finite and the CPU multiplies `bf16` pairs:
    /// both products then run on `bf16` operands (exact products, `f32` sums; `P` rounded to
    /// `bf16` as in FlashAttention-2), at twice the rate of widening to `f32`.
    pub bf16: Option<Bf16Inputs<'a>>,
    /// The instruction-set path every kernel of the call runs on (resolved once, at the top).
    pub isa: Isa,
    /// The key splits of the sequences that have them, and their partial results.
    pub partials: &'a Partials,
    /// Key/value tiles packed before the units started, for the (sequence, kv head) pairs that
    /// several units share.
    pub shared: &'a SharedTiles,
}

/// Key ranges of the sequences whose forward runs split over the keys
/// ([`super::key_splits`]), and where the splits' partial results go: row `(head, i)` of split
/// `s` of a sequence is partial row `first + (head · sq + i) · splits + s`, `dv` floats of its
/// normalised output in `o` and its log-sum-exp in `lse`. The splits merge by their log-sum-exp,
/// in split order, once every split is done ([`super::merge_splits`]).
pub(super) struct Partials {
    /// Per sequence: its key ranges (empty: not split) and its first partial row.
    pub seqs: Vec<(Vec<Range<usize>>, usize)>,
    pub o: Sink<f32>,
    pub lse: Sink<f32>,
}

impl<T: Element> Context<'_, T> {
    /// One work unit: query tiles `tiles` of every query head that reads kv head `kv_head` of
    /// sequence `seq` (over its key split `split`, if it has splits), sharing the packed key/value
    /// tiles.
    pub(super) fn unit(&self, sc: &mut Scratch, seq: usize, kv_head: usize, tiles: Range<usize>, split: Option<usize>) {
        sc.clear_cache();
        let group = self.g.hq / self.g.hk;
        for tile in tiles {
            for head in kv_head * group..(kv_head + 1) * group {
                self.query_tile(sc, seq, head, tile, split);
            }
        }
    }

    /// Computes rows `tile·Br ..` of query head `head` of sequence `seq` and writes them out; with
    /// `split`, over that key split only, into its partial rows.
    pub(super) fn query_tile(
        &self,
        sc: &mut Scratch,
        seq_index: usize,
        head: usize,
        tile: usize,
        split: Option<usize>,
    ) {
        let g = self.g;
        let seq = &g.seqs[seq_index];
        let Tiles { br, bc } = self.tiles;
        let (d, dv) = (g.d, g.dv);
        let r0 = tile * br;
        let rows = r0..(r0 + br).min(seq.sq);
        let nr = rows.len();
        let kv_head = g.kv_head(head);
        let vis = g.visibility(seq, head);
        let smod = ScoreMod::new(g, seq, head);
        let dropout = g.dropout.map(|dr| DropoutRng::new(dr.p, dr.seed, dr.offset));

        // Load Q_i (Algorithm 1, line 8); zero O_i, m_i = -inf, l_i = 0. The scale multiplies the
        // dot products, not Q: rounding q · scale per element costs accuracy at large scales.
        let dp = d.div_ceil(2);
        let pairs = self.bf16.is_some() && sc.pairs.is_some();
        let st = Strides::new(d, dv, bc, pairs);
        let lds = st.s;
        match (self.bf16, sc.pairs.as_mut()) {
            (Some(bits), Some(pt)) => pack_rows(&mut pt.q, dp, bits.q, g.q, seq, seq.q_start, rows.clone(), head, d),
            _ => {
                if sc.q.len() < nr * st.d {
                    sc.q.resize(nr * st.d, 0.0);
                }
                load_rows(self.isa, &mut sc.q, st.d, self.q, g.q, seq, seq.q_start, rows.clone(), head, d)
            }
        }
        sc.o[..nr * dv].fill(0.0);
        sc.softmax.reset(nr);

        // Loop over the key/value tiles this query tile can see (line 5, FA2 order). Tiles are
        // aligned to multiples of Bc, so a row's result does not depend on which rows share its
        // query tile (hence not on Br, nor on the thread count).
        let mut keys = vis.key_range(rows.clone());
        if let Some(sp) = split {
            // Split ranges start and end on key-tile boundaries: the same tiles as unsplit.
            let range = &self.partials.seqs[seq_index].0[sp];
            keys = keys.start.max(range.start)..keys.end.min(range.end);
        }
        let mut c0 = keys.start / bc * bc;
        while c0 < keys.end {
            let cols = c0..(c0 + bc).min(keys.end);
            c0 = cols.end;
            let class = vis.classify(rows.clone(), cols.clone());
            if class == TileClass::Skip {
                continue;
            }
            let nc = cols.len();
            // A cache slot holds the whole key tile: later query tiles may see more of it.
            let (key_tile, whole) = (cols.start / bc, cols.start..(cols.start + bc).min(seq.sk));
            let packed = |slot: bool| if slot { whole.clone() } else { cols.clone() };
            let shared_slot = self.shared.slot(g.hk, seq_index, kv_head, key_tile);
            if let Some(slot) = shared_slot {
                self.shared_ready((&mut sc.k, &mut sc.v), seq_index, kv_head, key_tile, slot);
            }
            let qk = match (self.bf16, sc.pairs.as_mut()) {
                (Some(bits), Some(pt)) => {
                    let kt = match shared_slot {
                        // SAFETY: `shared_ready` saw the slot ready.
                        Some(slot) => unsafe { self.shared.pair_kt(slot) },
                        None => pt.kt_cache.tile(key_tile, &mut pt.kt, |dst, slot| {
                            pack_rows_transposed(
                                self.isa,
                                dst,
                                bc,
                                bits.k,
                                g.k,
                                seq,
                                seq.k_start,
                                packed(slot),
                                kv_head,
                                d,
                            )
                        }),
                    };
                    QkOperands::Bf16Pairs { q: &pt.q, ldq: dp, kt }
                }
                _ => {
                    let k_buf = &mut sc.k;
                    let kt = match shared_slot {
                        // SAFETY: `shared_ready` saw the slot ready.
                        Some(slot) => unsafe { self.shared.kt(slot) },
                        None => sc.kt_cache.tile(key_tile, &mut sc.kt, |dst, slot| {
                            let keys = packed(slot);
                            let n = keys.len();
                            let (k, ldk) = rows_f32(self.isa, k_buf, self.k, g.k, seq, seq.k_start, keys, kv_head, d);
                            transpose_panels(self.isa, dst, k, ldk, n, d);
                        }),
                    };
                    QkOperands::F32 { q: &sc.q, ldq: st.d, kt }
                }
            };

            // S_ij = Q_i K_jᵀ (line 9), score modifiers, mask on Partial tiles only; a plain scale
            // waits for the exponent of the softmax.
            let deferred = smod.deferrable_scale();
            score_tile(
                self.isa,
                &mut sc.s,
                lds,
                (qk, deferred.is_some()),
                d,
                rows.clone(),
                cols.clone(),
                smod,
                class,
                &vis,
                None,
            );
            // m, l, P and the rescale of O (lines 10-12), then O_i += P_ij V_j.
            // On bf16 pairs without dropout, P goes straight to the pairs of the second product.
            let ldp = bc.div_ceil(2);
            let fused = sc.pairs.as_mut().filter(|_| dropout.is_none()).map(|pt| (&mut pt.p[..], ldp));
            let p_in_pairs = fused.is_some();
            sc.softmax.update(self.isa, &mut sc.s, lds, nc, &mut sc.o, dv, deferred.unwrap_or(1.0), fused);
            if let Some(rng) = &dropout {
                // Dropout acts on P after l has summed it: lse stays that of the full softmax.
                for (r, i) in rows.clone().enumerate() {
                    rng.apply_row(seq.batch, head, g.hq, i, cols.start, rng.scale(), &mut sc.s[r * lds..r * lds + nc]);
                }
            }
            if let (Some(bits), Some(pt)) = (self.bf16, sc.pairs.as_mut()) {
                // O_i += P_ij V_j on pairs of keys: P rounded to bf16, V interleaved by key pairs.
                let v = match shared_slot {
                    // SAFETY: `shared_ready` saw the slot ready.
                    Some(slot) => unsafe { self.shared.pair_v(slot) },
                    None => pt.v_cache.tile(key_tile, &mut pt.v, |dst, slot| {
                        pack_row_pairs(dst, dv, bits.v, g.v, seq, seq.k_start, packed(slot), kv_head, dv)
                    }),
                };
                if !p_in_pairs {
                    for r in 0..nr {
                        narrow_to_pairs(self.isa, &mut pt.p[r * ldp..], &sc.s[r * lds..r * lds + nc]);
                    }
                }
                // On AMX, Partial tiles too: the masked probabilities are exact zeros, and a panel's
                // key range would start the 16-pair blocks of `k` at another key (the instruction
                // sums a block's pairs in an order of its own, so blocks must always start at the
                // same keys).
                if class == TileClass::Full || self.isa.amx() {
                    gemm_bf16(self.isa, &mut sc.o, dv, &pt.p, ldp, v, dv, (nr, dv, nc.div_ceil(2)), true);
                } else {
                    // Panel by panel as below; a panel's keys widened to whole pairs (the extra
                    // key is a masked one, whose probability is an exact zero).
                    for (p0, keys) in panels(&vis, rows.clone(), cols.clone()) {
                        let n = (p0 + PANEL).min(nr) - p0;
                        let words = keys.start / 2..keys.end.div_ceil(2);
                        if !keys.is_empty() {
                            let (o, p) = (&mut sc.o[p0 * dv..], &pt.p[p0 * ldp + words.start..]);
                            gemm_bf16(self.isa, o, dv, p, ldp, &v[words.start * dv..], dv, (n, dv, words.len()), true);
                        }
                    }
                }
                continue;
            }
            // V_j from the unit's cache (packed in panels once per unit); past the cache's slots,
            // in place (or widened) per query tile as before.
            let shared_v = shared_slot.filter(|_| self.shared.v_len > 0);
            let (v, vl) = if let Some(slot) = shared_v {
                let vl = BLayout::panels(bc);
                // SAFETY: `shared_ready` saw the slot ready.
                let vt = unsafe { self.shared.v(slot) };
                (&vt[vl.index(cols.start - whole.start, 0)..], vl)
            } else if sc.v_cache.holds(key_tile) {
                let v_buf = &mut sc.v;
                let vt = sc.v_cache.tile(key_tile, &mut [], |dst, _| {
                    let (rows, ld) =
                        rows_f32(self.isa, v_buf, self.v, g.v, seq, seq.k_start, whole.clone(), kv_head, dv);
                    pack_panels(dst, bc, rows, ld, whole.len(), dv);
                });
                let vl = BLayout::panels(bc);
                (&vt[vl.index(cols.start - whole.start, 0)..], vl)
            } else {
                let (v, ldv) = rows_f32(self.isa, &mut sc.v, self.v, g.v, seq, seq.k_start, cols.clone(), kv_head, dv);
                (v, BLayout::rows(ldv))
            };
            if class == TileClass::Full {
                gemm_b(self.isa, &mut sc.o, dv, &sc.s, lds, v, vl, (nr, dv, nc), true);
            } else if !self.v_finite {
                // Masked probabilities are exact zeros: never form 0 · NaN for a hidden key.
                gemm_acc_skipping_zeros(&mut sc.o, dv, &sc.s, lds, v, vl, (nr, dv, nc));
            } else {
                // Panel by panel, over the keys the panel can see (the rest of P is exact zeros).
                for (p0, keys) in panels(&vis, rows.clone(), cols.clone()) {
                    let n = (p0 + PANEL).min(nr) - p0;
                    if !keys.is_empty() {
                        let (o, p) = (&mut sc.o[p0 * dv..], &sc.s[p0 * lds + keys.start..]);
                        gemm_b(self.isa, o, dv, p, lds, &v[vl.index(keys.start, 0)..], vl, (n, dv, keys.len()), true);
                    }
                }
            }
        }

        // One final normalisation (FA2), then write O_i and L_i (lines 12-13).
        for (r, i) in rows.enumerate() {
            let (inv, lse) = sc.softmax.finish(r).unwrap_or((0.0, f32::NEG_INFINITY));
            let o = &mut sc.o[r * dv..(r + 1) * dv];
            scale_row(self.isa, o, inv);
            if let Some(sp) = split {
                let (ranges, first) = &self.partials.seqs[seq_index];
                let at = first + (head * seq.sq + i) * ranges.len() + sp;
                // SAFETY: partial row (sequence, head, i, split) belongs to this work item alone;
                // `merge_splits` sized the buffers for every split sequence's rows.
                unsafe {
                    self.partials.o.slice_mut(at * dv, dv).copy_from_slice(o);
                    self.partials.lse.write(at, lse);
                }
                continue;
            }
            let dst = self.out_layout.row(seq, seq.q_start, i, head);
            // SAFETY: row (seq, head, i) is owned by this work item alone; its `dv` elements are
            // contiguous (unit last stride) inside the validated, non-overlapping `out` view.
            T::narrow_slice(o, unsafe { self.out.slice_mut(dst, dv) });
            // SAFETY: as above, for the lse entry of (seq, head, i).
            unsafe { self.lse.write(g.lse_index(seq, head, i), lse) };
        }
    }
}
