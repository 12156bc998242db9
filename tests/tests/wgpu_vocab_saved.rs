//! grpo-wgpu's backward from saved row states: `VocabKernel::forward_saved` and `kl_saved`
//! save grpo-core's `LseState` / `PairState`, `VocabKernel::backward_saved` takes them (or
//! grpo-core's) for every term set (log-probability, entropy, KL in either direction). Checked
//! against an f64 evaluation of MATH.md §5's gradient on the stored values within the tolerance
//! table (`grpo_tests::tolerance`), against the forward kernels' own outputs, against central
//! differences, and against grpo-core's errors, for f32, bf16 and f16 storage. The in-place
//! variants (`backward_rows_in_place`, `backward_saved_in_place`) against the out-of-place
//! gradient rounded by `half`, and their rounding against `half` directly. Skips (with a
//! message) without an adapter unless `GRPO_REQUIRE_GPU=1`.

use grpo_core::Error;
use grpo_core::vocab::canon::{finish_kl, finish_lse};
use grpo_core::vocab::{self, GradTerms, JsdState, KlDirection, KlTerm, LseState, PairState};
use grpo_tests::tolerance::{Dtype, Op, tolerance};
use grpo_tests::{gpu, log_softmax};
use grpo_wgpu::{ForwardOut, GpuError, LogitStorage, VocabKernel};
use proptest::prelude::*;

/// One batch of student and teacher rows and the backward's terms: `terms` picks a log-prob
/// term (bit 0), an entropy term (bit 1) and a KL term (`terms >> 2`: none, KL(p‖q), KL(q‖p)).
#[derive(Debug, Clone)]
struct Case {
    vocab: usize,
    rows: usize,
    student: Vec<f32>,
    teacher: Vec<f32>,
    targets: Vec<u32>,
    temp: f32,
    weights: [f32; 3],
    terms: u8,
}

impl Case {
    fn direction(&self) -> Option<KlDirection> {
        match self.terms >> 2 {
            0 => None,
            1 => Some(KlDirection::StudentTeacher),
            _ => Some(KlDirection::TeacherStudent),
        }
    }
}

fn vocab_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 1usize..=40,
        2 => prop::sample::select(vec![255usize, 256, 257, 513, 1025]),
        1 => 1000usize..3000,
    ]
}

fn logit() -> impl Strategy<Value = f32> {
    prop_oneof![
        6 => -12.0f32..12.0,
        1 => Just(0.0f32),
        1 => -60.0f32..60.0,
        1 => Just(f32::NEG_INFINITY),
    ]
}

/// Teachers are the student plus noise, or independent; both rows share the student's masked
/// entries, except in one case in six, where the masks are independent (a support violation
/// of the KL is then likely: both backends must give the same error), and in another, where
/// the teacher masks its own entries as well as the student's (KL(p‖q) is then +∞ where
/// KL(q‖p) is finite, which a KL(q‖p) forward records in its states).
fn case() -> impl Strategy<Value = Case> {
    (
        vocab_len(),
        1usize..4,
        prop::sample::select(vec![1.0f32, 0.7, 2.0]),
    )
        .prop_flat_map(|(vocab, rows, temp)| {
            let n = vocab * rows;
            (
                prop::collection::vec(logit(), n),
                prop::collection::vec(logit(), n),
                prop::collection::vec(0..vocab as u32, rows),
                (any::<bool>(), 0u8..6, 0u8..12),
                prop::array::uniform3(-2.0f32..2.0),
                Just((vocab, rows, temp)),
            )
        })
        .prop_map(
            |(mut student, other, targets, (near, masks, terms), weights, (vocab, rows, temp))| {
                let independent_masks = masks == 0;
                let teacher_masks_more = masks == 1;
                let mut teacher: Vec<f32> = student
                    .iter()
                    .zip(&other)
                    .map(|(&z, &o)| {
                        let w = if near && z.is_finite() && o.is_finite() {
                            z + o / 8.0
                        } else {
                            o
                        };
                        match (independent_masks, z.is_finite()) {
                            (true, _) => w,
                            (false, false) => f32::NEG_INFINITY,
                            (false, true) if w.is_finite() || teacher_masks_more => w,
                            (false, true) => 0.5,
                        }
                    })
                    .collect();
                // Every row keeps a finite target logit and a finite teacher logit.
                for r in 0..rows {
                    let y = r * vocab + targets[r] as usize;
                    if !student[y].is_finite() {
                        student[y] = 1.0;
                    }
                    if !teacher[y].is_finite() {
                        teacher[y] = -1.0;
                    }
                }
                Case {
                    vocab,
                    rows,
                    student,
                    teacher,
                    targets,
                    temp,
                    weights,
                    terms,
                }
            },
        )
}

/// The terms of `c`, with the teacher rows `teacher` (the stored ones).
fn terms_of<'a, L>(c: &'a Case, teacher: &'a [L], g: &'a [Vec<f32>; 3]) -> GradTerms<'a, u32, L> {
    GradTerms {
        logp: (c.terms & 1 != 0).then_some((&c.targets[..], &g[0][..])),
        entropy: (c.terms & 2 != 0).then_some(&g[1][..]),
        kl: c.direction().map(|direction| KlTerm {
            teacher,
            grad: &g[2][..],
            direction,
        }),
    }
}

/// The f64 gradient of row `r` of `terms` (MATH.md §5): with log p and log q of the stored
/// rows, `(g_lp·(1[v = y] − p_v) − g_H·p_v(log p_v + H) + g_KL·K_v)/T`, where `K_v = p_v(log p_v
/// − log q_v − KL(p‖q))` (KL(p‖q)) or `p_v − q_v` (KL(q‖p)). Also returns the scale the
/// tolerance's absolute part is multiplied by: the size of the terms the GPU rounds.
fn grad64(
    z: &[f64],
    w: &[f64],
    t: f64,
    y: Option<usize>,
    g: [f64; 3],
    kl: Option<KlDirection>,
) -> (Vec<f64>, f64) {
    let (_, lp) = log_softmax(z, t);
    let (_, lq) = log_softmax(w, t);
    let p: Vec<f64> = lp.iter().map(|l| l.exp()).collect();
    let q: Vec<f64> = lq.iter().map(|l| l.exp()).collect();
    let on = |v: usize| p[v] > 0.0;
    let h: f64 = -(0..z.len())
        .filter(|&v| on(v))
        .map(|v| p[v] * lp[v])
        .sum::<f64>();
    let kl_pq: f64 = (0..z.len())
        .filter(|&v| on(v))
        .map(|v| p[v] * (lp[v] - lq[v]))
        .sum();
    let min_lp = lp
        .iter()
        .filter(|l| l.is_finite())
        .fold(0.0f64, |a, &b| a.min(b));
    let max_ratio = (0..z.len())
        .filter(|&v| on(v))
        .map(|v| (lp[v] - lq[v]).abs())
        .fold(0.0f64, f64::max);
    let grad = (0..z.len())
        .map(|v| {
            let mut d = -g[0] * p[v];
            if y == Some(v) {
                d += g[0];
            }
            if on(v) {
                d -= g[1] * p[v] * (lp[v] + h);
            }
            d += g[2]
                * match kl {
                    None => 0.0,
                    Some(KlDirection::StudentTeacher) if on(v) => p[v] * (lp[v] - lq[v] - kl_pq),
                    Some(KlDirection::StudentTeacher) => 0.0,
                    Some(KlDirection::TeacherStudent) => p[v] - q[v],
                };
            d / t
        })
        .collect();
    let kl_scale = match kl {
        None => 0.0,
        Some(KlDirection::StudentTeacher) => g[2].abs() * (1.0 + max_ratio + kl_pq.abs()),
        Some(KlDirection::TeacherStudent) => 2.0 * g[2].abs(),
    };
    let scale = (g[0].abs() + g[1].abs() * (1.0 + h + min_lp.abs()) + kl_scale) / t;
    (grad, scale)
}

thread_local! {
    /// The largest gradient error of this thread's property test so far, as a share of what
    /// the tolerance allowed it (printed at the end of the test).
    static WORST: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
}

/// Compares `grad` (rows of `c`) with [`grad64`] on the stored rows `z`, `w`.
fn check_grad(
    c: &Case,
    z: &[f64],
    w: &[f64],
    dtype: Dtype,
    grad: &[f32],
    what: &str,
) -> Result<(), TestCaseError> {
    let v = c.vocab;
    let tol = tolerance(Op::VocabGrad, dtype);
    for r in 0..c.rows {
        let y = (c.terms & 1 != 0).then_some(c.targets[r] as usize);
        let on = [c.terms & 1 != 0, c.terms & 2 != 0, c.direction().is_some()];
        let g: [f64; 3] = std::array::from_fn(|i| if on[i] { c.weights[i] as f64 } else { 0.0 });
        let rows = r * v..(r + 1) * v;
        let (want, scale) = grad64(
            &z[rows.clone()],
            &w[rows.clone()],
            c.temp as f64,
            y,
            g,
            c.direction(),
        );
        let tol = tol.with_abs(tol.abs * scale);
        for (col, (&got, &want)) in grad[rows].iter().zip(&want).enumerate() {
            prop_assert!(
                tol.accepts(got, want),
                "{what}: grad[{r},{col}] {got} vs {want} (scale {scale})"
            );
            let share = (got as f64 - want).abs() / (tol.abs + tol.rel * want.abs());
            WORST.with(|w| w.set(w.get().max(share)));
        }
    }
    Ok(())
}

fn core_err(e: GpuError) -> Result<Error, TestCaseError> {
    match e {
        GpuError::Core(e) => Ok(e),
        e => Err(TestCaseError::fail(format!("not a grpo-core error: {e}"))),
    }
}

fn check_case<L: LogitStorage>(
    k: &VocabKernel<'_>,
    c: &Case,
    dtype: Dtype,
    conv: fn(f32) -> L,
) -> Result<(), TestCaseError> {
    let (rows, v, t) = (c.rows, c.vocab, c.temp);
    let z: Vec<L> = c.student.iter().map(|&x| conv(x)).collect();
    let w: Vec<L> = c.teacher.iter().map(|&x| conv(x)).collect();
    let wide = |x: &[L]| -> Vec<f64> { x.iter().map(|&e| e.widen() as f64).collect() };
    let (z64, w64) = (wide(&z), wide(&w));
    let tau = 1.0 / t;
    let fail = |e: GpuError| TestCaseError::fail(e.to_string());

    // The saving forward gives the plain forward's bits, and states grpo-core accepts whose
    // log-sum-exp and entropy meet the accuracy contract.
    let mut outs = [vec![0f32; rows], vec![0f32; rows], vec![0f32; rows]];
    let mut plain = outs.clone();
    let mut lse_states = vec![LseState::EMPTY; rows];
    fn out(o: &mut [Vec<f32>; 3]) -> ForwardOut<'_> {
        let [a, b, h] = o;
        ForwardOut {
            lse: Some(a),
            logp: Some(b),
            entropy: Some(h),
        }
    }
    k.forward_saved(&z, v, &c.targets, t, out(&mut outs), &mut lse_states)
        .map_err(fail)?;
    k.forward(&z, v, &c.targets, t, out(&mut plain))
        .map_err(fail)?;
    prop_assert_eq!(&outs, &plain);
    for (r, st) in lse_states.iter().enumerate() {
        prop_assert!(vocab::validate::saved(st, tau, r).is_ok(), "{st:?}");
        let (lse, _, h) = finish_lse(st, tau);
        let (rl, rlp) = log_softmax(&z64[r * v..(r + 1) * v], t as f64);
        let rh: f64 = -rlp
            .iter()
            .filter(|l| l.is_finite())
            .map(|l| l.exp() * l)
            .sum::<f64>();
        prop_assert!(
            tolerance(Op::Lse, dtype).accepts(lse, rl),
            "lse {lse} vs {rl}"
        );
        prop_assert!(
            tolerance(Op::Entropy, dtype).accepts(h, rh),
            "H {h} vs {rh}"
        );
    }

    // The backward of any term set (the saving forward, then the backward from its states):
    // grpo-core's `backward_rows` errors, or the f64 gradient.
    let g = c.weights.map(|x| vec![x; rows]);
    let terms = terms_of(c, &w, &g);
    let mut grad = vec![7f32; rows * v];
    let gpu = k.backward_rows(&z, v, t, &terms, &mut grad);
    match vocab::backward_rows(&z, v, t, &terms, &mut vec![0f32; rows * v]) {
        Err(e) => {
            prop_assert_eq!(core_err(gpu.unwrap_err())?, e);
            prop_assert!(grad.iter().all(|&x| x == 7.0), "grad written");
        }
        Ok(()) => {
            gpu.map_err(fail)?;
            check_grad(c, &z64, &w64, dtype, &grad, "backward_rows")?;
        }
    }
    // In place: the same errors with the logits untouched, or that gradient rounded to the
    // storage type as grpo-core's in-place backward rounds it (`half`'s `from_f32`).
    let mut over = z.clone();
    let gpu = k.backward_rows_in_place(&mut over, v, t, &terms);
    match vocab::backward_rows_in_place(&mut z.clone(), v, t, &terms) {
        Err(e) => {
            prop_assert_eq!(core_err(gpu.unwrap_err())?, e);
            same_bits(&over, &z, "backward_rows_in_place (logits untouched)")?;
        }
        Ok(()) => {
            gpu.map_err(fail)?;
            let rounded: Vec<L> = grad.iter().map(|&g| conv(g)).collect();
            same_bits(&over, &rounded, "backward_rows_in_place")?;
        }
    }

    // The saving KL forward: grpo-core's errors, the plain kernel's value (bits, in the
    // KL(p‖q) direction, where both run the same code), and states whose KL values meet the
    // contract in both directions.
    let direction = c.direction().unwrap_or(KlDirection::StudentTeacher);
    let mut kl = vec![0f32; rows];
    let mut pair_states = vec![PairState::EMPTY; rows];
    let gpu = k.kl_saved(&z, &w, v, t, direction, &mut kl, &mut pair_states);
    let (mut core_kl, mut core_pairs) = (vec![0f32; rows], vec![PairState::EMPTY; rows]);
    let core = vocab::kl_rows_saved(&z, &w, v, t, direction, &mut core_kl, &mut core_pairs);
    if let Err(e) = core {
        prop_assert_eq!(core_err(gpu.unwrap_err())?, e);
        return Ok(());
    }
    gpu.map_err(fail)?;
    let mut plain_kl = vec![0f32; rows];
    k.kl(&z, &w, v, t, direction, &mut plain_kl).map_err(fail)?;
    if direction == KlDirection::StudentTeacher {
        prop_assert_eq!(&kl, &plain_kl);
    }
    for (r, st) in pair_states.iter().enumerate() {
        prop_assert!(vocab::validate::saved(st, tau, r).is_ok(), "{st:?}");
        let (zr, wr) = (&z64[r * v..(r + 1) * v], &w64[r * v..(r + 1) * v]);
        let (forward, reverse) = finish_kl(st);
        let tol = tolerance(Op::Kl, dtype);
        for (got, a, b) in [(forward, zr, wr), (reverse, wr, zr)] {
            let want = kl_f64(a, b, t as f64);
            // The other direction may be +∞ (a support violation its forward would report).
            if want.is_finite() {
                prop_assert!(tol.accepts(got, want), "KL {got} vs {want} ({st:?})");
            }
        }
        // An infinite KL(p‖q), which only the KL(q‖p) direction accepts, is recorded as
        // grpo-core records it (u = +∞), so a KL(p‖q) term is refused on this state.
        let ninf = f64::NEG_INFINITY;
        let pq_infinite = zr.iter().zip(wr).any(|(&a, &b)| b == ninf && a != ninf);
        prop_assert_eq!(
            st.u == f32::INFINITY,
            pq_infinite,
            "row {}: u = {} (core {})",
            r,
            st.u,
            core_pairs[r].u
        );
        prop_assert_eq!(core_pairs[r].u == f32::INFINITY, pq_infinite);
        let want = match direction {
            KlDirection::StudentTeacher => finish_kl(st).0,
            KlDirection::TeacherStudent => finish_kl(st).1,
        };
        prop_assert!(
            tol.accepts(kl[r], want as f64),
            "kl_saved's value {} vs its state's {want}",
            kl[r]
        );
    }

    // The backward from the GPU's states and from grpo-core's, against the f64 gradient.
    k.backward_saved(&z, v, t, &pair_states, &terms, &mut grad)
        .map_err(fail)?;
    check_grad(c, &z64, &w64, dtype, &grad, "GPU pair states")?;
    let mut over = z.clone();
    k.backward_saved_in_place(&mut over, v, t, &pair_states, &terms)
        .map_err(fail)?;
    let rounded: Vec<L> = grad.iter().map(|&g| conv(g)).collect();
    same_bits(&over, &rounded, "backward_saved_in_place")?;
    k.backward_saved(&z, v, t, &core_pairs, &terms, &mut grad)
        .map_err(fail)?;
    check_grad(c, &z64, &w64, dtype, &grad, "grpo-core's pair states")?;
    if c.direction().is_none() {
        k.backward_saved(&z, v, t, &lse_states, &terms, &mut grad)
            .map_err(fail)?;
        check_grad(c, &z64, &w64, dtype, &grad, "GPU softmax states")?;
    }
    // The GPU's states serve grpo-core's backward (and so grpo-cpu's, which has its bits).
    vocab::backward_rows_saved(&z, v, t, &pair_states, &terms, &mut grad)
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    check_grad(
        c,
        &z64,
        &w64,
        dtype,
        &grad,
        "grpo-core from GPU pair states",
    )?;
    Ok(())
}

/// The bit patterns of `x`.
fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// `got` and `want` hold the same values, bit for bit (compared widened, which is exact).
fn same_bits<L: LogitStorage>(got: &[L], want: &[L], what: &str) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.widen(), w.widen());
        prop_assert!(g.to_bits() == w.to_bits(), "{what}: [{i}] {g} vs {w}");
    }
    Ok(())
}

/// f64 KL(a‖b) of the softmaxes of two rows at temperature `t` (+∞ when `b` is −∞ where `a`
/// has mass).
fn kl_f64(a: &[f64], b: &[f64], t: f64) -> f64 {
    let (_, la) = log_softmax(a, t);
    let (_, lb) = log_softmax(b, t);
    la.iter()
        .zip(&lb)
        .filter(|(la, _)| la.is_finite())
        .map(|(&la, &lb)| la.exp() * (la - lb))
        .sum()
}

fn run<L: LogitStorage>(test: &str, dtype: Dtype, conv: fn(f32) -> L) {
    let Some(ctx) = gpu::context(test) else {
        return;
    };
    let k = VocabKernel::new(ctx);
    if L::DTYPE == grpo_wgpu::LogitDtype::F16 && !ctx.supports_f16() {
        // Without SHADER_F16 the saving forward must say so, its states untouched.
        let mut saved = [LseState::EMPTY];
        let mut lse = [7.0f32];
        let out = ForwardOut {
            lse: Some(&mut lse),
            logp: None,
            entropy: None,
        };
        let r = k.forward_saved(&[conv(0.0)], 1, &[0], 1.0, out, &mut saved);
        assert_eq!(
            r,
            Err(GpuError::MissingFeature {
                feature: "SHADER_F16"
            })
        );
        assert_eq!((saved, lse), ([LseState::EMPTY], [7.0]));
        eprintln!("{test}: the adapter lacks SHADER_F16; checked the error instead");
        return;
    }
    WORST.with(|w| w.set(0.0));
    gpu::runner()
        .run(&case(), |c| check_case(&k, &c, dtype, conv))
        .unwrap();
    let worst = WORST.with(|w| w.get());
    eprintln!(
        "{test}: {} cases; largest gradient error {worst:.3} of its tolerance",
        gpu::cases()
    );
}

#[test]
fn saved_path_f32_matches_f64_reference() {
    run("saved_path_f32_matches_f64_reference", Dtype::F32, |x| x);
}

#[test]
fn saved_path_bf16_matches_f64_reference() {
    run(
        "saved_path_bf16_matches_f64_reference",
        Dtype::Bf16,
        half::bf16::from_f32,
    );
}

#[test]
fn saved_path_f16_matches_f64_reference() {
    run(
        "saved_path_f16_matches_f64_reference",
        Dtype::F16,
        half::f16::from_f32,
    );
}

#[test]
fn saved_backward_agrees_with_central_differences() {
    // ∂/∂z of g_lp·logp(y) + g_H·H + g_KL·KL by central differences of the f64 reference
    // (MATH.md §0), through the GPU's saved states, for each KL direction and without one.
    let Some(ctx) = gpu::context("saved_backward_agrees_with_central_differences") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    let z = [0.3f32, -1.2, 2.5, 0.0, 1.1, -0.4, 0.9];
    let w = [0.1f32, -0.7, 1.9, 0.4, 1.5, -1.1, 0.2];
    let (a, b, c, t, y) = (0.7f32, -1.3f32, 0.9f32, 0.8f32, 2usize);
    let wide = |x: &[f32]| -> Vec<f64> { x.iter().map(|&e| e as f64).collect() };
    let (z64, w64) = (wide(&z), wide(&w));
    let loss = |zz: &[f64], kl: Option<KlDirection>| {
        let (_, lp) = log_softmax(zz, t as f64);
        let h: f64 = -lp.iter().map(|l| l.exp() * l).sum::<f64>();
        let d = match kl {
            None => 0.0,
            Some(KlDirection::StudentTeacher) => kl_f64(zz, &w64, t as f64),
            Some(KlDirection::TeacherStudent) => kl_f64(&w64, zz, t as f64),
        };
        a as f64 * lp[y] + b as f64 * h + c as f64 * d
    };
    let g_kl = [c];
    for kl in [
        None,
        Some(KlDirection::StudentTeacher),
        Some(KlDirection::TeacherStudent),
    ] {
        let terms = GradTerms {
            logp: Some((&[y as u32][..], &[a][..])),
            entropy: Some(&[b][..]),
            kl: kl.map(|direction| KlTerm {
                teacher: &w[..],
                grad: &g_kl[..],
                direction,
            }),
        };
        let mut grad = [0f32; 7];
        let mut value = [0f32];
        let mut pair = [PairState::EMPTY];
        let direction = kl.unwrap_or(KlDirection::StudentTeacher);
        k.kl_saved(&z, &w, 7, t, direction, &mut value, &mut pair)
            .unwrap();
        k.backward_saved(&z, 7, t, &pair, &terms, &mut grad)
            .unwrap();
        // The recomputing backward runs the saving forward of its terms, then this backward.
        let mut recomputed = [0f32; 7];
        k.backward_rows(&z, 7, t, &terms, &mut recomputed).unwrap();
        if kl.is_none() {
            // The softmax state of the saving forward gives the same gradient.
            let mut lse = [LseState::EMPTY];
            let out = ForwardOut::default();
            k.forward_saved(&z, 7, &[y as u32], t, out, &mut lse)
                .unwrap();
            let mut again = [0f32; 7];
            k.backward_saved(&z, 7, t, &lse, &terms, &mut again)
                .unwrap();
            for (g1, g2) in grad.iter().zip(&again) {
                assert!((g1 - g2).abs() < 1e-6, "{g1} vs {g2}");
            }
            assert_eq!(recomputed, again);
        } else {
            assert_eq!(recomputed, grad);
        }
        for v in 0..7 {
            let e = 1e-6;
            let (mut hi, mut lo) = (z64.clone(), z64.clone());
            hi[v] += e;
            lo[v] -= e;
            let fd = (loss(&hi, kl) - loss(&lo, kl)) / (2.0 * e);
            assert!(
                (grad[v] as f64 - fd).abs() < 1e-5,
                "{kl:?} v={v}: {} vs {fd}",
                grad[v]
            );
        }
    }
}

/// The inputs of one `backward_saved` call with every term (KL(p‖q)), valid as built.
#[derive(Clone)]
struct Args {
    z: Vec<f32>,
    w: Vec<f32>,
    vocab: usize,
    temp: f32,
    saved: Vec<PairState>,
    targets: Vec<u32>,
    g: [Vec<f32>; 3],
    grad_len: usize,
}

impl Args {
    fn terms(&self) -> GradTerms<'_, u32, f32> {
        GradTerms {
            logp: Some((&self.targets[..], &self.g[0][..])),
            entropy: Some(&self.g[1][..]),
            kl: Some(KlTerm {
                teacher: &self.w[..],
                grad: &self.g[2][..],
                direction: KlDirection::StudentTeacher,
            }),
        }
    }
}

#[test]
fn saved_errors_match_grpo_core_and_leave_outputs_untouched() {
    let Some(ctx) = gpu::context("saved_errors_match_grpo_core_and_leave_outputs_untouched") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    let sentinel = 12345.0f32;
    let z = vec![0.5f32, -1.0, 2.0, 0.0, 0.0, 1.0];
    let w = vec![0.0f32, -1.0, 2.5, 1.0, 0.0, 0.0];
    let mut saved = vec![PairState::EMPTY; 2];
    vocab::kl_rows_saved(
        &z,
        &w,
        3,
        1.0,
        KlDirection::StudentTeacher,
        &mut [0.0; 2],
        &mut saved,
    )
    .unwrap();
    let base = Args {
        z,
        w,
        vocab: 3,
        temp: 1.0,
        saved,
        targets: vec![2, 0],
        g: [vec![1.0; 2], vec![-0.1; 2], vec![0.5; 2]],
        grad_len: 6,
    };
    let call = |a: &Args, what: &str| {
        let terms = a.terms();
        let mut grad = vec![sentinel; a.grad_len];
        let got = k.backward_saved(&a.z, a.vocab, a.temp, &a.saved, &terms, &mut grad);
        let mut core_grad = vec![sentinel; a.grad_len];
        let want =
            vocab::backward_rows_saved(&a.z, a.vocab, a.temp, &a.saved, &terms, &mut core_grad);
        // In place: grpo-core's in-place result (it has no `grad` length to check), the
        // logits untouched on `Err`.
        let mut over = a.z.clone();
        let got_in_place = k.backward_saved_in_place(&mut over, a.vocab, a.temp, &a.saved, &terms);
        let mut core_over = a.z.clone();
        let want_in_place =
            vocab::backward_rows_in_place_saved(&mut core_over, a.vocab, a.temp, &a.saved, &terms);
        let in_place = want_in_place.map_err(GpuError::Core);
        assert_eq!(got_in_place, in_place, "backward_saved_in_place: {what}");
        if want_in_place.is_err() {
            assert_eq!(bits(&over), bits(&a.z), "{what}: logits written");
        }
        (got, want, grad)
    };
    // The recomputing backward of the same terms: grpo-core's `backward_rows` result.
    let recompute = |a: &Args, what: &str| {
        let terms = a.terms();
        let mut grad = vec![sentinel; a.grad_len];
        let got = k.backward_rows(&a.z, a.vocab, a.temp, &terms, &mut grad);
        let mut core_grad = vec![sentinel; a.grad_len];
        let want = vocab::backward_rows(&a.z, a.vocab, a.temp, &terms, &mut core_grad);
        assert_eq!(got, want.map_err(GpuError::Core), "backward_rows: {what}");
        if want.is_err() {
            assert!(grad.iter().all(|&g| g == sentinel), "{what}: grad written");
        }
        let mut over = a.z.clone();
        let got = k.backward_rows_in_place(&mut over, a.vocab, a.temp, &terms);
        let want_in_place =
            vocab::backward_rows_in_place(&mut a.z.clone(), a.vocab, a.temp, &terms);
        let in_place = want_in_place.map_err(GpuError::Core);
        assert_eq!(got, in_place, "backward_rows_in_place: {what}");
        if want_in_place.is_err() {
            assert_eq!(bits(&over), bits(&a.z), "{what}: logits written");
        }
        want
    };
    let (got, want, _) = call(&base, "valid");
    assert_eq!((got, want), (Ok(()), Ok(())));
    assert_eq!(recompute(&base, "valid"), Ok(()));
    type Change = fn(&mut Args);
    let changes: [(&str, Change); 21] = [
        ("temperature 0", |a| a.temp = 0.0),
        ("temperature below 1e-6", |a| a.temp = 1e-7),
        ("vocab 0", |a| a.vocab = 0),
        ("logits length", |a| {
            a.z.pop();
        }),
        ("grad length", |a| a.grad_len = 5),
        ("saved length", |a| {
            a.saved.pop();
        }),
        ("targets length", |a| {
            a.targets.pop();
        }),
        ("grad_logp length", |a| {
            a.g[0].pop();
        }),
        ("grad_entropy length", |a| {
            a.g[1].pop();
        }),
        ("teacher length", |a| {
            a.w.pop();
        }),
        ("grad_kl length", |a| {
            a.g[2].pop();
        }),
        ("NaN grad_logp", |a| a.g[0][1] = f32::NAN),
        ("grad_entropy too large", |a| a.g[1][0] = 2e9),
        ("infinite grad_kl", |a| a.g[2][1] = f32::INFINITY),
        ("target out of range", |a| a.targets[1] = 3),
        ("NaN state", |a| a.saved[1].sz = f32::NAN),
        ("impossible state", |a| a.saved[0].sw = 0.25),
        ("KL above 2^65", |a| a.saved[1].u = 1e30),
        ("−∞ target logit", |a| a.z[3] = f32::NEG_INFINITY),
        ("infinite reference", |a| a.saved[0].wmax = f32::INFINITY),
        ("reference overflowing at T", |a| {
            a.temp = 1e-6;
            a.saved[0].zmax = 1e35;
        }),
    ];
    for (what, change) in changes {
        let mut a = base.clone();
        change(&mut a);
        let (got, want, grad) = call(&a, what);
        let want = want.expect_err(what);
        assert_eq!(got, Err(GpuError::Core(want)), "{what}");
        assert!(grad.iter().all(|&g| g == sentinel), "{what}: grad written");
        // The recomputing backward reads no state: the changes of the states alone leave it
        // valid.
        let states_only = [
            "saved length",
            "NaN state",
            "impossible state",
            "KL above 2^65",
            "infinite reference",
            "reference overflowing at T",
        ];
        let recomputed = recompute(&a, what);
        assert_eq!(recomputed.is_ok(), states_only.contains(&what), "{what}");
    }
    // The rows, which only the recomputing backward reads: the first error in grpo-core's order
    // (row by row: logits, teacher, the KL's support, the target logit), also where the device
    // pass finds a later row's error first.
    let rows: [(&str, Change); 7] = [
        ("NaN logit", |a| a.z[4] = f32::NAN),
        ("+∞ teacher logit", |a| a.w[1] = f32::INFINITY),
        ("row of only −∞", |a| a.z[3..6].fill(f32::NEG_INFINITY)),
        ("teacher −∞ where the student has mass", |a| {
            a.w[5] = f32::NEG_INFINITY;
        }),
        ("maximum overflowing at T", |a| {
            a.temp = 1e-6;
            a.z[5] = 1e35;
        }),
        ("−∞ target logit before a NaN row", |a| {
            a.z[2] = f32::NEG_INFINITY;
            a.z[4] = f32::NAN;
        }),
        ("NaN teacher before a −∞ target logit", |a| {
            a.w[0] = f32::NAN;
            a.z[3] = f32::NEG_INFINITY;
        }),
    ];
    for (what, change) in rows {
        let mut a = base.clone();
        change(&mut a);
        assert!(recompute(&a, what).is_err(), "{what}: grpo-core accepts it");
    }
    // A KL term needs the teacher's state: softmax states are refused.
    let lse: Vec<LseState> = base.saved.iter().map(|s| s.student()).collect();
    let mut grad = vec![sentinel; 6];
    let got = k.backward_saved(&base.z, 3, 1.0, &lse, &base.terms(), &mut grad);
    let want = vocab::backward_rows_saved(&base.z, 3, 1.0, &lse, &base.terms(), &mut [0.0; 6]);
    assert!(matches!(want, Err(Error::InvalidParam { name: "kl", .. })));
    assert_eq!(got, Err(GpuError::Core(want.unwrap_err())));
    assert!(grad.iter().all(|&g| g == sentinel));

    // The saving forwards: the states' length (after the other outputs', as grpo-core), and
    // nothing written on `Err`.
    let (mut lp, mut st) = ([sentinel; 2], [LseState::EMPTY; 1]);
    let out = ForwardOut {
        logp: Some(&mut lp),
        ..Default::default()
    };
    let got = k.forward_saved(&base.z, 3, &[0, 1], 1.0, out, &mut st);
    let mismatch = Error::LengthMismatch {
        what: "saved_out",
        expected: 2,
        found: 1,
    };
    assert_eq!(got, Err(GpuError::Core(mismatch)));
    assert_eq!((lp, st), ([sentinel; 2], [LseState::EMPTY]));
    let (mut kl, mut pairs) = ([sentinel; 2], [PairState::EMPTY; 1]);
    let got = k.kl_saved(
        &base.z,
        &base.w,
        3,
        1.0,
        KlDirection::TeacherStudent,
        &mut kl,
        &mut pairs,
    );
    assert_eq!(got, Err(GpuError::Core(mismatch)));
    assert_eq!((kl, pairs), ([sentinel; 2], [PairState::EMPTY]));

    // The states' length comes before this backend's own limit (a vocabulary too large for
    // one binding), as grpo-core has no such limit: no rows, one state.
    let (none, huge) = ([0f32; 0], u32::MAX as usize / 2 + 1);
    let fwd = KlDirection::StudentTeacher;
    let one_too_many = Error::LengthMismatch {
        what: "saved_out",
        expected: 0,
        found: 1,
    };
    let mut pairs = [PairState::EMPTY; 1];
    let got = k.kl_saved(&none, &none, huge, 1.0, fwd, &mut [], &mut pairs);
    let want = vocab::kl_rows_saved(&none, &none, huge, 1.0, fwd, &mut [], &mut pairs);
    assert_eq!(
        (got, want),
        (Err(GpuError::Core(one_too_many)), Err(one_too_many))
    );
    assert_eq!(pairs, [PairState::EMPTY]);
    let mut states = [JsdState::EMPTY; 1];
    let got = k.jsd_saved(&none, &none, huge, 0.5, 1.0, &mut [], &mut states);
    let want = vocab::jsd_rows_saved(&none, &none, huge, 0.5, 1.0, &mut [], &mut states);
    assert_eq!(
        (got, want),
        (Err(GpuError::Core(one_too_many)), Err(one_too_many))
    );
    assert_eq!(states, [JsdState::EMPTY]);
    // With the states' length right (or no states), the limit.
    let too_large = |r| matches!(r, Err(GpuError::TooLarge { what: "vocab", .. }));
    assert!(too_large(k.kl(&none, &none, huge, 1.0, fwd, &mut [])));
    assert!(too_large(k.kl_saved(
        &none,
        &none,
        huge,
        1.0,
        fwd,
        &mut [],
        &mut []
    )));
    assert!(too_large(k.jsd(&none, &none, huge, 0.5, 1.0, &mut [])));
    assert!(too_large(k.jsd_saved(
        &none,
        &none,
        huge,
        0.5,
        1.0,
        &mut [],
        &mut []
    )));
}

#[test]
fn saved_kl_support_and_host_rows_are_grpo_cores() {
    let Some(ctx) = gpu::context("saved_kl_support_and_host_rows_are_grpo_cores") else {
        return;
    };
    let k = VocabKernel::new(ctx);
    let ninf = f32::NEG_INFINITY;
    // Row 1: the student is −∞ where the teacher has mass, so KL(q‖p) = +∞ and KL(p‖q) is
    // finite: the saving forward checks the support of the direction it is asked for.
    let z = [0.0f32, 1.0, 0.5, /* row 1 */ 0.0, ninf, 0.5];
    let w = [0.3f32, 0.2, 0.1, /* row 1 */ 0.0, 1.0, 0.5];
    for direction in [KlDirection::StudentTeacher, KlDirection::TeacherStudent] {
        let (mut kl, mut st) = ([7.0f32; 2], [PairState::EMPTY; 2]);
        let got = k.kl_saved(&z, &w, 3, 1.0, direction, &mut kl, &mut st);
        let (mut core_kl, mut core_st) = ([0f32; 2], [PairState::EMPTY; 2]);
        let want = vocab::kl_rows_saved(&z, &w, 3, 1.0, direction, &mut core_kl, &mut core_st);
        match direction {
            KlDirection::StudentTeacher => {
                assert_eq!((got, want), (Ok(()), Ok(())));
                for r in 0..2 {
                    assert!((kl[r] - core_kl[r]).abs() < 2e-6, "{kl:?} vs {core_kl:?}");
                }
            }
            KlDirection::TeacherStudent => {
                assert!(want.is_err());
                assert_eq!(got, Err(GpuError::Core(want.unwrap_err())));
                assert_eq!((kl, st), ([7.0; 2], [PairState::EMPTY; 2]));
            }
        }
    }
    // A finite student logit whose z/T overflows to −∞ (not the maximum) has probability 0 in
    // grpo-core, which accepts the row; the shader sends it to grpo-core on the host, so its
    // value and state are grpo-core's bits.
    let z = [1.0f32, -3.0e38, 0.0, /* row 1 */ 0.25, 0.5, -0.5];
    let w = [0.5f32, 0.0, 0.0, /* row 1 */ 0.0, 0.0, 1.0];
    for direction in [KlDirection::StudentTeacher, KlDirection::TeacherStudent] {
        let (mut kl, mut st) = ([0f32; 2], [PairState::EMPTY; 2]);
        k.kl_saved(&z, &w, 3, 0.5, direction, &mut kl, &mut st)
            .unwrap();
        let (mut core_kl, mut core_st) = ([0f32; 2], [PairState::EMPTY; 2]);
        vocab::kl_rows_saved(&z, &w, 3, 0.5, direction, &mut core_kl, &mut core_st).unwrap();
        assert_eq!((kl[0].to_bits(), st[0]), (core_kl[0].to_bits(), core_st[0]));
        assert!((kl[1] - core_kl[1]).abs() < 2e-6);
    }
}

#[test]
fn chunked_saved_rows_give_the_same_bits() {
    // A private context whose binding cap forces chunks of 2 rows (bf16 with an odd vocab puts
    // chunk starts mid-word), against the same context uncapped.
    if gpu::context("chunked_saved_rows_give_the_same_bits").is_none() {
        return;
    }
    let ctx = grpo_wgpu::GpuContext::new().unwrap();
    let k = VocabKernel::new(&ctx);
    let (rows, vocab) = (7usize, 301usize);
    let bf = |i: usize, m: usize| half::bf16::from_f32(((i * m % 101) as f32) * 0.11 - 5.0);
    let z: Vec<half::bf16> = (0..rows * vocab).map(|i| bf(i, 37)).collect();
    let w: Vec<half::bf16> = (0..rows * vocab).map(|i| bf(i, 53)).collect();
    let targets: Vec<u32> = (0..rows as u32).map(|r| r * 13 % vocab as u32).collect();
    let g = [vec![1.0f32; rows], vec![0.5; rows], vec![-0.25; rows]];
    let run = |k: &VocabKernel<'_>| {
        let mut lp = vec![0f32; rows];
        let mut lse = vec![LseState::EMPTY; rows];
        let out = ForwardOut {
            logp: Some(&mut lp),
            ..Default::default()
        };
        k.forward_saved(&z, vocab, &targets, 0.9, out, &mut lse)
            .unwrap();
        let (mut kl, mut pair) = (vec![0f32; rows], vec![PairState::EMPTY; rows]);
        k.kl_saved(
            &z,
            &w,
            vocab,
            0.9,
            KlDirection::TeacherStudent,
            &mut kl,
            &mut pair,
        )
        .unwrap();
        let terms = GradTerms {
            logp: Some((&targets[..], &g[0][..])),
            entropy: Some(&g[1][..]),
            kl: Some(KlTerm {
                teacher: &w[..],
                grad: &g[2][..],
                direction: KlDirection::StudentTeacher,
            }),
        };
        let mut grad = vec![0f32; rows * vocab];
        k.backward_saved(&z, vocab, 0.9, &pair, &terms, &mut grad)
            .unwrap();
        // The recomputing backward, which uploads each chunk once for its two submissions:
        // with these terms (the KL's teacher too), and without the KL term.
        let mut recomputed = vec![0f32; rows * vocab];
        k.backward_rows(&z, vocab, 0.9, &terms, &mut recomputed)
            .unwrap();
        // In place (bf16 with an odd vocabulary: words straddle rows, chunks start mid-word).
        let mut over = z.clone();
        k.backward_saved_in_place(&mut over, vocab, 0.9, &pair, &terms)
            .unwrap();
        let mut over_rows = z.clone();
        k.backward_rows_in_place(&mut over_rows, vocab, 0.9, &terms)
            .unwrap();
        let mut no_kl = vec![0f32; rows * vocab];
        let terms = GradTerms { kl: None, ..terms };
        k.backward_rows(&z, vocab, 0.9, &terms, &mut no_kl).unwrap();
        let in_place = (over, over_rows);
        (lp, lse, kl, pair, grad, recomputed, no_kl, in_place)
    };
    let whole = run(&k);
    // The gradient row is 4·301 + 4 bytes: a cap of 2500 holds 2 rows.
    ctx.set_binding_cap(2500);
    let chunked = run(&k);
    ctx.set_binding_cap(u64::MAX);
    assert_eq!(whole, chunked);
}

#[test]
fn backward_rows_uploads_each_input_once() {
    // `backward_rows` runs two submissions per chunk (the saving forward, then the backward
    // from the states); the logits, and the KL term's teacher logits, go to the device once.
    // The public two-call path (`forward_saved` or `kl_saved`, then `backward_saved`) uploads
    // them twice, which is what this test tells apart. A private context: the counter is
    // per context, and other tests run beside this one.
    if gpu::context("backward_rows_uploads_each_input_once").is_none() {
        return;
    }
    let ctx = grpo_wgpu::GpuContext::new().unwrap();
    let k = VocabKernel::new(&ctx);
    let (rows, vocab) = (6usize, 5000usize);
    let z: Vec<f32> = (0..rows * vocab)
        .map(|i| ((i * 37 % 101) as f32) * 0.1 - 5.0)
        .collect();
    let w: Vec<f32> = (0..rows * vocab)
        .map(|i| ((i * 53 % 97) as f32) * 0.1 - 4.0)
        .collect();
    let targets: Vec<u32> = (0..rows as u32).map(|r| r * 13).collect();
    let g = vec![0.5f32; rows];
    let row_bytes = (vocab * 4) as u64;
    let input = rows as u64 * row_bytes;
    let uploaded = |run: &mut dyn FnMut()| {
        let before = ctx.bytes_uploaded();
        run();
        ctx.bytes_uploaded() - before
    };
    for kl in [
        None,
        Some(KlDirection::StudentTeacher),
        Some(KlDirection::TeacherStudent),
    ] {
        let terms = GradTerms {
            logp: Some((&targets[..], &g[..])),
            entropy: Some(&g[..]),
            kl: kl.map(|direction| KlTerm {
                teacher: &w[..],
                grad: &g[..],
                direction,
            }),
        };
        let inputs = if kl.is_some() { 2 * input } else { input };
        let mut grad = vec![0f32; rows * vocab];
        for cap in [u64::MAX, 2 * row_bytes + 8] {
            // Uncapped: one chunk; capped: three chunks of 2 rows, each uploaded once.
            ctx.set_binding_cap(cap);
            let sent = uploaded(&mut || {
                k.backward_rows(&z, vocab, 1.0, &terms, &mut grad).unwrap();
            });
            ctx.set_binding_cap(u64::MAX);
            // Besides the rows: targets, coefficients (48 bytes a row) and uniform blocks.
            assert!(
                sent >= inputs && sent < inputs + 4096,
                "{kl:?}, cap {cap}: {sent} bytes uploaded for {inputs} bytes of rows"
            );
        }
        let two_calls = uploaded(&mut || {
            let mut again = vec![0f32; rows * vocab];
            match kl {
                None => {
                    let mut st = vec![LseState::EMPTY; rows];
                    let out = ForwardOut::default();
                    k.forward_saved(&z, vocab, &[], 1.0, out, &mut st).unwrap();
                    k.backward_saved(&z, vocab, 1.0, &st, &terms, &mut again)
                        .unwrap();
                }
                Some(d) => {
                    let (mut v, mut st) = (vec![0f32; rows], vec![PairState::EMPTY; rows]);
                    k.kl_saved(&z, &w, vocab, 1.0, d, &mut v, &mut st).unwrap();
                    k.backward_saved(&z, vocab, 1.0, &st, &terms, &mut again)
                        .unwrap();
                }
            }
            assert_eq!(again, grad, "{kl:?}: the two-call path's gradient");
        });
        assert!(two_calls >= 2 * inputs, "{kl:?}: {two_calls} bytes");
    }
}

/// A compute shader around a storage prelude's `narrow`, the in-place backward's rounding:
/// `outputs[i] = narrow(bitcast<f32>(inputs[i]))`.
const NARROW_HARNESS: &str = "
@group(0) @binding(1) var<storage, read> inputs: array<u32>;
@group(0) @binding(2) var<storage, read_write> outputs: array<u32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) id: vec3<u32>,
        @builtin(num_workgroups) groups: vec3<u32>) {
    for (var i = id.x; i < arrayLength(&inputs); i += groups.x * 256u) {
        outputs[i] = narrow(bitcast<f32>(inputs[i]));
    }
}
";

/// `narrow(x)` of the storage prelude `prelude` for every input, run on `ctx`'s device.
fn run_narrow(ctx: &grpo_wgpu::GpuContext, prelude: &str, f16: bool, inputs: &[u32]) -> Vec<u32> {
    use wgpu::util::DeviceExt;
    let (device, queue) = (ctx.device(), ctx.queue());
    let source = format!(
        "{}{prelude}\n{NARROW_HARNESS}",
        if f16 { "enable f16;\n" } else { "" }
    );
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some("narrow"),
        source: wgpu::ShaderSource::Wgsl(source.into()),
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some("narrow"),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    });
    let bytes: Vec<u8> = inputs.iter().flat_map(|x| x.to_le_bytes()).collect();
    let size = bytes.len() as u64;
    let input = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("narrow inputs"),
        contents: &bytes,
        usage: wgpu::BufferUsages::STORAGE,
    });
    let buffer = |usage| {
        device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("narrow outputs"),
            size,
            usage,
            mapped_at_creation: false,
        })
    };
    let output = buffer(wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC);
    let staging = buffer(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST);
    let bind_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("narrow"),
        layout: &pipeline.get_bind_group_layout(0),
        entries: &[
            wgpu::BindGroupEntry {
                binding: 1,
                resource: input.as_entire_binding(),
            },
            wgpu::BindGroupEntry {
                binding: 2,
                resource: output.as_entire_binding(),
            },
        ],
    });
    let mut encoder = device.create_command_encoder(&Default::default());
    {
        let mut pass = encoder.begin_compute_pass(&Default::default());
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(1024, 1, 1);
    }
    encoder.copy_buffer_to_buffer(&output, 0, &staging, 0, size);
    queue.submit(Some(encoder.finish()));
    let (tx, rx) = std::sync::mpsc::channel();
    staging
        .slice(..)
        .map_async(wgpu::MapMode::Read, move |r| tx.send(r).unwrap());
    device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    // The wait can return before the mapping's callback ran (grpo-wgpu's `Resident::read` met
    // that on lavapipe): poll until it has.
    let mapped = loop {
        if let Ok(r) = rx.try_recv() {
            break r;
        }
        device.poll(wgpu::PollType::Poll).unwrap();
    };
    mapped.unwrap();
    let out = staging.slice(..).get_mapped_range().unwrap().to_vec();
    out.chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn in_place_rounding_is_halfs() {
    // The in-place backward rounds each f32 gradient with its storage prelude's `narrow`:
    // `half`'s `from_f32` bits (grpo-core's rounding), checked on every f32 whose low 12 bits
    // are 0x000, 0x001, 0x7ff, 0x800, 0x801 or 0xfff (6·2^20 values): every bf16 and f16
    // rounding tie and its neighbours, f16 subnormal results and their ties, overflow to ±∞,
    // ±0. WGSL leaves the bits of a NaN or infinite `bitcast<f32>` indeterminate and lets a
    // device flush f32 subnormals, so non-finite inputs give "a NaN or ±∞ of that sign" and
    // subnormal ones may also give ±0.
    let Some(ctx) = gpu::context("in_place_rounding_is_halfs") else {
        return;
    };
    let low = [0x000u32, 0x001, 0x7ff, 0x800, 0x801, 0xfff];
    let inputs: Vec<u32> = (0..1u32 << 20)
        .flat_map(|hi| low.map(|l| (hi << 12) | l))
        .collect();
    type Half = fn(f32) -> u16;
    let bf16: Half = |x| half::bf16::from_f32(x).to_bits();
    let f16: Half = |x| half::f16::from_f32(x).to_bits();
    for (name, prelude, is_f16, want) in [
        ("bf16", grpo_wgpu::shaders::LOAD_BF16, false, bf16),
        ("f16", grpo_wgpu::shaders::LOAD_F16, true, f16),
    ] {
        if is_f16 && !ctx.supports_f16() {
            eprintln!("in_place_rounding_is_halfs: f16 SKIPPED (the adapter has no SHADER_F16)");
            continue;
        }
        let got = run_narrow(ctx, prelude, is_f16, &inputs);
        let sign = |h: u32| h & 0x8000;
        for (&x, &g) in inputs.iter().zip(&got) {
            let f = f32::from_bits(x);
            let w = u32::from(want(f));
            let ok = if f.is_finite() && (f == 0.0 || f.is_normal()) {
                g == w
            } else if f.is_finite() {
                g == w || g == sign(w)
            } else {
                // ±∞ or a NaN of the input's sign (exponent all ones).
                let top = if is_f16 { 0x7c00 } else { 0x7f80 };
                g >> 16 == 0 && g & top == top && sign(g) == sign(w)
            };
            assert!(
                ok,
                "{name}: narrow({f:e} = {x:#010x}) = {g:#06x}, half gives {w:#06x}"
            );
        }
    }
}
