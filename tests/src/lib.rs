//! Shared helpers of the cross-crate test suite: proptest strategies with the edge cases of
//! DESIGN.md (lengths around multiples of 16, ±0, subnormals, huge magnitudes, all-equal and
//! singleton groups) and f64 references.

use proptest::prelude::*;

/// Finite f64 values including the edge cases the design card asks for.
pub fn edge_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        4 => -10.0f64..10.0,
        1 => Just(0.0f64),
        1 => Just(-0.0f64),
        1 => Just(1.0f64),
        1 => Just(f64::MIN_POSITIVE / 4.0),
        1 => Just(1e30f64),
        1 => Just(-1e30f64),
        1 => -1e6f64..1e6,
    ]
}

/// Binary rewards (0 or 1), the common RLVR case.
pub fn binary_reward() -> impl Strategy<Value = f64> {
    prop_oneof![Just(0.0f64), Just(1.0f64)]
}

/// Relative-plus-absolute closeness.
pub fn close(a: f64, b: f64, rel: f64, abs: f64) -> bool {
    (a - b).abs() <= abs + rel * a.abs().max(b.abs())
}

/// f64 log-softmax of one row at temperature `t`: (lse, log p). Each log-probability is taken
/// relative to the row maximum, `(x − m) − ln s`, so rows of logits near ±f32::MAX keep f64's
/// precision (`x − lse` would lose it to the size of `lse`). A row of only −∞ gives NaN.
pub fn log_softmax(row: &[f64], t: f64) -> (f64, Vec<f64>) {
    let x: Vec<f64> = row.iter().map(|&z| z / t).collect();
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let ln_s = x.iter().map(|&v| (v - m).exp()).sum::<f64>().ln();
    (m + ln_s, x.iter().map(|&v| (v - m) - ln_s).collect())
}

pub mod gpu;
pub mod tolerance;

/// A deterministic stream of f32 in [0, 1) (24 random bits each) from xorshift64 with `seed`
/// (non-zero): reproducible test data without a proptest runner.
pub fn uniform_f32(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Per-token log-ratios and advantages for PPO-clip's rounding ties: the 48 consecutive floats
/// around `ln(b)` for each bound `b` (their ratios step through the floats near `b`), each with
/// 318 advantages of both signs (±(0.5 + 0.00937·k)), for some of which `A·ρ` and `A·b` round to
/// the same f32 while `ρ ≠ b`. Returns `(lp, adv)`; use `old = 0`.
pub fn bound_tie_grid(bounds: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let advs: Vec<f32> = (1..160)
        .flat_map(|k| [0.5 + k as f32 * 0.00937, -(0.5 + k as f32 * 0.00937)])
        .collect();
    bounds
        .iter()
        .flat_map(|b| {
            let x = b.ln();
            (0..48).map(move |k| f32::from_bits(x.to_bits() + k - 24))
        })
        .flat_map(|x| advs.iter().map(move |&a| (x, a)))
        .unzip()
}
