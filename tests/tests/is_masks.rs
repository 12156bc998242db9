//! Rollout corrections in f64 against references written here from their rustdoc: importance
//! weights at every level and filter (with and without the log clamp and batch
//! normalisation), \[verl\] rejection masks with one or several criteria at every level, and
//! \[TRL\] off-policy sequence masking — on random padded batches with masked NaN garbage and
//! empty rows, and the errors with the outputs untouched. (The GPU tests compare grpo-wgpu
//! with grpo-core; these need no GPU.)

use grpo_core::Tokens;
use grpo_core::is_correction::{
    IsConfig, IsFilter, IsLevel, RejectLevel, RejectStat, RejectionCriterion, is_weights,
    off_policy_sequence_mask, rejection_mask,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Batch {
    rows: usize,
    cols: usize,
    /// `old` (or `roll` for OPSM) and `roll` (or `lp`): their difference is the log-ratio r.
    a: Vec<f64>,
    b: Vec<f64>,
    mask: Vec<bool>,
    adv: Vec<f64>,
}

impl Batch {
    fn tokens(&self) -> Tokens<'_> {
        Tokens::padded(self.rows, self.cols, Some(&self.mask))
    }
    fn valid(&self, i: usize) -> Vec<usize> {
        (i * self.cols..(i + 1) * self.cols)
            .filter(|&t| self.mask[t])
            .collect()
    }
    fn r(&self, t: usize) -> f64 {
        self.a[t] - self.b[t]
    }
}

/// r mostly within ±0.5, sometimes ±3 or ±25 (past the ±20 clamp); masked positions hold NaN;
/// rows may be empty or all masked.
fn batch() -> impl Strategy<Value = Batch> {
    (1usize..5, 0usize..6).prop_flat_map(|(rows, cols)| {
        let n = rows * cols;
        let r = prop_oneof![6 => -0.5f64..0.5, 2 => -3.0f64..3.0, 1 => -25.0f64..25.0];
        (
            prop::collection::vec(-6.0f64..0.0, n),
            prop::collection::vec(r, n),
            prop::collection::vec(prop::bool::weighted(0.8), n),
            prop::collection::vec(prop_oneof![-2.0f64..2.0, Just(0.0)], rows),
        )
            .prop_map(move |(b, r, mask, adv)| {
                let a = (0..n)
                    .map(|t| if mask[t] { b[t] + r[t] } else { f64::NAN })
                    .collect();
                Batch {
                    rows,
                    cols,
                    a,
                    b,
                    mask,
                    adv,
                }
            })
    })
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * (1.0 + a.abs().max(b.abs()))
}

/// Whether `v` lies within a rounding band of `bound` (a decision there may go either way
/// between two correct summation orders).
fn near(v: f64, bound: f64) -> bool {
    bound.is_finite() && (v - bound).abs() <= 1e-12 * (1.0 + bound.abs())
}

fn limit(x: f64, c: Option<f64>) -> f64 {
    c.map_or(x, |c| x.clamp(-c, c))
}

/// The weights of `cfg` (level, filter, clamp, normalisation) by their definitions, or `None`
/// where a decision lies within a rounding band of a bound.
fn is_reference(cfg: &IsConfig<f64>, b: &Batch) -> Option<Vec<f64>> {
    let n = b.a.len();
    let mut w = vec![0.0; n];
    let mut unsure = false;
    let mut seq_weights = Vec::new();
    for i in 0..b.rows {
        let toks = b.valid(i);
        if toks.is_empty() {
            continue;
        }
        let sum: f64 = toks.iter().map(|&t| b.r(t)).sum();
        let mean = sum / toks.len() as f64;
        let reject_geo = match cfg.filter {
            IsFilter::GeometricMask { lo, hi } => {
                let g = limit(mean, cfg.log_clamp).exp();
                unsure |= near(g, lo) || near(g, hi);
                !(g >= lo && g <= hi)
            }
            _ => false,
        };
        for &t in &toks {
            let l = match cfg.level {
                IsLevel::Token => b.r(t),
                IsLevel::Sequence => sum,
                IsLevel::GeometricMean => mean,
            };
            let raw = limit(l, cfg.log_clamp).exp();
            w[t] = match cfg.filter {
                IsFilter::None => raw,
                IsFilter::Truncate { min, max } => raw.clamp(min, max),
                IsFilter::Mask { lo, hi } => {
                    unsure |= near(raw, lo) || near(raw, hi);
                    if raw >= lo && raw <= hi { raw } else { 0.0 }
                }
                IsFilter::GeometricMask { .. } => {
                    if reject_geo {
                        0.0
                    } else {
                        raw
                    }
                }
            };
        }
        seq_weights.push(w[toks[0]]);
    }
    if cfg.batch_normalize {
        let vals: Vec<f64> = match cfg.level {
            IsLevel::Token => (0..n).filter(|&t| b.mask[t]).map(|t| w[t]).collect(),
            _ => seq_weights,
        };
        if !vals.is_empty() {
            let m = vals.iter().sum::<f64>() / vals.len() as f64;
            unsure |= near(m, 1e-8);
            if m > 1e-8 {
                for x in &mut w {
                    *x /= m;
                }
            }
        }
    }
    (!unsure).then_some(w)
}

fn is_configs() -> Vec<IsConfig<f64>> {
    let mut v = Vec::new();
    for level in [IsLevel::Token, IsLevel::Sequence, IsLevel::GeometricMean] {
        for filter in [
            IsFilter::None,
            IsFilter::Truncate { min: 0.0, max: 2.0 },
            IsFilter::Truncate { min: 0.5, max: 5.0 },
            IsFilter::Mask { lo: 0.8, hi: 1.25 },
        ] {
            for (log_clamp, batch_normalize) in [(Some(20.0), false), (None, true)] {
                v.push(IsConfig {
                    level,
                    filter,
                    log_clamp,
                    batch_normalize,
                });
            }
        }
    }
    let narrow = IsConfig {
        filter: IsFilter::GeometricMask { lo: 0.9, hi: 1.1 },
        ..IsConfig::seq_mask_tis()
    };
    v.push(narrow);
    v.push(IsConfig {
        batch_normalize: true,
        ..IsConfig::seq_mask_tis()
    });
    v
}

/// The rejection statistic of one token (r clamped to ±20 first, as verl does).
fn stat(s: RejectStat, r: f64) -> f64 {
    let r = r.clamp(-20.0, 20.0);
    match s {
        RejectStat::K1 => -r,
        RejectStat::K2 => r * r / 2.0,
        RejectStat::K3 => r.exp() - 1.0 - r,
    }
}

fn criteria() -> impl Strategy<Value = Vec<RejectionCriterion<f64>>> {
    use RejectLevel::{SeqMax, SeqMean, SeqSum, Token};
    use RejectStat::{K2, K3};
    let one = prop_oneof![
        (
            prop::sample::select(vec![Token, SeqSum, SeqMean]),
            0.3f64..1.0,
            1.0f64..3.0
        )
            .prop_map(|(l, lo, hi)| RejectionCriterion::k1(l, lo, hi).unwrap()),
        (
            prop::sample::select(vec![K2, K3]),
            prop::sample::select(vec![Token, SeqSum, SeqMean, SeqMax]),
            0.01f64..3.0
        )
            .prop_map(|(s, l, u)| RejectionCriterion::upper(s, l, u).unwrap()),
    ];
    prop::collection::vec(one, 0..4)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn is_weights_match_their_definitions(b in batch()) {
        for cfg in is_configs() {
            let mut w = vec![7.0; b.a.len()];
            is_weights(&cfg, &b.a, &b.b, &b.tokens(), &mut w).unwrap();
            let Some(want) = is_reference(&cfg, &b) else { continue };
            for t in 0..w.len() {
                prop_assert!(close(w[t], want[t]), "{:?} at {}: {} vs {}", cfg, t, w[t], want[t]);
            }
        }
    }

    #[test]
    fn rejection_masks_match_their_definition(b in batch(), cs in criteria()) {
        let mut keep = vec![true; b.a.len()];
        let d = rejection_mask(&cs, &b.a, &b.b, &b.tokens(), &mut keep).unwrap();
        let (mut rejected, mut rejected_seqs, mut total) = (0, 0, 0);
        for i in 0..b.rows {
            let toks = b.valid(i);
            // Sequence criteria: Σ, mean or max of the token statistics over the valid tokens.
            let mut seq_ok = true;
            for c in cs.iter().filter(|c| c.level != RejectLevel::Token) {
                if toks.is_empty() {
                    continue;
                }
                let s: Vec<f64> = toks.iter().map(|&t| stat(c.stat, b.r(t))).collect();
                let v = match c.level {
                    RejectLevel::SeqSum => s.iter().sum(),
                    RejectLevel::SeqMean => s.iter().sum::<f64>() / s.len() as f64,
                    _ => s.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
                };
                prop_assume!(!near(v, c.lo) && !near(v, c.hi));
                seq_ok &= v >= c.lo && v <= c.hi;
            }
            let mut all_rejected = !toks.is_empty();
            for &t in &toks {
                let mut ok = seq_ok;
                for c in cs.iter().filter(|c| c.level == RejectLevel::Token) {
                    let v = stat(c.stat, b.r(t));
                    prop_assume!(!near(v, c.lo) && !near(v, c.hi));
                    ok &= v >= c.lo && v <= c.hi;
                }
                prop_assert_eq!(keep[t], ok, "token {} of sequence {}", t, i);
                total += 1;
                rejected += usize::from(!ok);
                all_rejected &= !ok;
            }
            rejected_seqs += usize::from(all_rejected);
            for t in i * b.cols..(i + 1) * b.cols {
                if !b.mask[t] {
                    prop_assert!(!keep[t], "masked position {} kept", t);
                }
            }
        }
        prop_assert_eq!((d.tokens, d.rejected_tokens, d.rejected_sequences), (total, rejected, rejected_seqs));
    }

    #[test]
    fn off_policy_sequence_masks_match_their_definition(b in batch(), delta in prop_oneof![Just(0.0f64), 0.0f64..1.0]) {
        // Here a = roll and b = lp: drop sequence i iff it has a valid token, A_i < 0 and
        // mean(roll − lp) > δ.
        let mut keep = vec![true; b.rows];
        off_policy_sequence_mask(&b.adv, &b.b, &b.a, &b.tokens(), delta, &mut keep).unwrap();
        for i in 0..b.rows {
            let toks = b.valid(i);
            let drop = if toks.is_empty() {
                false
            } else {
                let mean = toks.iter().map(|&t| b.r(t)).sum::<f64>() / toks.len() as f64;
                prop_assume!(!near(mean, delta));
                b.adv[i] < 0.0 && mean > delta
            };
            prop_assert_eq!(keep[i], !drop, "sequence {}", i);
        }
    }

    #[test]
    fn errors_leave_the_outputs_untouched(b in batch(), pick in any::<prop::sample::Index>()) {
        // A NaN at a valid position of either input: every function refuses it, and both
        // sentinels survive (one of them shows any write).
        let valid: Vec<usize> = (0..b.mask.len()).filter(|&t| b.mask[t]).collect();
        prop_assume!(!valid.is_empty());
        let t = valid[pick.index(valid.len())];
        let mut bad = b.a.clone();
        bad[t] = f64::NAN;
        let c = [RejectionCriterion::upper(RejectStat::K2, RejectLevel::Token, 1.0).unwrap()];
        for sentinel in [true, false] {
            let mut keep = vec![sentinel; b.a.len()];
            prop_assert!(rejection_mask(&c, &bad, &b.b, &b.tokens(), &mut keep).is_err());
            prop_assert!(rejection_mask(&c, &b.a, &bad, &b.tokens(), &mut keep).is_err());
            prop_assert!(keep.iter().all(|&k| k == sentinel));
            let mut keep = vec![sentinel; b.rows];
            prop_assert!(off_policy_sequence_mask(&b.adv, &bad, &b.b, &b.tokens(), 0.1, &mut keep).is_err());
            prop_assert!(keep.iter().all(|&k| k == sentinel));
        }
        let mut w = vec![7.0; b.a.len()];
        prop_assert!(is_weights(&IsConfig::default(), &bad, &b.b, &b.tokens(), &mut w).is_err());
        prop_assert!(w.iter().all(|&x| x == 7.0));
    }
}
