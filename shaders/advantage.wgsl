// advantage.wgsl — group-relative advantage estimators (MATH.md §2), f32, the same per-element
// formulas as grpo-core.
//
// The host gathers each group's members contiguously (group g spans offsets[g]..offsets[g+1] of
// `scores` and `out`; for uniform and CSR layouts this is the caller's order) and validates the
// scores (finiteness, NaN policy, group sizes) before dispatch, so these kernels never see invalid
// data. Group statistics are Welford's update in member order, exactly grpo-core's
// `Moments::push` (the only operations WGSL does not round correctly are ÷ and sqrt).
//
// Entry points (run in this order within one submission, as the kind needs):
//   gdpo_sum      — GDPO: per group and reward, z_k; S_i = Σ_k w_k z_k → out
//   batch_moments — one invocation: Welford over the batch (scores, or out for GDPO) → bstats
//   group_stats   — z-score family / RLOO / batch-scaled → out
//   group_rank    — GOPO / G²RPO → out
//   finish        — GDPO: (S − μ_batch)/(σ_batch + ε) in place

const KIND_ZSCORE: u32 = 0u;
const KIND_RLOO: u32 = 1u;
const KIND_BATCH_SCALED: u32 = 2u;
const KIND_GOPO: u32 = 3u;
const KIND_G2RPO: u32 = 4u;
const KIND_GDPO: u32 = 5u;

const FLAG_UNBIASED: u32 = 1u;
// verl vectorized: σ = sqrt(max(var, ε)) before adding ε.
const FLAG_STD_FLOOR: u32 = 2u;
// TRL NaN policy: NaN scores are excluded from statistics and get advantage 0.
const FLAG_NAN_EXCLUDE: u32 = 4u;
// Ties share the average rank (else ordinal: earlier index ranks first).
const FLAG_TIE_AVERAGE: u32 = 8u;

const SINGLETON_ZERO: u32 = 0u;
const SINGLETON_VERL_LOOP: u32 = 1u;

struct AdvParams {
    groups: u32,
    n: u32,
    kind: u32,
    flags: u32,
    eps: f32,
    // The std-identity dial (s − μ)/(σ + ε)^γ: γ = 1 GRPO, γ = 0 Dr.GRPO.
    gamma: f32,
    singleton: u32,
    // GDPO: rewards per sample (scores is n × k, sample-major).
    k: u32,
}

@group(0) @binding(0) var<storage, read> scores: array<f32>;
@group(0) @binding(1) var<storage, read> offsets: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
// bstats: [batch mean, batch M2, batch count]; then per group [zero-variance, singleton] flags.
@group(0) @binding(3) var<storage, read_write> bstats: array<f32>;
@group(0) @binding(4) var<uniform> params: AdvParams;
@group(0) @binding(5) var<storage, read> weights: array<f32>;
@group(0) @binding(6) var<storage, read_write> diag: array<u32>;

struct Moments {
    n: u32,
    mean: f32,
    m2: f32,
}

// grpo_core::stats::Moments::push, operation for operation.
fn moments_push(a: Moments, x: f32) -> Moments {
    let n = a.n + 1u;
    let delta = x - a.mean;
    let mean = a.mean + delta / f32(n);
    return Moments(n, mean, a.m2 + delta * (x - mean));
}

fn excluded(x: f32) -> bool {
    return (params.flags & FLAG_NAN_EXCLUDE) != 0u && is_nan_bits(x);
}

// σ of a group with ≥ 2 members under the configured Bessel choice and floor.
fn group_sigma(m: Moments) -> f32 {
    var d = f32(m.n);
    if (params.flags & FLAG_UNBIASED) != 0u {
        d = f32(m.n - 1u);
    }
    let var_ = rmax(m.m2 / d, 0.0);
    if (params.flags & FLAG_STD_FLOOR) != 0u {
        return sqrt(rmax(var_, params.eps));
    }
    return sqrt(var_);
}

// (s − μ)/d^γ with the exact cases γ = 1 (GRPO) and γ = 0 (Dr.GRPO).
fn dial(centered: f32, d: f32) -> f32 {
    if params.gamma == 1.0 {
        return centered / d;
    }
    if params.gamma == 0.0 {
        return centered;
    }
    return centered / pow(d, params.gamma);
}

@compute @workgroup_size(64)
fn group_stats(@builtin(global_invocation_id) gid: vec3<u32>) {
    let g = gid.x;
    if g >= params.groups {
        return;
    }
    let lo = offsets[g];
    let hi = offsets[g + 1u];
    var m = Moments(0u, 0.0, 0.0);
    for (var i = lo; i < hi; i++) {
        let s = scores[i];
        if !excluded(s) {
            m = moments_push(m, s);
        }
    }
    var zero_var = 0u;
    var singleton = 0u;
    if m.n == 1u {
        singleton = 1u;
    } else if m.n >= 2u && m.m2 == 0.0 {
        zero_var = 1u;
    }
    for (var i = lo; i < hi; i++) {
        let s = scores[i];
        var a = 0.0;
        if !excluded(s) {
            if params.kind == KIND_ZSCORE {
                if m.n == 1u {
                    if params.singleton == SINGLETON_VERL_LOOP {
                        // verl loop: μ = 0, σ = 1.
                        a = dial(s, 1.0 + params.eps);
                    }
                } else {
                    a = dial(s - m.mean, group_sigma(m) + params.eps);
                }
            } else if params.kind == KIND_RLOO {
                if m.n == 1u {
                    if params.singleton == SINGLETON_VERL_LOOP {
                        a = s;
                    }
                } else {
                    // s_i − mean_{j≠i} s_j = (n/(n−1))(s_i − μ).
                    let nf = f32(m.n);
                    a = (nf / (nf - 1.0)) * (s - m.mean);
                }
            } else if params.kind == KIND_BATCH_SCALED {
                // TRL scale_rewards="batch": group mean, batch σ (bstats from batch_moments).
                a = (s - m.mean) / (bstats_sigma() + params.eps);
            }
        }
        out[i] = a;
    }
    diag[2u * g] = zero_var;
    diag[2u * g + 1u] = singleton;
}

fn bstats_sigma() -> f32 {
    let n = bstats[2];
    var d = n;
    if (params.flags & FLAG_UNBIASED) != 0u {
        d = n - 1.0;
    }
    if d <= 0.0 {
        return 0.0;
    }
    return sqrt(rmax(bstats[1] / d, 0.0));
}

// One invocation: the batch's moments, in index order (grpo-core's Moments::from_iter over the
// batch). Reads `out` for GDPO (the summed z-scores), `scores` otherwise.
@compute @workgroup_size(1)
fn batch_moments() {
    var m = Moments(0u, 0.0, 0.0);
    for (var i = 0u; i < params.n; i++) {
        if params.kind == KIND_GDPO {
            m = moments_push(m, out[i]);
        } else {
            let s = scores[i];
            if !excluded(s) {
                m = moments_push(m, s);
            }
        }
    }
    bstats[0] = m.mean;
    bstats[1] = m.m2;
    bstats[2] = f32(m.n);
}

// GDPO [2601.05242] stage 1: z_k = (r_k − μ_{k,g})/(σ_{k,g} + ε) per reward (NaN → 0 first),
// S = Σ_k w_k z_k. A group of one has no σ: its z is 0.
@compute @workgroup_size(64)
fn gdpo_sum(@builtin(global_invocation_id) gid: vec3<u32>) {
    let g = gid.x;
    if g >= params.groups {
        return;
    }
    let lo = offsets[g];
    let hi = offsets[g + 1u];
    let k = params.k;
    for (var i = lo; i < hi; i++) {
        out[i] = 0.0;
    }
    for (var r = 0u; r < k; r++) {
        var m = Moments(0u, 0.0, 0.0);
        for (var i = lo; i < hi; i++) {
            var x = scores[i * k + r];
            if is_nan_bits(x) {
                x = 0.0;
            }
            m = moments_push(m, x);
        }
        if m.n < 2u {
            continue;
        }
        let d = group_sigma(m) + params.eps;
        for (var i = lo; i < hi; i++) {
            var x = scores[i * k + r];
            if is_nan_bits(x) {
                x = 0.0;
            }
            out[i] = out[i] + weights[r] * ((x - m.mean) / d);
        }
    }
}

// GDPO stage 2: whiten S over the batch.
@compute @workgroup_size(64)
fn finish(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i >= params.n {
        return;
    }
    out[i] = (out[i] - bstats[0]) / (bstats_sigma() + params.eps);
}

// Acklam's rational approximation of Φ⁻¹(p) for 0 < p ≤ 0.5 (relative error 1.15e-9 in exact
// arithmetic; f32 evaluation here). Only the lower half is evaluated so that mirrored ranks give
// exactly opposite advantages (G²RPO's mean is exactly 0).
fn norm_quantile_lower(p: f32) -> f32 {
    if p < 0.02425 {
        let q = sqrt(-2.0 * log(p));
        let num = ((((-7.784894002430293e-03 * q - 3.223964580411365e-01) * q - 2.400758277161838e+00) * q
            - 2.549732539343734e+00) * q + 4.374664141464968e+00) * q + 2.938163982698783e+00;
        let den = (((7.784695709041462e-03 * q + 3.224671290700398e-01) * q + 2.445134137142996e+00) * q
            + 3.754408661907416e+00) * q + 1.0;
        return num / den;
    }
    let q = p - 0.5;
    let r = q * q;
    let num = (((((-3.969683028665376e+01 * r + 2.209460984245205e+02) * r - 2.759285104469687e+02) * r
        + 1.383577518672690e+02) * r - 3.066479806614716e+01) * r + 2.506628277459239e+00) * q;
    let den = ((((-5.447609879822406e+01 * r + 1.615858368580409e+02) * r - 1.556989798598866e+02) * r
        + 6.680131188771972e+01) * r - 1.328068155288572e+01) * r + 1.0;
    return num / den;
}

// GOPO [2602.03876]: A = 2 − 4(rank − 1)/(G − 1), rank 1 = best (descending).
// G²RPO [2604.08539]: A = Φ⁻¹((rank_asc − ½)/G), ties share the average mid-rank.
// Ranks by counting (O(G²) per group; groups are small).
@compute @workgroup_size(64)
fn group_rank(@builtin(global_invocation_id) gid: vec3<u32>) {
    let g = gid.x;
    if g >= params.groups {
        return;
    }
    let lo = offsets[g];
    let hi = offsets[g + 1u];
    let size = hi - lo;
    let average = (params.flags & FLAG_TIE_AVERAGE) != 0u || params.kind == KIND_G2RPO;
    for (var i = lo; i < hi; i++) {
        let s = scores[i];
        var greater = 0u;
        var less = 0u;
        var ties_before = 0u;
        var ties = 0u;
        for (var j = lo; j < hi; j++) {
            let t = scores[j];
            if t > s {
                greater++;
            } else if t < s {
                less++;
            } else {
                ties++;
                if j < i {
                    ties_before++;
                }
            }
        }
        var a = 0.0;
        if params.kind == KIND_GOPO {
            // rank − 1 (descending): ordinal counts earlier ties first; average takes the mean
            // of the tied ranks, greater + (ties − 1)/2.
            var r1 = f32(greater + ties_before);
            if average {
                r1 = (f32(2u * greater + ties) - 1.0) * 0.5;
            }
            a = 2.0 - (4.0 * r1) / f32(size - 1u);
        } else {
            // Twice the ascending mid-rank, 2·(less + (ties + 1)/2) = 2·less + ties + 1, and its
            // mirror 2(G + 1) − that; evaluate Φ⁻¹ on the lower one and mirror the sign.
            let twice = 2u * less + ties + 1u;
            let mirror = 2u * (size + 1u) - twice;
            if twice != mirror {
                let lower = min(twice, mirror);
                let x = norm_quantile_lower((f32(lower) * 0.5 - 0.5) / f32(size));
                a = select(x, -x, twice > mirror);
            }
        }
        out[i] = a;
    }
}
