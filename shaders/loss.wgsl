// loss.wgsl — per-token policy losses with their gradient ∂L/∂lp, KL penalties, IS weights and
// the reductions aggregation needs (MATH.md §3, §4), f32, the same per-element formulas as
// grpo-core. Masked tokens (mask == 0) may hold garbage: they are never read into arithmetic and
// get value 0 and gradient 0.
//
// Bindings: 0 a (lp; old for IS), 1 b (old; ref for KL; roll for IS), 2 adv (per token),
// 3 mask (u32 per token), 4 params, 5 value out, 6 grad out, 7 counters / reduction out,
// 8 segment offsets (packed sequences, seqs + 1 entries).
//
// Entry points: seq_mean (per sequence: masked mean of a − b, for GSPO), reduce (one workgroup:
// Σw and Σw² of ρ over valid tokens, for P3O's ESS), per_token (the loss itself).

const KIND_PPO: u32 = 0u;
const KIND_CISPO_VERL: u32 = 1u;
const KIND_CISPO_TRL: u32 = 2u;
const KIND_SAPO: u32 = 3u;
const KIND_REINFORCE: u32 = 4u;
const KIND_P3O: u32 = 5u;
const KIND_GSPO_TOKEN: u32 = 6u;
const KIND_GSPO_SEQ: u32 = 7u;
const KIND_K1: u32 = 8u;
const KIND_ABS: u32 = 9u;
const KIND_K2: u32 = 10u;
const KIND_K3: u32 = 11u;
const KIND_IS_TRUNCATE: u32 = 12u;
const KIND_IS_MASK: u32 = 13u;

const FLAG_CLAMP_LOG_RATIO: u32 = 1u;
const FLAG_DUAL_CLIP: u32 = 2u;
const FLAG_DELTA_CAP: u32 = 4u;
const FLAG_KL_OUT_CLAMP: u32 = 8u;

const WG: u32 = 256u;

struct LossParams {
    n: u32,
    kind: u32,
    flags: u32,
    seqs: u32,
    // Ratio bounds [lo, hi] (clip region; CISPO-verl's clamp; IS mask interval / truncate cap).
    lo: f32,
    hi: f32,
    // Log-ratio clamp C: x ∈ [−C, C] before exp (20 by default).
    clamp: f32,
    // Dual-clip constant c > 1.
    dual_c: f32,
    // Two-sided δ cap: ρ ← min(ρ, δ).
    delta: f32,
    tau_pos: f32,
    tau_neg: f32,
    // KL output clamp (±10 in the verl/OpenRLHF presets); GSPO-token's log-ratio cap (10).
    out_clamp: f32,
}

@group(0) @binding(0) var<storage, read> in_a: array<f32>;
@group(0) @binding(1) var<storage, read> in_b: array<f32>;
@group(0) @binding(2) var<storage, read> adv: array<f32>;
@group(0) @binding(3) var<storage, read> mask: array<u32>;
@group(0) @binding(4) var<uniform> params: LossParams;
@group(0) @binding(5) var<storage, read_write> value: array<f32>;
@group(0) @binding(6) var<storage, read_write> grad: array<f32>;
// counters: [0] clipped low, [1] clipped high, [2] dual-clipped, [3] valid tokens,
// then (as f32 bits) [4] Σw, [5] Σw² (P3O), then per sequence [6 + s] masked mean (GSPO).
@group(0) @binding(7) var<storage, read_write> counters: array<atomic<u32>>;
@group(0) @binding(8) var<storage, read> seg: array<u32>;

// ρ = exp(clamp(x)) and dρ/dx (0 where the clamp saturates).
struct Ratio {
    rho: f32,
    drho: f32,
}

fn ratio(x: f32) -> Ratio {
    var xc = x;
    var live = 1.0;
    if (params.flags & FLAG_CLAMP_LOG_RATIO) != 0u {
        if x > params.clamp || x < -params.clamp {
            live = 0.0;
        }
        xc = rclamp(x, -params.clamp, params.clamp);
    }
    let rho = exp(xc);
    return Ratio(rho, rho * live);
}

// Numerically stable logistic, the same two branches as grpo-core's Real::sigmoid.
fn sigmoid(z: f32) -> f32 {
    if z >= 0.0 {
        return 1.0 / (1.0 + exp(-z));
    }
    let e = exp(z);
    return e / (1.0 + e);
}

struct LossGrad {
    l: f32,
    g: f32,
}

// Unified clipped objective (MATH.md §3): L = −min(ρA, clip(ρ)A) [dual-clip for A < 0:
// min(L, −cA)]; the gradient is −A·∂ρ/∂lp unless the clipped branch is active.
fn clipped(r: Ratio, a: f32, i: u32) -> LossGrad {
    var rho = r.rho;
    var drho = r.drho;
    if (params.flags & FLAG_DELTA_CAP) != 0u && rho > params.delta {
        rho = params.delta;
        drho = 0.0;
    }
    let rc = rclamp(rho, params.lo, params.hi);
    let l1 = -(rho * a);
    let l2 = -(rc * a);
    var out = LossGrad(rmax(l1, l2), -(a * drho));
    // The clipped term wins strictly: ρ is beyond the bound in the direction A pushes it.
    if l2 > l1 {
        out.g = 0.0;
        if rho < params.lo {
            atomicAdd(&counters[0], 1u);
        } else {
            atomicAdd(&counters[1], 1u);
        }
    }
    if (params.flags & FLAG_DUAL_CLIP) != 0u && a < 0.0 {
        let l3 = -(params.dual_c * a);
        if l3 < out.l {
            out = LossGrad(l3, 0.0);
            atomicAdd(&counters[2], 1u);
        }
    }
    return out;
}

fn sum_w() -> f32 {
    return bitcast<f32>(atomicLoad(&counters[4]));
}

fn sum_w2() -> f32 {
    return bitcast<f32>(atomicLoad(&counters[5]));
}

@compute @workgroup_size(256)
fn per_token(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i >= params.n {
        return;
    }
    if mask[i] == 0u {
        value[i] = 0.0;
        grad[i] = 0.0;
        return;
    }
    atomicAdd(&counters[3], 1u);
    let a_in = in_a[i];
    let b_in = in_b[i];
    let kind = params.kind;
    var o = LossGrad(0.0, 0.0);
    if kind == KIND_PPO {
        o = clipped(ratio(a_in - b_in), adv[i], i);
    } else if kind == KIND_CISPO_VERL {
        // −sg(clamp(ρ, lo, hi))·A·lp.
        let w = rclamp(ratio(a_in - b_in).rho, params.lo, params.hi);
        let a = adv[i];
        o = LossGrad(-(w * a) * a_in, -(w * a));
    } else if kind == KIND_CISPO_TRL {
        // −sg(min(ρ, ε_max))·A·lp, ε_max in `hi`.
        let w = rmin(ratio(a_in - b_in).rho, params.hi);
        let a = adv[i];
        o = LossGrad(-(w * a) * a_in, -(w * a));
    } else if kind == KIND_SAPO {
        // L = −σ(τ(ρ − 1))·(4/τ)·A; ∂L/∂lp = −4A·σ(1 − σ)·∂ρ/∂lp.
        let a = adv[i];
        let tau = select(params.tau_neg, params.tau_pos, a > 0.0);
        let r = ratio(a_in - b_in);
        let s = sigmoid(tau * (r.rho - 1.0));
        o = LossGrad(-(s * (4.0 / tau) * a), -(4.0 * a * s * (1.0 - s) * r.drho));
    } else if kind == KIND_REINFORCE {
        let a = adv[i];
        o = LossGrad(-(a * a_in), -a);
    } else if kind == KIND_P3O {
        // ESS = (Σw)²/(n(Σw² + 1e-8)) over valid tokens (from `reduce`);
        // L = −sg(min(ρ, ESS))·A·lp + (1 − ESS)·(e^{−x} − 1 + x).
        // The host passes the valid-token count in `seqs` for P3O.
        let nv = f32(params.seqs);
        var ess = 1.0;
        if nv > 0.0 {
            let sw = sum_w();
            ess = (sw * sw) / (nv * (sum_w2() + 1e-8));
        }
        let a = adv[i];
        let x = a_in - b_in;
        let r = ratio(x);
        let w = rmin(r.rho, ess);
        let em = exp(-x);
        o = LossGrad(-(w * a) * a_in + (1.0 - ess) * ((em - 1.0) + x), -(w * a) + (1.0 - ess) * (1.0 - em));
    } else if kind == KIND_GSPO_TOKEN || kind == KIND_GSPO_SEQ {
        // The sequence holding token i: the largest s with seg[s] ≤ i (binary search).
        var s = 0u;
        var hi_s = params.seqs;
        while hi_s - s > 1u {
            let mid = (s + hi_s) / 2u;
            if seg[mid] <= i {
                s = mid;
            } else {
                hi_s = mid;
            }
        }
        let mean_x = bitcast<f32>(atomicLoad(&counters[6u + s]));
        let a = adv[i];
        if kind == KIND_GSPO_TOKEN {
            // log r_t = lp − sg(lp) + sg(mean x), capped at `out_clamp` (10): value e^{min(mean, cap)},
            // ∂r_t/∂lp_t = r_t (0 where the cap binds).
            let capped = mean_x > params.out_clamp;
            let r = exp(rmin(mean_x, params.out_clamp));
            o = clipped(Ratio(r, select(r, 0.0, capped)), a, i);
        } else {
            // s_i = exp(mean x) per sequence; ∂s_i/∂lp_t = s_i/|y_i|.
            let cnt = f32(atomicLoad(&counters[6u + params.seqs + s]));
            let r = ratio(mean_x);
            o = clipped(Ratio(r.rho, r.drho / cnt), a, i);
        }
    } else if kind == KIND_K1 || kind == KIND_ABS || kind == KIND_K2 || kind == KIND_K3 {
        // KL to the reference (b = ref): k1 = lp − ref, abs = |lp − ref|, k2 = (lp − ref)²/2,
        // k3 = e^{ref − lp} − (ref − lp) − 1 (input clamp ±C when FLAG_CLAMP_LOG_RATIO).
        var d = a_in - b_in;
        var live = 1.0;
        if (params.flags & FLAG_CLAMP_LOG_RATIO) != 0u && kind == KIND_K3 {
            if d > params.clamp || d < -params.clamp {
                live = 0.0;
            }
            d = rclamp(d, -params.clamp, params.clamp);
        }
        if kind == KIND_K1 {
            o = LossGrad(d, 1.0);
        } else if kind == KIND_ABS {
            o = LossGrad(abs(d), select(select(0.0, -1.0, d < 0.0), 1.0, d > 0.0));
        } else if kind == KIND_K2 {
            o = LossGrad(0.5 * (d * d), d);
        } else {
            let e = exp(-d);
            o = LossGrad((e + d) - 1.0, (1.0 - e) * live);
        }
        if (params.flags & FLAG_KL_OUT_CLAMP) != 0u {
            let c = params.out_clamp;
            if o.l > c || o.l < -c {
                o.g = 0.0;
            }
            o.l = rclamp(o.l, -c, c);
        }
    } else if kind == KIND_IS_TRUNCATE || kind == KIND_IS_MASK {
        // a = old, b = roll: w = e^{old − roll}; truncate: min(w, hi); mask: 0 outside [lo, hi].
        let w = ratio(a_in - b_in).rho;
        if kind == KIND_IS_TRUNCATE {
            o = LossGrad(rmin(w, params.hi), 0.0);
        } else {
            o = LossGrad(select(0.0, w, w >= params.lo && w <= params.hi), 0.0);
        }
    }
    value[i] = o.l;
    grad[i] = o.g;
}

// Per sequence (one invocation each): masked mean of a − b in token order, for GSPO, stored as
// f32 bits in counters[6 + s], and the valid count in counters[6 + seqs + s].
@compute @workgroup_size(64)
fn seq_mean(@builtin(global_invocation_id) gid: vec3<u32>) {
    let s = gid.x;
    if s >= params.seqs {
        return;
    }
    var sum = 0.0;
    var cnt = 0u;
    for (var t = seg[s]; t < seg[s + 1u]; t++) {
        if mask[t] != 0u {
            sum = sum + (in_a[t] - in_b[t]);
            cnt++;
        }
    }
    var mean = 0.0;
    if cnt > 0u {
        mean = sum / f32(cnt);
    }
    atomicStore(&counters[6u + s], bitcast<u32>(mean));
    atomicStore(&counters[6u + params.seqs + s], cnt);
}

var<workgroup> red_w: array<f32, WG>;
var<workgroup> red_w2: array<f32, WG>;

// One workgroup: Σρ and Σρ² over valid tokens (strided lanes, then a fixed pairwise tree), for
// P3O's ESS; stored as f32 bits in counters[4], counters[5].
@compute @workgroup_size(256)
fn reduce(@builtin(local_invocation_index) lid: u32) {
    var w = 0.0;
    var w2 = 0.0;
    for (var i = lid; i < params.n; i += WG) {
        if mask[i] != 0u {
            let r = ratio(in_a[i] - in_b[i]).rho;
            w = w + r;
            w2 = fma(r, r, w2);
        }
    }
    red_w[lid] = w;
    red_w2[lid] = w2;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride >> 1u) {
        if lid < stride {
            red_w[lid] = red_w[lid] + red_w[lid + stride];
            red_w2[lid] = red_w2[lid] + red_w2[lid + stride];
        }
        workgroupBarrier();
    }
    if lid == 0u {
        atomicStore(&counters[4], bitcast<u32>(red_w[0]));
        atomicStore(&counters[5], bitcast<u32>(red_w2[0]));
    }
}
