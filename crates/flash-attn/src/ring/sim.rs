//! `R` simulated ranks in one process: each rank a thread running the per-rank forward or
//! backward of the ring on the CPU backend, chunks passed to the next rank over channels. The
//! schedule, the half-chunk gathers and the merge are those every transport uses.

use std::sync::mpsc::{channel, Receiver, Sender};

use super::{merge_row, schedule, RingProblem, Sharding, Step};
use crate::error::{Error, Result};
use crate::spec::{Geometry, RowLayout, Sequence};
use crate::{AttentionSpec, Element, Gradients, Output, Tensor};

/// One rank's two ends of a ring: it sends to the next rank and receives from the previous.
struct Link<M> {
    tx: Sender<M>,
    rx: Receiver<M>,
}

impl<M> Link<M> {
    fn send(&self, m: M) -> Result<()> {
        self.tx.send(m).map_err(|_| Error::Unsupported("ring simulation: the next rank stopped".into()))
    }

    fn recv(&self) -> Result<M> {
        self.rx.recv().map_err(|_| Error::Unsupported("ring simulation: the previous rank stopped".into()))
    }
}

/// `R` links forming a ring: rank `r` sends to `r + 1` and receives from `r - 1` (mod `R`).
fn ring_links<M>(ranks: usize) -> Vec<Link<M>> {
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..ranks).map(|_| channel()).unzip();
    let mut rxs: Vec<Option<Receiver<M>>> = rxs.into_iter().map(Some).collect();
    (0..ranks)
        .map(|r| {
            let rx = rxs[r].take();
            Link { tx: txs[(r + 1) % ranks].clone(), rx: rx.unwrap_or_else(|| channel().1) }
        })
        .collect()
}

/// The global problem split over the ranks: which `(sequence, position)` each local token is.
pub(crate) struct Split<'a> {
    pub(crate) g: Geometry<'a>,
    /// Per rank, its local tokens in order: `(index into g.seqs, position in the sequence)`.
    pub(crate) tokens: Vec<Vec<(usize, usize)>>,
    /// Per rank, the validated local problem.
    pub(crate) problems: Vec<RingProblem>,
}

impl<'a> Split<'a> {
    pub(crate) fn new<T: Element>(
        spec: &AttentionSpec<'a>,
        layout: super::Layout,
        ranks: usize,
        q: &Tensor<'_, T>,
        k: &Tensor<'_, T>,
        v: &Tensor<'_, T>,
    ) -> Result<Self> {
        let g = Geometry::new(spec, q, k, v)?;
        let sharding = Sharding::new(layout, ranks)?;
        let mut cu = vec![0i32];
        for s in &g.seqs {
            if s.sq != s.sk {
                return Err(Error::Unsupported(format!(
                    "ring attention is self-attention: sequence {} has {} queries and {} keys",
                    s.batch, s.sq, s.sk
                )));
            }
            let local = sharding.local_len(s.sq)?;
            let last = *cu.last().unwrap_or(&0);
            cu.push(last + i32::try_from(local).map_err(|_| Error::Shape("sequence too long".into()))?);
        }
        let problem = RingProblem::new(spec, layout, ranks, cu, (g.hq, g.hk), (g.d, g.dv))?;
        let tokens = (0..ranks)
            .map(|r| {
                let mut t = Vec::with_capacity(problem.tokens());
                for (si, s) in g.seqs.iter().enumerate() {
                    for (start, len) in sharding.ranges(r, s.sq) {
                        t.extend((start..start + len).map(|i| (si, i)));
                    }
                }
                t
            })
            .collect();
        Ok(Split { g, tokens, problems: vec![problem; ranks] })
    }

    /// Rank `r`'s packed rows `[t, heads, dim]` of a global tensor with row layout `layout`.
    pub(crate) fn shard<T: Copy>(
        &self,
        r: usize,
        data: &[T],
        layout: &RowLayout,
        heads: usize,
        dim: usize,
        keys: bool,
    ) -> Vec<T> {
        let mut out = Vec::with_capacity(self.tokens[r].len() * heads * dim);
        for &(si, i) in &self.tokens[r] {
            let s = &self.g.seqs[si];
            let start = if keys { s.k_start } else { s.q_start };
            for h in 0..heads {
                let o = layout.row(s, start, i, h);
                out.extend_from_slice(&data[o..o + dim]);
            }
        }
        out
    }

    /// Rank `r`'s rows of a global `lse`, packed `[hq, t]`.
    pub(crate) fn shard_lse(&self, r: usize, lse: &[f32]) -> Vec<f32> {
        let t = self.tokens[r].len();
        let mut out = vec![0.0; self.g.hq * t];
        for h in 0..self.g.hq {
            for (lt, &(si, i)) in self.tokens[r].iter().enumerate() {
                out[h * t + lt] = lse[self.g.lse_index(&self.g.seqs[si], h, i)];
            }
        }
        out
    }

    /// Writes rank `r`'s packed rows `[t, heads, dim]` into a contiguous global tensor.
    pub(crate) fn unshard<T: Copy>(
        &self,
        r: usize,
        local: &[T],
        global: &mut [T],
        heads: usize,
        dim: usize,
        keys: bool,
    ) {
        let row = heads * dim;
        for (lt, &(si, i)) in self.tokens[r].iter().enumerate() {
            let s: &Sequence = &self.g.seqs[si];
            let tok = if keys { self.g.k_token(s, i) } else { self.g.q_token(s, i) };
            global[tok * row..(tok + 1) * row].copy_from_slice(&local[lt * row..(lt + 1) * row]);
        }
    }

    /// Writes rank `r`'s packed `lse` (`[hq, t]`) into the global one.
    pub(crate) fn unshard_lse(&self, r: usize, local: &[f32], global: &mut [f32]) {
        let t = self.tokens[r].len();
        for h in 0..self.g.hq {
            for (lt, &(si, i)) in self.tokens[r].iter().enumerate() {
                global[self.g.lse_index(&self.g.seqs[si], h, i)] = local[h * t + lt];
            }
        }
    }
}

/// Copies the rows of `runs` (`(local token, half token, len)`) out of `src` (`row` elements a
/// token) into a packed half-chunk buffer.
fn gather<T: Copy>(src: &[T], runs: &[(usize, usize, usize)], half_tokens: usize, row: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(half_tokens * row);
    for &(from, _, len) in runs {
        out.extend_from_slice(&src[from * row..(from + len) * row]);
    }
    out
}

/// Gathers the `lse` rows (`[h, t]` → `[h, t/2]`) of `runs`.
fn gather_lse(lse: &[f32], runs: &[(usize, usize, usize)], heads: usize, t: usize, half_tokens: usize) -> Vec<f32> {
    let mut out = vec![0.0; heads * half_tokens];
    for h in 0..heads {
        for &(from, to, len) in runs {
            out[h * half_tokens + to..h * half_tokens + to + len]
                .copy_from_slice(&lse[h * t + from..h * t + from + len]);
        }
    }
    out
}

/// Adds `part` (`[tp, row]`, in the input dtype) into the `f32` accumulator `acc` (`[t, row]`):
/// every row, or the rows of `runs`.
fn add_rows<T: Element>(acc: &mut [f32], part: &[T], runs: Option<&[(usize, usize, usize)]>, row: usize) {
    match runs {
        None => acc.iter_mut().zip(part).for_each(|(a, p)| *a += p.to_f32()),
        Some(runs) => {
            for &(local, half, len) in runs {
                let dst = &mut acc[local * row..(local + len) * row];
                dst.iter_mut().zip(&part[half * row..(half + len) * row]).for_each(|(a, p)| *a += p.to_f32());
            }
        }
    }
}

/// Merges a step's `out`/`lse` into the accumulators: every row, or the rows of `runs`.
fn merge_step<T: Element>(
    p: &RingProblem,
    acc: &mut [f32],
    acc_lse: &mut [f32],
    out: &[T],
    lse: &[f32],
    runs: Option<&[(usize, usize, usize)]>,
) {
    let (t, dv, hq) = (p.tokens(), p.dv, p.hq);
    let identity = [(0, 0, t)];
    let (runs, tp) = match runs {
        Some(r) => (r, t / 2),
        None => (&identity[..], t),
    };
    for &(local, part, len) in runs {
        for i in 0..len {
            let (lt, pt) = (local + i, part + i);
            for h in 0..hq {
                let a = &mut acc[(lt * hq + h) * dv..(lt * hq + h + 1) * dv];
                merge_row(
                    a,
                    &mut acc_lse[h * t + lt],
                    &out[(pt * hq + h) * dv..(pt * hq + h + 1) * dv],
                    lse[h * tp + pt],
                );
            }
        }
    }
}

/// One rank's ring forward: `out` (`[t, hq, dv]`, `f32`) and `lse` (`[hq, t]`).
fn rank_forward<T: Element>(
    p: &RingProblem,
    rank: usize,
    q: &[T],
    mut k: Vec<T>,
    mut v: Vec<T>,
    link: &Link<(Vec<T>, Vec<T>)>,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let t = p.tokens();
    let half = p.half_cu();
    let (first, second) = (p.half_runs(false), p.half_runs(true));
    let mut acc = vec![0.0f32; t * p.hq * p.dv];
    let mut acc_lse = vec![f32::NEG_INFINITY; p.hq * t];
    let (qs, ks, vs) = ([t, p.hq, p.d], [t, p.hk, p.d], [t, p.hk, p.dv]);
    let (hs_k, hs_v) = ([t / 2, p.hk, p.d], [t / 2, p.hk, p.dv]);
    for step in 0..p.ranks {
        if step + 1 < p.ranks {
            link.send((k.clone(), v.clone()))?;
        }
        let work = schedule(p.layout, p.causal, p.ranks, rank, step);
        match work {
            Step::Skip => {}
            Step::Full | Step::Diagonal => {
                let spec = p.step_spec(work, &p.cu, &p.cu);
                let o = crate::forward(&spec, &Tensor::new(q, &qs), &Tensor::new(&k, &ks), &Tensor::new(&v, &vs))?;
                merge_step(p, &mut acc, &mut acc_lse, &o.out, &o.lse, None);
            }
            Step::KeysFirstHalf => {
                let kh = gather(&k, &first, t / 2, p.hk * p.d);
                let vh = gather(&v, &first, t / 2, p.hk * p.dv);
                let spec = p.step_spec(work, &p.cu, &half);
                let o =
                    crate::forward(&spec, &Tensor::new(q, &qs), &Tensor::new(&kh, &hs_k), &Tensor::new(&vh, &hs_v))?;
                merge_step(p, &mut acc, &mut acc_lse, &o.out, &o.lse, None);
            }
            Step::QueriesSecondHalf => {
                let qh = gather(q, &second, t / 2, p.hq * p.d);
                let spec = p.step_spec(work, &half, &p.cu);
                let o = crate::forward(
                    &spec,
                    &Tensor::new(&qh, &[t / 2, p.hq, p.d]),
                    &Tensor::new(&k, &ks),
                    &Tensor::new(&v, &vs),
                )?;
                merge_step(p, &mut acc, &mut acc_lse, &o.out, &o.lse, Some(&second));
            }
        }
        if step + 1 < p.ranks {
            (k, v) = link.recv()?;
        }
    }
    Ok((acc, acc_lse))
}

/// The local inputs of one rank's backward.
struct BwdInputs<T> {
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    out: Vec<T>,
    lse: Vec<f32>,
    dout: Vec<T>,
}

type Grads32 = (Vec<f32>, Vec<f32>, Vec<f32>);

/// One rank's ring backward: `dq` for its queries and `dk`, `dv` for its keys, in `f32`. The
/// key/value chunks travel as in the forward; each chunk's `dK`/`dV` accumulators travel with it
/// one step behind and come home after the last step.
fn rank_backward<T: Element>(
    p: &RingProblem,
    rank: usize,
    inputs: BwdInputs<T>,
    kv_link: &Link<(Vec<T>, Vec<T>)>,
    dkv_link: &Link<(Vec<f32>, Vec<f32>)>,
) -> Result<Grads32> {
    let BwdInputs { q, mut k, mut v, out, lse, dout } = inputs;
    let t = p.tokens();
    let (t2, half) = (t / 2, p.half_cu());
    let (first, second) = (p.half_runs(false), p.half_runs(true));
    let (rq, rk, rv, ro) = (p.hq * p.d, p.hk * p.d, p.hk * p.dv, p.hq * p.dv);
    let mut dq = vec![0.0f32; t * rq];
    let mut dk = vec![0.0f32; t * rk];
    let mut dv = vec![0.0f32; t * rv];
    let (qs, ks, vs, os) = ([t, p.hq, p.d], [t, p.hk, p.d], [t, p.hk, p.dv], [t, p.hq, p.dv]);
    for step in 0..p.ranks {
        if step + 1 < p.ranks {
            kv_link.send((k.clone(), v.clone()))?;
        }
        let work = schedule(p.layout, p.causal, p.ranks, rank, step);
        match work {
            Step::Skip => {}
            Step::Full | Step::Diagonal => {
                let spec = p.step_spec(work, &p.cu, &p.cu);
                let g = crate::backward(
                    &spec,
                    &Tensor::new(&q, &qs),
                    &Tensor::new(&k, &ks),
                    &Tensor::new(&v, &vs),
                    &Tensor::new(&out, &os),
                    &lse,
                    &Tensor::new(&dout, &os),
                )?;
                add_rows(&mut dq, &g.dq, None, rq);
                add_rows(&mut dk, &g.dk, None, rk);
                add_rows(&mut dv, &g.dv, None, rv);
            }
            Step::KeysFirstHalf => {
                let kh = gather(&k, &first, t2, rk);
                let vh = gather(&v, &first, t2, rv);
                let spec = p.step_spec(work, &p.cu, &half);
                let g = crate::backward(
                    &spec,
                    &Tensor::new(&q, &qs),
                    &Tensor::new(&kh, &[t2, p.hk, p.d]),
                    &Tensor::new(&vh, &[t2, p.hk, p.dv]),
                    &Tensor::new(&out, &os),
                    &lse,
                    &Tensor::new(&dout, &os),
                )?;
                add_rows(&mut dq, &g.dq, None, rq);
                add_rows(&mut dk, &g.dk, Some(&first), rk);
                add_rows(&mut dv, &g.dv, Some(&first), rv);
            }
            Step::QueriesSecondHalf => {
                let qh = gather(&q, &second, t2, rq);
                let oh = gather(&out, &second, t2, ro);
                let doh = gather(&dout, &second, t2, ro);
                let lh = gather_lse(&lse, &second, p.hq, t, t2);
                let spec = p.step_spec(work, &half, &p.cu);
                let hs_o = [t2, p.hq, p.dv];
                let g = crate::backward(
                    &spec,
                    &Tensor::new(&qh, &[t2, p.hq, p.d]),
                    &Tensor::new(&k, &ks),
                    &Tensor::new(&v, &vs),
                    &Tensor::new(&oh, &hs_o),
                    &lh,
                    &Tensor::new(&doh, &hs_o),
                )?;
                add_rows(&mut dq, &g.dq, Some(&second), rq);
                add_rows(&mut dk, &g.dk, None, rk);
                add_rows(&mut dv, &g.dv, None, rv);
            }
        }
        dkv_link.send((dk, dv))?;
        (dk, dv) = dkv_link.recv()?;
        if step + 1 < p.ranks {
            (k, v) = kv_link.recv()?;
        }
    }
    Ok((dq, dk, dv))
}

/// The first error of any rank, preferring one that is not "a neighbour stopped" (which only
/// follows another rank's error).
fn first_error<R>(results: Vec<Result<R>>) -> Result<Vec<R>> {
    let is_cascade = |e: &Error| matches!(e, Error::Unsupported(m) if m.starts_with("ring simulation:"));
    let (ok, errors): (Vec<_>, Vec<_>) = results.into_iter().partition(|r| r.is_ok());
    let mut errors: Vec<Error> = errors.into_iter().filter_map(|r| r.err()).collect();
    if let Some(i) = errors.iter().position(|e| !is_cascade(e)) {
        return Err(errors.swap_remove(i));
    }
    if let Some(e) = errors.pop() {
        return Err(e);
    }
    Ok(ok.into_iter().filter_map(|r| r.ok()).collect())
}

/// Ring attention forward over `ranks` simulated ranks (one thread each, the CPU backend for
/// every step): takes the global `q`, `k`, `v` as [`forward`](crate::forward) does, shards them
/// by `layout`, runs the ring, and returns the global `out` and `lse` — equal to a one-device
/// forward within the numerics contract. See the [module docs](super) for what is supported.
pub fn simulate_forward<T: Element>(
    spec: &AttentionSpec<'_>,
    layout: super::Layout,
    ranks: usize,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
) -> Result<Output<T>> {
    let split = Split::new(spec, layout, ranks, q, k, v)?;
    let g = &split.g;
    let links = ring_links(ranks);
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(r, link)| {
                let split = &split;
                s.spawn(move || {
                    let lq = split.shard(r, q.data(), &g.q, g.hq, g.d, false);
                    let lk = split.shard(r, k.data(), &g.k, g.hk, g.d, true);
                    let lv = split.shard(r, v.data(), &g.v, g.hk, g.dv, true);
                    rank_forward(&split.problems[r], r, &lq, lk, lv, &link)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(panicked()))).collect::<Vec<_>>()
    });
    let locals = first_error(results)?;
    let out_shape = g.out_shape();
    let mut out = vec![T::default(); g.total_q * g.hq * g.dv];
    let mut lse = vec![f32::NEG_INFINITY; g.lse_len()];
    for (r, (acc, acc_lse)) in locals.iter().enumerate() {
        let narrowed: Vec<T> = acc.iter().map(|&x| T::from_f32(x)).collect();
        split.unshard(r, &narrowed, &mut out, g.hq, g.dv, false);
        split.unshard_lse(r, acc_lse, &mut lse);
    }
    Ok(Output { out, out_shape, lse, lse_shape: g.lse_shape() })
}

fn panicked() -> Error {
    Error::Unsupported("ring simulation: a rank panicked".into())
}

/// Ring attention backward over `ranks` simulated ranks: the global `dq`, `dk`, `dv` from the
/// global inputs, the forward's `out` and `lse` (of [`simulate_forward`] or any forward: they are
/// the same within the contract) and `dout`, as [`backward`](crate::backward) takes them.
#[allow(clippy::too_many_arguments)]
pub fn simulate_backward<T: Element>(
    spec: &AttentionSpec<'_>,
    layout: super::Layout,
    ranks: usize,
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &Tensor<'_, T>,
    lse: &[f32],
    dout: &Tensor<'_, T>,
) -> Result<Gradients<T>> {
    let split = Split::new(spec, layout, ranks, q, k, v)?;
    let g = &split.g;
    let out_layout = g.check_input_like("out", out, &g.out_shape(), true)?;
    let (_, dout_layout) = g.check_grad_input(dout)?;
    g.check_lse_len(lse.len())?;
    let kv_links = ring_links(ranks);
    let dkv_links = ring_links(ranks);
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = kv_links
            .into_iter()
            .zip(dkv_links)
            .enumerate()
            .map(|(r, (kv_link, dkv_link))| {
                let (split, out_layout, dout_layout) = (&split, &out_layout, &dout_layout);
                s.spawn(move || {
                    let inputs = BwdInputs {
                        q: split.shard(r, q.data(), &g.q, g.hq, g.d, false),
                        k: split.shard(r, k.data(), &g.k, g.hk, g.d, true),
                        v: split.shard(r, v.data(), &g.v, g.hk, g.dv, true),
                        out: split.shard(r, out.data(), out_layout, g.hq, g.dv, false),
                        lse: split.shard_lse(r, lse),
                        dout: split.shard(r, dout.data(), dout_layout, g.hq, g.dv, false),
                    };
                    rank_backward(&split.problems[r], r, inputs, &kv_link, &dkv_link)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(panicked()))).collect::<Vec<_>>()
    });
    let locals = first_error(results)?;
    let (dq_shape, dk_shape, dv_shape) = (g.q_shape(g.d), g.k_shape(g.d), g.k_shape(g.dv));
    let mut dq = vec![T::default(); g.total_q * g.hq * g.d];
    let mut dk = vec![T::default(); g.total_k * g.hk * g.d];
    let mut dv = vec![T::default(); g.total_k * g.hk * g.dv];
    let narrow = |x: &[f32]| x.iter().map(|&x| T::from_f32(x)).collect::<Vec<T>>();
    for (r, (ldq, ldk, ldv)) in locals.iter().enumerate() {
        split.unshard(r, &narrow(ldq), &mut dq, g.hq, g.d, false);
        split.unshard(r, &narrow(ldk), &mut dk, g.hk, g.d, true);
        split.unshard(r, &narrow(ldv), &mut dv, g.hk, g.dv, true);
    }
    Ok(Gradients { dq, dq_shape, dk, dk_shape, dv, dv_shape })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_of_links_passes_to_the_next_rank() {
        let links = ring_links::<usize>(3);
        for (r, l) in links.iter().enumerate() {
            l.send(r).unwrap();
        }
        let got: Vec<usize> = links.iter().map(|l| l.recv().unwrap()).collect();
        assert_eq!(got, vec![2, 0, 1]);
    }
}
