//! Ring / zigzag context parallelism (DESIGN §8) in the CPU simulation: the schedule covers every
//! visible (query, key) pair exactly once, and the simulated ranks' forward and backward meet the
//! numerics contract against the f64 oracle of the whole, unsplit problem.

mod ring_common;

use flash_attn::check::Rng;
use flash_attn::ring::{kv_source, schedule, simulate_forward, Layout, Sharding, Step};
use flash_attn::{AttentionSpec, DType, Error, Tensor};
use half::{bf16, f16};
use ring_common::Problem;

/// Which global (query, key) pairs of one sequence of length `len` the schedule computes, each
/// with the number of times it is computed.
fn coverage(layout: Layout, causal: bool, ranks: usize, len: usize) -> Vec<Vec<u32>> {
    let sharding = Sharding::new(layout, ranks).unwrap();
    let tokens = |r: usize| -> Vec<usize> { sharding.ranges(r, len).into_iter().flat_map(|(s, n)| s..s + n).collect() };
    let mut seen = vec![vec![0u32; len]; len];
    for rank in 0..ranks {
        let q = tokens(rank);
        for step in 0..ranks {
            let kv = tokens(kv_source(ranks, rank, step));
            let (qh, kh) = (q.len() / 2, kv.len() / 2);
            let (qs, ks): (&[usize], &[usize]) = match schedule(layout, causal, ranks, rank, step) {
                Step::Skip => continue,
                Step::Full => (&q, &kv),
                Step::Diagonal => {
                    for (a, &i) in q.iter().enumerate() {
                        for &j in &kv[..=a] {
                            seen[i][j] += 1;
                        }
                    }
                    continue;
                }
                Step::KeysFirstHalf => (&q, &kv[..kh]),
                Step::QueriesSecondHalf => (&q[qh..], &kv),
            };
            for &i in qs {
                for &j in ks {
                    seen[i][j] += 1;
                }
            }
        }
    }
    seen
}

#[test]
fn the_schedule_computes_every_visible_pair_exactly_once() {
    for layout in [Layout::Contiguous, Layout::Zigzag] {
        for causal in [false, true] {
            for ranks in [1, 2, 3, 4, 8] {
                let len = 2 * ranks * 3;
                let seen = coverage(layout, causal, ranks, len);
                for (i, row) in seen.iter().enumerate() {
                    for (j, &n) in row.iter().enumerate() {
                        let want = u32::from(!causal || j <= i);
                        assert_eq!(n, want, "{layout:?} causal {causal} R {ranks}: pair ({i}, {j}) computed {n} times");
                    }
                }
            }
        }
    }
}

#[test]
fn zigzag_gives_every_rank_the_same_causal_work() {
    for ranks in [2, 3, 4, 8] {
        let work = |rank: usize| -> usize {
            (0..ranks)
                .map(|step| match schedule(Layout::Zigzag, true, ranks, rank, step) {
                    Step::Skip => 0,
                    Step::Full => 4,
                    Step::Diagonal | Step::KeysFirstHalf | Step::QueriesSecondHalf => 2,
                })
                .sum()
        };
        let first = work(0);
        assert!((1..ranks).all(|r| work(r) == first), "R {ranks}");
        // The contiguous layout does not balance: the last rank has R times the first's work.
        let contiguous = |rank: usize| {
            (0..ranks).filter(|&s| schedule(Layout::Contiguous, true, ranks, rank, s) != Step::Skip).count()
        };
        assert_eq!(contiguous(ranks - 1), ranks * contiguous(0));
    }
}

fn run_random(seed: u64) {
    let mut rng = Rng::new(seed);
    let p = Problem::random(&mut rng);
    match p.dtype {
        DType::F32 => p.check::<f32>(&mut rng),
        DType::F16 => p.check::<f16>(&mut rng),
        DType::BF16 => p.check::<bf16>(&mut rng),
    }
}

#[test]
fn simulated_rings_meet_the_contract_on_random_problems() {
    let base: u64 = std::env::var("RING_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_0000);
    for case in 0..48 {
        run_random(base + case);
    }
}

#[test]
fn zigzag_causal_gqa_varlen_on_eight_ranks() {
    let p = Problem {
        dtype: DType::BF16,
        layout: Layout::Zigzag,
        ranks: 8,
        causal: true,
        softcap: None,
        lens: vec![16 * 9, 0, 16 * 3, 16 * 12],
        varlen: true,
        hq: 8,
        hk: 2,
        d: 64,
        dv: 64,
    };
    p.check::<bf16>(&mut Rng::new(81));
    let p =
        Problem { layout: Layout::Contiguous, ranks: 4, lens: vec![4 * 40; 2], varlen: false, dtype: DType::F32, ..p };
    p.check::<f32>(&mut Rng::new(82));
}

#[test]
fn what_the_ring_cannot_compute_is_an_error() {
    let q = vec![0.5f32; 8 * 2 * 16];
    let qt = Tensor::new(&q, &[1, 8, 2, 16]);
    let run =
        |spec: &AttentionSpec<'_>, layout: Layout, ranks: usize| simulate_forward(spec, layout, ranks, &qt, &qt, &qt);
    assert!(matches!(run(&AttentionSpec::new().window(2, 0), Layout::Contiguous, 2), Err(Error::Unsupported(_))));
    assert!(matches!(run(&AttentionSpec::new().dropout(0.1, 1, 0), Layout::Contiguous, 2), Err(Error::Unsupported(_))));
    assert!(matches!(run(&AttentionSpec::new(), Layout::Contiguous, 0), Err(Error::Unsupported(_))));
    assert!(matches!(run(&AttentionSpec::new(), Layout::Contiguous, 3), Err(Error::Shape(_))));
    assert!(matches!(run(&AttentionSpec::new(), Layout::Zigzag, 8), Err(Error::Shape(_))));
    let k = vec![0.5f32; 4 * 2 * 16];
    let kt = Tensor::new(&k, &[1, 4, 2, 16]);
    assert!(matches!(
        simulate_forward(&AttentionSpec::new(), Layout::Contiguous, 2, &qt, &kt, &kt),
        Err(Error::Unsupported(_))
    ));
}
