//! grpo-cpu's vocabulary kernels against grpo-core, bit for bit: every available backend ×
//! every row operation × f32/bf16/f16 storage × row lengths (0..=65, around multiples of 16 and
//! of the 2048-element block, 32768, 151936) × 1/2/3 threads × software prefetches on and off.
//! Errors must be the same `Err` value with every output untouched. Also every SIMD lane of
//! `exp`/`ln` against the scalar functions.

use std::sync::OnceLock;

use grpo_core::vocab::exp_ln;
use grpo_core::vocab::{
    GradTerms, JsdState, KlDirection, KlTerm, Logit, LseState, PairState, SavedState,
};
use grpo_cpu::{Backend, Cpu, Storage, math};
use proptest::prelude::*;

/// Every backend of this CPU with pools of 1, 2 and 3 threads: the 1-thread pool runs each
/// pass's default software prefetching, the 2-thread pool every pass with the opposite of the
/// backend's default and the 3-thread pool every pass with it (`Cpu::with_software_prefetch`),
/// so both settings of every pass are checked without a fourth pool.
fn cpus() -> &'static [Cpu] {
    static CPUS: OnceLock<Vec<Cpu>> = OnceLock::new();
    CPUS.get_or_init(|| {
        let mut v = Vec::new();
        for b in Backend::available() {
            let default = b.software_prefetch_default();
            for t in [1, 2, 3] {
                let cpu = Cpu::new(b).unwrap().with_threads(t).unwrap();
                v.push(match t {
                    1 => cpu,
                    2 => cpu.with_software_prefetch(!default),
                    _ => cpu.with_software_prefetch(default),
                });
            }
        }
        v
    })
}

/// Bit patterns with every NaN identified ("both NaN" counts as equal).
fn bits(x: &[f32]) -> Vec<u32> {
    x.iter()
        .map(|v| if v.is_nan() { u32::MAX } else { v.to_bits() })
        .collect()
}

fn bits_s<S: Logit>(x: &[S]) -> Vec<u32> {
    x.iter()
        .map(|v| {
            let f = v.to_f32();
            if f.is_nan() { u32::MAX } else { f.to_bits() }
        })
        .collect()
}

const SENTINEL: f32 = -7.25;

/// xorshift logits in [−s, s) with masked (−∞) entries at rate 1/`mask_every`.
fn logits(seed: u64, n: usize, scale: f32, mask_every: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            if mask_every > 0 && s.is_multiple_of(mask_every) {
                f32::NEG_INFINITY
            } else {
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 * scale - scale
            }
        })
        .collect()
}

/// One batch: student/teacher logits `[rows, vocab]` (stored as `S` and `U`), targets, weights.
struct Case<S, U = S> {
    z: Vec<S>,
    w: Vec<U>,
    vocab: usize,
    targets: Vec<u32>,
    g_lp: Vec<f32>,
    g_h: Vec<f32>,
    g_kl: Vec<f32>,
    temperature: f32,
    beta: f32,
}

impl<S: Storage> Case<S> {
    fn new(rows: usize, vocab: usize, seed: u64, temperature: f32) -> Self {
        Self::shaped(rows, vocab, seed, temperature, 9.0, 23)
    }

    /// Student logits in [−`scale`, `scale`) masked at rate 1/`mask_every` (0: never).
    fn shaped(
        rows: usize,
        vocab: usize,
        seed: u64,
        temperature: f32,
        scale: f32,
        mask_every: u64,
    ) -> Self {
        let n = rows * vocab;
        let conv = |v: Vec<f32>| v.into_iter().map(S::from_f32).collect::<Vec<S>>();
        let z = conv(logits(seed, n, scale, mask_every));
        // The teacher is masked wherever the student is (KL support), plus random values.
        let mut w = conv(logits(seed + 1, n, 7.0, 0));
        for (a, b) in z.iter().zip(w.iter_mut()) {
            if a.to_f32() == f32::NEG_INFINITY {
                *b = S::from_f32(f32::NEG_INFINITY);
            }
        }
        // Targets on unmasked logits (a masked target is an error, tested separately): the
        // first unmasked one from a start that depends on the row and the seed. A row masked
        // throughout (an error for every operation) keeps its start.
        let targets = (0..rows)
            .map(|r| {
                let row = &z[r * vocab..(r + 1) * vocab];
                let start = (r * 7919).wrapping_add(seed as usize) % vocab.max(1);
                let y = (0..vocab)
                    .map(|k| (start + k) % vocab)
                    .find(|&y| row[y].to_f32() != f32::NEG_INFINITY);
                y.unwrap_or(start) as u32
            })
            .collect();
        Case {
            z,
            w,
            vocab,
            targets,
            g_lp: (0..rows).map(|r| 1.0 - r as f32 * 0.25).collect(),
            g_h: (0..rows).map(|r| 0.5 + r as f32 * 0.125).collect(),
            g_kl: (0..rows).map(|r| -0.3 + r as f32 * 0.5).collect(),
            temperature,
            beta: 0.3,
        }
    }
}

impl<S, U> Case<S, U> {
    fn rows(&self) -> usize {
        self.targets.len()
    }
}

impl Case<f32> {
    /// The same case with the student's logits rounded to `T` and the teacher's to `W`.
    fn stored<T: Storage, W: Storage>(&self) -> Case<T, W> {
        Case {
            z: self.z.iter().map(|&x| T::from_f32(x)).collect(),
            w: self.w.iter().map(|&x| W::from_f32(x)).collect(),
            vocab: self.vocab,
            targets: self.targets.clone(),
            g_lp: self.g_lp.clone(),
            g_h: self.g_h.clone(),
            g_kl: self.g_kl.clone(),
            temperature: self.temperature,
            beta: self.beta,
        }
    }

    /// The same case with the logits rounded to bf16.
    fn to_bf16(&self) -> Case<half::bf16> {
        self.stored()
    }
}

/// The calls [`check_all`] makes of grpo-core (and of every `Cpu`): six forward (stats, two
/// log-prob, two KL, JSD), the JSD's gradient (weighted by `g_kl`) out of place and in place,
/// four backward term sets × out of place and in place, the forward
/// that saves its row states and two term sets × two backwards from them, the KL forward that
/// saves its pair states in both directions and the four term sets × two backwards from each
/// direction's states, the JSD forward that saves its states and the JSD's gradient from them
/// out of place and in place.
const CALLS: usize = 42;

/// What [`check_all`] saw: calls handed to grpo-core by the `Cpu`s, and grpo-core's `Err`s
/// among its [`CALLS`] calls.
#[derive(Debug, PartialEq)]
struct Outcome {
    fallbacks: usize,
    errors: usize,
}

/// Runs every operation on grpo-core and on every `Cpu`, comparing results and errors bit for
/// bit. Where grpo-core returns `Err`, its outputs must still hold the sentinel (in place: the
/// logits unchanged); the `Cpu`s' outputs, equal to grpo-core's, are then untouched too.
fn check_all<S: Storage + std::fmt::Debug, U: Storage + std::fmt::Debug>(
    c: &Case<S, U>,
    what: &str,
) -> Outcome {
    let rows = c.rows();
    let (v, t) = (c.vocab, c.temperature);
    let out = || vec![SENTINEL; rows];
    let grad = || vec![SENTINEL; c.z.len()];
    let (z, w) = (&c.z[..], &c.w[..]);

    // stats_rows
    let (mut l0, mut h0) = (out(), out());
    let r0 = grpo_core::vocab::stats_rows(z, v, t, &mut l0, &mut h0);
    // logprob_entropy_rows, with and without entropy
    let (mut p0, mut e0, mut q0) = (out(), out(), out());
    let s0 = grpo_core::vocab::logprob_entropy_rows(z, v, &c.targets, t, &mut p0, Some(&mut e0));
    let s0b = grpo_core::vocab::logprob_entropy_rows(z, v, &c.targets, t, &mut q0, None);
    // KL both directions, JSD
    let (mut kf0, mut kr0, mut j0) = (out(), out(), out());
    let k0f = grpo_core::vocab::kl_rows(z, w, v, t, KlDirection::StudentTeacher, &mut kf0);
    let k0r = grpo_core::vocab::kl_rows(z, w, v, t, KlDirection::TeacherStudent, &mut kr0);
    let j0r = grpo_core::vocab::jsd_rows(z, w, v, c.beta, t, &mut j0);
    let mut jg0 = grad();
    let jb0 = grpo_core::vocab::jsd_backward_rows(z, w, v, c.beta, t, &c.g_kl, &mut jg0);
    let mut jz0 = c.z.clone();
    let jbi0 = grpo_core::vocab::jsd_backward_rows_in_place(&mut jz0, w, v, c.beta, t, &c.g_kl);
    // The JSD forward that saves its states, and the JSD's gradient from them (`EMPTY` states
    // where it failed, which the backward rejects).
    let (mut js0, mut jst0) = (out(), vec![JsdState::EMPTY; rows]);
    let jsr0 = grpo_core::vocab::jsd_rows_saved(z, w, v, c.beta, t, &mut js0, &mut jst0);
    let mut jgs0 = grad();
    let jbs0 = grpo_core::vocab::jsd_backward_rows_saved(z, w, v, t, &jst0, &c.g_kl, &mut jgs0);
    let mut jzs0 = c.z.clone();
    let jbis0 =
        grpo_core::vocab::jsd_backward_rows_in_place_saved(&mut jzs0, w, v, t, &jst0, &c.g_kl);
    // backward with several term sets
    let term_sets: Vec<GradTerms<'_, u32, U>> = vec![
        GradTerms {
            logp: Some((&c.targets, &c.g_lp)),
            entropy: Some(&c.g_h),
            kl: None,
        },
        GradTerms {
            logp: None,
            entropy: Some(&c.g_h),
            kl: None,
        },
        GradTerms {
            logp: Some((&c.targets, &c.g_lp)),
            entropy: None,
            kl: Some(KlTerm {
                teacher: w,
                grad: &c.g_kl,
                direction: KlDirection::StudentTeacher,
            }),
        },
        GradTerms {
            logp: Some((&c.targets, &c.g_lp)),
            entropy: Some(&c.g_h),
            kl: Some(KlTerm {
                teacher: w,
                grad: &c.g_kl,
                direction: KlDirection::TeacherStudent,
            }),
        },
    ];
    let mut b0 = Vec::new();
    for terms in &term_sets {
        let mut g = grad();
        let r = grpo_core::vocab::backward_rows(z, v, t, terms, &mut g);
        let mut zi = c.z.clone();
        let ri = grpo_core::vocab::backward_rows_in_place(&mut zi, v, t, terms);
        b0.push((r, g, ri, zi));
    }
    // The forward that saves its row states, and the backward from them (the two term sets
    // without a KL term, the first two). Where the forward fails its states stay `EMPTY`, which the saved
    // backward rejects (after the checks that come before the states').
    let (mut ps0, mut saved0) = (out(), vec![LseState::EMPTY; rows]);
    let f0 = grpo_core::vocab::logprob_entropy_rows_saved(
        z,
        v,
        &c.targets,
        t,
        &mut ps0,
        None,
        &mut saved0,
    );
    let saved_terms = &term_sets[..2];
    let mut bs0 = Vec::new();
    for terms in saved_terms {
        let mut g = grad();
        let r = grpo_core::vocab::backward_rows_saved(z, v, t, &saved0, terms, &mut g);
        let mut zi = c.z.clone();
        let ri = grpo_core::vocab::backward_rows_in_place_saved(&mut zi, v, t, &saved0, terms);
        bs0.push((r, g, ri, zi));
    }
    // The KL forwards that save their pair states (the same states either way, except the
    // u = +∞ a KL(q‖p) call records where KL(p‖q) is infinite), and the backwards from each
    // direction's with every term set (`EMPTY` states where it failed).
    let mut kls0 = Vec::new();
    for d in [KlDirection::StudentTeacher, KlDirection::TeacherStudent] {
        let (mut o, mut st) = (out(), vec![PairState::EMPTY; rows]);
        let r = grpo_core::vocab::kl_rows_saved(z, w, v, t, d, &mut o, &mut st);
        kls0.push((d, r, o, st));
    }
    // From each direction's states: the KL(q‖p) direction's record KL(p‖q) = +∞ (`u = +∞`)
    // where that direction accepts a teacher masked where the student is not.
    let from_states = |states: &[PairState]| {
        let mut out = Vec::new();
        for terms in &term_sets {
            let mut g = grad();
            let r = grpo_core::vocab::backward_rows_saved(z, v, t, states, terms, &mut g);
            let mut zi = c.z.clone();
            let ri = grpo_core::vocab::backward_rows_in_place_saved(&mut zi, v, t, states, terms);
            out.push((r, g, ri, zi));
        }
        out
    };
    let (pairs0, pairs_qp) = (&kls0[0].3, &kls0[1].3);
    let (bp0, bq0) = (from_states(pairs0), from_states(pairs_qp));

    let untouched = |x: &[f32]| x.iter().all(|v| v.to_bits() == SENTINEL.to_bits());
    let mut errors = 0;
    for (r, outs, op) in [
        (&r0, [&l0[..], &h0[..]], "stats"),
        (&s0, [&p0[..], &e0[..]], "logprob_entropy"),
        (&s0b, [&q0[..], &q0[..]], "logprob"),
        (&k0f, [&kf0[..], &kf0[..]], "kl fwd"),
        (&k0r, [&kr0[..], &kr0[..]], "kl rev"),
        (&j0r, [&j0[..], &j0[..]], "jsd"),
        (&jb0, [&jg0[..], &jg0[..]], "jsd backward"),
        (&jsr0, [&js0[..], &js0[..]], "saving jsd"),
        (&jbs0, [&jgs0[..], &jgs0[..]], "jsd backward from states"),
    ] {
        if r.is_err() {
            errors += 1;
            assert!(
                outs.iter().all(|o| untouched(o)),
                "{what}: {op} wrote on {r:?}"
            );
        }
    }
    for (r, zi, op) in [
        (&jbi0, &jz0, "jsd backward in place"),
        (&jbis0, &jzs0, "jsd backward in place from states"),
    ] {
        if r.is_err() {
            errors += 1;
            assert_eq!(bits_s(zi), bits_s(z), "{what}: {op} wrote");
        }
    }
    if jsr0.is_err() {
        assert!(
            jst0.iter().all(|s| *s == JsdState::EMPTY),
            "{what}: jsd states"
        );
    } else if jb0.is_ok() {
        // From the states of a valid forward, the bits of the backward that recomputes them.
        assert_eq!(bits(&jgs0), bits(&jg0), "{what}: jsd saved vs recomputed");
        assert_eq!(
            bits_s(&jzs0),
            bits_s(&jz0),
            "{what}: jsd saved vs recomputed"
        );
    }
    if f0.is_err() {
        errors += 1;
        assert!(untouched(&ps0), "{what}: saved forward wrote on {f0:?}");
        assert!(
            saved0.iter().all(|s| *s == LseState::EMPTY),
            "{what}: saved states"
        );
    }
    for (d, r, o, st) in &kls0 {
        if r.is_err() {
            errors += 1;
            assert!(untouched(o), "{what}: saving kl {d:?} wrote on {r:?}");
            assert!(
                st.iter().all(|s| *s == PairState::EMPTY),
                "{what}: pair states"
            );
        }
    }
    if kls0.iter().all(|k| k.1.is_ok()) {
        let same = kls0[0].3 == kls0[1].3;
        assert!(same, "{what}: the pair states depend on the direction");
    }
    for (k, (r, g, ri, zi)) in b0.iter().chain(&bs0).chain(&bp0).chain(&bq0).enumerate() {
        if r.is_err() {
            errors += 1;
            assert!(untouched(g), "{what}: backward {k} wrote on {r:?}");
        }
        if ri.is_err() {
            errors += 1;
            assert_eq!(
                bits_s(zi),
                bits_s(z),
                "{what}: backward_in_place {k} wrote on {ri:?}"
            );
        }
    }

    let before = grpo_cpu::fallbacks_on_this_thread();
    for cpu in cpus() {
        let tag = format!("{what} {:?} threads={}", cpu.backend(), cpu.threads());
        let (mut l, mut h) = (out(), out());
        assert_eq!(cpu.stats_rows(z, v, t, &mut l, &mut h), r0, "stats {tag}");
        assert_eq!(bits(&l), bits(&l0), "stats lse {tag}");
        assert_eq!(bits(&h), bits(&h0), "stats H {tag}");

        let (mut p, mut e, mut q) = (out(), out(), out());
        let s = cpu.logprob_entropy_rows(z, v, &c.targets, t, &mut p, Some(&mut e));
        assert_eq!(s, s0, "logprob_entropy {tag}");
        assert_eq!(bits(&p), bits(&p0), "logp {tag}");
        assert_eq!(bits(&e), bits(&e0), "entropy {tag}");
        let sb = cpu.logprob_entropy_rows(z, v, &c.targets, t, &mut q, None);
        assert_eq!(sb, s0b, "logprob {tag}");
        assert_eq!(bits(&q), bits(&q0), "logp only {tag}");

        let (mut kf, mut kr, mut j) = (out(), out(), out());
        assert_eq!(
            cpu.kl_rows(z, w, v, t, KlDirection::StudentTeacher, &mut kf),
            k0f,
            "kl fwd {tag}"
        );
        assert_eq!(bits(&kf), bits(&kf0), "kl fwd {tag}");
        assert_eq!(
            cpu.kl_rows(z, w, v, t, KlDirection::TeacherStudent, &mut kr),
            k0r,
            "kl rev {tag}"
        );
        assert_eq!(bits(&kr), bits(&kr0), "kl rev {tag}");
        assert_eq!(cpu.jsd_rows(z, w, v, c.beta, t, &mut j), j0r, "jsd {tag}");
        assert_eq!(bits(&j), bits(&j0), "jsd {tag}");
        let mut jg = grad();
        let jb = cpu.jsd_backward_rows(z, w, v, c.beta, t, &c.g_kl, &mut jg);
        assert_eq!(jb, jb0, "jsd backward {tag}");
        assert_eq!(bits(&jg), bits(&jg0), "jsd backward {tag}");
        let mut jz = c.z.clone();
        let jbi = cpu.jsd_backward_rows_in_place(&mut jz, w, v, c.beta, t, &c.g_kl);
        assert_eq!(jbi, jbi0, "jsd backward in place {tag}");
        assert_eq!(bits_s(&jz), bits_s(&jz0), "jsd backward in place {tag}");
        let (mut js, mut jst) = (out(), vec![JsdState::EMPTY; rows]);
        let jsr = cpu.jsd_rows_saved(z, w, v, c.beta, t, &mut js, &mut jst);
        assert_eq!(jsr, jsr0, "saving jsd {tag}");
        assert_eq!(bits(&js), bits(&js0), "saving jsd {tag}");
        let state_bits = |x: &[JsdState]| -> Vec<[u32; 6]> {
            x.iter()
                .map(|s| {
                    let (a, b) = (&s.student, &s.teacher);
                    [a.max, a.neg_ln_sum, b.max, b.neg_ln_sum, s.beta, s.kl_pm].map(f32::to_bits)
                })
                .collect()
        };
        assert_eq!(state_bits(&jst), state_bits(&jst0), "jsd states {tag}");
        let mut jg = grad();
        let jbs = cpu.jsd_backward_rows_saved(z, w, v, t, &jst0, &c.g_kl, &mut jg);
        assert_eq!(jbs, jbs0, "jsd backward from states {tag}");
        assert_eq!(bits(&jg), bits(&jgs0), "jsd backward from states {tag}");
        let mut jz = c.z.clone();
        let jbis = cpu.jsd_backward_rows_in_place_saved(&mut jz, w, v, t, &jst0, &c.g_kl);
        assert_eq!(jbis, jbis0, "jsd backward in place from states {tag}");
        assert_eq!(
            bits_s(&jz),
            bits_s(&jzs0),
            "jsd backward in place from states {tag}"
        );

        for (k, terms) in term_sets.iter().enumerate() {
            let (r_ref, g_ref, ri_ref, zi_ref) = &b0[k];
            let mut g = grad();
            assert_eq!(
                &cpu.backward_rows(z, v, t, terms, &mut g),
                r_ref,
                "backward {k} {tag}"
            );
            assert_eq!(bits(&g), bits(g_ref), "backward {k} {tag}");
            let mut zi = c.z.clone();
            assert_eq!(
                &cpu.backward_rows_in_place(&mut zi, v, t, terms),
                ri_ref,
                "backward_in_place {k} {tag}"
            );
            assert_eq!(bits_s(&zi), bits_s(zi_ref), "backward_in_place {k} {tag}");
        }

        let (mut ps, mut saved) = (out(), vec![LseState::EMPTY; rows]);
        let f = cpu.logprob_entropy_rows_saved(z, v, &c.targets, t, &mut ps, None, &mut saved);
        assert_eq!(f, f0, "saved forward {tag}");
        assert_eq!(bits(&ps), bits(&ps0), "saved forward logp {tag}");
        assert_eq!(saved, saved0, "saved states {tag}");
        for (k, terms) in saved_terms.iter().enumerate() {
            let (r_ref, g_ref, ri_ref, zi_ref) = &bs0[k];
            let mut g = grad();
            let r = cpu.backward_rows_saved(z, v, t, &saved0, terms, &mut g);
            assert_eq!(&r, r_ref, "saved backward {k} {tag}");
            assert_eq!(bits(&g), bits(g_ref), "saved backward {k} {tag}");
            let mut zi = c.z.clone();
            let ri = cpu.backward_rows_in_place_saved(&mut zi, v, t, &saved0, terms);
            assert_eq!(&ri, ri_ref, "saved backward_in_place {k} {tag}");
            assert_eq!(
                bits_s(&zi),
                bits_s(zi_ref),
                "saved backward_in_place {k} {tag}"
            );
            // From the states of a valid forward, the bits of the backward that recomputes
            // them.
            if f0.is_ok() && b0[k].0.is_ok() {
                assert_eq!(bits(&g), bits(&b0[k].1), "saved vs recomputed {k} {tag}");
                assert_eq!(
                    bits_s(&zi),
                    bits_s(&b0[k].3),
                    "saved vs recomputed {k} {tag}"
                );
            }
        }

        for (d, r_ref, o_ref, st_ref) in &kls0 {
            let (mut o, mut st) = (out(), vec![PairState::EMPTY; rows]);
            let r = cpu.kl_rows_saved(z, w, v, t, *d, &mut o, &mut st);
            assert_eq!(&r, r_ref, "saving kl {d:?} {tag}");
            assert_eq!(bits(&o), bits(o_ref), "saving kl {d:?} {tag}");
            let pair_bits = |x: &[PairState]| -> Vec<[u32; 8]> {
                x.iter()
                    .map(|s| [s.zmax, s.sz, s.tz, s.wmax, s.sw, s.tw, s.u, s.v].map(f32::to_bits))
                    .collect()
            };
            assert_eq!(pair_bits(&st), pair_bits(st_ref), "pair states {d:?} {tag}");
        }
        for (k, terms) in term_sets.iter().enumerate() {
            // From each direction's states: the same Err, or the same bits.
            let mut outs = Vec::new();
            for (states, refs, from) in [(pairs0, &bp0, "KL(p‖q)"), (pairs_qp, &bq0, "KL(q‖p)")]
            {
                let (r_ref, g_ref, ri_ref, zi_ref) = &refs[k];
                let mut g = grad();
                let r = cpu.backward_rows_saved(z, v, t, states, terms, &mut g);
                assert_eq!(&r, r_ref, "{from}-saved backward {k} {tag}");
                assert_eq!(bits(&g), bits(g_ref), "{from}-saved backward {k} {tag}");
                let mut zi = c.z.clone();
                let ri = cpu.backward_rows_in_place_saved(&mut zi, v, t, states, terms);
                assert_eq!(&ri, ri_ref, "{from}-saved backward_in_place {k} {tag}");
                assert_eq!(
                    bits_s(&zi),
                    bits_s(zi_ref),
                    "{from}-saved backward_in_place {k} {tag}"
                );
                outs.push((g, zi));
            }
            let (g, zi) = &outs[0];
            // From the states of a valid KL forward, the bits of the backward that recomputes
            // them — the KL term's in either direction, and the terms without one.
            if kls0[0].1.is_ok() && b0[k].0.is_ok() {
                assert_eq!(
                    bits(g),
                    bits(&b0[k].1),
                    "pair-saved vs recomputed {k} {tag}"
                );
                assert_eq!(
                    bits_s(zi),
                    bits_s(&b0[k].3),
                    "pair-saved vs recomputed {k} {tag}"
                );
            }
        }
    }
    // Calls handed to grpo-core (validation failures); valid input must never be among them.
    // (Pathological valid input whose row statistics overflow — e.g. a logit of 5e29 at
    // T = 4, where z/T − max/T is a rounding residue of 1e21 — may be handed over: grpo-core
    // accepts it and the bits are the same either way.)
    let fallbacks = grpo_cpu::fallbacks_on_this_thread() - before;
    let finite = |x: &[f32]| x.iter().all(|v| v.is_finite());
    let all_ok = r0.is_ok()
        && finite(&l0)
        && finite(&h0)
        && s0.is_ok()
        && s0b.is_ok()
        && k0f.is_ok()
        && k0r.is_ok()
        && j0r.is_ok()
        && jb0.is_ok()
        && jbi0.is_ok()
        && jsr0.is_ok()
        && jbs0.is_ok()
        && jbis0.is_ok()
        && f0.is_ok()
        && kls0.iter().all(|k| k.1.is_ok())
        && b0
            .iter()
            .chain(&bs0)
            .chain(&bp0)
            .chain(&bq0)
            .all(|b| b.0.is_ok() && b.2.is_ok());
    if all_ok {
        assert_eq!(fallbacks, 0, "{what}: valid input took the grpo-core path");
    }
    Outcome { fallbacks, errors }
}

/// Row lengths 0..=65 and around multiples of 16 and of the block. The step loops take four
/// chunks of 16 per iteration (two on lanes with few registers) and the rest one at a time:
/// 80 (five chunks), 111 (six and a tail) and 2128 (a whole block, then five chunks) leave one
/// and two chunks after whole groups of four, 127, 255 and 2047 three.
fn check_lengths<S: Storage + std::fmt::Debug>(name: &str) {
    let mut lens: Vec<usize> = (0..=65).collect();
    lens.extend([
        80, 111, 127, 128, 129, 255, 256, 257, 2047, 2048, 2049, 2128, 4095, 4096, 4097, 6161,
    ]);
    for &v in &lens {
        for (seed, temp) in [(1u64, 1.0f32), (2, 0.7)] {
            let c = Case::<S>::new(3, v, seed + v as u64, temp);
            let seen = check_all(&c, &format!("{name} V={v} T={temp}"));
            // V = 0 is an error for every operation; everything else is valid input.
            assert_eq!(seen.fallbacks == 0, v > 0, "{name} V={v}");
            assert_eq!(seen.errors, if v > 0 { 0 } else { CALLS }, "{name} V={v}");
        }
    }
}

#[test]
fn f32_rows_of_every_length_match_core() {
    check_lengths::<f32>("f32");
}

#[test]
fn bf16_rows_of_every_length_match_core() {
    check_lengths::<half::bf16>("bf16");
}

#[test]
fn f16_rows_of_every_length_match_core() {
    check_lengths::<half::f16>("f16");
}

#[test]
fn long_rows_match_core() {
    for v in [32768usize, 151936] {
        check_all(&Case::<f32>::new(2, v, 5, 1.0), &format!("f32 V={v}"));
        check_all(
            &Case::<half::bf16>::new(2, v, 6, 0.9),
            &format!("bf16 V={v}"),
        );
    }
    check_all(&Case::<half::f16>::new(2, 32768, 8, 1.0), "f16 V=32768");
    check_all(&Case::<half::f16>::new(1, 151936, 7, 1.0), "f16 V=151936");
}

/// Random masking can mask a whole row when rows are short (here V = 1, masked at rate 1/23):
/// the case builder must still pick targets (it searched for an unmasked logit without end
/// before, which hung `random_batches_match_core` when proptest drew such a case), and every
/// operation reports grpo-core's error for the row.
#[test]
fn rows_masked_throughout_by_the_generator_are_errors_everywhere() {
    let seed = (0..10_000u64)
        .find(|&s| logits(s, 1, 9.0, 23)[0] == f32::NEG_INFINITY)
        .expect("a seed that masks the first logit");
    let c = Case::<f32>::shaped(3, 1, seed, 1.0, 9.0, 23);
    assert_eq!(c.z[0], f32::NEG_INFINITY, "row 0 is masked throughout");
    // Every one of grpo-core's calls reads row 0 and fails (the backwards from saved states
    // because the saving forward did); every Cpu hands each to it.
    let seen = check_all(&c, "V = 1, row 0 masked");
    assert_eq!(seen.errors, CALLS);
    assert_eq!(seen.fallbacks, CALLS * cpus().len());
    check_all(&c.to_bf16(), "V = 1, row 0 masked, bf16");
}

/// Each invalid input, in every storage type: grpo-core's `Err`s (counted among its [`CALLS`]:
/// only the calls that read the bad value or parameter fail), the same `Err` from every `Cpu`,
/// and every output untouched ([`check_all`]).
fn errors_in<S: Storage + std::fmt::Debug>(name: &str) {
    let case = || Case::<S>::new(4, 40, 11, 1.0);
    let set = |x: &mut [S], i: usize, v: f32| x[i] = S::from_f32(v);
    let ninf = f32::NEG_INFINITY;
    // Calls that read the teacher: both KLs, the JSD and its two gradients, two KL term sets ×
    // two backwards, both saving KLs — and the sixteen backwards from their pair states —, the
    // saving JSD and the two gradients from its states.
    const TEACHER: usize = 30;
    // Calls that take targets: two forward, three term sets × two backwards, the saving
    // forward — and the four backwards from its states — and three term sets × two
    // backwards from each direction's pair states.
    const TARGETS: usize = 25;
    let expect = |c: &Case<S>, what: &str, errors: usize| {
        let seen = check_all(c, &format!("{name} {what}"));
        assert_eq!(seen.errors, errors, "{name} {what}: grpo-core's Err count");
        seen
    };

    let mut nan = case();
    set(&mut nan.z, 2 * 40 + 17, f32::NAN);
    // Every operation per Cpu must have detected it and handed the call to grpo-core.
    let seen = expect(&nan, "NaN logit", CALLS);
    assert_eq!(seen.fallbacks, CALLS * cpus().len(), "{name} NaN logit");
    let mut nan_w = case();
    set(&mut nan_w.w, 3 * 40 + 39, f32::NAN);
    expect(&nan_w, "NaN teacher", TEACHER);
    let mut inf = case();
    set(&mut inf.z, 2 * 40 + 3, f32::INFINITY);
    expect(&inf, "+inf logit", CALLS);
    let mut inf_w = case();
    set(&mut inf_w.w, 40 + 39, f32::INFINITY);
    expect(&inf_w, "+inf teacher", TEACHER);
    let mut masked = case();
    masked.z[40..80].fill(S::from_f32(ninf));
    expect(&masked, "masked row", CALLS);
    let mut masked_w = case();
    masked_w.w[80..120].fill(S::from_f32(ninf));
    expect(&masked_w, "masked teacher row", TEACHER);
    let mut tgt = case();
    let y = tgt.targets[3] as usize;
    set(&mut tgt.z, 3 * 40 + y, ninf);
    set(&mut tgt.w, 3 * 40 + y, ninf);
    expect(&tgt, "masked target", TARGETS);
    let mut oob = case();
    oob.targets[1] = 40;
    expect(&oob, "target out of range", TARGETS);
    let mut sup = case();
    set(&mut sup.w, 2 * 40 + 5, ninf); // KL(p‖q) support violated
    set(&mut sup.z, 3 * 40 + 6, ninf); // KL(q‖p) support violated
    // Each KL direction once, and its term set in both backwards, each saving KL once, and
    // the sixteen backwards from the (failed) pair states of both directions; the JSD has no
    // support rule.
    expect(&sup, "support", 24);
    // Only the teacher masked where the student is not: KL(p‖q)'s forward, its term set in
    // both backwards and its saving forward fail (4), and the eight backwards from the failed
    // KL(p‖q) states; the KL(q‖p) direction's states record KL(p‖q) = +∞, so its KL(p‖q)
    // term set fails in both backwards from them too (2), where before it wrote a huge
    // finite gradient.
    let mut pq = case();
    set(&mut pq.w, 2 * 40 + 5, ninf);
    expect(&pq, "KL(p‖q) support", 14);
    let mut huge = Case::<S>::new(4, 40, 11, 1e-30);
    set(&mut huge.z, 0, 3e38); // +∞ in f16: rejected either way
    expect(&huge, "max/T overflow", CALLS);
    for t in [0.0f32, -1.0, f32::NAN, f32::INFINITY, 1e-40] {
        let mut c = case();
        c.temperature = t;
        expect(&c, &format!("temperature {t}"), CALLS);
    }
    let mut small = case();
    // Valid for the forward operations (|z|/T stays far below f32::MAX), but gradients scale
    // with 1/T and the backwards require T ≥ 1e-6: all twenty-eight backward calls and the
    // JSD's four gradients fail.
    small.temperature = 1e-7;
    expect(&small, "temperature 1e-7", 32);
    let mut beta = case();
    beta.beta = 1.0;
    // The JSD, its two gradients, the saving JSD and the two gradients from its (empty) states.
    expect(&beta, "beta = 1", 6);
    let mut wts = case();
    wts.g_lp[2] = f32::NAN;
    // The ten term sets with a log-prob term (one from saved row states, three from each
    // direction's saved pair states), out of place and in place.
    expect(&wts, "NaN logp weight", 20);
    let mut big = case();
    big.g_kl[1] = 2e9;
    // The two KL term sets, recomputing and from both directions' pair states, out of place
    // and in place, and the JSD's four gradients (which take the same weights).
    expect(&big, "KL weight too large", 16);
    let mut short = case();
    short.z.pop();
    expect(&short, "short logits", CALLS);
    let mut short_w = case();
    short_w.w.truncate(100);
    expect(&short_w, "short teacher", TEACHER);
    let seen = expect(&case(), "valid", 0);
    assert_eq!(seen.fallbacks, 0, "{name} valid");
}

#[test]
fn errors_match_core_and_leave_outputs_untouched() {
    errors_in::<f32>("f32");
    errors_in::<half::bf16>("bf16");
    errors_in::<half::f16>("f16");
}

/// Output slices of the wrong length: every `Cpu` returns grpo-core's `LengthMismatch` and
/// writes nothing (the row count comes from `targets.len()` where there are targets, else
/// `logits.len() / vocab`: 4 here).
#[test]
fn wrong_output_lengths_match_core_and_leave_outputs_untouched() {
    type Call<'a> =
        &'a dyn Fn(Option<&Cpu>, &mut [f32], &mut [f32]) -> Result<(), grpo_core::Error>;
    let c = Case::<f32>::new(4, 40, 11, 1.0);
    let (z, w, v, t, y) = (&c.z[..], &c.w[..], c.vocab, c.temperature, &c.targets[..]);
    let terms = GradTerms {
        logp: Some((y, &c.g_lp[..])),
        entropy: Some(&c.g_h[..]),
        kl: None::<KlTerm<'_, f32>>,
    };
    let stats = |cpu: Option<&Cpu>, a: &mut [f32], b: &mut [f32]| match cpu {
        None => grpo_core::vocab::stats_rows(z, v, t, a, b),
        Some(cpu) => cpu.stats_rows(z, v, t, a, b),
    };
    let fused = |cpu: Option<&Cpu>, a: &mut [f32], b: &mut [f32]| match cpu {
        None => grpo_core::vocab::logprob_entropy_rows(z, v, y, t, a, Some(b)),
        Some(cpu) => cpu.logprob_entropy_rows(z, v, y, t, a, Some(b)),
    };
    let logprob = |cpu: Option<&Cpu>, a: &mut [f32], _: &mut [f32]| match cpu {
        None => grpo_core::vocab::logprob_entropy_rows(z, v, y, t, a, None),
        Some(cpu) => cpu.logprob_entropy_rows(z, v, y, t, a, None),
    };
    let kl = |cpu: Option<&Cpu>, a: &mut [f32], _: &mut [f32]| match cpu {
        None => grpo_core::vocab::kl_rows(z, w, v, t, KlDirection::TeacherStudent, a),
        Some(cpu) => cpu.kl_rows(z, w, v, t, KlDirection::TeacherStudent, a),
    };
    let jsd = |cpu: Option<&Cpu>, a: &mut [f32], _: &mut [f32]| match cpu {
        None => grpo_core::vocab::jsd_rows(z, w, v, 0.5, t, a),
        Some(cpu) => cpu.jsd_rows(z, w, v, 0.5, t, a),
    };
    // The JSD's gradient with `b.len()` weights.
    let jsd_grad = |cpu: Option<&Cpu>, a: &mut [f32], b: &mut [f32]| {
        let g = vec![0.5f32; b.len()];
        match cpu {
            None => grpo_core::vocab::jsd_backward_rows(z, w, v, 0.5, t, &g, a),
            Some(cpu) => cpu.jsd_backward_rows(z, w, v, 0.5, t, &g, a),
        }
    };
    let backward = |cpu: Option<&Cpu>, a: &mut [f32], _: &mut [f32]| match cpu {
        None => grpo_core::vocab::backward_rows(z, v, t, &terms, a),
        Some(cpu) => cpu.backward_rows(z, v, t, &terms, a),
    };
    // The saving forward with `b.len()` states (its `b`; `EMPTY` where not written).
    let saving = |cpu: Option<&Cpu>, a: &mut [f32], b: &mut [f32]| {
        let mut st = vec![LseState::EMPTY; b.len()];
        let r = match cpu {
            None => grpo_core::vocab::logprob_entropy_rows_saved(z, v, y, t, a, None, &mut st),
            Some(cpu) => cpu.logprob_entropy_rows_saved(z, v, y, t, a, None, &mut st),
        };
        let written = st.iter().filter(|s| **s != LseState::EMPTY).count();
        b.fill(if written == 0 { SENTINEL } else { 0.0 });
        r
    };
    let mut saved = vec![LseState::EMPTY; 4];
    grpo_core::vocab::logprob_entropy_rows_saved(z, v, y, t, &mut [0.0; 4], None, &mut saved)
        .unwrap();
    let lse_terms: GradTerms<'_, u32> = GradTerms {
        logp: Some((y, &c.g_lp[..])),
        entropy: Some(&c.g_h[..]),
        kl: None,
    };
    // The backward from saved states, with `b.len()` of them.
    let from_saved = |cpu: Option<&Cpu>, a: &mut [f32], b: &mut [f32]| {
        let st = &saved[..b.len()];
        match cpu {
            None => grpo_core::vocab::backward_rows_saved(z, v, t, st, &lse_terms, a),
            Some(cpu) => cpu.backward_rows_saved(z, v, t, st, &lse_terms, a),
        }
    };
    // The saving KL forward with `b.len()` pair states (as `saving`).
    let saving_kl = |cpu: Option<&Cpu>, a: &mut [f32], b: &mut [f32]| {
        let mut st = vec![PairState::EMPTY; b.len()];
        let d = KlDirection::StudentTeacher;
        let r = match cpu {
            None => grpo_core::vocab::kl_rows_saved(z, w, v, t, d, a, &mut st),
            Some(cpu) => cpu.kl_rows_saved(z, w, v, t, d, a, &mut st),
        };
        let written = st.iter().filter(|s| **s != PairState::EMPTY).count();
        b.fill(if written == 0 { SENTINEL } else { 0.0 });
        r
    };
    let mut pairs = vec![PairState::EMPTY; 4];
    let d = KlDirection::StudentTeacher;
    grpo_core::vocab::kl_rows_saved(z, w, v, t, d, &mut [0.0; 4], &mut pairs).unwrap();
    let kl_terms: GradTerms<'_, u32> = GradTerms {
        logp: Some((y, &c.g_lp[..])),
        entropy: None,
        kl: Some(KlTerm {
            teacher: w,
            grad: &c.g_kl[..],
            direction: d,
        }),
    };
    // The backward from saved pair states, with `b.len()` of them.
    let from_pairs = |cpu: Option<&Cpu>, a: &mut [f32], b: &mut [f32]| {
        let st = &pairs[..b.len()];
        match cpu {
            None => grpo_core::vocab::backward_rows_saved(z, v, t, st, &kl_terms, a),
            Some(cpu) => cpu.backward_rows_saved(z, v, t, st, &kl_terms, a),
        }
    };
    // The saving JSD with `b.len()` states (as `saving`).
    let saving_jsd = |cpu: Option<&Cpu>, a: &mut [f32], b: &mut [f32]| {
        let mut st = vec![JsdState::EMPTY; b.len()];
        let r = match cpu {
            None => grpo_core::vocab::jsd_rows_saved(z, w, v, 0.5, t, a, &mut st),
            Some(cpu) => cpu.jsd_rows_saved(z, w, v, 0.5, t, a, &mut st),
        };
        let written = st.iter().filter(|s| **s != JsdState::EMPTY).count();
        b.fill(if written == 0 { SENTINEL } else { 0.0 });
        r
    };
    let mut jsd_states = vec![JsdState::EMPTY; 4];
    grpo_core::vocab::jsd_rows_saved(z, w, v, 0.5, t, &mut [0.0; 4], &mut jsd_states).unwrap();
    // The JSD's gradient from its saved states, with `b.len()` of them (and four weights).
    let from_jsd_states = |cpu: Option<&Cpu>, a: &mut [f32], b: &mut [f32]| {
        let (st, g) = (&jsd_states[..b.len()], [0.5f32; 4]);
        match cpu {
            None => grpo_core::vocab::jsd_backward_rows_saved(z, w, v, t, st, &g, a),
            Some(cpu) => cpu.jsd_backward_rows_saved(z, w, v, t, st, &g, a),
        }
    };
    // (operation, first output's length, second output's length)
    let calls: [(&str, Call<'_>, usize, usize); 23] = [
        ("stats, short lse", &stats, 3, 4),
        ("stats, long entropy", &stats, 4, 5),
        ("logprob_entropy, short logp", &fused, 3, 4),
        ("logprob_entropy, long entropy", &fused, 4, 5),
        ("logprob, long logp", &logprob, 5, 0),
        ("kl, short", &kl, 3, 0),
        ("jsd, long", &jsd, 5, 0),
        ("jsd gradient, short out", &jsd_grad, 159, 4),
        ("jsd gradient, long weights", &jsd_grad, 160, 5),
        ("backward, short", &backward, 159, 0),
        ("backward, long", &backward, 161, 0),
        ("saving forward, short states", &saving, 4, 3),
        ("saving forward, long logp", &saving, 5, 4),
        ("backward from saved states, short out", &from_saved, 159, 4),
        (
            "backward from saved states, short states",
            &from_saved,
            160,
            3,
        ),
        ("saving kl, short states", &saving_kl, 4, 3),
        ("saving kl, long kl", &saving_kl, 5, 4),
        ("backward from pair states, long out", &from_pairs, 161, 4),
        (
            "backward from pair states, short states",
            &from_pairs,
            160,
            3,
        ),
        ("saving jsd, short states", &saving_jsd, 4, 3),
        ("saving jsd, long jsd", &saving_jsd, 5, 4),
        (
            "jsd gradient from states, short out",
            &from_jsd_states,
            159,
            4,
        ),
        (
            "jsd gradient from states, short states",
            &from_jsd_states,
            160,
            3,
        ),
    ];
    let untouched = |x: &[f32]| x.iter().all(|v| v.to_bits() == SENTINEL.to_bits());
    for (what, call, n_a, n_b) in calls {
        let (mut a, mut b) = (vec![SENTINEL; n_a], vec![SENTINEL; n_b]);
        let want = call(None, &mut a, &mut b);
        assert!(
            matches!(want, Err(grpo_core::Error::LengthMismatch { .. })),
            "{what}: grpo-core gave {want:?}"
        );
        assert!(untouched(&a) && untouched(&b), "{what}: grpo-core wrote");
        for cpu in cpus() {
            let tag = format!("{what} {:?} threads={}", cpu.backend(), cpu.threads());
            let (mut a, mut b) = (vec![SENTINEL; n_a], vec![SENTINEL; n_b]);
            assert_eq!(call(Some(cpu), &mut a, &mut b), want, "{tag}");
            assert!(untouched(&a) && untouched(&b), "{tag}: wrote");
        }
    }
}

/// The gradients from saved states do not validate the logits (grpo-core's precondition:
/// those the states were saved from). Given others — NaN, ±∞, a logit above its row's saved
/// reference (a log-probability of about 34), one whose log-probability is 88.7 (just past
/// the exponential's domain, where AVX-512's `vscalefps` rounds `p·2^128` to a finite value
/// and a power of two from exponent bits is +∞), one 1000 (far past it), one far below —
/// every backend still gives grpo-core's result (NaN as NaN), out of place and in place, for
/// the JSD's states and for `backward_rows_saved`'s log-softmax states and pair states (both
/// KL directions, with log-probability and entropy terms): the gradients clamp their
/// exponentials' arguments at `D_MAX` = 88 (`exp_ln::clamp_grad_arg`). The JSD's gradient has
/// a fast form, which a block whose values leave its domain must not take; the other gradient
/// always takes the reference's.
#[test]
fn gradients_from_states_of_other_logits_match_core() {
    type Out<'a> =
        &'a dyn Fn(Option<&Cpu>, &[f32], &[f32], &mut [f32]) -> Result<(), grpo_core::Error>;
    type Over<'a> =
        &'a dyn Fn(Option<&Cpu>, &mut [half::bf16], &[f32]) -> Result<(), grpo_core::Error>;
    let vocab = 2 * 2048 + 40;
    let (z, w) = (logits(31, 2 * vocab, 6.0, 0), logits(32, 2 * vocab, 6.0, 0));
    let (t, ys) = (0.8, [5u32, vocab as u32 - 3]);
    let (g_lp, g_h, g_kl) = ([1.5f32, -0.5], [-0.01f32, 0.3], [0.7f32, -1.1]);
    let mut jsd_st = vec![JsdState::EMPTY; 2];
    grpo_core::vocab::jsd_rows_saved(&z, &w, vocab, 0.4, t, &mut [0.0; 2], &mut jsd_st).unwrap();
    let mut lse_st = vec![LseState::EMPTY; 2];
    let (mut lp, mut h) = ([0.0; 2], [0.0; 2]);
    grpo_core::vocab::logprob_entropy_rows_saved(
        &z,
        vocab,
        &ys,
        t,
        &mut lp,
        Some(&mut h),
        &mut lse_st,
    )
    .unwrap();
    let mut pair_st = [vec![PairState::EMPTY; 2], vec![PairState::EMPTY; 2]];
    let dirs = [KlDirection::StudentTeacher, KlDirection::TeacherStudent];
    for (st, dir) in pair_st.iter_mut().zip(dirs) {
        grpo_core::vocab::kl_rows_saved(&z, &w, vocab, t, dir, &mut [0.0; 2], st).unwrap();
    }
    let (ys, g_kl) = (&ys[..], &g_kl[..]);
    let g = [&g_lp[..], &g_h[..], g_kl];
    let jsd: Out<'_> = &|cpu, zz, ww, out| match cpu {
        None => grpo_core::vocab::jsd_backward_rows_saved(zz, ww, vocab, t, &jsd_st, g_kl, out),
        Some(cpu) => cpu.jsd_backward_rows_saved(zz, ww, vocab, t, &jsd_st, g_kl, out),
    };
    let jsd_over: Over<'_> = &|cpu, zz, ww| match cpu {
        None => grpo_core::vocab::jsd_backward_rows_in_place_saved(zz, ww, vocab, t, &jsd_st, g_kl),
        Some(cpu) => cpu.jsd_backward_rows_in_place_saved(zz, ww, vocab, t, &jsd_st, g_kl),
    };
    let (lse, lse_over) = from_states(&lse_st, g, ys, vocab, t, None);
    let (fwd, fwd_over) = from_states(&pair_st[0], g, ys, vocab, t, Some(dirs[0]));
    let (rev, rev_over) = from_states(&pair_st[1], g, ys, vocab, t, Some(dirs[1]));
    // (name, out of place, in place, whether it reads the teacher)
    let ops: [(&str, Out<'_>, Over<'_>, bool); 4] = [
        ("jsd", jsd, jsd_over, true),
        ("log-softmax states", &lse, &lse_over, false),
        ("pair states, KL(p‖q)", &fwd, &fwd_over, true),
        ("pair states, KL(q‖p)", &rev, &rev_over, true),
    ];

    // A student logit of row 0 whose log-probability under its log-softmax state is 88.7 (in
    // f32; its bf16 rounding, in place, moves it by up to about 0.3, past the clamp all the same).
    let st = lse_st[0];
    let past_domain = st.max + (88.7 + st.sum.ln()) * t;
    let cases: [(&str, usize, f32, bool); 13] = [
        ("student +inf", 2200, f32::INFINITY, true),
        ("teacher +inf", vocab + 9, f32::INFINITY, false),
        (
            "student just past the exponential's domain",
            2300,
            past_domain,
            true,
        ),
        ("student far above", vocab + 2500, 1.0e3, true),
        ("teacher far above", 4100, 1.0e3, false),
        ("teacher NaN", 40, f32::NAN, false),
        ("teacher -inf", 7, f32::NEG_INFINITY, false),
        ("student -inf", 3000, f32::NEG_INFINITY, true),
        ("student NaN", vocab + 100, f32::NAN, true),
        ("student above its reference", 2100, 40.0, true),
        ("teacher above its reference", vocab + 5, 40.0, false),
        ("student far below", vocab + 4000, -1.0e30, true),
        ("teacher far below", 4000, -1.0e30, false),
    ];
    for (what, i, x, student) in cases {
        let (mut zz, mut ww) = (z.clone(), w.clone());
        if student {
            zz[i] = x;
        } else {
            ww[i] = x;
        }
        let zb: Vec<half::bf16> = zz.iter().map(|&v| half::bf16::from_f32(v)).collect();
        for (op, out_of_place, in_place, reads_teacher) in ops {
            if !student && !reads_teacher {
                continue;
            }
            let mut want = vec![0f32; z.len()];
            out_of_place(None, &zz, &ww, &mut want).unwrap();
            let mut want_b = zb.clone();
            in_place(None, &mut want_b, &ww).unwrap();
            for cpu in cpus() {
                let tag = format!(
                    "{what}, {op}: {:?} threads={}",
                    cpu.backend(),
                    cpu.threads()
                );
                let mut got = vec![SENTINEL; z.len()];
                out_of_place(Some(cpu), &zz, &ww, &mut got).unwrap();
                assert_eq!(bits(&got), bits(&want), "{tag}");
                let mut got_b = zb.clone();
                in_place(Some(cpu), &mut got_b, &ww).unwrap();
                assert_eq!(bits_s(&got_b), bits_s(&want_b), "{tag} in place, bf16");
            }
        }
    }
}

/// `backward_rows_saved` (out of place) and `backward_rows_in_place_saved` (bf16) from the
/// states `st`, with log-probability and entropy terms and a KL term towards the teacher
/// logits in direction `dir`: grpo-core's for `None`, else the given `Cpu`'s.
#[allow(clippy::type_complexity)]
fn from_states<'a, St: SavedState + Sync>(
    st: &'a [St],
    g: [&'a [f32]; 3],
    ys: &'a [u32],
    vocab: usize,
    t: f32,
    dir: Option<KlDirection>,
) -> (
    impl Fn(Option<&Cpu>, &[f32], &[f32], &mut [f32]) -> Result<(), grpo_core::Error> + 'a,
    impl Fn(Option<&Cpu>, &mut [half::bf16], &[f32]) -> Result<(), grpo_core::Error> + 'a,
) {
    // Lifetimes a closure cannot name: the terms borrow `w`, the call's argument.
    fn terms<'b>(
        g: [&'b [f32]; 3],
        ys: &'b [u32],
        w: &'b [f32],
        dir: Option<KlDirection>,
    ) -> GradTerms<'b, u32> {
        let kl = dir.map(|direction| KlTerm {
            teacher: w,
            grad: g[2],
            direction,
        });
        GradTerms {
            logp: Some((ys, g[0])),
            entropy: Some(g[1]),
            kl,
        }
    }
    let out_of_place = move |cpu: Option<&Cpu>, z: &[f32], w: &[f32], out: &mut [f32]| match cpu {
        None => grpo_core::vocab::backward_rows_saved(z, vocab, t, st, &terms(g, ys, w, dir), out),
        Some(cpu) => cpu.backward_rows_saved(z, vocab, t, st, &terms(g, ys, w, dir), out),
    };
    let in_place = move |cpu: Option<&Cpu>, z: &mut [half::bf16], w: &[f32]| match cpu {
        None => {
            grpo_core::vocab::backward_rows_in_place_saved(z, vocab, t, st, &terms(g, ys, w, dir))
        }
        Some(cpu) => cpu.backward_rows_in_place_saved(z, vocab, t, st, &terms(g, ys, w, dir)),
    };
    (out_of_place, in_place)
}

/// Student and teacher stored as different types (a bf16 policy against an f32 teacher, an f32
/// student against an f16 teacher): the pair operations and the KL backward equal grpo-core.
#[test]
fn mixed_storage_pairs_match_core() {
    for v in [1usize, 15, 16, 17, 40, 2049, 4097] {
        for (seed, temp) in [(3u64, 1.0f32), (4, 0.7)] {
            let c = Case::<f32>::new(3, v, seed + v as u64, temp);
            let (bf16_f32, f32_f16) = (c.stored::<half::bf16, f32>(), c.stored::<f32, half::f16>());
            check_all(&bf16_f32, &format!("bf16/f32 V={v} T={temp}"));
            check_all(&f32_f16, &format!("f32/f16 V={v} T={temp}"));
        }
    }
}

/// Inputs for the lane tests: special values, every exponent with random mantissas, and a
/// dense sweep of the range the kernels use.
fn lane_inputs() -> Vec<f32> {
    let mut v = vec![
        0.0f32,
        -0.0,
        1.0,
        -1.0,
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::MAX,
        -f32::MAX,
        88.72284,
        -87.33655,
        -87.38,
        -88.0,
        -103.97,
        -104.0,
        89.0,
        core::f32::consts::FRAC_1_SQRT_2,
        core::f32::consts::SQRT_2,
    ];
    let mut s = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..400_000 {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.push(f32::from_bits(s as u32));
        v.push(((s >> 40) as f32 / (1u64 << 24) as f32) * -100.0 + 5.0);
    }
    for b in (0x3f00_0000u32..0x3fc0_0000).step_by(97) {
        v.push(f32::from_bits(b));
    }
    v
}

#[test]
fn every_lane_of_exp_and_ln_equals_the_scalar_functions() {
    let x = lane_inputs();
    let want_exp = bits(&x.iter().map(|&v| exp_ln::exp(v)).collect::<Vec<_>>());
    let want_nonpos = bits(&x.iter().map(|&v| exp_ln::exp_nonpos(v)).collect::<Vec<_>>());
    let want_ln = bits(&x.iter().map(|&v| exp_ln::ln(v)).collect::<Vec<_>>());
    for b in Backend::available() {
        // Shift the data by 0..16 so every value visits every lane (and the scalar tail).
        for shift in 0..16 {
            let xs = &x[shift..];
            let mut out = vec![0.0f32; xs.len()];
            math::exp(b, xs, &mut out);
            assert_eq!(bits(&out), want_exp[shift..], "exp {b:?} shift {shift}");
            math::exp_nonpos(b, xs, &mut out);
            assert_eq!(bits(&out), want_nonpos[shift..], "exp_nonpos {b:?}");
            math::ln(b, xs, &mut out);
            assert_eq!(bits(&out), want_ln[shift..], "ln {b:?} shift {shift}");
        }
    }
}

fn logit_value() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -20.0f32..20.0,
        1 => Just(f32::NEG_INFINITY),
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
        1 => -1e30f32..1e30,
        1 => Just(1e-40f32),
    ]
}

/// The step kernels first try a cheaper exponential that is exact only for arguments in
/// [−86, 0] and recompute a block whose arguments left that range (grpo-cpu
/// `exp_nonpos_normal_n`). Rows without masks whose arguments sit just inside or outside the
/// boundary, at several temperatures, f32 and bf16: both outcomes equal grpo-core. Rows
/// made of one maximum and edge values only make the entropy sum `Σ e·d` consist of the edge
/// terms alone (the maximum's term is 0), so a wrong subnormal `e` changes its bits.
#[test]
fn blocks_at_the_edge_of_the_fast_exponential_match_core() {
    let vocab = 2048 + 64 + 5;
    for (i, below) in [
        -85.99999f32,
        -86.0,
        -86.00001,
        -86.5,
        -87.9,
        -88.0,
        -88.1,
        -200.0,
    ]
    .into_iter()
    .enumerate()
    {
        for temp in [1.0f32, 0.5, 2.0] {
            let edge = 9.0 + below * temp;
            // Rows 0 and 1: the maximum 9 in the first / second block, every other logit at
            // the edge; row 2: random logits in [−9, 9) with one edge value in the unrolled
            // part of the second block and one in the tail; row 3: random (fast everywhere).
            let mut c = Case::<f32>::shaped(4, vocab, 40 + i as u64, temp, 9.0, 0);
            for (r, max_at) in [(0usize, 100usize), (1, 2048 + 17)] {
                let row = &mut c.z[r * vocab..(r + 1) * vocab];
                row.fill(edge);
                row[max_at] = 9.0;
            }
            let row = &mut c.z[2 * vocab..3 * vocab];
            row[2048 + 17] = edge;
            row[vocab - 2] = edge;
            check_all(&c, &format!("edge {below} T={temp}"));
            check_all(&c.to_bf16(), &format!("bf16 edge {below} T={temp}"));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random shapes and values (masks, ±0, subnormals, huge magnitudes, occasional NaN/+∞):
    /// every backend and thread count equals grpo-core, results and errors.
    #[test]
    fn random_batches_match_core(
        rows in 1usize..5,
        vocab in prop_oneof![1usize..70, 2040usize..2060],
        seed in any::<u64>(),
        temp in prop_oneof![Just(1.0f32), 0.25f32..4.0],
        (scale, mask_every) in prop_oneof![Just((9.0f32, 23u64)), Just((9.0, 0)), Just((44.0, 0))],
        vals in proptest::collection::vec(logit_value(), 16),
        // NaNs with payloads too: an exponential built from bit operations can turn a NaN
        // with an unusual payload into a number, which must not hide it.
        poison in proptest::option::of((0usize..10_000, prop_oneof![
            Just(f32::NAN),
            Just(f32::INFINITY),
            Just(f32::from_bits(0x7f80_0001)),
            Just(f32::from_bits(0xffc0_1234)),
        ])),
    ) {
        let mut c = Case::<f32>::shaped(rows, vocab, seed, temp, scale, mask_every);
        for (i, v) in vals.iter().enumerate() {
            let k = (seed as usize).wrapping_add(i * 131) % c.z.len();
            c.z[k] = *v;
        }
        if let Some((i, v)) = poison {
            let k = i % c.z.len();
            c.z[k] = v;
        }
        check_all(&c, "proptest f32");
        check_all(&c.to_bf16(), "proptest bf16");
    }
}
