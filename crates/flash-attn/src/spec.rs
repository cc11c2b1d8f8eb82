//! What attention to compute: [`AttentionSpec`], and its validation against `q`, `k`, `v` into a
//! [`Geometry`] every backend and the oracle share (DESIGN §2).

use crate::cpu::Isa;
use crate::error::{Error, Result};
use crate::tensor::{Tensor, TensorMut};

/// Which causal rule, if any, hides future keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Causal {
    /// No causal rule.
    #[default]
    None,
    /// Aligned to the bottom-right corner of the score matrix: `j <= i + (sk - sq)`
    /// (FlashAttention ≥ 2.1, the usual choice for decoding with a KV cache).
    BottomRight,
    /// Aligned to the top-left corner: `j <= i` (torch SDPA `is_causal`).
    TopLeft,
}

/// A block-sparse visibility mask: key block `bj` is visible to query block `bi` iff
/// `mask[bi][bj] != 0`, where `bi = i / block_q`, `bj = j / block_k`.
#[derive(Debug, Clone)]
pub struct BlockMask<'a> {
    /// `[qb, kb]` shared by every batch and head, or `[b, hq, qb, kb]`.
    pub mask: Tensor<'a, u8>,
    /// Query rows per block.
    pub block_q: usize,
    /// Key columns per block.
    pub block_k: usize,
}

/// Attention dropout (training): each probability is kept with probability `1 - p` and scaled by
/// `1 / (1 - p)`; the keep mask comes from Philox4x32-10 keyed by `seed`, with `offset` in the
/// counter (see [`crate::philox`]), so the backward pass regenerates it instead of storing it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    /// Probability of dropping, in `[0, 1)`.
    pub p: f32,
    /// Philox key.
    pub seed: u64,
    /// Philox counter offset: use a new one for every dropout call made with the same seed.
    pub offset: u32,
}

/// How attention is computed: scale, masks, score modifiers and the batch layout.
///
/// Built with chained setters; nothing is checked until it meets the tensors in
/// [`forward`](crate::forward) (or another entry point), which returns a typed [`Error`] for
/// anything invalid.
///
/// ```
/// use flash_attn::AttentionSpec;
/// let spec = AttentionSpec::new().causal().window(256, 0).softcap(30.0);
/// # let _ = spec;
/// ```
#[derive(Debug, Clone, Default)]
pub struct AttentionSpec<'a> {
    pub(crate) scale: Option<f32>,
    pub(crate) causal: Causal,
    pub(crate) window: Option<(i64, i64)>,
    pub(crate) softcap: Option<f32>,
    pub(crate) alibi: Option<Tensor<'a, f32>>,
    pub(crate) block_mask: Option<BlockMask<'a>>,
    pub(crate) varlen: Option<(&'a [i32], &'a [i32])>,
    pub(crate) dropout: Option<Dropout>,
    pub(crate) deterministic: bool,
    pub(crate) cpu_isa: Option<Isa>,
}

impl<'a> AttentionSpec<'a> {
    /// Plain attention: scale `1/sqrt(d)`, no mask, fixed-length batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Softmax scale applied to `q·k` (default `1/sqrt(d)`).
    #[must_use]
    pub fn scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Causal mask aligned bottom-right (`j <= i + sk - sq`), as FlashAttention 2.1+.
    #[must_use]
    pub fn causal(self) -> Self {
        self.causal_mode(Causal::BottomRight)
    }

    /// Causal mask aligned top-left (`j <= i`), as torch SDPA's `is_causal`.
    #[must_use]
    pub fn causal_top_left(self) -> Self {
        self.causal_mode(Causal::TopLeft)
    }

    /// Sets the causal rule explicitly.
    #[must_use]
    pub fn causal_mode(mut self, causal: Causal) -> Self {
        self.causal = causal;
        self
    }

    /// Sliding window: query `i` sees keys `i + off - left ..= i + off + right`, `-1` meaning
    /// unbounded on that side (`off = sk - sq`).
    #[must_use]
    pub fn window(mut self, left: i64, right: i64) -> Self {
        self.window = Some((left, right));
        self
    }

    /// Soft-capping of scores: `s = c · tanh(s / c)`, applied after the scale.
    #[must_use]
    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }

    /// ALiBi: `s -= slope_h · |i + off - j|`; slopes `[hq]` or `[b, hq]`.
    #[must_use]
    pub fn alibi_slopes(mut self, slopes: Tensor<'a, f32>) -> Self {
        self.alibi = Some(slopes);
        self
    }

    /// Block-sparse mask; `mask` is `[qb, kb]` or `[b, hq, qb, kb]` with `qb = ceil(sq / block_q)`
    /// and `kb = ceil(sk / block_k)` (in varlen: of the longest sequence).
    #[must_use]
    pub fn block_mask(mut self, mask: Tensor<'a, u8>, block_q: usize, block_k: usize) -> Self {
        self.block_mask = Some(BlockMask { mask, block_q, block_k });
        self
    }

    /// Variable-length (packed) batch: sequence `b` holds query tokens
    /// `cu_seqlens_q[b]..cu_seqlens_q[b+1]` and key tokens `cu_seqlens_k[b]..cu_seqlens_k[b+1]`;
    /// `q` is then `[tq, hq, d]`, `k`/`v` `[tk, hk, d|dv]`, `out` `[tq, hq, dv]`, `lse` `[hq, tq]`.
    #[must_use]
    pub fn varlen(mut self, cu_seqlens_q: &'a [i32], cu_seqlens_k: &'a [i32]) -> Self {
        self.varlen = Some((cu_seqlens_q, cu_seqlens_k));
        self
    }

    /// Attention dropout with probability `p` (training), keyed by `seed` and `offset`.
    #[must_use]
    pub fn dropout(mut self, p: f32, seed: u64, offset: u32) -> Self {
        self.dropout = Some(Dropout { p, seed, offset });
        self
    }

    /// Asks for bitwise-reproducible results: the same inputs give the same bits on every run.
    ///
    /// The CPU backend always is (whatever the thread count). The CUDA backward pass by default
    /// adds the `dq` contributions of key tiles with atomics in whatever order they finish; with
    /// this flag it adds them in key-tile order instead (slower when few heads share the GPU).
    #[must_use]
    pub fn deterministic(mut self) -> Self {
        self.deterministic = true;
        self
    }

    /// Runs the CPU backend on the instruction-set path `isa` instead of the process default (the
    /// best path the CPU has, capped by `FLASH_ATTN_CPU_ISA`): for tests and comparisons. A path
    /// the CPU lacks, or one above the cap, makes the call fail with [`Error::CpuIsa`]. Results
    /// meet the numerics contract on every path; bits may differ between paths.
    #[must_use]
    pub fn cpu_isa(mut self, isa: Isa) -> Self {
        self.cpu_isa = Some(isa);
        self
    }

    /// Whether [`deterministic`](Self::deterministic) was asked for.
    pub fn is_deterministic(&self) -> bool {
        self.deterministic
    }

    /// The dropout setting, if any.
    pub fn dropout_setting(&self) -> Option<Dropout> {
        self.dropout
    }

    /// Whether the batch is packed with `cu_seqlens`.
    pub fn is_varlen(&self) -> bool {
        self.varlen.is_some()
    }

    /// The causal rule.
    pub fn causal_rule(&self) -> Causal {
        self.causal
    }

    /// Validates the spec against the inputs' shapes and strides.
    pub fn geometry<T>(&self, q: &Tensor<'_, T>, k: &Tensor<'_, T>, v: &Tensor<'_, T>) -> Result<Geometry<'a>> {
        Geometry::new(self, q, k, v)
    }
}

/// Where one tensor's rows live: element `(sequence s, token i, head h, x)` is at
/// `seq_base[s] + i * token_stride + h * head_stride + x`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowLayout {
    /// Stride between batch entries (0 for varlen, where sequences are found by token offset).
    pub batch_stride: usize,
    /// Stride between consecutive tokens.
    pub token_stride: usize,
    /// Stride between heads.
    pub head_stride: usize,
}

impl RowLayout {
    fn from_strides(strides: &[usize], varlen: bool) -> Self {
        if varlen {
            RowLayout { batch_stride: 0, token_stride: strides[0], head_stride: strides[1] }
        } else {
            RowLayout { batch_stride: strides[0], token_stride: strides[1], head_stride: strides[2] }
        }
    }

    /// Offset of `(sequence, token i within it, head h)`.
    #[inline]
    pub fn row(&self, seq: &Sequence, start: usize, i: usize, h: usize) -> usize {
        seq.batch * self.batch_stride + (start + i) * self.token_stride + h * self.head_stride
    }
}

/// One sequence of the batch: its index, query and key ranges in the token dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sequence {
    /// Batch index.
    pub batch: usize,
    /// First query token (0 for fixed length, `cu_seqlens_q[b]` for varlen).
    pub q_start: usize,
    /// Number of queries.
    pub sq: usize,
    /// First key token.
    pub k_start: usize,
    /// Number of keys.
    pub sk: usize,
}

impl Sequence {
    /// `sk - sq`: the shift that aligns bottom-right causal masks, windows and ALiBi.
    pub fn offset(&self) -> i64 {
        self.sk as i64 - self.sq as i64
    }
}

/// The block mask after validation: strides resolved, dimensions checked.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockMaskRef<'a> {
    pub data: &'a [u8],
    pub block_q: usize,
    pub block_k: usize,
    /// Strides of `[b, h, qb, kb]` (0 for the broadcast dimensions of a 2-D mask).
    pub strides: [usize; 4],
}

/// ALiBi slopes after validation: slope of `(b, h)` is `data[b * strides.0 + h * strides.1]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AlibiRef<'a> {
    pub data: &'a [f32],
    pub strides: (usize, usize),
}

/// A validated problem: sizes, per-sequence ranges, resolved options and tensor layouts.
///
/// Every backend and the oracle read the problem through this one type, so they cannot disagree
/// on what the spec means.
#[derive(Debug, Clone)]
pub struct Geometry<'a> {
    /// Number of sequences.
    pub batch: usize,
    /// Query heads.
    pub hq: usize,
    /// Key/value heads.
    pub hk: usize,
    /// Head dimension of `q` and `k`.
    pub d: usize,
    /// Head dimension of `v` and `out`.
    pub dv: usize,
    /// Softmax scale in effect.
    pub scale: f32,
    /// Softcap in effect.
    pub softcap: Option<f32>,
    /// Causal rule.
    pub causal: Causal,
    /// Window `(left, right)`, `-1` unbounded.
    pub window: Option<(i64, i64)>,
    /// Dropout in effect (`None` when absent or `p = 0`).
    pub dropout: Option<Dropout>,
    /// Whether the batch is packed.
    pub varlen: bool,
    /// The sequences.
    pub seqs: Vec<Sequence>,
    /// Query tokens in the token dimension of `q`/`out` (`b·sq` or `tq`).
    pub total_q: usize,
    /// Key tokens in the token dimension of `k`/`v` (`b·sk` or `tk`).
    pub total_k: usize,
    /// Longest query sequence (`sq` for fixed length).
    pub max_sq: usize,
    /// Longest key sequence.
    pub max_sk: usize,
    pub(crate) q: RowLayout,
    pub(crate) k: RowLayout,
    pub(crate) v: RowLayout,
    pub(crate) alibi: Option<AlibiRef<'a>>,
    pub(crate) block: Option<BlockMaskRef<'a>>,
    /// The CPU path the spec asked for, if any ([`AttentionSpec::cpu_isa`]).
    pub(crate) cpu_isa: Option<Isa>,
}

fn shape_err(msg: String) -> Error {
    Error::Shape(msg)
}

fn check_cu_seqlens(which: &'static str, cu: &[i32], batch: usize, tokens: usize) -> Result<Vec<usize>> {
    let err = |reason: String| Error::CuSeqlens { which, reason };
    if cu.len() != batch + 1 {
        return Err(err(format!("has {} entries, expected batch + 1 = {}", cu.len(), batch + 1)));
    }
    if cu[0] != 0 {
        return Err(err(format!("must start at 0, starts at {}", cu[0])));
    }
    if let Some(&c) = cu.iter().find(|&&c| c < 0) {
        return Err(err(format!("has negative entry {c}")));
    }
    let mut out = Vec::with_capacity(cu.len());
    for (i, w) in cu.windows(2).enumerate() {
        if w[1] < w[0] {
            return Err(err(format!("decreases at index {}: {} then {}", i + 1, w[0], w[1])));
        }
    }
    for &c in cu {
        let c = usize::try_from(c).map_err(|_| err(format!("has negative entry {c}")))?;
        if c > tokens {
            return Err(err(format!("entry {c} is past the end of the {tokens} packed tokens")));
        }
        out.push(c);
    }
    Ok(out)
}

impl<'a> Geometry<'a> {
    /// Validates `spec` against `q`, `k`, `v` (DESIGN §2 shapes).
    pub fn new<T>(spec: &AttentionSpec<'a>, q: &Tensor<'_, T>, k: &Tensor<'_, T>, v: &Tensor<'_, T>) -> Result<Self> {
        let varlen = spec.varlen.is_some();
        let (rank, lq, lk, lv) = if varlen {
            (3, "[tq, hq, d]", "[tk, hk, d]", "[tk, hk, dv]")
        } else {
            (4, "[b, sq, hq, d]", "[b, sk, hk, d]", "[b, sk, hk, dv]")
        };
        q.check("q", lq, rank)?;
        k.check("k", lk, rank)?;
        v.check("v", lv, rank)?;
        let (qs, ks, vs) = (q.shape(), k.shape(), v.shape());
        let o = rank - 3; // index of the token dimension
        let (hq, d) = (qs[o + 1], qs[o + 2]);
        let (hk, dk) = (ks[o + 1], ks[o + 2]);
        let (hv, dv) = (vs[o + 1], vs[o + 2]);
        if dk != d {
            return Err(shape_err(format!("`q` has head dim {d} but `k` has {dk}; they must match")));
        }
        if hv != hk {
            return Err(shape_err(format!("`k` has {hk} heads but `v` has {hv}; they must match")));
        }
        if ks[o] != vs[o] {
            return Err(shape_err(format!("`k` has {} keys but `v` has {}; they must match", ks[o], vs[o])));
        }
        if hq == 0 || hk == 0 {
            return Err(shape_err(format!("head counts must be positive, got hq = {hq}, hk = {hk}")));
        }
        if hq % hk != 0 {
            return Err(Error::HeadRatio { hq, hk });
        }
        if d == 0 || dv == 0 {
            return Err(shape_err(format!("head dims must be positive, got d = {d}, dv = {dv}")));
        }

        let seqs: Vec<Sequence>;
        let (total_q, total_k);
        if let Some((cu_q, cu_k)) = spec.varlen {
            let batch = cu_q.len().saturating_sub(1);
            if cu_q.is_empty() {
                return Err(Error::CuSeqlens {
                    which: "cu_seqlens_q",
                    reason: "is empty; it needs batch + 1 >= 1 entries".into(),
                });
            }
            let cq = check_cu_seqlens("cu_seqlens_q", cu_q, batch, qs[0])?;
            let ck = check_cu_seqlens("cu_seqlens_k", cu_k, batch, ks[0])?;
            seqs = (0..batch)
                .map(|b| Sequence {
                    batch: b,
                    q_start: cq[b],
                    sq: cq[b + 1] - cq[b],
                    k_start: ck[b],
                    sk: ck[b + 1] - ck[b],
                })
                .collect();
            total_q = qs[0];
            total_k = ks[0];
        } else {
            let (b, sq, sk) = (qs[0], qs[1], ks[1]);
            if ks[0] != b || vs[0] != b {
                return Err(shape_err(format!("batch sizes differ: q {}, k {}, v {}", b, ks[0], vs[0])));
            }
            seqs = (0..b).map(|b| Sequence { batch: b, q_start: 0, sq, k_start: 0, sk }).collect();
            total_q = b * sq;
            total_k = b * sk;
        }
        let batch = seqs.len();
        let (max_sq, max_sk) = if varlen {
            (seqs.iter().map(|s| s.sq).max().unwrap_or(0), seqs.iter().map(|s| s.sk).max().unwrap_or(0))
        } else {
            (qs[1], ks[1]) // also when the batch is empty
        };

        let scale = spec.scale.unwrap_or(1.0 / (d as f32).sqrt());
        if !scale.is_finite() {
            return Err(Error::Scale(scale));
        }
        if let Some(c) = spec.softcap {
            if !(c.is_finite() && c > 0.0) {
                return Err(Error::Softcap(c));
            }
        }
        if let Some(dr) = spec.dropout {
            if !(dr.p.is_finite() && (0.0..1.0).contains(&dr.p)) {
                return Err(Error::Dropout(dr.p));
            }
        }
        if let Some((left, right)) = spec.window {
            if left < -1 || right < -1 {
                return Err(Error::Window { left, right });
            }
        }

        let alibi = match &spec.alibi {
            None => None,
            Some(t) => Some(check_alibi(t, batch, hq)?),
        };
        let block = match &spec.block_mask {
            None => None,
            Some(m) => Some(check_block_mask(m, batch, hq, max_sq, max_sk, varlen)?),
        };

        Ok(Geometry {
            batch,
            hq,
            hk,
            d,
            dv,
            scale,
            softcap: spec.softcap,
            causal: spec.causal,
            window: spec.window,
            dropout: spec.dropout.filter(|d| d.p > 0.0),
            varlen,
            seqs,
            total_q,
            total_k,
            max_sq,
            max_sk,
            q: RowLayout::from_strides(q.strides(), varlen),
            k: RowLayout::from_strides(k.strides(), varlen),
            v: RowLayout::from_strides(v.strides(), varlen),
            alibi,
            block,
            cpu_isa: spec.cpu_isa,
        })
    }

    /// Shape `out` must have: `[b, sq, hq, dv]` or `[tq, hq, dv]`.
    pub fn out_shape(&self) -> Vec<usize> {
        self.q_shape(self.dv)
    }

    /// Shape of `lse`: `[b, hq, sq]` or `[hq, tq]`.
    pub fn lse_shape(&self) -> Vec<usize> {
        if self.varlen {
            vec![self.hq, self.total_q]
        } else {
            vec![self.batch, self.hq, self.max_sq]
        }
    }

    /// Number of elements of `lse`.
    pub fn lse_len(&self) -> usize {
        self.hq * self.total_q
    }

    /// Offset in the contiguous `lse` of `(sequence, head h, query i)`.
    #[inline]
    pub fn lse_index(&self, seq: &Sequence, h: usize, i: usize) -> usize {
        if self.varlen {
            h * self.total_q + seq.q_start + i
        } else {
            (seq.batch * self.hq + h) * self.max_sq + i
        }
    }

    /// Index of query `i` of `seq` in the token dimension of a contiguous `out`
    /// (`b·sq` or `tq` entries).
    #[inline]
    pub fn q_token(&self, seq: &Sequence, i: usize) -> usize {
        if self.varlen {
            seq.q_start + i
        } else {
            seq.batch * self.max_sq + i
        }
    }

    /// Index of key `j` of `seq` in the token dimension of a contiguous `k`/`v`
    /// (`b·sk` or `tk` entries).
    #[inline]
    pub fn k_token(&self, seq: &Sequence, j: usize) -> usize {
        if self.varlen {
            seq.k_start + j
        } else {
            seq.batch * self.max_sk + j
        }
    }

    /// The key/value head read by query head `h` (GQA/MQA).
    #[inline]
    pub fn kv_head(&self, h: usize) -> usize {
        h / (self.hq / self.hk)
    }

    /// Shape of a per-query tensor with head dim `dim` (`q`, `out`, `dout`, `dq`).
    pub fn q_shape(&self, dim: usize) -> Vec<usize> {
        if self.varlen {
            vec![self.total_q, self.hq, dim]
        } else {
            vec![self.batch, self.max_sq, self.hq, dim]
        }
    }

    /// Shape of a per-key tensor with head dim `dim` (`k`, `v`, `dk`, `dv`).
    pub fn k_shape(&self, dim: usize) -> Vec<usize> {
        if self.varlen {
            vec![self.total_k, self.hk, dim]
        } else {
            vec![self.batch, self.max_sk, self.hk, dim]
        }
    }

    fn rank_layout(&self, per_query: bool) -> (usize, &'static str) {
        match (self.varlen, per_query) {
            (true, true) => (3, "[tq, hq, dim]"),
            (true, false) => (3, "[tk, hk, dim]"),
            (false, true) => (4, "[b, sq, hq, dim]"),
            (false, false) => (4, "[b, sk, hk, dim]"),
        }
    }

    /// Checks an extra input (`out`, `dout` of the backward pass) against `want` and returns its
    /// layout.
    pub(crate) fn check_input_like<T>(
        &self,
        name: &'static str,
        t: &Tensor<'_, T>,
        want: &[usize],
        per_query: bool,
    ) -> Result<RowLayout> {
        let (rank, layout) = self.rank_layout(per_query);
        t.check(name, layout, rank)?;
        self.layout_of(name, t.shape(), t.strides(), want)
    }

    /// Checks an output view (`out`, `dq`, `dk`, `dv`) against `want` and returns its layout.
    pub(crate) fn check_output_like<T>(
        &self,
        name: &'static str,
        t: &TensorMut<'_, T>,
        want: &[usize],
        per_query: bool,
    ) -> Result<RowLayout> {
        let (rank, layout) = self.rank_layout(per_query);
        t.check(name, layout, rank)?;
        self.layout_of(name, t.shape(), t.strides(), want)
    }

    /// The row layout of a checked view whose shape must be `want`.
    fn layout_of(&self, name: &'static str, shape: &[usize], strides: &[usize], want: &[usize]) -> Result<RowLayout> {
        if shape != want {
            return Err(shape_err(format!("`{name}` has shape {shape:?}, expected {want:?}")));
        }
        Ok(RowLayout::from_strides(strides, self.varlen))
    }

    /// Checks `lse` has one entry per (query head, query).
    pub(crate) fn check_lse_len(&self, len: usize) -> Result<()> {
        if len != self.lse_len() {
            return Err(Error::BufferLength { tensor: "lse", expected: self.lse_len(), got: len });
        }
        Ok(())
    }

    /// Validates the output view and `lse`, and returns the output's layout.
    pub(crate) fn check_out<T>(&self, out: &TensorMut<'_, T>, lse: &[f32]) -> Result<RowLayout> {
        let layout = self.check_output_like("out", out, &self.q_shape(self.dv), true)?;
        self.check_lse_len(lse.len())?;
        Ok(layout)
    }

    /// Validates `dout` (shape of `out`) for the oracle's backward.
    pub(crate) fn check_grad_input<'t, T>(&self, dout: &Tensor<'t, T>) -> Result<(&'t [T], RowLayout)> {
        let layout = self.check_input_like("dout", dout, &self.q_shape(self.dv), true)?;
        Ok((dout.data(), layout))
    }

    /// ALiBi slope of `(sequence, head)`, if ALiBi is on.
    #[inline]
    pub fn alibi_slope(&self, seq: &Sequence, h: usize) -> Option<f32> {
        let a = self.alibi?;
        Some(a.data[seq.batch * a.strides.0 + h * a.strides.1])
    }

    /// FLOPs as FlashAttention counts them (DESIGN §5): `4·sq·sk·d` per head, all of it even when
    /// masked except that causal counts half.
    pub fn flops(&self) -> f64 {
        let per: f64 = self.seqs.iter().map(|s| 4.0 * s.sq as f64 * s.sk as f64 * self.d as f64).sum();
        let f = per * self.hq as f64;
        if self.causal == Causal::None {
            f
        } else {
            f / 2.0
        }
    }
}

pub(crate) fn check_alibi<'a>(t: &Tensor<'a, f32>, batch: usize, hq: usize) -> Result<AlibiRef<'a>> {
    let strides = match t.shape().len() {
        1 => {
            t.check("alibi_slopes", "[hq]", 1)?;
            if t.shape()[0] != hq {
                return Err(Error::Alibi(format!(
                    "shape {:?} must be [hq] = [{hq}] or [b, hq] = [{batch}, {hq}]",
                    t.shape()
                )));
            }
            (0, t.strides()[0])
        }
        2 => {
            t.check("alibi_slopes", "[b, hq]", 2)?;
            if t.shape() != [batch, hq] {
                return Err(Error::Alibi(format!(
                    "shape {:?} must be [hq] = [{hq}] or [b, hq] = [{batch}, {hq}]",
                    t.shape()
                )));
            }
            (t.strides()[0], t.strides()[1])
        }
        _ => {
            return Err(Error::Alibi(format!(
                "shape {:?} must be [hq] = [{hq}] or [b, hq] = [{batch}, {hq}]",
                t.shape()
            )));
        }
    };
    Ok(AlibiRef { data: t.data(), strides })
}

fn check_block_mask<'a>(
    m: &BlockMask<'a>,
    batch: usize,
    hq: usize,
    max_sq: usize,
    max_sk: usize,
    varlen: bool,
) -> Result<BlockMaskRef<'a>> {
    if m.block_q == 0 || m.block_k == 0 {
        return Err(Error::BlockMask(format!("block size ({}, {}) must be positive", m.block_q, m.block_k)));
    }
    let qb = max_sq.div_ceil(m.block_q);
    let kb = max_sk.div_ceil(m.block_k);
    let what = if varlen { "of the longest sequence" } else { "" };
    let shape = m.mask.shape();
    let bad = || {
        Error::BlockMask(format!(
            "shape {shape:?} must be [qb, kb] = [{qb}, {kb}] or [b, hq, qb, kb] = [{batch}, {hq}, {qb}, {kb}] \
             (qb = ceil(sq{what} / {}), kb = ceil(sk{what} / {}))",
            m.block_q, m.block_k
        ))
    };
    let strides = match shape.len() {
        2 => {
            m.mask.check("block_mask", "[qb, kb]", 2)?;
            if shape != [qb, kb] {
                return Err(bad());
            }
            [0, 0, m.mask.strides()[0], m.mask.strides()[1]]
        }
        4 => {
            m.mask.check("block_mask", "[b, hq, qb, kb]", 4)?;
            if shape != [batch, hq, qb, kb] {
                return Err(bad());
            }
            let s = m.mask.strides();
            [s[0], s[1], s[2], s[3]]
        }
        _ => return Err(bad()),
    };
    Ok(BlockMaskRef { data: m.mask.data(), block_q: m.block_q, block_k: m.block_k, strides })
}
