//! grpo-core's canonical `exp` and `ln` (`grpo_core::vocab::exp_ln`) over slices, on a chosen
//! backend: the same bits as the scalar functions, 16 lanes at a time.
//!
//! These are the exponential and logarithm the vocabulary kernels are built from; they are
//! public so that tests (and users who need a reproducible vectorised `exp`) can check every
//! lane against the scalar reference.

use crate::arch;
use crate::backend::Backend;
use crate::kernels::math::{Func, Map};

fn map(backend: Backend, f: Func, x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "grpo_cpu::math: lengths differ");
    arch::run(backend, Map { f, x, out });
}

/// `out[i] = grpo_core::vocab::exp_ln::exp(x[i])` (e^x, ≤ 1 ULP, bit-reproducible).
///
/// # Panics
/// If the lengths differ.
///
/// ```
/// use grpo_cpu::{Backend, math};
/// let mut out = [0.0f32; 3];
/// math::exp(Backend::detect(), &[0.0, f32::NEG_INFINITY, 100.0], &mut out);
/// assert_eq!(out, [1.0, 0.0, f32::INFINITY]);
/// ```
pub fn exp(backend: Backend, x: &[f32], out: &mut [f32]) {
    map(backend, Func::Exp, x, out)
}

/// `out[i] = grpo_core::vocab::exp_ln::exp_nonpos(x[i])` (the kernels' e^x for x ≤ 0: equal
/// to [`exp`] down to −87.38, exactly 0 below).
///
/// # Panics
/// If the lengths differ.
///
/// ```
/// use grpo_cpu::{Backend, math};
/// let mut out = [1.0f32; 2];
/// math::exp_nonpos(Backend::detect(), &[0.0, -90.0], &mut out);
/// assert_eq!(out, [1.0, 0.0]);
/// ```
pub fn exp_nonpos(backend: Backend, x: &[f32], out: &mut [f32]) {
    map(backend, Func::ExpNonpos, x, out)
}

/// `out[i] = grpo_core::vocab::exp_ln::ln(x[i])` (natural logarithm, ≤ 1 ULP; ln 0 = −∞,
/// ln(x < 0) = NaN).
///
/// # Panics
/// If the lengths differ.
///
/// ```
/// use grpo_cpu::{Backend, math};
/// let mut out = [9.0f32; 2];
/// math::ln(Backend::detect(), &[1.0, 0.0], &mut out);
/// assert_eq!(out, [0.0, f32::NEG_INFINITY]);
/// ```
pub fn ln(backend: Backend, x: &[f32], out: &mut [f32]) {
    map(backend, Func::Ln, x, out)
}
