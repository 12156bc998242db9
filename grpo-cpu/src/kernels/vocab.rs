//! grpo-core's canonical vocabulary reductions (grpo_core::vocab::canon) over 16 lanes.
//!
//! The reference fixes *what* is computed: blocks of `BLOCK` = 2048 logits, per block the raw
//! maximum, then the element step in 16 strided lanes, the fixed lane tree, the tail on lane 0,
//! and a pairwise merge of block states. This file fixes *how fast*: the maximum pass streams
//! the block from memory (with software prefetch ahead) so the step pass finds it in L1; the
//! step pass is one vector per 16 elements with the lane accumulators in registers; merges and
//! tails use the same lane operations on lane 0, so hardware FMA replaces the reference's
//! software `fmaf` with identical bits.
//!
//! Everything here is `#[inline(always)]`: it is instantiated inside the per-ISA entry
//! functions of `arch/`.

use grpo_core::vocab::canon::{self, BLOCK, GradCoef, KlGrad, LseState, PairState};
use grpo_core::vocab::exp_ln::D_MIN;

use super::Kernel;
use super::math::{exp_nonpos_clamped, ln};
use crate::lanes::F32x16;

/// How far ahead of the maximum pass the next cache lines are requested.
const PREFETCH_BYTES: usize = 8192;

/// A logit storage type the lanes can load 16 at a time.
pub trait Load: canon::Logit {
    /// Loads and widens 16 consecutive values exactly.
    fn load<V: F32x16>(c: &[Self; 16]) -> V;
    /// Stores 16 gradients rounded to this type (`Logit::from_f32`, ties to even).
    #[inline(always)]
    fn store_grad<V: F32x16>(g: V, dst: &mut [Self; 16]) {
        let a = g.to_array();
        for (d, x) in dst.iter_mut().zip(a) {
            *d = Self::from_f32(x);
        }
    }
}

impl Load for f32 {
    #[inline(always)]
    fn load<V: F32x16>(c: &[f32; 16]) -> V {
        V::load(c)
    }
    #[inline(always)]
    fn store_grad<V: F32x16>(g: V, dst: &mut [f32; 16]) {
        g.store(dst);
    }
}

impl Load for half::bf16 {
    #[inline(always)]
    fn load<V: F32x16>(c: &[half::bf16; 16]) -> V {
        V::load_bf16(c)
    }
}

impl Load for half::f16 {
    #[inline(always)]
    fn load<V: F32x16>(c: &[half::f16; 16]) -> V {
        V::load_f16(c)
    }
}

/// `fma(a, b, c)` in lane 0 with the hardware (or portable) FMA of `V`.
#[inline(always)]
fn fma1<V: F32x16>(a: f32, b: f32, c: f32) -> f32 {
    V::splat(a).mul_add(V::splat(b), V::splat(c)).to_array()[0]
}

/// `canon::block_max`: the raw maximum of a block (order-free: max is exact, and the sign of
/// a zero is removed later by `scaled_max`).
///
/// Validation needs no separate test here: a NaN or +∞ logit always reaches the row state as a
/// non-finite maximum (+∞, or a NaN maximum) or a NaN sum (NaN and +∞ turn `exp` and every
/// later sum, product and merge into NaN), so the callers check `max` and `sum` for
/// finiteness — which also covers grpo-core's "all −∞" and "max/T overflows" errors.
#[inline(always)]
fn block_max<V: F32x16, S: Load>(z: &[S]) -> f32 {
    let (chunks, tail) = z.as_chunks::<16>();
    let mut m = [V::splat(f32::NEG_INFINITY); 4];
    let mut quads = chunks.chunks_exact(4);
    for q in &mut quads {
        for k in 0..4 {
            m[k] = m[k].max(S::load::<V>(&q[k]));
        }
    }
    for c in quads.remainder() {
        m[0] = m[0].max(S::load::<V>(c));
    }
    let v = m[0].max(m[1]).max(m[2].max(m[3])).to_array();
    let mut r = f32::NEG_INFINITY;
    for x in v {
        r = canon_max(r, x);
    }
    for &x in tail {
        r = canon_max(r, x.to_f32());
    }
    r
}

/// Requests the cache line `PREFETCH_BYTES` ahead of `p` (one call per 64-byte line: every
/// chunk of f32, every other chunk of 16-bit storage, chosen by the chunk index `i`). The step
/// pass issues these while it computes, so memory keeps streaming the next blocks in the
/// background of the arithmetic.
#[inline(always)]
fn prefetch_ahead<V: F32x16, S>(c: &[S; 16], i: usize) {
    if (i * size_of::<[S; 16]>()) % 64 == 0 {
        V::prefetch(c.as_ptr().cast::<u8>().wrapping_add(PREFETCH_BYTES));
    }
}

/// Support flags of a student/teacher block: `(forward, reverse)` violations, i.e. some
/// `w = −∞ < z` (KL(p‖q) = +∞) or some `z = −∞ < w` (KL(q‖p) = +∞).
#[inline(always)]
fn support<V: F32x16, S: Load, U: Load>(z: &[S], w: &[U]) -> (bool, bool) {
    let ninf = V::splat(f32::NEG_INFINITY);
    let (zc, zt) = z.as_chunks::<16>();
    let (wc, wt) = w.as_chunks::<16>();
    let (mut fwd, mut rev) = (V::mask_none(), V::mask_none());
    for (a, b) in zc.iter().zip(wc) {
        let mz = S::load::<V>(a).eq(ninf);
        let mw = U::load::<V>(b).eq(ninf);
        fwd = V::mask_or(fwd, V::mask_andnot(mz, mw));
        rev = V::mask_or(rev, V::mask_andnot(mw, mz));
    }
    let (mut f, mut r) = (V::mask_any(fwd), V::mask_any(rev));
    for (a, b) in zt.iter().zip(wt) {
        let (mz, mw) = (
            a.to_f32() == f32::NEG_INFINITY,
            b.to_f32() == f32::NEG_INFINITY,
        );
        f |= mw && !mz;
        r |= mz && !mw;
    }
    (f, r)
}

/// `max_r`: `if a > b { a } else { b }`.
#[inline(always)]
fn canon_max(a: f32, b: f32) -> f32 {
    if a > b { a } else { b }
}

/// The lane form of `canon::lse_step` on accumulators `(s, t)`.
#[inline(always)]
fn lse_step<V: F32x16>(z: V, tau: V, c: V, s: &mut V, t: &mut V) {
    let d = z.mul_add(tau, c);
    let dc = V::splat(D_MIN).max(d);
    let e = exp_nonpos_clamped(dc);
    *s = s.add(e);
    *t = e.mul_add(dc, *t);
}

/// `canon::lse_block` in lanes.
#[inline(always)]
fn lse_block<V: F32x16, S: Load>(z: &[S], tau: f32) -> LseState {
    let m = canon::scaled_max(block_max::<V, S>(z), tau);
    let (vt, vc) = (V::splat(tau), V::splat(canon::offset(m)));
    let (mut s, mut t) = (V::splat(0.0), V::splat(0.0));
    let (chunks, tail) = z.as_chunks::<16>();
    for (i, c) in chunks.iter().enumerate() {
        prefetch_ahead::<V, S>(c, i);
        lse_step::<V>(S::load(c), vt, vc, &mut s, &mut t);
    }
    let (mut sa, mut ta) = (s.to_array(), t.to_array());
    canon::tree(&mut sa);
    canon::tree(&mut ta);
    // The tail goes through lane 0 in index order; the other lanes are don't-care.
    let (mut s, mut t) = (V::splat(sa[0]), V::splat(ta[0]));
    for &x in tail {
        lse_step::<V>(V::splat(x.to_f32()), vt, vc, &mut s, &mut t);
    }
    LseState {
        max: m,
        sum: s.to_array()[0],
        dot: t.to_array()[0],
    }
}

/// `(δc, e^δc)` of `canon`'s `rescale` for two maxima at once (lanes 0 and 1).
#[inline(always)]
fn rescale2<V: F32x16>(ma: f32, mb: f32, top: f32) -> ([f32; 16], [f32; 16]) {
    let mut m = [0.0; 16];
    m[0] = ma;
    m[1] = mb;
    let dc = V::splat(D_MIN).max(V::from_array(m).sub(V::splat(top)));
    (dc.to_array(), exp_nonpos_clamped(dc).to_array())
}

/// `LseState::merge` with lane arithmetic.
#[inline(always)]
pub(crate) fn merge_lse<V: F32x16>(a: LseState, b: LseState) -> LseState {
    let top = canon_max(a.max, b.max);
    if top == f32::NEG_INFINITY {
        return LseState {
            max: top,
            sum: a.sum + b.sum,
            dot: a.dot + b.dot,
        };
    }
    let (d, e) = rescale2::<V>(a.max, b.max, top);
    LseState {
        max: top,
        sum: fma1::<V>(a.sum, e[0], b.sum * e[1]),
        dot: fma1::<V>(
            fma1::<V>(d[0], a.sum, a.dot),
            e[0],
            fma1::<V>(d[1], b.sum, b.dot) * e[1],
        ),
    }
}

/// `PairState::merge` with lane arithmetic.
#[inline(always)]
pub(crate) fn merge_pair<V: F32x16>(a: PairState, b: PairState) -> PairState {
    let z = merge_lse::<V>(a.student(), b.student());
    let w = merge_lse::<V>(a.teacher(), b.teacher());
    // Lanes: 0 = a's student, 1 = b's student, 2 = a's teacher, 3 = b's teacher.
    let mut parts = [0.0; 16];
    let mut tops = [0.0; 16];
    parts[..4].copy_from_slice(&[a.zmax, b.zmax, a.wmax, b.wmax]);
    tops[..4].copy_from_slice(&[z.max, z.max, w.max, w.max]);
    let (vp, vt) = (V::from_array(parts), V::from_array(tops));
    let diff = vp.sub(vt);
    let shift = V::splat(-f32::MAX).max(diff).to_array();
    let factor = exp_nonpos_clamped(V::splat(D_MIN).max(diff)).to_array();
    let g = |i: usize| {
        if tops[i] == f32::NEG_INFINITY {
            0.0
        } else {
            shift[i]
        }
    };
    let f = |i: usize| {
        if tops[i] == f32::NEG_INFINITY {
            1.0
        } else {
            factor[i]
        }
    };
    let (gzl, gzr, gwl, gwr) = (g(0), g(1), g(2), g(3));
    let ul = fma1::<V>(gzl - gwl, a.sz, a.u);
    let vl = fma1::<V>(gwl - gzl, a.sw, a.v);
    let ur = fma1::<V>(gzr - gwr, b.sz, b.u);
    let vr = fma1::<V>(gwr - gzr, b.sw, b.v);
    PairState {
        zmax: z.max,
        sz: z.sum,
        tz: z.dot,
        wmax: w.max,
        sw: w.sum,
        tw: w.dot,
        u: fma1::<V>(ul, f(0), ur * f(1)),
        v: fma1::<V>(vl, f(2), vr * f(3)),
    }
}

/// `canon::fold_blocks`: reduces `len` elements block by block in the canonical pairwise order
/// (recursive split at the largest power of two below the block count, evaluated with a
/// binary-counter stack). `None` for `len = 0`.
#[inline(always)]
fn fold_blocks<St: Copy>(
    len: usize,
    merge: impl Fn(St, St) -> St,
    mut block: impl FnMut(usize, usize) -> St,
) -> Option<St> {
    const LEVELS: usize = usize::BITS as usize;
    let mut stack: [Option<St>; LEVELS] = [None; LEVELS];
    let mut j = 0usize;
    let mut start = 0usize;
    while start < len {
        let end = if len - start > BLOCK {
            start + BLOCK
        } else {
            len
        };
        let mut cur = block(start, end);
        let mut level = 0;
        while level < LEVELS && (j >> level) & 1 == 1 {
            if let Some(left) = stack[level].take() {
                cur = merge(left, cur);
            }
            level += 1;
        }
        if level < LEVELS {
            stack[level] = Some(cur);
        }
        j += 1;
        start = end;
    }
    let mut acc: Option<St> = None;
    for slot in stack.iter_mut() {
        if let Some(left) = slot.take() {
            acc = Some(match acc {
                None => left,
                Some(right) => merge(left, right),
            });
        }
    }
    acc
}

/// The merged [`LseState`] of a whole row (`EMPTY` for an empty row).
#[inline(always)]
pub(crate) fn lse_row<V: F32x16, S: Load>(z: &[S], tau: f32) -> LseState {
    fold_blocks(z.len(), merge_lse::<V>, |s, e| {
        lse_block::<V, S>(&z[s..e], tau)
    })
    .unwrap_or(LseState::EMPTY)
}

/// The lane form of `canon::pair_step`; `acc` is `[sz, tz, sw, tw, u, v]`.
#[inline(always)]
fn pair_step<V: F32x16>(z: V, w: V, tau: V, cz: V, cw: V, acc: &mut [V; 6]) {
    let dmin = V::splat(D_MIN);
    let neg_max = V::splat(-f32::MAX);
    let (dz, dw) = (z.mul_add(tau, cz), w.mul_add(tau, cw));
    let dzc = dmin.max(dz);
    let ez = exp_nonpos_clamped(dzc);
    let dwc = dmin.max(dw);
    let ew = exp_nonpos_clamped(dwc);
    let g = neg_max.max(dz).sub(neg_max.max(dw));
    // −g is exact: flip the sign bit.
    let neg_g = g.xor(V::splat(-0.0));
    acc[0] = acc[0].add(ez);
    acc[1] = ez.mul_add(dzc, acc[1]);
    acc[2] = acc[2].add(ew);
    acc[3] = ew.mul_add(dwc, acc[3]);
    acc[4] = ez.mul_add(g, acc[4]);
    acc[5] = ew.mul_add(neg_g, acc[5]);
}

/// `canon::pair_block` in lanes (`z` and `w` have the same length).
#[inline(always)]
fn pair_block<V: F32x16, S: Load, U: Load>(
    z: &[S],
    w: &[U],
    tau: f32,
    flags: &mut PairFlags,
) -> PairState {
    let zraw = block_max::<V, S>(z);
    let wraw = block_max::<V, U>(w);
    let (fwd, rev) = support::<V, S, U>(z, w);
    flags.forward |= fwd;
    flags.reverse |= rev;
    let zmax = canon::scaled_max(zraw, tau);
    let wmax = canon::scaled_max(wraw, tau);
    let vt = V::splat(tau);
    let (cz, cw) = (V::splat(canon::offset(zmax)), V::splat(canon::offset(wmax)));
    let mut acc = [V::splat(0.0); 6];
    let (zc, zt) = z.as_chunks::<16>();
    let (wc, wt) = w.as_chunks::<16>();
    for (i, (a, b)) in zc.iter().zip(wc).enumerate() {
        prefetch_ahead::<V, S>(a, i);
        prefetch_ahead::<V, U>(b, i);
        pair_step::<V>(S::load(a), U::load(b), vt, cz, cw, &mut acc);
    }
    let mut lane0 = [0.0f32; 6];
    for (k, a) in acc.iter().enumerate() {
        let mut arr = a.to_array();
        canon::tree(&mut arr);
        lane0[k] = arr[0];
    }
    let mut acc = lane0.map(V::splat);
    for (&a, &b) in zt.iter().zip(wt) {
        pair_step::<V>(
            V::splat(a.to_f32()),
            V::splat(b.to_f32()),
            vt,
            cz,
            cw,
            &mut acc,
        );
    }
    let r = acc.map(|a| a.to_array()[0]);
    PairState {
        zmax,
        sz: r[0],
        tz: r[1],
        wmax,
        sw: r[2],
        tw: r[3],
        u: r[4],
        v: r[5],
    }
}

/// A pair state grpo-core's validation would accept, support aside: both maxima and sums
/// finite (see `block_max`).
#[inline(always)]
pub(crate) fn pair_ok(st: &PairState) -> bool {
    st.zmax.is_finite() && st.wmax.is_finite() && st.sz.is_finite() && st.sw.is_finite()
}

/// A row state grpo-core's validation would accept: finite maximum and sum (see `block_max`).
#[inline(always)]
pub(crate) fn lse_ok(st: &LseState) -> bool {
    st.max.is_finite() && st.sum.is_finite()
}

/// What the fused support check of a row pair found (NaN/+∞ show in the state, see
/// `block_max`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PairFlags {
    /// Some `w = −∞ < z`: KL(p‖q) would be +∞.
    pub(crate) forward: bool,
    /// Some `z = −∞ < w`: KL(q‖p) would be +∞.
    pub(crate) reverse: bool,
}

/// The merged [`PairState`] of a student row and a teacher row of equal length (`EMPTY_PAIR`
/// for empty rows), with the validation flags.
#[inline(always)]
pub(crate) fn pair_row<V: F32x16, S: Load, U: Load>(
    z: &[S],
    w: &[U],
    tau: f32,
) -> (PairState, PairFlags) {
    let mut flags = PairFlags::default();
    let st = fold_blocks(z.len(), merge_pair::<V>, |s, e| {
        pair_block::<V, S, U>(&z[s..e], &w[s..e], tau, &mut flags)
    });
    (st.unwrap_or(EMPTY_PAIR), flags)
}

/// The lane form of `canon::grad_step` for 16 non-target elements (`o` starts at 0), or, with
/// `o = g_lp`, for the target element in every lane.
#[inline(always)]
fn grad_step<V: F32x16>(z: V, w: V, o: V, c: &GradCoef, kl: KlGrad) -> V {
    let tau = V::splat(c.tau);
    let sign = V::splat(-0.0);
    let lp = z.mul_add(tau, V::splat(c.nlse));
    let lpc = V::splat(D_MIN).max(lp);
    let p = exp_nonpos_clamped(lpc);
    let mut k = V::splat(c.g_h).mul_add(lpc.add(V::splat(c.h)), V::splat(c.g_lp));
    let mut o = o;
    match kl {
        KlGrad::None => {}
        KlGrad::Forward => {
            let lq = w.mul_add(tau, V::splat(c.nlse_w));
            let neg_max = V::splat(-f32::MAX);
            let g = neg_max.max(lp).sub(neg_max.max(lq));
            k = V::splat(-c.g_kl).mul_add(g.sub(V::splat(c.kl)), k);
        }
        KlGrad::Reverse => {
            let lq = w.mul_add(tau, V::splat(c.nlse_w));
            let q = exp_nonpos_clamped(V::splat(D_MIN).max(lq));
            k = k.sub(V::splat(c.g_kl));
            o = V::splat(-c.g_kl).mul_add(q, o);
        }
    }
    p.xor(sign).mul_add(k, o).mul(tau)
}

/// The gradient of one element (lane 0): the tails, the unaligned head and the target.
#[inline(always)]
fn grad1<V: F32x16>(z: f32, w: f32, target: bool, c: &GradCoef, kl: KlGrad) -> f32 {
    let o = V::splat(if target { c.g_lp } else { 0.0 });
    grad_step(V::splat(z), V::splat(w), o, c, kl).to_array()[0]
}

/// `canon::grad_step` for every element of a row except the target term (the caller patches
/// element `y`): `out[v] = ∂(g_lp·logp(y) + g_H·H + g_KL·KL)/∂z_v` for `v ≠ y`. `w` is the
/// teacher row (ignored when `kl` is `None`). The output is write-only, so from its first
/// 64-byte boundary on it is written with streaming stores (the gradient is elementwise, so the
/// split point changes no bit).
#[inline(always)]
fn grad_into<V: F32x16, S: Load, U: Load>(
    z: &[S],
    w: &[U],
    c: &GradCoef,
    kl: KlGrad,
    out: &mut [f32],
) {
    let n = z.len().min(out.len());
    let head = out.as_ptr().align_offset(64).min(n);
    let wv = |i: usize| w.get(i).map_or(0.0, |v| v.to_f32());
    for i in 0..head {
        out[i] = grad1::<V>(z[i].to_f32(), wv(i), false, c, kl);
    }
    let zero = V::splat(0.0);
    let (zc, _) = z[head..n].as_chunks::<16>();
    let (oc, _) = out[head..n].as_chunks_mut::<16>();
    if kl == KlGrad::None || w.len() < n {
        for (zv, o) in zc.iter().zip(oc.iter_mut()) {
            V::prefetch(zv.as_ptr().cast::<u8>().wrapping_add(PREFETCH_BYTES));
            grad_step(S::load::<V>(zv), zero, zero, c, KlGrad::None).store_stream(o);
        }
    } else {
        let (wc, _) = w[head..n].as_chunks::<16>();
        for ((zv, wv), o) in zc.iter().zip(wc).zip(oc.iter_mut()) {
            V::prefetch(zv.as_ptr().cast::<u8>().wrapping_add(PREFETCH_BYTES));
            V::prefetch(wv.as_ptr().cast::<u8>().wrapping_add(PREFETCH_BYTES));
            grad_step(S::load::<V>(zv), U::load::<V>(wv), zero, c, kl).store_stream(o);
        }
    }
    for i in head + zc.len() * 16..n {
        out[i] = grad1::<V>(z[i].to_f32(), wv(i), false, c, kl);
    }
}

/// [`grad_into`] over the logits themselves, rounding each gradient to the storage type; the
/// target's gradient is computed before the row is overwritten and written last.
#[inline(always)]
fn grad_in_place<V: F32x16, S: Load, U: Load>(
    z: &mut [S],
    w: &[U],
    y: Option<usize>,
    c: &GradCoef,
    kl: KlGrad,
) {
    let wv = |i: usize| w.get(i).map_or(0.0, |v| v.to_f32());
    let target = y.and_then(|y| Some((y, grad1::<V>(z.get(y)?.to_f32(), wv(y), true, c, kl))));
    let zero = V::splat(0.0);
    let n = z.len();
    let (zc, zt) = z.as_chunks_mut::<16>();
    let done = zc.len() * 16;
    if kl == KlGrad::None || w.len() < n {
        for zv in zc.iter_mut() {
            let g = grad_step(S::load::<V>(zv), zero, zero, c, KlGrad::None);
            S::store_grad(g, zv);
        }
    } else {
        let (wc, _) = w.as_chunks::<16>();
        for (zv, wv) in zc.iter_mut().zip(wc) {
            let g = grad_step(S::load::<V>(zv), U::load::<V>(wv), zero, c, kl);
            S::store_grad(g, zv);
        }
    }
    for (i, x) in zt.iter_mut().enumerate() {
        *x = S::from_f32(grad1::<V>(x.to_f32(), wv(done + i), false, c, kl));
    }
    if let Some((y, g)) = target
        && let Some(x) = z.get_mut(y)
    {
        *x = S::from_f32(g);
    }
}

/// Canonical sum of the JSD terms of one validated row pair (`jsd_row` of grpo-core: 16 lanes,
/// tree, tail per block; blocks merged pairwise by addition), floored at 0.
#[inline(always)]
fn jsd_sum<V: F32x16, S: Load, U: Load>(z: &[S], w: &[U], p: &JsdParams) -> f32 {
    let (tau, nlz, nlw) = (V::splat(p.tau), V::splat(p.nlz), V::splat(p.nlw));
    let (beta, omb) = (V::splat(p.beta), V::splat(p.omb));
    let term = |z: V, w: V| {
        let dmin = V::splat(D_MIN);
        let lp = dmin.max(z.mul_add(tau, nlz));
        let lq = dmin.max(w.mul_add(tau, nlw));
        let pe = exp_nonpos_clamped(lp);
        let qe = exp_nonpos_clamped(lq);
        let lm = V::splat(JSD_LN_FLOOR).max(ln(beta.mul_add(qe, omb.mul(pe))));
        beta.mul(qe)
            .mul_add(lq.sub(lm), omb.mul(pe).mul(lp.sub(lm)))
    };
    let s = fold_blocks(
        z.len(),
        |a: f32, b: f32| a + b,
        |start, end| {
            let (zc, zt) = z[start..end].as_chunks::<16>();
            let (wc, wt) = w[start..end].as_chunks::<16>();
            let mut acc = V::splat(0.0);
            for (a, b) in zc.iter().zip(wc) {
                acc = acc.add(term(S::load(a), U::load(b)));
            }
            let mut lanes = acc.to_array();
            canon::tree(&mut lanes);
            let mut s = lanes[0];
            for (a, b) in zt.iter().zip(wt) {
                s += term(V::splat(a.to_f32()), V::splat(b.to_f32())).to_array()[0];
            }
            s
        },
    )
    .unwrap_or(0.0);
    canon_max(0.0, s)
}

/// grpo-core's floor of `ln(mixture)` in the JSD (its private `LN_FLOOR`): −104.
const JSD_LN_FLOOR: f32 = -104.0;

/// Per-row constants of the JSD's second pass.
#[derive(Clone, Copy, Debug)]
pub(crate) struct JsdParams {
    pub(crate) tau: f32,
    pub(crate) nlz: f32,
    pub(crate) nlw: f32,
    pub(crate) beta: f32,
    pub(crate) omb: f32,
}

/// Row states of a batch `[rows, vocab]` (`LseState::EMPTY` for `vocab = 0`).
pub(crate) struct LseRows<'a, S> {
    pub(crate) z: &'a [S],
    pub(crate) vocab: usize,
    pub(crate) tau: f32,
    pub(crate) out: &'a mut [LseState],
}

impl<S: Load> Kernel for LseRows<'_, S> {
    type Output = ();
    #[inline(always)]
    fn run<V: F32x16>(self) {
        for (r, o) in self.out.iter_mut().enumerate() {
            let row = self
                .z
                .get(r * self.vocab..(r + 1) * self.vocab)
                .unwrap_or(&[]);
            *o = lse_row::<V, S>(row, self.tau);
        }
    }
}

/// Pair states of two batches `[rows, vocab]` (student `z`, teacher `w`).
pub(crate) struct PairRows<'a, S, U> {
    pub(crate) z: &'a [S],
    pub(crate) w: &'a [U],
    pub(crate) vocab: usize,
    pub(crate) tau: f32,
    pub(crate) out: &'a mut [(PairState, PairFlags)],
}

/// The state of an empty pair of rows.
pub(crate) const EMPTY_PAIR: PairState = PairState {
    zmax: f32::NEG_INFINITY,
    sz: 0.0,
    tz: 0.0,
    wmax: f32::NEG_INFINITY,
    sw: 0.0,
    tw: 0.0,
    u: 0.0,
    v: 0.0,
};

impl<S: Load, U: Load> Kernel for PairRows<'_, S, U> {
    type Output = ();
    #[inline(always)]
    fn run<V: F32x16>(self) {
        for (r, o) in self.out.iter_mut().enumerate() {
            let span = r * self.vocab..(r + 1) * self.vocab;
            let z = self.z.get(span.clone()).unwrap_or(&[]);
            let w = self.w.get(span).unwrap_or(&[]);
            *o = pair_row::<V, S, U>(z, w, self.tau);
        }
    }
}

/// Gradients of a batch: row `r` of `out` gets `grad_row` of row `r` of `z` (and `w`) with
/// coefficients `coef[r]` and target `y[r]`.
pub(crate) struct GradRows<'a, S, U> {
    pub(crate) z: &'a [S],
    pub(crate) w: &'a [U],
    pub(crate) y: Option<&'a [usize]>,
    pub(crate) coef: &'a [GradCoef],
    pub(crate) kl: KlGrad,
    pub(crate) vocab: usize,
    pub(crate) out: &'a mut [f32],
}

impl<S: Load, U: Load> Kernel for GradRows<'_, S, U> {
    type Output = ();
    #[inline(always)]
    fn run<V: F32x16>(self) {
        if self.vocab == 0 {
            return;
        }
        for (r, (o, c)) in self
            .out
            .chunks_exact_mut(self.vocab)
            .zip(self.coef)
            .enumerate()
        {
            let span = r * self.vocab..(r + 1) * self.vocab;
            let z = self.z.get(span.clone()).unwrap_or(&[]);
            let w = self.w.get(span).unwrap_or(&[]);
            grad_into::<V, S, U>(z, w, c, self.kl, o);
            if let Some(y) = self.y.and_then(|y| y.get(r).copied())
                && let (Some(zy), Some(oy)) = (z.get(y), o.get_mut(y))
            {
                let wy = w.get(y).map_or(0.0, |v| v.to_f32());
                *oy = grad1::<V>(zy.to_f32(), wy, true, c, self.kl);
            }
        }
    }
}

/// [`GradRows`] writing over the logits (rounded to the storage type).
pub(crate) struct GradRowsInPlace<'a, S, U> {
    pub(crate) z: &'a mut [S],
    pub(crate) w: &'a [U],
    pub(crate) y: Option<&'a [usize]>,
    pub(crate) coef: &'a [GradCoef],
    pub(crate) kl: KlGrad,
    pub(crate) vocab: usize,
}

impl<S: Load, U: Load> Kernel for GradRowsInPlace<'_, S, U> {
    type Output = ();
    #[inline(always)]
    fn run<V: F32x16>(self) {
        if self.vocab == 0 {
            return;
        }
        for (r, (z, c)) in self
            .z
            .chunks_exact_mut(self.vocab)
            .zip(self.coef)
            .enumerate()
        {
            let w = self
                .w
                .get(r * self.vocab..(r + 1) * self.vocab)
                .unwrap_or(&[]);
            let y = self.y.and_then(|y| y.get(r).copied());
            grad_in_place::<V, S, U>(z, w, y, c, self.kl);
        }
    }
}

/// JSD_β of a batch of row pairs, with each row's validation flags. Rows whose flags or
/// maxima are invalid get `NaN` (the caller then defers to grpo-core for the error).
pub(crate) struct JsdRows<'a, S, U> {
    pub(crate) z: &'a [S],
    pub(crate) w: &'a [U],
    pub(crate) vocab: usize,
    pub(crate) tau: f32,
    pub(crate) beta: f32,
    pub(crate) omb: f32,
    pub(crate) out: &'a mut [(f32, PairFlags)],
}

impl<S: Load, U: Load> Kernel for JsdRows<'_, S, U> {
    type Output = ();
    #[inline(always)]
    fn run<V: F32x16>(self) {
        for (r, o) in self.out.iter_mut().enumerate() {
            let span = r * self.vocab..(r + 1) * self.vocab;
            let z = self.z.get(span.clone()).unwrap_or(&[]);
            let w = self.w.get(span).unwrap_or(&[]);
            let (st, flags) = pair_row::<V, S, U>(z, w, self.tau);
            let ok = pair_ok(&st);
            let value = if ok {
                let (lz, _, _) = canon::finish_lse(&st.student());
                let (lw, _, _) = canon::finish_lse(&st.teacher());
                let p = JsdParams {
                    tau: self.tau,
                    nlz: -lz,
                    nlw: -lw,
                    beta: self.beta,
                    omb: self.omb,
                };
                jsd_sum::<V, S, U>(z, w, &p)
            } else {
                f32::NAN
            };
            *o = (value, flags);
        }
    }
}

#[cfg(test)]
mod tests {
    //! Each backend's row kernels against grpo-core's scalar reference, bit for bit.

    use super::*;
    use crate::arch::run;
    use crate::backend::Backend;
    use grpo_core::vocab::canon;

    fn logits(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                match s % 97 {
                    0 => f32::NEG_INFINITY,
                    1 => -0.0,
                    2 => 1e-42,
                    _ => {
                        ((s >> 11) as f64 / (1u64 << 53) as f64 * 30.0 - 15.0) as f32
                            + (i % 7) as f32
                    }
                }
            })
            .collect()
    }

    fn ref_lse(z: &[f32], tau: f32) -> LseState {
        canon::fold_blocks(z.len(), LseState::merge, |s, e| {
            canon::lse_block(&z[s..e], tau)
        })
        .unwrap_or(LseState::EMPTY)
    }

    fn ref_pair(z: &[f32], w: &[f32], tau: f32) -> PairState {
        canon::fold_blocks(z.len(), PairState::merge, |s, e| {
            canon::pair_block(&z[s..e], &w[s..e], tau)
        })
        .unwrap_or(EMPTY_PAIR)
    }

    fn bits_lse(s: &LseState) -> [u32; 3] {
        [s.max, s.sum, s.dot].map(f32::to_bits)
    }

    fn bits_pair(s: &PairState) -> [u32; 8] {
        [s.zmax, s.sz, s.tz, s.wmax, s.sw, s.tw, s.u, s.v].map(f32::to_bits)
    }

    const LENS: &[usize] = &[
        0,
        1,
        2,
        15,
        16,
        17,
        31,
        32,
        33,
        47,
        48,
        49,
        63,
        64,
        65,
        2047,
        2048,
        2049,
        4097,
        6160,
        10 * 2048 + 5,
    ];

    #[test]
    fn lse_and_pair_rows_match_reference() {
        for &n in LENS {
            for tau in [1.0f32, 1.0 / 0.7, 0.5] {
                let z = logits(n as u64 + 1, n);
                let w = logits(n as u64 + 1000, n);
                let want = ref_lse(&z, tau);
                let want_p = ref_pair(&z, &w, tau);
                for b in Backend::available() {
                    let mut out = [LseState::EMPTY];
                    run(
                        b,
                        LseRows {
                            z: &z,
                            vocab: n,
                            tau,
                            out: &mut out,
                        },
                    );
                    assert_eq!(bits_lse(&out[0]), bits_lse(&want), "{b:?} n={n} tau={tau}");
                    let mut out = [(EMPTY_PAIR, PairFlags::default())];
                    run(
                        b,
                        PairRows {
                            z: &z,
                            w: &w,
                            vocab: n,
                            tau,
                            out: &mut out,
                        },
                    );
                    assert_eq!(bits_pair(&out[0].0), bits_pair(&want_p), "{b:?} pair n={n}");
                    let (f, r) = (0..n).fold((false, false), |(f, r), i| {
                        let (mz, mw) = (z[i] == f32::NEG_INFINITY, w[i] == f32::NEG_INFINITY);
                        (f | (mw & !mz), r | (mz & !mw))
                    });
                    assert_eq!(
                        out[0].1,
                        PairFlags {
                            forward: f,
                            reverse: r
                        }
                    );
                }
            }
        }
    }

    #[test]
    fn grad_rows_match_reference() {
        for &n in LENS {
            let z = logits(n as u64 + 7, n);
            let w = logits(n as u64 + 77, n);
            let y = n / 3;
            for kl in [KlGrad::None, KlGrad::Forward, KlGrad::Reverse] {
                let c = GradCoef {
                    tau: 1.0 / 0.7,
                    nlse: -12.5,
                    h: 2.25,
                    g_lp: 0.75,
                    g_h: -0.3,
                    g_kl: if kl == KlGrad::None { 0.0 } else { 0.1 },
                    nlse_w: -13.0,
                    kl: 0.05,
                };
                let want: Vec<u32> = (0..n)
                    .map(|v| canon::grad_step(z[v], w[v], v == y, &c, kl).to_bits())
                    .collect();
                for b in Backend::available() {
                    let mut out = vec![f32::NAN; n];
                    run(
                        b,
                        GradRows::<f32, f32> {
                            z: &z,
                            w: &w,
                            y: Some(&[y]),
                            coef: &[c],
                            kl,
                            vocab: n,
                            out: &mut out,
                        },
                    );
                    let got: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
                    assert_eq!(got, want, "{b:?} n={n} {kl:?}");
                }
            }
        }
    }
}
