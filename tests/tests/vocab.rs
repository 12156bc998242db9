//! Properties of the vocabulary kernels (grpo_core::vocab) on random rows: batched = single
//! row bit for bit, normalisation, bounds, invariances, untouched outputs on error.

use grpo_core::vocab::{
    self, GradTerms, KlDirection, KlTerm, backward_rows, kl_rows, logprob_entropy_rows, stats_rows,
};
use grpo_tests::close;
use proptest::prelude::*;

/// Row lengths around the lane width and a block boundary.
fn vocab_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 1usize..=65,
        1 => (0usize..4).prop_map(|k| 2048 - 2 + k),
        1 => (0usize..3).prop_map(|k| 4096 + 15 + k),
    ]
}

/// A logit: mostly moderate, sometimes masked, huge negative, ±0 or subnormal.
fn logit() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -12.0f32..12.0,
        1 => Just(f32::NEG_INFINITY),
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
        1 => Just(1e-41f32),
        1 => Just(-1e30f32),
    ]
}

fn rows_strategy() -> impl Strategy<Value = (usize, usize, Vec<f32>, Vec<f32>)> {
    (vocab_len(), 1usize..4).prop_flat_map(|(v, r)| {
        (
            Just(v),
            Just(r),
            prop::collection::vec(logit(), v * r),
            prop::collection::vec(-8.0f32..8.0, v * r),
        )
    })
}

/// The first unmasked index of each row (a row with none gets index 0).
fn targets(z: &[f32], v: usize) -> Vec<u32> {
    z.chunks(v)
        .map(|row| row.iter().position(|x| *x > f32::NEG_INFINITY).unwrap_or(0) as u32)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn batched_equals_single_row_and_is_normalised(
        (v, r, z, w) in rows_strategy(), t in 0.3f32..3.0
    ) {
        let ys = targets(&z, v);
        let (mut lp, mut h) = (vec![0.0f32; r], vec![0.0f32; r]);
        let ok = logprob_entropy_rows(&z, v, &ys, t, &mut lp, Some(&mut h));
        for row in 0..r {
            let zr = &z[row * v..(row + 1) * v];
            let single = vocab::logprob_entropy(zr, ys[row], t);
            match (&ok, single) {
                (Ok(()), Ok((a, b))) => {
                    prop_assert_eq!(a.to_bits(), lp[row].to_bits());
                    prop_assert_eq!(b.to_bits(), h[row].to_bits());
                    // Σ_v p_v = 1 and 0 ≤ H ≤ ln(#unmasked)
                    // (checked in f64 against an f64 log-sum-exp; Σp only where |lse| is moderate,
                    // since the lse contract is relative: at |lse| = 1e30 an f32 ulp is 1e23)
                    let lse = vocab::log_sum_exp(zr, t).unwrap() as f64;
                    let scaled: Vec<f64> = zr.iter().map(|&x| x as f64 / t as f64).collect();
                    let m = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let lse64 = m + scaled.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                    prop_assert!(close(lse, lse64, 1e-6, 2e-6), "lse {} vs f64 {}", lse, lse64);
                    if lse64.abs() < 1e3 {
                        let total: f64 = scaled.iter().map(|x| (x - lse).exp()).sum();
                        prop_assert!(close(total, 1.0, 0.0, 1e-5), "Σp = {}", total);
                    }
                    let n = zr.iter().filter(|x| **x > f32::NEG_INFINITY).count() as f32;
                    prop_assert!(b >= -1e-6 && b <= n.ln() + 1e-5, "H = {} n = {}", b, n);
                    prop_assert!(a <= 1e-6);
                }
                (Err(_), _) => {}
                (Ok(()), Err(e)) => prop_assert!(false, "batched Ok but row {} fails: {:?}", row, e),
            }
        }
        // teacher rows are finite everywhere: KL(p‖q) is defined, ≥ 0, and 0 against itself
        let mut kl = vec![0.0f32; r];
        if kl_rows(&z, &w, v, t, KlDirection::StudentTeacher, &mut kl).is_ok() {
            for &k in &kl {
                prop_assert!(k >= -1e-5, "KL = {}", k);
            }
        }
        let mut self_kl = vec![1.0f32; r];
        if kl_rows(&w, &w, v, t, KlDirection::TeacherStudent, &mut self_kl).is_ok() {
            prop_assert!(self_kl.iter().all(|&k| k == 0.0), "{:?}", self_kl);
        }
    }

    #[test]
    fn shifting_a_row_changes_lse_only(
        (v, _r, z, _w) in rows_strategy(), c in -4i32..4
    ) {
        // −1e30 would absorb the shift (x + c = x): such logits become −100 here, so every
        // row with an unmasked logit is checked.
        let zr: Vec<f32> = z[..v]
            .iter()
            .map(|&x| if x.is_finite() && x.abs() >= 1e3 { -100.0 } else { x })
            .collect();
        let masked = zr.iter().all(|&x| x == f32::NEG_INFINITY);
        match vocab::row_stats(&zr, 1.0) {
            Ok(a) => {
                let zs: Vec<f32> = zr.iter().map(|&x| x + c as f32).collect();
                let b = vocab::row_stats(&zs, 1.0).unwrap();
                prop_assert!(close(b.entropy as f64, a.entropy as f64, 1e-5, 2e-5));
                prop_assert!(close(b.lse as f64, a.lse as f64 + c as f64, 1e-6, 2e-5));
            }
            Err(e) => prop_assert!(masked, "{:?}", e),
        }
    }

    #[test]
    fn gradients_sum_to_zero_and_errors_leave_outputs_untouched(
        (v, r, z, w) in rows_strategy(), t in 0.5f32..2.0, poison in any::<bool>()
    ) {
        let ys = targets(&z, v);
        let g = vec![0.5f32; r];
        let mut zz = z.clone();
        if poison {
            let i = zz.len() / 2;
            zz[i] = f32::NAN;
        }
        // The teacher is finite everywhere, so KL(p‖q)'s support always holds: the only
        // invalid inputs are the poisoned NaN and a student row without an unmasked logit.
        // (KL(q‖p) would refuse every row with a masked student logit, most of them.)
        let kl = KlTerm { teacher: &w[..], grad: &g[..], direction: KlDirection::StudentTeacher };
        let terms = GradTerms { logp: Some((&ys[..], &g[..])), entropy: Some(&g[..]), kl: Some(kl) };
        let masked_row = z.chunks(v).any(|row| row.iter().all(|&x| x == f32::NEG_INFINITY));
        let mut out = vec![7.0f32; zz.len()];
        match backward_rows(&zz, v, t, &terms, &mut out) {
            Ok(()) => {
                prop_assert!(!poison && !masked_row);
                for row in out.chunks(v) {
                    let s: f64 = row.iter().map(|&x| x as f64).sum();
                    prop_assert!(s.abs() < 1e-4, "Σ grad = {}", s);
                }
            }
            Err(e) => {
                prop_assert!(poison || masked_row, "{:?}", e);
                prop_assert!(out.iter().all(|&x| x == 7.0));
            }
        }
        let (mut l, mut h) = (vec![7.0f32; r], vec![7.0f32; r]);
        if stats_rows(&zz, v, t, &mut l, &mut h).is_err() {
            prop_assert!(l.iter().chain(&h).all(|&x| x == 7.0));
        }
    }
}
