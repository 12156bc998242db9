//! Bit-exact, branch-free `exp` and `ln` for `f32` — the canonical arithmetic of the vocabulary
//! kernels \[ours\].
//!
//! Every function here is built only from operations whose result IEEE 754 specifies exactly
//! (round to nearest even): `+ − ×`, fused multiply-add with one rounding (computed here with
//! [`libm::fmaf`], which is correctly rounded, so hardware FMA gives the same bits), integer
//! add/sub/shift/and on the bit pattern, exact conversions between small integers and `f32`,
//! comparisons, selects and one read of an 8-entry constant table at an index taken from a bit
//! pattern. There are no branches on data, so a SIMD backend that performs the same operations
//! in the same order, lane by lane, gets the same bits (0 ULP between backends); the table read
//! is one register permute on AVX-512 and AVX2 (`vpermps`). A backend must run with the default
//! floating-point environment (round to nearest even, no flush-to-zero, no
//! denormals-are-zero).
//!
//! # Operation-by-operation specification (what a SIMD backend mirrors)
//!
//! Notation: `fma(a, b, c)` = a·b + c rounded once; `max_r(a, b)` = `if a > b { a } else { b }`
//! (x86 `maxps(a, b)`; for non-NaN `a` NEON `vmaxq` agrees); `min_r(a, b)` =
//! `if a < b { a } else { b }`; `bits`/`from_bits` reinterpret; integer ops are on `i32` with
//! wrapping; `>>` is an arithmetic shift.
//!
//! [`exp`] (full range, subnormal results correct):
//! ```text
//! x  = min_r(EXP_HI, max_r(EXP_LO, x))      // NaN stays NaN; ±inf → the clamps
//! t  = fma(x, LOG2E, SHIFT)                  // SHIFT = 1.5·2^20: t = SHIFT + round(8·x·log2 e)/8
//! kq = t − SHIFT                             // k/8 as f32 (exact), k = round(8·x·log2 e)
//! r  = fma(kq, −LN2_HI, x)                   // exact (Cody–Waite, see below)
//! r  = fma(kq, −LN2_LO, r)                   // |r| ≤ ln 2/16 (+1.5e−6)
//! q  = fma(EXP_C3, r, EXP_C2); q = fma(q, r, 1.0)
//! T  = EXP_TABLE[bits(t) & 7]                // 2^(j/8), j = k mod 8 (bits(SHIFT) ends in 0s)
//! p  = fma(T · r, q, T)                      // p ≈ 2^(j/8)·e^r ∈ [0.957, 1.92]
//! n  = (bits(t) − bits(SHIFT)) >> 3          // floor(kq) = (k − j)/8, in [−151, 128]
//! n1 = n >> 1;  n2 = n − n1                  // both in [−76, 64]
//! y  = (p · from_bits((n1 + 127) << 23)) · from_bits((n2 + 127) << 23)
//! ```
//! The first scaling is exact (the product stays normal), the second rounds once: a subnormal
//! result is rounded exactly once and an overflow becomes +∞. The first reduction step is exact:
//! `kq·LN2_HI` is a multiple of 2^−24 (LN2_HI's significand ends in three zero bits), and so is
//! `x` where `|x| ≥ ½`; below, `kq ≠ 0` needs `|x| ≥ 0.043`, where `x` is a multiple of 2^−28.
//! Either way the difference, at most 0.0434 in magnitude, has at most 24 significant bits.
//!
//! [`exp_nonpos`] (the kernels' exponential; identical bits to [`exp`] whenever
//! `n ≥ −126`, i.e. for `x ≥ −87.38`, and exactly 0 below):
//! ```text
//! x  = max_r(D_MIN, x)                       // D_MIN = −88: −∞ → −88
//! t, kq, r, q, T, p, n  as in exp
//! y  = p · from_bits(max_i32(n + 127, 0) << 23)   // n ≤ −127 → scale 0 → y = +0
//! ```
//! Its domain is `x ≤ 0` (that is all the kernels need; for `0 < x < 88.67` it still equals
//! [`exp`]); it costs one clamp, 8 FMA/multiply/add, one table read, 4 integer operations and
//! one multiply.
//!
//! [`ln`]:
//! ```text
//! sub = x < 2^−126                           // subnormal (or 0, or negative)
//! xs  = select(sub, x · 2^23, x)             // exact
//! ix  = bits(xs) − bits(SQRT_HALF)
//! e   = (ix >> 23) + select(sub, −23, 0)
//! m   = from_bits((ix & 0x007f_ffff) + bits(SQRT_HALF))   // m ∈ [√½, √2), x = 2^e·m
//! f   = m − 1                                // exact (Sterbenz)
//! q   = LN_C8; q = fma(q, f, LN_C7); … ; q = fma(q, f, LN_C0)   // Horner, 8 FMA
//! fe  = e as f32                             // exact
//! u   = fma(f · f, q, fe · LN2_LO)           // f·f and fe·LN2_LO each rounded once
//! y   = fma(fe, LN2_HI, f + u)
//! y   = select(x == +∞, +∞, y); y = select(x == 0, −∞, y); y = select(!(x ≥ 0), NaN, y)
//! ```
//!
//! # Accuracy
//!
//! Measured over **all 2^32 inputs** (`GRPO_EXHAUSTIVE=1 cargo test --release -p grpo-core
//! exhaustive -- --nocapture`, about 27 minutes on a shared 2-core machine), against the correctly
//! rounded result (taken as `libm::exp`/`libm::log` in f64 rounded to f32, which is correctly
//! rounded except when the f64 value lies within ~2^−29 relative of an f32 rounding boundary —
//! rare, and it could only make a measured distance off by one):
//!
//! | function | max distance from the correctly rounded f32 | max error vs the exact value |
//! |----------|---------------------------------------------|------------------------------|
//! | [`exp`]  | 1 ULP                                       | 1.155 ULP                    |
//! | [`ln`]   | 1 ULP                                       | 0.881 ULP                    |
//!
//! [`exp_nonpos`] equals [`exp`] bit for bit where it does not flush, so the same bound holds
//! there. The contract (DESIGN.md) is ≤ 2 ULP; the tests enforce the measured 1 ULP.
//!
//! [`exp`]'s error has three parts: the table entry's rounding (≤ ½ ULP of 2^(j/8)), the
//! polynomial (≤ 0.43·2^−24 relative) and the final rounding (½ ULP). Their sum stays below
//! 1.5 ULP, so the result is always one of the two floats around e^x. This form (an 8-entry
//! table, a degree-3 polynomial) replaced a degree-6 polynomial without a table (0.894 ULP
//! maximum error, also 1 ULP from the correctly rounded result) because it takes two
//! FMA-port operations fewer per exponential, which the vocabulary kernels are bound by on
//! AVX-512. A 16-entry table would keep the error below one ULP (0.9998 measured) at the same
//! AVX-512 cost, but AVX2 reads 16 entries with two permutes and a blend per half, which
//! measured slower there than the degree-6 form (README, "Changes measured").
//!
//! Being faithful rather than correctly rounded, [`exp`] is **not monotone** at the ULP level:
//! `exp(−0.031140493) < exp(−0.031140495)` by one ULP (the polynomial's rounding). Code must
//! not turn comparisons of ratios into comparisons of log-ratios (`exp(x) > hi ⟺ x > t`) or take
//! `exp(min x)` for `min exp(x)` and expect grpo-core's bits.
//!
//! Sources: Tang's table-driven exponential (ACM TOMS 15(2), 1989) and Cody & Waite's
//! argument reduction; polynomial coefficients fitted in f64 for this project (exp: minimax
//! by linear programming, ln: Remez exchange; weighted relative error) and rounded to f32
//! \[ours\].

/// log2(e) rounded to f32: 1.44269502162933349609375 (0x3fb8aa3b).
pub const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b);
/// 1.5·2^20 = 1572864 (0x49c00000): adding it rounds to a multiple of 1/8 (the spacing of
/// floats in [2^20, 2^21)) and leaves eight times that multiple in the low mantissa bits, so
/// the low three bits index [`EXP_TABLE`] and the bits above them give the power of two.
pub const SHIFT: f32 = f32::from_bits(0x49c0_0000);
/// ln 2 rounded to f32: 0.693147182464599609375 (0x3f317218).
pub const LN2_HI: f32 = f32::from_bits(0x3f31_7218);
/// ln 2 − LN2_HI rounded to f32: −1.904654212125934e−9 (0xb102e308); LN2_HI + LN2_LO equals
/// ln 2 within 6e−17.
pub const LN2_LO: f32 = f32::from_bits(0xb102_e308);
/// Lower clamp of [`exp`]: −104 (0xc2d00000); e^−104 < 2^−150 rounds to +0.
pub const EXP_LO: f32 = f32::from_bits(0xc2d0_0000);
/// Upper clamp of [`exp`]: 89 (0x42b20000); e^89 > f32::MAX rounds to +∞.
pub const EXP_HI: f32 = f32::from_bits(0x42b2_0000);
/// Lower clamp of the kernels' exponent argument: −88 (0xc2b00000). [`exp_nonpos`] maps it
/// (and everything below −87.38) to exactly +0, so masked (−∞) logits contribute exactly 0.
pub const D_MIN: f32 = f32::from_bits(0xc2b0_0000);
/// Upper clamp of the gradients' exponent argument: 88 (0x42b00000), see [`clamp_grad_arg`].
pub const D_MAX: f32 = f32::from_bits(0x42b0_0000);
/// √½ rounded to f32: 0.7071067690849304 (0x3f3504f3): the lower end of [`ln`]'s mantissa
/// interval.
pub const SQRT_HALF: f32 = f32::from_bits(0x3f35_04f3);
/// 2^23 (0x4b000000): scales subnormal inputs of [`ln`] to normal ones.
pub const TWO_POW_23: f32 = f32::from_bits(0x4b00_0000);
/// 2^−126 = f32::MIN_POSITIVE (0x00800000).
pub const MIN_NORMAL: f32 = f32::from_bits(0x0080_0000);

/// 2^(j/8) for j = 0..8, each rounded to f32 (relative error at most 3.2e−8): [`exp`]'s
/// table, read at `j = k mod 8`. Values (hex bits): 1 (0x3f800000), 1.0905077 (0x3f8b95c2),
/// 1.1892071 (0x3f9837f0), 1.2968396 (0x3fa5fed7), 1.4142135 (0x3fb504f3), 1.5422108
/// (0x3fc5672a), 1.6817929 (0x3fd744fd), 1.8340081 (0x3feac0c7).
pub const EXP_TABLE: [f32; 8] = [
    f32::from_bits(0x3f80_0000),
    f32::from_bits(0x3f8b_95c2),
    f32::from_bits(0x3f98_37f0),
    f32::from_bits(0x3fa5_fed7),
    f32::from_bits(0x3fb5_04f3),
    f32::from_bits(0x3fc5_672a),
    f32::from_bits(0x3fd7_44fd),
    f32::from_bits(0x3fea_c0c7),
];

// e^r ≈ 1 + r + C2 r² + C3 r³ on |r| ≤ ln 2/16: minimax fit of the relative error (a linear
// program over 20001 points in f64, for this project); with the coefficients rounded to f32
// the polynomial's relative error is 2.6e−8 (0.43·2^−24) before the rounding of its evaluation.
/// exp coefficient of r²: 0.500064492225647 (0x3f00043a).
pub const EXP_C2: f32 = f32::from_bits(0x3f00_043a);
/// exp coefficient of r³: 0.1666685789823532 (0x3e2aab2b).
pub const EXP_C3: f32 = f32::from_bits(0x3e2a_ab2b);

// ln(1+f) ≈ f + f²·(C0 + C1 f + … + C8 f⁸) on f ∈ [√½ − 1, √2 − 1]: Remez fit of
// (ln(1+f) − f)/f² weighted by f²/|ln(1+f)|; relative error 4.1e−9 (0.034 ULP) before f32
// rounding.
/// ln coefficient of f²: −0.49999988079071045 (0xbefffffc).
pub const LN_C0: f32 = f32::from_bits(0xbeff_fffc);
/// ln coefficient of f³: 0.33333325386047363 (0x3eaaaaa8).
pub const LN_C1: f32 = f32::from_bits(0x3eaa_aaa8);
/// ln coefficient of f⁴: −0.25001582503318787 (0xbe800213).
pub const LN_C2: f32 = f32::from_bits(0xbe80_0213);
/// ln coefficient of f⁵: 0.2000197470188141 (0x3e4cd1fa).
pub const LN_C3: f32 = f32::from_bits(0x3e4c_d1fa);
/// ln coefficient of f⁶: −0.16609081625938416 (0xbe2a13b6).
pub const LN_C4: f32 = f32::from_bits(0xbe2a_13b6);
/// ln coefficient of f⁷: 0.14181822538375854 (0x3e1138cc).
pub const LN_C5: f32 = f32::from_bits(0x3e11_38cc);
/// ln coefficient of f⁸: −0.13242992758750916 (0xbe079bb6).
pub const LN_C6: f32 = f32::from_bits(0xbe07_9bb6);
/// ln coefficient of f⁹: 0.1290445178747177 (0x3e04243f).
pub const LN_C7: f32 = f32::from_bits(0x3e04_243f);
/// ln coefficient of f¹⁰: −0.0762178897857666 (0xbd9c1820).
pub const LN_C8: f32 = f32::from_bits(0xbd9c_1820);

/// Correctly rounded `a·b + c` (one rounding): the only FMA the canonical arithmetic uses.
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    libm::fmaf(a, b, c)
}

/// `if a > b { a } else { b }`: the project-wide max (x86 `maxps(a, b)`).
#[inline(always)]
pub fn max_r(a: f32, b: f32) -> f32 {
    if a > b { a } else { b }
}

/// `if a < b { a } else { b }` (x86 `minps(a, b)`).
#[inline(always)]
pub fn min_r(a: f32, b: f32) -> f32 {
    if a < b { a } else { b }
}

/// Shared reduction: from a clamped `x` to `(n, p)` with e^x = 2^n · p.
#[inline(always)]
fn exp_reduce(x: f32) -> (i32, f32) {
    let t = fma(x, LOG2E, SHIFT);
    let kq = t - SHIFT;
    // r = x − kq·ln2 in two steps; the first is exact (see the module documentation).
    let r = fma(kq, -LN2_HI, x);
    let r = fma(kq, -LN2_LO, r);
    let q = fma(EXP_C3, r, EXP_C2);
    let q = fma(q, r, 1.0);
    let ki = (t.to_bits() as i32).wrapping_sub(SHIFT.to_bits() as i32);
    // `ki & 7` is in 0..8: the index never leaves the table.
    let table = EXP_TABLE[(ki & 7) as usize];
    let p = fma(table * r, q, table);
    (ki >> 3, p)
}

/// 2^k for a biased exponent `k + 127` in 1..=254 (the bit pattern `(k + 127) << 23`).
#[inline(always)]
fn pow2_biased(biased: i32) -> f32 {
    f32::from_bits((biased as u32).wrapping_shl(23))
}

/// e^x in f32, branch-free and bit-reproducible on every backend \[ours\].
///
/// Formula (Tang's table method): `x = (k/8)·ln 2 + r` with `k = round(8·x·log2 e)`, so
/// `e^x = 2^n · 2^(j/8) · e^r` with `k = 8n + j`; `2^(j/8)` from an 8-entry table, `e^r`
/// (`|r| ≤ ln 2/16`) by a degree-3 polynomial, `2^n` applied in two exact power-of-two factors
/// so that subnormal results are rounded once.
/// The exact operation sequence is in the [module documentation](self).
///
/// Accuracy, measured over all 2^32 inputs by the exhaustive test: at most 1 ULP from the
/// correctly rounded result, maximum error 1.155 ULP against the exact value (f64 `exp`);
/// exact at 0 (`exp(±0) = 1`). Special values:
/// `exp(−∞) = 0`, `exp(+∞) = +∞`, `exp(x > 88.7228) = +∞`, `exp(x < −103.98) = 0`, NaN in →
/// NaN out (payload unspecified).
///
/// ```
/// use grpo_core::vocab::exp_ln::exp;
/// assert_eq!(exp(0.0), 1.0);
/// assert!((exp(1.0) - core::f32::consts::E).abs() <= f32::EPSILON * 3.0);
/// assert_eq!(exp(f32::NEG_INFINITY), 0.0);
/// assert_eq!(exp(100.0), f32::INFINITY);
/// ```
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = min_r(EXP_HI, max_r(EXP_LO, x));
    let (n, p) = exp_reduce(x);
    let n1 = n >> 1;
    let n2 = n.wrapping_sub(n1);
    (p * pow2_biased(n1.wrapping_add(127))) * pow2_biased(n2.wrapping_add(127))
}

/// e^x for `x ≤ 0` as the vocabulary kernels compute it: [`exp`] with results below about
/// 0.96·2^−126 flushed to +0 \[ours\].
///
/// Formula: `exp_nonpos(x) = exp(x)` (same bits) when `n = floor(round(8·x·log2 e)/8) ≥
/// −126`, i.e. for `−87.38 ≲ x ≤ 0`, and exactly `+0` below (also for `x = −∞`). Those flushed
/// values are below 1.2e−38, far under the rounding of any sum the kernels form with them
/// (every row sum is ≥ 1). It is cheaper than [`exp`] (one clamp, one scaling multiply), which
/// matters because it runs once per logit. NaN in → NaN out. Defined (and equal to [`exp`]) up to `x < 88.67`
/// (`n ≤ 127`); larger inputs are outside its contract.
///
/// ```
/// use grpo_core::vocab::exp_ln::{exp, exp_nonpos};
/// assert_eq!(exp_nonpos(-3.5), exp(-3.5));
/// assert_eq!(exp_nonpos(-87.0), exp(-87.0));
/// assert_eq!(exp_nonpos(-90.0), 0.0);
/// assert_eq!(exp_nonpos(f32::NEG_INFINITY), 0.0);
/// ```
#[inline(always)]
pub fn exp_nonpos(x: f32) -> f32 {
    exp_nonpos_clamped(max_r(D_MIN, x))
}

/// `min_r(D_MAX, max_r(D_MIN, x))`: the argument the gradients' steps give
/// [`exp_nonpos_clamped`] (`canon::grad_step`, the JSD's steps) \[ours\].
///
/// Why the upper clamp: a log-probability is at most about 0 for the logits its row's
/// statistics came from, but the backward from saved states takes the logits as they come
/// (they are not validated), so other logits — +∞, or one more than 88·T above the state's
/// reference — give arguments above `exp_nonpos`'s domain. There its power of two
/// `from_bits((n + 127) << 23)` leaves the normal floats (`n ≥ 128`: +∞, then wrapped bit
/// patterns), and a backend that scales another way (AVX-512's `vscalefps` rounds `p·2^n`
/// once, giving a finite value or +∞) would give other bits. Clamped at 88, `n ≤ 127`:
/// `2^n` is a normal float and `p·2^n ≤ 1.92·2^127` is exact on every backend, so every
/// argument above 88 (+∞ included) gives `e^88 ≈ 1.65·10^38` everywhere. Below 88 the clamp
/// changes nothing; a NaN stays NaN.
///
/// ```
/// use grpo_core::vocab::exp_ln::{clamp_grad_arg, exp_nonpos_clamped, D_MAX, D_MIN};
/// assert_eq!(clamp_grad_arg(f32::INFINITY), D_MAX);
/// assert_eq!(clamp_grad_arg(f32::NEG_INFINITY), D_MIN);
/// assert_eq!(clamp_grad_arg(-3.0), -3.0);
/// assert!(clamp_grad_arg(f32::NAN).is_nan());
/// let top = exp_nonpos_clamped(clamp_grad_arg(1e30));
/// assert!(top.is_finite() && (top / 88f32.exp() - 1.0).abs() < 1e-6);
/// ```
#[inline(always)]
pub fn clamp_grad_arg(x: f32) -> f32 {
    min_r(D_MAX, max_r(D_MIN, x))
}

/// [`exp_nonpos`] without its clamp: the caller guarantees `x ≥ D_MIN` (or NaN), and every
/// backend gives these bits up to `x < 88.67` (the gradients clamp at [`D_MAX`] = 88 with
/// [`clamp_grad_arg`]); above, the power of two leaves the normal floats. The kernels
/// clamp the argument once and use the clamped value twice (here and in `e·d`).
///
/// ```
/// use grpo_core::vocab::exp_ln::{exp_nonpos, exp_nonpos_clamped, D_MIN};
/// assert_eq!(exp_nonpos_clamped(D_MIN), 0.0);
/// assert_eq!(exp_nonpos_clamped(-1.0), exp_nonpos(-1.0));
/// ```
#[inline(always)]
pub fn exp_nonpos_clamped(x: f32) -> f32 {
    let (n, p) = exp_reduce(x);
    let biased = n.wrapping_add(127);
    let biased = if biased > 0 { biased } else { 0 };
    p * pow2_biased(biased)
}

/// Natural logarithm in f32, branch-free and bit-reproducible on every backend \[ours\].
///
/// Formula: `x = 2^e·m` with `m ∈ [√½, √2)`, `ln x = e·ln 2 + ln(1 + f)`, `f = m − 1`,
/// `ln(1 + f) = f + f²·Q(f)` with a degree-8 polynomial `Q`; subnormal inputs are scaled by
/// 2^23 first. The exact operation sequence is in the [module documentation](self).
///
/// Accuracy, measured over all 2^32 inputs by the exhaustive test: at most 1 ULP from the
/// correctly rounded result, maximum error 0.881 ULP against the exact value (f64 `log`);
/// `ln(1) = 0` exactly. Special values: `ln(±0) = −∞`,
/// `ln(+∞) = +∞`, `ln(x < 0) = NaN`, `ln(NaN) = NaN` (the canonical quiet NaN 0x7fc00000).
///
/// ```
/// use grpo_core::vocab::exp_ln::ln;
/// assert_eq!(ln(1.0), 0.0);
/// assert!((ln(core::f32::consts::E) - 1.0).abs() <= f32::EPSILON);
/// assert_eq!(ln(0.0), f32::NEG_INFINITY);
/// assert!(ln(-1.0).is_nan());
/// ```
#[inline(always)]
pub fn ln(x: f32) -> f32 {
    let sub = x < MIN_NORMAL;
    let xs = if sub { x * TWO_POW_23 } else { x };
    let ix = (xs.to_bits() as i32).wrapping_sub(SQRT_HALF.to_bits() as i32);
    let e = (ix >> 23).wrapping_add(if sub { -23 } else { 0 });
    let m = f32::from_bits(((ix & 0x007f_ffff).wrapping_add(SQRT_HALF.to_bits() as i32)) as u32);
    let f = m - 1.0;
    let mut q = LN_C8;
    q = fma(q, f, LN_C7);
    q = fma(q, f, LN_C6);
    q = fma(q, f, LN_C5);
    q = fma(q, f, LN_C4);
    q = fma(q, f, LN_C3);
    q = fma(q, f, LN_C2);
    q = fma(q, f, LN_C1);
    q = fma(q, f, LN_C0);
    let fe = e as f32;
    let u = fma(f * f, q, fe * LN2_LO);
    let y = fma(fe, LN2_HI, f + u);
    let y = if x == f32::INFINITY { f32::INFINITY } else { y };
    let y = if x == 0.0 { f32::NEG_INFINITY } else { y };
    if x >= 0.0 { y } else { f32::NAN }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;

    /// Error of `y` against the f64 value `r` in units of the f32 ULP at `r` (subnormal ULP
    /// 2^−149 below 2^−126).
    fn ulp_err(y: f32, r: f64) -> f64 {
        if y.is_nan() || r.is_nan() {
            return if y.is_nan() && r.is_nan() {
                0.0
            } else {
                f64::INFINITY
            };
        }
        let rr = r as f32; // correctly rounded except rare double-rounding ties
        if rr.is_infinite() || y.is_infinite() {
            return if y == rr { 0.0 } else { f64::INFINITY };
        }
        let a = r.abs().max(f32::MIN_POSITIVE as f64);
        let e = a.log2().floor();
        let ulp = 2f64.powf(e - 23.0);
        (y as f64 - r).abs() / ulp
    }

    /// Distance in representable f32 values between two non-NaN floats.
    fn ulp_dist(a: f32, b: f32) -> u64 {
        fn ord(x: f32) -> i64 {
            let b = x.to_bits() as i32 as i64;
            if b < 0 { i32::MIN as i64 - b } else { b }
        }
        if a.is_nan() && b.is_nan() {
            return 0;
        }
        if a.is_nan() || b.is_nan() {
            return u64::MAX;
        }
        (ord(a) - ord(b)).unsigned_abs()
    }

    struct Stats {
        max_dist: u64,
        max_err: f64,
        worst: f32,
    }

    fn check_range(
        f: fn(f32) -> f32,
        r: fn(f64) -> f64,
        inputs: impl Iterator<Item = u32>,
    ) -> Stats {
        let mut st = Stats {
            max_dist: 0,
            max_err: 0.0,
            worst: 0.0,
        };
        for b in inputs {
            let x = f32::from_bits(b);
            let y = f(x);
            let rf = r(x as f64);
            let d = ulp_dist(y, rf as f32);
            if d > st.max_dist {
                st.max_dist = d;
                st.worst = x;
            }
            let e = ulp_err(y, rf);
            if e > st.max_err && e.is_finite() {
                st.max_err = e;
            }
        }
        st
    }

    /// A cheap deterministic generator (SplitMix64) so tests need no RNG crate.
    fn splitmix(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn special_bits() -> std::vec::Vec<u32> {
        let mut v = std::vec![
            0x0000_0000,
            0x8000_0000,
            0x0000_0001,
            0x8000_0001,
            0x007f_ffff,
            0x807f_ffff,
            0x0080_0000,
            0x8080_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0xffc0_0000,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x3f80_0000,
            0xbf80_0000,
        ];
        // exp overflow/underflow thresholds and the flush boundary, ±a few ULP.
        for t in [
            88.72284f32,
            -87.33655,
            -87.38,
            -103.972,
            -103.28,
            88.67,
            -88.0,
            89.0,
            -104.0,
        ] {
            for d in -4i32..=4 {
                v.push((t.to_bits() as i32 + d) as u32);
            }
        }
        // ln near 1 and near √½, √2.
        for t in [1.0f32, SQRT_HALF, core::f32::consts::SQRT_2, 0.5, 2.0] {
            for d in -64i32..=64 {
                v.push((t.to_bits() as i32 + d) as u32);
            }
        }
        v
    }

    fn sampled_inputs() -> impl Iterator<Item = u32> {
        let mut s = 0x1234_5678_9abc_def0u64;
        let random = (0..1_000_000).map(move |_| splitmix(&mut s) as u32);
        special_bits().into_iter().chain(random)
    }

    #[test]
    fn exp_sampled_within_one_ulp() {
        let st = check_range(exp, libm::exp, sampled_inputs());
        assert!(
            st.max_dist <= 1,
            "exp: {} ULP at {:e}",
            st.max_dist,
            st.worst
        );
    }

    #[test]
    fn ln_sampled_within_one_ulp() {
        let st = check_range(ln, libm::log, sampled_inputs());
        assert!(
            st.max_dist <= 1,
            "ln: {} ULP at {:e}",
            st.max_dist,
            st.worst
        );
    }

    #[test]
    fn exp_nonpos_equals_exp_where_not_flushed() {
        let mut s = 7u64;
        for i in 0..200_000u32 {
            // uniform in [−87.37, 0] plus bit-pattern sweeps of small magnitudes
            let x = if i % 2 == 0 {
                -((splitmix(&mut s) >> 40) as f32 / (1u64 << 24) as f32) * 87.37
            } else {
                -f32::from_bits((splitmix(&mut s) as u32) & 0x3fff_ffff)
            };
            if x >= -87.37 {
                assert_eq!(exp_nonpos(x).to_bits(), exp(x).to_bits(), "x = {x:e}");
            }
        }
        // The flush boundary: n = floor(kq) ≥ −126 ⟺ round(8·x·LOG2E) ≥ −1008, i.e.
        // x·LOG2E ≥ −126.0625 (the tie rounds to the even −1008).
        let edge = -87.379f32;
        assert_eq!(exp_nonpos(edge).to_bits(), exp(edge).to_bits());
        assert!(exp_nonpos(edge) > 0.0);
        for x in [
            -87.39f32,
            -88.0,
            -100.0,
            -1e30,
            f32::NEG_INFINITY,
            -f32::MAX,
        ] {
            assert_eq!(exp_nonpos(x).to_bits(), 0, "x = {x:e}");
        }
        assert!(exp_nonpos(f32::NAN).is_nan());
    }

    #[test]
    fn special_values() {
        assert_eq!(exp(0.0).to_bits(), 1.0f32.to_bits());
        assert_eq!(exp(-0.0).to_bits(), 1.0f32.to_bits());
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY).to_bits(), 0);
        assert_eq!(exp(88.73), f32::INFINITY);
        assert_eq!(exp(88.72), libm::exp(88.72f32 as f64) as f32);
        assert_eq!(exp(-103.98).to_bits(), 0);
        // e^−103.9 is about 1.03·2^−150 → the smallest subnormal after rounding
        assert_eq!(exp(-103.9).to_bits(), 1);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(ln(1.0).to_bits(), 0);
        assert_eq!(ln(0.0), f32::NEG_INFINITY);
        assert_eq!(ln(-0.0), f32::NEG_INFINITY);
        assert_eq!(ln(f32::INFINITY), f32::INFINITY);
        assert_eq!(ln(-1e-30).to_bits(), f32::NAN.to_bits());
        assert_eq!(ln(f32::NAN).to_bits(), f32::NAN.to_bits());
        assert_eq!(ln(f32::NEG_INFINITY).to_bits(), f32::NAN.to_bits());
        // ln of the smallest subnormal: −149·ln 2 = −103.27892990343184
        assert!((ln(f32::from_bits(1)) as f64 + 103.27892990343184).abs() < 1e-5);
    }

    /// `exp` is not monotone at the ULP level (documented in the module docs): a faithful
    /// (≤ 1 ULP) result may round down while its larger neighbour's rounds up. This pair is the
    /// first found by scanning from −0.3 towards 0 in order.
    #[test]
    fn exp_is_not_monotone_at_the_ulp_level() {
        let x = -3.114_049_5e-2_f32;
        let next = f32::from_bits(x.to_bits() - 1); // the next float towards +∞
        assert!(next > x);
        assert!(exp(next) < exp(x), "{:e} {:e}", exp(next), exp(x));
        assert_eq!(exp(x).to_bits() - exp(next).to_bits(), 1);
    }

    /// Every f32 input. Opt-in (`GRPO_EXHAUSTIVE=1`) because it evaluates 2^32 points per
    /// function (a few minutes in release mode). Prints the measured maxima.
    #[test]
    fn exhaustive_exp_ln() {
        if std::env::var("GRPO_EXHAUSTIVE").as_deref() != Ok("1") {
            std::eprintln!("exhaustive_exp_ln skipped: set GRPO_EXHAUSTIVE=1 to run it");
            return;
        }
        for (name, f, r) in [
            ("exp", exp as fn(f32) -> f32, libm::exp as fn(f64) -> f64),
            ("ln", ln, libm::log),
        ] {
            let st = check_range(f, r, 0..=u32::MAX);
            std::eprintln!(
                "{name}: max {} ULP vs rounded f64 reference (at {:e}), max error {:.4} ULP vs f64",
                st.max_dist,
                st.worst,
                st.max_err
            );
            assert!(st.max_dist <= 1, "{name}: {} ULP", st.max_dist);
        }
    }
}
