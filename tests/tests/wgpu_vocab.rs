//! grpo-wgpu's vocabulary kernels against an f64 evaluation of MATH.md §5 on the stored values,
//! within the tolerance table (`grpo_tests::tolerance`), for f32, f16 and bf16 storage.
//! Skips (with a message) without an adapter unless `GRPO_REQUIRE_GPU=1`.

use grpo_core::Error;
use grpo_core::vocab::{GradTerms, JsdState, KlDirection, KlTerm, LseState, PairState};
use grpo_tests::tolerance::{Dtype, Op, tolerance};
use grpo_tests::{gpu, log_softmax};
use grpo_wgpu::{ForwardOut, GpuError, LogitStorage, ResidentVocab, VocabKernel};
use proptest::prelude::*;

/// f64 reference of one row: (lse, logp(y), H, p), with `H = −Σ p log p`.
fn reference(row: &[f64], y: usize, t: f64) -> (f64, f64, f64, Vec<f64>) {
    let (lse, lp) = log_softmax(row, t);
    let p: Vec<f64> = lp.iter().map(|&l| l.exp()).collect();
    let h = -lp
        .iter()
        .zip(&p)
        .filter(|(_, p)| **p > 0.0)
        .map(|(l, p)| p * l)
        .sum::<f64>();
    (lse, lp[y], h, p)
}

fn kl_reference(a: &[f64], b: &[f64], t: f64) -> f64 {
    let (_, la) = log_softmax(a, t);
    let (_, lb) = log_softmax(b, t);
    la.iter()
        .zip(&lb)
        .map(|(&la, &lb)| (la.exp(), la - lb))
        .filter(|(p, _)| *p > 0.0)
        .map(|(p, d)| p * d)
        .sum()
}

/// Row lengths: small edge lengths, around the 256-lane workgroup, and a long one.
fn vocab_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 1usize..=65,
        2 => prop::sample::select(vec![15usize, 16, 17, 255, 256, 257, 511, 512, 513]),
        1 => 1000usize..5000,
    ]
}

fn logit() -> impl Strategy<Value = f32> {
    prop_oneof![
        6 => -12.0f32..12.0,
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
        1 => -60.0f32..60.0,
        1 => Just(f32::NEG_INFINITY),
    ]
}

#[derive(Debug, Clone)]
struct Case {
    vocab: usize,
    rows: usize,
    logits: Vec<f32>,
    targets: Vec<u32>,
    temp: f32,
}

fn case() -> impl Strategy<Value = Case> {
    (
        vocab_len(),
        1usize..4,
        prop::sample::select(vec![1.0f32, 0.7, 2.0]),
    )
        .prop_flat_map(|(vocab, rows, temp)| {
            (
                prop::collection::vec(logit(), vocab * rows),
                prop::collection::vec(0..vocab as u32, rows),
                Just((vocab, rows, temp)),
            )
        })
        .prop_map(|(mut logits, targets, (vocab, rows, temp))| {
            // Every row keeps at least one finite logit (an all −∞ row is an error, tested
            // separately), and the target's logit is finite.
            for r in 0..rows {
                let y = targets[r] as usize;
                if !logits[r * vocab + y].is_finite() {
                    logits[r * vocab + y] = 1.0;
                }
            }
            Case {
                vocab,
                rows,
                logits,
                targets,
                temp,
            }
        })
}

fn convert<L: LogitStorage>(c: &Case, f: fn(f32) -> L, back: fn(L) -> f32) -> (Vec<L>, Vec<f64>) {
    let stored: Vec<L> = c.logits.iter().map(|&x| f(x)).collect();
    let wide = stored.iter().map(|&x| back(x) as f64).collect();
    (stored, wide)
}

fn check_forward<L: LogitStorage>(
    k: &VocabKernel<'_>,
    c: &Case,
    dtype: Dtype,
    f: fn(f32) -> L,
    back: fn(L) -> f32,
) -> Result<(), TestCaseError> {
    let (stored, wide) = convert(c, f, back);
    let (mut lse, mut logp, mut h) = (vec![0f32; c.rows], vec![0f32; c.rows], vec![0f32; c.rows]);
    k.forward(
        &stored,
        c.vocab,
        &c.targets,
        c.temp,
        ForwardOut {
            lse: Some(&mut lse),
            logp: Some(&mut logp),
            entropy: Some(&mut h),
        },
    )
    .map_err(|e| TestCaseError::fail(e.to_string()))?;
    for r in 0..c.rows {
        let row = &wide[r * c.vocab..(r + 1) * c.vocab];
        if !row.iter().any(|v| v.is_finite()) {
            continue;
        }
        let (rl, rp, rh, _) = reference(row, c.targets[r] as usize, c.temp as f64);
        prop_assert!(
            tolerance(Op::Lse, dtype).accepts(lse[r], rl),
            "lse {} vs {rl} ({c:?})",
            lse[r]
        );
        prop_assert!(
            tolerance(Op::Logp, dtype).accepts(logp[r], rp),
            "logp {} vs {rp}",
            logp[r]
        );
        prop_assert!(
            tolerance(Op::Entropy, dtype).accepts(h[r], rh),
            "H {} vs {rh}",
            h[r]
        );
    }
    Ok(())
}

fn has_finite_rows(c: &Case, wide: &[f64]) -> bool {
    (0..c.rows).all(|r| {
        wide[r * c.vocab..(r + 1) * c.vocab]
            .iter()
            .any(|v| v.is_finite())
    })
}

#[test]
fn forward_f32_matches_f64_reference() {
    let Some(ctx) = gpu::context("forward_f32_matches_f64_reference") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    gpu::runner()
        .run(&case(), |c| check_forward(&k, &c, Dtype::F32, |x| x, |x| x))
        .unwrap();
    eprintln!("forward f32: {} cases", gpu::cases());
}

#[test]
fn forward_bf16_matches_f64_reference() {
    let Some(ctx) = gpu::context("forward_bf16_matches_f64_reference") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    gpu::runner()
        .run(&case(), |c| {
            check_forward(
                &k,
                &c,
                Dtype::Bf16,
                half::bf16::from_f32,
                half::bf16::to_f32,
            )
        })
        .unwrap();
    eprintln!("forward bf16: {} cases", gpu::cases());
}

#[test]
fn forward_f16_matches_f64_reference() {
    let Some(ctx) = gpu::context("forward_f16_matches_f64_reference") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    if !ctx.supports_f16() {
        let r = k.log_sum_exp(&[half::f16::ZERO], 1, 1.0, &mut [0.0]);
        assert_eq!(
            r,
            Err(GpuError::MissingFeature {
                feature: "SHADER_F16"
            })
        );
        eprintln!("forward f16: adapter lacks SHADER_F16; checked the error instead");
        return;
    }
    gpu::runner()
        .run(&case(), |c| {
            check_forward(&k, &c, Dtype::F16, half::f16::from_f32, half::f16::to_f32)
        })
        .unwrap();
    eprintln!("forward f16: {} cases", gpu::cases());
}

#[test]
fn long_rows_meet_the_accuracy_contract() {
    // MATH.md §5: V up to 262144 in f32; Qwen's 151936 and a row past 2^18 to exercise blocking.
    let Some(ctx) = gpu::context("long_rows_meet_the_accuracy_contract") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    for &vocab in &[151_936usize, 262_144] {
        let rows = 2;
        // Deterministic pseudo-random logits in [-8, 8) plus a peak (a trained model's row).
        let mut state = 0x9e3779b97f4a7c15u64;
        let mut logits: Vec<f32> = (0..rows * vocab)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 16.0 - 8.0
            })
            .collect();
        logits[17] = 25.0;
        let targets = vec![17u32, (vocab - 1) as u32];
        let c = Case {
            vocab,
            rows,
            logits,
            targets,
            temp: 1.0,
        };
        check_forward(&k, &c, Dtype::F32, |x| x, |x| x).unwrap();
        eprintln!("long row V={vocab}: ok");
    }
}

#[test]
fn kl_matches_f64_reference() {
    let Some(ctx) = gpu::context("kl_matches_f64_reference") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    let strat = case().prop_flat_map(|c| {
        let n = c.logits.len();
        (Just(c), prop::collection::vec(-12.0f32..12.0, n))
    });
    gpu::runner()
        .run(&strat, |(c, teacher)| {
            let (mut kl, mut rev) = (vec![0f32; c.rows], vec![0f32; c.rows]);
            let wide: Vec<f64> = c.logits.iter().map(|&x| x as f64).collect();
            prop_assume!(has_finite_rows(&c, &wide));
            k.kl(
                &c.logits,
                &teacher,
                c.vocab,
                c.temp,
                KlDirection::StudentTeacher,
                &mut kl,
            )
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
            // KL(q‖p) needs the student's support to cover the teacher's (the
            // teacher here is finite everywhere): only rows without a −∞ student logit.
            let reverse = k.kl(
                &c.logits,
                &teacher,
                c.vocab,
                c.temp,
                KlDirection::TeacherStudent,
                &mut rev,
            );
            let mut core_rev = vec![0f32; c.rows];
            let core = grpo_core::vocab::kl_rows(
                &c.logits,
                &teacher,
                c.vocab,
                c.temp,
                KlDirection::TeacherStudent,
                &mut core_rev,
            );
            prop_assert_eq!(reverse.clone().err(), core.err().map(GpuError::Core));
            for r in 0..c.rows {
                let a = &wide[r * c.vocab..(r + 1) * c.vocab];
                let b: Vec<f64> = teacher[r * c.vocab..(r + 1) * c.vocab]
                    .iter()
                    .map(|&x| x as f64)
                    .collect();
                let want = kl_reference(a, &b, c.temp as f64);
                prop_assert!(
                    tolerance(Op::Kl, Dtype::F32).accepts(kl[r], want),
                    "kl {} vs {want}",
                    kl[r]
                );
                prop_assert!(kl[r] >= -3e-5, "KL must be ≥ 0 up to rounding: {}", kl[r]);
                if reverse.is_ok() {
                    let want = kl_reference(&b, a, c.temp as f64);
                    prop_assert!(
                        tolerance(Op::Kl, Dtype::F32).accepts(rev[r], want),
                        "KL(q‖p) {} vs {want}",
                        rev[r]
                    );
                }
            }
            Ok(())
        })
        .unwrap();
    eprintln!("kl f32: {} cases", gpu::cases());
}

#[test]
fn backward_matches_f64_reference() {
    let Some(ctx) = gpu::context("backward_matches_f64_reference") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    let strat = (case(), -2.0f32..2.0, -2.0f32..2.0);
    gpu::runner()
        .run(&strat, |(c, g_lp, g_h)| {
            let g_lp = vec![g_lp; c.rows];
            let g_h = vec![g_h; c.rows];
            let mut grad = vec![0f32; c.rows * c.vocab];
            k.backward(
                &c.logits, c.vocab, &c.targets, c.temp, &g_lp, &g_h, &mut grad,
            )
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let t = c.temp as f64;
            for r in 0..c.rows {
                let row: Vec<f64> = c.logits[r * c.vocab..(r + 1) * c.vocab]
                    .iter()
                    .map(|&x| x as f64)
                    .collect();
                let y = c.targets[r] as usize;
                let (lse, _, h, p) = reference(&row, y, t);
                let (a, b) = (g_lp[r] as f64, g_h[r] as f64);
                let min_logp = row
                    .iter()
                    .filter(|z| z.is_finite())
                    .map(|z| z / t - lse)
                    .fold(0.0, f64::min);
                let scale = (a.abs() + b.abs() * (1.0 + h + min_logp.abs())) / t;
                let tol = tolerance(Op::VocabGrad, Dtype::F32);
                let tol = tol.with_abs(tol.abs * scale);
                for v in 0..c.vocab {
                    let lp = row[v] / t - lse;
                    let mut want = -a * p[v] - if p[v] > 0.0 { b * p[v] * (lp + h) } else { 0.0 };
                    if v == y {
                        want += a;
                    }
                    want /= t;
                    let got = grad[r * c.vocab + v];
                    prop_assert!(tol.accepts(got, want), "grad[{r},{v}] {got} vs {want}");
                }
            }
            Ok(())
        })
        .unwrap();
    eprintln!("backward f32: {} cases", gpu::cases());
}

#[test]
fn backward_agrees_with_central_differences() {
    // d/dz of (g·logp + h·H) by central differences of the f64 reference (MATH.md §0).
    let Some(ctx) = gpu::context("backward_agrees_with_central_differences") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    let row = [0.3f32, -1.2, 2.5, 0.0, 1.1, -0.4, 0.9];
    let (g, hw, t, y) = (0.7f64, -1.3f64, 0.8f64, 2usize);
    let mut grad = [0f32; 7];
    k.backward(
        &row,
        7,
        &[y as u32],
        t as f32,
        &[g as f32],
        &[hw as f32],
        &mut grad,
    )
    .unwrap();
    let f = |z: &[f64]| {
        let (_, lp, h, _) = reference(z, y, t);
        g * lp + hw * h
    };
    let base: Vec<f64> = row.iter().map(|&x| x as f64).collect();
    for v in 0..7 {
        let e = 1e-6;
        let mut a = base.clone();
        let mut b = base.clone();
        a[v] += e;
        b[v] -= e;
        let fd = (f(&a) - f(&b)) / (2.0 * e);
        assert!(
            (grad[v] as f64 - fd).abs() < 1e-5,
            "v={v}: {} vs {fd}",
            grad[v]
        );
    }
}

#[test]
fn errors_match_grpo_core_and_leave_outputs_untouched() {
    let Some(ctx) = gpu::context("errors_match_grpo_core_and_leave_outputs_untouched") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    let sentinel = 12345.0f32;
    // NaN at flat index 5 (row 1, column 1) and +∞ at 7: the first one is reported.
    let mut logits = vec![0.5f32; 12];
    logits[5] = f32::NAN;
    logits[7] = f32::INFINITY;
    let mut out = [sentinel; 3];
    assert_eq!(
        k.log_sum_exp(&logits, 4, 1.0, &mut out),
        Err(GpuError::Core(Error::NonFinite {
            what: "logits",
            index: 5
        }))
    );
    assert_eq!(out, [sentinel; 3]);
    // A row of only −∞ (row 2).
    let mut logits = vec![0.5f32; 12];
    logits[8..12].fill(f32::NEG_INFINITY);
    assert_eq!(
        k.entropy(&logits, 4, 1.0, &mut out),
        Err(GpuError::Core(Error::EmptySegment { segment: 2 }))
    );
    assert_eq!(out, [sentinel; 3]);
    // Row 1's maximum overflows to −∞ once divided by T = 1e-10 (every z/T is −∞): grpo-core
    // reports the overflow at the row's first maximum, not an empty row (forward; at T = 1e-6
    // with larger logits for the backward, whose T ≥ 1e-6 check comes first at 1e-10).
    let mut logits = vec![0.5f32; 12];
    logits[4..8].copy_from_slice(&[-2e30, -1e30, -1e30, -3e30]);
    let overflow = Err(GpuError::Core(Error::NonFinite {
        what: "logits / temperature",
        index: 5,
    }));
    let (mut lse, mut h) = ([sentinel; 3], [sentinel; 3]);
    assert_eq!(
        grpo_core::vocab::stats_rows(&logits, 4, 1e-10, &mut lse, &mut h).map_err(GpuError::Core),
        overflow
    );
    assert_eq!(k.entropy(&logits, 4, 1e-10, &mut out), overflow);
    assert_eq!(out, [sentinel; 3]);
    let mut grad = vec![sentinel; 12];
    let terms = GradTerms::<'_, u32> {
        logp: Some((&[0, 0, 0], &[1.0; 3])),
        entropy: Some(&[0.0; 3]),
        kl: None,
    };
    let mut logits6 = logits.clone();
    logits6[4..8].copy_from_slice(&[-2e33, -1e33, -1e33, -3e33]);
    for (z, t) in [(&logits, 1e-10f32), (&logits6, 1e-6)] {
        let mut core_grad = vec![sentinel; 12];
        let want = grpo_core::vocab::backward_rows(z, 4, t, &terms, &mut core_grad);
        let got = k.backward(z, 4, &[0, 0, 0], t, &[1.0; 3], &[0.0; 3], &mut grad);
        assert_eq!(got, want.map_err(GpuError::Core), "T = {t}");
        assert!(got.is_err());
    }
    assert_eq!(
        k.backward(
            &logits6,
            4,
            &[0, 0, 0],
            1e-6,
            &[1.0; 3],
            &[0.0; 3],
            &mut grad
        ),
        overflow
    );
    assert_eq!(grad, vec![sentinel; 12]);
    // Target out of range, length mismatch, bad temperature.
    let logits = vec![0.5f32; 12];
    assert_eq!(
        k.token_logprob(&logits, 4, &[0, 4, 1], 1.0, &mut out),
        Err(GpuError::Core(Error::TokenOutOfRange {
            index: 1,
            token: 4,
            vocab: 4
        }))
    );
    assert_eq!(
        k.log_sum_exp(&logits, 5, 1.0, &mut out),
        Err(GpuError::Core(Error::LengthMismatch {
            what: "logits",
            expected: 15,
            found: 12
        }))
    );
    assert!(matches!(
        k.log_sum_exp(&logits, 4, 0.0, &mut out),
        Err(GpuError::Core(Error::InvalidParam {
            name: "temperature",
            ..
        }))
    ));
    assert_eq!(out, [sentinel; 3]);
    let mut grad = [sentinel; 12];
    assert_eq!(
        k.backward(
            &logits,
            4,
            &[0, 1, 2],
            1.0,
            &[1.0, f32::NAN, 0.0],
            &[0.0; 3],
            &mut grad
        ),
        Err(GpuError::Core(Error::NonFinite {
            what: "g_logp",
            index: 1
        }))
    );
    // grpo-core's other backward checks: |weight| ≤ 1e9, T ≥ 1e-6 for gradients.
    let big = k.backward(
        &logits,
        4,
        &[0, 1, 2],
        1.0,
        &[1.0; 3],
        &[0.0, 0.0, -2e9],
        &mut grad,
    );
    let mut core_grad = [sentinel; 12];
    let terms = GradTerms::<'_, u32> {
        logp: Some((&[0, 1, 2], &[1.0; 3])),
        entropy: Some(&[0.0, 0.0, -2e9]),
        kl: None,
    };
    let want = grpo_core::vocab::backward_rows(&logits, 4, 1.0, &terms, &mut core_grad);
    assert!(
        matches!(
            (&big, &want),
            (
                Err(GpuError::Core(Error::InvalidParam { name: "g_entropy", reason: a })),
                Err(Error::InvalidParam { name: "grad_entropy", reason: b }),
            ) if a == b
        ),
        "{big:?} vs {want:?}"
    );
    let cold = k.backward(
        &logits,
        4,
        &[0, 1, 2],
        1e-7,
        &[1.0; 3],
        &[0.0; 3],
        &mut grad,
    );
    let want = grpo_core::vocab::backward_rows(&logits, 4, 1e-7, &terms, &mut core_grad);
    assert!(
        matches!(
            (&cold, &want),
            (
                Err(GpuError::Core(Error::InvalidParam { name: "temperature", reason: a })),
                Err(Error::InvalidParam { name: "temperature", reason: b }),
            ) if a == b
        ),
        "{cold:?} vs {want:?}"
    );
    assert_eq!(grad, [sentinel; 12]);
    assert_eq!(core_grad, [sentinel; 12]);
}

#[test]
fn hand_computed_values() {
    let Some(ctx) = gpu::context("hand_computed_values") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    // Row [0, ln 3]: lse = ln(1 + 3) = ln 4 = 1.3862944; logp(1) = ln3 − ln4 = ln 0.75
    // = −0.2876821; H = −(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351.
    let row = [0.0f32, 3f32.ln()];
    let (mut lse, mut lp, mut h) = ([0f32], [0f32], [0f32]);
    k.forward(
        &row,
        2,
        &[1],
        1.0,
        ForwardOut {
            lse: Some(&mut lse),
            logp: Some(&mut lp),
            entropy: Some(&mut h),
        },
    )
    .unwrap();
    assert!((lse[0] - 1.3862944).abs() < 2e-6, "{}", lse[0]);
    assert!((lp[0] + 0.2876821).abs() < 2e-6, "{}", lp[0]);
    assert!((h[0] - 0.5623351).abs() < 2e-6, "{}", h[0]);
    // A masked (−∞) entry contributes nothing: [0, ln 3, −∞] gives the same numbers; a −∞
    // target is grpo-core's NonFinite { "logits[target]" }.
    let row = [0.0f32, 3f32.ln(), f32::NEG_INFINITY];
    k.forward(
        &row,
        3,
        &[1],
        1.0,
        ForwardOut {
            lse: Some(&mut lse),
            logp: Some(&mut lp),
            entropy: Some(&mut h),
        },
    )
    .unwrap();
    assert!((lse[0] - 1.3862944).abs() < 2e-6);
    assert!((lp[0] + 0.2876821).abs() < 2e-6, "{}", lp[0]);
    assert_eq!(
        k.token_logprob(&row, 3, &[2], 1.0, &mut lp),
        Err(GpuError::Core(Error::NonFinite {
            what: "logits[target]",
            index: 2
        }))
    );
    // KL(p‖q) with p = (1/4, 3/4), q = (1/2, 1/2): 0.25 ln 0.5 + 0.75 ln 1.5 = 0.1308121.
    let mut kl = [0f32];
    k.kl(
        &[0.0f32, 3f32.ln()],
        &[0.0f32, 0.0],
        2,
        1.0,
        KlDirection::StudentTeacher,
        &mut kl,
    )
    .unwrap();
    assert!((kl[0] - 0.1308121).abs() < 3e-6, "{}", kl[0]);
}

#[test]
fn chunked_rows_give_the_same_bits() {
    // A private context whose binding cap (or workgroup cap) forces chunks of 1–3 rows (bf16 with
    // an odd vocab puts chunk starts mid-word), against the same context uncapped.
    if gpu::context("chunked_rows_give_the_same_bits").is_none() {
        return;
    }
    let ctx = grpo_wgpu::GpuContext::new().unwrap();
    let k = VocabKernel::new(&ctx);
    let (rows, vocab) = (7usize, 301usize);
    let logits: Vec<half::bf16> = (0..rows * vocab)
        .map(|i| half::bf16::from_f32(((i * 37 % 101) as f32) * 0.11 - 5.0))
        .collect();
    let targets: Vec<u32> = (0..rows as u32).map(|r| r * 13 % vocab as u32).collect();
    let run = |k: &VocabKernel<'_>| {
        let (mut lse, mut lp, mut h) = (vec![0f32; rows], vec![0f32; rows], vec![0f32; rows]);
        k.forward(
            &logits,
            vocab,
            &targets,
            0.9,
            ForwardOut {
                lse: Some(&mut lse),
                logp: Some(&mut lp),
                entropy: Some(&mut h),
            },
        )
        .unwrap();
        let mut grad = vec![0f32; rows * vocab];
        k.backward(
            &logits,
            vocab,
            &targets,
            0.9,
            &vec![1.0; rows],
            &vec![0.5; rows],
            &mut grad,
        )
        .unwrap();
        (lse, lp, h, grad)
    };
    let whole = run(&k);
    let whole_fwd = whole.clone();
    // The backward's gradient row is 4·301 + 4 bytes: a cap of 2500 holds 2 rows.
    ctx.set_binding_cap(2500);
    let chunked = run(&k);
    ctx.set_binding_cap(u64::MAX);
    assert_eq!(whole, chunked);
    // JSD reads a teacher row too. Its rows are 301·2 + 4 bytes per binding: a cap of 2000 holds
    // 3 rows, so chunks start at rows 3 and 6, i.e. at odd (mid-word) elements 903 and 1806.
    let teacher: Vec<half::bf16> = logits.iter().rev().copied().collect();
    let jsd = |k: &VocabKernel<'_>| {
        let mut out = vec![0f32; rows];
        k.jsd(&logits, &teacher, vocab, 0.3, 0.9, &mut out).unwrap();
        out
    };
    let whole = jsd(&k);
    ctx.set_binding_cap(2000);
    let chunked = jsd(&k);
    ctx.set_binding_cap(u64::MAX);
    assert_eq!(whole, chunked);
    // At most 3 workgroups (rows) per dispatch: chunks of 3, 3 and 1 rows, the same bits; the
    // benchmark hook, which runs every row in one dispatch, says how many workgroups it needed.
    ctx.set_max_workgroups_per_dimension(3);
    assert_eq!(run(&k), whole_fwd);
    assert_eq!(
        k.resident(&logits, vocab, ResidentVocab::Forward).err(),
        Some(GpuError::TooManyWorkgroups {
            needed: 7,
            limit: 3,
            per_dimension: 3
        })
    );
    assert_eq!(
        k.resident(&logits, vocab, ResidentVocab::Kl { teacher: &teacher })
            .err(),
        Some(GpuError::TooManyWorkgroups {
            needed: 7,
            limit: 3,
            per_dimension: 3
        })
    );
    ctx.set_max_workgroups_per_dimension(u32::MAX);
    // The KL hook validates its teacher as `kl` does.
    let short = &teacher[1..];
    let mut out = vec![0f32; rows];
    let kl_err = k.kl(
        &logits,
        short,
        vocab,
        1.0,
        KlDirection::StudentTeacher,
        &mut out,
    );
    assert!(kl_err.is_err());
    assert_eq!(
        k.resident(&logits, vocab, ResidentVocab::Kl { teacher: short })
            .err(),
        kl_err.err()
    );
    // A row larger than the cap (301·2 + 4 bytes > 500) is TooLarge, not a wrong answer.
    ctx.set_binding_cap(500);
    let mut lse = vec![0f32; rows];
    assert!(matches!(
        k.log_sum_exp(&logits, vocab, 1.0, &mut lse),
        Err(GpuError::TooLarge { .. })
    ));
}

#[test]
fn errors_are_grpo_cores_for_the_same_rows() {
    let Some(ctx) = gpu::context("errors_are_grpo_cores_for_the_same_rows") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    let ninf = f32::NEG_INFINITY;
    // (logits, vocab, targets, temperature): NaN, all −∞, overflow of z/T, −∞ target, bad T,
    // bad target, bad length; several errors in one batch (the first row's wins).
    let cases: Vec<(Vec<f32>, usize, Vec<u32>, f32)> = vec![
        (vec![0.0, 1.0, 2.0, f32::NAN, 0.0, 1.0], 3, vec![0, 0], 1.0),
        (vec![0.0, 1.0, 2.0, ninf, ninf, ninf], 3, vec![0, 0], 1.0),
        (vec![0.0, 3e38, 3e38, 1.0, 1.0, 1.0], 3, vec![0, 0], 0.5),
        (vec![0.0, 1.0, ninf, 1.0, 1.0, 1.0], 3, vec![2, 0], 1.0),
        (
            vec![0.0, 1.0, 2.0, f32::INFINITY, 1.0, ninf],
            3,
            vec![0, 2],
            1.0,
        ),
        (vec![0.0; 6], 3, vec![0, 0], 1e-39),
        (vec![0.0; 6], 3, vec![0, 3], 1.0),
        (vec![0.0; 5], 3, vec![0, 0], 1.0),
        (vec![0.0; 6], 0, vec![0, 0], 1.0),
    ];
    for (z, v, t, temp) in cases {
        let (mut lp, mut h) = ([7f32; 2], [7f32; 2]);
        let want = grpo_core::vocab::logprob_entropy_rows(&z, v, &t, temp, &mut lp, Some(&mut h))
            .unwrap_err();
        let (mut lp, mut h) = ([7f32; 2], [7f32; 2]);
        let got = k.forward(
            &z,
            v,
            &t,
            temp,
            ForwardOut {
                logp: Some(&mut lp),
                entropy: Some(&mut h),
                lse: None,
            },
        );
        assert_eq!(got, Err(GpuError::Core(want)), "{z:?} V={v} {t:?} T={temp}");
        assert_eq!((lp, h), ([7f32; 2], [7f32; 2]));
    }
}

// ---------------------------------------------------------------------------------------------
// JSD_β: grpo-wgpu against grpo-core's `jsd_rows` (same stored values, same errors), within the
// `Jsd` entry of the tolerance table; an f64 evaluation is reported alongside.

/// f64 JSD_β of one row pair: Σ β q ln(q/m) + (1 − β) p ln(p/m), m = β q + (1 − β) p.
fn jsd_reference(a: &[f64], b: &[f64], beta: f64, t: f64) -> f64 {
    let (_, _, _, p) = reference(a, 0, t);
    let (_, _, _, q) = reference(b, 0, t);
    p.iter()
        .zip(&q)
        .map(|(&p, &q)| {
            let m = beta * q + (1.0 - beta) * p;
            let tq = if q > 0.0 {
                beta * q * (q / m).ln()
            } else {
                0.0
            };
            let tp = if p > 0.0 {
                (1.0 - beta) * p * (p / m).ln()
            } else {
                0.0
            };
            tq + tp
        })
        .sum()
}

/// The largest JSD_β: −β ln β − (1 − β) ln(1 − β) (disjoint supports).
fn jsd_bound(beta: f64) -> f64 {
    -beta * beta.ln() - (1.0 - beta) * (1.0 - beta).ln()
}

#[derive(Debug, Clone)]
struct JsdCase {
    vocab: usize,
    rows: usize,
    student: Vec<f32>,
    teacher: Vec<f32>,
    beta: f32,
    temp: f32,
}

/// Lengths 1..=65, around multiples of 16 and of the 256-lane workgroup, and rows longer than
/// one workgroup's stride (several columns per invocation).
fn jsd_vocab_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 1usize..=65,
        2 => prop::sample::select(vec![
            15usize, 16, 17, 31, 32, 33, 255, 256, 257, 511, 512, 513, 767, 768, 769
        ]),
        1 => 1000usize..5000,
    ]
}

/// β: the symmetric ½, values near both ends of (0, 1) (0 and 1 themselves are errors, tested
/// below), and random.
fn jsd_beta() -> impl Strategy<Value = f32> {
    prop_oneof![
        2 => Just(0.5f32),
        1 => Just(1e-6f32),
        1 => Just(1.0f32 - f32::EPSILON / 2.0),
        4 => 0.001f32..0.999,
    ]
}

fn jsd_case() -> impl Strategy<Value = JsdCase> {
    (
        jsd_vocab_len(),
        1usize..4,
        prop::sample::select(vec![1.0f32, 0.7, 2.0]),
        jsd_beta(),
        // Teacher: 0 independent, 1 the student itself, 2 the student plus small noise.
        0u8..3,
    )
        .prop_flat_map(|(vocab, rows, temp, beta, mode)| {
            let n = vocab * rows;
            (
                prop::collection::vec(logit(), n),
                prop::collection::vec(logit(), n),
                prop::collection::vec(-0.05f32..0.05, n),
                Just((vocab, rows, temp, beta, mode)),
            )
        })
        .prop_map(|(student, other, noise, (vocab, rows, temp, beta, mode))| {
            let mut teacher: Vec<f32> = match mode {
                0 => other,
                1 => student.clone(),
                _ => student.iter().zip(&noise).map(|(&z, &e)| z + e).collect(),
            };
            let mut student = student;
            // Every row keeps a finite logit on both sides (all −∞ is an error, tested below).
            for r in 0..rows {
                for x in [&mut student, &mut teacher] {
                    let row = &mut x[r * vocab..(r + 1) * vocab];
                    if !row.iter().any(|z| z.is_finite()) {
                        row[r % vocab] = 0.5;
                    }
                }
            }
            JsdCase {
                vocab,
                rows,
                student,
                teacher,
                beta,
                temp,
            }
        })
}

/// Largest distances seen: |gpu − core|, |gpu − core|/core (where core ≥ 1e-3), |gpu − f64|.
#[derive(Debug, Default)]
struct JsdErr {
    abs: f64,
    rel: f64,
    f64_abs: f64,
}

fn check_jsd<L: LogitStorage + grpo_core::vocab::Logit>(
    k: &VocabKernel<'_>,
    c: &JsdCase,
    dtype: Dtype,
    f: fn(f32) -> L,
    back: fn(L) -> f32,
    err: &std::cell::RefCell<JsdErr>,
) -> Result<(), TestCaseError> {
    let s: Vec<L> = c.student.iter().map(|&x| f(x)).collect();
    let t: Vec<L> = c.teacher.iter().map(|&x| f(x)).collect();
    let mut want = vec![7f32; c.rows];
    let core = grpo_core::vocab::jsd_rows(&s, &t, c.vocab, c.beta, c.temp, &mut want);
    let mut got = vec![7f32; c.rows];
    let gpu = k.jsd(&s, &t, c.vocab, c.beta, c.temp, &mut got);
    if let Err(e) = core {
        // f16/bf16 rounding can empty a row (a tiny value that widens to… never −∞), or
        // overflow nothing: still, whatever grpo-core says, the GPU must say the same.
        prop_assert_eq!(gpu, Err(GpuError::Core(e)));
        prop_assert!(got.iter().all(|&x| x == 7.0));
        return Ok(());
    }
    gpu.map_err(|e| TestCaseError::fail(e.to_string()))?;
    let tol = tolerance(Op::Jsd, dtype);
    let (beta, temp) = (c.beta as f64, c.temp as f64);
    let mut e = err.borrow_mut();
    for r in 0..c.rows {
        let row = |x: &[L]| -> Vec<f64> {
            x[r * c.vocab..(r + 1) * c.vocab]
                .iter()
                .map(|&z| back(z) as f64)
                .collect()
        };
        let exact = jsd_reference(&row(&s), &row(&t), beta, temp);
        let (g, w) = (got[r] as f64, want[r] as f64);
        e.abs = e.abs.max((g - w).abs());
        if w >= 1e-3 {
            e.rel = e.rel.max((g - w).abs() / w);
        }
        e.f64_abs = e.f64_abs.max((g - exact).abs());
        prop_assert!(
            tol.accepts(got[r], w),
            "row {r}: gpu {} vs grpo-core {} (f64 {exact}); {c:?}",
            got[r],
            want[r]
        );
        prop_assert!(
            got[r] >= 0.0 && g <= jsd_bound(beta) + tol.abs + tol.rel * jsd_bound(beta),
            "row {r}: JSD {} outside [0, {}]",
            got[r],
            jsd_bound(beta)
        );
    }
    Ok(())
}

fn run_jsd<L: LogitStorage + grpo_core::vocab::Logit>(
    test: &str,
    dtype: Dtype,
    f: fn(f32) -> L,
    back: fn(L) -> f32,
) {
    let Some(ctx) = gpu::context(test) else {
        return;
    };
    let k = VocabKernel::new(ctx);
    if dtype == Dtype::F16 && !ctx.supports_f16() {
        let h = [half::f16::ZERO];
        let r = k.jsd(&h, &h, 1, 0.5, 1.0, &mut [0.0]);
        assert_eq!(
            r,
            Err(GpuError::MissingFeature {
                feature: "SHADER_F16"
            })
        );
        eprintln!("{test}: adapter lacks SHADER_F16; checked the error instead");
        return;
    }
    let err = std::cell::RefCell::new(JsdErr::default());
    gpu::runner()
        .run(&jsd_case(), |c| check_jsd(&k, &c, dtype, f, back, &err))
        .unwrap();
    let e = err.into_inner();
    eprintln!(
        "{test}: {} cases; max |gpu − grpo-core| = {:.3e} (relative, JSD ≥ 1e-3: {:.3e}), \
         max |gpu − f64| = {:.3e}",
        gpu::cases(),
        e.abs,
        e.rel,
        e.f64_abs
    );
}

#[test]
fn jsd_f32_matches_grpo_core() {
    run_jsd("jsd_f32_matches_grpo_core", Dtype::F32, |x| x, |x| x);
}

#[test]
fn jsd_bf16_matches_grpo_core() {
    run_jsd(
        "jsd_bf16_matches_grpo_core",
        Dtype::Bf16,
        half::bf16::from_f32,
        half::bf16::to_f32,
    );
}

#[test]
fn jsd_f16_matches_grpo_core() {
    run_jsd(
        "jsd_f16_matches_grpo_core",
        Dtype::F16,
        half::f16::from_f32,
        half::f16::to_f32,
    );
}

// The JSD's gradient: grpo-wgpu against grpo-core's `jsd_backward_rows` (same stored values,
// same errors), within the `JsdGrad` entry of the tolerance table.

/// Largest |gpu − core| as a share of its allowance, and how many elements were compared.
#[derive(Debug, Default)]
struct JsdGradErr {
    share: f64,
    elems: usize,
}

/// The `JsdGrad` allowance of each element of one row pair's gradient (f64 reference on the
/// stored values): with `c = |g|(1 − β)/T`, `K = KL(p‖m)`, `m = β q + (1 − β) p` and the
/// gradient `c·p_v·((log p_v − log m_v) − K)`,
/// - `abs·c·p_v·(1 + K + |log p_v − log m_v|) + rel·|want_v|`: the error of each factor (see the
///   table);
/// - `c·p_v·(1 + |log p_v − log m_v − K|)·δ_v` with `δ_v = 2^−22·(|z_v| + |z_max| + |w_v| +
///   |w_max|)/T`: the GPU divides each logit by T before it subtracts the row maximum (grpo-core
///   after), so its log p_v and log q_v carry an absolute error of about one ULP of the scaled
///   logits — large for logits far from 0 — which moves p_v and the log-ratio;
/// - `(1 + 256·|g|/T)·2^−126`: WGSL may flush a subnormal result or probability to 0, and
///   grpo-core flushes probabilities below about `2^−126` that the GPU keeps (its log mixture is
///   relative to `max(log p, log q)`). A column changed that way has `p_v` and `q_v` near
///   `2^−126`, so its gradient is below `|g|/T·2^−126` times its log-ratios (≤ 256 in
///   magnitude) in either.
fn jsd_grad_allowed(
    dtype: Dtype,
    (a, b): (&[f64], &[f64]),
    (beta, temp, g): (f64, f64, f64),
    want: &[f32],
) -> Vec<f64> {
    let tol = tolerance(Op::JsdGrad, dtype);
    let (_, _, _, p) = reference(a, 0, temp);
    let (_, _, _, q) = reference(b, 0, temp);
    let lr: Vec<f64> = p
        .iter()
        .zip(&q)
        .map(|(&p, &q)| {
            if p > 0.0 {
                (p / (beta * q + (1.0 - beta) * p)).ln()
            } else {
                0.0
            }
        })
        .collect();
    let k: f64 = p.iter().zip(&lr).map(|(p, l)| p * l).sum();
    let c = g.abs() * (1.0 - beta) / temp;
    let top = |x: &[f64]| {
        x.iter().fold(
            0.0f64,
            |m, &z| if z.is_finite() { m.max(z.abs()) } else { m },
        )
    };
    let (za, wa) = (top(a), top(b));
    let fin = |x: f64| if x.is_finite() { x.abs() } else { 0.0 };
    (0..p.len())
        .map(|v| {
            let delta = (fin(a[v]) + za + fin(b[v]) + wa) / temp / (1u64 << 22) as f64;
            let factors = tol.abs * (1.0 + k + lr[v].abs());
            let scaling = delta * (1.0 + (lr[v] - k).abs());
            let flushed = (1.0 + 256.0 * g.abs() / temp) * f32::MIN_POSITIVE as f64;
            c * p[v] * (factors + scaling) + tol.rel * (want[v] as f64).abs() + flushed
        })
        .collect()
}

/// The rows' weights of [`check_jsd_grad`]: signs and magnitudes that differ per row.
const JSD_WEIGHTS: [f32; 3] = [1.0, -0.5, 3.0];

fn check_jsd_grad<L: LogitStorage + grpo_core::vocab::Logit>(
    k: &VocabKernel<'_>,
    c: &JsdCase,
    dtype: Dtype,
    f: fn(f32) -> L,
    err: &std::cell::RefCell<JsdGradErr>,
) -> Result<(), TestCaseError> {
    let s: Vec<L> = c.student.iter().map(|&x| f(x)).collect();
    let t: Vec<L> = c.teacher.iter().map(|&x| f(x)).collect();
    let g = &JSD_WEIGHTS[..c.rows];
    let n = c.rows * c.vocab;
    let mut want = vec![7f32; n];
    let core = grpo_core::vocab::jsd_backward_rows(&s, &t, c.vocab, c.beta, c.temp, g, &mut want);
    let mut got = vec![7f32; n];
    let gpu = k.jsd_backward(&s, &t, c.vocab, c.beta, c.temp, g, &mut got);
    // In place: the same result, the gradient rounded to the storage type over the logits.
    let mut over = s.clone();
    let gpu_over = k.jsd_backward_in_place(&mut over, &t, c.vocab, c.beta, c.temp, g);
    prop_assert_eq!(&gpu_over, &gpu);
    let bits = |x: &[L]| x.iter().map(|v| v.to_f32().to_bits()).collect::<Vec<_>>();
    if let Err(e) = core {
        prop_assert_eq!(gpu, Err(GpuError::Core(e)));
        prop_assert!(got.iter().all(|&x| x == 7.0));
        prop_assert_eq!(bits(&over), bits(&s));
        // The saving forward's error is the JSD's, nothing written; the gradient from its
        // (`EMPTY`) states is grpo-core's error too, `grad` and the logits untouched.
        let (mut js, mut st) = (vec![7f32; c.rows], vec![JsdState::EMPTY; c.rows]);
        let fwd = k.jsd_saved(&s, &t, c.vocab, c.beta, c.temp, &mut js, &mut st);
        let mut j0 = vec![7f32; c.rows];
        let fwd0 = grpo_core::vocab::jsd_rows(&s, &t, c.vocab, c.beta, c.temp, &mut j0);
        prop_assert_eq!(fwd, fwd0.map_err(GpuError::Core));
        if fwd0.is_err() {
            prop_assert!(js.iter().all(|&x| x == 7.0) && st.iter().all(|x| *x == JsdState::EMPTY));
        }
        let mut gs = vec![7f32; n];
        let want_err =
            grpo_core::vocab::jsd_backward_rows_saved(&s, &t, c.vocab, c.temp, &st, g, &mut gs);
        let mut gs = vec![7f32; n];
        let got_err = k.jsd_backward_saved(&s, &t, c.vocab, c.temp, &st, g, &mut gs);
        prop_assert_eq!(got_err, want_err.map_err(GpuError::Core));
        if want_err.is_err() {
            prop_assert!(gs.iter().all(|&x| x == 7.0));
            let mut over = s.clone();
            let r = k.jsd_backward_saved_in_place(&mut over, &t, c.vocab, c.temp, &st, g);
            prop_assert_eq!(r, want_err.map_err(GpuError::Core));
            prop_assert_eq!(bits(&over), bits(&s));
        }
        return Ok(());
    }
    gpu.map_err(|e| TestCaseError::fail(e.to_string()))?;
    let rounded: Vec<L> = got.iter().map(|&x| L::from_f32(x)).collect();
    prop_assert_eq!(bits(&over), bits(&rounded));
    // The gradient from saved states: the GPU's own (whose JSD is `jsd`'s, bit for bit, and
    // whose states are grpo-core's within the row statistics' tolerance) and grpo-core's, each
    // within the same allowance of grpo-core's recomputing gradient; in place, rounded.
    let (mut js, mut st) = (vec![7f32; c.rows], vec![JsdState::EMPTY; c.rows]);
    k.jsd_saved(&s, &t, c.vocab, c.beta, c.temp, &mut js, &mut st)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut j = vec![7f32; c.rows];
    k.jsd(&s, &t, c.vocab, c.beta, c.temp, &mut j)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(f32_bits(&js), f32_bits(&j));
    let (mut j0, mut st0) = (vec![7f32; c.rows], vec![JsdState::EMPTY; c.rows]);
    grpo_core::vocab::jsd_rows_saved(&s, &t, c.vocab, c.beta, c.temp, &mut j0, &mut st0)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let (lse, jsd_tol) = (tolerance(Op::Lse, dtype), tolerance(Op::Jsd, dtype));
    // The states' references may differ (grpo-core's may lie below the row maximum), the
    // log-sum-exps they imply may not: lse = r·τ − (−ln s).
    let tau = 1.0 / c.temp as f64;
    let lse_of = |l: &grpo_core::vocab::canon::LogSoftmax| l.max as f64 * tau - l.neg_ln_sum as f64;
    for (a, b) in st.iter().zip(&st0) {
        prop_assert_eq!(a.beta, b.beta);
        for (x, y) in [(&a.student, &b.student), (&a.teacher, &b.teacher)] {
            let (got, want) = (lse_of(x), lse_of(y));
            prop_assert!(lse.accepts(got as f32, want), "{a:?} {b:?}");
        }
        // K sums p_v·(log p_v − log m_v), log-ratios up to −ln(1 − β) (16.6 for β = 1 − 2⁻²⁴)
        // in size: the JSD's absolute allowance times 1 + K.
        let k_err = (a.kl_pm as f64 - b.kl_pm as f64).abs();
        prop_assert!(
            k_err <= jsd_tol.abs * (1.0 + b.kl_pm.abs() as f64),
            "{a:?} {b:?}"
        );
    }
    let mut from_gpu = vec![7f32; n];
    k.jsd_backward_saved(&s, &t, c.vocab, c.temp, &st, g, &mut from_gpu)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut from_core = vec![7f32; n];
    k.jsd_backward_saved(&s, &t, c.vocab, c.temp, &st0, g, &mut from_core)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut over = s.clone();
    k.jsd_backward_saved_in_place(&mut over, &t, c.vocab, c.temp, &st, g)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let rounded: Vec<L> = from_gpu.iter().map(|&x| L::from_f32(x)).collect();
    prop_assert_eq!(bits(&over), bits(&rounded));
    let mut e = err.borrow_mut();
    for r in 0..c.rows {
        let span = r * c.vocab..(r + 1) * c.vocab;
        let row =
            |x: &[L]| -> Vec<f64> { x[span.clone()].iter().map(|&z| z.to_f32() as f64).collect() };
        let (beta, temp, gr) = (c.beta as f64, c.temp as f64, g[r] as f64);
        let allowed = jsd_grad_allowed(
            dtype,
            (&row(&s), &row(&t)),
            (beta, temp, gr),
            &want[span.clone()],
        );
        for v in 0..c.vocab {
            let i = r * c.vocab + v;
            for (what, got) in [
                ("recomputing", &got),
                ("from its states", &from_gpu),
                ("from grpo-core's states", &from_core),
            ] {
                let d = (got[i] as f64 - want[i] as f64).abs();
                e.share = e.share.max(d / allowed[v].max(f64::MIN_POSITIVE));
                e.elems += 1;
                prop_assert!(
                    d <= allowed[v],
                    "{what}: row {r} v {v}: gpu {} vs grpo-core {} (allowed {:e}); {c:?}",
                    got[i],
                    want[i],
                    allowed[v]
                );
            }
        }
    }
    Ok(())
}

fn run_jsd_grad<L: LogitStorage + grpo_core::vocab::Logit>(
    test: &str,
    dtype: Dtype,
    f: fn(f32) -> L,
) {
    let Some(ctx) = gpu::context(test) else {
        return;
    };
    let k = VocabKernel::new(ctx);
    if dtype == Dtype::F16 && !ctx.supports_f16() {
        let h = [half::f16::ZERO];
        let r = k.jsd_backward(&h, &h, 1, 0.5, 1.0, &[1.0], &mut [0.0]);
        assert_eq!(
            r,
            Err(GpuError::MissingFeature {
                feature: "SHADER_F16"
            })
        );
        eprintln!("{test}: adapter lacks SHADER_F16; checked the error instead");
        return;
    }
    let err = std::cell::RefCell::new(JsdGradErr::default());
    gpu::runner()
        .run(&jsd_case(), |c| check_jsd_grad(&k, &c, dtype, f, &err))
        .unwrap();
    let e = err.into_inner();
    eprintln!(
        "{test}: {} cases, {} gradient elements; max |gpu − grpo-core| / tolerance = {:.3}",
        gpu::cases(),
        e.elems,
        e.share
    );
}

#[test]
fn jsd_gradient_f32_matches_grpo_core() {
    run_jsd_grad("jsd_gradient_f32_matches_grpo_core", Dtype::F32, |x| x);
}

#[test]
fn jsd_gradient_bf16_matches_grpo_core() {
    run_jsd_grad(
        "jsd_gradient_bf16_matches_grpo_core",
        Dtype::Bf16,
        half::bf16::from_f32,
    );
}

#[test]
fn jsd_gradient_f16_matches_grpo_core() {
    run_jsd_grad(
        "jsd_gradient_f16_matches_grpo_core",
        Dtype::F16,
        half::f16::from_f32,
    );
}

/// Each invalid input of the JSD's gradient: grpo-core's error, in its order, and `grad`
/// untouched; then a long row pair (several columns per invocation, a masked entry on each
/// side) within the tolerance.
#[test]
fn jsd_gradient_errors_and_long_rows_match_grpo_core() {
    let Some(ctx) = gpu::context("jsd_gradient_errors_and_long_rows_match_grpo_core") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    let v = 5usize;
    let z: Vec<f32> = (0..2 * v).map(|i| (i as f32 * 0.7).sin() * 3.0).collect();
    let w: Vec<f32> = (0..2 * v).map(|i| (i as f32 * 1.3).cos() * 2.0).collect();
    let set = |x: &[f32], i: usize, val: f32| {
        let mut x = x.to_vec();
        x[i] = val;
        x
    };
    let ninf = f32::NEG_INFINITY;
    let mut masked = w.clone();
    masked[v..].fill(ninf);
    // (label, student, teacher, β, T, weights, out length)
    type Bad = (&'static str, Vec<f32>, Vec<f32>, f32, f32, Vec<f32>, usize);
    let cases: Vec<Bad> = vec![
        (
            "T below 1e-6",
            z.clone(),
            w.clone(),
            0.5,
            1e-7,
            vec![1.0; 2],
            2 * v,
        ),
        ("β = 0", z.clone(), w.clone(), 0.0, 1.0, vec![1.0; 2], 2 * v),
        (
            "β = 1 before lengths",
            z.clone(),
            w.clone(),
            1.0,
            1.0,
            vec![1.0; 3],
            9,
        ),
        (
            "short teacher",
            z.clone(),
            w[1..].to_vec(),
            0.5,
            1.0,
            vec![1.0; 2],
            2 * v,
        ),
        (
            "long out",
            z.clone(),
            w.clone(),
            0.5,
            1.0,
            vec![1.0; 2],
            2 * v + 1,
        ),
        (
            "three weights",
            z.clone(),
            w.clone(),
            0.5,
            1.0,
            vec![1.0; 3],
            2 * v,
        ),
        (
            "NaN weight",
            z.clone(),
            w.clone(),
            0.5,
            1.0,
            vec![1.0, f32::NAN],
            2 * v,
        ),
        (
            "huge weight",
            z.clone(),
            w.clone(),
            0.5,
            1.0,
            vec![2e9, 1.0],
            2 * v,
        ),
        (
            "NaN student",
            set(&z, v + 2, f32::NAN),
            w.clone(),
            0.5,
            1.0,
            vec![1.0; 2],
            2 * v,
        ),
        (
            "+inf teacher",
            z.clone(),
            set(&w, 3, f32::INFINITY),
            0.5,
            1.0,
            vec![1.0; 2],
            2 * v,
        ),
        (
            "masked teacher row",
            z.clone(),
            masked,
            0.5,
            1.0,
            vec![1.0; 2],
            2 * v,
        ),
    ];
    for (label, s, t, beta, temp, g, n) in cases {
        let mut want = vec![7f32; n];
        let core = grpo_core::vocab::jsd_backward_rows(&s, &t, v, beta, temp, &g, &mut want);
        let e = core.expect_err(label);
        let mut got = vec![7f32; n];
        let gpu = k.jsd_backward(&s, &t, v, beta, temp, &g, &mut got);
        assert_eq!(gpu, Err(GpuError::Core(e)), "{label}");
        assert!(got.iter().all(|&x| x == 7.0), "{label}: grad written");
        // In place (no `out` length to get wrong): grpo-core's in-place error, logits untouched.
        let (mut over, mut over_core) = (s.clone(), s.clone());
        let core =
            grpo_core::vocab::jsd_backward_rows_in_place(&mut over_core, &t, v, beta, temp, &g);
        let gpu = k.jsd_backward_in_place(&mut over, &t, v, beta, temp, &g);
        match core {
            Err(e) => assert_eq!(gpu, Err(GpuError::Core(e)), "{label}: in place"),
            Ok(()) => assert!(n != s.len(), "{label}: only a wrong `out` passes in place"),
        }
        if gpu.is_err() {
            let same = over.iter().zip(&s).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{label}: in place wrote");
        }
    }
    // Long rows: 151936 columns against an unrelated teacher (K = KL(p‖m) well above 0), a
    // masked entry on each side.
    let vocab = 151_936usize;
    let mut s: Vec<f32> = (0..vocab)
        .map(|i| ((i * 7919) % 1000) as f32 / 100.0 - 5.0)
        .collect();
    let mut t: Vec<f32> = (0..vocab)
        .map(|i| ((i * 104_729) % 997) as f32 / 80.0 - 6.0)
        .collect();
    s[17] = ninf;
    t[18] = ninf;
    let (mut want, mut got) = (vec![0f32; vocab], vec![0f32; vocab]);
    grpo_core::vocab::jsd_backward_rows(&s, &t, vocab, 0.3, 0.9, &[2.0], &mut want).unwrap();
    k.jsd_backward(&s, &t, vocab, 0.3, 0.9, &[2.0], &mut got)
        .unwrap();
    // And from the states the GPU's saving forward saved.
    let (mut j, mut st) = ([0f32], [JsdState::EMPTY]);
    k.jsd_saved(&s, &t, vocab, 0.3, 0.9, &mut j, &mut st)
        .unwrap();
    let mut from_states = vec![0f32; vocab];
    k.jsd_backward_saved(&s, &t, vocab, 0.9, &st, &[2.0], &mut from_states)
        .unwrap();
    let wide = |x: &[f32]| x.iter().map(|&z| z as f64).collect::<Vec<_>>();
    let allowed = jsd_grad_allowed(Dtype::F32, (&wide(&s), &wide(&t)), (0.3, 0.9, 2.0), &want);
    assert_eq!((got[17], from_states[17]), (0.0, 0.0));
    let mut share = 0.0f64;
    for i in 0..vocab {
        for got in [&got, &from_states] {
            let d = (got[i] as f64 - want[i] as f64).abs();
            share = share.max(d / allowed[i].max(f64::MIN_POSITIVE));
            assert!(
                d <= allowed[i],
                "v {i}: gpu {} vs grpo-core {}",
                got[i],
                want[i]
            );
        }
    }
    eprintln!("JSD gradient at V = {vocab}: max |gpu − grpo-core| / tolerance = {share:.3}");
}

#[test]
fn jsd_and_kl_long_rows_match_grpo_core() {
    // Rows of Qwen's 151936 columns (≈ 594 per invocation) and of MATH.md §5's largest 262144:
    // a row against a slightly perturbed copy (small JSD and KL), and a trained-model-like row
    // with a peak against an unrelated row; KL in both directions.
    let Some(ctx) = gpu::context("jsd_and_kl_long_rows_match_grpo_core") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    for vocab in [151_936usize, 262_144] {
        jsd_long_rows(&k, vocab);
    }
}

fn jsd_long_rows(k: &VocabKernel<'_>, vocab: usize) {
    let mut state = 0x2545f4914f6cdd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 16.0 - 8.0
    };
    let mut student: Vec<f32> = (0..2 * vocab).map(|_| next()).collect();
    student[vocab + 17] = 25.0;
    student[vocab + 5] = f32::NEG_INFINITY;
    let mut teacher: Vec<f32> = student[..vocab]
        .iter()
        .map(|&z| z + 0.01 * next())
        .collect();
    teacher.extend((0..vocab).map(|_| next()));
    for &(beta, temp) in &[(0.5f32, 1.0f32), (0.1, 0.7), (0.9, 1.0)] {
        let mut want = [0f32; 2];
        grpo_core::vocab::jsd_rows(&student, &teacher, vocab, beta, temp, &mut want).unwrap();
        let mut got = [0f32; 2];
        k.jsd(&student, &teacher, vocab, beta, temp, &mut got)
            .unwrap();
        let mut exact = [0f64; 2];
        for r in 0..2 {
            let row = |x: &[f32]| -> Vec<f64> {
                x[r * vocab..(r + 1) * vocab]
                    .iter()
                    .map(|&z| z as f64)
                    .collect()
            };
            exact[r] = jsd_reference(&row(&student), &row(&teacher), beta as f64, temp as f64);
            assert!(
                tolerance(Op::Jsd, Dtype::F32).accepts(got[r], want[r] as f64),
                "β={beta} T={temp} row {r}: gpu {} vs grpo-core {}",
                got[r],
                want[r]
            );
        }
        eprintln!(
            "jsd V={vocab} β={beta} T={temp}: gpu {got:?}, grpo-core {want:?}, f64 {exact:?}"
        );
    }
    for temp in [1.0f32, 0.7] {
        for dir in [KlDirection::StudentTeacher, KlDirection::TeacherStudent] {
            // Row 1's student is −∞ at column 5 and its teacher is not: KL(q‖p) is +∞ there, an
            // error; KL(q‖p) is compared on row 0 alone.
            let rows = if dir == KlDirection::StudentTeacher {
                2
            } else {
                1
            };
            let (s, t) = (&student[..rows * vocab], &teacher[..rows * vocab]);
            let mut want = [0f32; 2];
            grpo_core::vocab::kl_rows(s, t, vocab, temp, dir, &mut want[..rows]).unwrap();
            let mut got = [0f32; 2];
            k.kl(s, t, vocab, temp, dir, &mut got[..rows]).unwrap();
            let mut all = [7f32; 2];
            assert_eq!(
                k.kl(&student, &teacher, vocab, temp, dir, &mut all)
                    .is_err(),
                dir == KlDirection::TeacherStudent
            );
            for r in 0..rows {
                assert!(
                    tolerance(Op::Kl, Dtype::F32).accepts(got[r], want[r] as f64),
                    "kl {dir:?} T={temp} row {r}: gpu {} vs grpo-core {}",
                    got[r],
                    want[r]
                );
            }
            let row = |x: &[f32]| -> Vec<f64> { x[..vocab].iter().map(|&z| z as f64).collect() };
            let (a, b) = (row(&student), row(&teacher));
            let exact = match dir {
                KlDirection::StudentTeacher => kl_reference(&a, &b, temp as f64),
                KlDirection::TeacherStudent => kl_reference(&b, &a, temp as f64),
            };
            eprintln!(
                "kl V={vocab} T={temp} {dir:?}: gpu {got:?}, grpo-core {want:?}, f64 (row 0) {exact}"
            );
        }
    }
}

#[test]
fn jsd_hand_computed_values() {
    let Some(ctx) = gpu::context("jsd_hand_computed_values") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    let ninf = f32::NEG_INFINITY;
    // p = [½, ½], q = [¼, ¾], m = [3/8, 5/8]: JSD_½ = ½ (KL(q‖m) + KL(p‖m)) = 0.0338221;
    // JSD_¼ (m = [7/16, 9/16]) = 0.0248700. Disjoint supports: JSD_½ = ln 2.
    let z = [0.0f32, 0.0, 0.0, ninf];
    let w = [0.0f32, 3f32.ln(), ninf, 0.0];
    let mut out = [0f32; 2];
    k.jsd(&z, &w, 2, 0.5, 1.0, &mut out).unwrap();
    assert!((out[0] - 0.0338221).abs() < 2e-6, "{}", out[0]);
    assert!((out[1] - 2f32.ln()).abs() < 2e-6, "{}", out[1]);
    k.jsd(&z[..2], &w[..2], 2, 0.25, 1.0, &mut out[..1])
        .unwrap();
    assert!((out[0] - 0.0248700).abs() < 2e-6, "{}", out[0]);
    // Identical rows: 0 (clamped at 0 like grpo-core, never negative).
    let z = [1.0f32, 2.0, -3.0, ninf, 0.5];
    k.jsd(&z, &z, 5, 0.3, 0.7, &mut out[..1]).unwrap();
    assert!((0.0..1e-6).contains(&out[0]), "{}", out[0]);
    // A finite logit whose z/T overflows to −∞ but is not the row maximum is valid in grpo-core
    // (probability 0): the same value as with that entry masked.
    let z = [0.0f32, -3e38, 1.0];
    let w = [0.5f32, 0.0, 0.0];
    let mut want = [0f32];
    grpo_core::vocab::jsd_rows(&z, &w, 3, 0.5, 0.5, &mut want).unwrap();
    k.jsd(&z, &w, 3, 0.5, 0.5, &mut out[..1]).unwrap();
    let masked = [0.0f32, ninf, 1.0];
    let mut m = [0f32];
    k.jsd(&masked, &w, 3, 0.5, 0.5, &mut m).unwrap();
    assert!(
        tolerance(Op::Jsd, Dtype::F32).accepts(out[0], want[0] as f64),
        "{} vs {}",
        out[0],
        want[0]
    );
    assert_eq!(out[0], m[0]);
}

/// (student, teacher, vocab, β, T).
type JsdArgs = (Vec<f32>, Vec<f32>, usize, f32, f32);

#[test]
fn jsd_errors_match_grpo_core_and_leave_outputs_untouched() {
    let Some(ctx) = gpu::context("jsd_errors_match_grpo_core_and_leave_outputs_untouched") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    let (ninf, nan, inf) = (f32::NEG_INFINITY, f32::NAN, f32::INFINITY);
    let ok = vec![0.0f32, 1.0, 2.0, -1.0, 0.5, 0.25];
    // (student, teacher, vocab, β, T) with two rows of 3 (where the lengths are right).
    #[rustfmt::skip]
    let cases: Vec<JsdArgs> = vec![
        // NaN / +∞: student row 1; teacher row 0 (wins over a later student error); both in a row
        // (the student's wins).
        (vec![0.0, 1.0, 2.0, 0.0, nan, 1.0], ok.clone(), 3, 0.5, 1.0),
        (vec![0.0, 1.0, 2.0, 0.0, nan, 1.0], vec![0.0, inf, 0.0, 0.0, 0.0, 0.0], 3, 0.5, 1.0),
        (vec![0.0, 0.0, inf, 0.0, 0.0, 0.0], vec![nan, 0.0, 0.0, 0.0, 0.0, 0.0], 3, 0.5, 1.0),
        // Rows of only −∞: student row 0, teacher row 1.
        (vec![ninf, ninf, ninf, 0.0, 0.0, 0.0], ok.clone(), 3, 0.5, 1.0),
        (ok.clone(), vec![0.0, 1.0, 2.0, ninf, ninf, ninf], 3, 0.5, 1.0),
        // The maximum overflows once divided by T: to +∞ (student), to −∞ (teacher).
        (vec![0.0, 3e38, 3e38, 1.0, 1.0, 1.0], ok.clone(), 3, 0.5, 0.5),
        (ok.clone(), vec![0.0, 1.0, 2.0, -1e30, -2e30, -1e30], 3, 0.5, 1e-10),
        // Temperature: 0, negative, NaN, +∞, 1/T overflowing.
        (ok.clone(), ok.clone(), 3, 0.5, 0.0),
        (ok.clone(), ok.clone(), 3, 0.5, -1.0),
        (ok.clone(), ok.clone(), 3, 0.5, nan),
        (ok.clone(), ok.clone(), 3, 0.5, inf),
        (ok.clone(), ok.clone(), 3, 0.5, 1e-39),
        // β outside (0, 1), including both endpoints (the KL divergences: use `kl`).
        (ok.clone(), ok.clone(), 3, 0.0, 1.0),
        (ok.clone(), ok.clone(), 3, 1.0, 1.0),
        (ok.clone(), ok.clone(), 3, -0.25, 1.0),
        (ok.clone(), ok.clone(), 3, 1.5, 1.0),
        (ok.clone(), ok.clone(), 3, nan, 1.0),
        // β is checked before the lengths, T before β.
        (ok[..5].to_vec(), ok.clone(), 3, 2.0, 1.0),
        (ok.clone(), ok.clone(), 3, 2.0, 0.0),
        // Lengths: student, teacher, vocab 0.
        (ok[..5].to_vec(), ok.clone(), 3, 0.5, 1.0),
        (ok.clone(), ok[..4].to_vec(), 3, 0.5, 1.0),
        (ok.clone(), ok.clone(), 0, 0.5, 1.0),
    ];
    for (z, w, vocab, beta, temp) in cases {
        let mut want = [7f32; 2];
        let core = grpo_core::vocab::jsd_rows(&z, &w, vocab, beta, temp, &mut want).unwrap_err();
        assert_eq!(want, [7f32; 2]);
        let mut out = [7f32; 2];
        let got = k.jsd(&z, &w, vocab, beta, temp, &mut out);
        assert_eq!(
            got,
            Err(GpuError::Core(core)),
            "{z:?} {w:?} V={vocab} β={beta} T={temp}"
        );
        assert_eq!(out, [7f32; 2], "output written on error");
    }
    // bf16 storage reports the same flat index (row 1, column 2 of the teacher).
    let z: Vec<half::bf16> = ok.iter().map(|&x| half::bf16::from_f32(x)).collect();
    let mut w = z.clone();
    w[5] = half::bf16::NAN;
    let mut out = [7f32; 2];
    assert_eq!(
        k.jsd(&z, &w, 3, 0.5, 1.0, &mut out),
        Err(GpuError::Core(Error::NonFinite {
            what: "teacher",
            index: 5
        }))
    );
    assert_eq!(out, [7f32; 2]);
}

/// `kl` against grpo-core's `kl_rows` on rows built to hit every error (and the one anomaly the
/// core accepts), in both directions: the same error value with the output untouched, or the
/// same value within the KL tolerance.
#[test]
fn kl_errors_and_edge_rows_match_grpo_core() {
    let Some(ctx) = gpu::context("kl_errors_and_edge_rows_match_grpo_core") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    let (ninf, nan, inf) = (f32::NEG_INFINITY, f32::NAN, f32::INFINITY);
    let ok = vec![0.0f32, 1.0, 2.0, -1.0, 0.5, 0.25];
    // (student, teacher, vocab, T) with two rows of 3 (where the lengths are right).
    #[rustfmt::skip]
    let cases: Vec<(Vec<f32>, Vec<f32>, usize, f32)> = vec![
        // NaN / +∞: student row 1; teacher row 0 (wins over a later student error).
        (vec![0.0, 1.0, 2.0, 0.0, nan, 1.0], ok.clone(), 3, 1.0),
        (vec![0.0, 1.0, 2.0, 0.0, nan, 1.0], vec![0.0, inf, 0.0, 0.0, 0.0, 0.0], 3, 1.0),
        // Rows of only −∞: student row 0, teacher row 1.
        (vec![ninf, ninf, ninf, 0.0, 0.0, 0.0], ok.clone(), 3, 1.0),
        (ok.clone(), vec![0.0, 1.0, 2.0, ninf, ninf, ninf], 3, 1.0),
        // Support: the teacher is −∞ where the student has mass (forward +∞), and the converse
        // (KL(q‖p) = +∞); both −∞ in a column is fine.
        (ok.clone(), vec![0.0, ninf, 2.0, -1.0, 0.5, 0.25], 3, 1.0),
        (vec![0.0, 1.0, ninf, -1.0, 0.5, 0.25], ok.clone(), 3, 1.0),
        (vec![0.0, ninf, 2.0, -1.0, 0.5, 0.25], vec![0.0, ninf, 2.0, 1.0, 0.5, -0.25], 3, 1.0),
        // The maximum overflows once divided by T: to +∞ (student), to −∞ (teacher).
        (vec![0.0, 3e38, 3e38, 1.0, 1.0, 1.0], ok.clone(), 3, 0.5),
        (ok.clone(), vec![0.0, 1.0, 2.0, -1e30, -2e30, -1e30], 3, 1e-10),
        // A non-maximal logit whose z/T overflows to −∞: probability 0, accepted by grpo-core.
        (vec![0.0, 1.0, -3e38, 0.0, 0.5, 1.0], vec![0.5, 1.0, 0.0, 1.0, 0.5, 0.0], 3, 0.5),
        // Temperature: 0, negative, NaN, +∞, 1/T overflowing.
        (ok.clone(), ok.clone(), 3, 0.0),
        (ok.clone(), ok.clone(), 3, -1.0),
        (ok.clone(), ok.clone(), 3, nan),
        (ok.clone(), ok.clone(), 3, inf),
        (ok.clone(), ok.clone(), 3, 1e-39),
        // Lengths: student, teacher, vocab 0.
        (ok[..5].to_vec(), ok.clone(), 3, 1.0),
        (ok.clone(), ok[..4].to_vec(), 3, 1.0),
        (ok.clone(), ok.clone(), 0, 1.0),
    ];
    let mut errors = 0;
    for (z, w, vocab, temp) in cases {
        for dir in [KlDirection::StudentTeacher, KlDirection::TeacherStudent] {
            let mut want = [7f32; 2];
            let core = grpo_core::vocab::kl_rows(&z, &w, vocab, temp, dir, &mut want);
            let mut out = [7f32; 2];
            let got = k.kl(&z, &w, vocab, temp, dir, &mut out);
            let what = format!("{z:?} {w:?} V={vocab} T={temp} {dir:?}");
            match core {
                Err(e) => {
                    errors += 1;
                    assert_eq!(got, Err(GpuError::Core(e)), "{what}");
                    assert_eq!(out, [7f32; 2], "output written on error: {what}");
                }
                Ok(()) => {
                    got.unwrap_or_else(|e| panic!("{what}: {e}"));
                    for r in 0..2 {
                        let ok = tolerance(Op::Kl, Dtype::F32).accepts(out[r], want[r] as f64);
                        assert!(ok, "{what}: row {r}: {} vs core {}", out[r], want[r]);
                    }
                }
            }
        }
    }
    // Every row above but the accepted ones is an error in at least one direction.
    assert!(errors >= 30, "{errors} errors");
    // bf16 storage reports the same flat index (row 1, column 2 of the teacher).
    let z: Vec<half::bf16> = ok.iter().map(|&x| half::bf16::from_f32(x)).collect();
    let mut w = z.clone();
    w[5] = half::bf16::NAN;
    let mut out = [7f32; 2];
    assert_eq!(
        k.kl(&z, &w, 3, 1.0, KlDirection::StudentTeacher, &mut out),
        Err(GpuError::Core(Error::NonFinite {
            what: "teacher",
            index: 5
        }))
    );
    assert_eq!(out, [7f32; 2]);
}

// ---------------------------------------------------------------------------------------------
// Logits near ±f32::MAX: the shift of a logit to its row maximum (z − m, or z/T − m/T)
// overflows to −∞ in f32. grpo-core defines those rows (canon.rs: every shift is floored at
// D_MIN = −88 before exp, and at LOG_RATIO_FLOOR in a log-ratio; `validate::target` rejects a
// target whose (z_y − max)/T overflows); the GPU must give the same errors and values.

/// Rows (logits, T) whose shifts overflow: opposite signs in different lanes (the workgroup
/// tree merges them), in one lane of a row longer than the 256-lane stride (a new maximum
/// after an overflowing term, and an overflowing term after the maximum), temperatures that
/// move the overflow (T = 2: only z − m overflows, as grpo-core computes it; T = 0.5: only
/// z/T − m/T, as the shader computes it), and tiny/huge T where only the target check sees it.
fn extreme_rows() -> Vec<(Vec<f32>, f32)> {
    let big = 3e38f32;
    let mut long_a = vec![0.25f32; 300];
    (long_a[0], long_a[256]) = (-big, big);
    (long_a[1], long_a[257]) = (big, -big);
    long_a[7] = f32::NEG_INFINITY;
    let mut long_b: Vec<f32> = (0..600)
        .map(|i| ((i * 37 % 101) as f32) * 0.1 - 5.0)
        .collect();
    (long_b[3], long_b[259], long_b[515]) = (f32::MAX, -f32::MAX, f32::MAX);
    vec![
        (vec![big, -big, 0.0, 1.0], 1.0),
        (vec![-big, big, 0.5, -2.0], 1.0),
        (vec![f32::MAX, -f32::MAX, -1.0, f32::NEG_INFINITY], 1.0),
        (vec![big, -big, 0.0, 1.0], 2.0),
        (vec![1e38, -1e38, 5.0, 0.0], 0.5),
        (vec![big, -big, 0.0, 1.0], 1e10),
        (vec![1.0, -1e10, 0.0, 0.5], 1e-30),
        (vec![-3.3e38, -3e38, -3.2e38, -1e38], 1.0),
        (long_a, 1.0),
        (long_b, 0.7),
    ]
}

/// The target columns checked in a row: every one of a short row, a few of a long one.
fn extreme_targets(vocab: usize) -> Vec<u32> {
    if vocab <= 8 {
        (0..vocab as u32).collect()
    } else {
        vec![0, 1, 2, 3, 256, 257, 259, 515]
            .into_iter()
            .filter(|&y| (y as usize) < vocab)
            .collect()
    }
}

/// f64 gradient of g_lp·logp(y) + g_h·H (MATH.md §5) and the absolute slack of `VocabGrad`
/// scaled as `backward_matches_f64_reference` does, with log p floored at grpo-core's D_MIN
/// (a probability below e^−88 is 0 in grpo-core and contributes nothing to either term).
fn grad_reference(row: &[f64], y: usize, t: f64, a: f64, b: f64) -> (Vec<f64>, f64) {
    let (_, lp) = log_softmax(row, t);
    let (_, _, h, p) = reference(row, y, t);
    let min_logp = lp
        .iter()
        .filter(|l| l.is_finite())
        .map(|l| l.max(-88.0))
        .fold(0.0, f64::min);
    let scale = (a.abs() + b.abs() * (1.0 + h + min_logp.abs())) / t;
    let want = (0..row.len())
        .map(|v| {
            let mut g = -a * p[v]
                - if p[v] > 0.0 {
                    b * p[v] * (lp[v] + h)
                } else {
                    0.0
                };
            if v == y {
                g += a;
            }
            g / t
        })
        .collect();
    (want, scale)
}

/// Records a mismatch instead of stopping at the first one (the test reports them all).
macro_rules! check {
    ($fails:expr, $ok:expr, $($msg:tt)*) => {
        if !$ok {
            $fails.push(format!($($msg)*));
        }
    };
}

/// Checks one row at every target of [`extreme_targets`]; each mismatch is added to `fails`.
fn check_extreme_row<L: LogitStorage + grpo_core::vocab::Logit>(
    k: &VocabKernel<'_>,
    row: &[L],
    temp: f32,
    dtype: Dtype,
    fails: &mut Vec<String>,
) {
    let vocab = row.len();
    let wide: Vec<f64> = row.iter().map(|&z| LogitStorage::widen(z) as f64).collect();
    for y in extreme_targets(vocab) {
        let what = format!("{dtype:?} V={vocab} T={temp} y={y}");
        // Forward: grpo-core's error, or the f64 reference within the table.
        let (mut clp, mut ch) = ([7f32], [7f32]);
        let core =
            grpo_core::vocab::logprob_entropy_rows(row, vocab, &[y], temp, &mut clp, Some(&mut ch));
        let (mut lse, mut lp, mut h) = ([7f32], [7f32], [7f32]);
        let got = k.forward(
            row,
            vocab,
            &[y],
            temp,
            ForwardOut {
                lse: Some(&mut lse),
                logp: Some(&mut lp),
                entropy: Some(&mut h),
            },
        );
        if let Err(e) = core {
            let want = Err(GpuError::Core(e));
            check!(
                fails,
                got == want,
                "forward {what}: {got:?}, grpo-core {want:?}"
            );
            check!(
                fails,
                (lse, lp, h) == ([7f32], [7f32], [7f32]),
                "forward wrote on error: {what}"
            );
            continue;
        }
        if let Err(e) = got {
            fails.push(format!("forward {what}: {e}, grpo-core Ok"));
            continue;
        }
        let (rl, rp, rh, _) = reference(&wide, y as usize, temp as f64);
        check!(
            fails,
            tolerance(Op::Lse, dtype).accepts(lse[0], rl),
            "lse {} vs f64 {rl}: {what}",
            lse[0]
        );
        check!(
            fails,
            tolerance(Op::Logp, dtype).accepts(lp[0], rp),
            "logp {} vs f64 {rp} (grpo-core {}): {what}",
            lp[0],
            clp[0]
        );
        check!(
            fails,
            tolerance(Op::Entropy, dtype).accepts(h[0], rh),
            "H {} vs f64 {rh} (grpo-core {}): {what}",
            h[0],
            ch[0]
        );
        // Backward (grpo-core takes T ≥ 1e-6 for gradients; the rows above stay there or far
        // below, where only the forward is checked).
        if temp < grpo_core::vocab::MIN_GRAD_TEMPERATURE {
            continue;
        }
        let (a, b) = (0.75f32, -1.25f32);
        let mut grad = vec![7f32; vocab];
        if let Err(e) = k.backward(row, vocab, &[y], temp, &[a], &[b], &mut grad) {
            fails.push(format!("backward {what}: {e}, grpo-core Ok"));
            continue;
        }
        let (want, scale) = grad_reference(&wide, y as usize, temp as f64, a as f64, b as f64);
        let tol = tolerance(Op::VocabGrad, dtype);
        let tol = tol.with_abs(tol.abs * scale);
        for v in 0..vocab {
            check!(
                fails,
                tol.accepts(grad[v], want[v]),
                "grad[{v}] {} vs f64 {}: {what}",
                grad[v],
                want[v]
            );
        }
    }
}

/// Forward, backward and kl on rows whose shifts overflow f32 give grpo-core's errors, or its
/// values within the table's tolerance — never NaN, and never a −∞ grpo-core does not produce.
/// (JSD, which already floored its shifts, is checked on the same pairs.)
#[test]
fn extreme_logits_of_opposite_signs_match_grpo_core() {
    let Some(ctx) = gpu::context("extreme_logits_of_opposite_signs_match_grpo_core") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    let mut fails = Vec::new();
    for (row, temp) in extreme_rows() {
        check_extreme_row(&k, &row, temp, Dtype::F32, &mut fails);
        // bf16 holds ±3e38 too (f16 does not: its largest value is 65504).
        let b: Vec<half::bf16> = row.iter().map(|&z| half::bf16::from_f32(z)).collect();
        check_extreme_row(&k, &b, temp, Dtype::Bf16, &mut fails);
    }
    // The short T = 1 rows as one batch: grpo-core's first error (or all values).
    let batch: Vec<(Vec<f32>, f32)> = extreme_rows()
        .into_iter()
        .filter(|(r, t)| r.len() == 4 && *t == 1.0)
        .collect();
    let logits: Vec<f32> = batch.iter().flat_map(|(r, _)| r.clone()).collect();
    let rows = batch.len();
    for targets in [vec![0u32; rows], (0..rows as u32).map(|r| r % 4).collect()] {
        let (mut clp, mut ch) = (vec![7f32; rows], vec![7f32; rows]);
        let core = grpo_core::vocab::logprob_entropy_rows(
            &logits,
            4,
            &targets,
            1.0,
            &mut clp,
            Some(&mut ch),
        );
        let (mut lp, mut h) = (vec![7f32; rows], vec![7f32; rows]);
        let got = k.forward(
            &logits,
            4,
            &targets,
            1.0,
            ForwardOut {
                logp: Some(&mut lp),
                entropy: Some(&mut h),
                lse: None,
            },
        );
        let want = core.map_err(GpuError::Core);
        check!(
            fails,
            got == want,
            "batch {targets:?}: {got:?}, grpo-core {want:?}"
        );
        if want.is_ok() && got.is_ok() {
            for r in 0..rows {
                let ok = tolerance(Op::Logp, Dtype::F32).accepts(lp[r], clp[r] as f64)
                    && tolerance(Op::Entropy, Dtype::F32).accepts(h[r], ch[r] as f64);
                check!(
                    fails,
                    ok,
                    "batch row {r}: logp {} H {} vs grpo-core {} {}",
                    lp[r],
                    h[r],
                    clp[r],
                    ch[r]
                );
            }
        }
    }

    // KL and JSD between such rows and ordinary ones, both ways (and same-sign huge rows,
    // where two maxima differ by ~1e37): grpo-core's error or value.
    let big = 3e38f32;
    #[rustfmt::skip]
    let pairs: Vec<(Vec<f32>, Vec<f32>, f32)> = vec![
        (vec![big, -big, 0.0, 1.0], vec![0.0, 0.0, 0.0, 0.0], 1.0),
        (vec![0.0, 0.5, 0.0, 1.0], vec![big, -big, 0.0, 1.0], 1.0),
        (vec![big, -big, 0.0, 1.0], vec![-big, big, 1.0, 0.0], 1.0),
        (vec![1e38, -1e38, 5.0, 0.0], vec![0.0, 1.0, 2.0, 3.0], 0.5),
        (vec![big, 2.9e38, -big, 0.0], vec![0.0, 0.0, 1.0, 0.0], 1.0),
        (vec![-3.3e38, -3e38, -3.2e38, -1e38], vec![1.0, 2.0, 0.0, -1.0], 1.0),
        (vec![big, -big, 0.0, 1.0], vec![0.5, 0.0, 1.0, 0.0], 1e10),
    ];
    for (z, w, temp) in pairs {
        for dir in [KlDirection::StudentTeacher, KlDirection::TeacherStudent] {
            let what = format!("{z:?} {w:?} T={temp} {dir:?}");
            let mut want = [7f32];
            let core = grpo_core::vocab::kl_rows(&z, &w, 4, temp, dir, &mut want);
            let mut out = [7f32];
            let got = k.kl(&z, &w, 4, temp, dir, &mut out);
            match (core, got) {
                (Err(e), got) => {
                    let want = Err(GpuError::Core(e));
                    check!(fails, got == want, "kl {what}: {got:?}, grpo-core {want:?}");
                    check!(fails, out == [7f32], "kl wrote on error: {what}");
                }
                (Ok(()), Err(e)) => fails.push(format!("kl {what}: {e}, grpo-core Ok")),
                (Ok(()), Ok(())) => check!(
                    fails,
                    tolerance(Op::Kl, Dtype::F32).accepts(out[0], want[0] as f64),
                    "kl {} vs grpo-core {}: {what}",
                    out[0],
                    want[0]
                ),
            }
        }
        let what = format!("{z:?} {w:?} T={temp}");
        let mut want = [7f32];
        let core = grpo_core::vocab::jsd_rows(&z, &w, 4, 0.3, temp, &mut want);
        let mut out = [7f32];
        let got = k.jsd(&z, &w, 4, 0.3, temp, &mut out);
        match (core, got) {
            (Err(e), got) => {
                let want = Err(GpuError::Core(e));
                check!(
                    fails,
                    got == want,
                    "jsd {what}: {got:?}, grpo-core {want:?}"
                );
            }
            (Ok(()), Err(e)) => fails.push(format!("jsd {what}: {e}, grpo-core Ok")),
            (Ok(()), Ok(())) => check!(
                fails,
                tolerance(Op::Jsd, Dtype::F32).accepts(out[0], want[0] as f64),
                "jsd {} vs grpo-core {}: {what}",
                out[0],
                want[0]
            ),
        }
    }
    assert!(
        fails.is_empty(),
        "{} mismatches:\n{}",
        fails.len(),
        fails.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// Async variants.

/// Drives a future to completion with a no-op waker (the readback futures poll the device
/// themselves), so the test depends on no executor.
fn block_on<F: Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::yield_now();
    }
}

/// Polls two futures alternately until both are ready: two operations in flight on one
/// context at once.
fn join<A: Future, B: Future>(a: A, b: B) -> (A::Output, B::Output) {
    let (mut a, mut b) = (std::pin::pin!(a), std::pin::pin!(b));
    let (mut ra, mut rb) = (None, None);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    while ra.is_none() || rb.is_none() {
        if ra.is_none()
            && let std::task::Poll::Ready(v) = a.as_mut().poll(&mut cx)
        {
            ra = Some(v);
        }
        if rb.is_none()
            && let std::task::Poll::Ready(v) = b.as_mut().poll(&mut cx)
        {
            rb = Some(v);
        }
        std::thread::yield_now();
    }
    (ra.unwrap(), rb.unwrap())
}

fn f32_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// forward_async, backward_async, kl_async and jsd_async give the blocking methods' bits and
/// errors (outputs untouched on `Err`), for f32 and bf16 rows split into several chunks (so the
/// async path awaits several readbacks), and two of them can be in flight at once.
fn check_async<L: LogitStorage>(k: &VocabKernel<'_>, conv: fn(f32) -> L) {
    let (rows, vocab) = (5usize, 301usize);
    let logits: Vec<L> = (0..rows * vocab)
        .map(|i| conv(((i * 37 % 101) as f32) * 0.11 - 5.0))
        .collect();
    let teacher: Vec<L> = (0..rows * vocab)
        .map(|i| conv(((i * 53 % 89) as f32) * 0.09 - 4.0))
        .collect();
    let targets: Vec<u32> = (0..rows as u32).map(|r| r * 13 % vocab as u32).collect();
    let (g_lp, g_h) = (vec![0.75f32; rows], vec![-0.5f32; rows]);
    let temp = 0.9;

    let forward = |asynchronous: bool| {
        let (mut lse, mut lp, mut h) = (vec![7f32; rows], vec![7f32; rows], vec![7f32; rows]);
        let out = ForwardOut {
            lse: Some(&mut lse),
            logp: Some(&mut lp),
            entropy: Some(&mut h),
        };
        let r = if asynchronous {
            block_on(k.forward_async(&logits, vocab, &targets, temp, out))
        } else {
            k.forward(&logits, vocab, &targets, temp, out)
        };
        r.unwrap();
        (f32_bits(&lse), f32_bits(&lp), f32_bits(&h))
    };
    assert_eq!(forward(true), forward(false));

    let backward = |asynchronous: bool| {
        let mut grad = vec![7f32; rows * vocab];
        let r = if asynchronous {
            block_on(k.backward_async(&logits, vocab, &targets, temp, &g_lp, &g_h, &mut grad))
        } else {
            k.backward(&logits, vocab, &targets, temp, &g_lp, &g_h, &mut grad)
        };
        r.unwrap();
        f32_bits(&grad)
    };
    let grad = backward(false);
    assert_eq!(backward(true), grad);
    assert!(grad.iter().any(|&b| f32::from_bits(b) != 0.0));

    for dir in [KlDirection::StudentTeacher, KlDirection::TeacherStudent] {
        let (mut a, mut b) = (vec![7f32; rows], vec![7f32; rows]);
        k.kl(&logits, &teacher, vocab, temp, dir, &mut a).unwrap();
        block_on(k.kl_async(&logits, &teacher, vocab, temp, dir, &mut b)).unwrap();
        assert_eq!(f32_bits(&a), f32_bits(&b), "{dir:?}");
        assert!(a.iter().all(|&x| x > 0.0 && x.is_finite()), "{a:?}");
    }
    // The saving forwards and the backward from their states.
    let forward_saved = |asynchronous: bool| {
        let (mut lp, mut st) = (vec![7f32; rows], vec![LseState::EMPTY; rows]);
        let out = ForwardOut {
            logp: Some(&mut lp),
            ..Default::default()
        };
        let r = if asynchronous {
            block_on(k.forward_saved_async(&logits, vocab, &targets, temp, out, &mut st))
        } else {
            k.forward_saved(&logits, vocab, &targets, temp, out, &mut st)
        };
        r.unwrap();
        (f32_bits(&lp), st)
    };
    let (lp, lse_states) = forward_saved(false);
    assert_eq!(forward_saved(true), (lp, lse_states.clone()));
    let dir = KlDirection::TeacherStudent;
    let kl_saved = |asynchronous: bool| {
        let (mut kl, mut st) = (vec![7f32; rows], vec![PairState::EMPTY; rows]);
        let r = if asynchronous {
            block_on(k.kl_saved_async(&logits, &teacher, vocab, temp, dir, &mut kl, &mut st))
        } else {
            k.kl_saved(&logits, &teacher, vocab, temp, dir, &mut kl, &mut st)
        };
        r.unwrap();
        (f32_bits(&kl), st)
    };
    let (kl, pair_states) = kl_saved(false);
    assert_eq!(kl_saved(true), (kl, pair_states.clone()));
    let g_kl = vec![0.25f32; rows];
    let terms = GradTerms {
        logp: Some((&targets[..], &g_lp[..])),
        entropy: Some(&g_h[..]),
        kl: Some(KlTerm {
            teacher: &teacher[..],
            grad: &g_kl[..],
            direction: dir,
        }),
    };
    let mut grad = vec![7f32; rows * vocab];
    k.backward_saved(&logits, vocab, temp, &pair_states, &terms, &mut grad)
        .unwrap();
    let mut again = vec![7f32; rows * vocab];
    block_on(k.backward_saved_async(&logits, vocab, temp, &pair_states, &terms, &mut again))
        .unwrap();
    assert_eq!(f32_bits(&grad), f32_bits(&again));
    let mut recomputed = vec![7f32; rows * vocab];
    block_on(k.backward_rows_async(&logits, vocab, temp, &terms, &mut recomputed)).unwrap();
    k.backward_rows(&logits, vocab, temp, &terms, &mut again)
        .unwrap();
    assert_eq!(f32_bits(&recomputed), f32_bits(&again));
    let no_kl = GradTerms { kl: None, ..terms };
    k.backward_saved(&logits, vocab, temp, &lse_states, &no_kl, &mut grad)
        .unwrap();
    block_on(k.backward_saved_async(&logits, vocab, temp, &lse_states, &no_kl, &mut again))
        .unwrap();
    assert_eq!(f32_bits(&grad), f32_bits(&again));
    assert!(grad.iter().any(|&g| g != 0.0));
    // An error (a state that cannot be a forward's) is the blocking one; nothing written.
    let mut bad_states = lse_states.clone();
    bad_states[2].sum = 0.0;
    let mut grad = vec![7f32; rows * vocab];
    let want = k.backward_saved(&logits, vocab, temp, &bad_states, &no_kl, &mut grad);
    assert!(want.is_err());
    let got =
        block_on(k.backward_saved_async(&logits, vocab, temp, &bad_states, &no_kl, &mut grad));
    assert_eq!(got, want);
    assert_eq!(grad, vec![7f32; rows * vocab]);

    let (mut a, mut b) = (vec![7f32; rows], vec![7f32; rows]);
    k.jsd(&logits, &teacher, vocab, 0.3, temp, &mut a).unwrap();
    block_on(k.jsd_async(&logits, &teacher, vocab, 0.3, temp, &mut b)).unwrap();
    assert_eq!(f32_bits(&a), f32_bits(&b));
    assert!(a.iter().all(|&x| x > 0.0 && x.is_finite()), "{a:?}");
    // The JSD's saving forward and the gradient from its states, out of place and in place.
    let (mut sa, mut sb) = (vec![JsdState::EMPTY; rows], vec![JsdState::EMPTY; rows]);
    k.jsd_saved(&logits, &teacher, vocab, 0.3, temp, &mut a, &mut sa)
        .unwrap();
    block_on(k.jsd_saved_async(&logits, &teacher, vocab, 0.3, temp, &mut b, &mut sb)).unwrap();
    assert_eq!((f32_bits(&a), &sa), (f32_bits(&b), &sb));
    let g = vec![0.5f32; rows];
    let (mut ga, mut gb) = (vec![7f32; rows * vocab], vec![7f32; rows * vocab]);
    k.jsd_backward_saved(&logits, &teacher, vocab, temp, &sa, &g, &mut ga)
        .unwrap();
    block_on(k.jsd_backward_saved_async(&logits, &teacher, vocab, temp, &sa, &g, &mut gb)).unwrap();
    assert_eq!(f32_bits(&ga), f32_bits(&gb));
    let (mut za, mut zb) = (logits.clone(), logits.clone());
    k.jsd_backward_saved_in_place(&mut za, &teacher, vocab, temp, &sa, &g)
        .unwrap();
    let f = k.jsd_backward_saved_in_place_async(&mut zb, &teacher, vocab, temp, &sa, &g);
    block_on(f).unwrap();
    let wide = |x: &[L]| x.iter().map(|v| v.widen().to_bits()).collect::<Vec<_>>();
    assert_eq!(wide(&za), wide(&zb));
    let mut bad_states = sa.clone();
    bad_states[1].kl_pm = f32::NAN;
    let want = k.jsd_backward_saved(&logits, &teacher, vocab, temp, &bad_states, &g, &mut ga);
    assert!(want.is_err());
    let f = k.jsd_backward_saved_async(&logits, &teacher, vocab, temp, &bad_states, &g, &mut gb);
    assert_eq!(block_on(f), want);
    assert_eq!(f32_bits(&ga), f32_bits(&gb));

    // Two operations in flight at once on the same context.
    let (mut kl, mut js) = (vec![7f32; rows], vec![7f32; rows]);
    let (rk, rj) = join(
        k.kl_async(
            &logits,
            &teacher,
            vocab,
            temp,
            KlDirection::StudentTeacher,
            &mut kl,
        ),
        k.jsd_async(&logits, &teacher, vocab, 0.3, temp, &mut js),
    );
    rk.unwrap();
    rj.unwrap();
    let mut want = vec![7f32; rows];
    k.kl(
        &logits,
        &teacher,
        vocab,
        temp,
        KlDirection::StudentTeacher,
        &mut want,
    )
    .unwrap();
    assert_eq!(f32_bits(&kl), f32_bits(&want));
    assert_eq!(f32_bits(&js), f32_bits(&a));

    // Errors: a NaN in row 3 (found by the shader, turned into grpo-core's error on the host
    // after the readback) and a bad temperature (host validation): the blocking error, nothing
    // written.
    let mut bad = logits.clone();
    bad[3 * vocab + 7] = conv(f32::NAN);
    let nan = Err(GpuError::Core(Error::NonFinite {
        what: "logits",
        index: 3 * vocab + 7,
    }));
    let mut lse = vec![7f32; rows];
    let out = ForwardOut {
        lse: Some(&mut lse),
        ..Default::default()
    };
    assert_eq!(block_on(k.forward_async(&bad, vocab, &[], temp, out)), nan);
    assert_eq!(lse, vec![7f32; rows]);
    let mut grad = vec![7f32; rows * vocab];
    let got = block_on(k.backward_async(&bad, vocab, &targets, temp, &g_lp, &g_h, &mut grad));
    assert_eq!(got, nan);
    assert_eq!(grad, vec![7f32; rows * vocab]);
    let mut out = vec![7f32; rows];
    for dir in [KlDirection::StudentTeacher, KlDirection::TeacherStudent] {
        let want = k.kl(&bad, &teacher, vocab, temp, dir, &mut out);
        assert!(want.is_err());
        let got = block_on(k.kl_async(&bad, &teacher, vocab, temp, dir, &mut out));
        assert_eq!(got, want);
    }
    let want = k.jsd(&teacher, &bad, vocab, 0.3, temp, &mut out);
    assert_eq!(
        want,
        Err(GpuError::Core(Error::NonFinite {
            what: "teacher",
            index: 3 * vocab + 7
        }))
    );
    let got = block_on(k.jsd_async(&teacher, &bad, vocab, 0.3, temp, &mut out));
    assert_eq!(got, want);
    let got = block_on(k.jsd_async(&logits, &teacher, vocab, 0.3, 0.0, &mut out));
    assert_eq!(got, k.jsd(&logits, &teacher, vocab, 0.3, 0.0, &mut out));
    assert!(got.is_err());
    assert_eq!(out, vec![7f32; rows]);
}

#[test]
fn async_variants_equal_blocking() {
    if gpu::context("async_variants_equal_blocking").is_none() {
        return;
    }
    // A private context: its binding cap must not reach the tests running in parallel. At 2000
    // bytes a chunk holds 3 rows of bf16 logits and 1 row of f32 logits or gradient (301·4 + 4
    // bytes), so the async calls await up to 5 readbacks each.
    let ctx = grpo_wgpu::GpuContext::new().unwrap();
    let k = VocabKernel::new(&ctx);
    for cap in [u64::MAX, 2000] {
        ctx.set_binding_cap(cap);
        check_async(&k, |x| x);
        check_async(&k, half::bf16::from_f32);
    }
    ctx.set_binding_cap(u64::MAX);
}

/// The benchmark hook `VocabKernel::resident` computes what the public operations compute:
/// each variant's outputs, read back from the device after one run, are the public
/// operation's bits (targets 0, temperature 1, upstream gradients 1 (log-prob), 0.5
/// (entropy) and 1 (KL), as the hook documents), in f32 and bf16.
#[test]
fn resident_benchmark_work_computes_the_public_operations() {
    let Some(ctx) = gpu::context("resident_benchmark_work_computes_the_public_operations") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    resident_matches_public::<f32>(&k, |x| x);
    resident_matches_public::<half::bf16>(&k, half::bf16::from_f32);
}

fn resident_matches_public<L: LogitStorage + grpo_core::vocab::Logit>(
    k: &VocabKernel<'_>,
    from: fn(f32) -> L,
) {
    let (rows, vocab) = (3usize, 300usize);
    let row = |seed: usize| -> Vec<L> {
        (0..rows * vocab)
            .map(|i| from(((i * 37 + seed) % 101) as f32 * 0.13 - 6.0))
            .collect()
    };
    let (logits, teacher) = (row(0), row(17));
    let targets = vec![0u32; rows];
    let (ones, halves) = (vec![1.0f32; rows], vec![0.5f32; rows]);
    let floats = |bytes: Vec<u8>, n: usize| gpu::f32_bits(&bytes, n);
    let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let resident = |what| {
        let r = k.resident(&logits, vocab, what).unwrap();
        r.run().unwrap();
        r
    };

    // Forward: (lse, logp, H, 0) per row in binding 2.
    let (mut lse, mut lp, mut h) = (vec![0f32; rows], vec![0f32; rows], vec![0f32; rows]);
    let out = ForwardOut {
        lse: Some(&mut lse),
        logp: Some(&mut lp),
        entropy: Some(&mut h),
    };
    k.forward(&logits, vocab, &targets, 1.0, out).unwrap();
    let stats = floats(resident(ResidentVocab::Forward).read(2).unwrap(), rows * 4);
    let want: Vec<u32> = (0..rows)
        .flat_map(|r| [lse[r], lp[r], h[r], 0.0])
        .map(f32::to_bits)
        .collect();
    assert_eq!(stats, want, "{:?} forward", L::DTYPE);

    // KL(p‖q), the student being the logits: slot 3 of binding 2.
    let mut kl = vec![0f32; rows];
    k.kl(
        &logits,
        &teacher,
        vocab,
        1.0,
        KlDirection::StudentTeacher,
        &mut kl,
    )
    .unwrap();
    let stats = floats(
        resident(ResidentVocab::Kl { teacher: &teacher })
            .read(2)
            .unwrap(),
        rows * 4,
    );
    let got: Vec<u32> = (0..rows).map(|r| stats[r * 4 + 3]).collect();
    assert_eq!(got, bits(&kl), "{:?} kl", L::DTYPE);

    // The backwards: the gradient in binding 6.
    let n = rows * vocab;
    let mut grad = vec![0f32; n];
    k.backward(&logits, vocab, &targets, 1.0, &ones, &halves, &mut grad)
        .unwrap();
    let got = floats(resident(ResidentVocab::Backward).read(6).unwrap(), n);
    assert_eq!(got, bits(&grad), "{:?} backward", L::DTYPE);

    let terms = GradTerms {
        logp: Some((&targets[..], &ones[..])),
        entropy: Some(&halves[..]),
        kl: None,
    };
    let (mut lp, mut saved) = (vec![0f32; rows], vec![LseState::EMPTY; rows]);
    grpo_core::vocab::logprob_entropy_rows_saved(
        &logits, vocab, &targets, 1.0, &mut lp, None, &mut saved,
    )
    .unwrap();
    k.backward_saved(&logits, vocab, 1.0, &saved, &terms, &mut grad)
        .unwrap();
    let got = floats(resident(ResidentVocab::BackwardSaved).read(6).unwrap(), n);
    assert_eq!(got, bits(&grad), "{:?} backward_saved", L::DTYPE);
    // In place: the storage type's bytes in binding 8 (zero-padded to a word).
    let mut over = logits.clone();
    k.backward_saved_in_place(&mut over, vocab, 1.0, &saved, &terms)
        .unwrap();
    let mut got = resident(ResidentVocab::BackwardSavedInPlace)
        .read(8)
        .unwrap();
    got.truncate(n * size_of::<L>());
    let want: &[u8] = bytemuck::cast_slice(&over);
    assert_eq!(got, want, "{:?} backward_saved_in_place", L::DTYPE);

    let (mut kl, mut saved) = (vec![0f32; rows], vec![PairState::EMPTY; rows]);
    grpo_core::vocab::kl_rows_saved(
        &logits,
        &teacher,
        vocab,
        1.0,
        KlDirection::StudentTeacher,
        &mut kl,
        &mut saved,
    )
    .unwrap();
    let kl_term = KlTerm {
        teacher: &teacher[..],
        grad: &ones[..],
        direction: KlDirection::StudentTeacher,
    };
    let terms = GradTerms {
        kl: Some(kl_term),
        ..terms
    };
    k.backward_saved(&logits, vocab, 1.0, &saved, &terms, &mut grad)
        .unwrap();
    let got = floats(
        resident(ResidentVocab::BackwardKlSaved { teacher: &teacher })
            .read(6)
            .unwrap(),
        n,
    );
    assert_eq!(got, bits(&grad), "{:?} backward_kl_saved", L::DTYPE);

    // The JSD's gradient, β = ½, weights ½.
    k.jsd_backward(&logits, &teacher, vocab, 0.5, 1.0, &halves, &mut grad)
        .unwrap();
    let got = floats(
        resident(ResidentVocab::JsdBackward { teacher: &teacher })
            .read(6)
            .unwrap(),
        n,
    );
    assert_eq!(got, bits(&grad), "{:?} jsd_backward", L::DTYPE);
    // And from grpo-core's saved states.
    let (mut jsd, mut states) = (vec![0f32; rows], vec![JsdState::EMPTY; rows]);
    grpo_core::vocab::jsd_rows_saved(&logits, &teacher, vocab, 0.5, 1.0, &mut jsd, &mut states)
        .unwrap();
    k.jsd_backward_saved(&logits, &teacher, vocab, 1.0, &states, &halves, &mut grad)
        .unwrap();
    let got = floats(
        resident(ResidentVocab::JsdBackwardSaved { teacher: &teacher })
            .read(6)
            .unwrap(),
        n,
    );
    assert_eq!(got, bits(&grad), "{:?} jsd_backward_saved", L::DTYPE);

    // A binding the shader does not have is an error, not a panic.
    assert_eq!(
        resident(ResidentVocab::Forward).read(99).err(),
        Some(GpuError::Core(Error::InvalidParam {
            name: "binding",
            reason: "not one the resident work holds",
        }))
    );
}

// ---------------------------------------------------------------------------------------------
// Timeouts.

/// A wait past the context's limit (`GpuContext::set_timeout`) is `GpuError::Timeout`, blocking
/// or awaited, with the outputs untouched; the same context then computes the bits a fresh
/// one does, with a limit and without one. A zero limit makes the failure deterministic: both
/// forms check the deadline before they ask the device (and the map callbacks run only inside
/// a device poll), so no operation's outputs can be collected in time, however fast the device.
#[test]
fn a_wait_past_the_timeout_is_an_error_and_the_context_recovers() {
    use std::time::Duration;
    let Some(shared) = gpu::context("a_wait_past_the_timeout_is_an_error_and_the_context_recovers")
    else {
        return;
    };
    // Its own context: the limit is the context's, and the shared one serves the tests that
    // run in parallel with this one.
    let ctx = grpo_wgpu::GpuContext::new().unwrap();
    assert_eq!(ctx.timeout(), Some(grpo_wgpu::DEFAULT_TIMEOUT));
    let (rows, vocab) = (64, 4096);
    let z: Vec<f32> = (0..rows * vocab)
        .map(|i| (i * 7919 % 1000) as f32 * 0.01 - 5.0)
        .collect();
    let ys: Vec<u32> = (0..rows).map(|r| (r * 31 % vocab) as u32).collect();
    let run = |k: &VocabKernel<'_>, lp: &mut [f32], h: &mut [f32], awaited: bool| {
        let out = ForwardOut {
            lse: None,
            logp: Some(lp),
            entropy: Some(h),
        };
        if awaited {
            block_on(k.forward_async(&z, vocab, &ys, 1.0, out))
        } else {
            k.forward(&z, vocab, &ys, 1.0, out)
        }
    };
    let (mut want_lp, mut want_h) = (vec![0f32; rows], vec![0f32; rows]);
    run(&VocabKernel::new(shared), &mut want_lp, &mut want_h, false).unwrap();
    assert!(want_lp.iter().chain(&want_h).all(|v| v.is_finite()));
    let k = VocabKernel::new(&ctx);
    for (awaited, then) in [(false, Some(Duration::from_secs(120))), (true, None)] {
        ctx.set_timeout(Some(Duration::ZERO));
        let (mut lp, mut h) = (vec![7f32; rows], vec![7f32; rows]);
        assert_eq!(
            run(&k, &mut lp, &mut h, awaited),
            Err(GpuError::Timeout {
                limit: Duration::ZERO
            }),
            "awaited: {awaited}"
        );
        assert!(
            lp.iter().chain(&h).all(|&v| v == 7.0),
            "awaited: {awaited}: written on Err"
        );
        ctx.set_timeout(then);
        assert_eq!(ctx.timeout(), then);
        run(&k, &mut lp, &mut h, awaited).unwrap();
        assert_eq!(f32_bits(&lp), f32_bits(&want_lp), "awaited: {awaited}");
        assert_eq!(f32_bits(&h), f32_bits(&want_h), "awaited: {awaited}");
    }
}
