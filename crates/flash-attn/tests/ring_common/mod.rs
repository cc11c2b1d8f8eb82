//! A random context-parallel problem and its check against the f64 oracle, shared by the CPU
//! simulation's tests (tests/ring.rs) and the GPU's (tests/cuda_ring.rs).
#![allow(dead_code)]

use flash_attn::check::{compare_gradients, report, CaseData, Rng};
use flash_attn::ring::Layout;
use flash_attn::{reference, AttentionSpec, DType, Element, Gradients, Output, Result, Tensor};

/// A random problem for the ring: fixed length or varlen, GQA, head dims, causal or not.
pub struct Problem {
    pub dtype: DType,
    pub layout: Layout,
    pub ranks: usize,
    pub causal: bool,
    pub softcap: Option<f32>,
    /// Global sequence lengths (each a multiple of the layout's chunk count).
    pub lens: Vec<usize>,
    pub varlen: bool,
    pub hq: usize,
    pub hk: usize,
    pub d: usize,
    pub dv: usize,
}

impl Problem {
    pub fn random(rng: &mut Rng) -> Problem {
        let layout = rng.pick(&[Layout::Contiguous, Layout::Zigzag]);
        let ranks = rng.pick(&[1, 2, 3, 4, 8]);
        let chunks = if layout == Layout::Zigzag { 2 * ranks } else { ranks };
        let varlen = rng.chance(0.5);
        let b = rng.range(1, 4);
        let fixed = chunks * rng.range(1, 12);
        let lens = (0..b).map(|_| if varlen { chunks * rng.range(0, 12) } else { fixed }).collect();
        let (hq, hk) = rng.pick(&[(1, 1), (2, 1), (4, 2), (3, 3), (6, 2)]);
        let (d, dv) = rng.pick(&[(8, 8), (16, 16), (32, 32), (64, 64), (24, 40), (128, 128)]);
        Problem {
            dtype: rng.pick(&[DType::F32, DType::F16, DType::BF16]),
            layout,
            ranks,
            causal: rng.chance(0.6),
            softcap: if rng.chance(0.2) { Some(5.0) } else { None },
            lens,
            varlen,
            hq,
            hk,
            d,
            dv,
        }
    }

    fn cu(&self) -> Vec<i32> {
        std::iter::once(0)
            .chain(self.lens.iter().scan(0i32, |s, &l| {
                *s += l as i32;
                Some(*s)
            }))
            .collect()
    }

    pub fn data<T: Element>(&self, rng: &mut Rng) -> CaseData<T> {
        let tokens: usize = self.lens.iter().sum();
        let shapes = if self.varlen {
            [vec![tokens, self.hq, self.d], vec![tokens, self.hk, self.d], vec![tokens, self.hk, self.dv]]
        } else {
            let (b, s) = (self.lens.len(), self.lens[0]);
            [vec![b, s, self.hq, self.d], vec![b, s, self.hk, self.d], vec![b, s, self.hk, self.dv]]
        };
        let mut fill = |shape: &[usize]| {
            (0..shape.iter().product::<usize>()).map(|_| T::from_f64(rng.normal())).collect::<Vec<T>>()
        };
        let (q, k, v) = (fill(&shapes[0]), fill(&shapes[1]), fill(&shapes[2]));
        let strides = shapes.clone().map(|s| flash_attn::tensor::contiguous_strides(&s));
        let cu = self.varlen.then(|| (self.cu(), self.cu()));
        CaseData { q, k, v, shapes, strides, cu_seqlens: cu, alibi: None, block_mask: None }
    }

    pub fn spec<'a, T>(&self, data: &'a CaseData<T>) -> AttentionSpec<'a> {
        let mut spec = AttentionSpec::new();
        if self.causal {
            spec = spec.causal();
        }
        if let Some(c) = self.softcap {
            spec = spec.softcap(c);
        }
        if let Some((cq, ck)) = &data.cu_seqlens {
            spec = spec.varlen(cq, ck);
        }
        spec
    }

    pub fn describe(&self) -> String {
        format!(
            "{:?} {:?} R {} causal {} softcap {:?} lens {:?} varlen {} heads {}/{} d {}/{}",
            self.dtype,
            self.layout,
            self.ranks,
            self.causal,
            self.softcap,
            self.lens,
            self.varlen,
            self.hq,
            self.hk,
            self.d,
            self.dv
        )
    }

    /// Forward and backward through the CPU's simulated ring, each against the oracle of the
    /// unsplit problem; the backward is fed the ring's own `out` and `lse`.
    pub fn check<T: Element>(&self, rng: &mut Rng) {
        let (layout, ranks) = (self.layout, self.ranks);
        self.check_with::<T>(
            rng,
            |spec, q, k, v| flash_attn::ring::simulate_forward(spec, layout, ranks, q, k, v),
            |spec, q, k, v, o, l, d| flash_attn::ring::simulate_backward(spec, layout, ranks, q, k, v, o, l, d),
        );
    }

    /// [`Problem::check`] with any forward and backward of the ring.
    pub fn check_with<T: Element>(
        &self,
        rng: &mut Rng,
        forward: impl Fn(&AttentionSpec<'_>, &Tensor<'_, T>, &Tensor<'_, T>, &Tensor<'_, T>) -> Result<Output<T>>,
        backward: impl Fn(
            &AttentionSpec<'_>,
            &Tensor<'_, T>,
            &Tensor<'_, T>,
            &Tensor<'_, T>,
            &Tensor<'_, T>,
            &[f32],
            &Tensor<'_, T>,
        ) -> Result<Gradients<T>>,
    ) {
        let data = self.data::<T>(rng);
        let spec = self.spec(&data);
        let [q, k, v] = data.views();
        let o = forward(&spec, &q, &k, &v).unwrap_or_else(|e| panic!("{}: {e}", self.describe()));
        let oracle = reference::forward(&spec, &q, &k, &v).unwrap();
        let naive = reference::naive(&spec, &q, &k, &v).unwrap();
        let r = report(&o.out, &o.lse, &oracle, &naive, self.dtype);
        assert!(r.passed(), "forward {}: {r}", self.describe());

        let dout: Vec<T> = (0..o.out.len()).map(|_| T::from_f64(rng.normal())).collect();
        let dout = Tensor::new(&dout, &o.out_shape);
        let grads = backward(&spec, &q, &k, &v, &Tensor::new(&o.out, &o.out_shape), &o.lse, &dout)
            .unwrap_or_else(|e| panic!("{}: {e}", self.describe()));
        let b = compare_gradients(&spec, &grads, &data, &dout, self.dtype).unwrap();
        assert!(b.passed(), "backward {}: {b}", self.describe());
    }
}
