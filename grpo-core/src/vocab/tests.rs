//! Tests of the row operations against f64 references, error handling, and gradients.

extern crate std;
use super::canon::{BLOCK, LseState, fold_blocks, lse_block};
use super::*;
use crate::Error;
use std::vec;
use std::vec::Vec;

/// SplitMix64: deterministic, dependency-free.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (a, b) = (self.uniform(), self.uniform());
        (-2.0 * a.ln()).sqrt() * (2.0 * core::f64::consts::PI * b).cos()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// N(0, σ²) logits with a few spikes and (optionally) some masked entries.
fn logits(rng: &mut Rng, v: usize, sigma: f64, spikes: usize, masked: usize) -> Vec<f32> {
    let mut z: Vec<f32> = (0..v).map(|_| (sigma * rng.normal()) as f32).collect();
    for _ in 0..spikes {
        let i = rng.below(v);
        z[i] = (12.0 + 8.0 * rng.uniform()) as f32;
    }
    for _ in 0..masked {
        let i = rng.below(v);
        z[i] = f32::NEG_INFINITY;
    }
    z
}

// ---- f64 references -------------------------------------------------------------------------

fn lse64(z: &[f32], t: f64) -> f64 {
    let m = z
        .iter()
        .map(|&x| x as f64 / t)
        .fold(f64::NEG_INFINITY, f64::max);
    m + z
        .iter()
        .map(|&x| (x as f64 / t - m).exp())
        .sum::<f64>()
        .ln()
}

fn logp64(z: &[f32], t: f64) -> Vec<f64> {
    let l = lse64(z, t);
    z.iter().map(|&x| x as f64 / t - l).collect()
}

fn entropy64(z: &[f32], t: f64) -> f64 {
    logp64(z, t)
        .iter()
        .map(|&lp| {
            if lp == f64::NEG_INFINITY {
                0.0
            } else {
                -lp.exp() * lp
            }
        })
        .sum()
}

fn kl64(z: &[f32], w: &[f32], t: f64) -> f64 {
    let (lp, lq) = (logp64(z, t), logp64(w, t));
    lp.iter()
        .zip(&lq)
        .map(|(&a, &b)| {
            if a == f64::NEG_INFINITY {
                0.0
            } else {
                a.exp() * (a - b)
            }
        })
        .sum()
}

fn jsd64(z: &[f32], w: &[f32], beta: f64, t: f64) -> f64 {
    let z64: Vec<f64> = z.iter().map(|&x| x as f64).collect();
    jsd64_of(&z64, w, beta, t)
}

// ---- accuracy -------------------------------------------------------------------------------

#[test]
fn accuracy_against_f64_at_large_vocabularies() {
    let mut rng = Rng(42);
    let mut worst = [0.0f64; 4];
    for &v in &[151_936usize, 262_144] {
        for (k, &t) in [1.0f32, 0.7].iter().enumerate() {
            let z = logits(&mut rng, v, 3.0, 5, 100 * k);
            let w = logits(&mut rng, v, 3.0, 3, 0);
            let t64 = t as f64;
            let st = row_stats(&z, t).unwrap();
            let lp_ref = logp64(&z, t64);
            let h_ref = entropy64(&z, t64);
            let herr = (st.entropy as f64 - h_ref).abs();
            assert!(herr <= 1e-5, "V={v} T={t}: H err {herr:e}");
            worst[1] = worst[1].max(herr);
            // targets: a spike (the argmax), and random tokens
            let argmax = (0..v).max_by(|&a, &b| z[a].total_cmp(&z[b])).unwrap();
            let mut targets = vec![argmax];
            for _ in 0..4 {
                let mut y = rng.below(v);
                while z[y] == f32::NEG_INFINITY {
                    y = rng.below(v);
                }
                targets.push(y);
            }
            for &y in &targets {
                let (lp, h) = logprob_entropy(&z, y, t).unwrap();
                assert_eq!(h.to_bits(), st.entropy.to_bits());
                let err = (lp as f64 - lp_ref[y]).abs();
                let bound = 2e-6 + 1e-6 * lp_ref[y].abs();
                assert!(
                    err <= bound,
                    "V={v} T={t} y={y}: logp err {err:e} > {bound:e}"
                );
                worst[0] = worst[0].max(err / bound);
            }
            // KL between two independent rows (large) and a perturbed copy (small)
            let wz: Vec<f32> = z
                .iter()
                .map(|&x| x + (0.05 * rng.normal()) as f32)
                .collect();
            for other in [&w, &wz] {
                for dir in [KlDirection::StudentTeacher, KlDirection::TeacherStudent] {
                    if dir == KlDirection::StudentTeacher && k == 1 && other == &w {
                        // student masked where the teacher is not: forward is fine,
                    }
                    let got = kl_divergence(&z, other, t, dir);
                    let want = match dir {
                        KlDirection::StudentTeacher => kl64(&z, other, t64),
                        KlDirection::TeacherStudent => kl64(other, &z, t64),
                    };
                    if !want.is_finite() {
                        assert!(matches!(got, Err(Error::NonFinite { .. })));
                        continue;
                    }
                    let got = got.unwrap() as f64;
                    let err = (got - want).abs();
                    assert!(
                        err <= 1e-5 + 1e-6 * want,
                        "V={v} {dir:?}: KL {got} vs {want}"
                    );
                    worst[2] = worst[2].max(err);
                }
                let j = jsd(&z, other, 0.5, t).unwrap() as f64;
                let jr = jsd64(&z, other, 0.5, t64);
                assert!((j - jr).abs() <= 1e-5 + 1e-6 * jr, "JSD {j} vs {jr}");
                worst[3] = worst[3].max((j - jr).abs());
            }
        }
    }
    std::eprintln!(
        "worst: logp err/bound {:.3}, H {:.2e}, KL {:.2e}, JSD {:.2e}",
        worst[0],
        worst[1],
        worst[2],
        worst[3]
    );
}

#[test]
fn lse_is_accurate_for_wide_ranges_and_temperatures() {
    let mut rng = Rng(7);
    for &(v, sigma, t) in &[
        (1000usize, 30.0, 1.0f32),
        (5000, 1.0, 0.05),
        (40_000, 10.0, 3.0),
    ] {
        let z = logits(&mut rng, v, sigma, 2, 10);
        let got = log_sum_exp(&z, t).unwrap() as f64;
        let want = lse64(&z, t as f64);
        assert!(
            (got - want).abs() <= 2e-6 + 2e-7 * want.abs(),
            "{got} vs {want}"
        );
    }
}

#[test]
fn storage_types_give_the_bits_of_their_f32_values() {
    let mut rng = Rng(3);
    let z = logits(&mut rng, 3000, 3.0, 2, 5);
    let zb: Vec<half::bf16> = z.iter().map(|&x| half::bf16::from_f32(x)).collect();
    let zh: Vec<half::f16> = z.iter().map(|&x| half::f16::from_f32(x)).collect();
    let zb32: Vec<f32> = zb.iter().map(|x| x.to_f32()).collect();
    let zh32: Vec<f32> = zh.iter().map(|x| x.to_f32()).collect();
    assert_eq!(row_stats(&zb, 0.9).unwrap(), row_stats(&zb32, 0.9).unwrap());
    assert_eq!(row_stats(&zh, 0.9).unwrap(), row_stats(&zh32, 0.9).unwrap());
    let y = (0..3000).find(|&i| z[i].is_finite()).unwrap();
    assert_eq!(
        token_logprob(&zb, y, 1.0).unwrap().to_bits(),
        token_logprob(&zb32, y, 1.0).unwrap().to_bits()
    );
}

#[test]
fn row_ops_use_the_canonical_fold() {
    let mut rng = Rng(11);
    let v = 3 * BLOCK + 37;
    let z = logits(&mut rng, v, 2.0, 1, 3);
    let tau = 1.0 / 1.3f32;
    let mut prior = f32::NEG_INFINITY;
    let st: LseState = fold_blocks(
        v,
        |a: LseState, b| a.merge(b, tau),
        |a, b| {
            let (st, m) = lse_block(&z[a..b], tau, prior);
            prior = m;
            st
        },
    )
    .unwrap();
    assert_eq!(st, canon::lse_row(&z, tau));
    let (lse, _, h) = canon::finish_lse(&st, tau);
    let got = row_stats(&z, 1.3).unwrap();
    assert_eq!(
        (got.lse.to_bits(), got.entropy.to_bits()),
        (lse.to_bits(), h.to_bits())
    );
    // batched equals single-row, bit for bit
    let mut zz = z.clone();
    zz.extend_from_slice(&z);
    let (mut l2, mut h2) = ([0.0f32; 2], [0.0f32; 2]);
    stats_rows(&zz, v, 1.3, &mut l2, &mut h2).unwrap();
    assert_eq!(l2[1].to_bits(), lse.to_bits());
    assert_eq!(h2[0].to_bits(), h.to_bits());
}

#[test]
fn hand_computed_small_rows() {
    // [ln 1, ln 2, ln 3, ln 4] at T = 1: p = v/10. logp(3) = ln 0.4 = −0.91629073;
    // H = −Σ p ln p = −(0.1 ln 0.1 + 0.2 ln 0.2 + 0.3 ln 0.3 + 0.4 ln 0.4) = 1.27985423
    let z = [0.0f32, 2f32.ln(), 3f32.ln(), 4f32.ln()];
    let (lp, h) = logprob_entropy(&z, 3u32, 1.0).unwrap();
    assert!((lp + 0.916_290_73).abs() < 1e-6, "{lp}");
    assert!((h - 1.279_854_23).abs() < 1e-6, "{h}");
    // T = 2 on [0, 2 ln 3]: z/T = [0, ln 3] → p = [¼, ¾], lse = ln 4
    let st = row_stats(&[0.0f32, 2.0 * 3f32.ln()], 2.0).unwrap();
    assert!((st.lse - 4f32.ln()).abs() < 1e-6);
    // A masked entry changes nothing: [0, −∞, 0] → H = ln 2, logp(0) = −ln 2
    let z = [0.0f32, f32::NEG_INFINITY, 0.0];
    let (lp, h) = logprob_entropy(&z, 0usize, 1.0).unwrap();
    assert!((lp + 2f32.ln()).abs() < 1e-7 && (h - 2f32.ln()).abs() < 1e-7);
    // One-hot after masking: H = 0 exactly, logp = 0 exactly
    let (lp, h) = logprob_entropy(&[f32::NEG_INFINITY, 3.5], 1u32, 1.0).unwrap();
    assert_eq!((lp, h), (0.0, 0.0));
    // KL of identical rows is exactly 0; JSD of disjoint supports is ln 2 for β = ½
    let w = [1.0f32, -2.0, 0.5];
    assert_eq!(
        kl_divergence(&w, &w, 0.8, KlDirection::StudentTeacher).unwrap(),
        0.0
    );
    // JSD_β, β = 0.25, p = [½, ½], q = [¼, ¾]: m = ¼q + ¾p = [0.4375, 0.5625];
    // β Σ q ln(q/m) + (1−β) Σ p ln(p/m) = 0.25·(0.25 ln(0.25/0.4375) + 0.75 ln(0.75/0.5625))
    //   + 0.75·(0.5 ln(0.5/0.4375) + 0.5 ln(0.5/0.5625)) = 0.0092372… computed below in f64
    let r = 0.25 * (0.25 * (0.25f64 / 0.4375).ln() + 0.75 * (0.75f64 / 0.5625).ln())
        + 0.75 * (0.5 * (0.5f64 / 0.4375).ln() + 0.5 * (0.5f64 / 0.5625).ln());
    let j = jsd(&[0.0f32, 0.0], &[0.0f32, 3f32.ln()], 0.25, 1.0).unwrap();
    assert!((j as f64 - r).abs() < 1e-7, "{j} vs {r}");
}

// ---- errors ---------------------------------------------------------------------------------

#[test]
fn invalid_inputs_are_rejected_and_outputs_untouched() {
    let ninf = f32::NEG_INFINITY;
    let good = [0.0f32, 1.0, 2.0, 3.0, 0.5, 0.5, 0.5, 0.5];
    let s = 7.25f32; // sentinel
    let run = |z: &[f32], v: usize, t: &[u32], temp: f32| {
        let (mut lp, mut h) = ([s; 2], [s; 2]);
        let r = logprob_entropy_rows(z, v, t, temp, &mut lp, Some(&mut h));
        if r.is_err() {
            assert_eq!((lp, h), ([s; 2], [s; 2]), "outputs written on {r:?}");
        }
        r
    };
    assert!(run(&good, 4, &[0, 1], 1.0).is_ok());
    for temp in [0.0f32, -1.0, f32::NAN, f32::INFINITY, 1e-40] {
        assert!(matches!(
            run(&good, 4, &[0, 1], temp),
            Err(Error::InvalidParam {
                name: "temperature",
                ..
            })
        ));
    }
    assert!(matches!(
        run(&good, 0, &[0, 1], 1.0),
        Err(Error::InvalidParam { name: "vocab", .. })
    ));
    assert_eq!(
        run(&good[..7], 4, &[0, 1], 1.0),
        Err(Error::LengthMismatch {
            what: "logits",
            expected: 8,
            found: 7
        })
    );
    assert_eq!(
        run(&good, 4, &[0, 4], 1.0),
        Err(Error::TokenOutOfRange {
            index: 1,
            token: 4,
            vocab: 4
        })
    );
    let mut z = good;
    z[6] = f32::NAN;
    assert_eq!(
        run(&z, 4, &[0, 1], 1.0),
        Err(Error::NonFinite {
            what: "logits",
            index: 6
        })
    );
    z[6] = f32::INFINITY;
    assert_eq!(
        run(&z, 4, &[0, 1], 1.0),
        Err(Error::NonFinite {
            what: "logits",
            index: 6
        })
    );
    let z = [0.0f32, 1.0, 2.0, 3.0, ninf, ninf, ninf, ninf];
    assert_eq!(
        run(&z, 4, &[0, 1], 1.0),
        Err(Error::EmptySegment { segment: 1 })
    );
    let z = [0.0f32, 1.0, 2.0, 3.0, 0.0, ninf, 1.0, 1.0];
    assert_eq!(
        run(&z, 4, &[0, 1], 1.0),
        Err(Error::NonFinite {
            what: "logits[target]",
            index: 5
        })
    );
    // max z / T overflows
    let z = [3e38f32, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    assert!(matches!(
        run(&z, 4, &[0, 1], 0.5),
        Err(Error::NonFinite {
            what: "logits / temperature",
            index: 0
        })
    ));
    // the other batched ops leave their outputs untouched too (both of stats_rows')
    let (mut out, mut h) = ([s; 2], [s; 2]);
    let bad = [0.0f32, 1.0, f32::NAN, 0.0];
    let nan_at = |what| Err(Error::NonFinite { what, index: 2 });
    assert_eq!(stats_rows(&bad, 2, 1.0, &mut out, &mut h), nan_at("logits"));
    assert_eq!(
        kl_rows(
            &bad,
            &good[..4],
            2,
            1.0,
            KlDirection::StudentTeacher,
            &mut out
        ),
        nan_at("student")
    );
    assert_eq!(
        jsd_rows(&good[..4], &bad, 2, 0.5, 1.0, &mut out),
        nan_at("teacher")
    );
    assert_eq!(
        (out.map(f32::to_bits), h.map(f32::to_bits)),
        ([s.to_bits(); 2], [s.to_bits(); 2])
    );
    assert!(matches!(
        jsd_rows(&good[..4], &good[..4], 2, 1.0, 1.0, &mut out),
        Err(Error::InvalidParam { name: "beta", .. })
    ));
    assert_eq!(out.map(f32::to_bits), [s.to_bits(); 2]);
    // KL support: teacher masked where the student is not
    let z = [0.0f32, 0.0];
    let w = [0.0f32, ninf];
    assert!(matches!(
        kl_divergence(&z, &w, 1.0, KlDirection::StudentTeacher),
        Err(Error::NonFinite { index: 1, .. })
    ));
    assert!(kl_divergence(&z, &w, 1.0, KlDirection::TeacherStudent).is_ok());
    assert!(matches!(
        kl_divergence(&w, &z, 1.0, KlDirection::TeacherStudent),
        Err(Error::NonFinite { index: 1, .. })
    ));
    assert!(kl_divergence(&z, &w[..1], 1.0, KlDirection::StudentTeacher).is_err());
    // backward: out and logits untouched
    let mut g = [s; 8];
    let terms: GradTerms<'_, u32> = GradTerms {
        logp: Some((&[0, 1], &[1.0, f32::NAN])),
        entropy: None,
        kl: None,
    };
    assert_eq!(
        backward_rows(&good, 4, 1.0, &terms, &mut g),
        Err(Error::NonFinite {
            what: "grad_logp",
            index: 1
        })
    );
    assert_eq!(g, [s; 8]);
    let mut zz = good;
    assert!(backward_rows_in_place(&mut zz, 4, 1.0, &terms).is_err());
    assert_eq!(zz, good);
    let terms: GradTerms<'_, u32> = GradTerms {
        logp: Some((&[0, 9], &[1.0, 1.0])),
        entropy: None,
        kl: None,
    };
    assert!(backward_rows_in_place(&mut zz, 4, 1.0, &terms).is_err());
    assert_eq!(zz, good);
    // `out` needs one element per logit; its length is checked before the targets (9 ≥ V)
    assert_eq!(
        backward_rows(&good, 4, 1.0, &terms, &mut g[..7]),
        Err(Error::LengthMismatch {
            what: "out",
            expected: 8,
            found: 7
        })
    );
    assert_eq!(g.map(f32::to_bits), [s.to_bits(); 8]);
    // The module's order holds for the backward too: the temperature (with the gradients'
    // minimum) before every length, every length before the weights' values.
    for temp in [0.0f32, 1e-7] {
        assert!(matches!(
            backward_rows(&good, 4, temp, &terms, &mut g[..7]),
            Err(Error::InvalidParam {
                name: "temperature",
                ..
            })
        ));
    }
    let w = [0.0f32; 7];
    let terms: GradTerms<'_, u32> = GradTerms {
        logp: Some((&[0, 1], &[1.0, f32::NAN])),
        entropy: None,
        kl: Some(KlTerm {
            teacher: &w,
            grad: &[1.0, 1.0],
            direction: KlDirection::StudentTeacher,
        }),
    };
    assert_eq!(
        backward_rows_in_place(&mut zz, 4, 1.0, &terms),
        Err(Error::LengthMismatch {
            what: "teacher",
            expected: 8,
            found: 7
        })
    );
    assert_eq!(zz, good);
    assert_eq!(g.map(f32::to_bits), [s.to_bits(); 8]);
}

/// One invalid single-row input and the exact error of each family of operations on it:
/// `[row_stats/log_sum_exp/entropy, logprob_entropy/token_logprob, kl_divergence (both
/// directions), jsd]`. `None`: the family is not called (it does not take the bad argument,
/// or accepts it).
struct BadRow {
    label: &'static str,
    z: Vec<f32>,
    w: Vec<f32>,
    y: usize,
    t: f32,
    beta: f32,
    expect: [Option<Error>; 4],
}

/// The error a batched op returns for a [`BadRow`] placed as row 1 of a `[2, V]` batch whose
/// row 0 is valid: element indices (and lengths) move by V, row indices by 1, parameter
/// errors are unchanged.
fn in_row_1(e: Error, v: usize) -> Error {
    match e {
        Error::NonFinite { what, index } => Error::NonFinite {
            what,
            index: index + v,
        },
        Error::EmptySegment { segment } => Error::EmptySegment {
            segment: segment + 1,
        },
        Error::TokenOutOfRange {
            index,
            token,
            vocab,
        } => Error::TokenOutOfRange {
            index: index + 1,
            token,
            vocab,
        },
        Error::LengthMismatch {
            what,
            expected,
            found,
        } => Error::LengthMismatch {
            what,
            expected: expected + v,
            found: found + v,
        },
        e => e,
    }
}

#[test]
fn single_row_errors_are_exact_and_match_the_batched_ops() {
    // The rule (ops.rs, validate): temperature (finite, > 0, then 1/T finite), β (JSD), an
    // empty row (`vocab`), the teacher's length, the target id, then the student row (first
    // NaN/+∞, all −∞ → EmptySegment, max/T overflow → "<row> / temperature"), the teacher
    // row (same checks) and last the target's logit. Single-row ops name the row "logits"
    // alone and "student"/"teacher" in a pair; the batched ops check in the same order.
    let (ninf, nan, inf) = (f32::NEG_INFINITY, f32::NAN, f32::INFINITY);
    let z0 = vec![0.5f32, -1.0, 2.0, 0.0, 1.5];
    let w0 = vec![1.0f32, 0.0, -0.5, 2.0, 0.25];
    let base = || BadRow {
        label: "",
        z: z0.clone(),
        w: w0.clone(),
        y: 2,
        t: 1.0,
        beta: 0.5,
        expect: [None; 4],
    };
    let set = |row: &[f32], i: usize, x: f32| {
        let mut r = row.to_vec();
        r[i] = x;
        r
    };
    let nf = |what, index| Some(Error::NonFinite { what, index });
    // the student row is named "logits" by the one-row ops and "student" by the pair ops
    let student = |index| {
        [
            nf("logits", index),
            nf("logits", index),
            nf("student", index),
            nf("student", index),
        ]
    };
    let all = |e| [Some(e); 4];
    let pair = |e| [None, None, Some(e), Some(e)];
    let bad_t = Error::InvalidParam {
        name: "temperature",
        reason: "must be finite and > 0",
    };
    let empty = Error::InvalidParam {
        name: "vocab",
        reason: "must be > 0",
    };
    let bad_beta = Error::InvalidParam {
        name: "beta",
        reason: "must be in (0, 1) (use kl_divergence for the endpoints)",
    };
    let out_of_range = |token| Error::TokenOutOfRange {
        index: 0,
        token,
        vocab: 5,
    };
    let teacher_len = |found| Error::LengthMismatch {
        what: "teacher",
        expected: 5,
        found,
    };
    let mut cases = vec![
        BadRow {
            label: "NaN student logit",
            z: set(&z0, 3, nan),
            expect: student(3),
            ..base()
        },
        BadRow {
            label: "+inf student logit",
            z: set(&z0, 1, inf),
            expect: student(1),
            ..base()
        },
        BadRow {
            label: "NaN teacher logit",
            w: set(&w0, 4, nan),
            expect: [None, None, nf("teacher", 4), nf("teacher", 4)],
            ..base()
        },
        BadRow {
            label: "+inf teacher logit",
            w: set(&w0, 0, inf),
            expect: [None, None, nf("teacher", 0), nf("teacher", 0)],
            ..base()
        },
        BadRow {
            label: "all -inf student",
            z: vec![ninf; 5],
            expect: all(Error::EmptySegment { segment: 0 }),
            ..base()
        },
        BadRow {
            label: "all -inf teacher",
            w: vec![ninf; 5],
            expect: pair(Error::EmptySegment { segment: 0 }),
            ..base()
        },
        BadRow {
            // finite T whose reciprocal overflows (T < 2^-128)
            label: "T = 1e-40",
            t: 1e-40,
            expect: all(Error::InvalidParam {
                name: "temperature",
                reason: "must be above 2^-128 ≈ 2.9e-39 (1/T must be finite)",
            }),
            ..base()
        },
        BadRow {
            label: "student max / T overflows",
            z: set(&z0, 2, 3e38),
            t: 0.5,
            expect: [
                nf("logits / temperature", 2),
                nf("logits / temperature", 2),
                nf("student / temperature", 2),
                nf("student / temperature", 2),
            ],
            ..base()
        },
        BadRow {
            label: "teacher max / T overflows",
            w: set(&w0, 3, 3e38),
            t: 0.5,
            expect: pair(Error::NonFinite {
                what: "teacher / temperature",
                index: 3,
            }),
            ..base()
        },
        BadRow {
            // the empty check precedes the target's (y = 2 ≥ 0 = V)
            label: "empty rows",
            z: vec![],
            w: vec![],
            expect: all(empty),
            ..base()
        },
        BadRow {
            label: "target = V",
            y: 5,
            expect: [None, Some(out_of_range(5)), None, None],
            ..base()
        },
        BadRow {
            label: "target = usize::MAX",
            y: usize::MAX,
            expect: [None, Some(out_of_range(usize::MAX)), None, None],
            ..base()
        },
        BadRow {
            // a masked target is fine for the other families (and for KL only forward), so
            // only the log-probability is called
            label: "target on a -inf logit",
            z: set(&z0, 2, ninf),
            expect: [None, nf("logits[target]", 2), None, None],
            ..base()
        },
        BadRow {
            label: "teacher shorter",
            w: w0[..4].to_vec(),
            expect: pair(teacher_len(4)),
            ..base()
        },
        BadRow {
            label: "teacher longer",
            w: [&w0[..], &[0.0]].concat(),
            expect: pair(teacher_len(6)),
            ..base()
        },
        // precedence between two bad inputs
        BadRow {
            label: "T before a NaN logit",
            z: set(&z0, 3, nan),
            t: 0.0,
            expect: all(bad_t),
            ..base()
        },
        BadRow {
            label: "beta before an empty row",
            z: vec![],
            w: vec![],
            beta: 1.0,
            expect: [Some(empty), Some(empty), Some(empty), Some(bad_beta)],
            ..base()
        },
        BadRow {
            label: "teacher length before a NaN student",
            z: set(&z0, 3, nan),
            w: w0[..4].to_vec(),
            expect: [
                nf("logits", 3),
                nf("logits", 3),
                Some(teacher_len(4)),
                Some(teacher_len(4)),
            ],
            ..base()
        },
        BadRow {
            label: "target id before a NaN logit",
            z: set(&z0, 3, nan),
            y: 5,
            expect: [
                nf("logits", 3),
                Some(out_of_range(5)),
                nf("student", 3),
                nf("student", 3),
            ],
            ..base()
        },
        BadRow {
            label: "student before teacher",
            z: set(&z0, 4, inf),
            w: set(&w0, 0, nan),
            expect: student(4),
            ..base()
        },
        BadRow {
            label: "row scan before the target's logit",
            z: set(&set(&z0, 2, ninf), 4, nan),
            expect: [None, nf("logits", 4), None, None],
            ..base()
        },
    ];
    for t in [0.0f32, -0.0, -1.0, nan, inf, ninf] {
        cases.push(BadRow {
            label: "T not finite and > 0",
            t,
            expect: all(bad_t),
            ..base()
        });
    }
    for beta in [0.0f32, 1.0, -0.5, 1.5, nan, inf] {
        cases.push(BadRow {
            label: "beta outside (0, 1)",
            beta,
            expect: [None, None, None, Some(bad_beta)],
            ..base()
        });
    }
    // the base inputs are valid, so each case's error comes from what it changes
    let (ok, mut o) = (base(), [0.0f32; 2]);
    let zz = [&z0[..], &z0[..]].concat();
    let ww = [&w0[..], &w0[..]].concat();
    assert!(row_stats(&ok.z, ok.t).is_ok() && logprob_entropy(&ok.z, ok.y, ok.t).is_ok());
    assert!(jsd(&ok.z, &ok.w, ok.beta, ok.t).is_ok());
    assert!(logprob_entropy_rows(&zz, 5, &[0, ok.y], ok.t, &mut o, None).is_ok());
    assert!(jsd_rows(&zz, &ww, 5, ok.beta, ok.t, &mut o).is_ok());
    for dir in [KlDirection::StudentTeacher, KlDirection::TeacherStudent] {
        assert!(kl_divergence(&ok.z, &ok.w, ok.t, dir).is_ok());
        assert!(kl_rows(&zz, &ww, 5, ok.t, dir, &mut o).is_ok());
    }
    let s = 7.25f32; // sentinel
    let untouched = |b: &[f32]| b.iter().all(|x| x.to_bits() == s.to_bits());
    for c in &cases {
        let (l, z, w, t) = (c.label, &c.z[..], &c.w[..], c.t);
        // batch: a valid row 0 (the first V elements of z0, w0), then the bad row
        let v = z.len();
        let zz = [&z0[..v], z].concat();
        let ww = [&w0[..v], w].concat();
        let (mut o1, mut o2) = ([s; 2], [s; 2]);
        let [stats, logp, kl, js] = c.expect;
        if let Some(e) = stats {
            assert_eq!(row_stats(z, t).map(|_| ()), Err(e), "{l}: row_stats");
            assert_eq!(log_sum_exp(z, t).map(|_| ()), Err(e), "{l}: log_sum_exp");
            assert_eq!(entropy(z, t).map(|_| ()), Err(e), "{l}: entropy");
            let got = stats_rows(&zz, v, t, &mut o1, &mut o2);
            assert_eq!(got, Err(in_row_1(e, v)), "{l}: stats_rows");
            assert!(untouched(&o1) && untouched(&o2), "{l}: stats_rows wrote");
        }
        if let Some(e) = logp {
            let y = c.y;
            let got = logprob_entropy(z, y, t).map(|_| ());
            assert_eq!(got, Err(e), "{l}: logprob_entropy");
            assert_eq!(
                token_logprob(z, y, t).map(|_| ()),
                Err(e),
                "{l}: token_logprob"
            );
            let got = logprob_entropy_rows(&zz, v, &[0, y], t, &mut o1, Some(&mut o2));
            assert_eq!(got, Err(in_row_1(e, v)), "{l}: logprob_entropy_rows");
            assert!(
                untouched(&o1) && untouched(&o2),
                "{l}: logprob_entropy_rows wrote"
            );
        }
        for dir in [KlDirection::StudentTeacher, KlDirection::TeacherStudent] {
            let Some(e) = kl else { break };
            let got = kl_divergence(z, w, t, dir).map(|_| ());
            assert_eq!(got, Err(e), "{l}: kl_divergence {dir:?}");
            let got = kl_rows(&zz, &ww, v, t, dir, &mut o1);
            assert_eq!(got, Err(in_row_1(e, v)), "{l}: kl_rows {dir:?}");
            assert!(untouched(&o1), "{l}: kl_rows wrote");
        }
        if let Some(e) = js {
            assert_eq!(jsd(z, w, c.beta, t).map(|_| ()), Err(e), "{l}: jsd");
            let got = jsd_rows(&zz, &ww, v, c.beta, t, &mut o1);
            assert_eq!(got, Err(in_row_1(e, v)), "{l}: jsd_rows");
            assert!(untouched(&o1), "{l}: jsd_rows wrote");
            let sentinel = JsdState {
                beta: s,
                ..JsdState::EMPTY
            };
            let mut st = [sentinel; 2];
            let got = jsd_rows_saved(&zz, &ww, v, c.beta, t, &mut o1, &mut st);
            assert_eq!(got, Err(in_row_1(e, v)), "{l}: jsd_rows_saved");
            assert!(untouched(&o1), "{l}: jsd_rows_saved wrote");
            assert!(st.iter().all(|x| x.beta == s), "{l}: jsd_rows_saved saved");
            // the gradient makes the same checks in the same order (its own come first)
            let mut og = vec![s; zz.len()];
            let got = jsd_backward_rows(&zz, &ww, v, c.beta, t, &[1.0, -1.0], &mut og);
            assert_eq!(got, Err(in_row_1(e, v)), "{l}: jsd_backward_rows");
            assert!(untouched(&og), "{l}: jsd_backward_rows wrote");
            let mut zi = zz.clone();
            let got = jsd_backward_rows_in_place(&mut zi, &ww, v, c.beta, t, &[1.0, -1.0]);
            assert_eq!(got, Err(in_row_1(e, v)), "{l}: jsd_backward_rows_in_place");
            let same = zi.iter().zip(&zz).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{l}: jsd_backward_rows_in_place wrote");
        }
    }
}

// ---- backward -------------------------------------------------------------------------------

/// f64 loss of one row: g_lp·logp(y) + g_h·H + g_kl·KL(dir).
fn loss64(z: &[f64], w: &[f32], y: usize, t: f64, g: [f64; 3], dir: Option<KlDirection>) -> f64 {
    let zf: Vec<f32> = z.iter().map(|&x| x as f32).collect();
    let _ = zf;
    // direct f64 evaluation (not through f32)
    let m = z.iter().map(|&x| x / t).fold(f64::NEG_INFINITY, f64::max);
    let lse = m + z.iter().map(|&x| (x / t - m).exp()).sum::<f64>().ln();
    let lp: Vec<f64> = z.iter().map(|&x| x / t - lse).collect();
    let h: f64 = lp
        .iter()
        .map(|&a| {
            if a == f64::NEG_INFINITY {
                0.0
            } else {
                -a.exp() * a
            }
        })
        .sum();
    let lq = logp64(w, t);
    let kl = match dir {
        None => 0.0,
        Some(KlDirection::StudentTeacher) => {
            lp.iter().zip(&lq).map(|(&a, &b)| a.exp() * (a - b)).sum()
        }
        Some(KlDirection::TeacherStudent) => {
            lp.iter().zip(&lq).map(|(&a, &b)| b.exp() * (b - a)).sum()
        }
    };
    g[0] * lp[y] + g[1] * h + g[2] * kl
}

/// The analytic f64 gradient (the documented formulas).
fn grad64(
    z: &[f32],
    w: &[f32],
    y: usize,
    t: f64,
    g: [f64; 3],
    dir: Option<KlDirection>,
) -> Vec<f64> {
    let lp = logp64(z, t);
    let lq = logp64(w, t);
    let h = entropy64(z, t);
    let kl = match dir {
        Some(KlDirection::StudentTeacher) => kl64(z, w, t),
        _ => 0.0,
    };
    (0..z.len())
        .map(|v| {
            let p = lp[v].exp();
            if p == 0.0 {
                // masked entry: every term carries a factor p (or p − q with q > 0 only
                // where the teacher is unmasked, which the tests avoid)
                return 0.0;
            }
            let mut d = g[0] * (if v == y { 1.0 } else { 0.0 } - p) - g[1] * p * (lp[v] + h);
            d += g[2]
                * match dir {
                    None => 0.0,
                    Some(KlDirection::StudentTeacher) => p * (lp[v] - lq[v] - kl),
                    Some(KlDirection::TeacherStudent) => p - lq[v].exp(),
                };
            d / t
        })
        .collect()
}

#[test]
fn backward_matches_finite_differences_and_the_analytic_form() {
    let mut rng = Rng(5);
    let g = [0.7f32, -0.3, 0.45];
    // Each term alone as well as fused: an absent term must contribute nothing (weight 0,
    // no target). `(logp, entropy, kl)`; the fused sets come first so that the first runs
    // (V = 37, T = 0.8) draw the rows this test always used.
    let (fw, rv) = (
        Some(KlDirection::StudentTeacher),
        Some(KlDirection::TeacherStudent),
    );
    let sets = [
        (true, true, None),
        (true, true, fw),
        (true, true, rv),
        (true, false, None),
        (false, true, None),
        (false, false, fw),
        (false, false, rv),
    ];
    // V = 200 spans 12 full 16-lane chunks and a tail of 8; T = 1 is the unscaled path.
    let runs = [(37usize, 4usize), (200, 150)]
        .into_iter()
        .flat_map(|vy| [0.8f32, 1.0].map(move |t| (vy, t)))
        .flat_map(|(vy, t)| sets.map(move |set| (vy, t, set)));
    for ((v, y), t, (lp_on, h_on, dir)) in runs {
        let ctx = (v, t, lp_on, h_on, dir);
        let on = |b: bool, x: f32| if b { x as f64 } else { 0.0 };
        let g64 = [on(lp_on, g[0]), on(h_on, g[1]), on(dir.is_some(), g[2])];
        let z = logits(&mut rng, v, 1.5, 1, 0);
        let w = logits(&mut rng, v, 1.5, 0, 0);
        let mut out = vec![0.0f32; v];
        let target = [y as u32];
        let terms = GradTerms {
            logp: lp_on.then_some((&target[..], &g[0..1])),
            entropy: h_on.then_some(&g[1..2]),
            kl: dir.map(|d| KlTerm {
                teacher: &w[..],
                grad: &g[2..3],
                direction: d,
            }),
        };
        backward_rows(&z, v, t, &terms, &mut out).unwrap();
        let an = grad64(&z, &w, y, t as f64, g64, dir);
        // The KL(p‖q) gradient p_v (log p_v − log q_v − KL)/T carries KL itself: at a spike
        // (p_v ≈ 1) the log-ratio cancels it and KL's own f32 error (its contract: 1e-5 +
        // 1e-6·KL, see the module docs) is left unscaled; e.g. at V = 37, T = 1, KL alone:
        // KL = 4.0115 off by 1.2e-6, gradient 9.23e-6 vs 9.63e-6.
        let kl_slack: Vec<f64> = match dir {
            Some(KlDirection::StudentTeacher) => {
                let kl = kl64(&z, &w, t as f64);
                let lp = logp64(&z, t as f64);
                let s = g64[2].abs() * (1e-5 + 1e-6 * kl) / t as f64;
                lp.iter().map(|&a| s * a.exp()).collect()
            }
            _ => vec![0.0; v],
        };
        let z64: Vec<f64> = z.iter().map(|&x| x as f64).collect();
        for i in 0..v {
            // central difference of the f64 loss, step 1e-5
            let hstep = 1e-5;
            let mut zp = z64.clone();
            zp[i] += hstep;
            let mut zm = z64.clone();
            zm[i] -= hstep;
            let fd = (loss64(&zp, &w, y, t as f64, g64, dir)
                - loss64(&zm, &w, y, t as f64, g64, dir))
                / (2.0 * hstep);
            assert!(
                (fd - an[i]).abs() < 1e-7 + 1e-6 * an[i].abs(),
                "{ctx:?} FD {fd} vs {}",
                an[i]
            );
            assert!(
                (out[i] as f64 - an[i]).abs() < 2e-7 + 2e-6 * an[i].abs() + kl_slack[i],
                "{ctx:?} v={i}: {} vs {}",
                out[i],
                an[i]
            );
        }
        // in place equals out of place (f32), and bf16 in place is its rounding
        let mut zi = z.clone();
        backward_rows_in_place(&mut zi, v, t, &terms).unwrap();
        assert_eq!(zi, out, "{ctx:?}");
        let mut zb: Vec<half::bf16> = z.iter().map(|&x| half::bf16::from_f32(x)).collect();
        let zb32: Vec<f32> = zb.iter().map(|x| x.to_f32()).collect();
        let mut outb = vec![0.0f32; v];
        backward_rows(&zb32, v, t, &terms, &mut outb).unwrap();
        backward_rows_in_place(&mut zb, v, t, &terms).unwrap();
        for i in 0..v {
            assert_eq!(zb[i], half::bf16::from_f32(outb[i]), "{ctx:?} v={i}");
        }
    }
}

#[test]
fn backward_is_accurate_at_a_large_vocabulary_and_zero_on_masked_entries() {
    let mut rng = Rng(9);
    let v = 151_936;
    let mut z = logits(&mut rng, v, 3.0, 4, 50);
    z[10] = f32::NEG_INFINITY;
    let w = logits(&mut rng, v, 3.0, 2, 0);
    let g = [1.0f32, 0.5, 0.25];
    let terms = GradTerms {
        logp: Some((&[3u32][..], &g[0..1])),
        entropy: Some(&g[1..2]),
        kl: Some(KlTerm {
            teacher: &w[..],
            grad: &g[2..3],
            direction: KlDirection::StudentTeacher,
        }),
    };
    let mut out = vec![0.0f32; v];
    backward_rows(&z, v, 1.0, &terms, &mut out).unwrap();
    let an = grad64(
        &z,
        &w,
        3,
        1.0,
        [1.0, 0.5, 0.25],
        Some(KlDirection::StudentTeacher),
    );
    let mut worst = 0.0f64;
    for i in 0..v {
        let e = (out[i] as f64 - an[i]).abs();
        worst = worst.max(e);
        assert!(
            e <= 1e-7 + 1e-5 * an[i].abs(),
            "v={i}: {} vs {}",
            out[i],
            an[i]
        );
    }
    assert_eq!(out[10], 0.0);
    // the gradient of logp + H + KL w.r.t. logits sums to 0 over the vocabulary (shift
    // invariance of softmax); check in f64
    let sum: f64 = out.iter().map(|&x| x as f64).sum();
    assert!(sum.abs() < 1e-4, "{sum}");
    std::eprintln!("backward worst abs err {worst:e}");
}

/// Both KL directions of a row pair within 1e-5 (+1e-6 relative) of the f64 reference.
fn kl_matches_f64(z: &[f32], w: &[f32], t: f32) {
    let t64 = t as f64;
    for (dir, want) in [
        (KlDirection::StudentTeacher, kl64(z, w, t64)),
        (KlDirection::TeacherStudent, kl64(w, z, t64)),
    ] {
        let got = kl_divergence(z, w, t, dir).unwrap() as f64;
        assert!(
            (got - want).abs() <= 1e-5 + 1e-6 * want,
            "{dir:?} T={t}: {got} vs {want}"
        );
    }
}

#[test]
fn references_below_the_block_maxima_keep_the_accuracy_contract() {
    // Every block's maximum lies just within the slack (7.9 of 8 scaled units) above the
    // running maximum of the blocks before it, so every block after the first keeps a
    // reference below its own maximum, terms reach e^7.9 and the row's merged reference ends
    // 7.9/τ below the row maximum: the worst case for the cancellation in H = L − t/s.
    let mut rng = Rng(5);
    let v = 151_936;
    for t in [1.0f32, 0.7] {
        let t64 = t as f64;
        let step = 7.9 * t;
        let mut z = vec![0.0f32; v];
        for (j, block) in z.chunks_mut(BLOCK).enumerate() {
            let noise: Vec<f32> = block.iter().map(|_| rng.normal() as f32).collect();
            let top = noise.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            // Block j's maximum is j·7.9·T (up to rounding, which the rule does not mind).
            for (x, n) in block.iter_mut().zip(&noise) {
                *x = n - top + j as f32 * step;
            }
        }
        let w: Vec<f32> = z
            .iter()
            .map(|&x| x + (0.05 * rng.normal()) as f32)
            .collect();
        let st = row_stats(&z, t).unwrap();
        let h_ref = entropy64(&z, t64);
        assert!(
            (st.entropy as f64 - h_ref).abs() <= 1e-5,
            "T={t}: H {} vs {h_ref}",
            st.entropy
        );
        let lse_ref = lse64(&z, t64);
        assert!(
            (st.lse as f64 - lse_ref).abs() <= 2e-6 + 1e-6 * lse_ref.abs(),
            "T={t}: lse"
        );
        let lp_ref = logp64(&z, t64);
        for y in [v - 1, v / 2, 17] {
            let lp = token_logprob(&z, y, t).unwrap() as f64;
            let bound = 2e-6 + 1e-6 * lp_ref[y].abs();
            assert!(
                (lp - lp_ref[y]).abs() <= bound,
                "T={t} y={y}: {lp} vs {}",
                lp_ref[y]
            );
        }
        kl_matches_f64(&z, &w, t);
        let j = jsd(&z, &w, 0.5, t).unwrap() as f64;
        let jr = jsd64(&z, &w, 0.5, t64);
        assert!((j - jr).abs() <= 1e-5 + 1e-6 * jr, "JSD {j} vs {jr}");
        // The staircase really keeps the references below the block maxima: the merged
        // reference sits 7.9/τ below the row maximum (within rounding).
        let row = canon::lse_row(&z, 1.0 / t);
        let zmax = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert!(
            ((zmax - row.max) / t - 7.9).abs() < 1e-3,
            "{} {zmax}",
            row.max
        );
    }
}

#[test]
fn merges_across_blocks_with_distant_maxima() {
    // The student's mass sits in block 2, the teacher's in block 0; block 1 is masked in both.
    // Every merge rescales by a factor that underflows, and the log-ratio shifts are large.
    let mut rng = Rng(21);
    let v = 3 * BLOCK + 5;
    let mut z: Vec<f32> = (0..v).map(|_| rng.normal() as f32).collect();
    let mut w: Vec<f32> = (0..v).map(|_| rng.normal() as f32).collect();
    for i in 0..BLOCK {
        w[i] += 40.0;
        z[i] -= 40.0;
    }
    for i in BLOCK..2 * BLOCK {
        z[i] = f32::NEG_INFINITY;
        w[i] = f32::NEG_INFINITY;
    }
    for i in 2 * BLOCK..v {
        z[i] += 30.0;
    }
    for t in [1.0f32, 2.5] {
        let t64 = t as f64;
        kl_matches_f64(&z, &w, t);
        let st = row_stats(&z, t).unwrap();
        assert!((st.entropy as f64 - entropy64(&z, t64)).abs() <= 1e-5);
        assert!((st.lse as f64 - lse64(&z, t64)).abs() <= 2e-6 + 1e-7 * lse64(&z, t64).abs());
        let j = jsd(&z, &w, 0.3, t).unwrap() as f64;
        let jr = jsd64(&z, &w, 0.3, t64);
        assert!((j - jr).abs() <= 1e-5 + 1e-6 * jr, "JSD {j} vs {jr}");
    }
}

#[test]
fn tiny_temperatures_and_huge_scaled_logits_stay_finite() {
    // Found by the fuzzer: with T = 2.9e-11, z·τ ≈ 6.7e11 whose rounding residual (up to
    // 32768) used to reach exp as a positive argument. Differences are now taken before τ.
    let t = 2.922_502_9e-11f32;
    for z in [
        &[19.670_816f32][..],
        &[19.670_816, 19.0, f32::NEG_INFINITY, -1e30][..],
    ] {
        let st = row_stats(z, t).unwrap();
        assert!(st.lse.is_finite() && st.entropy.is_finite());
        // the maximum dominates completely: H = 0, lse = z_max/T (within f32 rounding)
        assert_eq!(st.entropy, 0.0);
        let want = z[0] as f64 / t as f64;
        assert!(
            (st.lse as f64 - want).abs() <= want * 1e-7,
            "{} vs {want}",
            st.lse
        );
        let lp = token_logprob(z, 0u32, t).unwrap();
        assert_eq!(lp, 0.0);
        let mut g = vec![1.0f32; z.len()];
        let terms: GradTerms<'_, u32> = GradTerms {
            logp: Some((&[0], &[1.0])),
            entropy: Some(&[1.0]),
            kl: None,
        };
        // 1/T ≈ 3.4e10 exceeds the backward's bound: refused, buffer untouched
        assert!(matches!(
            backward_rows(z, z.len(), t, &terms, &mut g),
            Err(Error::InvalidParam {
                name: "temperature",
                ..
            })
        ));
        assert!(g.iter().all(|&x| x == 1.0));
        backward_rows(z, z.len(), MIN_GRAD_TEMPERATURE, &terms, &mut g).unwrap();
        assert!(g.iter().all(|x| x.is_finite()), "{g:?}");
    }
}

#[test]
fn saved_states_give_the_forward_and_backward_bits() {
    let mut rng = Rng(31);
    // V: a tail only, whole chunks and a tail, several blocks with masked entries and a spike
    // (so that some blocks take the row's running maximum as their reference).
    for (v, masked) in [(5usize, 0usize), (67, 3), (2 * BLOCK + 77, 40)] {
        for t in [1.0f32, 0.7] {
            let rows = 3;
            let z: Vec<f32> = (0..rows)
                .flat_map(|_| logits(&mut rng, v, 2.0, 2, masked))
                .collect();
            // a finite target in every row
            let y: Vec<u32> = (0..rows)
                .map(|r| {
                    let row = &z[r * v..(r + 1) * v];
                    row.iter().position(|x| x.is_finite()).unwrap() as u32
                })
                .collect();
            let ctx = (v, t);
            let (mut lp, mut h) = (vec![0.0f32; rows], vec![0.0f32; rows]);
            let (mut lp2, mut h2) = (vec![0.0f32; rows], vec![0.0f32; rows]);
            let mut saved = vec![LseState::EMPTY; rows];
            logprob_entropy_rows(&z, v, &y, t, &mut lp, Some(&mut h)).unwrap();
            logprob_entropy_rows_saved(&z, v, &y, t, &mut lp2, Some(&mut h2), &mut saved).unwrap();
            assert_eq!((&lp, &h), (&lp2, &h2), "{ctx:?}");
            let tau = 1.0 / t;
            for r in 0..rows {
                assert_eq!(
                    saved[r],
                    canon::lse_row(&z[r * v..(r + 1) * v], tau),
                    "{ctx:?}"
                );
            }
            // the state does not depend on whether the entropies are written
            let mut saved2 = vec![LseState::EMPTY; rows];
            logprob_entropy_rows_saved(&z, v, &y, t, &mut lp2, None, &mut saved2).unwrap();
            assert_eq!(saved, saved2, "{ctx:?}");
            let g_lp = [-1.0f32, 0.5, 2.0];
            let g_h = [-0.01f32, 0.3, 0.0];
            let all = [
                (Some((&y[..], &g_lp[..])), Some(&g_h[..])),
                (Some((&y[..], &g_lp[..])), None),
                (None, Some(&g_h[..])),
                (None, None),
            ];
            for (logp, entropy) in all {
                let terms: GradTerms<'_, u32> = GradTerms {
                    logp,
                    entropy,
                    kl: None,
                };
                let (mut g, mut g2) = (vec![7.0f32; rows * v], vec![9.0f32; rows * v]);
                backward_rows(&z, v, t, &terms, &mut g).unwrap();
                backward_rows_saved(&z, v, t, &saved, &terms, &mut g2).unwrap();
                let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&g), bits(&g2), "{ctx:?}");
                let mut zi = z.clone();
                backward_rows_in_place_saved(&mut zi, v, t, &saved, &terms).unwrap();
                assert_eq!(bits(&zi), bits(&g), "{ctx:?}");
                // bf16 logits: their own states, the in-place rounding of the f32 gradient
                let zb: Vec<half::bf16> = z.iter().map(|&x| half::bf16::from_f32(x)).collect();
                let mut sb = vec![LseState::EMPTY; rows];
                logprob_entropy_rows_saved(&zb, v, &y, t, &mut lp2, None, &mut sb).unwrap();
                let (mut gb, mut zbi) = (vec![0.0f32; rows * v], zb.clone());
                backward_rows(&zb, v, t, &terms, &mut gb).unwrap();
                backward_rows_in_place_saved(&mut zbi, v, t, &sb, &terms).unwrap();
                let rounded: Vec<half::bf16> =
                    gb.iter().map(|&x| half::bf16::from_f32(x)).collect();
                assert_eq!(zbi, rounded, "{ctx:?}");
            }
        }
    }
    // and against the f64 analytic gradient on one row (logp and entropy terms)
    let (v, y, t) = (300usize, 17usize, 0.8f32);
    let z = logits(&mut rng, v, 1.5, 1, 2);
    let (mut lp, mut saved) = ([0.0f32], [LseState::EMPTY]);
    logprob_entropy_rows_saved(&z, v, &[y as u32], t, &mut lp, None, &mut saved).unwrap();
    let terms: GradTerms<'_, u32> = GradTerms {
        logp: Some((&[y as u32], &[0.7])),
        entropy: Some(&[-0.3]),
        kl: None,
    };
    let mut g = vec![0.0f32; v];
    backward_rows_saved(&z, v, t, &saved, &terms, &mut g).unwrap();
    let an = grad64(&z, &z, y, t as f64, [0.7, -0.3, 0.0], None);
    for i in 0..v {
        assert!(
            (g[i] as f64 - an[i]).abs() < 2e-7 + 2e-6 * an[i].abs(),
            "v={i}: {} vs {}",
            g[i],
            an[i]
        );
    }
}

#[test]
fn saved_state_backward_rejects_invalid_inputs_and_leaves_outputs_untouched() {
    let good = [0.0f32, 1.0, 2.0, 3.0, 0.5, 0.5, 0.5, f32::NEG_INFINITY];
    let s = 7.25f32; // sentinel
    let mut saved = [LseState::EMPTY; 2];
    let (mut lp, mut h) = ([0.0f32; 2], [0.0f32; 2]);
    logprob_entropy_rows_saved(&good, 4, &[0u32, 1], 1.0, &mut lp, Some(&mut h), &mut saved)
        .unwrap();
    // The forward: `saved_out`'s length, after the other outputs'; nothing written on `Err`.
    let mut short = [LseState::EMPTY; 1];
    let (mut lp, mut h) = ([s; 2], [s; 2]);
    assert_eq!(
        logprob_entropy_rows_saved(&good, 4, &[0u32, 1], 1.0, &mut lp, Some(&mut h), &mut short),
        Err(Error::LengthMismatch {
            what: "saved_out",
            expected: 2,
            found: 1
        })
    );
    assert_eq!((lp, h, short), ([s; 2], [s; 2], [LseState::EMPTY]));
    assert_eq!(
        logprob_entropy_rows_saved(&good, 4, &[0u32, 1], 1.0, &mut lp[..1], None, &mut short),
        Err(Error::LengthMismatch {
            what: "logp_out",
            expected: 2,
            found: 1
        })
    );
    // The backward: every error leaves `out` and (in place) the logits untouched.
    let check = |z: &[f32], v: usize, t: f32, st: &[LseState], terms: &GradTerms<'_, u32>| {
        let mut out = vec![s; z.len()];
        let r = backward_rows_saved(z, v, t, st, terms, &mut out);
        let mut zi = z.to_vec();
        let ri = backward_rows_in_place_saved(&mut zi, v, t, st, terms);
        if r.is_err() {
            assert!(out.iter().all(|x| x.to_bits() == s.to_bits()), "{r:?}");
        }
        if ri.is_err() {
            let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&zi), bits(z), "{ri:?}");
        }
        // `out`'s length is the only check the two forms do not share
        if z.len() == out.len() {
            assert_eq!(r, ri);
        }
        r
    };
    let lp_terms = |y: &'static [u32], g: &'static [f32]| GradTerms::<'static, u32> {
        logp: Some((y, g)),
        entropy: None,
        kl: None,
    };
    let terms = lp_terms(&[0, 1], &[1.0, -1.0]);
    assert!(check(&good, 4, 1.0, &saved, &terms).is_ok());
    for t in [0.0f32, f32::NAN, 1e-7] {
        assert!(matches!(
            check(&good, 4, t, &saved, &terms),
            Err(Error::InvalidParam {
                name: "temperature",
                ..
            })
        ));
    }
    assert!(matches!(
        check(&good, 0, 1.0, &saved, &terms),
        Err(Error::InvalidParam { name: "vocab", .. })
    ));
    assert_eq!(
        check(&good[..7], 4, 1.0, &saved, &terms),
        Err(Error::LengthMismatch {
            what: "logits",
            expected: 4,
            found: 7
        })
    );
    let mut out = [s; 7];
    assert_eq!(
        backward_rows_saved(&good, 4, 1.0, &saved, &terms, &mut out),
        Err(Error::LengthMismatch {
            what: "out",
            expected: 8,
            found: 7
        })
    );
    assert_eq!(out.map(f32::to_bits), [s.to_bits(); 7]);
    assert_eq!(
        check(&good, 4, 1.0, &saved[..1], &terms),
        Err(Error::LengthMismatch {
            what: "saved",
            expected: 2,
            found: 1
        })
    );
    let teacher = good;
    let with_kl: GradTerms<'_, u32> = GradTerms {
        logp: None,
        entropy: None,
        kl: Some(KlTerm {
            teacher: &teacher,
            grad: &[1.0, 1.0],
            direction: KlDirection::StudentTeacher,
        }),
    };
    let mut out = [s; 8];
    assert!(matches!(
        backward_rows_saved(&good, 4, 1.0, &saved, &with_kl, &mut out),
        Err(Error::InvalidParam { name: "kl", .. })
    ));
    assert_eq!(out.map(f32::to_bits), [s.to_bits(); 8]);
    assert_eq!(
        check(&good, 4, 1.0, &saved, &lp_terms(&[0], &[1.0, 1.0])),
        Err(Error::LengthMismatch {
            what: "targets",
            expected: 2,
            found: 1
        })
    );
    assert_eq!(
        check(&good, 4, 1.0, &saved, &lp_terms(&[0, 1], &[1.0, f32::NAN])),
        Err(Error::NonFinite {
            what: "grad_logp",
            index: 1
        })
    );
    assert!(matches!(
        check(&good, 4, 1.0, &saved, &lp_terms(&[0, 1], &[2e9, 1.0])),
        Err(Error::InvalidParam {
            name: "grad_logp",
            ..
        })
    ));
    assert_eq!(
        check(&good, 4, 1.0, &saved, &lp_terms(&[0, 4], &[1.0, 1.0])),
        Err(Error::TokenOutOfRange {
            index: 1,
            token: 4,
            vocab: 4
        })
    );
    // the states, row by row: not finite, or not a forward's
    let bad = |f: fn(&mut LseState)| {
        let mut st = saved;
        f(&mut st[1]);
        st
    };
    for f in [
        (|s: &mut LseState| s.max = f32::NAN) as fn(&mut LseState),
        |s| s.max = f32::NEG_INFINITY,
        |s| s.sum = f32::INFINITY,
        |s| s.dot = f32::NAN,
        |s| s.sum = 0.0,
        |s| s.max = 3e38,
    ] {
        let st = bad(f);
        let t = if st[1].max == 3e38 { 0.5 } else { 1.0 }; // 3e38 / 0.5 overflows
        assert_eq!(
            check(&good, 4, t, &st, &terms),
            Err(Error::NonFinite {
                what: "saved",
                index: 1
            }),
            "{:?}",
            st[1]
        );
    }
    for f in [
        (|s: &mut LseState| s.sum = 0.25) as fn(&mut LseState),
        |s| s.dot = -1e30,
    ] {
        assert!(matches!(
            check(&good, 4, 1.0, &bad(f), &terms),
            Err(Error::InvalidParam { name: "saved", .. })
        ));
    }
    // a masked target (row 1, element 3) is the only logit the checks read
    assert_eq!(
        check(&good, 4, 1.0, &saved, &lp_terms(&[0, 3], &[1.0, 1.0])),
        Err(Error::NonFinite {
            what: "logits[target]",
            index: 7
        })
    );
    // Documented: the other logits are not validated. A NaN gives a NaN gradient, not an error.
    let mut z = good;
    z[2] = f32::NAN;
    let mut out = [s; 8];
    assert!(backward_rows_saved(&z, 4, 1.0, &saved, &terms, &mut out).is_ok());
    assert!(out[2].is_nan() && out[4..].iter().all(|x| x.is_finite()));
    // A +∞ logit (as any whose log-probability exceeds 88) enters the exponential as 88
    // (`exp_ln::clamp_grad_arg`): with g_lp = 1 and no other term its (non-target) gradient
    // is −e^88, and every other element is that of the unchanged logits.
    z[2] = f32::INFINITY;
    backward_rows_saved(&z, 4, 1.0, &saved, &terms, &mut out).unwrap();
    let e88 = exp_ln::exp(exp_ln::D_MAX);
    assert_eq!(out[2], -e88);
    assert!((f64::from(e88) / libm::exp(88.0) - 1.0).abs() < 1e-6);
    let mut base = [s; 8];
    backward_rows_saved(&good, 4, 1.0, &saved, &terms, &mut base).unwrap();
    for i in (0..8).filter(|&i| i != 2) {
        assert_eq!(out[i].to_bits(), base[i].to_bits(), "{i}");
    }
}

/// Student and teacher rows (`rows × v`) with the same masked entries, so that both KL
/// directions have support, and a finite target in every row.
fn pair_batch(
    rng: &mut Rng,
    rows: usize,
    v: usize,
    masked: usize,
) -> (Vec<f32>, Vec<f32>, Vec<u32>) {
    let z: Vec<f32> = (0..rows)
        .flat_map(|_| logits(rng, v, 2.0, 2, masked))
        .collect();
    let mut w: Vec<f32> = (0..rows).flat_map(|_| logits(rng, v, 3.0, 1, 0)).collect();
    for (b, a) in w.iter_mut().zip(&z) {
        if *a == f32::NEG_INFINITY {
            *b = f32::NEG_INFINITY;
        }
    }
    let y = (0..rows)
        .map(|r| {
            z[r * v..(r + 1) * v]
                .iter()
                .position(|x| x.is_finite())
                .unwrap() as u32
        })
        .collect();
    (z, w, y)
}

#[test]
fn pair_states_give_the_kl_student_teacher_and_backward_bits() {
    let mut rng = Rng(37);
    let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (v, masked) in [(5usize, 0usize), (67, 3), (2 * BLOCK + 77, 40)] {
        for t in [1.0f32, 0.7] {
            let rows = 3;
            let (z, w, y) = pair_batch(&mut rng, rows, v, masked);
            let ctx = (v, t);
            let tau = 1.0 / t;
            // The saving forward: kl_rows' bits, and the same full state in either direction.
            let mut states = Vec::new();
            for d in [KlDirection::StudentTeacher, KlDirection::TeacherStudent] {
                let (mut kl, mut kl2) = (vec![0.0f32; rows], vec![0.0f32; rows]);
                let mut saved = vec![PairState::EMPTY; rows];
                kl_rows(&z, &w, v, t, d, &mut kl).unwrap();
                kl_rows_saved(&z, &w, v, t, d, &mut kl2, &mut saved).unwrap();
                assert_eq!(bits(&kl), bits(&kl2), "{ctx:?} {d:?}");
                for r in 0..rows {
                    let (zr, wr) = (&z[r * v..(r + 1) * v], &w[r * v..(r + 1) * v]);
                    assert_eq!(saved[r], canon::pair_row(zr, wr, tau), "{ctx:?}");
                    // its student half is the student row's own state
                    assert_eq!(saved[r].student(), canon::lse_row(zr, tau), "{ctx:?}");
                }
                states.push(saved);
            }
            assert_eq!(states[0], states[1], "{ctx:?}");
            let saved = &states[0];
            // The student's log-probabilities and entropies from the pair states (as the
            // documentation of kl_rows_saved derives them): logprob_entropy_rows' bits.
            let (mut lp, mut h) = (vec![0.0f32; rows], vec![0.0f32; rows]);
            logprob_entropy_rows(&z, v, &y, t, &mut lp, Some(&mut h)).unwrap();
            for r in 0..rows {
                let st = saved[r].student();
                let zy = z[r * v + y[r] as usize];
                assert_eq!(canon::logp_of(zy, tau, &st).to_bits(), lp[r].to_bits());
                assert_eq!(canon::finish_lse(&st, tau).2.to_bits(), h[r].to_bits());
            }
            let g_lp = [-1.0f32, 0.5, 2.0];
            let g_h = [-0.01f32, 0.3, 0.0];
            let g_kl = [0.4f32, -1.5, 1.0];
            let logps = [Some((&y[..], &g_lp[..])), None];
            let entropies = [Some(&g_h[..]), None];
            let kls = [
                None,
                Some(KlDirection::StudentTeacher),
                Some(KlDirection::TeacherStudent),
            ];
            for (logp, entropy, kl) in itertools3(&logps, &entropies, &kls) {
                let terms: GradTerms<'_, u32> = GradTerms {
                    logp,
                    entropy,
                    kl: kl.map(|direction| KlTerm {
                        teacher: &w[..],
                        grad: &g_kl[..],
                        direction,
                    }),
                };
                let what = (ctx, logp.is_some(), entropy.is_some(), kl);
                let (mut g, mut g2) = (vec![7.0f32; rows * v], vec![9.0f32; rows * v]);
                backward_rows(&z, v, t, &terms, &mut g).unwrap();
                backward_rows_saved(&z, v, t, saved, &terms, &mut g2).unwrap();
                assert_eq!(bits(&g), bits(&g2), "{what:?}");
                let mut zi = z.clone();
                backward_rows_in_place_saved(&mut zi, v, t, saved, &terms).unwrap();
                assert_eq!(bits(&zi), bits(&g), "{what:?}");
            }
        }
    }
    // bf16 student, f32 teacher: the saved state of the mixed pair, the in-place rounding
    let (v, t) = (300usize, 0.8f32);
    let (z, w, y) = pair_batch(&mut rng, 2, v, 4);
    let zb: Vec<half::bf16> = z.iter().map(|&x| half::bf16::from_f32(x)).collect();
    let mut saved = vec![PairState::EMPTY; 2];
    let mut kl = [0.0f32; 2];
    kl_rows_saved(
        &zb,
        &w,
        v,
        t,
        KlDirection::StudentTeacher,
        &mut kl,
        &mut saved,
    )
    .unwrap();
    let terms: GradTerms<'_, u32> = GradTerms {
        logp: Some((&y, &[0.7, -0.2])),
        entropy: Some(&[-0.3, 0.1]),
        kl: Some(KlTerm {
            teacher: &w,
            grad: &[0.45, 1.0],
            direction: KlDirection::StudentTeacher,
        }),
    };
    let (mut gb, mut zbi) = (vec![0.0f32; 2 * v], zb.clone());
    backward_rows(&zb, v, t, &terms, &mut gb).unwrap();
    backward_rows_in_place_saved(&mut zbi, v, t, &saved, &terms).unwrap();
    let rounded: Vec<half::bf16> = gb.iter().map(|&x| half::bf16::from_f32(x)).collect();
    assert_eq!(zbi, rounded);
    // and against the f64 analytic gradient on one row, each KL direction with the other terms
    let (z, w, y) = pair_batch(&mut rng, 1, v, 2);
    let y = y[0] as usize;
    for d in [KlDirection::StudentTeacher, KlDirection::TeacherStudent] {
        let mut saved = [PairState::EMPTY];
        kl_rows_saved(&z, &w, v, t, d, &mut [0.0], &mut saved).unwrap();
        let terms: GradTerms<'_, u32> = GradTerms {
            logp: Some((&[y as u32], &[0.7])),
            entropy: Some(&[-0.3]),
            kl: Some(KlTerm {
                teacher: &w,
                grad: &[0.45],
                direction: d,
            }),
        };
        let mut g = vec![0.0f32; v];
        backward_rows_saved(&z, v, t, &saved, &terms, &mut g).unwrap();
        let an = grad64(&z, &w, y, t as f64, [0.7, -0.3, 0.45], Some(d));
        for i in 0..v {
            assert!(
                (g[i] as f64 - an[i]).abs() < 2e-7 + 2e-6 * an[i].abs(),
                "{d:?} v={i}: {} vs {}",
                g[i],
                an[i]
            );
        }
    }
}

/// Every combination of one item of each slice, in order.
fn itertools3<'a, A: Copy, B: Copy, C: Copy>(
    a: &'a [A],
    b: &'a [B],
    c: &'a [C],
) -> impl Iterator<Item = (A, B, C)> + 'a {
    a.iter().flat_map(move |&x| {
        b.iter()
            .flat_map(move |&y| c.iter().map(move |&z| (x, y, z)))
    })
}

#[test]
fn pair_state_backward_rejects_invalid_inputs_and_leaves_outputs_untouched() {
    let s = 7.25f32; // sentinel
    let z = [0.0f32, 1.0, 2.0, 3.0, 0.5, 0.5, 0.5, f32::NEG_INFINITY];
    let w = [1.0f32, 0.0, 2.0, -1.0, 0.5, 1.5, -0.5, f32::NEG_INFINITY];
    let fwd = KlDirection::StudentTeacher;
    // The forward: `saved_out`'s length after the rows'; nothing written on `Err`.
    let (mut kl, mut short) = ([s; 2], [PairState::EMPTY; 1]);
    assert_eq!(
        kl_rows_saved(&z, &w, 4, 1.0, fwd, &mut kl, &mut short),
        Err(Error::LengthMismatch {
            what: "saved_out",
            expected: 2,
            found: 1
        })
    );
    assert_eq!(
        kl_rows_saved(&z, &w[..7], 4, 1.0, fwd, &mut kl, &mut short),
        Err(Error::LengthMismatch {
            what: "teacher",
            expected: 8,
            found: 7
        })
    );
    assert_eq!(
        (kl.map(f32::to_bits), short),
        ([s.to_bits(); 2], [PairState::EMPTY])
    );
    // a support violation of the direction asked for only
    let mut w_masked = w;
    w_masked[1] = f32::NEG_INFINITY;
    let mut saved = [PairState::EMPTY; 2];
    assert!(kl_rows_saved(&z, &w_masked, 4, 1.0, fwd, &mut kl, &mut saved).is_err());
    assert_eq!(
        (kl.map(f32::to_bits), saved),
        ([s.to_bits(); 2], [PairState::EMPTY; 2])
    );
    let rev = KlDirection::TeacherStudent;
    kl_rows_saved(&z, &w_masked, 4, 1.0, rev, &mut kl, &mut saved).unwrap();
    kl_rows_saved(&z, &w, 4, 1.0, fwd, &mut kl, &mut saved).unwrap();

    let check = |st: &[PairState], terms: &GradTerms<'_, u32>| {
        let mut out = [s; 8];
        let r = backward_rows_saved(&z, 4, 1.0, st, terms, &mut out);
        let mut zi = z;
        let ri = backward_rows_in_place_saved(&mut zi, 4, 1.0, st, terms);
        assert_eq!(r, ri);
        if r.is_err() {
            assert_eq!(out.map(f32::to_bits), [s.to_bits(); 8], "{r:?}");
            assert_eq!(zi.map(f32::to_bits), z.map(f32::to_bits), "{r:?}");
        }
        r
    };
    let kl_terms = |teacher: &'static [f32], g: &'static [f32]| GradTerms::<'static, u32> {
        logp: Some((&[2, 0], &[1.0, 1.0])),
        entropy: Some(&[0.5, 0.5]),
        kl: Some(KlTerm {
            teacher,
            grad: g,
            direction: KlDirection::StudentTeacher,
        }),
    };
    static W: [f32; 8] = [1.0, 0.0, 2.0, -1.0, 0.5, 1.5, -0.5, f32::NEG_INFINITY];
    assert!(check(&saved, &kl_terms(&W, &[1.0, -1.0])).is_ok());
    assert_eq!(
        check(&saved[..1], &kl_terms(&W, &[1.0, -1.0])),
        Err(Error::LengthMismatch {
            what: "saved",
            expected: 2,
            found: 1
        })
    );
    assert_eq!(
        check(&saved, &kl_terms(&W[..4], &[1.0, -1.0])),
        Err(Error::LengthMismatch {
            what: "teacher",
            expected: 8,
            found: 4
        })
    );
    assert_eq!(
        check(&saved, &kl_terms(&W, &[1.0])),
        Err(Error::LengthMismatch {
            what: "grad_kl",
            expected: 2,
            found: 1
        })
    );
    assert_eq!(
        check(&saved, &kl_terms(&W, &[1.0, f32::INFINITY])),
        Err(Error::NonFinite {
            what: "grad_kl",
            index: 1
        })
    );
    // the states, row by row: either half, or the KL values, not finite or not a forward's
    let bad = |f: fn(&mut PairState)| {
        let mut st = saved;
        f(&mut st[1]);
        st
    };
    let terms = kl_terms(&W, &[1.0, -1.0]);
    for f in [
        (|s: &mut PairState| s.zmax = f32::NAN) as fn(&mut PairState),
        |s| s.tz = f32::INFINITY,
        |s| s.wmax = f32::NEG_INFINITY,
        |s| s.tw = f32::NAN,
        |s| s.u = f32::NAN,
        |s| s.v = f32::INFINITY,
    ] {
        let st = bad(f);
        assert_eq!(
            check(&st, &terms),
            Err(Error::NonFinite {
                what: "saved",
                index: 1
            }),
            "{:?}",
            st[1]
        );
    }
    for f in [
        (|s: &mut PairState| s.sz = 0.25) as fn(&mut PairState),
        |s| s.sw = 0.25,
        |s| s.tw = -1e30,
        |s| s.u = 1e30,
    ] {
        let st = bad(f);
        assert!(
            matches!(
                check(&st, &terms),
                Err(Error::InvalidParam { name: "saved", .. })
            ),
            "{:?}",
            st[1]
        );
    }
    // the KL bound: 2^65 accepted, the next float above it not (u/s_z with s_z = 1, equal sums)
    let edge = |u: f32| PairState {
        zmax: 0.0,
        sz: 1.0,
        tz: 0.0,
        wmax: 0.0,
        sw: 1.0,
        tw: 0.0,
        u,
        v: 0.0,
    };
    assert_eq!(validate::saved(&edge(MAX_SAVED_KL), 1.0, 0), Ok(()));
    assert!(validate::saved(&edge(MAX_SAVED_KL.next_up()), 1.0, 0).is_err());
    assert_eq!(MAX_SAVED_KL, 2f32.powi(65));
    // a pair state serves the terms without a KL term too; an LseState no KL term
    let lse: Vec<LseState> = saved.iter().map(|p| p.student()).collect();
    assert!(matches!(
        backward_rows_saved(&z, 4, 1.0, &lse, &terms, &mut [s; 8]),
        Err(Error::InvalidParam { name: "kl", .. })
    ));
    let no_kl = GradTerms::<'_, u32> { kl: None, ..terms };
    let (mut a, mut b) = ([0.0f32; 8], [1.0f32; 8]);
    backward_rows_saved(&z, 4, 1.0, &saved, &no_kl, &mut a).unwrap();
    backward_rows_saved(&z, 4, 1.0, &lse, &no_kl, &mut b).unwrap();
    assert_eq!(a.map(f32::to_bits), b.map(f32::to_bits));
}

// ---- JSD gradient ---------------------------------------------------------------------------

/// f64 JSD_β of f64 student logits (the loss the finite differences differentiate).
fn jsd64_of(z: &[f64], w: &[f32], beta: f64, t: f64) -> f64 {
    let m = z.iter().map(|&x| x / t).fold(f64::NEG_INFINITY, f64::max);
    let lse = m + z.iter().map(|&x| (x / t - m).exp()).sum::<f64>().ln();
    let lq = logp64(w, t);
    let mut s = 0.0;
    for (&x, &b) in z.iter().zip(&lq) {
        let a = x / t - lse;
        let (p, q) = (a.exp(), b.exp());
        let mix = beta * q + (1.0 - beta) * p;
        if q > 0.0 {
            s += beta * q * (b - mix.ln());
        }
        if p > 0.0 {
            s += (1.0 - beta) * p * (a - mix.ln());
        }
    }
    s
}

/// The documented f64 gradient `(1 − β)·p_v·(log p_v − log m_v − KL(p‖m))/T`, times `g`, and
/// the f32 error it allows per element: the difference `log p_v − log m_v` is taken between
/// two f32 values of magnitude up to |log p_v| (each a few ULP off), and `K` carries a sum's
/// error; both are absolute errors that `p_v·(1 − β)·g/T` scales. Log p_v's own error is a
/// relative error of p_v.
fn jsd_grad64(z: &[f32], w: &[f32], beta: f64, t: f64, g: f64) -> (Vec<f64>, Vec<f64>) {
    let (lp, lq) = (logp64(z, t), logp64(w, t));
    let lm: Vec<f64> = lp
        .iter()
        .zip(&lq)
        .map(|(&a, &b)| (beta * b.exp() + (1.0 - beta) * a.exp()).ln())
        .collect();
    let k: f64 = (0..z.len())
        .filter(|&v| lp[v] > f64::NEG_INFINITY)
        .map(|v| lp[v].exp() * (lp[v] - lm[v]))
        .sum();
    let c = g * (1.0 - beta) / t;
    (0..z.len())
        .map(|v| {
            let p = lp[v].exp();
            if p == 0.0 {
                (0.0, 0.0)
            } else {
                let d = c * p * (lp[v] - lm[v] - k);
                // p_v itself is e^(log p_v) with log p_v's absolute error: relative
                let rel = 2e-6 + 2e-7 * lp[v].abs();
                (
                    d,
                    c.abs() * p * 1e-6 * (1.0 + lp[v].abs() + k) + rel * d.abs(),
                )
            }
        })
        .unzip()
}

#[test]
fn jsd_backward_matches_finite_differences_and_the_analytic_form() {
    let mut rng = Rng(17);
    let g = -0.65f32;
    // V = 200: 12 whole 16-lane chunks and a tail of 8; masked entries in either row (a
    // masked teacher entry has a finite, non-zero gradient)
    for (v, masked_z, masked_w) in [(37usize, 0usize, 0usize), (200, 3, 4)] {
        for t in [0.8f32, 1.0] {
            for beta in [0.1f32, 0.5, 0.9] {
                let ctx = (v, t, beta);
                let z = logits(&mut rng, v, 1.5, 1, masked_z);
                let w = logits(&mut rng, v, 1.5, 1, masked_w);
                let mut out = vec![7.25f32; 2 * v];
                let (zz, ww) = ([&z[..], &z[..]].concat(), [&w[..], &w[..]].concat());
                jsd_backward_rows(&zz, &ww, v, beta, t, &[g, 2.0 * g], &mut out).unwrap();
                // row 1 is row 0 with twice the weight: the weight is a factor, applied once
                for i in 0..v {
                    assert_eq!(out[v + i], 2.0 * out[i], "{ctx:?} v={i}");
                }
                // in place equals out of place (f32), and bf16 in place is its rounding
                let mut zi = zz.clone();
                jsd_backward_rows_in_place(&mut zi, &ww, v, beta, t, &[g, 2.0 * g]).unwrap();
                assert_eq!(zi, out, "{ctx:?}");
                let mut zb: Vec<half::bf16> = zz.iter().map(|&x| half::bf16::from_f32(x)).collect();
                let zb32: Vec<f32> = zb.iter().map(|x| x.to_f32()).collect();
                let mut outb = vec![0.0f32; 2 * v];
                jsd_backward_rows(&zb32, &ww, v, beta, t, &[g, 2.0 * g], &mut outb).unwrap();
                jsd_backward_rows_in_place(&mut zb, &ww, v, beta, t, &[g, 2.0 * g]).unwrap();
                for i in 0..2 * v {
                    assert_eq!(zb[i], half::bf16::from_f32(outb[i]), "{ctx:?} v={i}");
                }
                let (b64, t64) = (beta as f64, t as f64);
                let (an, tol) = jsd_grad64(&z, &w, b64, t64, g as f64);
                let z64: Vec<f64> = z.iter().map(|&x| x as f64).collect();
                for i in 0..v {
                    if z[i] == f32::NEG_INFINITY {
                        assert_eq!(out[i], 0.0, "{ctx:?} masked v={i}");
                        continue;
                    }
                    let h = 1e-5;
                    let (mut zp, mut zm) = (z64.clone(), z64.clone());
                    zp[i] += h;
                    zm[i] -= h;
                    let fd = g as f64 * (jsd64_of(&zp, &w, b64, t64) - jsd64_of(&zm, &w, b64, t64))
                        / (2.0 * h);
                    assert!(
                        (fd - an[i]).abs() < 1e-8 + 1e-6 * an[i].abs(),
                        "{ctx:?} v={i}: FD {fd} vs {}",
                        an[i]
                    );
                    assert!(
                        (out[i] as f64 - an[i]).abs() < tol[i],
                        "{ctx:?} v={i}: {} vs {}",
                        out[i],
                        an[i]
                    );
                }
            }
        }
    }
}

#[test]
fn jsd_backward_is_accurate_at_a_large_vocabulary() {
    let mut rng = Rng(23);
    let v = 151_936;
    for (beta, t) in [(0.5f32, 1.0f32), (0.2, 0.7)] {
        let mut z = logits(&mut rng, v, 3.0, 4, 50);
        z[10] = f32::NEG_INFINITY;
        let mut w = logits(&mut rng, v, 3.0, 2, 50);
        w[11] = f32::NEG_INFINITY;
        let mut out = vec![0.0f32; v];
        jsd_backward_rows(&z, &w, v, beta, t, &[1.0], &mut out).unwrap();
        let (an, tol) = jsd_grad64(&z, &w, beta as f64, t as f64, 1.0);
        let mut worst = 0.0f64;
        for i in 0..v {
            let e = (out[i] as f64 - an[i]).abs();
            worst = worst.max(e / tol[i].max(f64::MIN_POSITIVE));
            assert!(e <= tol[i], "β={beta} T={t} v={i}: {} vs {}", out[i], an[i]);
        }
        assert_eq!(out[10], 0.0);
        assert!(out[11] != 0.0 && out[11].is_finite());
        // shift invariance: the gradient sums to 0
        let sum: f64 = out.iter().map(|&x| x as f64).sum();
        assert!(sum.abs() < 1e-5, "{sum}");
        std::eprintln!("jsd backward β={beta} T={t}: worst error / tolerance {worst:.3}");
    }
}

#[test]
fn jsd_backward_rejects_its_own_invalid_inputs_and_leaves_out_untouched() {
    let z = [0.0f32, 1.0, 2.0, 3.0, 0.5, 0.5, 0.5, 0.5];
    let w = [1.0f32, 0.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0];
    let s = 7.25f32;
    let run = |z: &[f32], w: &[f32], beta: f32, t: f32, g: &[f32], n: usize| {
        let mut out = vec![s; n];
        let r = jsd_backward_rows(z, w, 4, beta, t, g, &mut out);
        if r.is_err() {
            assert!(
                out.iter().all(|x| x.to_bits() == s.to_bits()),
                "{r:?}: written"
            );
        } else {
            assert!(out.iter().all(|x| x.is_finite()));
        }
        // In place (no `out`: its length cannot be wrong), the same result or the same error
        // with the logits untouched.
        if n == z.len() {
            let mut zi = z.to_vec();
            let ri = jsd_backward_rows_in_place(&mut zi, w, 4, beta, t, g);
            assert_eq!(ri, r);
            let want = if r.is_ok() { &out[..] } else { z };
            let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&zi), bits(want));
        }
        r
    };
    let name = |r: Result<(), Error>| match r {
        Err(Error::InvalidParam { name, .. }) => name,
        other => panic!("{other:?}"),
    };
    assert!(run(&z, &w, 0.5, 1.0, &[1.0, -1.0], 8).is_ok());
    // the gradients' temperature minimum, before β
    assert_eq!(name(run(&z, &w, 0.0, 0.9e-6, &[1.0; 2], 8)), "temperature");
    assert!(run(&z, &w, 0.5, 1e-6, &[1.0; 2], 8).is_ok());
    // β, before the lengths
    assert_eq!(name(run(&z, &w, 1.0, 1.0, &[1.0; 3], 8)), "beta");
    assert_eq!(
        run(&z[..7], &w, 0.5, 1.0, &[1.0; 2], 8),
        Err(Error::LengthMismatch {
            what: "student",
            expected: 4,
            found: 7
        })
    );
    assert_eq!(
        run(&z, &w, 0.5, 1.0, &[1.0; 2], 9),
        Err(Error::LengthMismatch {
            what: "out",
            expected: 8,
            found: 9
        })
    );
    assert_eq!(
        run(&z, &w, 0.5, 1.0, &[1.0; 3], 8),
        Err(Error::LengthMismatch {
            what: "grad_jsd",
            expected: 2,
            found: 3
        })
    );
    // weights before the rows: a NaN weight of row 1 before a NaN logit of row 0
    let mut zn = z;
    zn[2] = f32::NAN;
    assert_eq!(
        run(&zn, &w, 0.5, 1.0, &[1.0, f32::NAN], 8),
        Err(Error::NonFinite {
            what: "grad_jsd",
            index: 1
        })
    );
    assert_eq!(
        run(&zn, &w, 0.5, 1.0, &[1.0, 1.0], 8),
        Err(Error::NonFinite {
            what: "student",
            index: 2
        })
    );
    assert_eq!(name(run(&z, &w, 0.5, 1.0, &[2e9, 1.0], 8)), "grad_jsd");
    assert!(run(&z, &w, 0.5, 1.0, &[MAX_GRAD_WEIGHT, -MAX_GRAD_WEIGHT], 8).is_ok());
}

// ---- JSD gradient from saved states ---------------------------------------------------------

/// f64 `K = KL(p‖m)` of one row pair.
fn jsd_kl_pm64(z: &[f32], w: &[f32], beta: f64, t: f64) -> f64 {
    let (lp, lq) = (logp64(z, t), logp64(w, t));
    (0..z.len())
        .filter(|&v| lp[v] > f64::NEG_INFINITY)
        .map(|v| {
            let lm = (beta * lq[v].exp() + (1.0 - beta) * lp[v].exp()).ln();
            lp[v].exp() * (lp[v] - lm)
        })
        .sum()
}

/// The saving forward gives `jsd_rows`' bits and the pair state of `pair_row`; K is accurate;
/// the backward from its states gives the bits of the recomputing backward, out of place and
/// in place, in f32 and bf16 student storage (f16 teacher).
#[test]
fn jsd_saved_states_give_the_recomputing_bits() {
    let mut rng = Rng(29);
    // around a block (2048) and 16-lane chunk edges, and several blocks
    for v in [1usize, 17, 37, 200, BLOCK + 33, 3 * BLOCK + 5] {
        for (beta, t) in [(0.1f32, 1.0f32), (0.5, 0.7), (0.9, 1.3)] {
            let ctx = (v, beta, t);
            let masked = v / 50;
            let z: Vec<f32> = [
                logits(&mut rng, v, 2.0, 1, masked),
                logits(&mut rng, v, 1.0, 0, 0),
            ]
            .concat();
            let w: Vec<f32> = [
                logits(&mut rng, v, 2.0, 1, masked),
                logits(&mut rng, v, 3.0, 2, 0),
            ]
            .concat();
            let wh: Vec<half::f16> = w.iter().map(|&x| half::f16::from_f32(x)).collect();
            let g = [0.75f32, -2.0];
            let (mut j, mut j_again) = ([0.0f32; 2], [0.0f32; 2]);
            let mut st = [JsdState::EMPTY; 2];
            jsd_rows_saved(&z, &wh, v, beta, t, &mut j, &mut st).unwrap();
            jsd_rows(&z, &wh, v, beta, t, &mut j_again).unwrap();
            assert_eq!(j.map(f32::to_bits), j_again.map(f32::to_bits), "{ctx:?}");
            let w16: Vec<f32> = wh.iter().map(|x| x.to_f32()).collect();
            for r in 0..2 {
                let span = r * v..(r + 1) * v;
                let tau = 1.0 / t;
                let pair = canon::pair_row(&z[span.clone()], &wh[span.clone()], tau);
                let ls = |h| canon::LogSoftmax::of(&h);
                assert_eq!(st[r].student, ls(pair.student()), "{ctx:?} row {r}");
                assert_eq!(st[r].teacher, ls(pair.teacher()), "{ctx:?} row {r}");
                assert_eq!(st[r].beta, beta);
                let k64 = jsd_kl_pm64(&z[span.clone()], &w16[span], beta as f64, t as f64);
                let e = (st[r].kl_pm as f64 - k64).abs();
                assert!(
                    e <= 1e-6 + 1e-5 * k64,
                    "{ctx:?} row {r}: K {} vs {k64}",
                    st[r].kl_pm
                );
                assert!(validate::jsd_saved(&st[r], tau, r).is_ok());
            }
            let (mut o, mut o_again) = (vec![7.25f32; 2 * v], vec![0.0f32; 2 * v]);
            jsd_backward_rows_saved(&z, &wh, v, t, &st, &g, &mut o).unwrap();
            jsd_backward_rows(&z, &wh, v, beta, t, &g, &mut o_again).unwrap();
            let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&o), bits(&o_again), "{ctx:?}");
            let mut zi = z.clone();
            jsd_backward_rows_in_place_saved(&mut zi, &wh, v, t, &st, &g).unwrap();
            assert_eq!(bits(&zi), bits(&o), "{ctx:?}: in place");
            // bf16 student rows: states of the bf16 rows, the bits of the in-place backward
            let zb: Vec<half::bf16> = z.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let mut stb = [JsdState::EMPTY; 2];
            jsd_rows_saved(&zb, &wh, v, beta, t, &mut j, &mut stb).unwrap();
            let (mut zbi, mut zbr) = (zb.clone(), zb.clone());
            jsd_backward_rows_in_place_saved(&mut zbi, &wh, v, t, &stb, &g).unwrap();
            jsd_backward_rows_in_place(&mut zbr, &wh, v, beta, t, &g).unwrap();
            assert_eq!(zbi, zbr, "{ctx:?}: bf16 in place");
        }
    }
}

#[test]
fn jsd_saved_backward_rejects_invalid_inputs_and_leaves_outputs_untouched() {
    let z = [0.0f32, 1.0, 2.0, 3.0, 0.5, 0.5, 0.5, f32::NEG_INFINITY];
    let w = [1.0f32, 0.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0];
    let mut st = [JsdState::EMPTY; 2];
    jsd_rows_saved(&z, &w, 4, 0.5, 1.0, &mut [0.0; 2], &mut st).unwrap();
    let s = 7.25f32;
    let run = |z: &[f32], w: &[f32], v: usize, t: f32, st: &[JsdState], g: &[f32], n: usize| {
        let mut out = vec![s; n];
        let r = jsd_backward_rows_saved(z, w, v, t, st, g, &mut out);
        if r.is_err() {
            assert!(
                out.iter().all(|x| x.to_bits() == s.to_bits()),
                "{r:?}: written"
            );
        }
        assert_eq!(
            validate::jsd_backward_saved(z.len(), w.len(), v, t, st, g, n).map(|_| ()),
            r
        );
        // in place: the same result or the same error with the logits untouched
        if n == z.len() {
            let mut zi = z.to_vec();
            let ri = jsd_backward_rows_in_place_saved(&mut zi, w, v, t, st, g);
            assert_eq!(ri, r);
            let want = if r.is_ok() { &out[..] } else { z };
            let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&zi), bits(want));
        }
        r
    };
    let name = |r: Result<(), Error>| match r {
        Err(Error::InvalidParam { name, .. }) => name,
        other => panic!("{other:?}"),
    };
    let len = |what, expected, found| {
        Err(Error::LengthMismatch {
            what,
            expected,
            found,
        })
    };
    let g = [1.0f32, -1.0];
    assert!(run(&z, &w, 4, 1.0, &st, &g, 8).is_ok());
    // the order: temperature, vocab, lengths (student, teacher, out, saved, grad_jsd), weights,
    // then the states row by row
    assert_eq!(name(run(&z, &w, 0, 0.9e-6, &st[..1], &g, 9)), "temperature");
    assert!(run(&z, &w, 4, 1e-6, &st, &g, 8).is_ok());
    assert_eq!(name(run(&z, &w, 0, 1.0, &st[..1], &g, 9)), "vocab");
    assert_eq!(run(&z[..7], &w, 4, 1.0, &st, &g, 8), len("student", 4, 7));
    assert_eq!(run(&z, &w[..4], 4, 1.0, &st, &g, 9), len("teacher", 8, 4));
    assert_eq!(run(&z, &w, 4, 1.0, &st[..1], &g, 9), len("out", 8, 9));
    assert_eq!(
        run(&z, &w, 4, 1.0, &st[..1], &g[..1], 8),
        len("saved", 2, 1)
    );
    assert_eq!(run(&z, &w, 4, 1.0, &st, &g[..1], 8), len("grad_jsd", 2, 1));
    let mut bad = st;
    bad[0].kl_pm = f32::NAN;
    let nan_weight = [1.0, f32::NAN];
    let got = run(&z, &w, 4, 1.0, &bad, &nan_weight, 8);
    assert_eq!(
        got,
        Err(Error::NonFinite {
            what: "grad_jsd",
            index: 1
        })
    );
    assert_eq!(name(run(&z, &w, 4, 1.0, &st, &[2e9, 1.0], 8)), "grad_jsd");
    // the states: the first bad row, each check
    let saved_nan = |index| {
        Err(Error::NonFinite {
            what: "saved",
            index,
        })
    };
    let with = |r: usize, f: &dyn Fn(&mut JsdState)| {
        let mut b = st;
        f(&mut b[r]);
        b
    };
    assert_eq!(run(&z, &w, 4, 1.0, &bad, &g, 8), saved_nan(0));
    let both = with(1, &|x| x.kl_pm = f32::INFINITY);
    assert_eq!(run(&z, &w, 4, 1.0, &both, &g, 8), saved_nan(1));
    let mut both = both;
    both[0].student.neg_ln_sum = 0.7; // row 0's student: s < ½
    assert_eq!(name(run(&z, &w, 4, 1.0, &both, &g, 8)), "saved");
    let ok_sum = with(0, &|x| x.student.neg_ln_sum = core::f32::consts::LN_2);
    assert!(run(&z, &w, 4, 1.0, &ok_sum, &g, 8).is_ok());
    let big_sum = with(0, &|x| x.teacher.neg_ln_sum = -53.5);
    assert!(
        run(
            &z,
            &w,
            4,
            1.0,
            &with(0, &|x| x.teacher.neg_ln_sum = -53.0),
            &g,
            8
        )
        .is_ok()
    );
    assert_eq!(name(run(&z, &w, 4, 1.0, &big_sum, &g, 8)), "saved");
    let teacher_nan = with(1, &|x| x.teacher.max = f32::NAN);
    assert_eq!(run(&z, &w, 4, 1.0, &teacher_nan, &g, 8), saved_nan(1));
    // the maximum scaled by τ must stay finite (τ = 1e6 at the gradients' smallest T)
    let huge = with(1, &|x| x.student.max = 1e33);
    assert!(run(&z, &w, 4, 1.0, &huge, &g, 8).is_ok());
    assert_eq!(run(&z, &w, 4, 1e-6, &huge, &g, 8), saved_nan(1));
    for beta in [0.0f32, 1.0, f32::NAN, -0.5] {
        let b = with(1, &|x| x.beta = beta);
        assert_eq!(name(run(&z, &w, 4, 1.0, &b, &g, 8)), "saved", "β = {beta}");
    }
    let k = with(0, &|x| x.kl_pm = -134.0);
    assert_eq!(name(run(&z, &w, 4, 1.0, &k, &g, 8)), "saved");
    assert!(run(&z, &w, 4, 1.0, &with(0, &|x| x.kl_pm = 133.0), &g, 8).is_ok());
    // the placeholder: its references are −∞
    let empty = [JsdState::EMPTY; 2];
    assert_eq!(run(&z, &w, 4, 1.0, &empty, &g, 8), saved_nan(0));
    // the logits are not validated: a NaN logit gives NaN gradients, not an error
    let mut zn = z;
    zn[1] = f32::NAN;
    let mut out = [0.0f32; 8];
    jsd_backward_rows_saved(&zn, &w, 4, 1.0, &st, &g, &mut out).unwrap();
    assert!(out[1].is_nan() && out[4..].iter().all(|x| x.is_finite()));
}

#[test]
fn a_state_whose_kl_pq_is_infinite_refuses_a_kl_pq_term() {
    // Row 0: p = [½, ½], the teacher masks column 1 (q = [1, 0]): KL(p‖q) = +∞, KL(q‖p) = ln 2.
    // Row 1: p = q = [½, ½] (both KLs 0).
    let ninf = f32::NEG_INFINITY;
    let (z, w) = ([0.0f32, 0.0, 0.0, 0.0], [0.0f32, ninf, 0.0, 0.0]);
    let (mut kl, mut saved) = ([0.0f32; 2], [PairState::EMPTY; 2]);
    kl_rows_saved(
        &z,
        &w,
        2,
        1.0,
        KlDirection::TeacherStudent,
        &mut kl,
        &mut saved,
    )
    .unwrap();
    assert!((kl[0] - core::f32::consts::LN_2).abs() < 1e-6 && kl[1] == 0.0);
    // The state records KL(p‖q) = +∞ (u = +∞) on row 0 only; its other sums are those of
    // the pair reduction.
    let plain = canon::pair_row(&z[..2], &w[..2], 1.0);
    assert_eq!(
        saved[0],
        PairState {
            u: f32::INFINITY,
            ..plain
        }
    );
    assert_eq!(canon::finish_kl(&saved[0]).0, f32::INFINITY);
    assert_eq!(saved[1], canon::pair_row(&z[2..], &w[2..], 1.0));
    for (r, st) in saved.iter().enumerate() {
        assert_eq!(validate::saved(st, 1.0, r), Ok(()));
    }
    let grad_kl = [1.0f32, 1.0];
    let terms = |direction| GradTerms::<'_, u32> {
        logp: None,
        entropy: Some(&[0.5, 0.5]),
        kl: Some(KlTerm {
            teacher: &w,
            grad: &grad_kl,
            direction,
        }),
    };
    // A KL(p‖q) term: refused as backward_rows refuses it, outputs untouched.
    let s = 7.25f32;
    let mut out = [s; 4];
    let pq = terms(KlDirection::StudentTeacher);
    assert_eq!(
        backward_rows_saved(&z, 2, 1.0, &saved, &pq, &mut out),
        Err(Error::NonFinite {
            what: "saved KL(p‖q)",
            index: 0
        })
    );
    assert_eq!(out, [s; 4]);
    let mut zi = z;
    assert!(backward_rows_in_place_saved(&mut zi, 2, 1.0, &saved, &pq).is_err());
    assert_eq!(zi, z);
    assert!(matches!(
        backward_rows(&z, 2, 1.0, &pq, &mut out),
        Err(Error::NonFinite { index: 1, .. })
    ));
    // A KL(q‖p) term (finite gradient (p_v − q_v)/T, here ±½ plus the entropy's 0): the
    // bits of the backward that recomputes the states.
    let qp = terms(KlDirection::TeacherStudent);
    let mut again = [s; 4];
    backward_rows_saved(&z, 2, 1.0, &saved, &qp, &mut out).unwrap();
    backward_rows(&z, 2, 1.0, &qp, &mut again).unwrap();
    assert_eq!(out, again);
    assert_eq!(out, [-0.5, 0.5, 0.0, 0.0]);
    // A StudentTeacher forward refuses the row and writes nothing.
    let mut none = [PairState::EMPTY; 2];
    assert!(
        kl_rows_saved(
            &z,
            &w,
            2,
            1.0,
            KlDirection::StudentTeacher,
            &mut kl,
            &mut none
        )
        .is_err()
    );
    assert_eq!(none, [PairState::EMPTY; 2]);
}
