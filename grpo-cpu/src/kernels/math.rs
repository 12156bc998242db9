//! grpo-core's canonical `exp`/`ln` (grpo_core::vocab::exp_ln) over 16 lanes.
//!
//! Each function repeats the reference's operation sequence one-for-one — same constants, same
//! FMAs, same integer bit manipulation, same selects — so every lane equals the scalar result
//! bit for bit. The sequences are specified in the module documentation of
//! `grpo_core::vocab::exp_ln`; keep the two in lockstep.

use grpo_core::vocab::exp_ln::{
    D_MAX, D_MIN, EXP_C2, EXP_C3, EXP_HI, EXP_LO, EXP_TABLE, LN_C0, LN_C1, LN_C2, LN_C3, LN_C4,
    LN_C5, LN_C6, LN_C7, LN_C8, LN2_HI, LN2_LO, LOG2E, MIN_NORMAL, SHIFT, SQRT_HALF, TWO_POW_23,
};

use crate::lanes::F32x16;

/// `2^k` from the biased exponent `k + 127` held as an `i32` bit pattern.
#[inline(always)]
fn pow2_biased<V: F32x16>(biased: V) -> V {
    biased.shl::<23>()
}

/// `grpo_core::vocab::exp_ln::exp` per lane.
#[inline(always)]
pub(crate) fn exp<V: F32x16>(x: V) -> V {
    let x = V::splat(EXP_HI).min(V::splat(EXP_LO).max(x));
    let ([t], [_], [p]) = exp_reduce_n::<V, 1>([x]);
    let n = t.sub_i32(V::splat(SHIFT)).shr_arith::<3>();
    let n1 = n.shr_arith::<1>();
    let n2 = n.sub_i32(n1);
    let bias = V::from_bits(127);
    p.mul(pow2_biased(n1.add_i32(bias)))
        .mul(pow2_biased(n2.add_i32(bias)))
}

/// Largest `|x|` for which [`exp_moderate`] equals [`exp`].
pub(crate) const EXP_MODERATE_MAX: f32 = 80.0;

/// [`exp`] for `|x| ≤ EXP_MODERATE_MAX` (or NaN), with one scaling multiply instead of two
/// and no clamp — the same bits there.
///
/// Why: [`exp`] clamps `x` (a no-op inside the range) and scales `p·2^n` as `(p·2^n₁)·2^n₂` so
/// that `2^n` never needs to be a float itself. For `|x| ≤ 80`, `n = floor(round(8·x·log₂e)/8)`
/// lies in [−116, 115], so `2^n₁`, `2^n₂` and `2^n` are all normal floats, the first product is
/// exact (a power-of-two scaling of a normal number that stays normal) and both forms round the
/// same exact value `p·2^n` once. Used where the caller has clamped `x` (PPO's log-ratio clamp).
#[inline(always)]
pub(crate) fn exp_moderate<V: F32x16>(x: V) -> V {
    scaled_by_multiply(x)
}

/// `p·from_bits((n + 127) << 23)` for the reduction `(n, p)` of `x`: the reference's scaling
/// of `exp_nonpos` as a plain multiply, on every backend and for every `x` (the bits of a
/// wrapped scale included, which `F32x16::mul_pow2_or_zero` does not promise).
#[inline(always)]
fn scaled_by_multiply<V: F32x16>(x: V) -> V {
    let ([t], [_], [p]) = exp_reduce_n::<V, 1>([x]);
    p.mul(pow2_biased(biased_exponent(t)))
}

/// `bits(SHIFT) − 8·127`: subtracted from `bits(t)` before the shift by 3 it gives the biased
/// exponent `n + 127` (the reference's `((bits(t) − bits(SHIFT)) >> 3) + 127`: adding 127
/// before or after an arithmetic shift by 3 is the same when it is added as 8·127; integer
/// arithmetic, so the same bits).
const SHIFT_MINUS_BIAS: u32 = SHIFT.to_bits() - 8 * 127;

/// The reference's `n + 127` from the reduction's `t`, in two integer operations.
#[inline(always)]
fn biased_exponent<V: F32x16>(t: V) -> V {
    t.sub_i32(V::from_bits(SHIFT_MINUS_BIAS)).shr_arith::<3>()
}

/// `grpo_core::vocab::exp_ln::clamp_grad_arg` per lane: `min(D_MAX, max(D_MIN, x))`, the
/// gradients' argument of [`exp_nonpos_clamped_n`] (a NaN stays NaN: the project's `max` and
/// `min` return their second operand then).
#[inline(always)]
pub(crate) fn clamp_grad_arg<V: F32x16>(x: V) -> V {
    V::splat(D_MAX).min(V::splat(D_MIN).max(x))
}

/// `grpo_core::vocab::exp_ln::exp_nonpos_clamped` per lane: the caller has applied
/// `max_r(D_MIN, ·)` (or [`clamp_grad_arg`]); arguments below 88.67 (see
/// [`exp_nonpos_clamped_n`]).
#[inline(always)]
pub(crate) fn exp_nonpos_clamped<V: F32x16>(x: V) -> V {
    exp_nonpos_clamped_n([x])[0]
}

/// [`exp_nonpos_clamped`] of `N` independent vectors, operation by operation across all `N`
/// (same bits per lane), for arguments below 88.67 (`n ≤ 127`; the forward kernels' are at
/// most grpo-core's `OFFSET_SLACK` = 8, the gradients' at most `D_MAX` = 88 by
/// [`clamp_grad_arg`]) or NaN. Interleaving the `N` dependency chains in program
/// order lets the out-of-order core overlap them: one exponential is a chain of nine dependent
/// operations (about 35 cycles of latency), and a single chain per loop iteration leaves the
/// FMA units mostly idle.
///
/// The reference's `max(n + 127, 0)` is not needed here (the step kernels are compute-bound,
/// so every vector operation counts): it never changes a value, because the argument is
/// `≥ D_MIN = −88` (the caller's clamp), so `8·x·log₂e ≥ −1015.7`, `n ≥ −127` and
/// `n + 127 ≥ 0`. A NaN argument gives a NaN polynomial `p`, and `p·2^n` is that NaN whatever
/// the scale (a shifted exponent field is never itself a NaN pattern). The tests comparing
/// every lane with the scalar reference (`exp_nonpos` over the whole clamped range in
/// `grpo-cpu`'s `math` tests) pin this.
///
/// The scaling is [`F32x16::mul_pow2_or_zero`]: the reference's multiply by
/// `from_bits((n + 127) << 23)` on every backend but AVX-512, where one masked `vscalefps` of
/// `kq = t − SHIFT` (whose floor is `n`) replaces the integer subtraction, the two shifts and
/// the multiply — the same single rounding of `p·2^n`, and +0 where `n = −127`.
#[inline(always)]
pub(crate) fn exp_nonpos_clamped_n<V: F32x16, const N: usize>(x: [V; N]) -> [V; N] {
    let (t, kq, mut p) = exp_reduce_n::<V, N>(x);
    for i in 0..N {
        p[i] = p[i].mul_pow2_or_zero(kq[i], biased_exponent(t[i]));
    }
    p
}

/// Lower end of [`exp_nonpos_normal_n`]'s domain.
pub(crate) const EXP_NORMAL_MIN: f32 = -86.0;

/// [`exp_nonpos_clamped_n`] for arguments in [[`EXP_NORMAL_MIN`], `OFFSET_SLACK` = 8] (no
/// NaN; positive arguments come from a block whose reference lies below its maximum, see
/// grpo-core's `canon::block_reference`): the scaling `p·2^n` is
/// [`F32x16::mul_pow2_normal`] — an integer add of `n << 23` to `p`'s bits, which moves one
/// operation per vector off the FMA ports the step loops are bound by, or on AVX-512 one
/// `vscalefps` that takes `kq` as the float the reduction computed anyway (the integer
/// shift, mask and add become one operation; with the degree-6 exponential before the table
/// form, whose integer form was a subtraction, a shift and an add, fused log-prob + entropy on
/// 8 × 32768 f32 in cache, one thread, measured 0.95 of the integer form's time).
///
/// Same bits there: `x ∈ [−86, 8]` gives `kq ∈ [−124.125, 11.5]`, so `n ∈ [−125, 11]`, and
/// `p = 2^(j/8)·e^r ∈ [0.95, 1.92]`, so `0.95·2^−125 ≤ p·2^n < 2^12` is a normal float and
/// the product is exact — `p` with its exponent field increased by `n`. Outside the domain the
/// result is meaningless (subnormal results would need a rounding, a NaN could turn into a
/// number): the callers check the domain and recompute with [`exp_nonpos_clamped_n`] if it was
/// left.
#[inline(always)]
pub(crate) fn exp_nonpos_normal_n<V: F32x16, const N: usize>(x: [V; N]) -> [V; N] {
    let (t, kq, mut p) = exp_reduce_n::<V, N>(x);
    for i in 0..N {
        // `n << 23` is `(bits(t) − bits(SHIFT)) << 20` with the low 23 bits cleared, and
        // `bits(SHIFT) << 20` is 0 modulo 2^32 (its low 22 bits are zero): two operations.
        let n_field = t[i].shl::<20>().and(V::from_bits(0xff80_0000));
        p[i] = p[i].mul_pow2_normal(kq[i], n_field);
    }
    p
}

/// The reference's `exp_reduce` for `N` vectors, operation by operation across all `N`:
/// `(t, kq, p)` with `t = SHIFT + kq`, `kq = round(8·x·log₂e)/8` and `p` the table entry
/// times the polynomial (`e^x = 2^floor(kq)·p`). Callers derive the integer forms of
/// `n = floor(kq)` their scaling needs from `t`; unused values are dead code to LLVM.
#[inline(always)]
#[allow(clippy::type_complexity)]
fn exp_reduce_n<V: F32x16, const N: usize>(x: [V; N]) -> ([V; N], [V; N], [V; N]) {
    // Plain loops rather than `array::from_fn` closures: a closure is a separate function,
    // and if LLVM declines to inline it, its intrinsics are compiled without the ISA.
    let shift = V::splat(SHIFT);
    let (mut t, mut kq, mut r, mut q) = ([shift; N], [shift; N], [shift; N], [shift; N]);
    for i in 0..N {
        t[i] = x[i].mul_add(V::splat(LOG2E), shift);
        kq[i] = t[i].sub(shift);
    }
    for i in 0..N {
        r[i] = kq[i].mul_add(V::splat(-LN2_HI), x[i]);
    }
    for i in 0..N {
        r[i] = kq[i].mul_add(V::splat(-LN2_LO), r[i]);
    }
    for i in 0..N {
        q[i] = V::splat(EXP_C3).mul_add(r[i], V::splat(EXP_C2));
    }
    for i in 0..N {
        q[i] = q[i].mul_add(r[i], V::splat(1.0));
    }
    let mut p = q;
    for i in 0..N {
        let table = t[i].lookup8(&EXP_TABLE);
        p[i] = table.mul(r[i]).mul_add(q[i], table);
    }
    (t, kq, p)
}

/// `grpo_core::vocab::exp_ln::exp_nonpos` per lane, for every argument: the reference's
/// multiply by `from_bits((n + 127) << 23)` on every backend, because above the kernels'
/// domain (`n > 127`, x ≥ 88.67) that scale is a wrapped bit pattern that no `vscalefps`
/// reproduces (see [`exp_nonpos_clamped_n`]).
#[inline(always)]
pub(crate) fn exp_nonpos<V: F32x16>(x: V) -> V {
    scaled_by_multiply(V::splat(D_MIN).max(x))
}

/// `grpo_core::vocab::exp_ln::ln` per lane.
#[inline(always)]
pub(crate) fn ln<V: F32x16>(x: V) -> V {
    let sub = x.lt(V::splat(MIN_NORMAL));
    let xs = V::select(sub, x.mul(V::splat(TWO_POW_23)), x);
    let y = ln_scaled(
        xs,
        Some(V::select(sub, V::from_bits(-23i32 as u32), V::from_bits(0))),
    );
    let inf = V::splat(f32::INFINITY);
    let y = V::select(x.eq(inf), inf, y);
    let y = V::select(x.eq(V::splat(0.0)), V::splat(f32::NEG_INFINITY), y);
    V::select(x.ge(V::splat(0.0)), y, V::splat(f32::NAN))
}

/// The reference `ln`'s reduction and polynomial for a normal `xs` (the argument, or a
/// subnormal one scaled by 2^23) whose exponent is then corrected by `e_adjust` (−23 or 0 as
/// `i32` lanes; `None` is 0).
#[inline(always)]
fn ln_scaled<V: F32x16>(xs: V, e_adjust: Option<V>) -> V {
    // Not `Option::map`: no closure that LLVM could leave un-inlined.
    if let Some(a) = e_adjust {
        ln_scaled_n([xs], Some([a]))[0]
    } else {
        ln_scaled_n([xs], None)[0]
    }
}

/// [`ln`] of `N` vectors whose lanes all lie in [`MIN_NORMAL`, `f32::MAX`] (positive, normal,
/// finite): the same bits there with 11 vector operations fewer per vector. The reference's
/// four special cases are all identities on that domain — the subnormal scaling by 2^23 (and
/// its −23 in the exponent), `+∞ → +∞`, `0 → −∞`, negative or NaN `→ NaN` — so only its
/// reduction and polynomial remain. Outside the domain the result is meaningless; the callers
/// establish the domain before they use it (the JSD's passes, `kernels::vocab::jsd_parts`).
/// The dense scan `ln_normal_equals_the_reference_on_its_domain` and the opt-in exhaustive
/// test pin the bits.
///
/// The `N` logarithms go operation by operation across all `N` (same bits per lane), as
/// [`exp_nonpos_clamped_n`] interleaves its exponentials: each is a chain of about fifteen
/// dependent operations, its Horner polynomial alone eight FMAs. With four chunk pairs per
/// JSD iteration, against the logarithms issued one after another: 0.978–0.984 of the time on
/// AVX-512, no difference on AVX2 (4 × 32768 f32 pairs in cache, one thread, Zen 4, one
/// process alternating both).
#[inline(always)]
pub(crate) fn ln_normal_n<V: F32x16, const N: usize>(x: [V; N]) -> [V; N] {
    ln_scaled_n(x, None)
}

/// [`ln_scaled`] for `N` vectors, each operation applied to all `N` before the next.
#[inline(always)]
fn ln_scaled_n<V: F32x16, const N: usize>(xs: [V; N], e_adjust: Option<[V; N]>) -> [V; N] {
    // Plain loops, as in `exp_reduce_n`: no closures that LLVM could leave un-inlined.
    let sqrt_half = V::splat(SQRT_HALF);
    let (mut e, mut f, mut q) = ([sqrt_half; N], [sqrt_half; N], [V::splat(LN_C8); N]);
    for i in 0..N {
        let ix = xs[i].sub_i32(sqrt_half);
        e[i] = ix.shr_arith::<23>();
        if let Some(adjust) = e_adjust {
            e[i] = e[i].add_i32(adjust[i]);
        }
        let m = ix.and(V::from_bits(0x007f_ffff)).add_i32(sqrt_half);
        f[i] = m.sub(V::splat(1.0));
    }
    for c in [LN_C7, LN_C6, LN_C5, LN_C4, LN_C3, LN_C2, LN_C1, LN_C0] {
        for i in 0..N {
            q[i] = q[i].mul_add(f[i], V::splat(c));
        }
    }
    let mut y = q;
    for i in 0..N {
        let fe = e[i].i32_to_f32();
        let u = f[i].mul(f[i]).mul_add(q[i], fe.mul(V::splat(LN2_LO)));
        y[i] = fe.mul_add(V::splat(LN2_HI), f[i].add(u));
    }
    y
}

/// Which canonical function [`Map`] applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Func {
    Exp,
    ExpNonpos,
    Ln,
}

/// `out[i] = f(x[i])` (equal lengths; the tail goes through lane 0).
pub(crate) struct Map<'a> {
    pub(crate) f: Func,
    pub(crate) x: &'a [f32],
    pub(crate) out: &'a mut [f32],
}

impl super::Kernel for Map<'_> {
    type Output = ();
    #[inline(always)]
    fn run<V: F32x16>(self) {
        let (xc, xt) = self.x.as_chunks::<16>();
        let (oc, ot) = self.out.as_chunks_mut::<16>();
        for (x, o) in xc.iter().zip(oc.iter_mut()) {
            apply(self.f, V::load(x)).store(o);
        }
        for (x, o) in xt.iter().zip(ot.iter_mut()) {
            *o = apply(self.f, V::splat(*x)).to_array()[0];
        }
    }
}

#[inline(always)]
fn apply<V: F32x16>(f: Func, v: V) -> V {
    match f {
        Func::Exp => exp(v),
        Func::ExpNonpos => exp_nonpos(v),
        Func::Ln => ln(v),
    }
}

#[cfg(test)]
mod tests {
    use super::{
        EXP_MODERATE_MAX, EXP_NORMAL_MIN, Func, Map, clamp_grad_arg, exp, exp_moderate,
        exp_nonpos_clamped, exp_nonpos_normal_n, ln_normal_n,
    };
    use crate::backend::Backend;
    use crate::kernels::Kernel;
    use crate::lanes::F32x16;
    use grpo_core::vocab::exp_ln::{self, D_MIN, MIN_NORMAL};

    /// The lane functions under test (the public `Map` kernel covers only `exp`,
    /// `exp_nonpos` and `ln`).
    #[derive(Clone, Copy, Debug)]
    enum Lane {
        Exp,
        ExpModerate,
        ExpNonposClamped,
        ExpNonposNormal,
        LnNormal,
        /// The gradients' exponential: `exp_nonpos_clamped(clamp_grad_arg(x))`.
        ExpGrad,
    }

    /// `out[i] = f(x[i])` for whole chunks of 16, on whatever backend runs it.
    struct Apply<'a> {
        f: Lane,
        x: &'a [f32],
        out: &'a mut [f32],
    }

    impl Kernel for Apply<'_> {
        type Output = ();
        #[inline(always)]
        fn run<V: F32x16>(self) {
            let (xc, oc) = (self.x.as_chunks::<16>().0, self.out.as_chunks_mut::<16>().0);
            for (x, o) in xc.iter().zip(oc.iter_mut()) {
                let v = V::load(x);
                let y = match self.f {
                    Lane::Exp => exp(v),
                    Lane::ExpModerate => exp_moderate(v),
                    Lane::ExpNonposClamped => exp_nonpos_clamped(v),
                    Lane::ExpNonposNormal => exp_nonpos_normal_n([v])[0],
                    Lane::LnNormal => ln_normal_n([v])[0],
                    Lane::ExpGrad => exp_nonpos_clamped(clamp_grad_arg(v)),
                };
                y.store(o);
            }
        }
    }

    /// The backends the dense scans below check: every backend this CPU has, except the
    /// portable one on AArch64.
    ///
    /// The portable lanes are the same Rust on every target (no FMA contraction, `libm`'s
    /// `fmaf`), so their scans on x86 already cover them; AArch64 always has NEON, so
    /// `Backend::detect` never picks them there. CI runs these tests under qemu-aarch64,
    /// where the portable scans took about half of each test: 120 s → 58 s for
    /// `exp_moderate_equals_exp_inside_its_range` alone without them. Every other test in
    /// this crate still checks the portable backend on AArch64 too.
    fn scanned_backends() -> impl Iterator<Item = Backend> {
        Backend::available().filter(|&b| !(cfg!(target_arch = "aarch64") && b == Backend::Portable))
    }

    /// Asserts that `f` equals `want` bit for bit on every `x` (a multiple of 16 long), on
    /// every backend of [`scanned_backends`]; returns the number of values compared per
    /// backend.
    fn check_every_backend(f: Lane, xs: &[f32], want: impl Fn(f32) -> f32) -> usize {
        assert_eq!(xs.len() % 16, 0);
        assert_on_every_backend(f, xs, want, |backend, out| {
            crate::arch::run(backend, Apply { f, x: xs, out })
        })
    }

    /// Runs `kernel(backend, out)` for `xs` on every backend of [`scanned_backends`] and
    /// asserts that `out` equals `want(x)` bit for bit at every `x`; returns `xs.len()`.
    fn assert_on_every_backend(
        what: impl core::fmt::Debug,
        xs: &[f32],
        want: impl Fn(f32) -> f32,
        kernel: impl Fn(Backend, &mut [f32]),
    ) -> usize {
        let want: Vec<u32> = xs.iter().map(|&x| want(x).to_bits()).collect();
        let mut backends = 0;
        for backend in scanned_backends() {
            backends += 1;
            let mut out = vec![0.0f32; xs.len()];
            kernel(backend, &mut out);
            for ((x, got), want) in xs.iter().zip(&out).zip(&want) {
                assert_eq!(
                    got.to_bits(),
                    *want,
                    "{what:?} on {backend:?}, x = {x:e} ({:#010x})",
                    x.to_bits()
                );
            }
        }
        assert!(backends > 0, "no backend scanned");
        xs.len()
    }

    /// The lanes' `exp_nonpos_clamped` (without the reference's `max(n + 127, 0)`, and with
    /// AVX-512's masked `vscalefps`) equals the reference bit for bit on every float of
    /// [D_MIN, D_MIN + 1.5] — where `n` reaches −127 and the results are subnormal or zero —,
    /// every 29th float of the rest of [D_MIN, 0], ±0, NaNs of both signs and the positive
    /// arguments up to the slack (`up_to_the_slack`).
    #[test]
    fn exp_nonpos_clamped_equals_the_reference_on_the_clamped_range() {
        let nans = [f32::NAN, -f32::NAN, f32::from_bits(0xff80_0001)];
        let extra: Vec<f32> = nans.into_iter().chain(up_to_the_slack()).collect();
        let xs = arguments(D_MIN, 1.5, &extra);
        let checked = check_every_backend(Lane::ExpNonposClamped, &xs, exp_ln::exp_nonpos_clamped);
        assert!(checked > 45_000_000, "{checked}");
    }

    /// The gradients' exponential (`clamp_grad_arg`, then `exp_nonpos_clamped`) equals the
    /// reference's on every backend beyond the forward's arguments too, where the backward
    /// from saved states puts other logits than the states': every 97th float of (8, 1e38],
    /// every float of [87.9, 88.8] (the clamp at 88 and, past it, the end of the scaling's
    /// domain at 88.67, which AVX-512's `vscalefps` and a power of two from exponent bits
    /// cross differently), ±∞, NaNs of both signs and every 29th float of [−1e38, D_MIN].
    #[test]
    fn the_gradients_exponential_equals_the_reference_on_every_argument() {
        let bits = |x: f32| x.to_bits();
        let mut xs: Vec<f32> = (bits(8.0)..=bits(1e38))
            .step_by(97)
            .chain(bits(87.9)..=bits(88.8))
            .chain((bits(D_MIN)..=bits(-1e38)).step_by(29))
            .map(f32::from_bits)
            .chain([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, 88.0])
            .collect();
        xs.resize(xs.len().div_ceil(16) * 16, 100.0);
        let want = |x| exp_ln::exp_nonpos_clamped(exp_ln::clamp_grad_arg(x));
        let checked = check_every_backend(Lane::ExpGrad, &xs, want);
        assert!(checked > 20_000_000, "{checked}");
        // Every argument from 88 up gives e^88, finite.
        let top = exp_ln::exp(exp_ln::D_MAX);
        assert!(top.is_finite() && want(f32::INFINITY) == top && want(1e30) == top);
    }

    /// Every 97th float of (0, 8] and the 64 floats below 8: the positive arguments a block
    /// whose reference lies below its maximum gives (at most grpo-core's `OFFSET_SLACK`).
    fn up_to_the_slack() -> Vec<f32> {
        let top = grpo_core::vocab::canon::OFFSET_SLACK.to_bits();
        (1..=top)
            .step_by(97)
            .chain(top - 64..=top)
            .map(f32::from_bits)
            .collect()
    }

    /// Every float of `[lo, lo + dense]`, every 29th float of the rest of `[lo, 0]`, ±0 and
    /// `extra`, padded with −1 to a multiple of 16.
    fn arguments(lo: f32, dense: f32, extra: &[f32]) -> Vec<f32> {
        let dense = (lo + dense).to_bits();
        let mut xs: Vec<f32> = (dense..=lo.to_bits())
            .chain((0x8000_0000..dense).step_by(29))
            .map(f32::from_bits)
            .chain([0.0, -0.0])
            .chain(extra.iter().copied())
            .collect();
        xs.resize(xs.len().div_ceil(16) * 16, -1.0);
        xs
    }

    /// `exp_moderate` = `exp` = the reference `exp` over every 61st float of [−80, 80], the
    /// floats around the ends and around 0 (the argument in its rustdoc covers the rest), and
    /// NaN.
    #[test]
    fn exp_moderate_equals_exp_inside_its_range() {
        let top = EXP_MODERATE_MAX.to_bits();
        let mut xs: Vec<f32> = (0..=top)
            .step_by(61)
            .chain(top - 64..=top)
            .chain(0..64)
            .flat_map(|b| [f32::from_bits(b), -f32::from_bits(b)])
            .chain([f32::NAN])
            .collect();
        xs.resize(xs.len().div_ceil(16) * 16, 1.0);
        let checked = check_every_backend(Lane::ExpModerate, &xs, exp_ln::exp);
        assert!(checked > 35_000_000, "{checked}");
        check_every_backend(Lane::Exp, &xs, exp_ln::exp);
    }

    /// Every lane function equals grpo-core's scalar function bit for bit on **every** `f32`
    /// of its domain, on every backend of [`scanned_backends`] — the dense scans above, made
    /// exhaustive. Opt-in (`GRPO_EXHAUSTIVE=1`), because the scalar references and the portable
    /// lanes compute their FMAs in software (`libm::fmaf`):
    ///
    /// ```text
    /// GRPO_EXHAUSTIVE=1 cargo test --release -p grpo-cpu exhaustive -- --nocapture
    /// ```
    ///
    /// | function | inputs | reference |
    /// |---|---|---|
    /// | `exp` (the lane function behind the public `math::exp`) | all 2^32 | `exp_ln::exp` |
    /// | `exp_nonpos` (the public `math::exp_nonpos`) | all 2^32 | `exp_ln::exp_nonpos` |
    /// | `ln` (the public `math::ln`) | all 2^32 | `exp_ln::ln` |
    /// | `exp_moderate` | `|x| ≤ 80`, NaN | `exp_ln::exp` |
    /// | `exp_nonpos_clamped` | `D_MIN ≤ x ≤ 88` (`n ≤ 127`), NaN | `exp_ln::exp_nonpos_clamped` |
    /// | `exp_nonpos_normal_n` | `−86 ≤ x ≤ OFFSET_SLACK` | `exp_ln::exp_nonpos_clamped` |
    /// | `ln_normal_n` | positive normal finite (`MIN_NORMAL ≤ x ≤ f32::MAX`) | `exp_ln::ln` |
    ///
    /// Run on an AMD EPYC (Zen 4, family 25 model 17, 2 vCPUs; backends AVX-512 with
    /// `vscalefps`, AVX2 + FMA and portable) on 2026-12-05: every value equal, in 537–540 s;
    /// again there after the table exponential (`lookup8`): every value equal, in 310 s;
    /// with the `ln_normal_n` row: every value equal, in 400 s.
    #[test]
    fn exhaustive_lanes_equal_the_reference() {
        if std::env::var("GRPO_EXHAUSTIVE").as_deref() != Ok("1") {
            std::eprintln!("exhaustive_lanes_equal_the_reference skipped: set GRPO_EXHAUSTIVE=1");
            return;
        }
        use rayon::prelude::*;
        use std::sync::atomic::{AtomicU64, Ordering};
        const SPAN: u64 = 1 << 16;
        const SPANS: u64 = (1 << 32) / SPAN;
        let slack = grpo_core::vocab::canon::OFFSET_SLACK;
        let done = AtomicU64::new(0);
        let start = std::time::Instant::now();
        let compared: u64 = (0..SPANS)
            .into_par_iter()
            .map(|span| {
                let first = (span * SPAN) as u32;
                let all: Vec<f32> = (first..=first + (SPAN as u32 - 1))
                    .map(f32::from_bits)
                    .collect();
                let mut n = 0;
                n += check_inputs(Lane::Exp, &all, |_| true, exp_ln::exp);
                n += check_map(Func::ExpNonpos, &all, exp_ln::exp_nonpos);
                n += check_map(Func::Ln, &all, exp_ln::ln);
                n += check_inputs(
                    Lane::ExpModerate,
                    &all,
                    |x| x.is_nan() || x.abs() <= EXP_MODERATE_MAX,
                    exp_ln::exp,
                );
                n += check_inputs(
                    Lane::ExpNonposClamped,
                    &all,
                    |x| x.is_nan() || (D_MIN..=88.0).contains(&x),
                    exp_ln::exp_nonpos_clamped,
                );
                n += check_inputs(
                    Lane::ExpNonposNormal,
                    &all,
                    |x| (EXP_NORMAL_MIN..=slack).contains(&x),
                    exp_ln::exp_nonpos_clamped,
                );
                n += check_inputs(
                    Lane::LnNormal,
                    &all,
                    |x| (MIN_NORMAL..=f32::MAX).contains(&x),
                    exp_ln::ln,
                );
                let d = done.fetch_add(1, Ordering::Relaxed) + 1;
                if d.is_multiple_of(SPANS / 32) {
                    std::eprintln!(
                        "{d} of {SPANS} spans, {:.0} s",
                        start.elapsed().as_secs_f64()
                    );
                }
                n
            })
            .sum();
        // Per backend: 3 × 2^32 full-range values plus the three domains.
        assert!(compared > 3 * (1u64 << 32), "{compared}");
    }

    /// [`check_every_backend`] on the values of `all` that `keep` admits (a multiple of 16,
    /// padded with −1, inside every domain above), without its length condition.
    fn check_inputs(
        f: Lane,
        all: &[f32],
        keep: impl Fn(f32) -> bool,
        want: impl Fn(f32) -> f32,
    ) -> u64 {
        let mut xs: Vec<f32> = all.iter().copied().filter(|&x| keep(x)).collect();
        if xs.is_empty() {
            return 0;
        }
        xs.resize(xs.len().div_ceil(16) * 16, -1.0);
        check_every_backend(f, &xs, want) as u64
    }

    /// The public [`Map`] kernel (`grpo_cpu::math`) against `want` on every value of `xs`, on
    /// every backend of [`scanned_backends`].
    fn check_map(f: Func, xs: &[f32], want: impl Fn(f32) -> f32) -> u64 {
        assert_on_every_backend(f, xs, want, |backend, out| {
            crate::arch::run(backend, Map { f, x: xs, out })
        }) as u64
    }

    /// `exp_nonpos_normal_n` (an integer exponent add, or AVX-512's `vscalefps`) equals the
    /// reference on its domain [−86, 8]: every float of [−86, −85] (the smallest exponents),
    /// every 29th float of the rest of [−86, 0], ±0 and the positive arguments up to the slack
    /// (`up_to_the_slack`).
    #[test]
    fn exp_nonpos_normal_equals_the_reference_on_its_domain() {
        let xs = arguments(EXP_NORMAL_MIN, 1.0, &up_to_the_slack());
        let checked = check_every_backend(Lane::ExpNonposNormal, &xs, exp_ln::exp_nonpos_clamped);
        assert!(checked > 45_000_000, "{checked}");
    }

    /// `ln_normal_n` (the reference `ln` without its special cases) equals the reference on its
    /// domain, the positive normal finite floats: every float of the lowest binade's first
    /// 2^20 and of [1 − 2^−8, 1 + 2^−8] (where the reduction's `f` is smallest), every 59th of
    /// the rest, and `f32::MAX`.
    #[test]
    fn ln_normal_equals_the_reference_on_its_domain() {
        let (lo, hi) = (MIN_NORMAL.to_bits(), f32::MAX.to_bits());
        let near_one = (1.0f32 - 1.0 / 256.0).to_bits()..=(1.0f32 + 1.0 / 256.0).to_bits();
        let mut xs: Vec<f32> = (lo..lo + (1 << 20))
            .chain((lo..=hi).step_by(59))
            .chain(near_one)
            .chain([hi])
            .map(f32::from_bits)
            .collect();
        xs.resize(xs.len().div_ceil(16) * 16, 1.0);
        let checked = check_every_backend(Lane::LnNormal, &xs, exp_ln::ln);
        assert!(checked > 35_000_000, "{checked}");
    }
}
