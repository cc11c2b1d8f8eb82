//! Context parallelism (DESIGN §8): one sequence split over `R` ranks, the key/value chunks
//! travelling around a ring while each rank attends its queries to the chunk it holds, the partial
//! results merged by their log-sum-exp (ring attention; FlashAttention's ring backward passes
//! `dK`/`dV` around the ring with the chunks).
//!
//! This module holds what every transport shares: the [`Layout`] of the sequence over the ranks,
//! the [`schedule`] (which rank's chunk a rank holds at each step, and what it computes with it),
//! the sharding of global tensors into per-rank ones ([`Sharding`]), the validated problem
//! ([`RingProblem`]) and the merge. [`simulate_forward`] and [`simulate_backward`] run `R`
//! simulated ranks in one process (a thread each, chunks passed over channels) with the same
//! schedule and merge, so both are tested without GPUs; the CUDA backend runs them over NCCL.
//!
//! # Layouts
//!
//! - [`Layout::Contiguous`]: rank `r` holds tokens `[r·L/R, (r+1)·L/R)` of every sequence. With
//!   a causal mask rank `r` has work at `r + 1` of the `R` steps, so the last rank does `R` times
//!   the work of the first.
//! - [`Layout::Zigzag`]: each sequence is cut into `2R` chunks of `c = L/(2R)` tokens and rank `r`
//!   holds chunks `r` and `2R-1-r` (in that order). Causal work is then the same on every rank:
//!   the first step is causal on the rank's own tokens, and each later step is exactly half the
//!   product — every query against the first half of the visiting chunk (when it comes from an
//!   earlier rank), or the second half of the queries against all of it (from a later rank).
//!
//! # What is supported
//!
//! Self-attention (every sequence has as many keys as queries), fixed length or varlen, GQA/MQA,
//! any head dims, scale, softcap, causal (both alignments coincide when `sq = sk`) or not. Each
//! sequence's length must divide by `R` (contiguous) or `2R` (zigzag). Windows, ALiBi, block masks
//! and dropout read global positions that a chunk does not carry: [`Error::Unsupported`].

pub(crate) mod sim;

pub use sim::{simulate_backward, simulate_forward};

use crate::error::{Error, Result};
use crate::spec::{AttentionSpec, Causal};
use crate::Element;

/// How a sequence's tokens are spread over the ranks. See the [module docs](self).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// Rank `r` holds the `r`-th of `R` equal chunks.
    #[default]
    Contiguous,
    /// Rank `r` holds chunks `r` and `2R-1-r` of `2R` equal chunks (balanced causal work).
    Zigzag,
}

/// What a rank computes at one step of the ring, with the chunk it holds then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Nothing: every key of the chunk is in the future of every local query.
    Skip,
    /// Every local query against every key of the chunk, no mask.
    Full,
    /// The rank's own chunk: causal on the local tokens (step 0 under a causal mask).
    Diagonal,
    /// Every local query against the first half of each sequence's keys in the chunk (zigzag,
    /// chunk from an earlier rank).
    KeysFirstHalf,
    /// The second half of each sequence's local queries against every key of the chunk (zigzag,
    /// chunk from a later rank).
    QueriesSecondHalf,
}

/// The rank whose key/value chunk rank `rank` holds at step `step`: chunks move from rank `r` to
/// rank `r + 1` (mod `R`) between steps, so at step `t` rank `r` holds rank `r - t`'s.
pub fn kv_source(ranks: usize, rank: usize, step: usize) -> usize {
    if ranks == 0 {
        return 0;
    }
    (rank % ranks + ranks - step % ranks) % ranks
}

/// What rank `rank` of `ranks` computes at step `step` (`0 <= step < ranks`).
pub fn schedule(layout: Layout, causal: bool, ranks: usize, rank: usize, step: usize) -> Step {
    let source = kv_source(ranks, rank, step);
    if !causal {
        return Step::Full;
    }
    if source == rank {
        return Step::Diagonal;
    }
    match layout {
        Layout::Contiguous if source < rank => Step::Full,
        Layout::Contiguous => Step::Skip,
        Layout::Zigzag if source < rank => Step::KeysFirstHalf,
        Layout::Zigzag => Step::QueriesSecondHalf,
    }
}

/// Where each rank's tokens come from: the token ranges of one sequence of length `len` that rank
/// `rank` holds, in its local order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharding {
    /// The layout.
    pub layout: Layout,
    /// Number of ranks `R`.
    pub ranks: usize,
}

impl Sharding {
    /// A sharding over `ranks` ranks (at least 1).
    pub fn new(layout: Layout, ranks: usize) -> Result<Self> {
        if ranks == 0 {
            return Err(Error::Unsupported("a ring needs at least one rank".into()));
        }
        Ok(Sharding { layout, ranks })
    }

    /// The number of chunks a sequence is cut into (`R`, or `2R` for zigzag).
    pub fn chunks(&self) -> usize {
        match self.layout {
            Layout::Contiguous => self.ranks,
            Layout::Zigzag => 2 * self.ranks,
        }
    }

    /// Tokens of a sequence of global length `len` held by each rank; an error unless `len`
    /// divides by [`Sharding::chunks`].
    pub fn local_len(&self, len: usize) -> Result<usize> {
        let n = self.chunks();
        if !len.is_multiple_of(n) {
            return Err(Error::Shape(format!(
                "a sequence of {len} tokens does not split into {n} equal chunks ({:?} layout over {} ranks)",
                self.layout, self.ranks
            )));
        }
        Ok(len / self.ranks)
    }

    /// The ranges `(start, len)` of a sequence of global length `len` that rank `rank` holds, in
    /// local order (one range, or two for zigzag). `len` must divide by [`Sharding::chunks`].
    pub fn ranges(&self, rank: usize, len: usize) -> Vec<(usize, usize)> {
        match self.layout {
            Layout::Contiguous => {
                let c = len / self.ranks;
                vec![(rank * c, c)]
            }
            Layout::Zigzag => {
                let c = len / (2 * self.ranks);
                vec![(rank * c, c), ((2 * self.ranks - 1 - rank) * c, c)]
            }
        }
    }

    /// `cu_seqlens` of a rank's packed tokens from the global one: every length divided by `R`.
    pub fn local_cu_seqlens(&self, cu_global: &[i32]) -> Result<Vec<i32>> {
        let err = |reason: &str| Error::CuSeqlens { which: "cu_seqlens", reason: reason.into() };
        if cu_global.first().is_some_and(|&c| c != 0) {
            return Err(err("must start at 0"));
        }
        let mut out = Vec::with_capacity(cu_global.len());
        out.push(0);
        for w in cu_global.windows(2) {
            let len = w[1].checked_sub(w[0]).and_then(|l| usize::try_from(l).ok()).ok_or_else(|| err("decreases"))?;
            let local = self.local_len(len)?;
            let last = *out.last().unwrap_or(&0);
            out.push(last + local as i32);
        }
        Ok(out)
    }
}

/// A validated context-parallel problem, as one rank sees it: its packed local tokens
/// (`[t, h, d]`, `cu_seqlens` with every sequence's local length) and the attention options.
#[derive(Debug, Clone, PartialEq)]
pub struct RingProblem {
    /// The layout.
    pub(crate) layout: Layout,
    /// Ranks in the ring.
    pub(crate) ranks: usize,
    /// Whether the causal mask is on.
    pub(crate) causal: bool,
    /// Softmax scale (explicit, so every step uses the global one).
    pub(crate) scale: f32,
    /// Softcap, if any.
    pub(crate) softcap: Option<f32>,
    /// Query heads.
    pub(crate) hq: usize,
    /// Key/value heads.
    pub(crate) hk: usize,
    /// Head dim of `q` and `k`.
    pub(crate) d: usize,
    /// Head dim of `v` and `out`.
    pub(crate) dv: usize,
    /// Local `cu_seqlens` (same for queries and keys): every sequence's local token count, which
    /// is even for zigzag.
    pub(crate) cu: Vec<i32>,
    /// Whether the step kernels should be deterministic ([`AttentionSpec::deterministic`]).
    pub(crate) deterministic: bool,
}

impl RingProblem {
    /// Checks that `spec` is something the ring computes (see the [module docs](self)) and
    /// records it with the local packed geometry: `cu_local` as [`Sharding::local_cu_seqlens`]
    /// gives it, heads and head dims.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        spec: &AttentionSpec<'_>,
        layout: Layout,
        ranks: usize,
        cu_local: Vec<i32>,
        (hq, hk): (usize, usize),
        (d, dv): (usize, usize),
    ) -> Result<Self> {
        Sharding::new(layout, ranks)?;
        if spec.window.is_some() {
            return Err(Error::Unsupported("ring attention with a sliding window".into()));
        }
        if spec.alibi.is_some() {
            return Err(Error::Unsupported("ring attention with ALiBi".into()));
        }
        if spec.block_mask.is_some() {
            return Err(Error::Unsupported("ring attention with a block mask".into()));
        }
        if spec.dropout.is_some_and(|dr| dr.p > 0.0) {
            return Err(Error::Unsupported("ring attention with dropout".into()));
        }
        if hk == 0 || hq % hk != 0 {
            return Err(Error::HeadRatio { hq, hk });
        }
        if d == 0 || dv == 0 {
            return Err(Error::Shape("head dims must be positive".into()));
        }
        if cu_local.first() != Some(&0) || cu_local.windows(2).any(|w| w[1] < w[0]) {
            return Err(Error::CuSeqlens { which: "cu_seqlens", reason: "must start at 0 and never decrease".into() });
        }
        if layout == Layout::Zigzag && cu_local.windows(2).any(|w| (w[1] - w[0]) % 2 != 0) {
            return Err(Error::Shape("zigzag: every sequence's local length must be even".into()));
        }
        let scale = match spec.scale {
            Some(s) => s,
            None => 1.0 / (d as f32).sqrt(),
        };
        Ok(RingProblem {
            layout,
            ranks,
            causal: spec.causal != Causal::None,
            scale,
            softcap: spec.softcap,
            hq,
            hk,
            d,
            dv,
            cu: cu_local,
            deterministic: spec.deterministic,
        })
    }

    /// The layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Ranks in the ring.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Whether the causal mask is on.
    pub fn causal(&self) -> bool {
        self.causal
    }

    /// `(hq, hk)`.
    pub fn heads(&self) -> (usize, usize) {
        (self.hq, self.hk)
    }

    /// `(d, dv)`.
    pub fn head_dims(&self) -> (usize, usize) {
        (self.d, self.dv)
    }

    /// The local `cu_seqlens`.
    pub fn cu_seqlens(&self) -> &[i32] {
        &self.cu
    }

    /// Local tokens of this rank.
    pub fn tokens(&self) -> usize {
        self.cu.last().map_or(0, |&t| t as usize)
    }

    /// `cu_seqlens` of the half-chunks (every local length halved).
    pub fn half_cu(&self) -> Vec<i32> {
        self.cu.iter().map(|&c| c / 2).collect()
    }

    /// Runs `(local token, half-chunk token, len)` of the first or second half of every sequence:
    /// the rows a zigzag half step gathers from the local buffers and scatters back.
    pub fn half_runs(&self, second: bool) -> Vec<(usize, usize, usize)> {
        self.cu
            .windows(2)
            .map(|w| {
                let (start, half) = (w[0] as usize, (w[1] - w[0]) as usize / 2);
                (start + if second { half } else { 0 }, w[0] as usize / 2, half)
            })
            .filter(|r| r.2 > 0)
            .collect()
    }

    /// The spec of one step's attention call on packed tokens: varlen with `cu_q` and `cu_k`, the
    /// ring's scale and softcap, causal on the diagonal step only.
    pub fn step_spec<'a>(&self, step: Step, cu_q: &'a [i32], cu_k: &'a [i32]) -> AttentionSpec<'a> {
        let mut spec = AttentionSpec::new().scale(self.scale).varlen(cu_q, cu_k);
        if let Some(c) = self.softcap {
            spec = spec.softcap(c);
        }
        if step == Step::Diagonal {
            spec = spec.causal();
        }
        if self.deterministic {
            spec = spec.deterministic();
        }
        spec
    }
}

/// Merges one partial result into the running one, for one row: `out` and `lse` become those of
/// attention over the union of both key sets. `lse = -inf` means "no key seen" on either side.
///
/// `new_lse = max + ln(e^(a - max) + e^(b - max))`; each side's output weighs `e^(lse - new_lse)`.
#[inline]
pub fn merge_row<T: Element>(acc: &mut [f32], acc_lse: &mut f32, part: &[T], part_lse: f32) {
    if part_lse == f32::NEG_INFINITY {
        return;
    }
    let a = *acc_lse;
    if a == f32::NEG_INFINITY {
        for (o, p) in acc.iter_mut().zip(part) {
            *o = p.to_f32();
        }
        *acc_lse = part_lse;
        return;
    }
    let m = a.max(part_lse);
    let (wa, wb) = ((a - m).exp(), (part_lse - m).exp());
    let sum = wa + wb;
    let (wa, wb) = (wa / sum, wb / sum);
    for (o, p) in acc.iter_mut().zip(part) {
        *o = *o * wa + p.to_f32() * wb;
    }
    let new_lse = m + sum.ln();
    *acc_lse = new_lse;
}
