//! Vocabulary row kernels from untrusted sizes and values: never panic, and every `Ok` result
//! is finite.
#![no_main]

use grpo_core::vocab::{
    GradTerms, KlDirection, KlTerm, backward_rows, backward_rows_in_place, jsd_rows, kl_rows,
    logprob_entropy_rows, stats_rows,
};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, arbitrary::Arbitrary)]
struct Input {
    vocab: u8,
    rows: u8,
    /// Logit values: raw bits, or (when the top bit of the selector is set) picks from a table
    /// of edge values, so that −∞, huge and tiny values are common.
    student: Vec<(u8, u32)>,
    teacher: Vec<(u8, u32)>,
    targets: Vec<u16>,
    temperature: u32,
    beta: u32,
    weights: Vec<u32>,
    bf16: bool,
}

const EDGE: [f32; 12] = [
    f32::NEG_INFINITY,
    0.0,
    -0.0,
    1.0,
    -1.0,
    3.0e38,
    -3.0e38,
    1e-40,
    -88.0,
    20.0,
    -1e19,
    f32::NAN,
];

fn value((sel, bits): (u8, u32)) -> f32 {
    if sel & 0x80 != 0 {
        EDGE[(sel as usize) % EDGE.len()]
    } else if sel & 0x40 != 0 {
        f32::from_bits(bits)
    } else {
        // moderate logits
        (bits as i32 as f32) * 1e-8
    }
}

fn all_finite(x: &[f32]) -> bool {
    x.iter().all(|v| v.is_finite())
}

fuzz_target!(|inp: Input| {
    let vocab = inp.vocab as usize % 40;
    let rows = inp.rows as usize % 5;
    let n = rows * vocab;
    let z: Vec<f32> = inp.student.iter().map(|&p| value(p)).take(n + 1).collect();
    let w: Vec<f32> = inp.teacher.iter().map(|&p| value(p)).take(n + 1).collect();
    let temperature = if inp.temperature & 1 == 0 {
        1.0
    } else {
        f32::from_bits(inp.temperature)
    };
    let beta = f32::from_bits(inp.beta);
    let targets: Vec<u32> = inp
        .targets
        .iter()
        .map(|&t| t as u32 % 48)
        .take(rows)
        .collect();
    let weights: Vec<f32> = inp
        .weights
        .iter()
        .map(|&b| {
            if b & 1 == 0 {
                (b as f32) * 1e-9
            } else {
                f32::from_bits(b)
            }
        })
        .take(rows)
        .collect();

    let mut lse = vec![0.0f32; rows];
    let mut h = vec![0.0f32; rows];
    if stats_rows(&z, vocab, temperature, &mut lse, &mut h).is_ok() {
        assert!(all_finite(&lse) && all_finite(&h));
    }
    let mut lp = vec![0.0f32; targets.len()];
    let mut h2 = vec![0.0f32; targets.len()];
    if logprob_entropy_rows(&z, vocab, &targets, temperature, &mut lp, Some(&mut h2)).is_ok() {
        assert!(all_finite(&lp) && all_finite(&h2));
        assert!(lp.iter().all(|&x| x <= 1e-5));
    }
    for dir in [KlDirection::Forward, KlDirection::Reverse] {
        let mut kl = vec![0.0f32; rows];
        if kl_rows(&z, &w, vocab, temperature, dir, &mut kl).is_ok() {
            assert!(all_finite(&kl), "{kl:?}");
        }
    }
    let mut j = vec![0.0f32; rows];
    if jsd_rows(&z, &w, vocab, beta, temperature, &mut j).is_ok() {
        assert!(all_finite(&j));
    }
    let terms = GradTerms {
        logp: Some((&targets[..], &weights[..])),
        entropy: Some(&weights[..]),
        kl: Some(KlTerm {
            teacher: &w[..],
            grad: &weights[..],
            direction: if inp.bf16 {
                KlDirection::Forward
            } else {
                KlDirection::Reverse
            },
        }),
    };
    let mut g = vec![0.0f32; z.len()];
    if backward_rows(&z, vocab, temperature, &terms, &mut g).is_ok() {
        assert!(all_finite(&g));
    }
    if inp.bf16 {
        let mut zb: Vec<half::bf16> = z.iter().map(|&x| half::bf16::from_f32(x)).collect();
        let _ = backward_rows_in_place(&mut zb, vocab, temperature, &terms);
    } else {
        let mut zz = z.clone();
        if backward_rows_in_place(&mut zz, vocab, temperature, &terms).is_ok() {
            assert!(all_finite(&zz));
            assert_eq!(zz, g);
        }
    }
});
