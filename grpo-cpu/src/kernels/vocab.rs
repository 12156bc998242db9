//! grpo-core's canonical vocabulary reductions (grpo_core::vocab::canon) over 16 lanes.
//!
//! The reference fixes *what* is computed: blocks of `BLOCK` = 2048 logits, per block a
//! reference maximum (`canon::block_reference`), then the element step in 16 strided lanes,
//! the fixed lane tree, the tail on lane 0, and a pairwise merge of block states. This file
//! fixes *how fast*: a block after a row's first is read once from memory, stepped against the
//! running maximum while the same pass takes its extrema (where the registers are few, f32 rows
//! take them in a second pass from L1 instead: `ROOMY_REGISTERS`), and a row's first block (or
//! one whose maximum jumped) is read twice, a maximum pass and then the step from L1
//! (`step_block`);
//! every step requests the cache lines 8 KiB ahead in software; the step is one vector per 16
//! elements with the lane accumulators in registers; merges and tails use the same lane
//! operations on lane 0, so hardware FMA replaces the reference's software `fmaf` with
//! identical bits.
//!
//! Everything here is `#[inline(always)]`: it is instantiated inside the per-ISA entry
//! functions of `arch/`.

use core::marker::PhantomData;

use grpo_core::vocab::JsdState;
use grpo_core::vocab::canon::{
    self, BLOCK, GradCoef, JsdParams, KlGrad, LOG_RATIO_FLOOR, LseState, PairState,
};
use grpo_core::vocab::exp_ln::D_MIN;

use super::math::{
    EXP_NORMAL_MIN, clamp_grad_arg, exp_nonpos_clamped, exp_nonpos_clamped_n, exp_nonpos_normal_n,
    ln, ln_normal_n,
};
use super::{Kernel, software_prefetch};
use crate::arch;
use crate::lanes::F32x16;

/// The register count ([`F32x16::REGISTERS`]) from which a backend keeps the working sets the
/// kernels were first tuned with on AVX-512: a one-row step that tracks the block's extrema as
/// it goes, four pairs of extrema accumulators in [`block_max_min`], four chunks per iteration
/// in the backward. Backends with fewer registers (AVX2 and NEON hold 8 values) step f32 rows
/// without tracking and take the extrema in a second pass over the block, which is in L1 by
/// then ([`BlockRows::SCAN_IN_STEP`]), with two pairs of accumulators, and step the backward
/// two chunks at a time ([`grad_row_chunks`]).
///
/// Why: on AVX2 the one-pass step's live values — ten exponential constants, the offset, the
/// sums `s` and `t` and the running maximum and minimum, two registers each — exceed the 16
/// ymm registers. Its loop issued about 70 instructions per 16 logits, 36 of them arithmetic
/// and loads, the rest spills, reloads and re-broadcast constants, and its time followed the
/// instruction count (about 4.8 per cycle). Measured on an AMD EPYC (Zen 3, family 25 model
/// 1, 2 vCPUs under KVM, no AVX-512), one row of 65536 logits in L2, one thread, medians of
/// 3000 calls, alternated with the code before:
/// - the step without the tracking issued 54 instructions per 16 logits and took 4.5 ns
///   instead of 5.9 ns per 16 logits;
/// - with the extrema pass after it, fused log-prob + entropy f32 23.5–23.7 → 21.0–21.2 µs
///   (four runs), the backward (whose statistics pass is this step) 59 → 56 µs;
/// - bf16 rows, whose loads widen, measured 23.5 µs tracking in the step and 24.3 µs with a
///   pass after it, so 16-bit rows keep the tracking;
/// - the pair step (KL) measured 50.4 → 52.0 µs with a pass of its own, and 54.5 µs with one
///   chunk pair per iteration instead of two, so it keeps both (`PairBlock`).
///
/// NEON, with the same 8 values of registers, follows the rule unmeasured.
const ROOMY_REGISTERS: usize = 16;

/// Chunks of 16 whose exponentials are computed together (see `exp_nonpos_clamped_n`).
/// Measured (fused f32, 64 × 8192 in cache, one thread, median of 9 alternated runs, Zen 4):
/// 2 → 0.160 ms, 4 → 0.157 ms, 8 → 0.167 ms.
const UNROLL: usize = 4;

/// [`UNROLL`] on lanes with fewer than [`ROOMY_REGISTERS`], for the loops over one row whose
/// eight AVX2 exponential chains would spill: the backward's gradient steps
/// (`grad_row_chunks`), the JSD's gradient pass (`jsd_grad_range`) and the one-row step that
/// does not track the extrema (`lse_unroll`: f32 rows). Two chunks are four exponential chains,
/// and their live values fit the 16 ymm registers with fewer spills.
///
/// For the one-row step, measured on a Zen 4 host (AMD EPYC, 2 vCPUs) forcing AVX2 + FMA,
/// 4 × 32768 in cache, one thread, one process alternating both forms over 40–60 rounds,
/// median of the per-round time ratios against four chunks: f32 fused 0.89–0.91, log-prob
/// alone 0.89, fused at T = 0.7 0.92; one chunk 1.07 against two. Streaming on two threads
/// (12 rounds, 2048 × 32768 / 512 × 151936): fused 0.92 / 0.94, log-prob 0.92 / 0.89. The
/// 16-bit rows, whose step tracks the extrema, measured 1.00 (fused) and 1.03 (bf16 log-prob)
/// in cache with two, so they keep four, as AVX-512 does (0.98 / 1.02 with two). A tracking
/// step with two chunks measured 1.12–1.15 against this one and its extrema pass. NEON, with
/// as few registers, follows the rule unmeasured; the Zen 3 host that tuned the AVX2 step
/// measured three chunks slower than four (README) but not two.
const FEW_REGISTERS_UNROLL: usize = 2;

/// Chunk pairs per iteration of the JSD's loops over both rows (`jsd_chunks`,
/// `jsd_ratio_chunks`, `jsd_saved_grad_range`): two exponentials and a logarithm per element,
/// a dependency chain of about 45 operations, so the more pairs in flight the better the FMA
/// ports are kept busy, until the registers spill. Measured against two pairs (4 × 32768 f32
/// pairs in cache, one thread, one process alternating both over 30 rounds, median of the
/// per-round time ratios, Zen 4): the JSD forward 0.954 on AVX-512 and 0.956 on AVX2, its
/// backward 0.936 / 0.888, the backward from saved states 1.009 / 0.877; eight pairs measured
/// 1.13 against four on AVX-512 (spills). Streaming on two threads (12 rounds, 2048 × 32768 /
/// 512 × 151936), AVX-512: forward 1.00 / 0.98, backward 0.84 / 0.83, from saved states
/// 1.00 / 0.97; AVX2: 0.99 / 0.97, 0.94 / 0.89, 1.00 / 0.91.
const JSD_PAIRS: usize = 4;

/// How far ahead of a step the next cache lines are requested: 8 KiB (one f32 block). Every
/// step prefetches, the one-pass steps (every block after a row's first, see `lse_block`)
/// included: on the Intel build machine (Xeon, model 207, 2 vCPUs) the hardware prefetchers
/// alone leave a one-pass step streaming at about 60 % of its in-cache rate, and the
/// software prefetch measured fused 22.2 / 25.4 → 16.0 / 17.1 ms and KL 34.9 / 39.8 →
/// 26.1 / 29.3 ms (2 threads, 2048 × 32768 / 512 × 151936, median of four and three
/// alternated runs); 4 and 16 KiB measured within the noise of 8 KiB there. The Zen 4 build
/// machine of earlier sessions streamed one pass of plain loads at full speed (30.0 GB/s
/// against a 27.5 GB/s read probe, one thread, a stand-alone loop), so there the one-pass
/// steps prefetched nothing; what the prefetch costs there (one load-port operation per
/// 64-byte line) is not measured.
///
/// Measured on the 2-core AVX-512 build machine (Zen 4), 2 threads, f32, best distance moves
/// as the step gets cheaper:
/// - with the earlier, slower step (stats kernel, 2048 × 32768, ratio to the read roofline, a
///   loaded machine): none 0.43–0.47, 4 KiB 0.54, 8 KiB 0.73, 16 KiB 0.79–0.93, 32–128 KiB
///   0.62–0.78;
/// - with the current step (median ms of 6–7 interleaved runs of two binaries, 2048 × 32768 /
///   512 × 151936): fused 13.6 / 15.5 at 16 KiB against 12.4 / 13.7 at 8 KiB, log-prob
///   14.6 / 16.1 against 11.1 / 13.4, backward 29.1 / 33.5 against 26.8 / 28.8; 4 KiB and
///   12 KiB were slower than 8 KiB, and adding an L2 prefetch (`T1`) 56 KiB ahead, or using
///   `T1` alone at 8–32 KiB, gained nothing measurable.
///
/// With the one-pass steps, none at all is faster still on that Zen 4 host, so AVX-512 on AMD
/// runs without software prefetches by default (`Backend::software_prefetch_default`; the
/// steps then skip [`prefetch_ahead`]'s requests, see `kernels::set_software_prefetch`): eight
/// runs of `grpo-bench vocab --dtype all` alternating `--prefetch on` and `off` (2 threads,
/// 2048 × 32768 and 512 × 151936), median per-pair time ratios off/on 0.74–0.89 for the
/// one-row passes and the out-of-place backward in every storage type, f32 KL 0.85 / 0.87,
/// JSD 0.94 / 0.91 and `backward_kl` 0.89 / 0.86, 0.92–0.99 in place. The exception is the
/// pair passes on 16-bit rows at 2048 × 32768 (KL 1.09–1.10, JSD and `backward_kl`
/// 1.02–1.03), which are faster without them at 512 × 151936 (0.90–0.97). Of those, the KL
/// prefetches by default (`backend::Pass::NarrowKl`): at most row lengths it gains a fifth.
const PREFETCH_BYTES: usize = 8192;

/// How far ahead the same steps request lines into L2 (`prefetcht1`) besides the L1 request
/// at [`PREFETCH_BYTES`]: 24 KiB. On the Intel build machine, 2 threads, f32, 2048 × 32768 /
/// 512 × 151936, the median of the per-pair ratios of alternated runs against the L1 request
/// alone was fused 0.92 / 0.96 (six runs; 0.97 / 0.93 in another seven), backward 0.99 /
/// 0.95 (four runs; 0.97 / 0.93 in five); at 48 KiB fused 0.90 / 0.99, backward 1.08 /
/// 0.99; the L2 request alone 16 KiB ahead, without the L1 one, 1.02 / 1.08 and 1.14 / 1.01.
/// (On the Zen 4 machine of earlier sessions an L2 request 56 KiB ahead measured no gain
/// with the two-pass step.)
const PREFETCH_L2_BYTES: usize = 24576;

/// A logit storage type the lanes can load 16 at a time.
pub trait Load: canon::Logit {
    /// Whether this is `half::bf16` (whose gradient stores then use `F32x16::store_bf16`).
    #[doc(hidden)]
    const IS_BF16: bool = false;
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
    const IS_BF16: bool = true;
    #[inline(always)]
    fn load<V: F32x16>(c: &[half::bf16; 16]) -> V {
        V::load_bf16(c)
    }
    #[inline(always)]
    fn store_grad<V: F32x16>(g: V, dst: &mut [half::bf16; 16]) {
        g.store_bf16(dst);
    }
}

impl Load for half::f16 {
    #[inline(always)]
    fn load<V: F32x16>(c: &[half::f16; 16]) -> V {
        V::load_f16(c)
    }
    #[inline(always)]
    fn store_grad<V: F32x16>(g: V, dst: &mut [half::f16; 16]) {
        g.store_f16(dst);
    }
}

/// `fma(a, b, c)` in lane 0 with the hardware (or portable) FMA of `V`.
#[inline(always)]
fn fma1<V: F32x16>(a: f32, b: f32, c: f32) -> f32 {
    V::splat(a).mul_add(V::splat(b), V::splat(c)).to_array()[0]
}

/// `canon::block_max`: the raw maximum of a block (order-free: max is exact, and the sign of
/// a zero is removed by the final `+ 0.0`).
///
/// Validation needs no separate test here: a NaN or +∞ logit always reaches the row state as a
/// non-finite maximum (+∞, or a NaN maximum) or a NaN sum (NaN and +∞ turn `exp` and every
/// later sum, product and merge into NaN), so the callers check `max` and `sum` for
/// finiteness — which also covers grpo-core's "all −∞" and "max/T overflows" errors.
///
/// Also returns the smallest value of the whole chunks (`+∞` if there are none; a NaN may or
/// may not be seen): the step pass decides from it, before it starts, whether the
/// exponent-add exponential applies (`normal_domain`). That costs one `min` per vector here,
/// where the loop waits on memory, instead of in the compute-bound step, and a block with a
/// masked (−∞) logit goes straight to the reference scaling instead of running twice.
#[inline(always)]
fn block_max_min<V: F32x16, S: Load>(chunks: &[[S; 16]], tail: &[S]) -> (f32, f32) {
    // Four independent maxima and minima hide the latency of `max`/`min`; where the registers
    // hold only eight values, eight accumulators would spill, and two pairs measured faster
    // (AVX2, see `ROOMY_REGISTERS`).
    if const { V::REGISTERS >= ROOMY_REGISTERS } {
        block_max_min_n::<V, S, 4>(chunks, tail)
    } else {
        block_max_min_n::<V, S, 2>(chunks, tail)
    }
}

/// [`block_max_min`] with `A` pairs of accumulators.
#[inline(always)]
fn block_max_min_n<V: F32x16, S: Load, const A: usize>(
    chunks: &[[S; 16]],
    tail: &[S],
) -> (f32, f32) {
    let mut m = [V::splat(f32::NEG_INFINITY); A];
    let mut lo = [V::splat(f32::INFINITY); A];
    let mut groups = chunks.chunks_exact(A);
    for q in &mut groups {
        for k in 0..A {
            let x = S::load::<V>(&q[k]);
            m[k] = m[k].max(x);
            lo[k] = lo[k].min(x);
        }
    }
    for c in groups.remainder() {
        let x = S::load::<V>(c);
        m[0] = m[0].max(x);
        lo[0] = lo[0].min(x);
    }
    let (mut top, mut low) = (m[0], lo[0]);
    for k in 1..A {
        top = top.max(m[k]);
        low = low.min(lo[k]);
    }
    // The minimum is only compared, never part of a result.
    (fold_tail_max(top.reduce_max(), tail), low.reduce_min())
}

/// The block maximum from the lanes' maximum `lanes` of the whole chunks and the `tail`
/// values, in index order; `+ 0.0` removes the sign of a zero maximum, the only order
/// dependence of a max.
#[inline(always)]
fn fold_tail_max<S: Load>(lanes: f32, tail: &[S]) -> f32 {
    tail.iter().fold(lanes, |r, &x| canon_max(r, x.to_f32())) + 0.0
}

/// Whether some lane is NaN.
#[inline(always)]
fn any_nan<V: F32x16>(v: V) -> bool {
    V::mask_any(V::mask_andnot(v.eq(v), V::splat(0.0).eq(V::splat(0.0))))
}

/// Whether every step argument `max_r(D_MIN, (z − c)·τ)` of a block whose smallest logit is
/// `low` lies in [`exp_nonpos_normal_n`]'s domain: `(low − c)·τ ≥ EXP_NORMAL_MIN`, rounded
/// exactly as the step rounds it (`·τ` skipped when `!SCALED`). Rounding is monotone and
/// τ > 0, so no other logit of the block gives a smaller argument. A NaN `low` (or `c`)
/// answers `false`; NaN logits that `low` did not see are caught after the step (see
/// `lse_steps`).
#[inline(always)]
fn normal_domain<const SCALED: bool>(low: f32, c: f32, tau: f32) -> bool {
    let d = low - c;
    (if SCALED { d * tau } else { d }) >= EXP_NORMAL_MIN
}

/// Requests the cache line [`PREFETCH_BYTES`] ahead of `p` into L1 and the one
/// [`PREFETCH_L2_BYTES`] ahead into L2 (one call per 64-byte line: every chunk of f32, every
/// other chunk of 16-bit storage, chosen by the chunk index `i`). The step pass issues these
/// while it computes, so memory keeps streaming the next blocks in the background of the
/// arithmetic.
#[inline(always)]
pub(crate) fn prefetch_ahead<V: F32x16, S>(c: &[S; 16], i: usize, on: bool) {
    if on && (i * size_of::<[S; 16]>()).is_multiple_of(64) {
        let p = c.as_ptr().cast::<u8>();
        V::prefetch(p.wrapping_add(PREFETCH_BYTES));
        V::prefetch_l2(p.wrapping_add(PREFETCH_L2_BYTES));
    }
}

/// What [`pair_max_support`] finds in a student/teacher block pair.
struct PairScan {
    /// Raw block maxima (as [`block_max_min`]).
    zmax: f32,
    wmax: f32,
    /// Smallest values of the whole chunks (as [`block_max_min`]).
    zlow: f32,
    wlow: f32,
    /// Some `w = −∞ < z`: KL(p‖q) = +∞.
    pq_infinite: bool,
    /// Some `z = −∞ < w`: KL(q‖p) = +∞.
    qp_infinite: bool,
}

/// Both raw block maxima and minima of a student/teacher block pair and its support flags.
/// One pass over both rows, so each is loaded once before the step pass.
#[inline(always)]
fn pair_max_support<V: F32x16, S: Load, U: Load>(
    (zc, zt): (&[[S; 16]], &[S]),
    (wc, wt): (&[[U; 16]], &[U]),
) -> PairScan {
    let ninf = V::splat(f32::NEG_INFINITY);
    let (mut mz, mut mw) = (ninf, ninf);
    let (mut lz, mut lw) = (V::splat(f32::INFINITY), V::splat(f32::INFINITY));
    let (mut fwd, mut rev) = (V::mask_none(), V::mask_none());
    for (a, b) in zc.iter().zip(wc) {
        let (x, y) = (S::load::<V>(a), U::load::<V>(b));
        mz = mz.max(x);
        mw = mw.max(y);
        lz = lz.min(x);
        lw = lw.min(y);
        let (iz, iw) = (x.eq(ninf), y.eq(ninf));
        fwd = V::mask_or(fwd, V::mask_andnot(iz, iw));
        rev = V::mask_or(rev, V::mask_andnot(iw, iz));
    }
    let (tf, tr) = tail_support(zt, wt);
    PairScan {
        zmax: fold_tail_max(mz.reduce_max(), zt),
        wmax: fold_tail_max(mw.reduce_max(), wt),
        zlow: lz.reduce_min(),
        wlow: lw.reduce_min(),
        pq_infinite: V::mask_any(fwd) || tf,
        qp_infinite: V::mask_any(rev) || tr,
    }
}

/// `max_r`: `if a > b { a } else { b }`.
#[inline(always)]
fn canon_max(a: f32, b: f32) -> f32 {
    if a > b { a } else { b }
}

/// The lane form of `canon::lse_step` on accumulators `(s, t)`.
#[inline(always)]
fn lse_step<V: F32x16>(z: V, tau: V, c: V, s: &mut V, t: &mut V) {
    let d = z.sub(c).mul(tau);
    let dc = V::splat(D_MIN).max(d);
    let e = exp_nonpos_clamped(dc);
    *s = s.add(e);
    *t = e.mul_add(dc, *t);
}

/// The rows of one block as [`step_block`] drives them: one row (`N = 1`, [`LseBlock`]) or a
/// student/teacher row pair (`N = 2`, [`PairBlock`]), stepped together against one offset
/// per row.
trait BlockRows<V: F32x16, const N: usize> {
    /// The lane accumulators of the step.
    type Acc: Copy;
    /// Whether a one-pass step takes the block's extrema as it goes ([`Scan`]) rather than in
    /// a pass of its own after the step ([`extrema`](BlockRows::extrema), the block in L1 by
    /// then). The same values either way (a NaN that either misses is caught by the sums);
    /// which is faster depends on the registers and the storage (see [`ROOMY_REGISTERS`]).
    const SCAN_IN_STEP: bool;
    /// The accumulators before the first step.
    fn zero() -> Self::Acc;
    /// The step over the block's whole chunks against offsets `c`, with the exponent-add
    /// exponential if `normal`; every loaded value of row `i` goes to `track[i]`. Returns
    /// `false` if the exponent-add met a NaN (the sums are then meaningless).
    fn steps<T: Track<V>>(
        &self,
        tau: f32,
        c: [f32; N],
        normal: bool,
        acc: &mut Self::Acc,
        track: &mut [T; N],
    ) -> bool;
    /// Each row's `(maximum, smallest chunk value)` (as [`block_max_min`]), read in a pass of
    /// its own before a two-pass step.
    fn extrema(&mut self) -> [(f32, f32); N];
    /// The same from the scans of a one-pass step over the whole chunks (the tails are
    /// still to be seen).
    fn scanned(&mut self, scans: &[Scan<V>; N]) -> [(f32, f32); N];
}

/// `canon::block_reference` and the whole-chunk steps of one block, read once where the
/// reference allows it: returns the lane accumulators, each row's reference (the block
/// state's maximum) and each row's running maximum after the block.
///
/// With every `prior > −∞` (every block but a row's first) the block is read once: the steps
/// run against the running maxima — the references `canon::block_reference` picks unless a
/// block maximum lies more than `OFFSET_SLACK/τ` above its running maximum — while the same
/// pass takes each row's maximum and minimum. Only if the rule then picks a block's own
/// maximum is the block (in L1 by now) stepped again. A row's first block takes its extrema
/// first and steps after, as every block did before the running-maximum reference (see
/// grpo-core's `canon` for why: two passes cost about a fifth of the streaming rate).
///
/// `fast` carries between blocks whether the exponent-add exponential applied to the
/// previous block: the one-pass step tries it only then (it learns the block's minimum only
/// afterwards), so a masked vocabulary, whose blocks each hold a −∞, steps each block once
/// with the reference scaling instead of twice. In a two-pass step the domain is known before
/// the step, and a NaN the minimum missed sends the step to the reference scaling. Which path
/// ran never changes a bit.
#[inline(always)]
fn step_block<V: F32x16, B: BlockRows<V, N>, const N: usize>(
    rows: &mut B,
    tau: f32,
    prior: [f32; N],
    fast: &mut bool,
) -> (B::Acc, [f32; N], [f32; N]) {
    let mut acc = B::zero();
    let (found, stepped) = if prior.iter().all(|&p| p > f32::NEG_INFINITY) {
        let c = prior.map(|p| p + 0.0);
        let (ok, found) = if B::SCAN_IN_STEP {
            let mut scans = [(); N].map(|()| Scan::<V>::new());
            let ok = rows.steps(tau, c, *fast, &mut acc, &mut scans);
            (ok, rows.scanned(&scans))
        } else {
            let ok = rows.steps(tau, c, *fast, &mut acc, &mut [(); N]);
            (ok, rows.extrema())
        };
        let kept = (0..N)
            .all(|i| canon::block_reference(prior[i], found[i].0, tau).to_bits() == c[i].to_bits());
        let domain = (0..N).all(|i| normal_domain_at(found[i].1, c[i], tau));
        let valid = ok && (!*fast || domain);
        if kept && valid {
            *fast = domain;
        }
        (found, kept && valid)
    } else {
        (rows.extrema(), false)
    };
    let refs: [f32; N] =
        core::array::from_fn(|i| canon::block_reference(prior[i], found[i].0, tau));
    if !stepped {
        let c = refs.map(canon::offset);
        *fast = (0..N).all(|i| normal_domain_at(found[i].1, c[i], tau));
        acc = B::zero();
        if !rows.steps(tau, c, *fast, &mut acc, &mut [(); N]) {
            acc = B::zero();
            rows.steps(tau, c, false, &mut acc, &mut [(); N]);
            *fast = false;
        }
    }
    let running = core::array::from_fn(|i| canon_max(prior[i], found[i].0));
    (acc, refs, running)
}

/// What a step does with the values it loads: a one-pass step takes their extrema
/// ([`Scan`]); a two-pass step, which knew them before it started, nothing (`()`).
trait Track<V>: Sized {
    /// Whether [`add`](Track::add) does anything (the step then keeps two more values live).
    const TRACKS: bool;
    fn add(&mut self, x: V);
}

impl<V> Track<V> for () {
    const TRACKS: bool = false;
    #[inline(always)]
    fn add(&mut self, _: V) {}
}

/// The running maximum and minimum a one-pass step takes of the values it loads.
struct Scan<V> {
    max: V,
    min: V,
}

impl<V: F32x16> Track<V> for Scan<V> {
    const TRACKS: bool = true;
    #[inline(always)]
    fn add(&mut self, x: V) {
        self.max = self.max.max(x);
        self.min = self.min.min(x);
    }
}

impl<V: F32x16> Scan<V> {
    #[inline(always)]
    fn new() -> Self {
        Scan {
            max: V::splat(f32::NEG_INFINITY),
            min: V::splat(f32::INFINITY),
        }
    }

    /// The block maximum with the `tail` values ([`fold_tail_max`]) and the chunks' minimum.
    #[inline(always)]
    fn finish<S: Load>(&self, tail: &[S]) -> (f32, f32) {
        (
            fold_tail_max(self.max.reduce_max(), tail),
            self.min.reduce_min(),
        )
    }
}

/// One row's block for [`step_block`]; `DOT` as in [`lse_row`].
struct LseBlock<'a, S, const DOT: bool> {
    chunks: &'a [[S; 16]],
    tail: &'a [S],
}

impl<V: F32x16, S: Load, const DOT: bool> BlockRows<V, 1> for LseBlock<'_, S, DOT> {
    /// `[s, t]`.
    type Acc = [V; 2];
    const SCAN_IN_STEP: bool = V::REGISTERS >= ROOMY_REGISTERS || size_of::<S>() < 4;
    #[inline(always)]
    fn zero() -> [V; 2] {
        [V::splat(0.0); 2]
    }
    #[inline(always)]
    fn steps<T: Track<V>>(
        &self,
        tau: f32,
        c: [f32; 1],
        normal: bool,
        acc: &mut [V; 2],
        track: &mut [T; 1],
    ) -> bool {
        let [s, t] = acc;
        lse_chunks::<V, S, T, DOT>(self.chunks, tau, c[0], normal, s, t, &mut track[0])
    }
    #[inline(always)]
    fn extrema(&mut self) -> [(f32, f32); 1] {
        [block_max_min::<V, S>(self.chunks, self.tail)]
    }
    #[inline(always)]
    fn scanned(&mut self, scans: &[Scan<V>; 1]) -> [(f32, f32); 1] {
        [scans[0].finish(self.tail)]
    }
}

/// `canon::lse_block` in lanes: the block's state after earlier blocks whose running maximum
/// is `prior`, and the running maximum after it. The whole chunks go through [`step_block`]
/// (one pass or two, `fast` carried between blocks), then the fixed lane tree and the tail on
/// lane 0.
#[inline(always)]
fn lse_block<V: F32x16, S: Load, const DOT: bool>(
    z: &[S],
    tau: f32,
    prior: f32,
    fast: &mut bool,
) -> (LseState, f32) {
    let (chunks, tail) = z.as_chunks::<16>();
    let ([s, t], [r], [running]) =
        step_block::<V, _, 1>(&mut LseBlock::<S, DOT> { chunks, tail }, tau, [prior], fast);
    let (vt, vc) = (V::splat(tau), V::splat(canon::offset(r)));
    let (mut sa, mut ta) = (s.to_array(), t.to_array());
    canon::tree(&mut sa);
    canon::tree(&mut ta);
    // The tail goes through lane 0 in index order; the other lanes are don't-care.
    let (mut s, mut t) = (V::splat(sa[0]), V::splat(ta[0]));
    for &x in tail {
        lse_step::<V>(V::splat(x.to_f32()), vt, vc, &mut s, &mut t);
    }
    let st = LseState {
        max: r,
        sum: s.to_array()[0],
        dot: t.to_array()[0],
    };
    (st, running)
}

/// [`normal_domain`] for any τ (the `·τ` skipped at τ = 1, as the steps skip it).
#[inline(always)]
fn normal_domain_at(low: f32, c: f32, tau: f32) -> bool {
    if tau == 1.0 {
        normal_domain::<false>(low, c, tau)
    } else {
        normal_domain::<true>(low, c, tau)
    }
}

/// The step over all whole chunks of a block against offset `c` (`lse_steps` over groups of
/// `lse_unroll` chunks, then the rest one at a time with the reference scaling), the exponent-add
/// exponential if `normal`, the loaded values to `track`. Returns `false` if the exponent-add
/// met a NaN (the sums are then meaningless).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn lse_chunks<V: F32x16, S: Load, T: Track<V>, const DOT: bool>(
    chunks: &[[S; 16]],
    tau: f32,
    c: f32,
    normal: bool,
    s: &mut V,
    t: &mut V,
    track: &mut T,
) -> bool {
    let (vt, vc) = (V::splat(tau), V::splat(c));
    // A `const` block: each instantiation compiles one of the two.
    let (ok, whole) = if const { lse_unroll::<V, T>() == UNROLL } {
        lse_chunk_steps::<V, S, T, DOT, UNROLL>(chunks, tau, normal, vt, vc, s, t, track)
    } else {
        lse_chunk_steps::<V, S, T, DOT, FEW_REGISTERS_UNROLL>(
            chunks, tau, normal, vt, vc, s, t, track,
        )
    };
    for c in &chunks[whole..] {
        let x = S::load(c);
        track.add(x);
        lse_step::<V>(x, vt, vc, s, t);
    }
    ok
}

/// How many chunks [`lse_steps`] takes per iteration: [`UNROLL`], except for a step that
/// does not track the extrema on lanes with few registers ([`ROOMY_REGISTERS`]), which takes
/// [`FEW_REGISTERS_UNROLL`].
const fn lse_unroll<V: F32x16, T: Track<V>>() -> usize {
    if V::REGISTERS < ROOMY_REGISTERS && !T::TRACKS {
        FEW_REGISTERS_UNROLL
    } else {
        UNROLL
    }
}

/// [`lse_steps`] over the whole groups of `G` chunks of `chunks`, in the form `τ` and
/// `normal` select: whether no NaN met the exponent-add, and how many chunks were stepped.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn lse_chunk_steps<V: F32x16, S: Load, T: Track<V>, const DOT: bool, const G: usize>(
    chunks: &[[S; 16]],
    tau: f32,
    normal: bool,
    vt: V,
    vc: V,
    s: &mut V,
    t: &mut V,
    track: &mut T,
) -> (bool, usize) {
    let whole = &chunks[..chunks.len() / G * G];
    // `(z − c)·1 = z − c` exactly, so at T = 1 (the common case) the multiply is skipped: one
    // of the step's ~18 vector operations, in a compute-bound loop. Lanes without
    // `SPECIALIZED_LOOPS` compile only the general step (a `const` block: see there).
    let ok = if const { !V::SPECIALIZED_LOOPS } {
        lse_steps::<V, S, T, true, false, DOT, G>(whole, vt, vc, s, t, track)
    } else {
        match (tau == 1.0, normal) {
            (true, true) => lse_steps::<V, S, T, false, true, DOT, G>(whole, vt, vc, s, t, track),
            (true, false) => lse_steps::<V, S, T, false, false, DOT, G>(whole, vt, vc, s, t, track),
            (false, true) => lse_steps::<V, S, T, true, true, DOT, G>(whole, vt, vc, s, t, track),
            (false, false) => lse_steps::<V, S, T, true, false, DOT, G>(whole, vt, vc, s, t, track),
        }
    };
    (ok, whole.len())
}

/// The step over whole groups of `G` chunks (`lse_unroll`): their exponentials interleaved
/// (independent), their accumulation in index order (chunk i before chunk i + 1, as the lanes
/// require). `SCALED = false` skips the `·τ` (exact for τ = 1). The cache lines
/// [`PREFETCH_BYTES`] ahead are requested as the loop goes.
///
/// `NORMAL = true` uses [`exp_nonpos_normal_n`], valid where every argument lies in its
/// domain: a two-pass step's caller has checked that from the block's smallest logit
/// (`normal_domain`) before, a one-pass step's caller checks it after from the tracked
/// minimum. A NaN argument — which the minimum may miss — makes `t` NaN (`e·NaN`): the
/// function returns `false` then (the sums are meaningless and the caller reruns with
/// `NORMAL = false`), and `true` otherwise and for `NORMAL = false`. Without `DOT` (no `t`,
/// see [`lse_row`]) a separate `+` accumulates the arguments for that check, as in
/// `pair_steps`: NaN is sticky under addition, the ≤ 2048 arguments in [−86, 8] of a block
/// cannot overflow, and the add leaves the FMA ports to the exponentials. Where the lanes'
/// scaling keeps a NaN (`F32x16::POW2_NORMAL_KEEPS_NAN`: AVX-512's `vscalefps`), the check
/// reads `s` instead and the separate sum goes: a NaN or infinite argument makes the
/// reduction's `r`, so its exponential, so `s` NaN (an infinite one then reruns the block
/// with `NORMAL = false` where the separate sum did not, which changes nothing: its domain
/// check fails too, or its block is not kept), and `s`, at most 2048·2^12, is otherwise
/// finite. One vector operation fewer per chunk in a loop bound by them: log-prob alone
/// (4 × 32768 in cache, one thread, one process alternating both forms over 60 rounds,
/// median of the per-round time ratios; Zen 4) f32 0.925–0.935, bf16 0.955, f16 0.937,
/// f32 at T = 0.7 0.941; streaming on two threads (12 rounds) f32 0.948 / 0.993, bf16
/// 0.971 / 0.944 at 2048 × 32768 / 512 × 151936. Inside the domain
/// (`EXP_NORMAL_MIN` = −86 > `D_MIN` = −88) the clamp `max_r(D_MIN, d)` is the identity, so
/// the `NORMAL` step skips it; its results are used only once the domain holds. Skipping it
/// measured no faster when every block was read twice, but the one-pass step is bound by its
/// arithmetic: fused f32 0.125 → 0.120 ms with 16 × 32768 in cache on one thread, 7.71 /
/// 8.43 → 7.49 / 8.15 ms streaming 2048 × 32768 / 512 × 151936 on two (median of seven and
/// five alternated runs).
///
/// `pair_steps` uses the same scheme (alone it measured no faster with all six pair sums, but
/// with only the sums the caller needs it does; see there).
#[inline(always)]
fn lse_steps<
    V: F32x16,
    S: Load,
    T: Track<V>,
    const SCALED: bool,
    const NORMAL: bool,
    const DOT: bool,
    const G: usize,
>(
    chunks: &[[S; 16]],
    vt: V,
    vc: V,
    s: &mut V,
    t: &mut V,
    track: &mut T,
) -> bool {
    let dmin = V::splat(D_MIN);
    let mut nan = V::splat(0.0);
    let prefetch = software_prefetch();
    for (j, q) in chunks.chunks_exact(G).enumerate() {
        for k in 0..G {
            prefetch_ahead::<V, S>(&q[k], j * G + k, prefetch);
        }
        let mut dc = [dmin; G];
        for k in 0..G {
            let x = S::load::<V>(&q[k]);
            track.add(x);
            let d = x.sub(vc);
            let d = if SCALED { d.mul(vt) } else { d };
            dc[k] = if NORMAL { d } else { dmin.max(d) };
        }
        let e = if NORMAL {
            exp_nonpos_normal_n(dc)
        } else {
            exp_nonpos_clamped_n(dc)
        };
        for k in 0..G {
            *s = s.add(e[k]);
            if DOT {
                *t = e[k].mul_add(dc[k], *t);
            } else if NORMAL && !V::POW2_NORMAL_KEEPS_NAN {
                nan = nan.add(dc[k]);
            }
        }
    }
    let check = if DOT {
        *t
    } else if V::POW2_NORMAL_KEEPS_NAN {
        *s
    } else {
        nan
    };
    !NORMAL || !any_nan(check)
}

/// `(δc, e^δc)` of `canon`'s `rescale` for two maxima at once (lanes 0 and 1).
#[inline(always)]
fn rescale2<V: F32x16>(ma: f32, mb: f32, top: f32, tau: f32) -> ([f32; 16], [f32; 16]) {
    let mut m = [0.0; 16];
    m[0] = ma;
    m[1] = mb;
    let d = V::from_array(m).sub(V::splat(top)).mul(V::splat(tau));
    let dc = V::splat(D_MIN).max(d);
    (dc.to_array(), exp_nonpos_clamped(dc).to_array())
}

/// `LseState::merge` with lane arithmetic.
#[inline(always)]
pub(crate) fn merge_lse<V: F32x16>(a: LseState, b: LseState, tau: f32) -> LseState {
    let top = canon_max(a.max, b.max);
    if top == f32::NEG_INFINITY {
        return LseState {
            max: top,
            sum: a.sum + b.sum,
            dot: a.dot + b.dot,
        };
    }
    let (d, e) = rescale2::<V>(a.max, b.max, top, tau);
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
pub(crate) fn merge_pair<V: F32x16>(a: PairState, b: PairState, tau: f32) -> PairState {
    let z = merge_lse::<V>(a.student(), b.student(), tau);
    let w = merge_lse::<V>(a.teacher(), b.teacher(), tau);
    // Lanes: 0 = a's student, 1 = b's student, 2 = a's teacher, 3 = b's teacher.
    let mut parts = [0.0; 16];
    let mut tops = [0.0; 16];
    parts[..4].copy_from_slice(&[a.zmax, b.zmax, a.wmax, b.wmax]);
    tops[..4].copy_from_slice(&[z.max, z.max, w.max, w.max]);
    let (vp, vt) = (V::from_array(parts), V::from_array(tops));
    let diff = vp.sub(vt).mul(V::splat(tau));
    let shift = V::splat(LOG_RATIO_FLOOR).max(diff).to_array();
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

/// What [`fold_blocks`] folds: a per-block reduction and the merge of adjacent states. A trait
/// with `#[inline(always)]` methods rather than closures, so the block kernels are compiled
/// inside the ISA entry function (a closure that LLVM declines to inline would be compiled
/// without the ISA, turning every lane operation into a call).
trait Blocks {
    type St: Copy;
    fn block(&mut self, start: usize, end: usize) -> Self::St;
    fn merge(&mut self, a: Self::St, b: Self::St) -> Self::St;
}

/// `canon::fold_blocks`: reduces `len` elements block by block in the canonical pairwise order
/// (recursive split at the largest power of two below the block count, evaluated with a
/// binary-counter stack). `None` for `len = 0`.
#[inline(always)]
fn fold_blocks<B: Blocks>(len: usize, b: &mut B) -> Option<B::St> {
    const LEVELS: usize = usize::BITS as usize;
    let mut stack: [Option<B::St>; LEVELS] = [None; LEVELS];
    let mut j = 0usize;
    let mut start = 0usize;
    while start < len {
        let end = if len - start > BLOCK {
            start + BLOCK
        } else {
            len
        };
        let mut cur = b.block(start, end);
        let mut level = 0;
        while level < LEVELS && (j >> level) & 1 == 1 {
            if let Some(left) = stack[level].take() {
                cur = b.merge(left, cur);
            }
            level += 1;
        }
        if level < LEVELS {
            stack[level] = Some(cur);
        }
        j += 1;
        start = end;
    }
    let mut acc: Option<B::St> = None;
    for slot in stack.iter_mut() {
        if let Some(left) = slot.take() {
            acc = Some(match acc {
                None => left,
                Some(right) => b.merge(left, right),
            });
        }
    }
    acc
}

struct LseBlocks<'a, V, S, const DOT: bool> {
    z: &'a [S],
    tau: f32,
    /// Running maximum of the blocks so far (`canon::block_reference`).
    prior: f32,
    /// Whether the exponent-add exponential applied to the previous block (`lse_block`).
    fast: bool,
    lanes: PhantomData<V>,
}

impl<V: F32x16, S: Load, const DOT: bool> Blocks for LseBlocks<'_, V, S, DOT> {
    type St = LseState;
    #[inline(always)]
    fn block(&mut self, start: usize, end: usize) -> LseState {
        let st;
        (st, self.prior) =
            lse_block::<V, S, DOT>(&self.z[start..end], self.tau, self.prior, &mut self.fast);
        st
    }
    #[inline(always)]
    fn merge(&mut self, a: LseState, b: LseState) -> LseState {
        merge_lse::<V>(a, b, self.tau)
    }
}

struct PairBlocks<'a, V, S, U, const SUMS: u8> {
    z: &'a [S],
    w: &'a [U],
    tau: f32,
    /// Running maxima of the student's and the teacher's blocks so far.
    prior: [f32; 2],
    /// As in [`LseBlocks`].
    fast: bool,
    flags: PairFlags,
    lanes: PhantomData<V>,
}

impl<V: F32x16, S: Load, U: Load, const SUMS: u8> Blocks for PairBlocks<'_, V, S, U, SUMS> {
    type St = PairState;
    #[inline(always)]
    fn block(&mut self, start: usize, end: usize) -> PairState {
        let (z, w) = (&self.z[start..end], &self.w[start..end]);
        let st;
        (st, self.prior) = pair_block::<V, S, U, SUMS>(
            z,
            w,
            self.tau,
            self.prior,
            &mut self.fast,
            &mut self.flags,
        );
        st
    }
    #[inline(always)]
    fn merge(&mut self, a: PairState, b: PairState) -> PairState {
        merge_pair::<V>(a, b, self.tau)
    }
}

/// The JSD's per-element quantities of `N` chunk pairs at once (those of grpo-core's
/// `jsd_step` per lane; interleaved chains, `M = 2N` exponentials): `(l, e, lm)` with
/// `l = [lp₀, lq₀, lp₁, lq₁, …]`, `e` their exponentials (`[p₀, q₀, …]`) and `lm` each pair's
/// log mixture.
///
/// `NORMAL = true` is for chunks whose log-probabilities all lie in [`EXP_NORMAL_MIN`], 0]
/// (checked by the caller, [`jsd_normal_domain`]): there the reference's clamps and special
/// cases are identities and are left out — `clamp_grad_arg` of each log-probability, the
/// general scaling of the exponentials ([`exp_nonpos_normal_n`] instead), `ln`'s subnormal and
/// special-value handling ([`ln_normal_n`]: both probabilities are at least e^−86 ≈ 4.5·10^−38,
/// so their mixture `fma(β, q, (1 − β)·p)` with β ∈ (0, 1) is at least half that, a normal
/// float ≤ 1) and the floor `LN_FLOOR` = −104 (`ln` of that mixture is above −88). About 16 of
/// the ~65 vector operations of a chunk pair (two exponentials, one logarithm).
#[inline(always)]
#[allow(clippy::type_complexity)]
fn jsd_parts<V: F32x16, const N: usize, const M: usize, const NORMAL: bool>(
    z: [V; N],
    w: [V; N],
    p: &JsdParams,
) -> ([V; M], [V; M], [V; N]) {
    let (tau, beta, omb) = (V::splat(p.tau), V::splat(p.beta), V::splat(p.omb));
    let dmin = V::splat(D_MIN);
    let (zm, zl) = (V::splat(p.lz.max), V::splat(p.lz.neg_ln_sum));
    let (wm, wl) = (V::splat(p.lw.max), V::splat(p.lw.neg_ln_sum));
    // `[lp₀, lq₀, lp₁, lq₁, …]`, the layout of the interleaved exponentials.
    const { assert!(M == 2 * N) };
    let mut l = [dmin; M];
    for k in 0..N {
        l[2 * k] = z[k].sub(zm).mul_add(tau, zl);
        l[2 * k + 1] = w[k].sub(wm).mul_add(tau, wl);
    }
    if !NORMAL {
        for x in &mut l {
            *x = clamp_grad_arg(*x);
        }
    }
    let e = if NORMAL {
        exp_nonpos_normal_n(l)
    } else {
        exp_nonpos_clamped_n(l)
    };
    let floor = V::splat(canon::LN_FLOOR);
    let mut mix = [floor; N];
    for k in 0..N {
        mix[k] = beta.mul_add(e[2 * k + 1], omb.mul(e[2 * k]));
    }
    let lm = if NORMAL {
        ln_normal_n(mix)
    } else {
        for m in &mut mix {
            *m = floor.max(ln(*m));
        }
        mix
    };
    (l, e, lm)
}

/// The JSD terms of `N` chunk pairs (grpo-core's `jsd_step` per lane) from their
/// [`jsd_parts`].
#[inline(always)]
fn jsd_terms_of<V: F32x16, const N: usize, const M: usize>(
    l: &[V; M],
    e: &[V; M],
    lm: &[V; N],
    p: &JsdParams,
) -> [V; N] {
    let (beta, omb) = (V::splat(p.beta), V::splat(p.omb));
    let mut out = [lm[0]; N];
    for k in 0..N {
        let (pe, qe, lp, lq) = (e[2 * k], e[2 * k + 1], l[2 * k], l[2 * k + 1]);
        out[k] = beta
            .mul(qe)
            .mul_add(lq.sub(lm[k]), omb.mul(pe).mul(lp.sub(lm[k])));
    }
    out
}

/// The student terms `p·(lp − lm)` of `N` chunk pairs (grpo-core's `jsd_student_step`, whose
/// sum is `K = KL(p‖m)`) from their [`jsd_parts`].
#[inline(always)]
fn jsd_student_terms_of<V: F32x16, const N: usize, const M: usize>(
    l: &[V; M],
    e: &[V; M],
    lm: &[V; N],
) -> [V; N] {
    let mut out = [lm[0]; N];
    for k in 0..N {
        out[k] = e[2 * k].mul(l[2 * k].sub(lm[k]));
    }
    out
}

/// Whether [`jsd_parts`]' `NORMAL` form applies to a block whose whole chunks' smallest
/// logits are `zlow` and `wlow`: each smallest log-probability `(low − max)·τ − ln s`,
/// rounded as the step rounds it, is at least [`EXP_NORMAL_MIN`]. The rounding is monotone
/// and τ > 0, so no other logit gives a smaller one; a −∞ logit (masked vocabulary) answers
/// `false`. (The rows are validated: no NaN.)
#[inline(always)]
fn jsd_normal_domain<V: F32x16>(zlow: f32, wlow: f32, p: &JsdParams) -> bool {
    // No closure: one that LLVM declines to inline is compiled without the ISA.
    let lp = fma1::<V>(zlow - p.lz.max, p.tau, p.lz.neg_ln_sum);
    let lq = fma1::<V>(wlow - p.lw.max, p.tau, p.lw.neg_ln_sum);
    lp >= EXP_NORMAL_MIN && lq >= EXP_NORMAL_MIN
}

/// Whether the `NORMAL` form applies to these whole chunks (never for lanes without
/// `SPECIALIZED_LOOPS`, which compile the general form only): a scan of their minima, which
/// also brings them into L1 for the step.
#[inline(always)]
fn jsd_chunks_normal<V: F32x16, S: Load, U: Load>(
    zc: &[[S; 16]],
    wc: &[[U; 16]],
    p: &JsdParams,
) -> bool {
    if const { !V::SPECIALIZED_LOOPS } {
        return false;
    }
    let (zlow, wlow) = (
        block_max_min::<V, S>(zc, &[]).1,
        block_max_min::<V, U>(wc, &[]).1,
    );
    jsd_normal_domain::<V>(zlow, wlow, p)
}

/// The JSD terms of whole chunk pairs summed into the first accumulator (16 lanes, index
/// order), and the student terms ([`jsd_student_terms_of`]) into the second, [`JSD_PAIRS`]
/// chunk pairs per iteration, in [`jsd_parts`]' `NORMAL` form or the reference's.
#[inline(always)]
fn jsd_chunks<V: F32x16, S: Load, U: Load, const NORMAL: bool>(
    zc: &[[S; 16]],
    wc: &[[U; 16]],
    p: &JsdParams,
) -> [V; 2] {
    const G: usize = JSD_PAIRS;
    let mut acc = [V::splat(0.0); 2];
    let mut zp = zc.chunks_exact(G);
    let mut wp = wc.chunks_exact(G);
    let prefetch = software_prefetch();
    for (j, (a, b)) in (&mut zp).zip(&mut wp).enumerate() {
        let (z, w) = (
            load_chunks::<V, S, G>(a, G * j, prefetch),
            load_chunks::<V, U, G>(b, G * j, prefetch),
        );
        let (l, e, lm) = jsd_parts::<V, G, { 2 * G }, NORMAL>(z, w, p);
        for t in jsd_terms_of(&l, &e, &lm, p) {
            acc[0] = acc[0].add(t);
        }
        for t in jsd_student_terms_of(&l, &e, &lm) {
            acc[1] = acc[1].add(t);
        }
    }
    for (a, b) in zp.remainder().iter().zip(wp.remainder()) {
        let (l, e, lm) = jsd_parts::<V, 1, 2, NORMAL>([S::load(a)], [U::load(b)], p);
        acc[0] = acc[0].add(jsd_terms_of(&l, &e, &lm, p)[0]);
        acc[1] = acc[1].add(jsd_student_terms_of(&l, &e, &lm)[0]);
    }
    acc
}

/// The canonical sums of a row pair's JSD terms and of its student terms (`K = KL(p‖m)`,
/// grpo-core's `jsd_rows_saved`) by blocks.
struct JsdBlocks<'a, V, S, U> {
    z: &'a [S],
    w: &'a [U],
    p: JsdParams,
    lanes: PhantomData<V>,
}

impl<V: F32x16, S: Load, U: Load> Blocks for JsdBlocks<'_, V, S, U> {
    type St = [f32; 2];
    /// 16 lanes, tree, tail on lane 0 (grpo-core's `canonical_sum`), per sum. The whole
    /// chunks take [`jsd_parts`]' `NORMAL` form where [`jsd_chunks_normal`] allows it.
    #[inline(always)]
    fn block(&mut self, start: usize, end: usize) -> [f32; 2] {
        let (zc, zt) = self.z[start..end].as_chunks::<16>();
        let (wc, wt) = self.w[start..end].as_chunks::<16>();
        let acc = if jsd_chunks_normal::<V, S, U>(zc, wc, &self.p) {
            jsd_chunks::<V, S, U, true>(zc, wc, &self.p)
        } else {
            jsd_chunks::<V, S, U, false>(zc, wc, &self.p)
        };
        let mut s = acc.map(|a| {
            let mut lanes = a.to_array();
            canon::tree(&mut lanes);
            lanes[0]
        });
        for (a, b) in zt.iter().zip(wt) {
            let (a, b) = (V::splat(a.to_f32()), V::splat(b.to_f32()));
            let (l, e, lm) = jsd_parts::<V, 1, 2, false>([a], [b], &self.p);
            s[0] += jsd_terms_of(&l, &e, &lm, &self.p)[0].to_array()[0];
            s[1] += jsd_student_terms_of(&l, &e, &lm)[0].to_array()[0];
        }
        s
    }
    #[inline(always)]
    fn merge(&mut self, a: [f32; 2], b: [f32; 2]) -> [f32; 2] {
        [a[0] + b[0], a[1] + b[1]]
    }
}

/// The merged [`LseState`] of a whole row (`EMPTY` for an empty row). `DOT = false` leaves
/// the whole chunks' `t = Σ e·δ` out of the step (one FMA per 16 logits of the ~11 the FMA
/// ports carry): the returned `dot` is then unspecified (finite garbage, as the sums a
/// [`PairNeed`] leaves out), while `max` and `sum` keep the reference's bits — neither ever
/// reads `t`, in the steps or in the merges.
#[inline(always)]
pub(crate) fn lse_row<V: F32x16, S: Load, const DOT: bool>(z: &[S], tau: f32) -> LseState {
    let mut b = LseBlocks::<V, S, DOT> {
        z,
        tau,
        prior: f32::NEG_INFINITY,
        fast: true,
        lanes: PhantomData,
    };
    fold_blocks(z.len(), &mut b).unwrap_or(LseState::EMPTY)
}

/// What a pair pass has to produce for its caller. Both maxima and both sums of exponentials
/// (`sz`, `sw`) are always computed; of the other sums of [`PairState`] only those the caller
/// reads (each is one FMA per element pair in a compute-bound loop):
///
/// | need          | reader                                  | sums              |
/// |---------------|-----------------------------------------|-------------------|
/// | `Jsd`         | the JSD's log-softmax of both rows (and `jsd_rows_saved`'s states) | — |
/// | `KlStudentTeacher` | `finish_kl(..).0`                       | `u`               |
/// | `KlTeacherStudent` | `finish_kl(..).1`                       | `v`               |
/// | `GradStudentTeacher` | `GradCoef::from_pair` with `KlGrad::StudentTeacher` (entropy, KL(p‖q)) | `tz`, `u` |
/// | `GradTeacherStudent` | `GradCoef::from_pair` with `KlGrad::TeacherStudent` (entropy; `kl` unread) | `tz` |
/// | `Saved`       | `kl_rows_saved`: the whole state, `canon::pair_row`'s bits | `tz`, `tw`, `u`, `v` |
///
/// The sums left out are unspecified in the returned state (finite garbage: they start at 0
/// and go through the merges). The teacher's `tw` (its entropy) is read only from a saved
/// state. Every computed sum has the reference's bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PairNeed {
    Jsd,
    KlStudentTeacher,
    KlTeacherStudent,
    GradStudentTeacher,
    GradTeacherStudent,
    Saved,
}

/// `SUMS` bit of a pair pass: the student's `tz = Σ e_z·δz`.
const SUM_TZ: u8 = 1;
/// `SUMS` bit: `u = Σ e_z·(δz − δw)` (KL(p‖q)).
const SUM_U: u8 = 2;
/// `SUMS` bit: `v = Σ e_w·(δw − δz)` (KL(q‖p)).
const SUM_V: u8 = 4;
/// `SUMS` bit: the teacher's `tw = Σ e_w·δw`.
const SUM_TW: u8 = 8;

impl PairNeed {
    /// Every need (for tests).
    #[cfg(test)]
    pub(crate) const ALL: [PairNeed; 6] = [
        PairNeed::Jsd,
        PairNeed::KlStudentTeacher,
        PairNeed::KlTeacherStudent,
        PairNeed::GradStudentTeacher,
        PairNeed::GradTeacherStudent,
        PairNeed::Saved,
    ];

    /// The `SUMS` bits of this need.
    pub(crate) const fn sums(self) -> u8 {
        match self {
            PairNeed::Jsd => 0,
            PairNeed::KlStudentTeacher => SUM_U,
            PairNeed::KlTeacherStudent => SUM_V,
            PairNeed::GradStudentTeacher => SUM_TZ | SUM_U,
            PairNeed::GradTeacherStudent => SUM_TZ,
            PairNeed::Saved => SUM_TZ | SUM_TW | SUM_U | SUM_V,
        }
    }

    /// Whether `tz`, `tw`, `u`, `v` are computed.
    #[cfg(test)]
    pub(crate) const fn computes(self) -> [bool; 4] {
        let s = self.sums();
        [
            s & SUM_TZ != 0,
            s & SUM_TW != 0,
            s & SUM_U != 0,
            s & SUM_V != 0,
        ]
    }
}

/// The lane form of `canon::pair_step` for the sums `SUMS` asks for; `acc` is
/// `[sz, tz, sw, tw, u, v]` (`tw` and the sums not asked for stay as they are).
#[inline(always)]
fn pair_step<V: F32x16, const SUMS: u8>(z: V, w: V, tau: V, cz: V, cw: V, acc: &mut [V; 6]) {
    let dmin = V::splat(D_MIN);
    let neg_max = V::splat(LOG_RATIO_FLOOR);
    let (dz, dw) = (z.sub(cz).mul(tau), w.sub(cw).mul(tau));
    let (dzc, dwc) = (dmin.max(dz), dmin.max(dw));
    let ez = exp_nonpos_clamped(dzc);
    let ew = exp_nonpos_clamped(dwc);
    let g = neg_max.max(dz).sub(neg_max.max(dw));
    pair_accumulate::<V, SUMS>(ez, ew, [dzc, dwc], g, acc);
}

/// The sums of one element pair (in the reference's order): `ez`, `ew` its exponentials,
/// `dc` the clamped differences `[δz, δw]`, `g` the floored log-ratio difference.
#[inline(always)]
fn pair_accumulate<V: F32x16, const SUMS: u8>(ez: V, ew: V, dc: [V; 2], g: V, acc: &mut [V; 6]) {
    acc[0] = acc[0].add(ez);
    if SUMS & SUM_TZ != 0 {
        acc[1] = ez.mul_add(dc[0], acc[1]);
    }
    acc[2] = acc[2].add(ew);
    if SUMS & SUM_TW != 0 {
        acc[3] = ew.mul_add(dc[1], acc[3]);
    }
    if SUMS & SUM_U != 0 {
        acc[4] = ez.mul_add(g, acc[4]);
    }
    if SUMS & SUM_V != 0 {
        // −g is exact: flip the sign bit.
        acc[5] = ew.mul_add(g.xor(V::splat(-0.0)), acc[5]);
    }
}

/// A student/teacher block pair for [`step_block`] (`z` and `w` of equal length), each row
/// split once into whole chunks and tail (as [`LseBlock`]); the support flags of what it reads
/// go to `flags`.
struct PairBlock<'a, S, U, const SUMS: u8> {
    z: (&'a [[S; 16]], &'a [S]),
    w: (&'a [[U; 16]], &'a [U]),
    flags: &'a mut PairFlags,
}

impl<S: Load, U: Load, const SUMS: u8> PairBlock<'_, S, U, SUMS> {
    /// Records the flags of a [`pair_max_support`] scan and returns its extrema.
    #[inline(always)]
    fn record(&mut self, scan: PairScan) -> [(f32, f32); 2] {
        self.flags.pq_infinite |= scan.pq_infinite;
        self.flags.qp_infinite |= scan.qp_infinite;
        [(scan.zmax, scan.zlow), (scan.wmax, scan.wlow)]
    }
}

impl<V: F32x16, S: Load, U: Load, const SUMS: u8> BlockRows<V, 2> for PairBlock<'_, S, U, SUMS> {
    /// `[sz, tz, sw, tw, u, v]`.
    type Acc = [V; 6];
    /// On every backend: a pass of its own over both rows measured slower on AVX2 too (see
    /// [`ROOMY_REGISTERS`]).
    const SCAN_IN_STEP: bool = true;
    #[inline(always)]
    fn zero() -> [V; 6] {
        [V::splat(0.0); 6]
    }
    #[inline(always)]
    fn steps<T: Track<V>>(
        &self,
        tau: f32,
        c: [f32; 2],
        normal: bool,
        acc: &mut [V; 6],
        track: &mut [T; 2],
    ) -> bool {
        pair_chunks::<V, S, U, T, SUMS>(self.z.0, self.w.0, tau, c, normal, acc, track)
    }
    #[inline(always)]
    fn extrema(&mut self) -> [(f32, f32); 2] {
        let scan = pair_max_support::<V, S, U>(self.z, self.w);
        self.record(scan)
    }
    #[inline(always)]
    fn scanned(&mut self, scans: &[Scan<V>; 2]) -> [(f32, f32); 2] {
        let (zt, wt) = (self.z.1, self.w.1);
        let found = [scans[0].finish(zt), scans[1].finish(wt)];
        // The support flags need a look at the −∞ entries: none in the chunks unless a
        // minimum is −∞ (then the block, in L1 now, is scanned again); the tail is checked
        // here.
        if found[0].1 == f32::NEG_INFINITY || found[1].1 == f32::NEG_INFINITY {
            let scan = pair_max_support::<V, S, U>(self.z, self.w);
            return self.record(scan);
        }
        let (pq_infinite, qp_infinite) = tail_support(zt, wt);
        self.flags.pq_infinite |= pq_infinite;
        self.flags.qp_infinite |= qp_infinite;
        found
    }
}

/// `canon::pair_block` in lanes (`z` and `w` have the same length): the block's state after
/// earlier blocks with running maxima `prior`, and the running maxima after it. The whole
/// chunk pairs go through [`step_block`] (one pass or two, `fast` carried between blocks, as
/// in `lse_block`), then the fixed lane tree and the tail on lane 0.
#[inline(always)]
fn pair_block<V: F32x16, S: Load, U: Load, const SUMS: u8>(
    z: &[S],
    w: &[U],
    tau: f32,
    prior: [f32; 2],
    fast: &mut bool,
    flags: &mut PairFlags,
) -> (PairState, [f32; 2]) {
    let mut rows = PairBlock::<S, U, SUMS> {
        z: z.as_chunks::<16>(),
        w: w.as_chunks::<16>(),
        flags,
    };
    let (acc, [zmax, wmax], running) = step_block::<V, _, 2>(&mut rows, tau, prior, fast);
    let (zt, wt) = (rows.z.1, rows.w.1);
    let (vt, cz, cw) = (
        V::splat(tau),
        V::splat(canon::offset(zmax)),
        V::splat(canon::offset(wmax)),
    );
    let mut lane0 = [0.0f32; 6];
    for (k, a) in acc.iter().enumerate() {
        let mut arr = a.to_array();
        canon::tree(&mut arr);
        lane0[k] = arr[0];
    }
    let mut acc = [V::splat(0.0); 6];
    for k in 0..6 {
        acc[k] = V::splat(lane0[k]);
    }
    for (&a, &b) in zt.iter().zip(wt) {
        pair_step::<V, SUMS>(
            V::splat(a.to_f32()),
            V::splat(b.to_f32()),
            vt,
            cz,
            cw,
            &mut acc,
        );
    }
    let mut r = [0.0f32; 6];
    for k in 0..6 {
        r[k] = acc[k].to_array()[0];
    }
    let st = PairState {
        zmax,
        sz: r[0],
        tz: r[1],
        wmax,
        sw: r[2],
        tw: r[3],
        u: r[4],
        v: r[5],
    };
    (st, running)
}

/// The support flags of a block's tail (as `pair_max_support` computes them).
#[inline(always)]
fn tail_support<S: Load, U: Load>(zt: &[S], wt: &[U]) -> (bool, bool) {
    let (mut f, mut r) = (false, false);
    for (a, b) in zt.iter().zip(wt) {
        let (iz, iw) = (
            a.to_f32() == f32::NEG_INFINITY,
            b.to_f32() == f32::NEG_INFINITY,
        );
        f |= iw && !iz;
        r |= iz && !iw;
    }
    (f, r)
}

/// The pair step over all whole chunk pairs of a block against offsets `c = [cz, cw]`
/// (`pair_steps` over pairs of chunks, then a last chunk with the reference scaling), as
/// `lse_chunks` does for one row.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pair_chunks<V: F32x16, S: Load, U: Load, T: Track<V>, const SUMS: u8>(
    zc: &[[S; 16]],
    wc: &[[U; 16]],
    tau: f32,
    c: [f32; 2],
    normal: bool,
    acc: &mut [V; 6],
    track: &mut [T; 2],
) -> bool {
    let (vt, cz, cw) = (V::splat(tau), V::splat(c[0]), V::splat(c[1]));
    let whole = zc.len() / 2 * 2;
    let (zs, ws) = (&zc[..whole], &wc[..whole]);
    // As in `lse_chunks`: the general step only, for lanes without `SPECIALIZED_LOOPS`.
    let ok = if const { !V::SPECIALIZED_LOOPS } {
        pair_steps::<V, S, U, T, true, false, SUMS>(zs, ws, vt, cz, cw, acc, track)
    } else {
        match (tau == 1.0, normal) {
            (true, true) => {
                pair_steps::<V, S, U, T, false, true, SUMS>(zs, ws, vt, cz, cw, acc, track)
            }
            (true, false) => {
                pair_steps::<V, S, U, T, false, false, SUMS>(zs, ws, vt, cz, cw, acc, track)
            }
            (false, true) => {
                pair_steps::<V, S, U, T, true, true, SUMS>(zs, ws, vt, cz, cw, acc, track)
            }
            (false, false) => {
                pair_steps::<V, S, U, T, true, false, SUMS>(zs, ws, vt, cz, cw, acc, track)
            }
        }
    };
    for (a, b) in zc[whole..].iter().zip(&wc[whole..]) {
        let (x, y) = (S::load::<V>(a), U::load::<V>(b));
        track[0].add(x);
        track[1].add(y);
        pair_step::<V, SUMS>(x, y, vt, cz, cw, acc);
    }
    ok
}

/// The pair step over whole pairs of chunks (`z` and `w` of equal, even length): four
/// independent exponentials interleaved per iteration, then the sums updated in index order.
/// `SCALED = false` skips the `·τ` (exact for τ = 1); `SUMS` selects the optional sums
/// ([`PairNeed`]); the tracking and prefetching as in `lse_steps`.
///
/// `NORMAL = true` uses [`exp_nonpos_normal_n`] (its domain checked from both blocks'
/// smallest logits, before or after) and returns whether no argument was NaN, as `lse_steps`
/// does. Inside that domain both clamps are the identity — `max_r(D_MIN, δ)` as there, and
/// the log-ratio floor `max_r(LOG_RATIO_FLOOR, δ)` (−2^64) — so the `NORMAL` step skips
/// them. The NaN check rides on `u` or `v` when the caller asks for one: `g = δz − δw` is NaN
/// when either argument is, and `e·NaN + acc` stays NaN. Otherwise (`Jsd`, `GradTeacherStudent`: no
/// sum multiplies by `g`, `tz` misses a NaN teacher, and the exponent-add can turn a NaN
/// into a number) a separate `+` accumulates the arguments: NaN is sticky under addition, and
/// the ≤ 2048 arguments in [−86, 8] of a block cannot overflow. Where the scaling keeps a NaN
/// (AVX-512, as in `lse_steps`) the check reads `Σ e_z + Σ e_w` instead, and the four adds
/// per iteration go (JSD, 4 × 32768 f32 pairs in cache, one thread, alternated as there:
/// 0.984–0.987 of the time; the JSD's other passes dominate it). Measured with both (median
/// ms, one thread, 64 × 8192 f32 pairs in cache): 0.315 with all six sums and the reference
/// scaling, 0.285 with KL(p‖q)'s three, 0.272 with the exponent-add on top (before the
/// NaN check); without the clamps and the separate NaN sum for the KL needs, KL 0.274 →
/// 0.228 ms with 16 × 32768 in cache on one thread, 19.5 / 22.0 → 16.9 / 19.0 ms streaming
/// 2048 × 32768 / 512 × 151936 on two (median of seven and five alternated runs).
#[inline(always)]
fn pair_steps<
    V: F32x16,
    S: Load,
    U: Load,
    T: Track<V>,
    const SCALED: bool,
    const NORMAL: bool,
    const SUMS: u8,
>(
    z: &[[S; 16]],
    w: &[[U; 16]],
    vt: V,
    cz: V,
    cw: V,
    acc: &mut [V; 6],
    track: &mut [T; 2],
) -> bool {
    let (dmin, neg_max) = (V::splat(D_MIN), V::splat(LOG_RATIO_FLOOR));
    let scale = |d: V| if SCALED { d.mul(vt) } else { d };
    let mut nan = V::splat(0.0);
    let prefetch = software_prefetch();
    for (j, (a, b)) in z.chunks_exact(2).zip(w.chunks_exact(2)).enumerate() {
        for k in 0..2 {
            prefetch_ahead::<V, S>(&a[k], 2 * j + k, prefetch);
            prefetch_ahead::<V, U>(&b[k], 2 * j + k, prefetch);
        }
        let x = [S::load::<V>(&a[0]), S::load::<V>(&a[1])];
        let y = [U::load::<V>(&b[0]), U::load::<V>(&b[1])];
        for k in 0..2 {
            track[0].add(x[k]);
            track[1].add(y[k]);
        }
        let dz = [scale(x[0].sub(cz)), scale(x[1].sub(cz))];
        let dw = [scale(y[0].sub(cw)), scale(y[1].sub(cw))];
        let e;
        let dc;
        if NORMAL {
            dc = [dz[0], dz[1], dw[0], dw[1]];
            if SUMS & (SUM_U | SUM_V) == 0 && !V::POW2_NORMAL_KEEPS_NAN {
                for x in dc {
                    nan = nan.add(x);
                }
            }
            e = exp_nonpos_normal_n(dc);
        } else {
            dc = [
                dmin.max(dz[0]),
                dmin.max(dz[1]),
                dmin.max(dw[0]),
                dmin.max(dw[1]),
            ];
            e = exp_nonpos_clamped_n(dc);
        }
        for k in 0..2 {
            let g = if NORMAL {
                dz[k].sub(dw[k])
            } else {
                neg_max.max(dz[k]).sub(neg_max.max(dw[k]))
            };
            pair_accumulate::<V, SUMS>(e[k], e[2 + k], [dc[k], dc[2 + k]], g, acc);
        }
    }
    let nan = if SUMS & SUM_U != 0 {
        acc[4]
    } else if SUMS & SUM_V != 0 {
        acc[5]
    } else if V::POW2_NORMAL_KEEPS_NAN {
        // Σ e_z + Σ e_w: NaN if either sum is (a NaN argument's exponential is NaN there).
        acc[0].add(acc[2])
    } else {
        nan
    };
    !NORMAL || !any_nan(nan)
}

/// A pair state grpo-core's validation would accept, support aside: both halves [`lse_ok`].
#[inline(always)]
pub(crate) fn pair_ok(st: &PairState, tau: f32) -> bool {
    lse_ok(&st.student(), tau) && lse_ok(&st.teacher(), tau)
}

/// A row state grpo-core's validation would accept: finite raw maximum, `max·τ` and sum (see
/// `block_max_min`: NaN and +∞ logits always surface here).
#[inline(always)]
pub(crate) fn lse_ok(st: &LseState, tau: f32) -> bool {
    st.max.is_finite() && (st.max * tau).is_finite() && st.sum.is_finite()
}

/// What the fused support check of a row pair found (NaN/+∞ show in the state, see
/// `block_max_min`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PairFlags {
    /// Some `w = −∞ < z`: KL(p‖q) would be +∞.
    pub(crate) pq_infinite: bool,
    /// Some `z = −∞ < w`: KL(q‖p) would be +∞.
    pub(crate) qp_infinite: bool,
}

/// The merged [`PairState`] of a student row and a teacher row of equal length (`PairState::EMPTY`
/// for empty rows), with the validation flags; of the optional sums only those in `SUMS`
/// ([`PairNeed::sums`]).
#[inline(always)]
pub(crate) fn pair_row<V: F32x16, S: Load, U: Load, const SUMS: u8>(
    z: &[S],
    w: &[U],
    tau: f32,
) -> (PairState, PairFlags) {
    let mut b = PairBlocks::<V, S, U, SUMS> {
        z,
        w,
        tau,
        prior: [f32::NEG_INFINITY; 2],
        fast: true,
        flags: PairFlags::default(),
        lanes: PhantomData,
    };
    let st = fold_blocks(z.len().min(w.len()), &mut b);
    (st.unwrap_or(PairState::EMPTY), b.flags)
}

/// `(x − max)·τ + neg_ln_sum` — a log-softmax of `canon::grad_step` — with `SCALED = false`
/// for τ = 1, where `(x − max)·1 + c` is the single rounding `(x − max) + c`: an add instead of
/// an FMA, which frees the FMA ports the gradient loops are bound by.
#[inline(always)]
fn log_softmax_lanes<V: F32x16, const SCALED: bool>(x: V, max: V, neg_ln_sum: V, tau: V) -> V {
    let d = x.sub(max);
    if SCALED {
        d.mul_add(tau, neg_ln_sum)
    } else {
        d.add(neg_ln_sum)
    }
}

/// The lane form of `canon::grad_step` for `N` vectors at once, operation by operation across
/// all `N` (same bits per lane; interleaved dependency chains, see `exp_nonpos_clamped_n`).
/// `z` are student logits, `w` the teacher's (ignored for `KlGrad::None`), `o` the additive
/// start: 0 for non-target elements, `g_lp` for the target in every lane. `SCALED = false` is
/// for τ = 1 (the log-softmaxes above, and the final `·τ` skipped — exact).
///
/// One step for every KL mode: the KL terms used to run one vector at a time through a
/// separate step. Interleaving them measured no faster (`grpo-bench vocab --kernel
/// backward_kl`, f32, 2 threads, alternating binaries: 47.8 / 59.6 → 46.6 / 56.6 ms median at
/// 2048 × 32768 / 512 × 151936, within the noise): a KL backward is dominated by its two
/// passes over two rows — the pair statistics (teacher log-sum-exp and KL value) and then the
/// gradient. The mode is a run-time value in the chunk loop (`grad_row_chunks`), whose
/// compiled form tests it per iteration; a loop compiled per mode (a `match` outside it, the
/// mode a constant inside) measured slower on Zen 4 (4 × 32768 f32 in cache, one thread, one
/// process alternating both over 40 rounds, median of the per-round time ratios, from saved
/// states): without a KL term 1.089 on AVX-512 and 1.057 on AVX2, with KL(p‖q) 1.159 / 1.024.
#[inline(always)]
fn grad_steps<V: F32x16, const N: usize, const SCALED: bool>(
    z: [V; N],
    w: [V; N],
    o: [V; N],
    c: &GradCoef,
    kl: KlGrad,
) -> [V; N] {
    let tau = V::splat(c.tau);
    let (pmax, pnls) = (V::splat(c.p.max), V::splat(c.p.neg_ln_sum));
    let (mut lp, mut lpc) = (z, z);
    for i in 0..N {
        lp[i] = log_softmax_lanes::<V, SCALED>(z[i], pmax, pnls, tau);
        lpc[i] = clamp_grad_arg(lp[i]);
    }
    let p = exp_nonpos_clamped_n(lpc);
    let (g_h, h, g_lp) = (V::splat(c.g_h), V::splat(c.h), V::splat(c.g_lp));
    let mut k = z;
    for i in 0..N {
        k[i] = g_h.mul_add(lpc[i].add(h), g_lp);
    }
    let mut o = o;
    if kl != KlGrad::None {
        let (qmax, qnls) = (V::splat(c.q.max), V::splat(c.q.neg_ln_sum));
        let neg_g_kl = V::splat(-c.g_kl);
        let mut lq = w;
        for i in 0..N {
            lq[i] = log_softmax_lanes::<V, SCALED>(w[i], qmax, qnls, tau);
        }
        if kl == KlGrad::StudentTeacher {
            let (floor, kl_value) = (V::splat(LOG_RATIO_FLOOR), V::splat(c.kl));
            for i in 0..N {
                let g = floor.max(lp[i]).sub(floor.max(lq[i]));
                k[i] = neg_g_kl.mul_add(g.sub(kl_value), k[i]);
            }
        } else {
            for x in &mut lq {
                *x = clamp_grad_arg(*x);
            }
            let q = exp_nonpos_clamped_n(lq);
            let g_kl = V::splat(c.g_kl);
            for i in 0..N {
                k[i] = k[i].sub(g_kl);
                o[i] = neg_g_kl.mul_add(q[i], o[i]);
            }
        }
    }
    let sign = V::splat(-0.0);
    let mut g = p;
    for i in 0..N {
        let x = p[i].xor(sign).mul_add(k[i], o[i]);
        g[i] = if SCALED { x.mul(tau) } else { x };
    }
    g
}

/// `N` chunks of a row loaded as lanes, with the cache lines `PREFETCH_BYTES` ahead requested
/// (`i` = index of the first chunk in the row).
#[inline(always)]
fn load_chunks<V: F32x16, S: Load, const N: usize>(
    c: &[[S; 16]],
    i: usize,
    prefetch: bool,
) -> [V; N] {
    let mut x = [V::splat(0.0); N];
    for k in 0..N {
        prefetch_ahead::<V, S>(&c[k], i + k, prefetch);
        x[k] = S::load::<V>(&c[k]);
    }
    x
}

/// The gradient of `N` chunks starting at chunk `i` of `z` (and of the teacher `w`, read only
/// when `kl` is not `None`), non-target elements.
#[inline(always)]
fn grad_chunks<V: F32x16, S: Load, U: Load, const N: usize, const SCALED: bool>(
    z: &[[S; 16]],
    w: &[[U; 16]],
    i: usize,
    c: &GradCoef,
    kl: KlGrad,
    prefetch: bool,
) -> [V; N] {
    let x = load_chunks::<V, S, N>(&z[i..i + N], i, prefetch);
    let t = if kl == KlGrad::None {
        x
    } else {
        load_chunks::<V, U, N>(&w[i..i + N], i, prefetch)
    };
    grad_steps::<V, N, SCALED>(x, t, [V::splat(0.0); N], c, kl)
}

/// Where [`grad_row_chunks`] puts a row's gradient: a separate `f32` row ([`GradInto`]) or the
/// logits themselves ([`GradOver`]).
trait GradDest<S: Load> {
    /// The whole chunks of logits the gradient is computed from.
    fn logits(&self) -> &[[S; 16]];
    /// Writes the gradients `g` of the `G` chunks from chunk `i` on (after they were read).
    fn put<V: F32x16, const G: usize>(&mut self, i: usize, g: [V; G]);
}

/// The gradient of the chunks `z` into `out` (as many), through [`F32x16::store_stream`]: the
/// output is written once and not read back (the JSD's gradient reads its log-ratios from it
/// first, [`JsdGradDest`]).
struct GradInto<'a, S> {
    z: &'a [[S; 16]],
    out: &'a mut [[f32; 16]],
}

impl<S: Load> GradDest<S> for GradInto<'_, S> {
    #[inline(always)]
    fn logits(&self) -> &[[S; 16]] {
        self.z
    }
    #[inline(always)]
    fn put<V: F32x16, const G: usize>(&mut self, i: usize, g: [V; G]) {
        for (g, o) in g.into_iter().zip(&mut self.out[i..i + G]) {
            g.store_stream(o);
        }
    }
}

/// The gradient of the chunks written over them, rounded to the storage type.
struct GradOver<'a, S>(&'a mut [[S; 16]]);

impl<S: Load> GradDest<S> for GradOver<'_, S> {
    #[inline(always)]
    fn logits(&self) -> &[[S; 16]] {
        self.0
    }
    #[inline(always)]
    fn put<V: F32x16, const G: usize>(&mut self, i: usize, g: [V; G]) {
        for (g, z) in g.into_iter().zip(&mut self.0[i..i + G]) {
            S::store_grad(g, z);
        }
    }
}

/// The gradient of a row's whole chunks (non-target elements) into `dest`; `w` holds the
/// teacher's chunks (as many) unless `kl` is `None`. The `·τ` is skipped at τ = 1 (see
/// `grad_steps`). [`UNROLL`] chunks at a time where the registers hold 16 values or more, two
/// where they hold 8 ([`ROOMY_REGISTERS`]): eight exponential chains in flight spill on AVX2.
/// Measured there (Zen 3, see [`ROOMY_REGISTERS`]) with one row of 65536 f32 in L2 on one
/// thread, and streaming on two:
/// - in place (a copy of the row included), medians of 3000 calls: 56.2–56.9 µs with two
///   against 70.9–72.0 µs with four (four alternated runs); streaming (2048 × 32768, three
///   alternated runs) 40.4–41.7 ms against 44.8–46.1 ms;
/// - out of place (cached stores, see `arch::avx2`), fastest of 3000 calls: 47.1–47.2 µs
///   against 53.1–53.8 µs (three alternated runs); streaming (2048 × 32768 / 512 × 151936,
///   four alternated runs) 39.1–46.9 / 45.3–58.6 ms against 45.2–47.5 / 50.4–55.0 ms, within
///   the noise. (With `vmovntps` two had measured slower streaming, 85.2–94.0 against
///   57.6–60.5 ms at 2048 × 32768.)
#[inline(always)]
fn grad_row_chunks<V: F32x16, S: Load, U: Load, D: GradDest<S>>(
    dest: &mut D,
    w: &[[U; 16]],
    c: &GradCoef,
    kl: KlGrad,
) {
    // The conditions on `V` are `const` blocks, which the compiler decides before it
    // instantiates the branches: only those this `V` can take are compiled.
    if const { V::REGISTERS >= ROOMY_REGISTERS } {
        if const { V::SPECIALIZED_LOOPS } && c.tau == 1.0 {
            grad_row_chunks_n::<V, S, U, D, false, UNROLL>(dest, w, c, kl)
        } else {
            grad_row_chunks_n::<V, S, U, D, true, UNROLL>(dest, w, c, kl)
        }
    } else if const { V::SPECIALIZED_LOOPS } && c.tau == 1.0 {
        grad_row_chunks_n::<V, S, U, D, false, FEW_REGISTERS_UNROLL>(dest, w, c, kl)
    } else {
        grad_row_chunks_n::<V, S, U, D, true, FEW_REGISTERS_UNROLL>(dest, w, c, kl)
    }
}

/// [`grad_row_chunks`], `G` chunks at a time.
#[inline(always)]
fn grad_row_chunks_n<
    V: F32x16,
    S: Load,
    U: Load,
    D: GradDest<S>,
    const SCALED: bool,
    const G: usize,
>(
    dest: &mut D,
    w: &[[U; 16]],
    c: &GradCoef,
    kl: KlGrad,
) {
    let n = dest.logits().len();
    let whole = n / G * G;
    let prefetch = software_prefetch();
    for j in (0..whole).step_by(G) {
        let g = grad_chunks::<V, S, U, G, SCALED>(dest.logits(), w, j, c, kl, prefetch);
        dest.put(j, g);
    }
    for i in whole..n {
        let g = grad_chunks::<V, S, U, 1, SCALED>(dest.logits(), w, i, c, kl, prefetch);
        dest.put(i, g);
    }
}

/// The gradient of one element (lane 0): the tails, the unaligned head and the target.
#[inline(always)]
fn grad1<V: F32x16>(z: f32, w: f32, target: bool, c: &GradCoef, kl: KlGrad) -> f32 {
    let o = V::splat(if target { c.g_lp } else { 0.0 });
    grad_steps::<V, 1, true>([V::splat(z)], [V::splat(w)], [o], c, kl)[0].to_array()[0]
}

/// The KL mode the chunk loops run: `kl`, or `None` when there is no teacher of the row's
/// length (the callers validate that there is one whenever `kl` is not `None`).
#[inline(always)]
fn chunk_kl(kl: KlGrad, teacher_len: usize, n: usize) -> KlGrad {
    if teacher_len < n { KlGrad::None } else { kl }
}

/// `canon::grad_step` for every element of a row except the target term (the caller patches
/// element `y`): `out[v] = ∂(g_lp·logp(y) + g_H·H + g_KL·KL)/∂z_v` for `v ≠ y`. `w` is the
/// teacher row (ignored when `kl` is `None`). The output is write-only, so from its first
/// 64-byte boundary on it is written with [`F32x16::store_stream`] (streaming stores where the
/// backend uses them; the gradient is elementwise, so the split point changes no bit).
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
    let (zc, _) = z[head..n].as_chunks::<16>();
    let (oc, _) = out[head..n].as_chunks_mut::<16>();
    let ck = chunk_kl(kl, w.len(), n);
    let wc = if ck == KlGrad::None {
        &[]
    } else {
        w[head..n].as_chunks::<16>().0
    };
    grad_row_chunks::<V, S, U, _>(&mut GradInto { z: zc, out: oc }, wc, c, ck);
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
    let n = z.len();
    let ck = chunk_kl(kl, w.len(), n);
    let (zc, zt) = z.as_chunks_mut::<16>();
    let done = zc.len() * 16;
    let wc = if ck == KlGrad::None {
        &[]
    } else {
        w[..done].as_chunks::<16>().0
    };
    grad_row_chunks::<V, S, U, _>(&mut GradOver(zc), wc, c, ck);
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
/// tree, tail per block; blocks merged pairwise by addition), floored at 0, and the canonical
/// sum of its student terms, `K = KL(p‖m)` (unclamped).
#[inline(always)]
fn jsd_sum<V: F32x16, S: Load, U: Load>(z: &[S], w: &[U], p: &JsdParams) -> (f32, f32) {
    let mut b = JsdBlocks::<V, S, U> {
        z,
        w,
        p: *p,
        lanes: PhantomData,
    };
    let [s, k] = fold_blocks(z.len().min(w.len()), &mut b).unwrap_or([0.0; 2]);
    (canon_max(0.0, s), k)
}

/// The student terms `p·(lp − lm)` of whole chunk pairs (grpo-core's `jsd_student_step`)
/// summed into `acc` as [`jsd_chunks`] sums the JSD's (same lanes, same order), each
/// element's log-ratio `lp − lm` stored to `lr` for the gradient's pass.
#[inline(always)]
fn jsd_ratio_chunks<V: F32x16, S: Load, U: Load, const NORMAL: bool>(
    zc: &[[S; 16]],
    wc: &[[U; 16]],
    p: &JsdParams,
    lr: &mut [[f32; 16]],
) -> V {
    const G: usize = JSD_PAIRS;
    let mut acc = V::splat(0.0);
    let mut zp = zc.chunks_exact(G);
    let mut wp = wc.chunks_exact(G);
    let prefetch = software_prefetch();
    let mut op = lr.chunks_exact_mut(G);
    for (j, ((a, b), o)) in (&mut zp).zip(&mut wp).zip(&mut op).enumerate() {
        let (z, w) = (
            load_chunks::<V, S, G>(a, G * j, prefetch),
            load_chunks::<V, U, G>(b, G * j, prefetch),
        );
        let (l, e, lm) = jsd_parts::<V, G, { 2 * G }, NORMAL>(z, w, p);
        for k in 0..G {
            let r = l[2 * k].sub(lm[k]);
            r.store(&mut o[k]);
            acc = acc.add(e[2 * k].mul(r));
        }
    }
    for ((a, b), o) in zp
        .remainder()
        .iter()
        .zip(wp.remainder())
        .zip(op.into_remainder())
    {
        let (l, e, lm) = jsd_parts::<V, 1, 2, NORMAL>([S::load(a)], [U::load(b)], p);
        let r = l[0].sub(lm[0]);
        r.store(o);
        acc = acc.add(e[0].mul(r));
    }
    acc
}

/// `K = KL(p‖m)` of a row pair by blocks, the canonical sum of the student terms (as
/// [`JsdBlocks`] sums the JSD's), storing every element's log-ratio `lp − lm` to `lr` on the
/// way.
struct JsdRatioBlocks<'a, V, S, U> {
    z: &'a [S],
    w: &'a [U],
    p: JsdParams,
    lr: &'a mut [f32],
    lanes: PhantomData<V>,
}

impl<V: F32x16, S: Load, U: Load> Blocks for JsdRatioBlocks<'_, V, S, U> {
    type St = f32;
    #[inline(always)]
    fn block(&mut self, start: usize, end: usize) -> f32 {
        let (zc, zt) = self.z[start..end].as_chunks::<16>();
        let (wc, wt) = self.w[start..end].as_chunks::<16>();
        let (lc, ltail) = self.lr[start..end].as_chunks_mut::<16>();
        let acc = if jsd_chunks_normal::<V, S, U>(zc, wc, &self.p) {
            jsd_ratio_chunks::<V, S, U, true>(zc, wc, &self.p, lc)
        } else {
            jsd_ratio_chunks::<V, S, U, false>(zc, wc, &self.p, lc)
        };
        let mut lanes = acc.to_array();
        canon::tree(&mut lanes);
        let mut s = lanes[0];
        for ((a, b), o) in zt.iter().zip(wt).zip(ltail) {
            let (a, b) = (V::splat(a.to_f32()), V::splat(b.to_f32()));
            let (l, e, lm) = jsd_parts::<V, 1, 2, false>([a], [b], &self.p);
            let r = l[0].sub(lm[0]);
            *o = r.to_array()[0];
            s += e[0].mul(r).to_array()[0];
        }
        s
    }
    #[inline(always)]
    fn merge(&mut self, a: f32, b: f32) -> f32 {
        a + b
    }
}

/// The JSD's gradient `(p·(lr − k))·c` (grpo-core's `jsd_grad_step`) of `N` chunks at once,
/// from the student's logits and the log-ratios `lr` that [`JsdRatioBlocks`] stored: `p` is
/// recomputed as [`jsd_parts`] computes it (`NORMAL`: the student's log-probabilities are in
/// [`EXP_NORMAL_MIN`], 0]), so the teacher is not read again and no logarithm is taken.
#[inline(always)]
fn jsd_grads<V: F32x16, const N: usize, const NORMAL: bool>(
    z: [V; N],
    lr: [V; N],
    p: &JsdParams,
    (k, c): (V, V),
) -> [V; N] {
    let (tau, zm, zl) = (
        V::splat(p.tau),
        V::splat(p.lz.max),
        V::splat(p.lz.neg_ln_sum),
    );
    let dmin = V::splat(D_MIN);
    let mut l = [dmin; N];
    for j in 0..N {
        l[j] = z[j].sub(zm).mul_add(tau, zl);
        if !NORMAL {
            l[j] = clamp_grad_arg(l[j]);
        }
    }
    let e = if NORMAL {
        exp_nonpos_normal_n(l)
    } else {
        exp_nonpos_clamped_n(l)
    };
    let mut out = [k; N];
    for j in 0..N {
        out[j] = e[j].mul(lr[j].sub(k)).mul(c);
    }
    out
}

/// The gradient of one element (lane 0) from its log-ratio: the unaligned head and the tail.
#[inline(always)]
fn jsd_grad1<V: F32x16>(z: f32, lr: f32, p: &JsdParams, (k, c): (f32, f32)) -> f32 {
    let kc = (V::splat(k), V::splat(c));
    jsd_grads::<V, 1, false>([V::splat(z)], [V::splat(lr)], p, kc)[0].to_array()[0]
}

/// The JSD's gradient of one validated row pair into `out`: `K = KL(p‖m)` by
/// [`JsdRatioBlocks`], which leaves each element's log-ratio in `out`, then `out[v] =
/// (p_v·(out[v] − K))·c` ([`jsd_grads`]; `c = (g·(1 − β))·τ`) — a scalar head up to 64-byte
/// alignment of `out`, the whole chunks ([`jsd_grad_chunks`] into [`GradInto`], streaming
/// stores on AVX-512),
/// the tail. Every element is independent, so the split changes no bit.
#[inline(always)]
fn jsd_grad_into<V: F32x16, S: Load, U: Load>(
    z: &[S],
    w: &[U],
    p: &JsdParams,
    g: f32,
    out: &mut [f32],
) {
    let n = z.len().min(w.len()).min(out.len());
    let (z, out) = (&z[..n], &mut out[..n]);
    let kc = jsd_ratios::<V, S, U>(z, &w[..n], p, g, out);
    let head = out.as_ptr().align_offset(64).min(n);
    for i in 0..head {
        out[i] = jsd_grad1::<V>(z[i].to_f32(), out[i], p, kc);
    }
    let (zc, _) = z[head..].as_chunks::<16>();
    let (oc, _) = out[head..].as_chunks_mut::<16>();
    let done = head + zc.len() * 16;
    jsd_grad_chunks::<V, S, _>(&mut GradInto { z: zc, out: oc }, p, kc);
    for i in done..n {
        out[i] = jsd_grad1::<V>(z[i].to_f32(), out[i], p, kc);
    }
}

/// [`jsd_grad_into`] over the student logits themselves, each gradient rounded to the storage
/// type; the log-ratios go to `scratch` (at least a row long) instead of the output.
#[inline(always)]
fn jsd_grad_over<V: F32x16, S: Load, U: Load>(
    z: &mut [S],
    w: &[U],
    p: &JsdParams,
    g: f32,
    scratch: &mut [f32],
) {
    let n = z.len().min(w.len()).min(scratch.len());
    let (z, lr) = (&mut z[..n], &mut scratch[..n]);
    let kc = jsd_ratios::<V, S, U>(z, &w[..n], p, g, lr);
    let (zc, zt) = z.as_chunks_mut::<16>();
    let (lc, lt) = lr.as_chunks::<16>();
    jsd_grad_chunks::<V, S, _>(
        &mut JsdOver {
            z: GradOver(zc),
            lr: lc,
        },
        p,
        kc,
    );
    for (x, &r) in zt.iter_mut().zip(lt) {
        *x = S::from_f32(jsd_grad1::<V>(x.to_f32(), r, p, kc));
    }
}

/// `(K, c)` of a validated row pair: `K = KL(p‖m)` by [`JsdRatioBlocks`] (each element's
/// log-ratio left in `lr`), `c = (g·(1 − β))·τ`.
#[inline(always)]
fn jsd_ratios<V: F32x16, S: Load, U: Load>(
    z: &[S],
    w: &[U],
    p: &JsdParams,
    g: f32,
    lr: &mut [f32],
) -> (f32, f32) {
    let n = lr.len();
    let mut b = JsdRatioBlocks::<V, S, U> {
        z,
        w,
        p: *p,
        lr,
        lanes: PhantomData,
    };
    let k = fold_blocks(n, &mut b).unwrap_or(0.0);
    (k, (g * p.omb) * p.tau)
}

/// What the JSD gradient's last pass needs besides a [`GradDest`]: each chunk's log-ratios.
/// Out of place they are in the `f32` output itself ([`GradInto`]), in place in a scratch row
/// ([`JsdOver`]).
trait JsdGradDest<S: Load>: GradDest<S> {
    /// Chunk `i`'s log-ratios (read before chunk `i`'s gradient is put).
    fn ratios<V: F32x16>(&self, i: usize) -> V;
}

impl<S: Load> JsdGradDest<S> for GradInto<'_, S> {
    #[inline(always)]
    fn ratios<V: F32x16>(&self, i: usize) -> V {
        V::load(&self.out[i])
    }
}

/// The JSD's gradients over the logits ([`GradOver`]: rounded to their storage type), from
/// the log-ratios in `lr`.
struct JsdOver<'a, S> {
    z: GradOver<'a, S>,
    lr: &'a [[f32; 16]],
}

impl<S: Load> GradDest<S> for JsdOver<'_, S> {
    #[inline(always)]
    fn logits(&self) -> &[[S; 16]] {
        self.z.logits()
    }
    #[inline(always)]
    fn put<V: F32x16, const G: usize>(&mut self, i: usize, g: [V; G]) {
        self.z.put(i, g);
    }
}

impl<S: Load> JsdGradDest<S> for JsdOver<'_, S> {
    #[inline(always)]
    fn ratios<V: F32x16>(&self, i: usize) -> V {
        V::load(&self.lr[i])
    }
}

/// The JSD gradient's whole chunks: by blocks, each in [`jsd_grads`]' `NORMAL` form where the
/// block's smallest student logit allows it ([`jsd_grad_range`]).
#[inline(always)]
fn jsd_grad_chunks<V: F32x16, S: Load, D: JsdGradDest<S>>(
    d: &mut D,
    p: &JsdParams,
    kc: (f32, f32),
) {
    let n = d.logits().len();
    for start in (0..n).step_by(BLOCK / 16) {
        let end = (start + BLOCK / 16).min(n);
        let normal = const { V::SPECIALIZED_LOOPS } && {
            let zlow = block_max_min::<V, S>(&d.logits()[start..end], &[]).1;
            fma1::<V>(zlow - p.lz.max, p.tau, p.lz.neg_ln_sum) >= EXP_NORMAL_MIN
        };
        if normal {
            jsd_grad_range::<V, S, D, true>(d, start..end, p, kc);
        } else {
            jsd_grad_range::<V, S, D, false>(d, start..end, p, kc);
        }
    }
}

/// [`jsd_grad_chunks`] over chunks `range`, as many at a time as the backward's gradient
/// steps take ([`grad_row_chunks`]): [`UNROLL`] where the registers are roomy, else
/// [`FEW_REGISTERS_UNROLL`]. It took two on every backend before; against that (the JSD
/// backward, whose ratio pass takes [`JSD_PAIRS`], f32, Zen 4, one process alternating both,
/// median of the per-round time ratios) four measured on AVX-512 0.756–0.767 in cache (4 ×
/// 32768, one thread, 30 rounds) and 0.848 / 0.834 streaming (2048 × 32768 / 512 × 151936, two
/// threads, 12 rounds); on AVX2 0.987 and 1.008 / 1.022, so it keeps two there.
#[inline(always)]
fn jsd_grad_range<V: F32x16, S: Load, D: JsdGradDest<S>, const NORMAL: bool>(
    d: &mut D,
    range: core::ops::Range<usize>,
    p: &JsdParams,
    kc: (f32, f32),
) {
    // As in `grad_row_chunks`: a `const` block, so only the width this `V` takes is compiled.
    if const { V::REGISTERS >= ROOMY_REGISTERS } {
        jsd_grad_steps::<V, S, D, NORMAL, UNROLL>(d, range, p, kc)
    } else {
        jsd_grad_steps::<V, S, D, NORMAL, FEW_REGISTERS_UNROLL>(d, range, p, kc)
    }
}

/// [`jsd_grad_range`], `G` chunks at a time.
#[inline(always)]
fn jsd_grad_steps<V: F32x16, S: Load, D: JsdGradDest<S>, const NORMAL: bool, const G: usize>(
    d: &mut D,
    range: core::ops::Range<usize>,
    p: &JsdParams,
    (k, c): (f32, f32),
) {
    let kc = (V::splat(k), V::splat(c));
    let pairs = range.start + (range.end - range.start) / G * G;
    let prefetch = software_prefetch();
    for i in (range.start..pairs).step_by(G) {
        let zv = load_chunks::<V, S, G>(&d.logits()[i..i + G], i, prefetch);
        let mut rv = [zv[0]; G];
        for (j, r) in rv.iter_mut().enumerate() {
            *r = d.ratios(i + j);
        }
        let g = jsd_grads::<V, G, NORMAL>(zv, rv, p, kc);
        d.put(i, g);
    }
    for i in pairs..range.end {
        let zv = [S::load(&d.logits()[i])];
        let g = jsd_grads::<V, 1, NORMAL>(zv, [d.ratios(i)], p, kc);
        d.put(i, g);
    }
}

/// The JSD's gradient `(p·((lp − lm) − K))·c` (grpo-core's `jsd_grad_step`) of `N` chunk pairs
/// at once from both rows: the one pass of the backward from saved states, every quantity of
/// [`jsd_parts`] (two exponentials and a logarithm per element) in its `NORMAL` form or the
/// reference's.
#[inline(always)]
fn jsd_saved_grads<V: F32x16, const N: usize, const M: usize, const NORMAL: bool>(
    z: [V; N],
    w: [V; N],
    p: &JsdParams,
    (k, c): (V, V),
) -> [V; N] {
    let (l, e, lm) = jsd_parts::<V, N, M, NORMAL>(z, w, p);
    let mut out = [k; N];
    for j in 0..N {
        out[j] = e[2 * j].mul(l[2 * j].sub(lm[j]).sub(k)).mul(c);
    }
    out
}

/// [`jsd_saved_grads`] of one element pair (lane 0): the unaligned head and the tail.
#[inline(always)]
fn jsd_saved_grad1<V: F32x16>(z: f32, w: f32, p: &JsdParams, (k, c): (f32, f32)) -> f32 {
    let kc = (V::splat(k), V::splat(c));
    let (z, w) = ([V::splat(z)], [V::splat(w)]);
    jsd_saved_grads::<V, 1, 2, false>(z, w, p, kc)[0].to_array()[0]
}

/// The saved-state JSD gradient's whole chunks into `d`, from the teacher's chunks `wc` (as
/// many): by blocks, each in [`jsd_parts`]' `NORMAL` form where [`jsd_saved_normal`] allows
/// it, [`JSD_PAIRS`] chunk pairs per iteration.
#[inline(always)]
fn jsd_saved_grad_chunks<V: F32x16, S: Load, U: Load, D: GradDest<S>>(
    d: &mut D,
    wc: &[[U; 16]],
    p: &JsdParams,
    (k, c): (f32, f32),
) {
    let n = d.logits().len().min(wc.len());
    let kc = (V::splat(k), V::splat(c));
    for start in (0..n).step_by(BLOCK / 16) {
        let end = (start + BLOCK / 16).min(n);
        let (zb, wb) = (&d.logits()[start..end], &wc[start..end]);
        if jsd_saved_normal::<V, S, U>(zb, wb, p) {
            jsd_saved_grad_range::<V, S, U, D, true>(d, wc, start..end, p, kc);
        } else {
            jsd_saved_grad_range::<V, S, U, D, false>(d, wc, start..end, p, kc);
        }
    }
}

/// Whether [`jsd_parts`]' `NORMAL` form gives the reference's bits on these chunk pairs of rows
/// that were *not* validated (the backward from saved states takes the logits as they come):
/// every value finite ([`finite_extrema`]; a NaN or ±∞ goes to the reference's form, which
/// propagates it as grpo-core does) and every log-probability in `[EXP_NORMAL_MIN, 1]`, which
/// the rows' smallest and largest logits bound (rounding is monotone and τ > 0). On `[1, 88)`
/// too the `NORMAL` exponential equals the reference's, and the mixture of two probabilities
/// below e stays a normal float; a logit above its row's reference by more (not the rows the
/// state was saved from) takes the reference's form.
#[inline(always)]
fn jsd_saved_normal<V: F32x16, S: Load, U: Load>(
    zc: &[[S; 16]],
    wc: &[[U; 16]],
    p: &JsdParams,
) -> bool {
    if const { !V::SPECIALIZED_LOOPS } {
        return false;
    }
    let (Some((zmax, zlow)), Some((wmax, wlow))) =
        (finite_extrema::<V, S>(zc), finite_extrema::<V, U>(wc))
    else {
        return false;
    };
    let lp = fma1::<V>(zmax - p.lz.max, p.tau, p.lz.neg_ln_sum);
    let lq = fma1::<V>(wmax - p.lw.max, p.tau, p.lw.neg_ln_sum);
    jsd_normal_domain::<V>(zlow, wlow, p) && lp <= 1.0 && lq <= 1.0
}

/// The largest and smallest value of whole chunks if every value is finite (`x·0 = 0` for all
/// of them: NaN and ±∞ give NaN), else `None`; `None` for no chunk.
#[inline(always)]
fn finite_extrema<V: F32x16, S: Load>(chunks: &[[S; 16]]) -> Option<(f32, f32)> {
    let zero = V::splat(0.0);
    let (mut top, mut low, mut probe) =
        (V::splat(f32::NEG_INFINITY), V::splat(f32::INFINITY), zero);
    for c in chunks {
        let x = S::load::<V>(c);
        top = top.max(x);
        low = low.min(x);
        probe = probe.add(x.mul(zero));
    }
    let finite = !chunks.is_empty() && probe.to_array().iter().all(|&v| v == 0.0);
    finite.then(|| (top.reduce_max(), low.reduce_min()))
}

/// [`jsd_saved_grad_chunks`] over chunks `range`, [`JSD_PAIRS`] at a time.
#[inline(always)]
fn jsd_saved_grad_range<V: F32x16, S: Load, U: Load, D: GradDest<S>, const NORMAL: bool>(
    d: &mut D,
    wc: &[[U; 16]],
    range: core::ops::Range<usize>,
    p: &JsdParams,
    kc: (V, V),
) {
    const G: usize = JSD_PAIRS;
    let pairs = range.start + (range.end - range.start) / G * G;
    let prefetch = software_prefetch();
    for i in (range.start..pairs).step_by(G) {
        let zv = load_chunks::<V, S, G>(&d.logits()[i..i + G], i, prefetch);
        let wv = load_chunks::<V, U, G>(&wc[i..i + G], i, prefetch);
        let g = jsd_saved_grads::<V, G, { 2 * G }, NORMAL>(zv, wv, p, kc);
        d.put(i, g);
    }
    for i in pairs..range.end {
        let (zv, wv) = ([S::load(&d.logits()[i])], [U::load(&wc[i])]);
        let g = jsd_saved_grads::<V, 1, 2, NORMAL>(zv, wv, p, kc);
        d.put(i, g);
    }
}

/// Row states of a batch `[rows, vocab]` (`LseState::EMPTY` for `vocab = 0`).
pub(crate) struct LseRows<'a, S> {
    pub(crate) z: &'a [S],
    pub(crate) vocab: usize,
    pub(crate) tau: f32,
    /// Whether the states' `dot` (the entropy's sum) is computed ([`lse_row`]'s `DOT`).
    pub(crate) dot: bool,
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
            *o = if self.dot {
                lse_row::<V, S, true>(row, self.tau)
            } else {
                lse_row::<V, S, false>(row, self.tau)
            };
        }
    }
}

/// Pair states of two batches `[rows, vocab]` (student `z`, teacher `w`), with the sums
/// `need` asks for; run with [`PairRows::run_on`].
pub(crate) struct PairRows<'a, S, U> {
    pub(crate) z: &'a [S],
    pub(crate) w: &'a [U],
    pub(crate) vocab: usize,
    pub(crate) tau: f32,
    pub(crate) need: PairNeed,
    pub(crate) out: &'a mut [(PairState, PairFlags)],
}

impl<S: Load, U: Load> PairRows<'_, S, U> {
    /// Runs the pass on `target` with the kernel compiled for `need`'s sums. One kernel type
    /// per need, so every ISA entry function holds a single copy of the pair pass: five copies
    /// inlined into one entry function (a `match` inside the kernel) gave it a stack frame that
    /// overflowed a 2 MiB thread stack in an unoptimised build (grpo-cpu's doctests under
    /// qemu-aarch64, where every lane temporary gets its own slot).
    pub(crate) fn run_on(self, target: impl Into<arch::Target>) {
        let target = target.into();
        match self.need {
            PairNeed::Jsd => self.run_for::<{ PairNeed::Jsd.sums() }>(target),
            PairNeed::KlStudentTeacher => {
                self.run_for::<{ PairNeed::KlStudentTeacher.sums() }>(target)
            }
            PairNeed::KlTeacherStudent => {
                self.run_for::<{ PairNeed::KlTeacherStudent.sums() }>(target)
            }
            PairNeed::GradStudentTeacher => {
                self.run_for::<{ PairNeed::GradStudentTeacher.sums() }>(target)
            }
            PairNeed::GradTeacherStudent => {
                self.run_for::<{ PairNeed::GradTeacherStudent.sums() }>(target)
            }
            PairNeed::Saved => self.run_for::<{ PairNeed::Saved.sums() }>(target),
        }
    }

    fn run_for<const SUMS: u8>(self, target: arch::Target) {
        arch::run(target, PairRowsFor::<_, _, SUMS>(self))
    }
}

/// [`PairRows`] as the kernel for the sums `SUMS`.
struct PairRowsFor<'a, S, U, const SUMS: u8>(PairRows<'a, S, U>);

impl<S: Load, U: Load, const SUMS: u8> Kernel for PairRowsFor<'_, S, U, SUMS> {
    type Output = ();
    #[inline(always)]
    fn run<V: F32x16>(self) {
        let p = self.0;
        for (r, o) in p.out.iter_mut().enumerate() {
            let span = r * p.vocab..(r + 1) * p.vocab;
            let z = p.z.get(span.clone()).unwrap_or(&[]);
            let w = p.w.get(span).unwrap_or(&[]);
            *o = pair_row::<V, S, U, SUMS>(z, w, p.tau);
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
    const STORES_BF16: bool = S::IS_BF16;
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

/// JSD_β of a batch of row pairs, with each row's validation flags and its [`JsdState`]
/// (grpo-core's `jsd_rows_saved`). `jsd_rows` computes the states too and drops them: `K`
/// costs a multiply and an add per element pair of the ~65 vector operations, where a second
/// instantiation of the kernel without it would cost build time in every backend and storage
/// pair. Rows whose flags or maxima are invalid get `NaN` (the caller
/// then defers to grpo-core for the error).
pub(crate) struct JsdRows<'a, S, U> {
    pub(crate) z: &'a [S],
    pub(crate) w: &'a [U],
    pub(crate) vocab: usize,
    pub(crate) tau: f32,
    pub(crate) beta: f32,
    pub(crate) out: &'a mut [(f32, PairFlags, JsdState)],
}

impl<S: Load, U: Load> Kernel for JsdRows<'_, S, U> {
    type Output = ();
    #[inline(always)]
    fn run<V: F32x16>(self) {
        for (r, o) in self.out.iter_mut().enumerate() {
            let span = r * self.vocab..(r + 1) * self.vocab;
            let z = self.z.get(span.clone()).unwrap_or(&[]);
            let w = self.w.get(span).unwrap_or(&[]);
            let (pair, flags) = pair_row::<V, S, U, { PairNeed::Jsd.sums() }>(z, w, self.tau);
            *o = if pair_ok(&pair, self.tau) {
                let p = JsdParams::of(&pair, self.tau, self.beta);
                let (value, kl_pm) = jsd_sum::<V, S, U>(z, w, &p);
                (value, flags, JsdState::of(&p, kl_pm))
            } else {
                (f32::NAN, flags, JsdState::EMPTY)
            };
        }
    }
}

/// The JSD's gradient of a batch of validated row pairs (grpo-core's `jsd_backward_rows`),
/// from each row's [`JsdParams`] and weight ([`jsd_grad_into`]).
pub(crate) struct JsdGradRows<'a, S, U> {
    pub(crate) z: &'a [S],
    pub(crate) w: &'a [U],
    pub(crate) vocab: usize,
    pub(crate) params: &'a [JsdParams],
    pub(crate) grad: &'a [f32],
    pub(crate) out: &'a mut [f32],
}

impl<S: Load, U: Load> Kernel for JsdGradRows<'_, S, U> {
    type Output = ();
    #[inline(always)]
    fn run<V: F32x16>(self) {
        if self.vocab == 0 {
            return;
        }
        let rows = self.out.chunks_exact_mut(self.vocab);
        for (r, ((o, p), &g)) in rows.zip(self.params).zip(self.grad).enumerate() {
            let span = r * self.vocab..(r + 1) * self.vocab;
            let z = self.z.get(span.clone()).unwrap_or(&[]);
            let w = self.w.get(span).unwrap_or(&[]);
            jsd_grad_into::<V, S, U>(z, w, p, g, o);
        }
    }
}

/// [`JsdGradRows`] writing over the student logits (rounded to their storage type), with one
/// row of `f32` scratch for the log-ratios.
pub(crate) struct JsdGradRowsInPlace<'a, S, U> {
    pub(crate) z: &'a mut [S],
    pub(crate) w: &'a [U],
    pub(crate) vocab: usize,
    pub(crate) params: &'a [JsdParams],
    pub(crate) grad: &'a [f32],
}

impl<S: Load, U: Load> Kernel for JsdGradRowsInPlace<'_, S, U> {
    type Output = ();
    const STORES_BF16: bool = S::IS_BF16;
    #[inline(always)]
    fn run<V: F32x16>(self) {
        if self.vocab == 0 {
            return;
        }
        let mut scratch = vec![0.0f32; self.vocab];
        let rows = self.z.chunks_exact_mut(self.vocab);
        for (r, ((z, p), &g)) in rows.zip(self.params).zip(self.grad).enumerate() {
            let w = self
                .w
                .get(r * self.vocab..(r + 1) * self.vocab)
                .unwrap_or(&[]);
            jsd_grad_over::<V, S, U>(z, w, p, g, &mut scratch);
        }
    }
}

/// Where the JSD's gradient from saved states goes: an `f32` buffer, or over the student
/// logits (rounded to their storage type).
pub(crate) enum JsdSavedDest<'a, S> {
    Into { z: &'a [S], out: &'a mut [f32] },
    Over(&'a mut [S]),
}

/// The JSD's gradient of a batch of row pairs from the constants their saved states give
/// (grpo-core's `jsd_backward_rows_saved` / `jsd_backward_rows_in_place_saved`: per row
/// `(JsdParams, K, c)` of `JsdState::grad_params`), one pass over each row pair: out of
/// place a scalar head up to 64-byte alignment of the output, the whole chunks (streaming
/// stores on AVX-512, [`GradInto`]) and the tail; in place the whole chunks ([`GradOver`])
/// and the tail. Every element is independent, so the split changes no bit.
pub(crate) struct JsdSavedGradRows<'a, S, U> {
    pub(crate) dest: JsdSavedDest<'a, S>,
    pub(crate) w: &'a [U],
    pub(crate) vocab: usize,
    pub(crate) params: &'a [(JsdParams, f32, f32)],
}

impl<S: Load, U: Load> Kernel for JsdSavedGradRows<'_, S, U> {
    type Output = ();
    const STORES_BF16: bool = S::IS_BF16;
    #[inline(always)]
    fn run<V: F32x16>(self) {
        let v = self.vocab;
        if v == 0 {
            return;
        }
        match self.dest {
            JsdSavedDest::Into { z, out } => {
                let rows = out.chunks_exact_mut(v).zip(self.params);
                for (r, (o, &(p, k, c))) in rows.enumerate() {
                    let span = r * v..(r + 1) * v;
                    let z = z.get(span.clone()).unwrap_or(&[]);
                    let w = self.w.get(span).unwrap_or(&[]);
                    let n = z.len().min(w.len()).min(o.len());
                    let (z, w, o) = (&z[..n], &w[..n], &mut o[..n]);
                    let head = o.as_ptr().align_offset(64).min(n);
                    for i in 0..head {
                        o[i] = jsd_saved_grad1::<V>(z[i].to_f32(), w[i].to_f32(), &p, (k, c));
                    }
                    let (zc, _) = z[head..].as_chunks::<16>();
                    let (wc, _) = w[head..].as_chunks::<16>();
                    let (oc, _) = o[head..].as_chunks_mut::<16>();
                    let done = head + zc.len() * 16;
                    let mut d = GradInto { z: zc, out: oc };
                    jsd_saved_grad_chunks::<V, S, U, _>(&mut d, wc, &p, (k, c));
                    for i in done..n {
                        o[i] = jsd_saved_grad1::<V>(z[i].to_f32(), w[i].to_f32(), &p, (k, c));
                    }
                }
            }
            JsdSavedDest::Over(z) => {
                let rows = z.chunks_exact_mut(v).zip(self.params);
                for (r, (z, &(p, k, c))) in rows.enumerate() {
                    let w = self.w.get(r * v..(r + 1) * v).unwrap_or(&[]);
                    let n = z.len().min(w.len());
                    let (zc, zt) = z[..n].as_chunks_mut::<16>();
                    let (wc, wt) = w[..n].as_chunks::<16>();
                    jsd_saved_grad_chunks::<V, S, U, _>(&mut GradOver(zc), wc, &p, (k, c));
                    for (x, y) in zt.iter_mut().zip(wt) {
                        let g = jsd_saved_grad1::<V>(x.to_f32(), y.to_f32(), &p, (k, c));
                        *x = S::from_f32(g);
                    }
                }
            }
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
        canon::lse_row(z, tau)
    }

    fn ref_pair(z: &[f32], w: &[f32], tau: f32) -> PairState {
        canon::pair_row(z, w, tau)
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

    /// Rounds every chunk of `x` to bf16 and f16 with the kernels' `store_grad`.
    struct StoreGrads<'a>(&'a [[f32; 16]]);

    impl Kernel for StoreGrads<'_> {
        type Output = (Vec<u16>, Vec<u16>);
        const STORES_BF16: bool = true;
        #[inline(always)]
        fn run<V: F32x16>(self) -> Self::Output {
            let (mut b, mut h) = (Vec::new(), Vec::new());
            for c in self.0 {
                let mut bc = [half::bf16::ZERO; 16];
                let mut hc = [half::f16::ZERO; 16];
                <half::bf16 as Load>::store_grad(V::load(c), &mut bc);
                <half::f16 as Load>::store_grad(V::load(c), &mut hc);
                b.extend(bc.map(half::bf16::to_bits));
                h.extend(hc.map(half::f16::to_bits));
            }
            (b, h)
        }
    }

    /// The vector roundings of gradients to bf16 and f16 (in-place backward) equal `half`'s
    /// scalar `from_f32` on every backend: every 251st f32 bit pattern, every bf16 value with
    /// the dropped half just below, at and above a tie, every f16 value with the 13 dropped
    /// bits at and around a tie, f16 subnormal ties, the f16 overflow threshold, ±∞ and NaNs
    /// with payloads (quiet, signalling, payload only in the dropped bits).
    #[test]
    fn half_precision_gradient_stores_round_as_half_does() {
        let mut xs: Vec<u32> = (0..=u32::MAX).step_by(251).collect();
        for h in 0..=u16::MAX as u32 {
            let b = h << 16;
            xs.extend([b, b | 0x7fff, b | 0x8000, b | 0x8001, b | 0xffff]);
            let f = half::f16::from_bits(h as u16).to_f32().to_bits();
            xs.extend([f, f + 0x0fff, f + 0x1000, f + 0x1001, f.wrapping_sub(1)]);
        }
        for k in 0..1024u32 {
            // (2k + 1)·2⁻²⁵: halfway between the f16 subnormals k·2⁻²⁴ and (k + 1)·2⁻²⁴.
            let mid = (2 * k + 1) as f32 * 2f32.powi(-25);
            xs.extend([mid.to_bits(), (-mid).to_bits()]);
        }
        let specials = [
            65504.0f32,
            65519.99,
            65520.0,
            65536.0,
            f32::MAX,
            f32::INFINITY,
        ];
        xs.extend(specials.iter().flat_map(|x| [x.to_bits(), (-x).to_bits()]));
        xs.extend([
            0x7f80_0001,
            0xffc0_1234,
            0x7fbf_ffff,
            0xff80_1fff,
            0x7fc0_0000,
            1,
            0x8000_0001,
        ]);
        xs.resize(xs.len().div_ceil(16) * 16, 0);
        let x: Vec<f32> = xs.iter().map(|&b| f32::from_bits(b)).collect();
        let chunks = x.as_chunks::<16>().0;
        let check = |name: &str, (bf, hf): (Vec<u16>, Vec<u16>)| {
            for (i, &v) in x.iter().enumerate() {
                let (wb, wh) = (half::bf16::from_f32(v), half::f16::from_f32(v));
                assert_eq!(bf[i], wb.to_bits(), "{name} bf16 of {:#010x}", xs[i]);
                assert_eq!(hf[i], wh.to_bits(), "{name} f16 of {:#010x}", xs[i]);
            }
        };
        for b in Backend::available() {
            check(&format!("{b:?}"), run(b, StoreGrads(chunks)));
        }
        // Where the CPU has AVX512_BF16, `Backend::Avx512` ran `vcvtneps2bf16` above (with the
        // integer rounding for vectors holding a subnormal, e.g. the chunks of `h << 16` for
        // small `h` beside normal f16 values); AVX-512's integer rounding must hold there too.
        #[cfg(target_arch = "x86_64")]
        if let Ok(out) = arch::avx512::run_without_bf16(StoreGrads(chunks)) {
            check("Avx512 (integer rounding)", out);
        }
    }

    #[test]
    fn lse_and_pair_rows_match_reference() {
        for &n in LENS {
            for tau in [1.0f32, 1.0 / 0.7, 0.5] {
                let z = logits(n as u64 + 1, n);
                let w = logits(n as u64 + 1000, n);
                let want = ref_lse(&z, tau);
                let want_p = ref_pair(&z, &w, tau);
                for b in arch::targets() {
                    for dot in [true, false] {
                        let mut out = [LseState::EMPTY];
                        run(
                            b,
                            LseRows {
                                z: &z,
                                vocab: n,
                                tau,
                                dot,
                                out: &mut out,
                            },
                        );
                        // Without `dot` the state's `dot` is unspecified: compare the rest.
                        let keep = |s: &LseState| {
                            let x = bits_lse(s);
                            [x[0], x[1], if dot { x[2] } else { 0 }]
                        };
                        assert_eq!(keep(&out[0]), keep(&want), "{b:?} n={n} tau={tau} {dot}");
                    }
                    let (f, r) = (0..n).fold((false, false), |(f, r), i| {
                        let (mz, mw) = (z[i] == f32::NEG_INFINITY, w[i] == f32::NEG_INFINITY);
                        (f | (mw & !mz), r | (mz & !mw))
                    });
                    for need in PairNeed::ALL {
                        let mut out = [(PairState::EMPTY, PairFlags::default())];
                        PairRows {
                            z: &z,
                            w: &w,
                            vocab: n,
                            tau,
                            need,
                            out: &mut out,
                        }
                        .run_on(b);
                        // The sums `need` leaves out are unspecified: compare the rest.
                        let [tz, tw, u, v] = need.computes();
                        let masked = |s: &PairState| {
                            let mut x = bits_pair(s);
                            for (i, keep) in [(2, tz), (5, tw), (6, u), (7, v)] {
                                if !keep {
                                    x[i] = 0;
                                }
                            }
                            x
                        };
                        assert_eq!(
                            masked(&out[0].0),
                            masked(&want_p),
                            "{b:?} pair n={n} tau={tau} {need:?}"
                        );
                        assert_eq!(
                            out[0].1,
                            PairFlags {
                                pq_infinite: f,
                                qp_infinite: r
                            }
                        );
                    }
                }
            }
        }
    }

    /// Same bits, or both NaN.
    fn same(a: u32, b: u32) -> bool {
        a == b || (f32::from_bits(a).is_nan() && f32::from_bits(b).is_nan())
    }

    /// Every backend's `LseRows` and `PairRows` (every `PairNeed`, the sums it computes) on
    /// each `(student, teacher)` row pair as one row, at τ = 1 and 0.75, bit for bit against
    /// grpo-core (NaN as "both NaN"), and the pair's support flags against a direct count.
    fn rows_match_reference(cases: &[(Vec<f32>, Vec<f32>)]) {
        let ninf = f32::NEG_INFINITY;
        for (z, w) in cases {
            let n = z.len();
            let flags = PairFlags {
                pq_infinite: z.iter().zip(w).any(|(&a, &b)| b == ninf && a != ninf),
                qp_infinite: z.iter().zip(w).any(|(&a, &b)| a == ninf && b != ninf),
            };
            for tau in [1.0f32, 0.75] {
                let want = bits_lse(&ref_lse(z, tau));
                let want_p = bits_pair(&ref_pair(z, w, tau));
                for b in arch::targets() {
                    for dot in [true, false] {
                        let mut out = [LseState::EMPTY];
                        run(
                            b,
                            LseRows {
                                z,
                                vocab: n,
                                tau,
                                dot,
                                out: &mut out,
                            },
                        );
                        let got = bits_lse(&out[0]);
                        // Without `dot` the state's `dot` is unspecified.
                        for i in 0..if dot { 3 } else { 2 } {
                            assert!(
                                same(got[i], want[i]),
                                "{b:?} lse {i} dot={dot}: {got:x?} {want:x?}"
                            );
                        }
                    }
                    for need in PairNeed::ALL {
                        let mut out = [(PairState::EMPTY, PairFlags::default())];
                        PairRows {
                            z,
                            w,
                            vocab: n,
                            tau,
                            need,
                            out: &mut out,
                        }
                        .run_on(b);
                        let got = bits_pair(&out[0].0);
                        let [tz, tw, u, v] = need.computes();
                        let keep = [true, true, tz, true, true, tw, u, v];
                        for i in 0..8 {
                            assert!(
                                !keep[i] || same(got[i], want_p[i]),
                                "{b:?} {need:?} tau={tau} field {i}: {got:x?} {want_p:x?}"
                            );
                        }
                        assert_eq!(out[0].1, flags, "{b:?} {need:?} tau={tau}");
                    }
                }
            }
        }
    }

    /// The fast paths' exits (`NORMAL = true` steps of `lse_block` and `pair_block`): blocks
    /// that leave the exponent-add domain must run with the reference scaling. Arguments in
    /// [D_MIN, −86) give subnormal exponentials that the exponent-add would mis-encode —
    /// invisible in `sum` ≥ 1 but not in the sums of tiny products (`dot`, `tz`, `u`, `v`)
    /// when every other element is the maximum, in either row of a pair; and NaN logits with
    /// payloads that the exponent-add turns into numbers (0x7fc0_0001 + 1 << 23 is a negative
    /// subnormal) must still give NaN sums.
    #[test]
    fn fast_paths_fall_back_outside_their_domain() {
        let n = 2 * 2048 + 40;
        let mut cases: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
        for tail in [-87.5f32, -86.5, -87.9, f32::NEG_INFINITY] {
            let mut z = vec![tail; n];
            let mut w = vec![tail * 0.5; n];
            for i in (0..n).step_by(1000) {
                z[i] = 0.0;
                w[i + 1] = 0.25;
            }
            cases.push((z.clone(), w.clone()));
            cases.push((w, z));
        }
        // One row inside the domain, the other outside, maxima at the same positions: the
        // log-ratio sums `u`, `v` are then sums of tiny products only.
        let (mut z, mut w) = (vec![-80.0f32; n], vec![-87.5f32; n]);
        for i in (0..n).step_by(1000) {
            (z[i], w[i]) = (0.0, 0.0);
        }
        cases.push((z.clone(), w.clone()));
        cases.push((w, z));
        for nan in [0x7fc0_0001u32, 0x7f80_0001, 0xffc0_00ff, 0x7fc0_0000] {
            let mut z: Vec<f32> = (0..n).map(|i| (i % 13) as f32 - 6.0).collect();
            let w: Vec<f32> = (0..n).map(|i| (i % 11) as f32 - 5.0).collect();
            z[2048 + 17] = f32::from_bits(nan);
            cases.push((z.clone(), w.clone()));
            cases.push((w, z));
        }
        rows_match_reference(&cases);
    }

    /// Rows whose blocks exercise every branch of the running-maximum reference
    /// (`canon::block_reference`): a later block's maximum within the slack above the running
    /// maximum (one pass kept), beyond it (stepped again with its own maximum), below it,
    /// all-masked first and later blocks, masked logits that switch the exponent-add off and
    /// on again between blocks, a jump seen only in a row's tail, NaN and +∞ in later blocks,
    /// and student/teacher rows that pick differently. Every backend, τ = 1 and 0.75, every
    /// `PairNeed`, against grpo-core's bits; the pair's support flags against a direct count.
    #[test]
    fn running_reference_paths_match_reference() {
        const B: usize = 2048;
        let ninf = f32::NEG_INFINITY;
        // Each block: values (i mod 13 − 12)·0.5 + top, so its maximum is `top`.
        let row = |tops: &[f32], tail: usize| -> Vec<f32> {
            let mut z = Vec::new();
            for (j, &top) in tops.iter().enumerate() {
                let len = if j + 1 == tops.len() { tail.max(1) } else { B };
                z.extend((0..len).map(|i| ((i % 13) as f32 - 12.0) * 0.5 + top));
            }
            z
        };
        let mut rows: Vec<Vec<f32>> = vec![
            row(&[0.0, 7.9, 15.8, 23.7], B),
            row(&[0.0, 8.5, 17.0, 3.0], B),
            row(&[0.0, 20.0, 5.0, 40.0, 39.0], 1000),
            row(&[0.0, -30.0, 0.5, 6.0], 37),
            row(&[-3.0, 10.0, 10.0], B),
        ];
        // All-masked first block, all-masked later block.
        let mut z = row(&[0.0, 1.0, 2.0], B);
        z[..B].fill(ninf);
        rows.push(z);
        let mut z = row(&[0.0, 1.0, 2.0, 1.0], 100);
        z[B..2 * B].fill(ninf);
        rows.push(z);
        // Masked logits in block 1 only (the exponent-add off for block 1, back on later), and
        // in blocks 1 and 2 (off for two blocks).
        let mut z = row(&[0.0, 1.0, 2.0, 3.0], B);
        z[B + 5] = ninf;
        rows.push(z.clone());
        z[2 * B + 700] = ninf;
        rows.push(z);
        // Arguments below the exponent-add's domain in a later block only: flushed to 0
        // (−90), and in [−88, −86), where the exponent-add's bits are wrong but no NaN shows.
        for low in [-90.0f32, -87.5, -86.5] {
            let mut z = row(&[0.0, 1.0, 0.5], B);
            z[B + 9] = low;
            rows.push(z);
        }
        // A jump beyond the slack only in the last block's tail (the 3 elements after its
        // whole chunks).
        let mut z = row(&[0.0, 1.0, 0.5], 35);
        z[2 * B + 33] = 30.0;
        rows.push(z);
        // A masked logit only in a tail (support flags from the tail).
        let mut z = row(&[0.0, 1.0, 0.5], 35);
        z[2 * B + 34] = ninf;
        rows.push(z);
        // NaN and +∞ in a later block, after blocks that ran the exponent-add and after ones
        // that did not.
        for bad in [f32::NAN, f32::from_bits(0x7fc0_0001), f32::INFINITY] {
            let mut z = row(&[0.0, 1.0, 2.0], B);
            z[2 * B + 3] = bad;
            rows.push(z.clone());
            z[B + 5] = ninf;
            rows.push(z);
        }
        let mut cases = Vec::new();
        for z in &rows {
            // The teacher: the same row, one shifted so that its maxima pick differently,
            // and a plain one.
            let w1: Vec<f32> = z.iter().map(|&x| x * 0.5).collect();
            let w2: Vec<f32> = (0..z.len()).map(|i| (i % 11) as f32 - 5.0).collect();
            cases.push((z.clone(), z.clone()));
            cases.push((z.clone(), w1.clone()));
            cases.push((w1, z.clone()));
            cases.push((z.clone(), w2.clone()));
            cases.push((w2, z.clone()));
        }
        rows_match_reference(&cases);
    }

    /// One block of `z` (and `w`) after given running maxima, through the lane `lse_block`
    /// and `pair_block` (KL(p‖q) sums), with the exponent-add hint `fast` on entry.
    struct OneBlock<'a> {
        z: &'a [f32],
        w: &'a [f32],
        tau: f32,
        prior: [f32; 2],
        fast: bool,
    }

    impl Kernel for OneBlock<'_> {
        type Output = ((LseState, f32), (PairState, [f32; 2]));
        #[inline(always)]
        fn run<V: F32x16>(self) -> Self::Output {
            let mut fast = self.fast;
            let lse = lse_block::<V, f32, true>(self.z, self.tau, self.prior[0], &mut fast);
            let mut fast = self.fast;
            let mut flags = PairFlags::default();
            let pair = pair_block::<V, f32, f32, { PairNeed::GradStudentTeacher.sums() }>(
                self.z, self.w, self.tau, self.prior, &mut fast, &mut flags,
            );
            (lse, pair)
        }
    }

    /// Single blocks whose sums are made only of the values the one-pass step has to get
    /// right without knowing the block's minimum first: every argument in [−88, −86) below a
    /// running maximum within the slack (subnormal exponentials, which the exponent-add gets
    /// wrong without a NaN), masked and NaN logits, each with the exponent-add hint on and
    /// off. Block states and running maxima bit for bit against grpo-core's.
    #[test]
    fn one_pass_blocks_match_reference() {
        let n = 2048;
        let mut blocks: Vec<Vec<f32>> = Vec::new();
        for low in [-87.9f32, -87.5, -86.5, -86.0, -90.0] {
            blocks.push((0..n).map(|i| low + (i % 5) as f32 * 0.01).collect());
        }
        let mut z: Vec<f32> = (0..n).map(|i| -87.5 + (i % 3) as f32 * 0.1).collect();
        z[100] = f32::NEG_INFINITY;
        blocks.push(z.clone());
        z[7] = f32::from_bits(0x7fc0_0001);
        blocks.push(z);
        let mut z: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 0.5 - 6.0).collect();
        z[5] = f32::from_bits(0xffc0_00ff);
        blocks.push(z);
        for z in &blocks {
            for w in [z.clone(), z.iter().map(|&x| x * 0.5 - 2.0).collect()] {
                for (tau, prior) in [(1.0f32, [0.0f32, -1.0]), (0.75, [1.0, 0.5])] {
                    let (want_l, run_l) = canon::lse_block(z, tau, prior[0]);
                    let (want_p, run_p) = canon::pair_block(z, &w, tau, prior);
                    for b in arch::targets() {
                        for fast in [true, false] {
                            let (lse, pair) = run(
                                b,
                                OneBlock {
                                    z,
                                    w: &w,
                                    tau,
                                    prior,
                                    fast,
                                },
                            );
                            let (got, want) = (bits_lse(&lse.0), bits_lse(&want_l));
                            for i in 0..3 {
                                assert!(
                                    same(got[i], want[i]),
                                    "{b:?} {fast} lse {i}: {got:x?} {want:x?}"
                                );
                            }
                            assert!(same(lse.1.to_bits(), run_l.to_bits()));
                            let (got, want) = (bits_pair(&pair.0), bits_pair(&want_p));
                            for i in [0, 1, 2, 3, 4, 6] {
                                assert!(
                                    same(got[i], want[i]),
                                    "{b:?} {fast} pair {i}: {got:x?} {want:x?}"
                                );
                            }
                            for k in 0..2 {
                                assert!(same(pair.1[k].to_bits(), run_p[k].to_bits()));
                            }
                        }
                    }
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
            // τ = 1 takes the step without the `·τ` (`grad_row_chunks`' other arm).
            for (kl, tau) in [KlGrad::None, KlGrad::StudentTeacher, KlGrad::TeacherStudent]
                .into_iter()
                .flat_map(|kl| [(kl, 1.0 / 0.7), (kl, 1.0)])
            {
                let c = GradCoef {
                    tau,
                    p: canon::LogSoftmax {
                        max: 14.5,
                        neg_ln_sum: -3.25,
                    },
                    h: 2.25,
                    g_lp: 0.75,
                    g_h: -0.3,
                    g_kl: if kl == KlGrad::None { 0.0 } else { 0.1 },
                    q: canon::LogSoftmax {
                        max: 13.0,
                        neg_ln_sum: -4.5,
                    },
                    kl: 0.05,
                };
                let want: Vec<u32> = (0..n)
                    .map(|v| canon::grad_step(z[v], w[v], v == y, &c, kl).to_bits())
                    .collect();
                for b in arch::targets() {
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
                    assert_eq!(got, want, "{b:?} n={n} {kl:?} τ={tau}");
                    let mut over = z.clone();
                    run(
                        b,
                        GradRowsInPlace::<f32, f32> {
                            z: &mut over,
                            w: &w,
                            y: Some(&[y]),
                            coef: &[c],
                            kl,
                            vocab: n,
                        },
                    );
                    let got: Vec<u32> = over.iter().map(|x| x.to_bits()).collect();
                    assert_eq!(got, want, "in place: {b:?} n={n} {kl:?} τ={tau}");
                }
            }
        }
    }
}
