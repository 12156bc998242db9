//! Aggregation: the weights sum as documented, the scalar equals Σ w_t L_t, invalid positions
//! get weight 0, and `scale_gradients` gives the sequence mass for sequence-level losses, or
//! refuses a non-finite result with the gradients untouched.

use grpo_core::aggregate::{
    AggConfig, AggMode, Denominator, SeqCount, aggregate, scale_gradients, sequence_weights,
};
use grpo_core::loss::LossLevel;
use grpo_core::{Error, Tokens};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Batch {
    values: Vec<f64>,
    mask: Vec<bool>,
    rows: usize,
    cols: usize,
}

fn batch() -> impl Strategy<Value = Batch> {
    (1usize..5, 1usize..7).prop_flat_map(|(rows, cols)| {
        let n = rows * cols;
        (
            proptest::collection::vec(-5.0f64..5.0, n),
            proptest::collection::vec(prop::bool::weighted(0.7), n),
        )
            .prop_map(move |(mut values, mask)| {
                for t in 0..n {
                    if !mask[t] {
                        values[t] = f64::NAN; // garbage where invalid
                    }
                }
                Batch {
                    values,
                    mask,
                    rows,
                    cols,
                }
            })
    })
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * (1.0 + a.abs().max(b.abs()))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn weights_sum_as_documented(b in batch(), global in 1usize..100, procs in 1usize..8) {
        let tok = Tokens::padded(b.rows, b.cols, Some(&b.mask));
        let n_valid = b.mask.iter().filter(|&&m| m).count() as f64;
        let nonempty = (0..b.rows).filter(|&i| tok.valid_count(i) > 0).count() as f64;
        let l = b.cols as f64;
        // B of a mean over sequences: every row, or the non-empty ones (verl), ClampOne's
        // max(B, 1) where none is.
        for (sequences, rows) in [(SeqCount::All, b.rows as f64), (SeqCount::NonEmpty, nonempty.max(1.0))] {
            let cases: Vec<(AggMode, f64)> = vec![
                // token-mean: Σ w = 1 over valid tokens (N ≥ 1), with a global count N/N_global.
                (AggMode::TokenMean { global_tokens: None }, if n_valid > 0.0 { 1.0 } else { 0.0 }),
                (AggMode::TokenMean { global_tokens: Some(global) }, n_valid / global as f64),
                (AggMode::Bnpo, if n_valid > 0.0 { 1.0 } else { 0.0 }),
                // seq-mean-token-mean: each non-empty sequence has mass 1/B.
                (AggMode::SeqMeanTokenMean, nonempty / rows),
                (AggMode::SeqMeanTokenSum, n_valid / rows),
                (AggMode::Luspo, n_valid / rows),
                (AggMode::SeqMeanTokenSumNorm { max_len: None, divide_by_batch: true }, n_valid / (rows * l)),
                (AggMode::SeqMeanTokenSumNorm { max_len: Some(11), divide_by_batch: false }, n_valid / 11.0),
                (AggMode::Dapo { global_tokens: global, processes: procs }, n_valid * procs as f64 / global as f64),
            ];
            for (mode, want) in cases {
                let cfg = AggConfig { mode, denominator: Denominator::ClampOne, sequences };
                let mut w = vec![f64::NAN; b.values.len()];
                let loss = aggregate(&cfg, tok, &b.values, &mut w).unwrap();
                let sum: f64 = w.iter().sum();
                prop_assert!(close(sum, want), "{:?} {:?}: Σw = {} want {}", mode, sequences, sum, want);
                let dot: f64 = (0..w.len()).filter(|&t| b.mask[t]).map(|t| w[t] * b.values[t]).sum();
                prop_assert!(close(loss, dot), "{:?}: loss {} Σ w L {}", mode, loss, dot);
                for t in 0..w.len() {
                    if !b.mask[t] {
                        prop_assert_eq!(w[t], 0.0);
                    }
                }
                // sequence_weights gives each valid token's weight (0 for an empty sequence
                // under a per-sequence mean), with the same bits.
                let mut ws = vec![f64::NAN; b.rows];
                sequence_weights(&cfg, tok, b.values.len(), &mut ws).unwrap();
                for i in 0..b.rows {
                    for t in tok.valid_positions(i) {
                        prop_assert_eq!(w[t].to_bits(), ws[i].to_bits());
                    }
                    if mode == AggMode::SeqMeanTokenMean && tok.valid_count(i) == 0 {
                        prop_assert_eq!(ws[i], 0.0);
                    }
                }
                if mode == AggMode::SeqMeanTokenMean {
                    for i in 0..b.rows {
                        let mass: f64 = tok.valid_positions(i).map(|t| w[t]).sum();
                        if tok.valid_count(i) > 0 {
                            prop_assert!(close(mass, 1.0 / rows));
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn sequence_level_scaling_uses_sequence_mass(b in batch()) {
        let tok = Tokens::padded(b.rows, b.cols, Some(&b.mask));
        let cfg = AggConfig { mode: AggMode::SeqMeanTokenSum, denominator: Denominator::ClampOne, sequences: SeqCount::All };
        let mut w = vec![0.0; b.values.len()];
        aggregate(&cfg, tok, &b.values, &mut w).unwrap();
        let mut g = vec![1.0; b.values.len()];
        scale_gradients(tok, &w, LossLevel::Sequence, &mut g).unwrap();
        for i in 0..b.rows {
            // Mass of sequence i = n_i / B.
            let want = tok.valid_count(i) as f64 / b.rows as f64;
            for t in tok.span(i) {
                if b.mask[t] {
                    prop_assert!(close(g[t], want));
                } else {
                    prop_assert_eq!(g[t], 0.0);
                }
            }
        }
    }

    #[test]
    fn scaled_gradients_are_exact_or_refused_untouched(
        b in batch(),
        level in prop::bool::ANY,
        exps in proptest::collection::vec((0i32..=308, 0i32..=308), 24),
    ) {
        // Weights and gradients from 1 to 1e308, so masses and products overflow in some cases
        // and not in others; NaN gradients at invalid positions must not matter.
        let tok = Tokens::padded(b.rows, b.cols, Some(&b.mask));
        let n = b.values.len();
        let w: Vec<f64> = (0..n).map(|t| 10f64.powi(exps[t % 24].0)).collect();
        let g0: Vec<f64> = (0..n)
            .map(|t| if b.mask[t] { 10f64.powi(exps[t % 24].1) * b.values[t] } else { f64::NAN })
            .collect();
        let level = if level { LossLevel::Sequence } else { LossLevel::Token };
        // Reference: the factor of each valid token (sequence mass summed in index order).
        let mut want = vec![0.0; n];
        let mut first_bad = None;
        for i in 0..b.rows {
            let mass: f64 = tok.valid_positions(i).fold(0.0, |s, t| s + w[t]);
            for t in tok.valid_positions(i) {
                let f = if level == LossLevel::Sequence { mass } else { w[t] };
                want[t] = g0[t] * f;
                if !want[t].is_finite() && first_bad.is_none() {
                    first_bad = Some(t);
                }
            }
        }
        let mut g = g0.clone();
        match (scale_gradients(tok, &w, level, &mut g), first_bad) {
            (Ok(()), None) => prop_assert_eq!(g, want),
            (Err(e), Some(index)) => {
                prop_assert_eq!(e, Error::NonFinite { what: "scaled gradient", index });
                for t in 0..n {
                    prop_assert!(g[t].to_bits() == g0[t].to_bits());
                }
            }
            (r, bad) => prop_assert!(false, "got {:?}, first non-finite result at {:?}", r, bad),
        }
    }

    #[test]
    fn packed_and_padded_agree(b in batch()) {
        // The same rows packed back to back with their padding inside the segments.
        let cu: Vec<usize> = (0..=b.rows).map(|i| i * b.cols).collect();
        let padded = Tokens::padded(b.rows, b.cols, Some(&b.mask));
        let packed = Tokens::packed(&cu, Some(&b.mask));
        for mode in [AggMode::SeqMeanTokenMean, AggMode::TokenMean { global_tokens: None }, AggMode::Luspo] {
            let cfg = AggConfig { mode, denominator: Denominator::ClampOne, sequences: SeqCount::All };
            let (mut w1, mut w2) = (vec![0.0; b.values.len()], vec![0.0; b.values.len()]);
            let l1 = aggregate(&cfg, padded, &b.values, &mut w1).unwrap();
            let l2 = aggregate(&cfg, packed, &b.values, &mut w2).unwrap();
            prop_assert_eq!(l1, l2);
            prop_assert_eq!(w1, w2);
        }
    }
}

#[test]
fn strict_all_masked_is_an_error_and_clamp_one_is_zero() {
    let v = [f64::NAN; 6];
    let m = [false; 6];
    let tok = Tokens::padded(2, 3, Some(&m));
    for mode in [
        AggMode::TokenMean {
            global_tokens: None,
        },
        AggMode::Bnpo,
        AggMode::SeqMeanTokenMean,
        AggMode::Dapo {
            global_tokens: 0,
            processes: 1,
        },
    ] {
        let mut w = [5.0; 6];
        let strict = AggConfig::<f64> {
            mode,
            denominator: Denominator::Strict,
            sequences: SeqCount::All,
        };
        assert!(aggregate(&strict, tok, &v, &mut w).is_err(), "{mode:?}");
        assert_eq!(w, [5.0; 6]);
        let trl = AggConfig::<f64> {
            mode,
            denominator: Denominator::ClampOne,
            sequences: SeqCount::All,
        };
        assert_eq!(aggregate(&trl, tok, &v, &mut w), Ok(0.0), "{mode:?}");
        assert_eq!(w, [0.0; 6]);
    }
    // No sequences at all under seq-mean: B = 0.
    let cu = [0usize];
    let mut w: [f64; 0] = [];
    for sequences in [SeqCount::All, SeqCount::NonEmpty] {
        let cfg = AggConfig::<f64> {
            mode: AggMode::SeqMeanTokenSum,
            denominator: Denominator::Strict,
            sequences,
        };
        assert!(aggregate(&cfg, Tokens::packed(&cu, None), &[], &mut w).is_err());
    }
}
