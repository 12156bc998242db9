//! grpo-cpu's vocabulary kernels against grpo-core on untrusted shapes and values: never
//! panic, and every result — Ok values bit for bit, or the same `Err` with the outputs
//! untouched — equals grpo-core's (differential fuzzing), on every backend of the CPU.
#![no_main]

use grpo_core::vocab::{GradTerms, KlDirection, KlTerm};
use grpo_cpu::{Backend, Cpu};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, arbitrary::Arbitrary)]
struct Input {
    vocab: u8,
    rows: u8,
    temperature: u8,
    beta: u8,
    reverse: bool,
    logits: Vec<(u8, u16)>,
    targets: Vec<u8>,
}

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

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter()
        .map(|v| if v.is_nan() { u32::MAX } else { v.to_bits() })
        .collect()
}

/// Bit patterns of a 16-bit row (NaN compared as "both NaN", as in [`bits`]).
fn bits16<S: grpo_core::vocab::Logit>(x: &[S], to_bits: fn(S) -> u16) -> Vec<u32> {
    x.iter()
        .map(|&v| {
            if v.to_f32().is_nan() {
                u32::MAX
            } else {
                u32::from(to_bits(v))
            }
        })
        .collect()
}

fuzz_target!(|inp: Input| {
    let vocab = usize::from(inp.vocab % 72);
    let rows = usize::from(inp.rows % 4);
    let n = rows * vocab;
    let mut z: Vec<f32> = inp.logits.iter().map(|&(s, x)| value(s, x)).collect();
    z.resize(n, 0.5);
    // The teacher: the student shifted, sharing its masks (and its poison).
    let w: Vec<f32> = z.iter().map(|&v| v * 0.5 - 1.0).collect();
    let targets: Vec<u32> = (0..rows)
        .map(|r| u32::from(inp.targets.get(r).copied().unwrap_or(0)))
        .collect();
    let t = [1.0f32, 0.5, 2.0, 0.0, -1.0, f32::NAN, 1e-30, 7.0][usize::from(inp.temperature % 8)];
    let beta = f32::from(inp.beta) / 255.0;
    let dir = if inp.reverse {
        KlDirection::Reverse
    } else {
        KlDirection::Forward
    };
    let g = vec![0.75f32; rows];
    let terms: GradTerms<'_, u32, f32> = GradTerms {
        logp: Some((&targets, &g)),
        entropy: Some(&g),
        kl: Some(KlTerm {
            teacher: &w,
            grad: &g,
            direction: dir,
        }),
    };
    let sentinel = || vec![-3.5f32; rows];
    let (mut l0, mut h0, mut p0, mut k0, mut j0) =
        (sentinel(), sentinel(), sentinel(), sentinel(), sentinel());
    let mut g0 = vec![-3.5f32; n];
    let r0 = (
        grpo_core::vocab::stats_rows(&z, vocab, t, &mut l0, &mut h0),
        grpo_core::vocab::logprob_entropy_rows(&z, vocab, &targets, t, &mut p0, None),
        grpo_core::vocab::kl_rows(&z, &w, vocab, t, dir, &mut k0),
        grpo_core::vocab::jsd_rows(&z, &w, vocab, beta, t, &mut j0),
        grpo_core::vocab::backward_rows(&z, vocab, t, &terms, &mut g0),
    );
    // In place in 16-bit storage: the gradients rounded to the logits' own type (vector
    // roundings in grpo-cpu, `half`'s scalar ones in grpo-core).
    let zb: Vec<half::bf16> = z.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let zh: Vec<half::f16> = z.iter().map(|&v| half::f16::from_f32(v)).collect();
    let (mut b0, mut f0) = (zb.clone(), zh.clone());
    let rb0 = grpo_core::vocab::backward_rows_in_place(&mut b0, vocab, t, &terms);
    let rf0 = grpo_core::vocab::backward_rows_in_place(&mut f0, vocab, t, &terms);
    for b in Backend::available() {
        let cpu = Cpu::new(b).unwrap();
        let (mut bb, mut ff) = (zb.clone(), zh.clone());
        assert_eq!(
            cpu.backward_rows_in_place(&mut bb, vocab, t, &terms),
            rb0,
            "{b:?}"
        );
        assert_eq!(
            cpu.backward_rows_in_place(&mut ff, vocab, t, &terms),
            rf0,
            "{b:?}"
        );
        assert_eq!(
            bits16(&bb, half::bf16::to_bits),
            bits16(&b0, half::bf16::to_bits),
            "{b:?}"
        );
        assert_eq!(
            bits16(&ff, half::f16::to_bits),
            bits16(&f0, half::f16::to_bits),
            "{b:?}"
        );
        let (mut l, mut h, mut p, mut k, mut j) =
            (sentinel(), sentinel(), sentinel(), sentinel(), sentinel());
        let mut gr = vec![-3.5f32; n];
        let r = (
            cpu.stats_rows(&z, vocab, t, &mut l, &mut h),
            cpu.logprob_entropy_rows(&z, vocab, &targets, t, &mut p, None),
            cpu.kl_rows(&z, &w, vocab, t, dir, &mut k),
            cpu.jsd_rows(&z, &w, vocab, beta, t, &mut j),
            cpu.backward_rows(&z, vocab, t, &terms, &mut gr),
        );
        assert_eq!(r, r0, "{b:?}");
        for (a, c) in [
            (&l, &l0),
            (&h, &h0),
            (&p, &p0),
            (&k, &k0),
            (&j, &j0),
            (&gr, &g0),
        ] {
            assert_eq!(bits(a), bits(c), "{b:?}");
        }
    }
});
