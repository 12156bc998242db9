//! grpo-cpu's vocabulary kernels against grpo-core, bit for bit: every available backend ×
//! every row operation × f32/bf16/f16 storage × row lengths (0..=65, around multiples of 16 and
//! of the 2048-element block, 32768, 151936) × 1/2/3 threads. Errors must be the same `Err`
//! value with every output untouched. Also every SIMD lane of `exp`/`ln` against the scalar
//! functions.

use std::sync::OnceLock;

use grpo_core::vocab::exp_ln;
use grpo_core::vocab::{GradTerms, KlDirection, KlTerm, Logit};
use grpo_cpu::{Backend, Cpu, Storage, math};
use proptest::prelude::*;

/// Every backend of this CPU with pools of 1, 2 and 3 threads.
fn cpus() -> &'static [Cpu] {
    static CPUS: OnceLock<Vec<Cpu>> = OnceLock::new();
    CPUS.get_or_init(|| {
        let mut v = Vec::new();
        for b in Backend::available() {
            for t in [1, 2, 3] {
                v.push(Cpu::new(b).unwrap().with_threads(t).unwrap());
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

/// One batch: student/teacher logits `[rows, vocab]`, targets, weights.
struct Case<S> {
    z: Vec<S>,
    w: Vec<S>,
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
        // Targets on unmasked logits (a masked target is an error, tested separately).
        let targets = (0..rows)
            .map(|r| {
                let mut y = (r * 7919 + seed as usize) % vocab.max(1);
                while vocab > 0 && z[r * vocab + y].to_f32() == f32::NEG_INFINITY {
                    y = (y + 1) % vocab;
                }
                y as u32
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

    fn rows(&self) -> usize {
        self.targets.len()
    }
}

impl Case<f32> {
    /// The same case with the logits rounded to bf16.
    fn to_bf16(&self) -> Case<half::bf16> {
        let conv = |v: &[f32]| v.iter().map(|&x| half::bf16::from_f32(x)).collect();
        Case {
            z: conv(&self.z),
            w: conv(&self.w),
            vocab: self.vocab,
            targets: self.targets.clone(),
            g_lp: self.g_lp.clone(),
            g_h: self.g_h.clone(),
            g_kl: self.g_kl.clone(),
            temperature: self.temperature,
            beta: self.beta,
        }
    }
}

/// Runs every operation on grpo-core and on every `Cpu`, comparing results, errors and
/// untouched outputs.
fn check_all<S: Storage + std::fmt::Debug>(c: &Case<S>, what: &str) -> usize {
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
    let k0f = grpo_core::vocab::kl_rows(z, w, v, t, KlDirection::Forward, &mut kf0);
    let k0r = grpo_core::vocab::kl_rows(z, w, v, t, KlDirection::Reverse, &mut kr0);
    let j0r = grpo_core::vocab::jsd_rows(z, w, v, c.beta, t, &mut j0);
    // backward with several term sets
    let term_sets: Vec<GradTerms<'_, u32, S>> = vec![
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
                direction: KlDirection::Forward,
            }),
        },
        GradTerms {
            logp: Some((&c.targets, &c.g_lp)),
            entropy: Some(&c.g_h),
            kl: Some(KlTerm {
                teacher: w,
                grad: &c.g_kl,
                direction: KlDirection::Reverse,
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
            cpu.kl_rows(z, w, v, t, KlDirection::Forward, &mut kf),
            k0f,
            "kl fwd {tag}"
        );
        assert_eq!(bits(&kf), bits(&kf0), "kl fwd {tag}");
        assert_eq!(
            cpu.kl_rows(z, w, v, t, KlDirection::Reverse, &mut kr),
            k0r,
            "kl rev {tag}"
        );
        assert_eq!(bits(&kr), bits(&kr0), "kl rev {tag}");
        assert_eq!(cpu.jsd_rows(z, w, v, c.beta, t, &mut j), j0r, "jsd {tag}");
        assert_eq!(bits(&j), bits(&j0), "jsd {tag}");

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
        && b0.iter().all(|b| b.0.is_ok() && b.2.is_ok());
    if all_ok {
        assert_eq!(fallbacks, 0, "{what}: valid input took the grpo-core path");
    }
    fallbacks
}

fn check_lengths<S: Storage + std::fmt::Debug>(name: &str) {
    let mut lens: Vec<usize> = (0..=65).collect();
    lens.extend([
        127, 128, 129, 255, 256, 257, 2047, 2048, 2049, 4095, 4096, 4097, 6161,
    ]);
    for &v in &lens {
        for (seed, temp) in [(1u64, 1.0f32), (2, 0.7)] {
            let c = Case::<S>::new(3, v, seed + v as u64, temp);
            let fallbacks = check_all(&c, &format!("{name} V={v} T={temp}"));
            // V = 0 is an error for every operation; everything else is valid input.
            assert_eq!(fallbacks == 0, v > 0, "{name} V={v}");
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
    check_all(&Case::<half::f16>::new(1, 151936, 7, 1.0), "f16 V=151936");
}

#[test]
fn errors_match_core_and_leave_outputs_untouched() {
    let base = Case::<f32>::new(4, 40, 11, 1.0);
    // NaN, +∞ at row 2; a masked row; a masked target; a support violation; bad parameters.
    let mut nan = Case::<f32>::new(4, 40, 11, 1.0);
    nan.z[2 * 40 + 17] = f32::NAN;
    // Every operation (6 forward + 8 backward calls) per Cpu must have detected it.
    assert_eq!(check_all(&nan, "NaN logit"), 14 * cpus().len());
    let mut nan_w = Case::<f32>::new(4, 40, 11, 1.0);
    nan_w.w[3 * 40 + 39] = f32::NAN;
    check_all(&nan_w, "NaN teacher");
    let mut inf = Case::<f32>::new(4, 40, 11, 1.0);
    inf.z[2 * 40 + 3] = f32::INFINITY;
    inf.w[40 + 39] = f32::INFINITY;
    check_all(&inf, "+inf logit");
    let mut masked = Case::<f32>::new(4, 40, 11, 1.0);
    for x in &mut masked.z[40..80] {
        *x = f32::NEG_INFINITY;
    }
    check_all(&masked, "masked row");
    let mut tgt = Case::<f32>::new(4, 40, 11, 1.0);
    let y = tgt.targets[3] as usize;
    tgt.z[3 * 40 + y] = f32::NEG_INFINITY;
    tgt.w[3 * 40 + y] = f32::NEG_INFINITY;
    check_all(&tgt, "masked target");
    let mut oob = Case::<f32>::new(4, 40, 11, 1.0);
    oob.targets[1] = 40;
    check_all(&oob, "target out of range");
    let mut sup = Case::<f32>::new(4, 40, 11, 1.0);
    sup.w[2 * 40 + 5] = f32::NEG_INFINITY; // forward KL support violated
    sup.z[3 * 40 + 6] = f32::NEG_INFINITY; // reverse KL support violated
    check_all(&sup, "support");
    let mut huge = Case::<f32>::new(4, 40, 11, 1e-30);
    huge.z[0] = 3e38;
    check_all(&huge, "max/T overflow");
    for t in [0.0f32, -1.0, f32::NAN, f32::INFINITY, 1e-40, 1e-7] {
        let mut c = Case::<f32>::new(4, 40, 11, 1.0);
        c.temperature = t;
        check_all(&c, &format!("temperature {t}"));
    }
    let mut beta = Case::<f32>::new(4, 40, 11, 1.0);
    beta.beta = 1.0;
    check_all(&beta, "beta = 1");
    let mut wts = Case::<f32>::new(4, 40, 11, 1.0);
    wts.g_lp[2] = f32::NAN;
    wts.g_kl[1] = 2e9;
    check_all(&wts, "bad weights");
    let mut short = Case::<f32>::new(4, 40, 11, 1.0);
    short.z.pop();
    short.w.truncate(100);
    check_all(&short, "lengths");
    assert_eq!(check_all(&base, "valid"), 0);
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
        -87.68,
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
