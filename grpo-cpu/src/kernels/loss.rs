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
//! Two modes share the lane code: the *check* mode (no writes) gathers the diagnostics and
//! tells whether the span is safe to write; the *write* mode stores values and gradients
//! (`F32x16::store_stream`: the outputs are written once and not read back).
//!
//! The check is a cheaper, conservative stand-in for grpo-core's (finite `lp`, `old`, `A`,
//! value and gradient): it requires `d = lp − old` finite (which implies finite `lp` and `old`:
//! `±∞ − y` and NaN stay non-finite) and `B = A·max(ρ, hi, c_dual)` finite. Since
//! `|value| ≤ |A|·max(ρ', clip(ρ), c_dual) ≤ |B|` and `|grad| ∈ {0, |A·ρ|} ≤ |B|`, and `B` is
//! non-finite for non-finite `A` (`max(…) ≥ hi > 1`), a span that passes would pass grpo-core.
//! The converse can fail only when `A·ρ` overflows while the selected branch stays finite (an
//! unclamped log-ratio above ~88 − ln|A|); such a span reports "not ok" and the caller falls
//! back to grpo-core, which returns the correct result — slower, never different.

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
    /// `max(hi, dual)`: with `ρ`, bounds every ratio the value multiplies `A` by.
    pub(crate) value_bound: f32,
    /// The clamp keeps every finite log-ratio within `exp_moderate`'s range.
    pub(crate) moderate: bool,
}

impl PpoParams {
    /// The kernel's parameters for a configuration that passed
    /// `grpo_core::loss::PpoClipConfig::validate`.
    pub(crate) fn new(cfg: &grpo_core::loss::PpoClipConfig<f32>) -> Self {
        let hi = cfg.bounds.hi;
        PpoParams {
            lo: cfg.bounds.lo,
            hi,
            clamp: cfg.log_ratio_clamp,
            dual: cfg.dual_clip,
            cap: cfg.delta_cap,
            value_bound: cfg.dual_clip.map_or(hi, |c| c.max(hi)),
            moderate: cfg.log_ratio_clamp.is_some_and(|c| c <= EXP_MODERATE_MAX),
        }
    }
}

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

/// What the check mode found in a span (the write mode returns the default).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SpanDiag {
    /// Every valid input, `lp − old`, value and gradient is finite.
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
    /// `lp − old` before the clamp.
    d: V,
    x: V,
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

/// grpo-core's PPO-clip token step (`ppo_clip`'s closure and `ppo_core`) per lane.
#[inline(always)]
fn token_lanes<V: F32x16>(p: &PpoParams, lp: V, old: V, a: V) -> TokenLanes<V> {
    let zero = V::splat(0.0);
    let d = lp.sub(old);
    let (x, clamped) = match p.clamp {
        Some(c) => {
            let (c, mc) = (V::splat(c), V::splat(-c));
            let above = d.gt(c);
            let below = d.lt(mc);
            (
                V::select(above, c, V::select(below, mc, d)),
                V::mask_or(above, below),
            )
        }
        None => (d, V::mask_none()),
    };
    // Inside the clamp the cheaper form of the same exponential applies.
    let rho = if p.moderate { exp_moderate(x) } else { exp(x) };
    let drho = V::select(clamped, zero, rho);
    // Unclipped branch, optionally capped at δ.
    let (r1, dr1, cap) = match p.cap {
        Some(dc) => {
            let m = rho.gt(V::splat(dc));
            (V::select(m, V::splat(dc), rho), V::select(m, zero, drho), m)
        }
        None => (rho, drho, V::mask_none()),
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
    let second = v2.gt(v1);
    let mut value = V::select(second, v2, v1);
    let mut grad = V::select(second, g2, g1);
    let a_neg = a.lt(zero);
    let a_pos = a.gt(zero);
    let capped = V::mask_and(V::mask_and(cap, a_neg), v1.ge(v2));
    let clip_high = V::mask_and(a_pos, above);
    let clip_low = V::mask_and(a_neg, below);
    let dual = match p.dual {
        Some(c) => {
            let v3 = neg(V::splat(c).mul(a));
            let m = V::mask_and(a_neg, v3.lt(value));
            value = V::select(m, v3, value);
            grad = V::select(m, zero, grad);
            m
        }
        None => V::mask_none(),
    };
    // A = 0 (either sign): value and gradient +0, no flag (the flags above need A ≠ 0).
    let a_zero = a.eq(zero);
    value = V::select(a_zero, zero, value);
    grad = V::select(a_zero, zero, grad);
    TokenLanes {
        value,
        grad,
        d,
        x,
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

/// One chunk of 16 positions: its lanes, its (masked) advantages and its validity.
///
/// A function rather than a closure: a closure is a separate function, and if LLVM declines to
/// inline it, its intrinsics are compiled without the ISA's features.
#[inline(always)]
fn chunk<V: F32x16>(
    p: &PpoParams,
    lp: &[f32; 16],
    old: &[f32; 16],
    adv: &[f32; 16],
    mask: Option<&[bool; 16]>,
) -> (TokenLanes<V>, V, Option<V::Mask>) {
    let valid = mask.map(valid_lanes::<V>);
    let (l, o, a) = masked_inputs(valid, V::load(lp), V::load(old), V::load(adv));
    (token_lanes(p, l, o, a), a, valid)
}

/// Running diagnostics of the check mode, in lanes (counts as exact f32 lane counts: a span
/// holds far fewer than 2^24 tokens per lane).
struct Acc<V: F32x16> {
    /// `Σ (d·0 + B·0)` with `B = A·max(ρ, hi, c_dual)`: finite (a sum of zeros) exactly when
    /// every `d` and `B` was finite, NaN otherwise (`±∞·0 = NaN`, and NaN propagates through
    /// `+`). See the module docs for why this is a safe stand-in for grpo-core's check.
    check: V,
    tokens: V,
    clipped_low: V,
    clipped_high: V,
    dual: V,
    capped: V,
    clamped: V,
    rmin: V,
    rmax: V,
}

/// `acc + 1` in the lanes of `m` (written as a select of the sum, which AVX-512 does in one
/// masked add).
#[inline(always)]
fn count<V: F32x16>(acc: V, m: V::Mask) -> V {
    V::select(m, acc.add(V::splat(1.0)), acc)
}

impl<V: F32x16> Acc<V> {
    #[inline(always)]
    fn new() -> Self {
        let zero = V::splat(0.0);
        Acc {
            check: zero,
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
    /// Flags that the configuration cannot raise are not counted (the branches are the same for
    /// every chunk).
    #[inline(always)]
    fn add(&mut self, p: &PpoParams, t: &TokenLanes<V>, a: V, valid: Option<V::Mask>) {
        let zero = V::splat(0.0);
        // |value| ≤ |A|·max(ρ, hi, c_dual) and |grad| ≤ |A|·ρ (module docs).
        let bound = a.mul(t.rho.max(V::splat(p.value_bound)));
        let nan_if_inf = t.d.mul_add(zero, bound.mul(zero));
        self.check = self.check.add(nan_if_inf);
        self.clipped_low = count(self.clipped_low, t.clip_low);
        self.clipped_high = count(self.clipped_high, t.clip_high);
        if p.dual.is_some() {
            self.dual = count(self.dual, t.dual);
        }
        if p.cap.is_some() {
            self.capped = count(self.capped, t.capped);
        }
        if p.clamp.is_some() {
            self.clamped = count(self.clamped, t.clamped);
        }
        match valid {
            None => {
                self.rmin = self.rmin.min(t.rho);
                self.rmax = self.rmax.max(t.rho);
            }
            Some(m) => {
                self.tokens = count(self.tokens, m);
                self.rmin = self.rmin.min(V::select(m, t.rho, V::splat(f32::INFINITY)));
                self.rmax = self
                    .rmax
                    .max(V::select(m, t.rho, V::splat(f32::NEG_INFINITY)));
            }
        }
    }

    /// The span's diagnostics; `unmasked` = tokens of chunks added with `valid = None`.
    fn finish(self, kl: f32, unmasked: usize) -> SpanDiag {
        let total = |v: V| v.to_array().iter().map(|&c| c as usize).sum::<usize>();
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
            ok: self.check.to_array().iter().all(|c| c.is_finite()),
            tokens: unmasked + total(self.tokens),
            clipped_low: total(self.clipped_low),
            clipped_high: total(self.clipped_high),
            dual_clipped: total(self.dual),
            delta_capped: total(self.capped),
            clamped: total(self.clamped),
            kl,
            ratio_min: rmin,
            ratio_max: rmax,
        }
    }
}

impl Kernel for PpoSpan<'_> {
    type Output = SpanDiag;

    #[inline(always)]
    fn run<V: F32x16>(self) -> SpanDiag {
        let PpoSpan {
            p,
            lp,
            old,
            adv,
            mask,
            mut out,
        } = self;
        let n = lp.len();
        let mut acc = Acc::<V>::new();
        let mut unmasked = 0;
        let mut fold = PairwiseFold::new();
        let zero = V::splat(0.0);
        let mut start = 0;
        while start < n {
            let end = (start + BLOCK).min(n);
            let n16 = start + (end - start) / LANES * LANES;
            let mut kl = zero;
            let (lpc, _) = lp[start..n16].as_chunks::<16>();
            let (oldc, _) = old[start..n16].as_chunks::<16>();
            let (advc, _) = adv[start..n16].as_chunks::<16>();
            let maskc = mask.map(|m| m[start..n16].as_chunks::<16>().0);
            match out.as_mut() {
                Some((value, grad)) => {
                    let (vc, _) = value[start..n16].as_chunks_mut::<16>();
                    let (gc, _) = grad[start..n16].as_chunks_mut::<16>();
                    for (k, (v, g)) in vc.iter_mut().zip(gc.iter_mut()).enumerate() {
                        let (lanes, _, _) =
                            chunk::<V>(&p, &lpc[k], &oldc[k], &advc[k], maskc.map(|m| &m[k]));
                        lanes.value.store_stream(v);
                        lanes.grad.store_stream(g);
                    }
                }
                None => {
                    for k in 0..lpc.len() {
                        let (lanes, a, valid) =
                            chunk::<V>(&p, &lpc[k], &oldc[k], &advc[k], maskc.map(|m| &m[k]));
                        acc.add(&p, &lanes, a, valid);
                        kl = kl.sub(lanes.x);
                    }
                    if mask.is_none() {
                        unmasked += n16 - start;
                    }
                }
            }
            // Tail (only in the batch's last block): the same lanes on a zero-padded chunk, then
            // the canonical order — tree first, tail elements added in index order.
            let tail = end - n16;
            let mut kl_lanes = kl.to_array();
            tree(&mut kl_lanes);
            let mut s = kl_lanes[0];
            if tail > 0 {
                let pad = |src: &[f32]| {
                    let mut a = [0.0f32; 16];
                    a[..tail].copy_from_slice(&src[n16..end]);
                    a
                };
                let mut m = [false; 16];
                for (l, b) in m.iter_mut().enumerate().take(tail) {
                    *b = mask.is_none_or(|mk| mk[n16 + l]);
                }
                let valid = Some(valid_lanes::<V>(&m));
                let (l, o, a) = masked_inputs(
                    valid,
                    V::load(&pad(lp)),
                    V::load(&pad(old)),
                    V::load(&pad(adv)),
                );
                let lanes = token_lanes(&p, l, o, a);
                match out.as_mut() {
                    Some((value, grad)) => {
                        value[n16..end].copy_from_slice(&lanes.value.to_array()[..tail]);
                        grad[n16..end].copy_from_slice(&lanes.grad.to_array()[..tail]);
                    }
                    None => {
                        acc.add(&p, &lanes, a, valid);
                        let x = lanes.x.to_array();
                        for l in 0..tail {
                            if m[l] {
                                s += -x[l];
                            }
                        }
                    }
                }
            }
            fold.push(s, |a, b| a + b);
            start = end;
        }
        match out {
            Some(_) => SpanDiag::default(),
            None => acc.finish(fold.finish(|a, b| a + b).unwrap_or(0.0), unmasked),
        }
    }
}
