//! The numerics contract of DESIGN §2 on random problems: for `out` and `lse`,
//! `max|cpu - oracle_f64| <= 2 · max|naive_T - oracle_f64| + eps_T · max(1, max|oracle_f64|)`,
//! with non-finite oracle values matched exactly.
//!
//! Every option combination is drawn: dtype, heads (MHA/GQA/MQA), head dims (odd, `d != dv`, up to
//! 512), lengths (1, not multiples of any tile, `sq != sk` both ways, empty varlen sequences),
//! causal (both alignments), windows (with unbounded sides), softcap, scale, ALiBi `[hq]` and
//! `[b, hq]`, block masks of any block size (`[qb, kb]` and `[b, hq, qb, kb]`), strided storage;
//! each with the backend's tiles and with small explicit ones. `PROPTEST_CASES=n` runs `n` cases
//! per property instead of the defaults below.

mod common;

use common::{config, explicit_tiles};
use flash_attn::check::{Case, CaseReport};
use flash_attn::cpu::{Isa, Tiles};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

fn meets_contract(isa: Isa, case: &Case, tiles: Option<Tiles>) -> Result<(), TestCaseError> {
    let Some(case) = common::on_isa(isa, case.clone()) else { return Ok(()) };
    let case = &case;
    let report: CaseReport = match case.run_cpu_tiled(tiles) {
        Ok(r) => r,
        Err(e) => return Err(TestCaseError::fail(format!("{case}: valid case rejected: {e}"))),
    };
    prop_assert!(report.passed(), "{case} tiles={tiles:?}: {report}");
    Ok(())
}

/// `Case` itself must describe every valid problem, an empty fixed-length batch included.
#[test]
fn an_empty_fixed_length_batch_meets_the_contract() {
    let case = Case { seqlens: vec![], ..common::plain(flash_attn::DType::F32, 1, (3, 4), (2, 1), 8) };
    let report = case.run_cpu().expect("an empty batch is valid");
    assert!(report.passed(), "{report}");
}

// The properties, once per instruction-set path (`portable::…`, `avx2::…`, `avx512::…`, `neon::…`).
for_each_isa! {
proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn random_problems_meet_the_contract_with_the_backend_tiles(case in common::cases()) {
        meets_contract(ISA, &case, None)?;
    }

    #[test]
    fn random_problems_meet_the_contract_with_explicit_tiles(case in common::cases(), tiles in explicit_tiles()) {
        meets_contract(ISA, &case, Some(tiles))?;
    }
}

proptest! {
    #![proptest_config(config(64))]

    /// Head dims up to the CPU limit of 512, on short sequences to keep the oracle quick.
    #[test]
    fn large_head_dims_meet_the_contract(
        case in common::cases_with(24, common::large_head_dims(), (1usize..=2).prop_map(|hk| (2 * hk, hk))),
        tiles in prop::option::of(explicit_tiles()),
    ) {
        meets_contract(ISA, &case, tiles)?;
    }

    /// Packed batches where sequences are often empty on one side or both.
    #[test]
    fn varlen_batches_with_empty_sequences_meet_the_contract(
        case in common::cases(),
        seqlens in prop::collection::vec(
            prop_oneof![(Just(0usize), 0usize..=90), (0usize..=90, Just(0usize)), Just((0, 0)), (0usize..=90, 0usize..=90)],
            1..=5,
        ),
        tiles in prop::option::of(explicit_tiles()),
    ) {
        let case = Case { seqlens, varlen: true, ..case };
        meets_contract(ISA, &case, tiles)?;
    }

    /// Block-sparse masks of every block size, shared or per head, empty to dense.
    #[test]
    fn block_sparse_masks_meet_the_contract(
        case in common::cases(),
        block in common::block_case(),
        tiles in prop::option::of(explicit_tiles()),
    ) {
        let case = Case { block: Some(block), ..case };
        meets_contract(ISA, &case, tiles)?;
    }

    /// Few query rows over thousands of keys: the forward splits the keys into ranges of whole key
    /// tiles, each its own work unit, and merges them by their log-sum-exp.
    #[test]
    fn few_queries_over_many_keys_meet_the_contract(
        case in common::cases_with(8, common::head_dims(40), common::heads()),
        lens in prop::collection::vec((1usize..=64, 2048usize..=5000), 1..=2),
        tiles in prop::option::of(explicit_tiles()),
    ) {
        let seqlens = if case.varlen { lens } else { vec![lens[0]; lens.len()] };
        let case = Case { seqlens, ..case };
        meets_contract(ISA, &case, tiles)?;
    }

    /// Decoding (one query against a long cache) and its mirror image (one key).
    #[test]
    fn single_query_and_single_key_problems_meet_the_contract(
        case in common::cases(),
        long in 1usize..=300,
        single_query in any::<bool>(),
        tiles in prop::option::of(explicit_tiles()),
    ) {
        let lens = if single_query { (1, long) } else { (long, 1) };
        let seqlens = vec![lens; case.seqlens.len()];
        let case = Case { seqlens, ..case };
        meets_contract(ISA, &case, tiles)?;
    }
}
}
