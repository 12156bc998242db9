//! grpo-wgpu's reductions against grpo-core in f32 (same config structs), within the tolerance
//! table: aggregation (every mode and zero-denominator rule). Identical errors with outputs
//! untouched. Skips without an adapter unless `GRPO_REQUIRE_GPU=1`.

use std::cell::Cell;

use grpo_core::aggregate::{AggConfig, AggMode, Denominator, SeqCount, aggregate};
use grpo_core::{Error, Preset, Tokens};
use grpo_tests::gpu;
use grpo_tests::tolerance::{Dtype, Op, tolerance, ulp_distance};
use grpo_wgpu::{GpuError, LossKernel};
use proptest::prelude::*;

/// A packed or padded batch of per-token values with NaN garbage at masked positions.
#[derive(Debug, Clone)]
struct Batch {
    values: Vec<f32>,
    cu: Vec<usize>,
    /// `Some((rows, cols))`: padded layout instead of `cu`.
    padded: Option<(usize, usize)>,
    mask: Vec<bool>,
}

impl Batch {
    fn tokens(&self) -> Tokens<'_> {
        match self.padded {
            Some((r, c)) => Tokens::padded(r, c, Some(&self.mask)),
            None => Tokens::packed(&self.cu, Some(&self.mask)),
        }
    }
}

fn batch() -> impl Strategy<Value = Batch> {
    (prop::collection::vec(0usize..40, 0..8), any::<bool>())
        .prop_flat_map(|(lens, padded)| {
            let cols = lens.iter().copied().max().unwrap_or(0);
            let n = if padded {
                cols * lens.len()
            } else {
                lens.iter().sum()
            };
            let value = prop_oneof![
                4 => -3.0f32..3.0,
                1 => -1e4f32..1e4,
                1 => Just(0.0f32),
            ];
            (
                Just(lens),
                Just(padded),
                prop::collection::vec(value, n),
                prop::collection::vec(prop::bool::weighted(0.8), n),
            )
        })
        .prop_map(|(lens, padded, mut values, mask)| {
            let mut cu = vec![0];
            for &l in &lens {
                cu.push(cu.last().unwrap() + l);
            }
            let cols = lens.iter().copied().max().unwrap_or(0);
            for t in 0..values.len() {
                if !mask[t] {
                    values[t] = f32::NAN;
                }
            }
            Batch {
                values,
                cu,
                padded: padded.then_some((lens.len(), cols)),
                mask,
            }
        })
}

fn modes() -> Vec<AggMode> {
    vec![
        AggMode::TokenMean {
            global_tokens: None,
        },
        AggMode::TokenMean {
            global_tokens: Some(50),
        },
        AggMode::SeqMeanTokenMean,
        AggMode::SeqMeanTokenSum,
        AggMode::SeqMeanTokenSumNorm {
            max_len: None,
            divide_by_batch: true,
        },
        AggMode::SeqMeanTokenSumNorm {
            max_len: Some(64),
            divide_by_batch: false,
        },
        AggMode::Bnpo,
        AggMode::Dapo {
            global_tokens: 80,
            processes: 4,
        },
        AggMode::Luspo,
    ]
}

fn configs() -> Vec<AggConfig<f32>> {
    let mut v = Vec::new();
    for mode in modes() {
        for preset in [Preset::Paper, Preset::Verl, Preset::Trl] {
            v.push(AggConfig::from_preset(preset, mode));
        }
        v.push(AggConfig {
            mode,
            denominator: Denominator::PlusEps(1e-8),
            sequences: SeqCount::All,
        });
        // Non-empty sequences with TRL's clamp (the Verl preset is Strict).
        v.push(AggConfig {
            mode,
            denominator: Denominator::ClampOne,
            sequences: SeqCount::NonEmpty,
        });
    }
    v
}

#[test]
fn aggregate_matches_grpo_core() {
    let Some(ctx) = gpu::context("aggregate_matches_grpo_core") else {
        return;
    };
    let k = LossKernel::new(ctx);
    let tol = tolerance(Op::Aggregate, Dtype::F32);
    // Fn closures: counters in Cells.
    let (max_ulp, oks, errs) = (Cell::new(0u64), Cell::new(0usize), Cell::new(0usize));
    for cfg in configs() {
        gpu::runner()
            .run(&batch(), |b| {
                let n = b.values.len();
                let mut cw = vec![7f32; n];
                let c = aggregate(&cfg, b.tokens(), &b.values, &mut cw);
                let mut gw = vec![7f32; n];
                let g = k.aggregate(&cfg, b.tokens(), &b.values, &mut gw);
                match (c, g) {
                    (Ok(c), Ok(g)) => {
                        oks.set(oks.get() + 1);
                        max_ulp.set(max_ulp.get().max(ulp_distance(g, c)));
                        prop_assert!(tol.accepts(g, c as f64), "{cfg:?}: gpu {g} core {c}");
                        // The weights are counts' functions: bit-identical.
                        for t in 0..n {
                            prop_assert_eq!(gw[t].to_bits(), cw[t].to_bits(), "w[{}]", t);
                        }
                    }
                    (Err(e), g) => {
                        errs.set(errs.get() + 1);
                        prop_assert_eq!(g, Err(GpuError::Core(e)));
                        prop_assert!(gw.iter().all(|&w| w == 7.0));
                    }
                    (Ok(_), Err(e)) => return Err(TestCaseError::fail(e.to_string())),
                }
                Ok(())
            })
            .unwrap();
    }
    eprintln!(
        "aggregate: {} configs × {} cases ({} Ok, {} Err); max distance to grpo-core: {} ULP",
        configs().len(),
        gpu::cases(),
        oks.get(),
        errs.get(),
        max_ulp.get()
    );
}

#[test]
fn hand_computed_aggregates() {
    let Some(ctx) = gpu::context("hand_computed_aggregates") else {
        return;
    };
    let k = LossKernel::new(ctx);
    // Two rows of width 3: row 0 holds 1, 3 (third masked), row 1 holds 5 (two masked).
    let v = [1.0f32, 3.0, f32::NAN, 5.0, f32::NAN, f32::NAN];
    let m = [true, true, false, true, false, false];
    let tok = Tokens::padded(2, 3, Some(&m));
    let mut w = [0f32; 6];
    // token-mean: (1 + 3 + 5)/3 = 3, weights 1/3 at valid tokens.
    let loss = k.aggregate(&AggConfig::default(), tok, &v, &mut w).unwrap();
    assert_eq!(loss, 3.0);
    let third = 1.0f32 / 3.0;
    assert_eq!(w, [third, third, 0.0, third, 0.0, 0.0]);
    // seq-mean-token-mean: ((1 + 3)/2 + 5/1)/2 = 3.5; weights 1/(2·2) and 1/(2·1).
    let cfg = AggConfig::from_preset(Preset::Verl, AggMode::SeqMeanTokenMean);
    assert_eq!(k.aggregate(&cfg, tok, &v, &mut w).unwrap(), 3.5);
    assert_eq!(w, [0.25, 0.25, 0.0, 0.5, 0.0, 0.0]);
    // Dr. GRPO: 9/(2·3) = 1.5; verl's variant: 9/3 = 3.
    let dr = AggMode::SeqMeanTokenSumNorm {
        max_len: None,
        divide_by_batch: true,
    };
    let paper = AggConfig::from_preset(Preset::Paper, dr);
    assert_eq!(k.aggregate(&paper, tok, &v, &mut w).unwrap(), 1.5);
    let verl = AggConfig::from_preset(Preset::Verl, dr);
    assert_eq!(k.aggregate(&verl, tok, &v, &mut w).unwrap(), 3.0);
    // DAPO with 12 global tokens over 2 processes: 9/(12/2) = 1.5.
    let dapo = AggConfig::from_preset(
        Preset::Trl,
        AggMode::Dapo {
            global_tokens: 12,
            processes: 2,
        },
    );
    assert_eq!(k.aggregate(&dapo, tok, &v, &mut w).unwrap(), 1.5);
}

#[test]
fn aggregate_errors_match_grpo_core_and_leave_weights_untouched() {
    let Some(ctx) = gpu::context("aggregate_errors") else {
        return;
    };
    let k = LossKernel::new(ctx);
    let m = [false; 4];
    let all_masked = Tokens::padded(2, 2, Some(&m));
    let full = Tokens::padded(2, 2, None);
    let nan = [f32::NAN; 4];
    let big = [3e38f32; 4];
    let cases: Vec<(AggConfig<f32>, Tokens<'_>, &[f32], Error)> = vec![
        (AggConfig::default(), all_masked, &nan, Error::NoValidTokens),
        (
            AggConfig::from_preset(Preset::Paper, AggMode::SeqMeanTokenMean),
            all_masked,
            &nan,
            Error::EmptySegment { segment: 0 },
        ),
        // verl counts the non-empty sequences: none.
        (
            AggConfig::from_preset(Preset::Verl, AggMode::SeqMeanTokenMean),
            all_masked,
            &nan,
            Error::NoValidTokens,
        ),
        (
            AggConfig::default(),
            full,
            &nan,
            Error::NonFinite {
                what: "values",
                index: 0,
            },
        ),
        (
            AggConfig {
                mode: AggMode::SeqMeanTokenSum,
                denominator: Denominator::Strict,
                sequences: SeqCount::All,
            },
            full,
            &big,
            // (3e38 + 3e38) overflows f32.
            Error::NonFinite {
                what: "aggregated loss",
                index: 0,
            },
        ),
        (
            AggConfig {
                mode: AggMode::Dapo {
                    global_tokens: 4,
                    processes: 0,
                },
                sequences: SeqCount::All,
                denominator: Denominator::Strict,
            },
            full,
            &big,
            Error::InvalidParam {
                name: "processes",
                reason: "must be >= 1",
            },
        ),
        (
            AggConfig {
                mode: AggMode::Bnpo,
                denominator: Denominator::PlusEps(-1.0),
                sequences: SeqCount::All,
            },
            full,
            &big,
            Error::InvalidParam {
                name: "denominator eps",
                reason: "must be finite and > 0",
            },
        ),
    ];
    for (cfg, tok, v, want) in cases {
        let mut cw = [9f32; 4];
        assert_eq!(aggregate(&cfg, tok, v, &mut cw), Err(want));
        let mut gw = [9f32; 4];
        assert_eq!(
            k.aggregate(&cfg, tok, v, &mut gw),
            Err(GpuError::Core(want))
        );
        assert_eq!(gw, [9f32; 4]);
    }
    let mut w = [9f32; 3];
    assert_eq!(
        k.aggregate(&AggConfig::default(), full, &big, &mut w),
        Err(GpuError::Core(Error::LengthMismatch {
            what: "weights",
            expected: 4,
            found: 3
        }))
    );
}
