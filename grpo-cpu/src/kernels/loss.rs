//! grpo-core's per-token PPO-clip (`grpo_core::loss::ppo_clip`, f32) over 16 lanes.
//!
//! The reference evaluates, per valid token, `x = clamp(lp − old)`, `ρ = exp(x)` (the canonical
//! `exp`, which is what `Real::exp` is for `f32`), then the clip logic of its `ppo_core`: a few
//! multiplications, negations, comparisons and selects. Every one of those is exactly specified
//! by IEEE 754, so [`token_lanes`] repeats them operation by operation and each lane equals the
//! scalar result bit for bit — including the signs of zero gradients (`−mul0(A, 0) = −0`, while
//! the `A = 0` and dual-clip branches write `+0`).
//!
//! `kl_sum` follows grpo-core's canonical order ([`grpo_core::vocab::canon::CanonicalSum`]):
//! per block of 2048 positions, 16 strided lane sums of `−x`, the lane tree, the tail of the
//! batch's last block added in index order, blocks merged pairwise. A kernel call covers a span
//! of whole blocks starting at a block boundary and folds its blocks with a
//! [`PairwiseFold`]; spans of a power-of-two number of blocks fold into the same association.
//!
//! Two modes: the *check* mode (no writes) tells whether the span is safe to write and sums
//! its `−x` (in the canonical chunks, which only this sum needs); the *write* mode stores
//! values and gradients and gathers the other diagnostics, in chunks aligned to the arrays
//! where it can (see [`write_span`]). The check reads the inputs at about the memory's pace —
//! no exponential — and the write mode's arithmetic is done once.
//!
//! The check is a cheaper, conservative stand-in for grpo-core's (finite `lp`, `old`, `A`,
//! value and gradient). It requires `d = lp − old` finite (which implies finite `lp` and `old`:
//! `±∞ − y` and NaN stay non-finite) and `A·M` finite, where `M = max(R, hi, c_dual)` and `R` is
//! an upper bound of every ratio `ρ` the span can hold: `e^c` (rounded up) under a clamp
//! `c ≤ 80`; otherwise `e^80`, and the check also requires `d ≤ 80` (so `x = clamp(d) ≤ 80`).
//! Since `|value| ≤ |A|·max(ρ', clip(ρ), c_dual) ≤ |A|·M` and `|grad| ∈ {0, |A·ρ|} ≤ |A|·M`,
//! rounding is monotonic, and `A·M` is non-finite for non-finite `A` (`M ≥ hi > 1`), a span
//! that passes would pass grpo-core. The converse can fail: an `|A|` above `f32::MAX / M`
//! (about 7e29 under the default clamp of 20) or, without a clamp of at most 80, a log-ratio
//! above 80 whose ratio the clip logic never overflows. Such a span reports "not ok" and the
//! caller falls back to grpo-core, which returns the correct result — slower, never different.

use grpo_core::vocab::canon::{BLOCK, LANES, PairwiseFold, tree};

use super::Kernel;
use super::math::{EXP_MODERATE_MAX, exp, exp_moderate};
use crate::lanes::F32x16;

/// PPO-clip parameters, already validated (`grpo_core::loss::PpoClipConfig::validate`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PpoParams {
    pub(crate) lo: f32,
    pub(crate) hi: f32,
    pub(crate) clamp: Option<f32>,
    pub(crate) dual: Option<f32>,
    pub(crate) cap: Option<f32>,
    /// The clamp keeps every finite log-ratio within `exp_moderate`'s range.
    pub(crate) moderate: bool,
    /// `M = max(R, hi, c_dual)`, where `R ≥ ρ` for every log-ratio the check passes: `R` is
    /// `e^c` for a clamp `c ≤ 80` ([`Self::moderate`]), else `e^80` (the check also requires
    /// `lp − old ≤ 80`, [`CHECK_LOG_RATIO_MAX`]), rounded up (see the module docs).
    pub(crate) check_bound: f32,
}

/// The largest log-ratio `lp − old` the check passes when the clamp does not bound `ρ`'s
/// argument by 80 (no clamp, or a wider one); above it the batch goes to grpo-core.
const CHECK_LOG_RATIO_MAX: f32 = EXP_MODERATE_MAX;

/// An `f32` at least `e^x` and at least the canonical `exp(x)` (which is within 2 ULP of
/// `e^x`, 2^-22 relative): `e^x·(1 + 2^-20)` in `f64`, rounded to `f32` (at most 2^-24
/// relative down).
fn exp_upper_bound(x: f32) -> f32 {
    (f64::from(x).exp() * (1.0 + 2f64.powi(-20))) as f32
}

impl PpoParams {
    /// The kernel's parameters for a configuration that passed
    /// `grpo_core::loss::PpoClipConfig::validate`.
    pub(crate) fn new(cfg: &grpo_core::loss::PpoClipConfig<f32>) -> Self {
        let hi = cfg.bounds.hi;
        let moderate = cfg.log_ratio_clamp.is_some_and(|c| c <= EXP_MODERATE_MAX);
        let ratio_bound = exp_upper_bound(match cfg.log_ratio_clamp {
            Some(c) if moderate => c,
            _ => CHECK_LOG_RATIO_MAX,
        });
        PpoParams {
            lo: cfg.bounds.lo,
            hi,
            clamp: cfg.log_ratio_clamp,
            dual: cfg.dual_clip,
            cap: cfg.delta_cap,
            moderate,
            check_bound: ratio_bound.max(hi).max(cfg.dual_clip.unwrap_or(hi)),
        }
    }
}

/// The configuration's options as bits of a const generic parameter `O` ([`PpoSpan::run`]
/// picks the variant once per span): each combination compiles to its own loop, without the
/// per-chunk tests of the options and the mask repacking that LLVM emitted where one loop
/// served them all (see [`PpoSpan::run`]).
const CLAMP: u8 = 1;
/// [`PpoParams::moderate`] (only together with [`CLAMP`]).
const MODERATE: u8 = 2;
/// The δ cap on the unclipped ratio.
const CAP: u8 = 4;
/// The dual clip.
const DUAL: u8 = 8;

/// One span of the batch: positions `start..start + lp.len()` (the slices are that span),
/// `start` a multiple of `BLOCK`; `batch_len` is the whole batch's length (it decides where the
/// canonical tail is).
pub(crate) struct PpoSpan<'a> {
    pub(crate) p: PpoParams,
    pub(crate) lp: &'a [f32],
    pub(crate) old: &'a [f32],
    pub(crate) adv: &'a [f32],
    pub(crate) mask: Option<&'a [bool]>,
    /// `Some((value, grad))`: write mode; `None`: check mode.
    pub(crate) out: Option<(&'a mut [f32], &'a mut [f32])>,
}

/// What a span's pass found: the check mode sets `ok` and `kl` (the rest is the default), the
/// write mode (which runs only after every span passed) the other diagnostics, with
/// `ok = true` and `kl = 0`.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SpanDiag {
    /// The check passed: every valid input, value and gradient would be finite (module docs).
    pub(crate) ok: bool,
    pub(crate) tokens: usize,
    pub(crate) clipped_low: usize,
    pub(crate) clipped_high: usize,
    pub(crate) dual_clipped: usize,
    pub(crate) delta_capped: usize,
    pub(crate) clamped: usize,
    /// The span's `Σ −x` in the canonical order (its blocks folded pairwise).
    pub(crate) kl: f32,
    pub(crate) ratio_min: f32,
    pub(crate) ratio_max: f32,
}

/// Per-lane results of one chunk of 16 tokens.
struct TokenLanes<V: F32x16> {
    value: V,
    grad: V,
    rho: V,
    clamped: V::Mask,
    clip_low: V::Mask,
    clip_high: V::Mask,
    dual: V::Mask,
    capped: V::Mask,
}

/// `−v`: flips the sign bit, as Rust's unary minus does.
#[inline(always)]
fn neg<V: F32x16>(v: V) -> V {
    v.xor(V::splat(-0.0))
}

/// `−mul0(a, dr)` for `a ≠ 0`: `−0` where `dr == 0`, else `−(a·dr)` (grpo-core's `mul0`).
#[inline(always)]
fn neg_mul0<V: F32x16>(a: V, dr: V) -> V {
    let zero = V::splat(0.0);
    neg(V::select(dr.eq(zero), zero, a.mul(dr)))
}

/// `x = clamp(d)` and where the clamp applied, per lane (grpo-core's log-ratio clamp; `d`
/// itself without [`CLAMP`]). The check mode's `Σ −x` and the write mode's ratios both start
/// here, so they see the same `x`.
#[inline(always)]
fn log_ratio_lanes<V: F32x16, const O: u8>(p: &PpoParams, d: V) -> (V, V::Mask) {
    if O & CLAMP != 0 {
        let c = p.clamp.unwrap_or(f32::INFINITY);
        let (c, mc) = (V::splat(c), V::splat(-c));
        let above = d.gt(c);
        let below = d.lt(mc);
        (
            V::select(above, c, V::select(below, mc, d)),
            V::mask_or(above, below),
        )
    } else {
        (d, V::mask_none())
    }
}

/// grpo-core's PPO-clip token step (`ppo_clip`'s closure and `ppo_core`) per lane.
/// `O`: the options' bits ([`CLAMP`], …), which the configuration `p` matches.
#[inline(always)]
fn token_lanes<V: F32x16, const O: u8>(p: &PpoParams, lp: V, old: V, a: V) -> TokenLanes<V> {
    let zero = V::splat(0.0);
    let (x, clamped) = log_ratio_lanes::<V, O>(p, lp.sub(old));
    // Inside the clamp the cheaper form of the same exponential applies.
    let rho = if O & MODERATE != 0 {
        exp_moderate(x)
    } else {
        exp(x)
    };
    let drho = if O & CLAMP != 0 {
        V::select(clamped, zero, rho)
    } else {
        rho
    };
    // Unclipped branch, optionally capped at δ.
    let (r1, dr1, cap) = if O & CAP != 0 {
        let dc = V::splat(p.cap.unwrap_or(f32::INFINITY));
        let m = rho.gt(dc);
        (V::select(m, dc, rho), V::select(m, zero, drho), m)
    } else {
        (rho, drho, V::mask_none())
    };
    let v1 = neg(a.mul(r1));
    let g1 = neg_mul0(a, dr1);
    // Clipped branch: gradient only inside the closed interval [lo, hi].
    let below = rho.lt(V::splat(p.lo));
    let above = rho.gt(V::splat(p.hi));
    let r2 = V::select(below, V::splat(p.lo), V::select(above, V::splat(p.hi), rho));
    let dr2 = V::select(V::mask_or(below, above), zero, drho);
    let v2 = neg(a.mul(r2));
    let g2 = neg_mul0(a, dr2);
    let a_neg = a.lt(zero);
    let a_pos = a.gt(zero);
    let clip_high = V::mask_and(a_pos, above);
    let clip_low = V::mask_and(a_neg, below);
    // The winner decided on the ratios, exactly, as grpo-core's `ppo_core` does (not on the
    // rounded products, which can tie while the ratios differ): the clipped branch where
    // `A·(r1 − r2) > 0`. Without the δ cap `r1 = ρ`, so that is `ρ > hi` for `A > 0` and
    // `ρ < lo` for `A < 0` — the clip flags, no further comparison.
    let second = if O & CAP != 0 {
        V::mask_or(V::mask_and(a_pos, r1.gt(r2)), V::mask_and(a_neg, r1.lt(r2)))
    } else {
        V::mask_or(clip_high, clip_low)
    };
    let mut value = V::select(second, v2, v1);
    let mut grad = V::select(second, g2, g1);
    let capped = if O & CAP != 0 {
        V::mask_andnot(second, V::mask_and(cap, a_neg))
    } else {
        V::mask_none()
    };
    let dual = if O & DUAL != 0 {
        let c = V::splat(p.dual.unwrap_or(f32::INFINITY));
        // −c·A < −r·A exactly for A < 0, with r the winning branch's ratio. Without the cap
        // that is ρ: where the clipped branch wins for A < 0, ρ < lo ≤ 1 < c either way.
        let r = if O & CAP != 0 {
            V::select(second, r2, r1)
        } else {
            rho
        };
        let m = V::mask_and(a_neg, c.lt(r));
        value = V::select(m, neg(c.mul(a)), value);
        grad = V::select(m, zero, grad);
        m
    } else {
        V::mask_none()
    };
    // A = 0 (either sign): value and gradient +0, no flag (the flags above need A ≠ 0).
    let a_zero = a.eq(zero);
    value = V::select(a_zero, zero, value);
    grad = V::select(a_zero, zero, grad);
    TokenLanes {
        value,
        grad,
        rho,
        clamped,
        clip_low,
        clip_high,
        dual,
        capped,
    }
}

/// Validity lanes of 16 mask entries.
#[inline(always)]
fn valid_lanes<V: F32x16>(m: &[bool; 16]) -> V::Mask {
    let mut a = [0.0f32; 16];
    for (x, &b) in a.iter_mut().zip(m) {
        *x = if b { 1.0 } else { 0.0 };
    }
    V::load(&a).gt(V::splat(0.0))
}

/// One chunk's inputs with the invalid lanes replaced by `+0`.
///
/// A token with `lp = old = A = +0` is exactly what grpo-core writes for a masked position
/// (`A = 0` → value and gradient `+0`), sets no flag (they need `A ≠ 0` or `x ≠ 0`) and adds
/// `−x = −0` to the lane sum of `−x`, which leaves every sum unchanged (`s − (+0) = s`, also for
/// `s = −0`). So after this, only the token count and the ratio range need the mask.
#[inline(always)]
fn masked_inputs<V: F32x16>(valid: Option<V::Mask>, lp: V, old: V, a: V) -> (V, V, V) {
    match valid {
        None => (lp, old, a),
        Some(m) => {
            let zero = V::splat(0.0);
            (
                V::select(m, lp, zero),
                V::select(m, old, zero),
                V::select(m, a, zero),
            )
        }
    }
}

/// One chunk of 16 positions: its lanes and its validity.
///
/// A function rather than a closure: a closure is a separate function, and if LLVM declines to
/// inline it, its intrinsics are compiled without the ISA's features.
#[inline(always)]
fn chunk<V: F32x16, const O: u8>(
    p: &PpoParams,
    lp: &[f32; 16],
    old: &[f32; 16],
    adv: &[f32; 16],
    mask: Option<&[bool; 16]>,
) -> (TokenLanes<V>, Option<V::Mask>) {
    let valid = mask.map(valid_lanes::<V>);
    let (l, o, a) = masked_inputs(valid, V::load(lp), V::load(old), V::load(adv));
    (token_lanes::<V, O>(p, l, o, a), valid)
}

/// The check mode's work on one chunk of `lp − old = d` and `A` (invalid lanes zeroed,
/// [`masked_inputs`]): its term, `+0` in every lane that passes and a positive number, +∞ or
/// NaN in a lane that does not (see the module docs) — `d·0 + (A·M)·0` (NaN unless `d` and
/// `A·M` are finite, `M` = [`PpoParams::check_bound`]), plus `max(d, 80) − 80` where the
/// clamp does not keep `ρ`'s argument at most 80 (positive exactly when `d > 80`) —, and
/// `x = clamp(d)` for the span's `Σ −x`.
#[inline(always)]
fn check_lanes<V: F32x16, const O: u8>(p: &PpoParams, d: V, a: V) -> (V, V) {
    let zero = V::splat(0.0);
    let t = d.mul_add(zero, a.mul(V::splat(p.check_bound)).mul(zero));
    let t = if O & MODERATE != 0 {
        t
    } else {
        let lim = V::splat(CHECK_LOG_RATIO_MAX);
        t.add(d.max(lim).sub(lim))
    };
    (t, log_ratio_lanes::<V, O>(p, d).0)
}

/// Running diagnostics of the write mode, in lanes: the counts as `u32` bit patterns
/// ([`F32x16::count_lanes`]; a span holds far fewer than 2^32 tokens per lane), the ratio
/// range as floats.
///
/// The counts were f32 lanes, `select(m, acc + 1, acc)`: an add and a blend per flag on AVX2,
/// where the integer count is one subtraction. Measured on the Zen 3 host (`grpo-bench loss
/// --tokens 262144 --threads 1`, in cache, five alternated runs): median per-pair time ratio
/// 0.98 for PPO-clip and 0.99 for KL3; streaming 8 M tokens on two threads, within the noise.
struct Acc<V: F32x16> {
    tokens: V,
    clipped_low: V,
    clipped_high: V,
    dual: V,
    capped: V,
    clamped: V,
    rmin: V,
    rmax: V,
}

impl<V: F32x16> Acc<V> {
    #[inline(always)]
    fn new() -> Self {
        let zero = V::splat(0.0);
        Acc {
            tokens: zero,
            clipped_low: zero,
            clipped_high: zero,
            dual: zero,
            capped: zero,
            clamped: zero,
            rmin: V::splat(f32::INFINITY),
            rmax: V::splat(f32::NEG_INFINITY),
        }
    }

    /// Adds one chunk; `valid = None` means every lane is valid. Masked lanes hold zeroed inputs
    /// ([`masked_inputs`]), so they only need excluding from the count and the ratio range.
    /// Flags that the configuration cannot raise are not counted (`O` says which it can).
    #[inline(always)]
    fn add<const O: u8>(&mut self, t: &TokenLanes<V>, valid: Option<V::Mask>) {
        self.clipped_low = V::count_lanes(self.clipped_low, t.clip_low);
        self.clipped_high = V::count_lanes(self.clipped_high, t.clip_high);
        if O & DUAL != 0 {
            self.dual = V::count_lanes(self.dual, t.dual);
        }
        if O & CAP != 0 {
            self.capped = V::count_lanes(self.capped, t.capped);
        }
        if O & CLAMP != 0 {
            self.clamped = V::count_lanes(self.clamped, t.clamped);
        }
        match valid {
            None => {
                self.rmin = self.rmin.min(t.rho);
                self.rmax = self.rmax.max(t.rho);
            }
            Some(m) => {
                self.tokens = V::count_lanes(self.tokens, m);
                self.rmin = self.rmin.min(V::select(m, t.rho, V::splat(f32::INFINITY)));
                self.rmax = self
                    .rmax
                    .max(V::select(m, t.rho, V::splat(f32::NEG_INFINITY)));
            }
        }
    }

    /// The span's diagnostics; `unmasked` = tokens of chunks added with `valid = None`.
    fn finish(self, unmasked: usize) -> SpanDiag {
        let total = |v: V| {
            v.to_array()
                .iter()
                .map(|c| c.to_bits() as usize)
                .sum::<usize>()
        };
        let rmin = self
            .rmin
            .to_array()
            .into_iter()
            .fold(f32::INFINITY, |m, r| if r < m { r } else { m });
        let rmax = self
            .rmax
            .to_array()
            .into_iter()
            .fold(f32::NEG_INFINITY, |m, r| if r > m { r } else { m });
        SpanDiag {
            ok: true,
            tokens: unmasked + total(self.tokens),
            clipped_low: total(self.clipped_low),
            clipped_high: total(self.clipped_high),
            dual_clipped: total(self.dual),
            delta_capped: total(self.capped),
            clamped: total(self.clamped),
            kl: 0.0,
            ratio_min: rmin,
            ratio_max: rmax,
        }
    }
}

impl Kernel for PpoSpan<'_> {
    type Output = SpanDiag;

    /// Runs the loop compiled for the configuration's options ([`CLAMP`], [`MODERATE`],
    /// [`CAP`], [`DUAL`]). With one loop for every configuration, LLVM tested the options in
    /// every chunk and carried masks across those branches packed to 16 bits and unpacked
    /// again (`perf annotate` of the AVX2 loops, default configuration).
    #[inline(always)]
    fn run<V: F32x16>(self) -> SpanDiag {
        let p = &self.p;
        match (
            p.clamp.is_some(),
            p.moderate,
            p.cap.is_some(),
            p.dual.is_some(),
        ) {
            (false, _, false, false) => self.run_with::<V, 0>(),
            (false, _, false, true) => self.run_with::<V, DUAL>(),
            (false, _, true, false) => self.run_with::<V, CAP>(),
            (false, _, true, true) => self.run_with::<V, { CAP | DUAL }>(),
            (true, false, false, false) => self.run_with::<V, CLAMP>(),
            (true, false, false, true) => self.run_with::<V, { CLAMP | DUAL }>(),
            (true, false, true, false) => self.run_with::<V, { CLAMP | CAP }>(),
            (true, false, true, true) => self.run_with::<V, { CLAMP | CAP | DUAL }>(),
            (true, true, false, false) => self.run_with::<V, { CLAMP | MODERATE }>(),
            (true, true, false, true) => self.run_with::<V, { CLAMP | MODERATE | DUAL }>(),
            (true, true, true, false) => self.run_with::<V, { CLAMP | MODERATE | CAP }>(),
            (true, true, true, true) => self.run_with::<V, { CLAMP | MODERATE | CAP | DUAL }>(),
        }
    }
}

impl PpoSpan<'_> {
    /// [`Kernel::run`] for the options `O`, which `self.p` has.
    #[inline(always)]
    fn run_with<V: F32x16, const O: u8>(self) -> SpanDiag {
        match self.out {
            None => check_span::<V, O>(&self.p, self.lp, self.old, self.adv, self.mask),
            Some((value, grad)) => {
                write_span::<V, O>(&self.p, self.lp, self.old, self.adv, self.mask, value, grad)
            }
        }
    }
}

/// The check mode over one span: whether it passes (see the module docs), and its `Σ −x` in
/// the canonical order — per block, 16 strided lane sums, the lane tree, the batch's tail in
/// index order; the blocks folded pairwise — which the check computes because it reads `lp`
/// and `old` in the canonical chunks anyway, while it waits for memory (a span that fails
/// goes to grpo-core, which computes its own).
#[inline(always)]
fn check_span<V: F32x16, const O: u8>(
    p: &PpoParams,
    lp: &[f32],
    old: &[f32],
    adv: &[f32],
    mask: Option<&[bool]>,
) -> SpanDiag {
    let n = lp.len();
    let mut check = V::splat(0.0);
    let mut fold = PairwiseFold::new();
    let mut start = 0;
    while start < n {
        let end = (start + BLOCK).min(n);
        let n16 = start + (end - start) / LANES * LANES;
        let (lpc, _) = lp[start..n16].as_chunks::<16>();
        let (oldc, _) = old[start..n16].as_chunks::<16>();
        let (advc, _) = adv[start..n16].as_chunks::<16>();
        let mut kl = V::splat(0.0);
        match mask {
            None => {
                for k in 0..lpc.len() {
                    let (l, o, a) = (V::load(&lpc[k]), V::load(&oldc[k]), V::load(&advc[k]));
                    let (t, x) = check_lanes::<V, O>(p, l.sub(o), a);
                    check = check.add(t);
                    kl = kl.sub(x);
                }
            }
            Some(m) => {
                let (mc, _) = m[start..n16].as_chunks::<16>();
                for k in 0..lpc.len() {
                    let valid = Some(valid_lanes::<V>(&mc[k]));
                    let (l, o, a) = masked_inputs(
                        valid,
                        V::load(&lpc[k]),
                        V::load(&oldc[k]),
                        V::load(&advc[k]),
                    );
                    let (t, x) = check_lanes::<V, O>(p, l.sub(o), a);
                    check = check.add(t);
                    kl = kl.sub(x);
                }
            }
        }
        // Tail (only in the batch's last block): the same lanes on a zero-padded chunk, then
        // the canonical order — tree first, tail elements added in index order.
        let mut kl_lanes = kl.to_array();
        tree(&mut kl_lanes);
        let mut s = kl_lanes[0];
        if end > n16 {
            let m = mask.map(|m| &m[n16..end]);
            let (l, o, a, _) = padded_chunk::<V>(&lp[n16..end], &old[n16..end], &adv[n16..end], m);
            let (t, x) = check_lanes::<V, O>(p, l.sub(o), a);
            check = check.add(t);
            for (i, &xi) in x.to_array().iter().enumerate().take(end - n16) {
                if m.is_none_or(|m| m[i]) {
                    s += -xi;
                }
            }
        }
        fold.push(s, |a, b| a + b);
        start = end;
    }
    SpanDiag {
        ok: check.to_array().iter().all(|&c| c == 0.0),
        kl: fold.finish(|a, b| a + b).unwrap_or(0.0),
        ..SpanDiag::default()
    }
}

/// The inputs of at most 16 positions (a span's tail, or in the write mode the positions
/// before its first aligned chunk), zero-padded to a chunk, with the invalid lanes (masked, or
/// beyond the positions) zeroed ([`masked_inputs`]), and the validity.
#[inline(always)]
fn padded_chunk<V: F32x16>(
    lp: &[f32],
    old: &[f32],
    adv: &[f32],
    mask: Option<&[bool]>,
) -> (V, V, V, Option<V::Mask>) {
    let tail = lp.len();
    let pad = |src: &[f32]| {
        let mut a = [0.0f32; 16];
        a[..tail].copy_from_slice(src);
        a
    };
    let mut m = [false; 16];
    for (l, b) in m.iter_mut().enumerate().take(tail) {
        *b = mask.is_none_or(|mk| mk[l]);
    }
    let valid = Some(valid_lanes::<V>(&m));
    let (l, o, a) = masked_inputs(
        valid,
        V::load(&pad(lp)),
        V::load(&pad(old)),
        V::load(&pad(adv)),
    );
    (l, o, a, valid)
}

/// The write mode over one span: values, gradients and the diagnostics except `kl` (the
/// check mode's).
///
/// Every token is computed on its own and the diagnostics are counts and extrema, so the
/// chunks need not be the canonical ones: where the five arrays lie equally far from a
/// 64-byte boundary (the common case: buffers from one allocator), the first chunk starts at
/// that boundary — after a zero-padded partial chunk of the positions before it — and every
/// load and store is aligned, the stores streaming ([`F32x16::store_stream`]). Otherwise the
/// chunks start at the span's start and the stores go through the cache.
///
/// Why (Zen 4, 2 threads, 8 M tokens; one process alternating two forms, median of twelve
/// per-pair time ratios per run): streaming stores beside loads that straddle cache lines
/// were the slowest form — with the inputs 16 bytes past a 64-byte boundary and the outputs
/// on one, cached stores took 0.81–0.87 of their time (six runs) — while with every array on
/// a boundary the streaming stores were the fastest (cached ones took 0.99–1.14 of their time,
/// ten runs). Large buffers from glibc's `malloc` (so Rust's `Vec`) start 16 bytes past a page
/// boundary, PyTorch's CPU tensors on a 64-byte one. `grpo-bench loss`, whose arrays all start
/// 16 bytes past one, took 0.905 (PPO-clip) and 0.904 (KL3) of the time of the canonical
/// chunks (18 alternated runs of both binaries, median per-pair ratio).
///
/// Streaming stores leave the outputs out of the cache: a batch small enough to stay there
/// (262144 tokens, 5 MiB) ran as fast either way, but its consumer then reads the values and
/// gradients from memory — as it does after the out-of-place vocabulary backward.
#[inline(always)]
fn write_span<V: F32x16, const O: u8>(
    p: &PpoParams,
    lp: &[f32],
    old: &[f32],
    adv: &[f32],
    mask: Option<&[bool]>,
    value: &mut [f32],
    grad: &mut [f32],
) -> SpanDiag {
    let n = lp.len();
    // Positions before the next 64-byte boundary (`align_offset` may answer `usize::MAX`
    // where it cannot tell: then the chunks start at the span's start).
    let offset = |x: *const f32| x.align_offset(64);
    let head = offset(lp.as_ptr());
    let aligned = head < LANES
        && [old.as_ptr(), adv.as_ptr(), value.as_ptr(), grad.as_ptr()]
            .into_iter()
            .all(|x| offset(x) == head);
    let mut acc = Acc::<V>::new();
    let start = if aligned { head.min(n) } else { 0 };
    let whole = start + (n - start) / LANES * LANES;
    let inp = Inputs { lp, old, adv, mask };
    for r in [0..start, whole..n] {
        if !r.is_empty() {
            let (v, g) = (&mut value[r.clone()], &mut grad[r.clone()]);
            write_part::<V, O>(p, inp.range(r), v, g, &mut acc);
        }
    }
    let (vc, _) = value[start..whole].as_chunks_mut::<16>();
    let (gc, _) = grad[start..whole].as_chunks_mut::<16>();
    let body = inp.range(start..whole);
    if aligned {
        write_chunks::<V, O, true>(p, body, vc, gc, &mut acc);
    } else {
        write_chunks::<V, O, false>(p, body, vc, gc, &mut acc);
    }
    let unmasked = if mask.is_none() { whole - start } else { 0 };
    acc.finish(unmasked)
}

/// The inputs of some positions of a span.
#[derive(Clone, Copy)]
struct Inputs<'a> {
    lp: &'a [f32],
    old: &'a [f32],
    adv: &'a [f32],
    mask: Option<&'a [bool]>,
}

impl<'a> Inputs<'a> {
    /// Positions `r` of these.
    fn range(&self, r: core::ops::Range<usize>) -> Inputs<'a> {
        Inputs {
            lp: &self.lp[r.clone()],
            old: &self.old[r.clone()],
            adv: &self.adv[r.clone()],
            mask: self.mask.map(|m| &m[r]),
        }
    }
}

/// Fewer than 16 positions of [`write_span`] (before its first whole chunk, or after its last):
/// the same lanes on a zero-padded chunk ([`padded_chunk`]), the positions' values and
/// gradients copied out.
#[inline(always)]
fn write_part<V: F32x16, const O: u8>(
    p: &PpoParams,
    inp: Inputs<'_>,
    value: &mut [f32],
    grad: &mut [f32],
    acc: &mut Acc<V>,
) {
    let (l, o, a, valid) = padded_chunk::<V>(inp.lp, inp.old, inp.adv, inp.mask);
    let lanes = token_lanes::<V, O>(p, l, o, a);
    value.copy_from_slice(&lanes.value.to_array()[..value.len()]);
    grad.copy_from_slice(&lanes.grad.to_array()[..grad.len()]);
    acc.add::<O>(&lanes, valid);
}

/// The whole chunks of [`write_span`] (`inp` holds as many positions as `vc` and `gc`): their
/// values and gradients stored streaming if `STREAM`, through the cache otherwise.
#[inline(always)]
fn write_chunks<V: F32x16, const O: u8, const STREAM: bool>(
    p: &PpoParams,
    inp: Inputs<'_>,
    vc: &mut [[f32; 16]],
    gc: &mut [[f32; 16]],
    acc: &mut Acc<V>,
) {
    let (lpc, oldc, advc) = (
        inp.lp.as_chunks::<16>().0,
        inp.old.as_chunks::<16>().0,
        inp.adv.as_chunks::<16>().0,
    );
    let maskc = inp.mask.map(|m| m.as_chunks::<16>().0);
    for (k, (v, g)) in vc.iter_mut().zip(gc.iter_mut()).enumerate() {
        let (lanes, valid) = chunk::<V, O>(p, &lpc[k], &oldc[k], &advc[k], maskc.map(|m| &m[k]));
        if STREAM {
            lanes.value.store_stream(v);
            lanes.grad.store_stream(g);
        } else {
            lanes.value.store(v);
            lanes.grad.store(g);
        }
        acc.add::<O>(&lanes, valid);
    }
}

#[cfg(test)]
mod tests {
    use super::{CHECK_LOG_RATIO_MAX, PpoParams, PpoSpan, exp_upper_bound};
    use crate::Cpu;
    use crate::backend::Backend;
    use grpo_core::Tokens;
    use grpo_core::divergence::RatioBounds;
    use grpo_core::loss::{PolicyInputs, PpoClipConfig, ppo_clip};
    use grpo_core::presets::Preset;
    use grpo_core::vocab::exp_ln::exp;

    /// Each of the twelve loops [`PpoSpan::run`] picks — no clamp, a clamp of 20 (`exp_moderate`)
    /// or of 100, each with and without the δ cap and the dual clip — gives grpo-core's values,
    /// gradients and diagnostics bit for bit on every backend (two threads, two spans and a
    /// tail, masked and not; the log-ratios cross the clip bounds, δ = 5, c = 3 and both clamps,
    /// and some lie a few ULP from a bound, where `−A·ρ` can round like `−A·bound`).
    #[test]
    fn every_option_combination_matches_core_on_every_backend() {
        let n = 16384 + 2048 + 37;
        let mut next = crate::test_data::uniform_f32(0x2545_f491_4f6c_dd1d);
        // Every 97 tokens, eight log-ratios lie within 4 ULP of ln(lo), ln(hi), ln(c) or ln(δ)
        // (lp = that value, old = 0): ratios around each bound, some of whose products with
        // the advantage round like the bound's (ties the branches must be decided without).
        let bounds = [0.8f32, 1.28, 3.0, 5.0];
        let near_bound = |t: usize| (3..11).contains(&(t % 97));
        let mut lp: Vec<f32> = (0..n).map(|_| -4.0 * next()).collect();
        let old: Vec<f32> = (0..n)
            .map(|t| {
                if near_bound(t) {
                    let b = bounds[t % 4].ln();
                    lp[t] = f32::from_bits((b.to_bits() as i32 + (t % 9) as i32 - 4) as u32);
                    return 0.0;
                }
                let d = match t % 97 {
                    0 => 25.0,
                    1 => -25.0,
                    2 => -120.0,
                    _ => 2.0 * next() - 1.0,
                };
                lp[t] - d
            })
            .collect();
        let adv: Vec<f32> = (0..n)
            .map(|t| if t % 13 == 0 { 0.0 } else { 4.0 * next() - 2.0 })
            .collect();
        let mask: Vec<bool> = (0..n).map(|_| next() < 0.9).collect();
        let ties = (0..n)
            .filter(|&t| {
                let (rho, a) = (<f32 as grpo_core::Real>::exp(lp[t]), adv[t]);
                near_bound(t) && bounds.iter().any(|&b| rho != b && a * rho == a * b)
            })
            .count();
        assert!(ties > 0, "no rounding ties at the bounds");
        let mut loops = 0;
        for clamp in [None, Some(20.0f32), Some(100.0)] {
            for delta_cap in [None, Some(5.0f32)] {
                for dual_clip in [None, Some(3.0f32)] {
                    let cfg = PpoClipConfig {
                        bounds: RatioBounds { lo: 0.8, hi: 1.28 },
                        dual_clip,
                        delta_cap,
                        log_ratio_clamp: clamp,
                    };
                    loops += 1;
                    for m in [None, Some(&mask[..])] {
                        let inp = PolicyInputs {
                            lp: &lp,
                            old: &old,
                            adv: &adv,
                            tokens: Tokens::padded(1, n, m),
                        };
                        let (mut v0, mut g0) = (vec![0.0f32; n], vec![0.0f32; n]);
                        let want = ppo_clip(&cfg, &inp, &mut v0, &mut g0).unwrap();
                        if clamp.is_some() {
                            assert!(want.clamped > 0, "{cfg:?}");
                        }
                        if delta_cap.is_some() {
                            assert!(want.delta_capped > 0, "{cfg:?}");
                        }
                        if dual_clip.is_some() {
                            assert!(want.dual_clipped > 0, "{cfg:?}");
                        }
                        assert!(want.clipped_low > 0 && want.clipped_high > 0, "{cfg:?}");
                        for b in Backend::available() {
                            let cpu = Cpu::new(b).unwrap().with_threads(2).unwrap();
                            let (mut v, mut g) = (vec![9.0f32; n], vec![9.0f32; n]);
                            let got = cpu.ppo_clip(&cfg, &inp, &mut v, &mut g).unwrap();
                            let who = format!("{b:?}, mask {}, {cfg:?}", m.is_some());
                            assert_eq!(got, want, "{who}");
                            assert_eq!(got.kl_sum.to_bits(), want.kl_sum.to_bits(), "{who}");
                            let bits =
                                |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                            assert!(bits(&v) == bits(&v0), "{who}: values");
                            assert!(bits(&g) == bits(&g0), "{who}: gradients");
                        }
                    }
                }
            }
        }
        assert_eq!(loops, 12);
    }

    /// The write pass's two chunkings — aligned to the arrays when all five lie equally far
    /// from a 64-byte boundary (each of the 16 distances), the canonical chunks otherwise —
    /// give grpo-core's bits and diagnostics on every backend (NEON too, under qemu in CI).
    #[test]
    fn every_array_offset_matches_core_on_every_backend() {
        let n = 2048 + 16 + 37;
        let mut next = crate::test_data::uniform_f32(0x5851_f42d_4c95_7f2d);
        let lp: Vec<f32> = (0..n).map(|_| -4.0 * next()).collect();
        let old: Vec<f32> = lp.iter().map(|&l| l + 0.8 * next() - 0.4).collect();
        let adv: Vec<f32> = (0..n).map(|_| 4.0 * next() - 2.0).collect();
        let mask: Vec<bool> = (0..n).map(|_| next() < 0.9).collect();
        let cfg = PpoClipConfig::<f32>::default();
        // The first index of `buf` whose address lies `4·q` bytes past a 64-byte boundary.
        let at = |buf: &[f32], q: usize| {
            (0..16)
                .find(|&i| (buf.as_ptr() as usize + 4 * i) % 64 == 4 * q)
                .unwrap()
        };
        let offsets = (0..16)
            .map(|q| [q; 5])
            .chain([[0, 0, 0, 0, 5], [5, 5, 5, 0, 0]]);
        for q in offsets {
            let mut bufs: Vec<Vec<f32>> = (0..5).map(|_| vec![0.0f32; n + 16]).collect();
            let o: Vec<usize> = (0..5).map(|k| at(&bufs[k], q[k])).collect();
            for (k, src) in [&lp, &old, &adv].into_iter().enumerate() {
                bufs[k][o[k]..o[k] + n].copy_from_slice(src);
            }
            let [l, od, a, v, g] = &mut bufs[..] else {
                unreachable!()
            };
            for m in [None, Some(&mask[..])] {
                let inp = PolicyInputs {
                    lp: &l[o[0]..o[0] + n],
                    old: &od[o[1]..o[1] + n],
                    adv: &a[o[2]..o[2] + n],
                    tokens: Tokens::padded(1, n, m),
                };
                let (mut v0, mut g0) = (vec![0.0f32; n], vec![0.0f32; n]);
                let want = ppo_clip(&cfg, &inp, &mut v0, &mut g0).unwrap();
                for b in Backend::available() {
                    let cpu = Cpu::new(b).unwrap().with_threads(1).unwrap();
                    let (v, g) = (&mut v[o[3]..o[3] + n], &mut g[o[4]..o[4] + n]);
                    v.fill(9.0);
                    g.fill(9.0);
                    let got = cpu.ppo_clip(&cfg, &inp, v, g).unwrap();
                    let who = format!("{b:?}, offsets {q:?}, mask {}", m.is_some());
                    assert_eq!(got, want, "{who}");
                    assert_eq!(got.kl_sum.to_bits(), want.kl_sum.to_bits(), "{who}");
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert!(bits(v) == bits(&v0), "{who}: values");
                    assert!(bits(g) == bits(&g0), "{who}: gradients");
                }
            }
        }
    }

    /// The check mode's verdict on one span on every backend this CPU has (asserted equal).
    fn check_ok(
        cfg: &PpoClipConfig<f32>,
        lp: &[f32],
        old: &[f32],
        adv: &[f32],
        mask: Option<&[bool]>,
    ) -> bool {
        let p = PpoParams::new(cfg);
        let verdicts: Vec<bool> = Backend::available()
            .map(|b| {
                let span = PpoSpan {
                    p,
                    lp,
                    old,
                    adv,
                    mask,
                    out: None,
                };
                crate::arch::run(b, span).ok
            })
            .collect();
        assert!(verdicts.iter().all(|&v| v == verdicts[0]), "{verdicts:?}");
        verdicts[0]
    }

    /// A span of `n` ordinary tokens with `lp[at] = lp_at`, `adv[at] = adv_at` (old = 0).
    fn span_with(n: usize, at: usize, lp_at: f32, adv_at: f32) -> [Vec<f32>; 3] {
        let lp = (0..n)
            .map(|t| if t == at { lp_at } else { -0.01 * t as f32 })
            .collect();
        let adv = (0..n).map(|t| if t == at { adv_at } else { 1.0 }).collect();
        [lp, vec![0.0; n], adv]
    }

    /// The bound `R` is above the canonical exponential of every argument it covers: every
    /// 997th float of [−90, 80], the clamps the presets use, and 80 itself.
    #[test]
    fn the_ratio_bound_covers_the_canonical_exp() {
        let negative = ((-0.0f32).to_bits()..=(-90.0f32).to_bits()).step_by(997);
        let positive = (0..=CHECK_LOG_RATIO_MAX.to_bits()).step_by(997);
        let mut count = 0;
        for x in negative.chain(positive).map(f32::from_bits) {
            assert!(exp(x) <= exp_upper_bound(x), "x = {x:e}");
            assert!(exp(x) <= exp_upper_bound(CHECK_LOG_RATIO_MAX), "x = {x:e}");
            count += 1;
        }
        assert!(count > 2_000_000, "{count}");
        for c in [0.2f32, 1.0, 10.0, 20.0, 80.0] {
            assert!(exp(c) <= exp_upper_bound(c) && exp_upper_bound(c) <= exp(c) * 1.00001);
        }
    }

    /// Where the check passes and where it hands the span to grpo-core, at each of its
    /// bounds, in the body (chunks of 16) and in the tail, masked and not.
    #[test]
    fn the_check_passes_exactly_inside_its_bounds() {
        let clamped = PpoClipConfig::<f32>::default();
        assert_eq!(clamped.log_ratio_clamp, Some(20.0));
        let unclamped = PpoClipConfig::<f32>::from_preset(Preset::Trl);
        assert_eq!(unclamped.log_ratio_clamp, None);
        let wide = PpoClipConfig {
            log_ratio_clamp: Some(100.0),
            ..clamped
        };
        let dual = PpoClipConfig {
            dual_clip: Some(1e30),
            ..clamped
        };
        let up = |x: f32| f32::from_bits(x.to_bits() + 1);
        // The largest |A| whose A·M is finite under the default clamp: M = e^20 (rounded up).
        let m = exp_upper_bound(20.0);
        let a_max = f32::MAX / m;
        for (n, at) in [(48, 20), (53, 50)] {
            let cases: [(&PpoClipConfig<f32>, f32, f32, bool); 16] = [
                (&clamped, -0.5, 1.0, true),
                // A clamped log-ratio: ρ ≤ e^20 whatever lp − old is.
                (&clamped, 1e30, 1.0, true),
                (&clamped, f32::NAN, 1.0, false),
                (&clamped, f32::INFINITY, 1.0, false),
                (&clamped, -0.5, f32::INFINITY, false),
                (&clamped, -0.5, f32::NAN, false),
                (&clamped, -0.5, a_max * 0.99, true),
                (&clamped, -0.5, -a_max * 0.99, true),
                (&clamped, -0.5, a_max * 1.01, false),
                // Without a clamp, or with one above 80: log-ratios up to 80.
                (&unclamped, CHECK_LOG_RATIO_MAX, 1.0, true),
                (&unclamped, up(CHECK_LOG_RATIO_MAX), 1e-30, false),
                (&unclamped, -1e30, 1.0, true),
                (&wide, CHECK_LOG_RATIO_MAX, 1.0, true),
                (&wide, up(CHECK_LOG_RATIO_MAX), 1.0, false),
                // M takes the dual clip's constant.
                (&dual, -0.5, 1e8, true),
                (&dual, -0.5, 1e9, false),
            ];
            for (cfg, lp_at, adv_at, want) in cases {
                let [lp, old, adv] = span_with(n, at, lp_at, adv_at);
                let what = format!("n = {n}, lp = {lp_at:e}, A = {adv_at:e}, {cfg:?}");
                assert_eq!(check_ok(cfg, &lp, &old, &adv, None), want, "{what}");
                // Masked out, the token is not checked; masked in, it is.
                let mut mask = vec![true; n];
                assert_eq!(check_ok(cfg, &lp, &old, &adv, Some(&mask)), want, "{what}");
                mask[at] = false;
                assert!(
                    check_ok(cfg, &lp, &old, &adv, Some(&mask)),
                    "masked: {what}"
                );
            }
        }
    }
}
