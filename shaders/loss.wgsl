// loss.wgsl — per-token policy losses with their gradient ∂L/∂lp and KL-to-reference penalties
// (MATH.md §3–4) in f32, the same per-element operations as grpo-core (loss/ppo.rs, loss/pg.rs,
// divergence/kl_penalty.rs). Masked tokens (flags == 0 on input) may hold garbage: they are never
// read into arithmetic and get value 0 and gradient 0.
//
// Bindings: 0 lp, 1 old (reference for KL; REINFORCE's optional weights), 2 adv (old for the
// importance-corrected KL k3·ρ), 3 flags (in: 1 for a valid token; out: 1 | event bits << 1),
// 4 params, 5 value out, 6 grad out.
// The host validates every input (grpo-core's order and errors) and checks the outputs'
// finiteness after readback; the shader sees only valid tokens.
// Aggregation (agg_seq, agg_total) rebinds them: 0 values, 1 per-sequence weights w_i, 3 the
// mask (n words) then each sequence's [start, end) (2 words per sequence), 5 per-token weights
// out, 6 the per-sequence products w_i·Σ then the scalar at index seqs.
// Sequence-ratio losses (seq_ratio) keep the per-token bindings; flags holds the mask then the
// spans as for aggregation. IS weights (is_weights) read old in lp and roll in old, take the
// log limit in clamp and the filter bounds (truncate, mask or geometric mask) in lo/hi, and
// write the weights to value.
// ESS sums (ess_seq, ess_total) use the per-token bindings with flags as for aggregation and
// write (Σw, Σw²) per sequence to grad[2i], grad[2i + 1], the totals to grad[2·seqs], +1.
// Rejection masks (rejection) read old in lp and roll in old; flags holds the mask, the spans,
// then the criteria (see `rejection`); the token decisions go back in flags (EV_REJECTED) and
// the per-sequence aggregates to grad[i·cs + j]. OPSM (opsm) reads lp in lp, roll in old and one
// advantage per sequence in adv, flags as for aggregation, and writes one sum per sequence to
// grad[i].

const KIND_PPO: u32 = 0u;
const KIND_CISPO_CLAMP: u32 = 1u;
const KIND_CISPO_CAP: u32 = 2u;
const KIND_SAPO: u32 = 3u;
const KIND_REINFORCE: u32 = 4u;
const KIND_GSPO: u32 = 5u;
const KIND_GSPO_TOKEN: u32 = 6u;
const KIND_P3O: u32 = 7u;
const KIND_IS_TOKEN: u32 = 12u;
const KIND_IS_SEQ: u32 = 13u;
const KIND_K1: u32 = 8u;
const KIND_ABS: u32 = 9u;
const KIND_K2: u32 = 10u;
const KIND_K3: u32 = 11u;
const KIND_K3_IS: u32 = 14u;
const KIND_K1_ST: u32 = 15u;
const KIND_K3_ST: u32 = 16u;
const KIND_IS_GEO: u32 = 17u;

const FLAG_CLAMP_LOG_RATIO: u32 = 1u;
const FLAG_DUAL_CLIP: u32 = 2u;
const FLAG_DELTA_CAP: u32 = 4u;
const FLAG_KL_OUT_CLAMP: u32 = 8u;
const FLAG_WEIGHTS: u32 = 16u;
const FLAG_IS_TRUNCATE: u32 = 32u;
const FLAG_IS_MASK: u32 = 64u;
const FLAG_IS_GEO_MASK: u32 = 128u;

// Event bits (grpo-core's TokenOut flags), shifted left by one in the flags word.
const EV_CLAMPED: u32 = 1u;
const EV_CLIP_LOW: u32 = 2u;
const EV_CLIP_HIGH: u32 = 4u;
const EV_DUAL: u32 = 8u;
const EV_CAPPED: u32 = 16u;
const EV_OUT_CLAMPED: u32 = 32u;

// divergence::measures guards in f32: exp_guard = ln(f32::MAX)/2 − 1, poly_guard = sqrt(MAX).
// (Bit patterns; naga cannot evaluate bitcast in a const expression, so they are cast at use.)
const EXP_GUARD_BITS: u32 = 0x422d7218u;
const POLY_GUARD_BITS: u32 = 0x5f7fffffu;

struct LossParams {
    n: u32,
    kind: u32,
    flags: u32,
    // Number of sequences (reductions).
    seqs: u32,
    // Ratio bounds [lo, hi] (clip region; CISPO's clamp); CISPO's cap in hi.
    lo: f32,
    hi: f32,
    // Log-ratio clamp C (PPO-family), or the KL input clamp.
    clamp: f32,
    // Dual-clip constant c > 1.
    dual_c: f32,
    // δ cap of the unclipped branch.
    delta: f32,
    tau_pos: f32,
    tau_neg: f32,
    // KL output clamp.
    out_clamp: f32,
}

@group(0) @binding(0) var<storage, read> lp: array<f32>;
@group(0) @binding(1) var<storage, read> old: array<f32>;
@group(0) @binding(2) var<storage, read> adv: array<f32>;
@group(0) @binding(3) var<storage, read_write> flags: array<u32>;
@group(0) @binding(4) var<uniform> params: LossParams;
@group(0) @binding(5) var<storage, read_write> value: array<f32>;
@group(0) @binding(6) var<storage, read_write> grad: array<f32>;

struct Out {
    v: f32,
    g: f32,
    ev: u32,
}

// loss::mul0: 0 when either factor is 0 (so 0·∞ never appears), else a·b.
fn mul0(a: f32, b: f32) -> f32 {
    if a == 0.0 || b == 0.0 {
        return 0.0;
    }
    return a * b;
}

// loss::ppo_core.
fn ppo_core(rho: f32, drho: f32, a: f32) -> Out {
    var o = Out(0.0, 0.0, 0u);
    if a == 0.0 {
        return o;
    }
    var r1 = rho;
    var dr1 = drho;
    var capped = false;
    if (params.flags & FLAG_DELTA_CAP) != 0u && rho > params.delta {
        r1 = params.delta;
        dr1 = 0.0;
        capped = true;
    }
    let v1 = -(a * r1);
    let g1 = -mul0(a, dr1);
    var r2 = rho;
    var dr2 = drho;
    if rho < params.lo {
        r2 = params.lo;
        dr2 = 0.0;
    } else if rho > params.hi {
        r2 = params.hi;
        dr2 = 0.0;
    }
    let v2 = -(a * r2);
    let g2 = -mul0(a, dr2);
    // The winner decided on the ratios, exactly (the rounded products can tie while the
    // ratios differ; see loss::ppo_core).
    let clipped_wins = (a > 0.0 && r1 > r2) || (a < 0.0 && r1 < r2);
    var v = v1;
    var g = g1;
    var r = r1;
    if clipped_wins {
        v = v2;
        g = g2;
        r = r2;
    }
    if capped && a < 0.0 && !clipped_wins {
        o.ev |= EV_CAPPED;
    }
    if a > 0.0 && rho > params.hi {
        o.ev |= EV_CLIP_HIGH;
    }
    if a < 0.0 && rho < params.lo {
        o.ev |= EV_CLIP_LOW;
    }
    if (params.flags & FLAG_DUAL_CLIP) != 0u && a < 0.0 {
        let v3 = -(params.dual_c * a);
        // −c·A < −r·A exactly for A < 0.
        if params.dual_c < r {
            v = v3;
            g = 0.0;
            o.ev |= EV_DUAL;
        }
    }
    o.v = v;
    o.g = g;
    return o;
}

// 1/k! for k = 2..=17 (divergence::measures::EXPM1_MINUS_X rounded to f32), as bit patterns so
// no abstract-float conversion rule is involved.
const EXPM1_MINUS_X_BITS = array<u32, 16>(
    0x3f000000u, // 1/2!
    0x3e2aaaabu, // 1/3!
    0x3d2aaaabu, // 1/4!
    0x3c088889u, // 1/5!
    0x3ab60b61u, // 1/6!
    0x39500d01u, // 1/7!
    0x37d00d01u, // 1/8!
    0x3638ef1du, // 1/9!
    0x3493f27eu, // 1/10!
    0x32d7322bu, // 1/11!
    0x310f76c7u, // 1/12!
    0x2f309231u, // 1/13!
    0x2d49cba5u, // 1/14!
    0x2b573f9fu, // 1/15!
    0x29573f9fu, // 1/16!
    0x274a963cu, // 1/17!
);

// e^x − 1 − x without cancellation (divergence::measures::expm1_minus_x). grpo-core switches
// to libm's expm1(x) − x at |x| = ½; WGSL has no expm1 and exp(x) − 1 − x would lose up to
// 11× exp's error there (e^½/(e^½ − 1.5)), so the series runs to |x| < 2 here (the first
// omitted term is 2^16/18! ≈ 1e-11 of x²/2), where the direct form loses at most 1.7×.
fn expm1_minus_x(x: f32) -> f32 {
    if abs(x) < 2.0 {
        let coef = EXPM1_MINUS_X_BITS;
        var acc = 0.0;
        for (var k = 15i; k >= 0i; k--) {
            acc = acc * x + bitcast<f32>(coef[k]);
        }
        return acc * x * x;
    }
    return (exp(x) - 1.0) - x;
}

// e^x − 1 (WGSL has no expm1): x + expm1_minus_x(x), accurate for small x.
fn expm1(x: f32) -> f32 {
    if abs(x) < 2.0 {
        return x + expm1_minus_x(x);
    }
    return exp(x) - 1.0;
}

// divergence::measures::limit (inputs here are finite, so its NaN branch cannot occur).
fn limit_hit(x: f32, lim: f32) -> bool {
    return x > lim || x < -lim;
}

// Whether `kind` is one of the KL-to-reference estimators (kl_token).
fn is_kl(kind: u32) -> bool {
    return (kind >= KIND_K1 && kind <= KIND_K3) || (kind >= KIND_K3_IS && kind <= KIND_K3_ST);
}

// KL-to-reference penalty (divergence::kl_penalty::eval_flagged) of lp_v and ref_v:
// d = lp − ref, x = lp − old
// (read only by k3·ρ):
//   k1 d | abs |d| | k2 d²/2 | k3 e^{−d} + d − 1 | k3·ρ with ρ = e^x, ∂ = ρ·(1 − e^{−d} + k3)
//   | k1+ value d, gradient d | k3+ value k3, gradient d.
// d (and x) are limited to the input clamp and the overflow guard (EV_CLAMPED, gradient 0 there);
// k3·ρ zeroes only the limited factor's term; the straight-through forms take the gradient of
// the separate k2 term, d limited by the polynomial guard alone, which no clamp touches.
fn kl_token(lp_v: f32, ref_v: f32, x_raw: f32) -> Out {
    let d_raw = lp_v - ref_v;
    let kind = params.kind;
    let straight = kind == KIND_K1_ST || kind == KIND_K3_ST;
    var guard = bitcast<f32>(POLY_GUARD_BITS);
    if kind == KIND_K3 || kind == KIND_K3_IS || kind == KIND_K3_ST {
        guard = bitcast<f32>(EXP_GUARD_BITS);
    }
    var lim = guard;
    if (params.flags & FLAG_CLAMP_LOG_RATIO) != 0u {
        lim = rmin(params.clamp, guard);
    }
    var hit = limit_hit(d_raw, lim);
    let d = rclamp(d_raw, -lim, lim);
    var o = Out(0.0, 0.0, 0u);
    if kind == KIND_K1 {
        o = Out(d, 1.0, 0u);
    } else if kind == KIND_ABS {
        // sign(lp − ref) from the comparison, not from d: WGSL may flush a subnormal
        // difference to 0, and grpo-core's gradient is ±1 there (gradual underflow makes
        // lp − ref ≠ 0 whenever lp ≠ ref).
        o = Out(abs(d), select(select(0.0, -1.0, lp_v < ref_v), 1.0, lp_v > ref_v), 0u);
    } else if kind == KIND_K2 {
        o = Out(d * d * 0.5, d, 0u);
    } else if kind == KIND_K1_ST {
        o = Out(d, d, 0u);
    } else if kind == KIND_K3_IS {
        // As grpo-core: ρ·(∂k3 + k3), each term 0 where its own input was limited; unlimited,
        // ∂k3 + k3 = d exactly, so the gradient is ρ·d (the sum would cancel for large |d|).
        let x_hit = limit_hit(x_raw, lim);
        let x = rclamp(x_raw, -lim, lim);
        let k3 = expm1_minus_x(-d);
        let rho = exp(x);
        var g = 0.0;
        if !hit && !x_hit {
            g = rho * d;
        } else if !hit {
            g = rho * -expm1(-d);
        } else if !x_hit {
            g = rho * k3;
        }
        o = Out(k3 * rho, g, 0u);
        hit = hit || x_hit;
    } else {
        o = Out(expm1_minus_x(-d), -expm1(-d), 0u);
    }
    if straight {
        let pg = bitcast<f32>(POLY_GUARD_BITS);
        o.g = rclamp(d_raw, -pg, pg);
    } else if hit && kind != KIND_K3_IS {
        o.g = 0.0;
    }
    if hit {
        o.ev |= EV_CLAMPED;
    }
    if (params.flags & FLAG_KL_OUT_CLAMP) != 0u {
        let c = params.out_clamp;
        if limit_hit(o.v, c) {
            o.v = rclamp(o.v, -c, c);
            if !straight {
                o.g = 0.0;
            }
            o.ev |= EV_OUT_CLAMPED;
        }
    }
    return o;
}

// The numerically stable logistic of grpo-core's Real::sigmoid.
fn sigmoid(z: f32) -> f32 {
    if z >= 0.0 {
        return 1.0 / (1.0 + exp(-z));
    }
    let e = exp(z);
    return e / (1.0 + e);
}

// σ'(z) = e^{−|z|}/(1 + e^{−|z|})² (loss::pg::sigmoid_slope).
fn sigmoid_slope(z: f32) -> f32 {
    let e = exp(-abs(z));
    let d = 1.0 + e;
    return e / (d * d);
}

@compute @workgroup_size(256)
fn per_token(@builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, 256u);
    if i >= params.n {
        return;
    }
    if flags[i] == 0u {
        value[i] = 0.0;
        grad[i] = 0.0;
        return;
    }
    let kind = params.kind;
    var o = Out(0.0, 0.0, 0u);
    if is_kl(kind) {
        o = kl_token(lp[i], old[i], lp[i] - adv[i]);
    } else if kind == KIND_REINFORCE {
        var w = 1.0;
        if (params.flags & FLAG_WEIGHTS) != 0u {
            w = old[i];
        }
        let wa = mul0(w, adv[i]);
        o = Out(-mul0(wa, lp[i]), -wa, 0u);
    } else {
        // Log-ratio clamp (loss::clamp_log_ratio), then ρ = e^x; the gradient of a clamped
        // ratio is 0.
        var x = lp[i] - old[i];
        var clamped = false;
        if (params.flags & FLAG_CLAMP_LOG_RATIO) != 0u {
            if x > params.clamp {
                x = params.clamp;
                clamped = true;
            } else if x < -params.clamp {
                x = -params.clamp;
                clamped = true;
            }
        }
        let rho = exp(x);
        let a = adv[i];
        if kind == KIND_PPO {
            o = ppo_core(rho, select(rho, 0.0, clamped), a);
        } else if kind == KIND_CISPO_CLAMP || kind == KIND_CISPO_CAP {
            // −sg(w)·A·lp with w = clamp(ρ, lo, hi) (verl) or min(ρ, cap) (TRL).
            var w = rho;
            var ev = 0u;
            if kind == KIND_CISPO_CLAMP && rho < params.lo {
                w = params.lo;
                ev = EV_CLIP_LOW;
            } else if rho > params.hi {
                w = params.hi;
                ev = EV_CLIP_HIGH;
            }
            let wa = mul0(w, a);
            o = Out(-mul0(wa, lp[i]), -wa, ev);
        } else if kind == KIND_P3O {
            // L = −sg(min(ρ, ESS))·A·lp + (1 − ESS)·(e^{−x} − 1 + x), ESS in hi, 1 − ESS in
            // lo; ∂L/∂lp = −min(ρ, ESS)·A + (1 − ESS)·(1 − e^{−x}) (the k3 term, k3 of
            // KL(θ‖old) as grpo-core's p3o, 0 when clamped).
            var w = rho;
            var ev = 0u;
            if rho > params.hi {
                w = params.hi;
                ev = EV_CLIP_HIGH;
            }
            let wa = mul0(w, a);
            let k3 = expm1_minus_x(-x);
            var dk3 = -expm1(-x);
            if clamped {
                dk3 = 0.0;
            }
            o = Out(-mul0(wa, lp[i]) + mul0(params.lo, k3), -wa + mul0(params.lo, dk3), ev);
        } else if kind == KIND_SAPO {
            // L = −σ(τ(ρ − 1))·(4/τ)·A, ∂L/∂lp = −4A·σ'(z)·ρ.
            var tau = params.tau_neg;
            if a > 0.0 {
                tau = params.tau_pos;
            }
            let z = tau * (rho - 1.0);
            let s = sigmoid(z);
            var g = 0.0;
            if !clamped {
                g = -mul0(4.0 * a, mul0(sigmoid_slope(z), rho));
            }
            o = Out(-mul0(s * 4.0 / tau, a), g, 0u);
        }
        if clamped {
            o.ev |= EV_CLAMPED;
        }
    }
    value[i] = o.v;
    grad[i] = o.g;
    flags[i] = 1u | (o.ev << 1u);
}

// Aggregation, pass 1: one invocation per sequence sums its valid values in token order (the
// order of grpo-core's aggregate) and stores w_i·sum; it also writes the per-token weights of its
// span (w_i at valid tokens, 0 elsewhere). The product is stored, not accumulated, so no fused
// multiply-add can change its rounding.
@compute @workgroup_size(256)
fn agg_seq(@builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, 256u);
    if i >= params.seqs {
        return;
    }
    let start = flags[params.n + 2u * i];
    let end = flags[params.n + 2u * i + 1u];
    let w = old[i];
    var s = 0.0;
    for (var t = start; t < end; t++) {
        if flags[t] != 0u {
            s += lp[t];
            value[t] = w;
        } else {
            value[t] = 0.0;
        }
    }
    grad[i] = s * w;
}

// Aggregation, pass 2: the scalar, Σ_i (w_i·sum_i) added in sequence order by one invocation
// (grpo-core's order, so the same bits; B is a batch size, small next to the token count).
@compute @workgroup_size(1)
fn agg_total() {
    var l = 0.0;
    for (var i = 0u; i < params.seqs; i++) {
        l += grad[i];
    }
    grad[params.seqs] = l;
}

// Sequence-ratio losses (loss/seq.rs), one invocation per sequence: x̄ = Σ(lp − old)/n over the
// valid tokens in token order (grpo-core's seq_sum), then
//   GSPO:       s = e^{clamp(x̄)}, L = ppo_core(s, A) on every valid token when they share A,
//               else the mean of ppo_core(s, A_t) over them; ∂L/∂lp_t = ∂L/∂x̄ / n;
//   GSPO-token: r = e^{min(x̄, max)}, L_t = ppo_core(r, A_t), ∂r/∂lp_t = r (0 when clamped).
// Masked tokens of the span get 0; valid ones get their event bits as per_token writes them.
@compute @workgroup_size(256)
fn seq_ratio(@builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, 256u);
    if i >= params.seqs {
        return;
    }
    let start = flags[params.n + 2u * i];
    let end = flags[params.n + 2u * i + 1u];
    var sx = 0.0;
    var c = 0u;
    // Whether every valid token has the first one's advantage a0 (seq::gspo_sequence's `shared`;
    // `shared` is a reserved word in WGSL).
    var a0 = 0.0;
    var one_adv = true;
    for (var t = start; t < end; t++) {
        if flags[t] != 0u {
            sx += lp[t] - old[t];
            if c == 0u {
                a0 = adv[t];
            } else if adv[t] != a0 {
                one_adv = false;
            }
            c += 1u;
        }
    }
    let nt = f32(max(c, 1u));
    let xbar = sx / nt;
    var x = xbar;
    var clamped = false;
    if (params.flags & FLAG_CLAMP_LOG_RATIO) != 0u {
        if x > params.clamp {
            x = params.clamp;
            clamped = true;
        } else if params.kind == KIND_GSPO && x < -params.clamp {
            x = -params.clamp;
            clamped = true;
        }
    }
    let rho = exp(x);
    let drho = select(rho, 0.0, clamped);
    // GSPO: L_i = ℓ(A) for an advantage the tokens share, else the mean of the tokens' terms ℓ(A_t)
    // (grpo-core's gspo, in its order); ∂L_i/∂lp_t = (∂L_i/∂x̄)/n.
    var seq = Out(0.0, 0.0, 0u);
    if params.kind == KIND_GSPO {
        if one_adv {
            seq = ppo_core(rho, drho, a0);
        } else {
            var sv = 0.0;
            var sg = 0.0;
            for (var t = start; t < end; t++) {
                if flags[t] != 0u {
                    let term = ppo_core(rho, drho, adv[t]);
                    sv += term.v;
                    sg += term.g;
                }
            }
            seq = Out(sv / nt, sg / nt, 0u);
        }
        seq.g = seq.g / nt;
    }
    for (var t = start; t < end; t++) {
        if flags[t] == 0u {
            value[t] = 0.0;
            grad[t] = 0.0;
            continue;
        }
        var o = seq;
        if params.kind == KIND_GSPO {
            // The token's own term decides its clip events.
            o.ev = ppo_core(rho, drho, select(adv[t], a0, one_adv)).ev;
        } else if params.kind == KIND_GSPO_TOKEN {
            o = ppo_core(rho, drho, adv[t]);
        }
        if clamped {
            o.ev |= EV_CLAMPED;
        }
        value[t] = o.v;
        grad[t] = o.g;
        flags[t] = 1u | (o.ev << 1u);
    }
}

// Importance weights (is_correction::is_weights), one invocation per sequence: r_t = old_t −
// roll_t, S = Σ_t r_t in token order over the valid tokens and r̄ = S/n. The log-weight is r_t
// (token level), S (sequence) or r̄ (geometric mean), limited to ±clamp (EV_CLAMPED), w = e^l,
// then truncated to [lo, hi] or zeroed outside it (EV_CLIP_LOW: the filter changed w). The
// geometric-mean filter (FLAG_IS_GEO_MASK) instead zeroes the whole sequence when
// e^{limit(r̄)} ∉ [lo, hi] (EV_CLIP_LOW on each of its tokens) and leaves w unchanged otherwise.
// Masked tokens get 0.
@compute @workgroup_size(256)
fn is_weights(@builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, 256u);
    if i >= params.seqs {
        return;
    }
    let start = flags[params.n + 2u * i];
    let end = flags[params.n + 2u * i + 1u];
    var sum = 0.0;
    var c = 0u;
    for (var t = start; t < end; t++) {
        if flags[t] != 0u {
            sum += lp[t] - old[t];
            c += 1u;
        }
    }
    let mean = sum / f32(max(c, 1u));
    let lim = params.clamp;
    var reject = false;
    if (params.flags & FLAG_IS_GEO_MASK) != 0u {
        let g = exp(rclamp(mean, -lim, lim));
        reject = !(g >= params.lo && g <= params.hi);
    }
    for (var t = start; t < end; t++) {
        if flags[t] == 0u {
            value[t] = 0.0;
            continue;
        }
        var l = sum;
        if params.kind == KIND_IS_TOKEN {
            l = lp[t] - old[t];
        } else if params.kind == KIND_IS_GEO {
            l = mean;
        }
        var ev = 0u;
        if limit_hit(l, lim) {
            ev |= EV_CLAMPED;
        }
        let raw = exp(rclamp(l, -lim, lim));
        var w = raw;
        if (params.flags & FLAG_IS_TRUNCATE) != 0u {
            w = rclamp(raw, params.lo, params.hi);
        } else if (params.flags & FLAG_IS_MASK) != 0u && !(raw >= params.lo && raw <= params.hi) {
            w = 0.0;
        } else if reject {
            w = 0.0;
        }
        if w != raw || reject {
            ev |= EV_CLIP_LOW;
        }
        value[t] = w;
        flags[t] = 1u | (ev << 1u);
    }
}

// ESS sums (loss/pg.rs ess_stats), pass 1: one invocation per sequence adds w = e^{clamp(x)} and
// w² over its valid tokens in token order.
@compute @workgroup_size(256)
fn ess_seq(@builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, 256u);
    if i >= params.seqs {
        return;
    }
    let start = flags[params.n + 2u * i];
    let end = flags[params.n + 2u * i + 1u];
    var sw = 0.0;
    var sw2 = 0.0;
    for (var t = start; t < end; t++) {
        if flags[t] != 0u {
            var x = lp[t] - old[t];
            if (params.flags & FLAG_CLAMP_LOG_RATIO) != 0u {
                x = rclamp(x, -params.clamp, params.clamp);
            }
            let w = exp(x);
            sw += w;
            sw2 += w * w;
        }
    }
    grad[2u * i] = sw;
    grad[2u * i + 1u] = sw2;
}

// ESS sums, pass 2: the per-sequence sums added in sequence order by one invocation.
@compute @workgroup_size(1)
fn ess_total() {
    var sw = 0.0;
    var sw2 = 0.0;
    for (var i = 0u; i < params.seqs; i++) {
        sw += grad[2u * i];
        sw2 += grad[2u * i + 1u];
    }
    grad[2u * params.seqs] = sw;
    grad[2u * params.seqs + 1u] = sw2;
}

// verl rollout rejection statistics of r = old − roll (is_correction::RejectStat), and the
// levels of is_correction::RejectLevel, as the host encodes them.
const STAT_K1: u32 = 0u;
const STAT_K2: u32 = 1u;
const LEVEL_SEQ_MAX: u32 = 3u;
// Event bit of a valid token that a token-level criterion rejects.
const EV_REJECTED: u32 = 64u;

// is_correction's token statistic of r clamped to ±20 (REJECT_LOG_CLAMP, verl's SAFETY_BOUND;
// the inputs are finite): k1 = −r, k2 = r²/2 (both exact: the same correctly rounded
// operations as grpo-core; ×0.5 is exact, so even a fused multiply-add into a sum rounds
// alike), k3 = e^r − 1 − r (expm1_minus_x above: not bit-identical, see
// LossKernel::rejection_mask).
fn reject_stat(stat: u32, r_raw: f32) -> f32 {
    let r = rclamp(r_raw, -20.0, 20.0);
    if stat == STAT_K1 {
        return -r;
    }
    if stat == STAT_K2 {
        return r * r * 0.5;
    }
    return expm1_minus_x(r);
}

// A key whose unsigned order is the numeric order of non-NaN f32 values, ±∞ included, with −0
// mapped to +0 (they compare equal). The bounds arrive as keys, so `lo ≤ v ≤ hi` is decided
// exactly without ±∞ ever entering arithmetic (k2/k3 criteria have lo = −∞). The host's
// LossKernel `order_key` is the same function.
fn order_key(x: f32) -> u32 {
    var b = bitcast<u32>(x);
    if b == 0x80000000u {
        b = 0u;
    }
    if (b & 0x80000000u) != 0u {
        return ~b;
    }
    return b | 0x80000000u;
}

// Rollout rejection (is_correction::rejection_mask), one invocation per sequence. flags holds,
// after the mask (n words) and the spans (2 words per sequence), the criteria: at
// base = n + 2·seqs the count cs of sequence-level criteria and the count ct of token-level ones,
// then cs + ct records of 4 words (stat, level, key(lo), key(hi)), sequence-level ones first.
// For each sequence-level criterion j the statistic of every valid token is added in token
// order (SeqSum, SeqMean: grpo-core's order, so k1/k2 sums have its bits) or maxed (SeqMax, the
// project's NaN rule as grpo-core's Real::max) and stored to grad[i·cs + j]; the host divides
// the means (correctly rounded, as grpo-core) and compares with the bounds. Each valid token gets
// 1 | EV_REJECTED << 1 in flags when a token-level criterion rejects it, 1 otherwise.
@compute @workgroup_size(256)
fn rejection(@builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, 256u);
    if i >= params.seqs {
        return;
    }
    let start = flags[params.n + 2u * i];
    let end = flags[params.n + 2u * i + 1u];
    let base = params.n + 2u * params.seqs;
    let cs = flags[base];
    let ct = flags[base + 1u];
    for (var j = 0u; j < cs; j++) {
        let c = base + 2u + 4u * j;
        let stat = flags[c];
        let is_max = flags[c + 1u] == LEVEL_SEQ_MAX;
        // grpo-core starts a maximum at −∞; NEG_BIG gives the same maximum, since only k2 and
        // k3 (both ≥ 0) have a SeqMax level.
        var agg = 0.0;
        if is_max {
            agg = NEG_BIG;
        }
        for (var t = start; t < end; t++) {
            if flags[t] != 0u {
                let v = reject_stat(stat, lp[t] - old[t]);
                if is_max {
                    agg = rmax(agg, v);
                } else {
                    agg += v;
                }
            }
        }
        grad[i * cs + j] = agg;
    }
    for (var t = start; t < end; t++) {
        if flags[t] == 0u {
            continue;
        }
        let r = lp[t] - old[t];
        var ev = 0u;
        for (var j = 0u; j < ct; j++) {
            let c = base + 2u + 4u * (cs + j);
            let v = reject_stat(flags[c], r);
            let k = order_key(v);
            // NaN is never kept (grpo-core's `v >= lo && v <= hi` is false for it).
            if is_nan_bits(v) || k < flags[c + 2u] || k > flags[c + 3u] {
                ev = EV_REJECTED;
            }
        }
        flags[t] = 1u | (ev << 1u);
    }
}

// Off-policy sequence masking (is_correction::off_policy_sequence_mask), one invocation per
// sequence: for a negative advantage, Σ_t (roll_t − lp_t) over the valid tokens in token order
// (grpo-core's order, so the sum has its bits) to grad[i], 0 otherwise. The host divides by the
// count and compares with δ (correctly rounded, as grpo-core).
@compute @workgroup_size(256)
fn opsm(@builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg, 256u);
    if i >= params.seqs {
        return;
    }
    var sum = 0.0;
    if adv[i] < 0.0 {
        let start = flags[params.n + 2u * i];
        let end = flags[params.n + 2u * i + 1u];
        for (var t = start; t < end; t++) {
            if flags[t] != 0u {
                sum += old[t] - lp[t];
            }
        }
    }
    grad[i] = sum;
}
