//! grpo-cpu's vocabulary kernels against grpo-core on untrusted shapes and values: never
//! panic, and every result — Ok values bit for bit, or the same `Err` with the outputs
//! untouched — equals grpo-core's (differential fuzzing), on every backend of the CPU, on the
//! caller's pool and on pools of 1 to 3 threads.
#![no_main]

use std::sync::OnceLock;

use grpo_core::Result;
use grpo_core::vocab::{
    self, GradTerms, JsdState, KlDirection, KlTerm, Logit, LseState, MAX_GRAD_WEIGHT, PairState,
    SavedState,
};
use grpo_cpu::{Backend, Cpu, Storage};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, arbitrary::Arbitrary)]
struct Input {
    vocab: u8,
    rows: u8,
    temperature: u8,
    beta: u8,
    /// Bit 0: KL(q‖p) (`TeacherStudent`); bit 1: `logprob_entropy_rows` also writes entropies; bits 2–4: leave
    /// the backward's log-probability, entropy, KL term out; bits 5–6: the executors' pool.
    flags: u8,
    /// Which length is off by one, if any ([`Slot`]).
    wrong: u8,
    logits: Vec<(u8, u16)>,
    teacher: Vec<(u8, u16)>,
    targets: Vec<u8>,
    /// Backward weights, three per row (log-probability, entropy, KL).
    weights: Vec<u32>,
}

/// The slices whose length an input can get wrong: `wrong % 16` is the slot's number (8–15:
/// every length exact) and `wrong & 16` makes it one too long instead of one too short.
#[derive(Clone, Copy)]
enum Slot {
    Teacher,
    /// The per-row outputs (`lse_out`, `logp_out`, KL and JSD `out`, the saved states).
    Out,
    Entropy,
    Grad,
    GradLogp,
    GradEntropy,
    GradKl,
    Targets,
}

/// What the outputs are filled with before each call; no kernel writes NaN on `Ok`.
const SENTINEL: f32 = f32::from_bits(0x7fc0_5a5a);

/// A logit from a selector and payload: mostly ordinary values, sometimes the edge cases.
fn value(sel: u8, x: u16) -> f32 {
    match sel % 16 {
        0 => f32::NEG_INFINITY,
        1 => f32::NAN,
        2 => f32::INFINITY,
        3 => f32::from_bits(u32::from(x)),       // subnormals
        4 => f32::from_bits(u32::from(x) << 16), // any bf16-like pattern
        5 => (x as f32 - 32768.0) * 1e25,
        _ => (x as f32 - 32768.0) / 1024.0,
    }
}

/// A teacher logit: the student's, shifted (sharing its masks and poison, so that the KL is
/// mostly defined) unless the selector's top bit asks for an independent value — which puts
/// −∞, NaN and +∞ where the student has none: KL support violations and teacher-only errors.
fn teacher_value(z: f32, (sel, x): (u8, u16)) -> f32 {
    if sel & 0x80 == 0 {
        z * 0.5 + (f32::from(x) - 32768.0) / 4096.0
    } else {
        value(sel, x)
    }
}

/// A backward weight: mostly moderate, sometimes exactly at or just past the accepted bound,
/// sometimes any bit pattern (NaN, ±∞, huge).
fn weight(b: u32) -> f32 {
    let sign = if b & 8 == 0 { 1.0 } else { -1.0 };
    match b % 8 {
        0 => f32::from_bits(b),
        1 => sign * MAX_GRAD_WEIGHT,
        2 => sign * f32::from_bits(MAX_GRAD_WEIGHT.to_bits() + 1),
        _ => sign * (b >> 4) as f32 / 65536.0,
    }
}

/// Bit patterns of a row, NaN compared as "both NaN" (grpo-core does not pin NaN payloads).
/// Widening to f32 is exact and injective for bf16 and f16, so this compares their own bits.
fn bits<S: Logit>(x: &[S]) -> Vec<u32> {
    x.iter()
        .map(|&v| {
            let v = v.to_f32();
            if v.is_nan() { u32::MAX } else { v.to_bits() }
        })
        .collect()
}

/// Exact bit patterns (NaN payloads included), for "untouched" checks.
fn raw<S: Logit>(x: &[S]) -> Vec<u32> {
    x.iter().map(|v| v.to_f32().to_bits()).collect()
}

fn untouched(x: &[f32]) -> bool {
    x.iter().all(|v| v.to_bits() == SENTINEL.to_bits())
}

/// Every backend of this CPU, each on the caller's pool and on pools of 1, 2 and 3 threads
/// (`[backend][pool]`): the 1- and 2-thread pools run every pass with the backend's default
/// software prefetching and with its opposite, the others each pass's own default. Built once:
/// a pool per input would cost more than the kernels. With few threads a task gets several
/// rows (`Cpu::rows_per_task`), so one kernel call spans rows.
fn executors() -> &'static [[Cpu; 4]] {
    static CPUS: OnceLock<Vec<[Cpu; 4]>> = OnceLock::new();
    CPUS.get_or_init(|| {
        Backend::available()
            .map(|b| {
                let cpu = Cpu::new(b).expect("an available backend");
                let pool = |n| cpu.clone().with_threads(n).expect("a thread pool");
                let default = b.software_prefetch_default();
                [
                    cpu.clone(),
                    pool(1).with_software_prefetch(default),
                    pool(2).with_software_prefetch(!default),
                    pool(3),
                ]
            })
            .collect()
    })
}

/// One decoded input, for every storage type of the student.
struct Case<'a> {
    cpus: Vec<&'static Cpu>,
    vocab: usize,
    t: f32,
    beta: f32,
    dir: KlDirection,
    teacher: &'a [f32],
    targets: &'a [u32],
    terms: GradTerms<'a, u32, f32>,
    /// Output lengths: per-row outputs, entropies, the out-of-place gradient.
    out: usize,
    entropy: usize,
    grad: usize,
    /// Whether `logprob_entropy_rows` is asked for entropies.
    with_entropy: bool,
    /// The terms of the backward from saved states: `terms` without its KL term, unless the
    /// input keeps it (grpo-core's `InvalidParam{name: "kl"}`).
    saved_terms: GradTerms<'a, u32, f32>,
    /// The JSD gradient's weights (the KL term's, whether or not `terms` has one).
    jsd_grad: &'a [f32],
}

/// A saved state's bits, for equality with NaN payloads and signed zeros told apart.
fn state_bits(st: &[LseState]) -> Vec<[u32; 3]> {
    st.iter()
        .map(|s| [s.max, s.sum, s.dot].map(f32::to_bits))
        .collect()
}

/// A saved pair state's bits (as [`state_bits`]).
fn pair_bits(st: &[PairState]) -> Vec<[u32; 8]> {
    st.iter()
        .map(|s| [s.zmax, s.sz, s.tz, s.wmax, s.sw, s.tw, s.u, s.v].map(f32::to_bits))
        .collect()
}

/// Runs `op` with grpo-core (`None`), then with every executor, each time on fresh outputs of
/// lengths `lens` filled with [`SENTINEL`]: every executor must return grpo-core's result and
/// output bits, and on `Err` every output must still be the sentinel.
fn differential<const N: usize>(
    cpus: &[&Cpu],
    lens: [usize; N],
    op: impl Fn(Option<&Cpu>, &mut [Vec<f32>; N]) -> Result<()>,
) {
    let fresh = || lens.map(|len| vec![SENTINEL; len]);
    let mut want = fresh();
    let res = op(None, &mut want);
    let want_bits = want.each_ref().map(|o| bits(o));
    for cpu in cpus {
        let mut got = fresh();
        assert_eq!(op(Some(cpu), &mut got), res, "{cpu:?}");
        assert_eq!(got.each_ref().map(|o| bits(o)), want_bits, "{cpu:?}");
        if res.is_err() {
            assert!(got.iter().chain(&want).all(|o| untouched(o)), "{res:?}");
        }
    }
}

/// The forward operations on student logits stored as `S`.
fn forward<S: Storage>(c: &Case<'_>, z: &[S]) {
    let (v, t, w) = (c.vocab, c.t, c.teacher);
    differential(&c.cpus, [c.out, c.entropy], |cpu, [l, h]| match cpu {
        None => vocab::stats_rows(z, v, t, l, h),
        Some(cpu) => cpu.stats_rows(z, v, t, l, h),
    });
    differential(&c.cpus, [c.out, c.entropy], |cpu, [lp, h]| {
        let h = c.with_entropy.then_some(&mut h[..]);
        match cpu {
            None => vocab::logprob_entropy_rows(z, v, c.targets, t, lp, h),
            Some(cpu) => cpu.logprob_entropy_rows(z, v, c.targets, t, lp, h),
        }
    });
    // The saving forward: its states compared bit for bit, `EMPTY` on `Err`.
    let mut want = (vec![SENTINEL; c.out], vec![LseState::EMPTY; c.out]);
    let res = vocab::logprob_entropy_rows_saved(z, v, c.targets, t, &mut want.0, None, &mut want.1);
    for cpu in &c.cpus {
        let mut got = (vec![SENTINEL; c.out], vec![LseState::EMPTY; c.out]);
        let r = cpu.logprob_entropy_rows_saved(z, v, c.targets, t, &mut got.0, None, &mut got.1);
        assert_eq!(r, res, "{cpu:?}");
        assert_eq!(bits(&got.0), bits(&want.0), "{cpu:?}");
        assert_eq!(state_bits(&got.1), state_bits(&want.1), "{cpu:?}");
        if res.is_err() {
            assert!(untouched(&got.0) && got.1.iter().all(|s| *s == LseState::EMPTY));
        }
    }
    differential(&c.cpus, [c.out], |cpu, [k]| match cpu {
        None => vocab::kl_rows(z, w, v, t, c.dir, k),
        Some(cpu) => cpu.kl_rows(z, w, v, t, c.dir, k),
    });
    // The saving KL forward: its pair states compared bit for bit, `EMPTY` on `Err`.
    let mut want = (vec![SENTINEL; c.out], vec![PairState::EMPTY; c.out]);
    let res = vocab::kl_rows_saved(z, w, v, t, c.dir, &mut want.0, &mut want.1);
    for cpu in &c.cpus {
        let mut got = (vec![SENTINEL; c.out], vec![PairState::EMPTY; c.out]);
        let r = cpu.kl_rows_saved(z, w, v, t, c.dir, &mut got.0, &mut got.1);
        assert_eq!(r, res, "{cpu:?}");
        assert_eq!(bits(&got.0), bits(&want.0), "{cpu:?}");
        assert_eq!(pair_bits(&got.1), pair_bits(&want.1), "{cpu:?}");
        if res.is_err() {
            assert!(untouched(&got.0) && got.1.iter().all(|s| *s == PairState::EMPTY));
        }
    }
    differential(&c.cpus, [c.out], |cpu, [j]| match cpu {
        None => vocab::jsd_rows(z, w, v, c.beta, t, j),
        Some(cpu) => cpu.jsd_rows(z, w, v, c.beta, t, j),
    });
}

/// [`differential`] for an operation that writes over the logits: each run on a copy of `z`,
/// every executor's result and logits equal to grpo-core's, and on `Err` the logits unchanged.
fn differential_in_place<S: Storage>(
    cpus: &[&Cpu],
    z: &[S],
    op: impl Fn(Option<&Cpu>, &mut [S]) -> Result<()>,
) {
    let mut want = z.to_vec();
    let res = op(None, &mut want);
    for cpu in cpus {
        let mut got = z.to_vec();
        assert_eq!(op(Some(cpu), &mut got), res, "{cpu:?}");
        assert_eq!(bits(&got), bits(&want), "{cpu:?}");
        if res.is_err() {
            assert!(raw(&got) == raw(z) && raw(&want) == raw(z), "{res:?}");
        }
    }
}

/// The backwards from saved states `st` (either kind) with `terms`, out of place and in place.
fn from_saved<S: Storage, St: SavedState>(
    c: &Case<'_>,
    z: &[S],
    st: &[St],
    terms: &GradTerms<'_, u32, f32>,
) {
    let (v, t) = (c.vocab, c.t);
    differential(&c.cpus, [c.grad], |cpu, [g]| match cpu {
        None => vocab::backward_rows_saved(z, v, t, st, terms, g),
        Some(cpu) => cpu.backward_rows_saved(z, v, t, st, terms, g),
    });
    differential_in_place(&c.cpus, z, |cpu, zi| match cpu {
        None => vocab::backward_rows_in_place_saved(zi, v, t, st, terms),
        Some(cpu) => cpu.backward_rows_in_place_saved(zi, v, t, st, terms),
    });
}

/// Every backward on student logits stored as `S`; in place, the gradient is rounded to `S`
/// (vector roundings in grpo-cpu, `half`'s scalar ones in grpo-core).
fn backward<S: Storage>(c: &Case<'_>, z: &[S]) {
    let (v, t) = (c.vocab, c.t);
    differential(&c.cpus, [c.grad], |cpu, [g]| match cpu {
        None => vocab::backward_rows(z, v, t, &c.terms, g),
        Some(cpu) => cpu.backward_rows(z, v, t, &c.terms, g),
    });
    differential_in_place(&c.cpus, z, |cpu, zi| match cpu {
        None => vocab::backward_rows_in_place(zi, v, t, &c.terms),
        Some(cpu) => cpu.backward_rows_in_place(zi, v, t, &c.terms),
    });
    // From the row states grpo-core's saving forward wrote (`EMPTY` where it failed).
    let mut saved = vec![LseState::EMPTY; c.out];
    let mut lp = vec![SENTINEL; c.out];
    let _ = vocab::logprob_entropy_rows_saved(z, v, c.targets, t, &mut lp, None, &mut saved);
    from_saved(c, z, &saved, &c.saved_terms);
    // The same states over other logits (the teacher's, as the student's type): the backward
    // from saved states does not validate them, and every backend still gives grpo-core's
    // bits — ±∞, NaN, and log-probabilities far above 88 included.
    // (Resized to the student's length: a teacher of the wrong length would test errors only.)
    let mut other: Vec<S> = c.teacher.iter().map(|&x| S::from_f32(x)).collect();
    other.resize(z.len(), S::from_f32(0.5));
    from_saved(c, &other, &saved, &c.saved_terms);
    // From the pair states grpo-core's saving KL forward wrote, with every term.
    let mut pairs = vec![PairState::EMPTY; c.out];
    let mut kl = vec![SENTINEL; c.out];
    let _ = vocab::kl_rows_saved(z, c.teacher, v, t, c.dir, &mut kl, &mut pairs);
    from_saved(c, z, &pairs, &c.terms);
    // The same pair states with other teacher logits (the student's): the KL(q‖p) term's teacher
    // exponential meets log-probabilities past 88 too.
    let zf: Vec<f32> = z.iter().map(|x| x.to_f32()).collect();
    let foreign = GradTerms {
        kl: c.terms.kl.map(|k| KlTerm { teacher: &zf, ..k }),
        ..c.terms
    };
    from_saved(c, z, &pairs, &foreign);
    // The JSD's gradient, out of place and in place.
    let (w, beta, g) = (c.teacher, c.beta, c.jsd_grad);
    differential(&c.cpus, [c.grad], |cpu, [o]| match cpu {
        None => vocab::jsd_backward_rows(z, w, v, beta, t, g, o),
        Some(cpu) => cpu.jsd_backward_rows(z, w, v, beta, t, g, o),
    });
    differential_in_place(&c.cpus, z, |cpu, zi| match cpu {
        None => vocab::jsd_backward_rows_in_place(zi, w, v, beta, t, g),
        Some(cpu) => cpu.jsd_backward_rows_in_place(zi, w, v, beta, t, g),
    });
    // The saving JSD (states compared bit for bit, `EMPTY` on `Err`), and the JSD's gradient
    // from grpo-core's states, out of place and in place.
    let mut want = (vec![SENTINEL; c.out], vec![JsdState::EMPTY; c.out]);
    let res = vocab::jsd_rows_saved(z, w, v, beta, t, &mut want.0, &mut want.1);
    for cpu in &c.cpus {
        let mut got = (vec![SENTINEL; c.out], vec![JsdState::EMPTY; c.out]);
        let r = cpu.jsd_rows_saved(z, w, v, beta, t, &mut got.0, &mut got.1);
        assert_eq!(r, res, "{cpu:?}");
        assert_eq!(bits(&got.0), bits(&want.0), "{cpu:?}");
        assert_eq!(jsd_state_bits(&got.1), jsd_state_bits(&want.1), "{cpu:?}");
        if res.is_err() {
            assert!(untouched(&got.0) && got.1.iter().all(|s| *s == JsdState::EMPTY));
        }
    }
    let st = &want.1[..];
    differential(&c.cpus, [c.grad], |cpu, [o]| match cpu {
        None => vocab::jsd_backward_rows_saved(z, w, v, t, st, g, o),
        Some(cpu) => cpu.jsd_backward_rows_saved(z, w, v, t, st, g, o),
    });
    differential_in_place(&c.cpus, z, |cpu, zi| match cpu {
        None => vocab::jsd_backward_rows_in_place_saved(zi, w, v, t, st, g),
        Some(cpu) => cpu.jsd_backward_rows_in_place_saved(zi, w, v, t, st, g),
    });
    // The same states over other student logits (the teacher's), out of place and in place.
    differential(&c.cpus, [c.grad], |cpu, [o]| match cpu {
        None => vocab::jsd_backward_rows_saved(&other, w, v, t, st, g, o),
        Some(cpu) => cpu.jsd_backward_rows_saved(&other, w, v, t, st, g, o),
    });
    differential_in_place(&c.cpus, &other, |cpu, zi| match cpu {
        None => vocab::jsd_backward_rows_in_place_saved(zi, w, v, t, st, g),
        Some(cpu) => cpu.jsd_backward_rows_in_place_saved(zi, w, v, t, st, g),
    });
}

/// A JSD state's bits.
fn jsd_state_bits(st: &[JsdState]) -> Vec<[u32; 6]> {
    st.iter()
        .map(|s| {
            let (a, b) = (&s.student, &s.teacher);
            [a.max, a.neg_ln_sum, b.max, b.neg_ln_sum, s.beta, s.kl_pm].map(f32::to_bits)
        })
        .collect()
}

fuzz_target!(|inp: Input| {
    let vocab = usize::from(inp.vocab % 72);
    // Up to 9 rows: with 1 or 2 threads, tasks then hold several rows.
    let rows = usize::from(inp.rows % 10);
    let n = rows * vocab;
    let mut z: Vec<f32> = inp.logits.iter().map(|&(s, x)| value(s, x)).collect();
    z.resize(n, 0.5);

    let wrong = (inp.wrong % 16 < 8).then_some(inp.wrong % 16);
    let len = |slot: Slot, exact: usize| match wrong {
        Some(s) if s == slot as u8 && inp.wrong & 16 != 0 => exact + 1,
        Some(s) if s == slot as u8 => exact.saturating_sub(1),
        _ => exact,
    };
    let mut w: Vec<f32> = (0..n)
        .map(|i| {
            inp.teacher
                .get(i)
                .map_or(z[i] * 0.5 - 1.0, |&p| teacher_value(z[i], p))
        })
        .collect();
    w.resize(len(Slot::Teacher, n), 0.0);
    let targets: Vec<u32> = (0..len(Slot::Targets, rows))
        .map(|r| u32::from(inp.targets.get(r).copied().unwrap_or(0)))
        .collect();
    let weights = |slot: Slot, k: usize| -> Vec<f32> {
        (0..len(slot, rows))
            .map(|r| inp.weights.get(3 * r + k).map_or(0.75, |&b| weight(b)))
            .collect()
    };
    let (g_lp, g_h, g_kl) = (
        weights(Slot::GradLogp, 0),
        weights(Slot::GradEntropy, 1),
        weights(Slot::GradKl, 2),
    );
    let t = [1.0f32, 0.5, 2.0, 0.0, -1.0, f32::NAN, 1e-30, 7.0][usize::from(inp.temperature % 8)];
    let dir = if inp.flags & 1 == 0 {
        KlDirection::StudentTeacher
    } else {
        KlDirection::TeacherStudent
    };
    let has = |bit: u8| inp.flags & (4 << bit) == 0;
    let pool = usize::from(inp.flags >> 5) % 4;
    let case = Case {
        cpus: executors().iter().map(|e| &e[pool]).collect(),
        vocab,
        t,
        beta: f32::from(inp.beta) / 255.0,
        dir,
        teacher: &w,
        targets: &targets,
        terms: GradTerms {
            logp: has(0).then_some((&targets[..], &g_lp[..])),
            entropy: has(1).then_some(&g_h[..]),
            kl: has(2).then_some(KlTerm {
                teacher: &w,
                grad: &g_kl,
                direction: dir,
            }),
        },
        out: len(Slot::Out, rows),
        entropy: len(Slot::Entropy, rows),
        grad: len(Slot::Grad, n),
        with_entropy: inp.flags & 2 != 0,
        saved_terms: GradTerms {
            logp: has(0).then_some((&targets[..], &g_lp[..])),
            entropy: has(1).then_some(&g_h[..]),
            // One input in 16 keeps the KL term: grpo-core's error for it.
            kl: (has(2) && inp.wrong & 0xe0 == 0xe0).then_some(KlTerm {
                teacher: &w,
                grad: &g_kl,
                direction: dir,
            }),
        },
        jsd_grad: &g_kl,
    };

    // Forward in f32 and one 16-bit type; the backwards in every storage type. (Each kernel is
    // compiled per backend and type, and this target is the slowest fuzz build: f16 forwards
    // would add their instantiations for little new code — f16 loads run in the backwards.)
    let zb: Vec<half::bf16> = z.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let zh: Vec<half::f16> = z.iter().map(|&v| half::f16::from_f32(v)).collect();
    forward(&case, &z);
    forward(&case, &zb);
    backward(&case, &z);
    backward(&case, &zb);
    backward(&case, &zh);
});
