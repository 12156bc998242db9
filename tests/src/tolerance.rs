//! The one tolerance table of the GPU backend (libm `precision.rs` style): for each operation and
//! storage type, how far a grpo-wgpu result may be from its reference, and why.
//!
//! Two kinds of reference exist. Scalar group/token math (advantages, losses) is compared with
//! grpo-core in f32 in ULP: both evaluate the same formula in the same order, and WGSL rounds
//! `+ − ×` correctly, so the distance comes only from the operations WGSL does *not* round
//! correctly (÷ 2.5 ULP, sqrt, exp 3+2|x| ULP, log 3 ULP or 2^-21 absolute, pow as exp2∘log2) and
//! from cancellation downstream of them. Vocabulary kernels are compared with an f64 evaluation of
//! the formula on the *stored* values (f16/bf16 widen exactly), which is MATH.md §5's contract.

/// An allowed distance: `|got − want| ≤ abs + rel·|want|`, or within `ulp` f32 ULPs of `want`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tol {
    /// ULP distance in f32 that is always accepted.
    pub ulp: u32,
    /// Absolute slack.
    pub abs: f64,
    /// Relative slack.
    pub rel: f64,
}

impl Tol {
    const fn ulp(ulp: u32) -> Tol {
        Tol {
            ulp,
            abs: 0.0,
            rel: 0.0,
        }
    }

    /// Whether `got` is within this tolerance of `want`. NaN never passes; equal infinities do.
    pub fn accepts(&self, got: f32, want: f64) -> bool {
        if got.is_nan() || want.is_nan() {
            return false;
        }
        if got as f64 == want {
            return true;
        }
        if ulp_distance(got, want as f32) <= self.ulp as u64 {
            return true;
        }
        (got as f64 - want).abs() <= self.abs + self.rel * want.abs()
    }

    /// The same tolerance with `extra` more ULPs.
    pub fn plus_ulp(mut self, extra: u32) -> Tol {
        self.ulp += extra;
        self
    }

    /// The same tolerance with `abs` scaled (for errors proportional to an input's magnitude).
    pub fn with_abs(mut self, abs: f64) -> Tol {
        self.abs = abs;
        self
    }
}

/// Distance in representable f32 values (0 for +0 vs −0; `u64::MAX` when either is NaN).
pub fn ulp_distance(a: f32, b: f32) -> u64 {
    if a.is_nan() || b.is_nan() {
        return u64::MAX;
    }
    fn key(x: f32) -> i64 {
        let b = x.to_bits() as i32 as i64;
        if b < 0 { i32::MIN as i64 - b } else { b }
    }
    (key(a) - key(b)).unsigned_abs()
}

/// Storage type of the inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    /// f32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
}

/// Operations with a tolerance entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// log-sum-exp of a row, vs f64.
    Lse,
    /// logp(target), vs f64.
    Logp,
    /// Entropy of a row, vs f64.
    Entropy,
    /// KL between two rows, vs f64.
    Kl,
    /// JSD_β between two rows, vs grpo-core's `jsd_rows` (f32).
    Jsd,
    /// Fused backward gradient, vs f64 (abs scaled by the upstream gradients and 1/T).
    VocabGrad,
    /// The JSD's gradient, vs grpo-core's `jsd_backward_rows` (f32; abs scaled per element by
    /// |g|(1 − β)/T·p_v·(1 + K + |log p_v − log m_v|)).
    JsdGrad,
    /// GRPO z-score family with γ ∈ {0, 1} (incl. Dr.GRPO, RLOO, batch-scaled), vs grpo-core f32.
    AdvZscore,
    /// z-score with a general γ (pow), vs grpo-core f32.
    AdvDialPow,
    /// GOPO ranks, vs grpo-core f32.
    AdvGopo,
    /// G²RPO Φ⁻¹ of mid-ranks, vs grpo-core.
    AdvG2rpo,
    /// GDPO (two z-score stages), vs grpo-core f32.
    AdvGdpo,
    /// Per-token loss value / gradient without exp (REINFORCE, k1, k2), vs grpo-core f32.
    LossAlgebraic,
    /// Per-token loss value / gradient through exp of a log-ratio (PPO-clip, CISPO, SAPO, k3…).
    LossExp,
    /// KL penalties K3Is (k3·ρ), k1+ and k3+ (straight-through), vs grpo-core f32.
    KlIsStraightThrough,
    /// Sequence-ratio losses (GSPO, GSPO-token): exp of a masked mean log-ratio, vs grpo-core f32.
    LossSeqRatio,
    /// Importance weights (token / sequence level, truncate / mask), vs grpo-core f32.
    IsWeights,
    /// Importance weights at the geometric-mean level (one WGSL division before exp).
    IsWeightsGeometric,
    /// Extra ULPs of a batch-normalised importance weight (÷ the mean of the GPU's weights).
    IsBatchNormalize,
    /// P3O's effective-sample-size sums Σw, Σw² (a reduction), vs grpo-core f32.
    EssSums,
    /// Aggregation of per-token losses (scalar and per-token weights), vs grpo-core f32.
    Aggregate,
    /// The k3 statistic e^r − 1 − r of a rollout rejection criterion, vs grpo-core f32: the band
    /// around a bound inside which a k3 keep/reject decision may differ.
    RejectionK3,
}

/// The tolerance of `op` on inputs stored as `dtype`.
pub fn tolerance(op: Op, dtype: Dtype) -> Tol {
    use Op::*;
    match (op, dtype) {
        // MATH.md §5 contract: |logp − ref| ≤ 2e-6 + 1e-6·|logp|, |H − ref| ≤ 1e-5 (V ≤ 262144).
        // The reference is f64 on the stored values and f16/bf16 widen to f32 exactly, so the
        // storage type changes nothing: the same bound holds for every dtype. lse shares logp's
        // bound (logp = (z_y − m) − ln s uses the same ln s).
        (Lse | Logp, _) => Tol {
            ulp: 0,
            abs: 2e-6,
            rel: 1e-6,
        },
        (Entropy, _) => Tol {
            ulp: 0,
            abs: 1e-5,
            rel: 0.0,
        },
        // KL = (ln S_q − ln S_p) + u/S_p (grpo-core's finish_kl, shifts to the final row maxima):
        // three terms of the entropy's accuracy. Measured on lavapipe: ≤ 5e-7 from grpo-core at
        // V = 151936 and 262144 (KL ≈ 1e-3 and 13–27).
        (Kl, _) => Tol {
            ulp: 0,
            abs: 3e-5,
            rel: 1e-5,
        },
        // JSD_β against grpo-core's f32 `jsd_rows` (not f64: grpo-core owns the definition, incl.
        // its clamp at 0 and its −88 floor of log p). Both sum non-negative per-column terms
        // weighted by p and q, so the distance is dominated by the two log-sum-exps' absolute
        // errors (each ≤ ~1e-6 at V ≤ 262144, Lse above), which shift every log p (or log q) and
        // move JSD by about that much times weights summing to ≤ 1; the GPU evaluates log m
        // relative to max(log p, log q), so exp's 3 + 2|x| ULP do not accumulate over identical
        // columns. Measured on lavapipe: max |gpu − grpo-core| = 9.2e-7 over 4548 random cases
        // of 1–3 row pairs per dtype (f32 8.3e-7, bf16 3.0e-7, f16 9.2e-7; V ≤ 5000, β ∈ (0, 1)
        // incl. 1e-6 and 1 − 2⁻²⁴, T ∈ {0.7, 1, 2}, −∞ entries, identical, perturbed and
        // independent pairs) and 6.6e-7 at V = 151936 and 262144 (JSD ≈ 0.69, where grpo-core
        // is within 1e-7 of f64 and the GPU 6.7e-7). Headroom ≈ 3× over the worst measured case.
        (Jsd, _) => Tol {
            ulp: 0,
            abs: 3e-6,
            rel: 0.0,
        },
        // Each p_v = exp(logp_v) carries exp's 3+2|x| ULP (≈ 2e-5 relative at |x| = 88 where
        // p_v underflows anyway) plus logp_v's absolute 2e-6; the caller multiplies `abs` by
        // (|g_lp| + |g_H|·(1 + H + |log p_min|))/T.
        (VocabGrad, _) => Tol {
            ulp: 0,
            abs: 4e-6,
            rel: 2e-5,
        },
        // c·p_v·((log p_v − log m_v) − K), c = g(1 − β)/T: p_v carries exp's relative error and
        // the log-sum-exps' absolute 1e-6 (relative in p_v), log p_v − log m_v is taken
        // relative to max(log p, log q) on the GPU and directly in grpo-core (a few ULP of
        // |log m_v| apart), and K = KL(p‖m) ≤ −ln(1 − β) is a sum like the JSD: each an error
        // of one factor, which the others scale. The caller allows `abs·c·p_v·(1 + K +
        // |log p_v − log m_v|) + rel·|grad_v|` (f64 p_v, K, log-ratio on the stored values),
        // plus the error of the GPU's scaling of the logits before their shift and 2^−126
        // (`jsd_grad_allowed` in tests/tests/wgpu_vocab.rs). Measured on lavapipe (the JSD's
        // random cases: V ≤ 5000, β incl. 1e-6 and 1 − 2⁻²⁴, T ∈ {0.7, 1, 2}; 3000 per dtype,
        // three runs): at most 0.45 (f32), 0.38 (bf16), 0.29 (f16) of that allowance; 0.14 at
        // V = 151936.
        (JsdGrad, _) => Tol {
            ulp: 0,
            abs: 4e-6,
            rel: 2e-5,
        },
        // Welford's mean update divides by n and sqrt/÷ are ≤ 2.5 ULP in WGSL: the output gets a
        // few ULP, plus the cancellation in s − μ: an error of ulp(μ) in μ becomes
        // ulp(max|s|)/(σ + ε) in A, which the caller adds as `abs` (see `zscore_abs`).
        (AdvZscore | AdvGdpo, _) => Tol::ulp(4),
        // pow(d, γ) is exp2(γ·log2 d) in WGSL: ~3+2|γ log2 d| ULP on top of AdvZscore.
        (AdvDialPow, _) => Tol {
            ulp: 16,
            abs: 0.0,
            rel: 4e-6,
        },
        // grpo-core rounds q = 4(rank − 1)/(G − 1) ∈ [0, 4], then 2 − q (exact for q ≥ 1, else
        // ½ ULP of the result); the shader computes 2(G + 1 − 2·rank)/(G − 1), an exact integer
        // over G − 1, with WGSL's ÷ (2.5 ULP), so that the middle rank is exactly 0 whatever
        // the driver fuses (advantage.wgsl, group_rank). The two differ by ≤ 3 ULP of the result
        // plus ½ ULP of q (≤ 2⁻²³ absolute, q < 4): ≤ 3.5 ULP for |A| ≥ 1 (there q ≤ 1 or
        // q ≥ 3, where ½ ULP of q is at most one ULP of A, and 2 − q is exact for q ≥ 1), and
        // for |A| < 1 (1 < q < 3: the subtraction is exact, ULP(A) ≤ 2⁻²⁴) at most
        // 2.5·2⁻²⁴ + 2⁻²³ < 2⁻²¹ absolute. Measured on NVIDIA H200 (Vulkan) with grpo-core's
        // literal form in the shader: 2 − 12/6 came out −2⁻²⁴ = 2 − 12·fl(1/6) (the division
        // as a reciprocal product, fused into the subtraction), which is why the shader no longer
        // uses it.
        (AdvGopo, _) => Tol {
            ulp: 4,
            abs: 1.0 / (1u64 << 21) as f64,
            rel: 0.0,
        },
        // The normal scores come from the host (grpo-core's f64 Φ⁻¹ rounded to f32), so an
        // untied rank is bit-identical; a tie block of t ranks is averaged in f32 here (t − 1
        // additions and a division) instead of f64: ≤ t/2 + 2.5 ULP of the result, relative to
        // the largest |score| summed (cancellation of mirrored scores), covered by `abs`.
        (AdvG2rpo, _) => Tol {
            ulp: 8,
            abs: 2e-6,
            rel: 0.0,
        },
        // Only + − × and one ÷: the 4 ULP budget of the GPU issue. `abs` = the smallest normal
        // f32: WGSL may flush a subnormal result (k1 = d, |d|, k2's gradient d at a subnormal
        // d = lp − ref) to zero, as in LossExp. Measured on lavapipe, which keeps subnormals
        // (GRPO_GPU_CASES=1000 per config: k1/abs/k2 × every preset and clamps 3/0.5, ≈ 12 000
        // valid tokens with a subnormal d): 0 ULP, values and gradients.
        (LossAlgebraic, _) => Tol {
            ulp: 4,
            abs: f32::MIN_POSITIVE as f64,
            rel: 0.0,
        },
        // Products/quotients of a few correctly rounded operations around exp: 8 ULP, *plus*
        // WGSL's exp allowance of 3 + 2|x| ULP for every exp the formula evaluates, which the
        // caller adds with `exp_ulps` (it depends on the token: |x| ≤ 20 after the verl clamp,
        // up to 88 without it — TRL). Measured on lavapipe: 53 ULP at x = 58.4, i.e. lavapipe
        // uses most of the allowance (exp2 of a rounded x·log2 e). `abs` = the smallest normal
        // f32: WGSL may flush subnormal results to zero (lavapipe does, e.g. SAPO's gradient at
        // 8.7e-39).
        (LossExp, _) => Tol {
            ulp: 8,
            abs: f32::MIN_POSITIVE as f64,
            rel: 0.0,
        },
        // LossExp's reasoning: 8 ULP of correctly rounded + − × around exp, plus exp's 3 + 2|x| ULP
        // per exp the formula evaluates, added by the caller with `exp_ulps` (k3+: e^{−d}; K3Is:
        // e^{−d} and ρ = e^x, d and x after the clamp/guard, |·| ≤ 43.36). k1+'s value and every
        // straight-through gradient (d itself) are the same f32 operations: bit-identical but for
        // WGSL flushing a subnormal d, which `abs` covers (the caller scales it by ρ for K3Is,
        // where a flushed k3 is multiplied by ρ). K3Is's gradient is one product with ρ (ρ·d,
        // or ρ·∂k3 / ρ·k3 where one input was limited — grpo-core and the shader both use the
        // exact ρ·d instead of the cancelling sum ρ·(∂k3 + k3)), so it takes the value's
        // tolerance. Measured on lavapipe (GRPO_GPU_CASES=2000 per config, 5 configs × 3
        // estimators: every preset, plus clamps 3/0.5): 0 ULP without exp; exp-based values
        // ≤ 48 ULP and at most exp's allowance − 1; K3Is gradients ≤ 33 ULP and at most the
        // allowance − 5. The 8-ULP base is the headroom.
        (KlIsStraightThrough, _) => Tol {
            ulp: 8,
            abs: f32::MIN_POSITIVE as f64,
            rel: 0.0,
        },
        // LossExp plus three WGSL divisions (x̄ = Σx/n; GSPO's mean of its tokens' terms when
        // they do not share an advantage; ∂L/∂s·s/n), each ≤ 2.5 ULP instead of correctly
        // rounded: 8 + 3·2.5 → 16. The sums themselves run in grpo-core's order (bit-identical).
        // x̄'s 2.5 ULP become 2.5|x̄| ULP of e^x̄, which the caller adds with `exp_ulps` (an
        // extra argument 1.25·x̄) on top of exp's own 3 + 2|x̄|. Where GSPO's terms have both
        // signs and cancel, the caller applies the budget to their magnitude instead.
        (LossSeqRatio, _) => Tol {
            ulp: 16,
            abs: f32::MIN_POSITIVE as f64,
            rel: 0.0,
        },
        // One exp of a log-weight that has grpo-core's bits (r_t, or Σ r_t summed in its order,
        // limited by the same comparisons), then a clamp or a mask that is exact: only exp's
        // allowance (3 + 2|l| ULP, added by the caller with `exp_ulps`) plus LossExp's margin.
        (IsWeights, _) => Tol {
            ulp: 8,
            abs: f32::MIN_POSITIVE as f64,
            rel: 0.0,
        },
        // IsWeights with the log-weight r̄ = Σr/n: Σr has grpo-core's bits (token order), the
        // division is WGSL's (≤ 2.5 ULP of r̄, grpo-core's is correctly rounded), i.e. ≤ 2.5|r̄|
        // ULP of e^{r̄}, which the caller adds with `exp_ulps` as an extra argument 1.25·r̄ next
        // to exp's own 3 + 2|r̄| (as LossSeqRatio), then the exact clamp/mask. Measured on
        // lavapipe (GRPO_GPU_CASES=1000: 10 unnormalised configs × packed, padded and
        // near-bound batches): ≤ 14 ULP, always ≥ 6 ULP inside the exp + ÷ allowance alone; the
        // 8-ULP base is IsWeights' margin.
        (IsWeightsGeometric, _) => Tol {
            ulp: 8,
            abs: f32::MIN_POSITIVE as f64,
            rel: 0.0,
        },
        // batch_normalize: w/m with m grpo-core's running mean of the GPU's weights in its order
        // and the division on the host (correctly rounded). m is a convex combination of weights
        // that each carry their own allowance, so w/m is within the weight's allowance plus the
        // largest weight allowance of the batch (the caller adds both), plus the roundings of
        // the running mean and the division, which this extra base covers. Measured on lavapipe
        // (GRPO_GPU_CASES=1000, 9 normalised configs × packed, padded and near-bound batches):
        // ≤ 59 ULP, always ≥ 4 ULP inside the two allowances without any base.
        (IsBatchNormalize, _) => Tol::ulp(8),
        // Σw and Σw² of positive terms, grpo-core in one flat token-order accumulator, the GPU per
        // sequence then over sequences: each order is within (n − 1)·2⁻²⁴ relative of the exact
        // sum, so they differ by ≤ 2(n − 1)·2⁻²⁴ ≈ 3e-5 for the test batches (n ≤ 200), plus
        // each w's exp error (3 + 2|x| ULP, ≤ 43 ULP ≈ 5e-6 under the ±20 clamp, ≤ 163 ULP
        // ≈ 2e-5 at |x| = 80 without it; twice that for w²): 1e-4 relative.
        (EssSums, _) => Tol {
            ulp: 0,
            abs: 0.0,
            rel: 1e-4,
        },
        // The weights are grpo-core's own f32 operations on counts (host), and the reduction
        // runs in grpo-core's order (per-sequence sums in token order, then the B products in
        // sequence order) with correctly rounded + and ×, the product stored before it is added
        // (no fused multiply-add): bit-identical.
        (Aggregate, _) => Tol::ulp(0),
        // k3 = e^r − 1 − r after the ±20 clamp (expm1_minus_x on both sides). For |r| < ½ both
        // run the same 16-term Taylor series in f32 (a fused multiply-add in a GPU Horner step
        // moves a rounding or two); for ½ ≤ |r| < 2 grpo-core takes libm's expm1(r) − r (≤ 1 ULP,
        // amplified ≤ 4.4× by the subtraction at r = ½) while the GPU keeps the series; beyond,
        // the GPU computes (e^r − 1) − r, whose exp error (3 + 2|r| ULP) the subtractions amplify
        // by e^r/(e^r − 1 − r) ≤ 1.69 (r ≥ 2; ≤ 0.12 for r ≤ −2): the caller adds
        // 2·`exp_ulps(&[r])` for |r| ≥ 2. `abs`: a flushed subnormal k3 (|r| ≲ 1.5e-19). The
        // k1 and k2 statistics need no entry: they are the same correctly rounded operations,
        // summed in grpo-core's order (bit-identical; only a flushed subnormal can differ).
        // Sequence aggregates widen the band as their inputs do: Σ of the token bands plus both
        // sums' rounding (2·count·2⁻²⁴ of the sum), ÷ count for a mean, the largest token band
        // for a maximum. Measured on lavapipe (k3 through the same WGSL function,
        // `LossKernel::kl_penalty` without clamps: a 200001-point sweep of r ∈ [−50, 50] plus
        // 50000 log-uniform |r| ∈ [1e-12, 50]): 0 ULP for |r| < ½, 4 ULP for ½ ≤ |r| < 2, 32 ULP
        // for |r| ≥ 2 and always ≥ 12 ULP inside twice exp's allowance; in the rejection tests
        // (GRPO_GPU_CASES=1000, 13000 cases) 370 of 6838 borderline tokens were decided
        // differently, their statistics all within 3 ULP (0.19 of the band) of the bound.
        (RejectionK3, _) => Tol {
            ulp: 16,
            abs: f32::MIN_POSITIVE as f64,
            rel: 0.0,
        },
    }
}

/// Extra absolute slack of a z-score computed as (s − μ)/d with d = (σ + ε)^γ: a last-bit
/// difference in μ moves s − μ by up to `ulp(max|s|)`, which the division amplifies by 1/d —
/// 2 ULPs of the largest |score| over the divisor (the caller passes d, the dial included).
/// Welford's update μ + δ/n differs in its last bit in two ways WGSL permits: ÷ is 2.5 ULP, and
/// a driver may fuse the product into the sum (one rounding instead of two). Measured on NVIDIA
/// H200 (Vulkan): the z-score of 0 in the group (−0.5, 0, 0.5) came out −1.5e-8 instead of 0,
/// i.e. a mean of 7.45e-9 = fma(0.75, fl(1/3), −0.25) (a division by reciprocal, fused into
/// Welford's update); and with γ = 0.727 A ≈ −0.21 differed by 2.3e-6 (158 ULP), about one ULP
/// of μ ≈ −3.7e5 over (σ + ε)^γ (0.031/12450 = 2.5e-6), beyond a slack computed with σ + ε.
pub fn zscore_abs(max_abs_score: f64, divisor: f64) -> f64 {
    let ulp = f32::EPSILON as f64 * max_abs_score.max(f32::MIN_POSITIVE as f64);
    2.0 * ulp / divisor
}

/// WGSL's accuracy allowance for exp, summed over the arguments of every exp a formula evaluates:
/// Σ (3 + 2·⌈|x|⌉) ULP (WGSL spec, "Floating Point Accuracy": exp is 3 + 2|x| ULP).
pub fn exp_ulps(args: &[f64]) -> u32 {
    args.iter()
        .map(|x| 3 + 2 * x.abs().ceil().min(200.0) as u32)
        .sum()
}

/// `x` with a subnormal value flushed to a zero of the same sign. The WGSL spec lets an
/// implementation flush subnormal inputs, intermediates and outputs to zero ("Floating Point
/// Accuracy"); NVIDIA's Vulkan driver flushes subnormal inputs (measured on NVIDIA H200: with
/// lp = 0 and a reference log-prob of −1e-45, Abs's gradient sign(lp − ref) came out 0, as for
/// a reference of −0). Oracles that accept such a device
/// compare with grpo-core on the *flushed inputs* as a second reference, rather than widening a
/// tolerance: exactly what the spec permits, and nothing more.
pub fn flush_subnormal(x: f32) -> f32 {
    if x.is_subnormal() {
        0.0f32.copysign(x)
    } else {
        x
    }
}
