use flash_attn::check::{Case, Rng};

#[test]
fn random_cases_meet_the_contract() {
    let mut rng = Rng::new(1234);
    let mut failed = 0;
    for n in 0..300 {
        let case = Case::random(&mut rng);
        let tiles = (n % 2 == 0).then(|| flash_attn::cpu::Tiles { br: rng.range(1, 20), bc: rng.range(1, 20) });
        let rep = case.run_cpu_tiled(tiles).unwrap();
        if !rep.passed() {
            failed += 1;
            eprintln!("case {n}: {case}: {rep}");
        }
    }
    assert_eq!(failed, 0);
}
