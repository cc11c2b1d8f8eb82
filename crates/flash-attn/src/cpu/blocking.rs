//! Tile sizes from cache sizes.
//!
//! The IO argument of the seeds (Algorithm 1: `Bc = ceil(M / 4d)`, `Br = min(Bc, d)`) with the
//! CPU's caches in place of SRAM: the key/value tile (`Bc × (d + dv)` f32, reused by every row of
//! the query tile) should stay in L2 alongside the query tile, the output accumulator and the
//! `Br × Bc` score tile, so each key/value element is read from memory once per query tile.

/// L2 bytes per core we plan to use (of 2 MB on the target machines; half, leaving room for the
/// streamed inputs and the other tenant of a shared cache).
const L2_BUDGET: usize = 1 << 20;

/// Bytes of packed key/value tiles one thread of the forward pass keeps for its current
/// (sequence, kv head): 4 MiB (twice L2) holds `Kᵀ` and `V` of 8k keys at d = 128 as `bf16`
/// pairs; in `f32`, `Kᵀ` and `V` have 4 MiB each (8k keys at d = 128). Key tiles past it are
/// packed per query tile (`f32` `V`: read in place), as without a cache.
pub const KV_CACHE_BUDGET: usize = 4 << 20;

/// Bytes of packed query tiles (`Q` and `dO` as `bf16` pairs, in the two layouts of the products)
/// one thread of the backward pass keeps for its current unit: 4 MiB holds every query tile of
/// 4k rows at d = 128. Tiles past it are packed per key tile, as without a cache.
pub const ROW_CACHE_BUDGET: usize = 4 << 20;

/// Rows and columns of a tile of the score matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tiles {
    /// Query rows per tile (`Br`).
    pub br: usize,
    /// Key columns per tile (`Bc`).
    pub bc: usize,
}

/// Tile sizes for head dims `d`, `dv`, given the longest query sequence and the number of
/// `(sequence, head)` pairs to spread over `threads`.
pub fn tiles(d: usize, dv: usize, max_sq: usize, pairs: usize, threads: usize) -> Tiles {
    tiles_with_keys(kv_tile(d, dv), d, dv, max_sq, pairs, threads)
}

/// [`tiles`] for products on AMX tiles (`bf16` pairs): key tiles twice as wide, since a
/// `bf16` key/value tile takes half the bytes of an `f32` one. Each tile product then runs twice
/// as many `tdpbf16ps` per load and store of its output tiles (the `O` accumulator of `P·V`,
/// loaded and stored once a key tile) and per tile configuration. Measured on the Xeon (session
/// 47, `docs/cpu-performance.md`): 256 keys against 128, non-causal `bf16` forwards 1.09-1.19×,
/// causal 512² 1.01×; 512 keys lost at 512² (0.84-0.87).
pub fn amx_tiles(d: usize, dv: usize, max_sq: usize, pairs: usize, threads: usize) -> Tiles {
    tiles_with_keys(2 * kv_tile(d, dv), d, dv, max_sq, pairs, threads)
}

/// [`tiles`] with key tiles of `bc`.
fn tiles_with_keys(bc: usize, d: usize, dv: usize, max_sq: usize, pairs: usize, threads: usize) -> Tiles {
    // Query tile: as tall as the other half of the budget allows for Q_i, O_i and S_ij (up to
    // 256 rows), since every row shares the packing of each key/value tile; fewer rows when the
    // batch is too small to give every thread a few tiles.
    let q_row_bytes = 4 * (d + dv + bc);
    let mut br = (L2_BUDGET / 2 / q_row_bytes).clamp(16, 256) / 16 * 16;
    while br > 16 && pairs * max_sq.div_ceil(br) < 4 * threads {
        br /= 2;
    }
    Tiles { br: br.min(max_sq.max(1)), bc }
}

/// Row stride, in `f32` elements, of a packed tile `n` columns wide: `n` rounded up to whole
/// 64-byte lines, and then to an odd number of lines. A GEMM micro-tile walks its operands row
/// by row; at a stride of a power of two lines (128 `f32`, 512 bytes) the rows of a panel share
/// one eighth of the L1 sets and the panel stops fitting in L1. An odd number of lines spreads
/// them over every set. Measured on one core, AVX2 on a Zen 3 and AVX-512 on a Sapphire Rapids
/// Xeon (docs/cpu-performance.md, session 36): `Q·Kᵀ` and `P·V` at d 128 4-22% faster with both
/// operands padded (128 → 144), nothing gained padding one alone.
pub fn padded_stride(n: usize) -> usize {
    16 * (n.div_ceil(16) | 1)
}

/// Row strides, in `f32` elements, of the tiles the `f32` products run on: the score-shaped ones
/// (`s`: `S`, `dP` and their companions, and the backward's `Vᵀ`, which a product reads at the
/// stride it writes `dP` with), the rows of head dim `d` (`Q_i`, `K_j`) and of head dim `dv`
/// (`dO_i`, the backward's `V_j`), each [`padded_stride`] of its width. The products on `bf16`
/// pairs keep the widths. (The `f32` `Kᵀ` tiles, and the forward's cached `V_j`, lie in 16-column
/// panels instead: `cpu::gemm::BLayout`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strides {
    /// Score-shaped tiles (`Bc` columns).
    pub s: usize,
    /// Rows of head dim `d`.
    pub d: usize,
    /// Rows of head dim `dv`.
    pub dv: usize,
}

impl Strides {
    /// The strides for head dims `d`, `dv` and key tiles of `bc`; on `bf16` pairs (`pairs`), the
    /// widths themselves.
    pub fn new(d: usize, dv: usize, bc: usize, pairs: bool) -> Self {
        if pairs {
            Strides { s: bc, d, dv }
        } else {
            Strides { s: padded_stride(bc), d: padded_stride(d), dv: padded_stride(dv) }
        }
    }
}

/// Tile sizes of the backward pass: 64-row query tiles, and key tiles as wide as the budget allows
/// unless `kv_groups` (sequence, kv head) pairs of at most `max_sk` keys would then have fewer
/// than `min_units` key tiles between them (a work unit of the backward is a run of key tiles of
/// one pair): then narrower, halved down to 32 keys. At 1 × 8 heads × 128², d 128, one 128-key
/// tile a head gave 16 threads 8 units. The sizes depend on the problem's shape only — not on
/// the thread count — because the backward pass promises bitwise identical results on any
/// number of threads.
pub fn backward_tiles(d: usize, dv: usize, kv_groups: usize, max_sk: usize, min_units: usize) -> Tiles {
    let mut bc = kv_tile(d, dv);
    while bc > 32 && kv_groups * max_sk.div_ceil(bc) < min_units {
        bc = (bc / 32).max(2) * 16;
    }
    Tiles { br: 64, bc }
}

/// Key/value tile width: as wide as the budget allows, a multiple of 16, between 16 and 128.
/// Depends on the head dims only, so that every query row meets the same key tiles.
fn kv_tile(d: usize, dv: usize) -> usize {
    let kv_row_bytes = 4 * (d + dv);
    (L2_BUDGET / 2 / kv_row_bytes).clamp(16, 128) / 16 * 16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_stay_within_bounds_for_every_head_dim() {
        for d in [1, 7, 64, 128, 256, 512] {
            let t = tiles(d, d, 4096, 8, 2);
            assert!(t.bc >= 16 && t.bc <= 128 && t.bc.is_multiple_of(16));
            assert!(t.br >= 16 && t.br <= 256);
            assert!(4 * t.br * (2 * d + t.bc) <= L2_BUDGET);
            assert!(4 * t.bc * 2 * d <= L2_BUDGET);
        }
    }

    #[test]
    fn padded_strides_cover_the_row_in_an_odd_number_of_lines() {
        for n in 1..600 {
            let ld = padded_stride(n);
            assert!(ld >= n && ld < n + 32, "{n} -> {ld}");
            assert!(ld.is_multiple_of(16) && !(ld / 16).is_multiple_of(2), "{n} -> {ld}");
        }
        assert_eq!((padded_stride(64), padded_stride(128), padded_stride(96)), (80, 144, 112));
    }

    #[test]
    fn backward_key_tiles_narrow_only_for_too_few_units() {
        // 8 heads of 128 keys: 128-key tiles give 8 units of 16; 64-key tiles give 16.
        assert_eq!(backward_tiles(128, 128, 8, 128, 16), Tiles { br: 64, bc: 64 });
        assert_eq!(backward_tiles(128, 128, 16, 128, 16).bc, 128);
        assert_eq!(backward_tiles(128, 128, 8, 4096, 16).bc, 128);
        // Down to 32 keys and no further, a multiple of 16 on the way.
        assert_eq!(backward_tiles(64, 64, 1, 40, 16).bc, 32);
        for d in [1, 7, 64, 128, 256, 1000] {
            for (groups, sk) in [(1, 1), (1, 100), (3, 200), (8, 128), (64, 8192)] {
                let t = backward_tiles(d, d, groups, sk, 16);
                assert!(t.bc.is_multiple_of(16) && (32..=128).contains(&t.bc), "{d} {groups} {sk}: {t:?}");
                assert!(t.bc == 32 || groups * sk.div_ceil(t.bc) >= 16 || t.bc == kv_tile(d, d), "{t:?}");
            }
        }
    }

    #[test]
    fn amx_key_tiles_are_twice_the_f32_ones() {
        for d in [16, 64, 128, 256, 512] {
            let (f, a) = (tiles(d, d, 4096, 8, 16), amx_tiles(d, d, 4096, 8, 16));
            assert_eq!(a.bc, 2 * f.bc, "d {d}");
            assert!(a.br >= 16 && a.br <= f.br, "d {d}: {a:?} {f:?}");
        }
        assert_eq!(amx_tiles(128, 128, 512, 8, 16), Tiles { br: 64, bc: 256 });
    }

    #[test]
    fn small_batches_get_smaller_query_tiles() {
        assert_eq!(tiles(64, 64, 128, 1, 2).br, 16);
        assert_eq!(tiles(64, 64, 4096, 8, 2).br, 256);
        assert_eq!(tiles(64, 64, 5, 1, 2).br, 5);
    }
}
