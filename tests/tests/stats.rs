//! Properties of grpo-core's statistics against f64 references.

use grpo_core::layout::Groups;
use grpo_core::stats::{Bessel, Moments, RankOrder, TiePolicy, norm_quantile, ranks};
use grpo_tests::close;
use proptest::prelude::*;

/// Two-pass f64 reference: (mean, M2).
fn two_pass(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    (mean, xs.iter().map(|x| (x - mean) * (x - mean)).sum())
}

proptest! {
    /// Sharded moments merged with Chan's rule equal the one-machine moments (the all-reduce
    /// contract), for any split into any number of shards.
    #[test]
    fn merged_moments_equal_one_pass(
        xs in prop::collection::vec(-1e3f64..1e3, 1..200),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let mut bounds: Vec<usize> = cuts.iter().map(|c| c.index(xs.len() + 1)).collect();
        bounds.push(0);
        bounds.push(xs.len());
        bounds.sort_unstable();
        let merged = bounds
            .windows(2)
            .map(|w| Moments::from_slice(&xs[w[0]..w[1]]))
            .fold(Moments::new(), Moments::merge);
        let whole = Moments::from_slice(&xs);
        let (mean, m2) = two_pass(&xs);
        prop_assert_eq!(merged.n, xs.len());
        prop_assert!(close(merged.mean, whole.mean, 1e-12, 1e-12));
        prop_assert!(close(merged.m2, whole.m2, 1e-10, 1e-9));
        prop_assert!(close(whole.mean, mean, 1e-12, 1e-12));
        prop_assert!(close(whole.m2, m2, 1e-10, 1e-9));
    }

    /// f32 moments stay within f32 rounding of the f64 two-pass reference.
    #[test]
    fn f32_moments_track_f64(xs in prop::collection::vec(-100.0f32..100.0, 2..300)) {
        let wide: Vec<f64> = xs.iter().map(|&x| x as f64).collect();
        let (mean, m2) = two_pass(&wide);
        let m = Moments::from_slice(&xs);
        prop_assert!(close(m.mean as f64, mean, 1e-5, 1e-4));
        prop_assert!(close(m.m2 as f64, m2, 1e-4, 1e-3));
    }

    /// Identical values have exactly zero spread, whatever the value and the shard split.
    #[test]
    fn identical_values_zero_variance(v in -1e6f32..1e6, n in 1usize..64, cut in 0usize..64) {
        let xs = vec![v; n];
        let cut = cut.min(n);
        let m = Moments::from_slice(&xs[..cut]).merge(Moments::from_slice(&xs[cut..]));
        prop_assert_eq!(m.mean, v);
        prop_assert_eq!(m.m2, 0.0);
        prop_assert_eq!(m.variance(Bessel::Population), Some(0.0));
    }

    /// Average ranks: a permutation of ranks sums to n(n+1)/2 and ties share a value; ordinal
    /// ranks are a permutation of 1..=n that respects the value order and, among ties, the
    /// index order.
    #[test]
    fn rank_policies(xs in prop::collection::vec(0u8..6, 0..40), desc in any::<bool>()) {
        let v: Vec<f64> = xs.iter().map(|&x| x as f64).collect();
        let n = v.len();
        let order = if desc { RankOrder::Descending } else { RankOrder::Ascending };
        let mut scratch = vec![0usize; n];
        let mut avg = vec![0.0; n];
        let mut ord = vec![0.0; n];
        ranks(&v, TiePolicy::Average, order, &mut scratch, &mut avg).unwrap();
        ranks(&v, TiePolicy::Ordinal, order, &mut scratch, &mut ord).unwrap();
        let total = (n * (n + 1)) as f64 / 2.0;
        prop_assert_eq!(avg.iter().sum::<f64>(), total);
        prop_assert_eq!(ord.iter().sum::<f64>(), total);
        for i in 0..n {
            for j in 0..n {
                let better = if desc { v[i] > v[j] } else { v[i] < v[j] };
                if v[i] == v[j] {
                    prop_assert_eq!(avg[i], avg[j]);
                    prop_assert_eq!(ord[i] < ord[j], i < j);
                } else {
                    prop_assert_eq!(ord[i] < ord[j], better);
                    prop_assert_eq!(avg[i] < avg[j], better);
                }
            }
        }
    }

    /// Φ(Φ⁻¹(u)) = u, checked with libm's erfc as an independent reference.
    #[test]
    fn norm_quantile_round_trip(u in 1e-300f64..1.0) {
        prop_assume!(u < 1.0);
        let x: f64 = norm_quantile(u).unwrap();
        let back = 0.5 * libm_erfc(-x / std::f64::consts::SQRT_2);
        prop_assert!(close(back, u, 1e-12, 1e-300), "u={u} x={x} back={back}");
    }

    /// Groups from a shuffled id array contain exactly the samples with that id, in order.
    #[test]
    fn group_ids_partition(ids in prop::collection::vec(0usize..5, 0..60)) {
        let k = ids.iter().max().map_or(0, |m| m + 1);
        prop_assume!((0..k).all(|g| ids.contains(&g)));
        let mut scratch = vec![0usize; Groups::group_ids_scratch_len(ids.len(), k)];
        let groups = Groups::from_group_ids(&ids, k, &mut scratch).unwrap();
        prop_assert_eq!(groups.validate(ids.len()).unwrap(), k);
        for g in 0..k {
            let expect: Vec<usize> = (0..ids.len()).filter(|&i| ids[i] == g).collect();
            prop_assert_eq!(groups.members(g).collect::<Vec<_>>(), expect);
        }
    }
}

/// erfc of libm. Φ⁻¹'s refinement step uses the same function, so this round trip checks the
/// inversion, not libm; the tabulated quantiles in grpo-core's unit tests are the independent check.
fn libm_erfc(x: f64) -> f64 {
    <f64 as grpo_core::Real>::erfc(x)
}
