// advantage.wgsl — group-relative advantage estimators (MATH.md §2) in f32, the same per-element
// operations as grpo-core (advantage/zscore.rs, rloo.rs, rank.rs, multi_reward.rs).
//
// The host gathers each group's members contiguously (group g spans offsets[g]..offsets[g+1] of
// `scores` and `out`; for uniform and CSR layouts that is the caller's order, for permuted
// layouts the member order grpo-core iterates) and validates everything grpo-core validates
// before dispatch, so these kernels see only valid input. NaN scores reaching a kernel are the
// "unscorable" ones of NanPolicy::Exclude. Group statistics are Welford's update in member
// order and batch statistics Chan's merge of the group moments in group order, exactly
// grpo-core's `Moments`; WGSL rounds + − × correctly, so only ÷, sqrt and pow can differ — and
// a driver may fuse a product into a following sum (one rounding instead of two; NVIDIA's
// Vulkan driver does, dividing as a multiplication by a reciprocal), which moves a mean by an
// ULP: results that must be exact (GOPO's middle rank) are computed so that no fusion can
// reach them.
//
// Entry points (run in order within one submission, as the estimator needs):
//   gdpo_sum      — GDPO: per group and reward z_k, S_i = Σ_k w_k z_k → out
//   batch_moments — one invocation: the batch's moments → bstats
//   group_stats   — z-score family (group / batch / no scale) and RLOO → out
//   group_rank    — GOPO / G²RPO → out
//   finish        — GDPO: ratio(S − μ_batch, σ_batch + ε_batch) in place

const KIND_ZSCORE: u32 = 0u;
const KIND_RLOO: u32 = 1u;
const KIND_GOPO: u32 = 3u;
const KIND_G2RPO: u32 = 4u;
const KIND_GDPO: u32 = 5u;

const FLAG_UNBIASED: u32 = 1u;
// σ = sqrt(max(var, var_floor)) (verl vectorized).
const FLAG_VAR_FLOOR: u32 = 2u;
// Ties share the average rank (GOPO; else ordinal: earlier member ranks first).
const FLAG_TIE_AVERAGE: u32 = 8u;

const SCALE_GROUP: u32 = 0u;
const SCALE_BATCH: u32 = 1u;
const SCALE_NONE: u32 = 2u;

const SINGLETON_ZERO: u32 = 0u;
const SINGLETON_VERL_LOOP: u32 = 1u;

struct AdvParams {
    groups: u32,
    n: u32,
    kind: u32,
    flags: u32,
    // ε added to σ (GDPO: the per-reward ε).
    eps: f32,
    // The std-identity dial (σ + ε)^γ: γ = 1 GRPO, γ = 0 Dr.GRPO-like.
    gamma: f32,
    singleton: u32,
    // GDPO: rewards per sample (scores is n × k, sample-major).
    k: u32,
    var_floor: f32,
    // GDPO: ε of the batch whitening.
    batch_eps: f32,
    scale: u32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read> scores: array<f32>;
@group(0) @binding(1) var<storage, read> offsets: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
// bstats: [batch mean, batch M2, batch count].
@group(0) @binding(3) var<storage, read_write> bstats: array<f32>;
@group(0) @binding(4) var<uniform> params: AdvParams;
@group(0) @binding(5) var<storage, read> weights: array<f32>;
// diag: per group [zero-spread flag, scorable count].
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

// grpo_core::stats::Moments::merge (Chan et al.), operation for operation.
fn moments_merge(a: Moments, b: Moments) -> Moments {
    if b.n == 0u {
        return a;
    }
    if a.n == 0u {
        return b;
    }
    let n = a.n + b.n;
    let na = f32(a.n);
    let nb = f32(b.n);
    let nn = f32(n);
    let delta = b.mean - a.mean;
    return Moments(n, a.mean + delta * (nb / nn), a.m2 + b.m2 + delta * delta * (na * (nb / nn)));
}

// std with the Bessel choice and optional variance floor; -1 when undefined (n − 1 = 0 or n = 0).
fn std_floored(m: Moments) -> f32 {
    var d = m.n;
    if (params.flags & FLAG_UNBIASED) != 0u {
        if d == 0u {
            return -1.0;
        }
        d = d - 1u;
    }
    if d == 0u {
        return -1.0;
    }
    var v = rmax(m.m2 / f32(d), 0.0);
    if (params.flags & FLAG_VAR_FLOOR) != 0u {
        v = rmax(v, params.var_floor);
    }
    return sqrt(v);
}

// unwrap_or(0).
fn std_or_zero(m: Moments) -> f32 {
    return rmax(std_floored(m), 0.0);
}

// group_scan::ratio: 0 when either side is 0, else num/den.
fn ratio(num: f32, den: f32) -> f32 {
    if num == 0.0 || den == 0.0 {
        return 0.0;
    }
    return num / den;
}

// group_scan::dial.
fn dial(x: f32) -> f32 {
    if params.gamma == 1.0 {
        return x;
    }
    if params.gamma == 0.0 {
        return 1.0;
    }
    return pow(x, params.gamma);
}

// Welford over the scorable members of a group, with the first two scorable values (for the
// exactly symmetric centring of pairs, group_scan::GroupStats::centered).
struct GroupStats {
    m: Moments,
    first: f32,
    half_gap: f32,
}

fn group_of(lo: u32, hi: u32) -> GroupStats {
    var m = Moments(0u, 0.0, 0.0);
    var first = 0.0;
    var second = 0.0;
    for (var i = lo; i < hi; i++) {
        let s = scores[i];
        if !is_nan_bits(s) {
            if m.n == 0u {
                first = s;
            } else if m.n == 1u {
                second = s;
            }
            m = moments_push(m, s);
        }
    }
    return GroupStats(m, first, (second - first) * 0.5);
}

fn centered(st: GroupStats, s: f32) -> f32 {
    if st.m.n == 2u {
        if st.half_gap == 0.0 {
            return 0.0;
        }
        if s == st.first {
            return -st.half_gap;
        }
        return st.half_gap;
    }
    return s - st.m.mean;
}

@compute @workgroup_size(64)
fn group_stats(@builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>) {
    let g = linear_index(gid, nwg, 64u);
    if g >= params.groups {
        return;
    }
    let lo = offsets[g];
    let hi = offsets[g + 1u];
    let st = group_of(lo, hi);
    let n = st.m.n;
    diag[2u * g] = select(0u, 1u, n >= 2u && st.m.m2 == 0.0);
    diag[2u * g + 1u] = n;
    if params.kind == KIND_RLOO {
        // s_i − mean_{j≠i} s_j = centered(s_i)·n/(n − 1); singleton: verl loop A = s.
        var factor = 0.0;
        if n >= 2u {
            factor = f32(n) / f32(n - 1u);
        }
        for (var i = lo; i < hi; i++) {
            let s = scores[i];
            var a = 0.0;
            if !is_nan_bits(s) {
                if n == 1u {
                    a = select(0.0, s, params.singleton == SINGLETON_VERL_LOOP);
                } else {
                    a = centered(st, s) * factor;
                }
            }
            out[i] = a;
        }
        return;
    }
    // z-score family: A = ratio(centered(s), dial(σ + ε)) by scale.
    let eps = params.eps;
    if n == 1u {
        var den = 1.0;
        if params.scale != SCALE_NONE {
            den = dial(1.0 + eps);
        }
        for (var i = lo; i < hi; i++) {
            let s = scores[i];
            var a = 0.0;
            if !is_nan_bits(s) && params.singleton == SINGLETON_VERL_LOOP {
                a = ratio(s, den);
            }
            out[i] = a;
        }
        return;
    }
    var den = 1.0;
    if params.scale == SCALE_GROUP {
        den = dial(std_or_zero(st.m) + eps);
    } else if params.scale == SCALE_BATCH {
        let b = Moments(u32(bstats[2]), bstats[0], bstats[1]);
        den = dial(std_or_zero(b) + eps);
    }
    for (var i = lo; i < hi; i++) {
        let s = scores[i];
        var a = 0.0;
        if !is_nan_bits(s) {
            a = ratio(centered(st, s), den);
        }
        out[i] = a;
    }
}

// GDPO's reward r of sample i (NaN: left out, multi_reward::reward).
fn reward_at(i: u32, r: u32) -> f32 {
    return scores[i * params.k + r];
}

// Whether GDPO's sample i has a non-NaN reward (otherwise it is unscorable: left out of the
// batch moments, advantage 0).
fn scorable(i: u32) -> bool {
    for (var r = 0u; r < params.k; r++) {
        if !is_nan_bits(reward_at(i, r)) {
            return true;
        }
    }
    return false;
}

// One invocation: the batch's moments as grpo-core merges them — each group's Welford moments
// (of the scorable scores, or of GDPO's S in `out`) merged in group order.
@compute @workgroup_size(1)
fn batch_moments() {
    var all = Moments(0u, 0.0, 0.0);
    for (var g = 0u; g < params.groups; g++) {
        var m = Moments(0u, 0.0, 0.0);
        for (var i = offsets[g]; i < offsets[g + 1u]; i++) {
            if params.kind == KIND_GDPO {
                if scorable(i) {
                    m = moments_push(m, out[i]);
                }
            } else {
                let s = scores[i];
                if !is_nan_bits(s) {
                    m = moments_push(m, s);
                }
            }
        }
        all = moments_merge(all, m);
    }
    bstats[0] = all.mean;
    bstats[1] = all.m2;
    bstats[2] = f32(all.n);
}

// GDPO [2601.05242] stage 1: z_k = ratio(r_k − μ_{k,g}, σ_{k,g} + ε) per reward, the moments
// over the group's non-NaN r_k and a NaN r_k adding nothing; S = Σ_k w_k z_k in reward order
// (0 for an unscorable sample, which `batch_moments` and `finish` skip). Singleton groups:
// verl loop μ = 0, den = 1 + ε; otherwise the undefined σ is 0 and the numerator is 0.
@compute @workgroup_size(64)
fn gdpo_sum(@builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>) {
    let g = linear_index(gid, nwg, 64u);
    if g >= params.groups {
        return;
    }
    let lo = offsets[g];
    let hi = offsets[g + 1u];
    let size = hi - lo;
    var flat = 1u;
    for (var i = lo; i < hi; i++) {
        out[i] = 0.0;
    }
    for (var r = 0u; r < params.k; r++) {
        var m = Moments(0u, 0.0, 0.0);
        for (var i = lo; i < hi; i++) {
            let x = reward_at(i, r);
            if !is_nan_bits(x) {
                m = moments_push(m, x);
            }
        }
        if m.m2 != 0.0 {
            flat = 0u;
        }
        var mu = m.mean;
        var den = std_or_zero(m) + params.eps;
        if size == 1u && params.singleton == SINGLETON_VERL_LOOP {
            mu = 0.0;
            den = 1.0 + params.eps;
        }
        for (var i = lo; i < hi; i++) {
            let x = reward_at(i, r);
            if !is_nan_bits(x) {
                out[i] = out[i] + weights[r] * ratio(x - mu, den);
            }
        }
    }
    diag[2u * g] = select(0u, flat, size >= 2u);
    diag[2u * g + 1u] = size;
}

// GDPO stage 2: whiten S over the batch.
@compute @workgroup_size(64)
fn finish(@builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, 64u);
    if i >= params.n {
        return;
    }
    let b = Moments(u32(bstats[2]), bstats[0], bstats[1]);
    var a = 0.0;
    if scorable(i) {
        a = ratio(out[i] - b.mean, std_or_zero(b) + params.batch_eps);
    }
    out[i] = a;
}

// G²RPO's normal scores Φ⁻¹((2r − 1)/(2g)) come from the host (grpo-core's own f64
// `norm_quantile`, rounded to f32): `weights` holds, for each group, g values at the offset
// `table_base[group]` (a table per distinct scorable count). An f32 rational approximation
// evaluated here would be off by up to ~1e-5 relative (Acklam's coefficients cancel in f32;
// AS241's 7-digit version still 6e-6), far beyond the table's few ULPs.
@group(0) @binding(7) var<storage, read> table_base: array<u32>;

fn normal_score(g: u32, r: u32) -> f32 {
    return weights[table_base[g] + r - 1u];
}

// GOPO [2602.03876]: A = 2 − 4(rank − 1)/(G − 1), rank 1 = best (descending), among the
// scorable members (G = their count; fewer than 2 → 0).
// G²RPO [2604.08539]: a tie block holding ascending ranks start+1..=end gets the mean of
// normal_score over those ranks (0 when the block is centred on the middle rank).
@compute @workgroup_size(64)
fn group_rank(@builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>) {
    let g = linear_index(gid, nwg, 64u);
    if g >= params.groups {
        return;
    }
    let lo = offsets[g];
    let hi = offsets[g + 1u];
    var count = 0u;
    var first = 0.0;
    var flat = 1u;
    for (var i = lo; i < hi; i++) {
        let s = scores[i];
        if !is_nan_bits(s) {
            if count == 0u {
                first = s;
            } else if s != first {
                flat = 0u;
            }
            count++;
        }
    }
    diag[2u * g] = select(0u, flat, count >= 2u);
    diag[2u * g + 1u] = count;
    let average = (params.flags & FLAG_TIE_AVERAGE) != 0u;
    for (var i = lo; i < hi; i++) {
        let s = scores[i];
        var a = 0.0;
        let skip = is_nan_bits(s) || (params.kind == KIND_GOPO && count < 2u);
        if !skip {
            var greater = 0u;
            var less = 0u;
            var ties_before = 0u;
            var ties = 0u;
            for (var j = lo; j < hi; j++) {
                let t = scores[j];
                if is_nan_bits(t) {
                    continue;
                }
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
            if params.kind == KIND_GOPO {
                // Twice the rank (descending): ordinal = greater + earlier ties + 1; average =
                // the mean of the tied ranks, greater + (ties + 1)/2. Then
                // A = 2 − 4(rank − 1)/(G − 1) = 2(G + 1 − 2·rank)/(G − 1): an exact integer
                // numerator and one division, so the middle rank (and an all-tied group under
                // `average`) gives exactly 0 and mirrored ranks exact negatives whatever the
                // driver does. grpo-core's literal form rounds the quotient, then subtracts; a
                // driver that divides by multiplying with a reciprocal and fuses that product
                // into the subtraction (naga emits no NoContraction; NVIDIA's Vulkan driver
                // fuses) turned 2 − 12/6 into 2 − 12·fl(1/6) = −6e-8. This form is within one
                // rounding of the quotient of grpo-core's (tolerance AdvGopo).
                var rank2 = 2u * (greater + ties_before + 1u);
                if average {
                    rank2 = 2u * greater + ties + 1u;
                }
                let num = 2i * (i32(count) + 1i - i32(rank2));
                a = f32(num) / f32(count - 1u);
            } else {
                let start = less;
                let end = less + ties;
                if start + 1u + end != count + 1u {
                    var sum = 0.0;
                    for (var r = start + 1u; r <= end; r++) {
                        sum = sum + normal_score(g, r);
                    }
                    a = sum / f32(end - start);
                }
            }
        }
        out[i] = a;
    }
}
