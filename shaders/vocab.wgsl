// vocab.wgsl — vocabulary-wide reductions over logit rows (MATH.md §5).
//
// Prepended by grpo-wgpu: common.wgsl, then one of load_{f32,f16,bf16}.wgsl (which declares the
// logit bindings 0 and 5 and `load_logit` / `load_teacher`, widening to f32). All accumulation is
// f32. One workgroup owns one row: each of the 256 invocations walks the row with stride 256
// keeping an online (max, sum, shifted-moment) state, then the 256 states are merged by a fixed
// pairwise tree, so rows of any length work and the summation is blocked (≈ V/256 sequential adds
// per lane, then log2(256) levels) as the accuracy contract requires.
//
// Status per row, 4 words (host turns it into grpo_core::Error after readback, in grpo-core's
// order, before any caller buffer is written): word 0 = first column holding NaN or +∞ (NO_INDEX
// if none); word 1 = flags (1: every logit is −∞; 2: the target's logit is −∞; 4: KL is +∞
// because the teacher is −∞ where the student has mass); word 2 = first column whose z/T
// overflows to +∞ (NO_INDEX if none); word 3 unused. `jsd` uses its own layout (see there).


const WG: u32 = 256u;
const FLAG_EMPTY_ROW: u32 = 1u;
const FLAG_TARGET_NEG_INF: u32 = 2u;
const FLAG_KL_INFINITE: u32 = 4u;

struct VocabParams {
    // Rows in this dispatch (one chunk of the caller's batch).
    rows: u32,
    // Row length V.
    vocab: u32,
    // Element index of row 0 inside the logit bindings (bf16 chunks may start mid-word).
    base: u32,
    // 1/T, computed once on the host (multiplication is exact-rounded; a division per element is
    // allowed 2.5 ULP in WGSL).
    inv_temp: f32,
    // JSD_β only (the other entry points ignore them): β and 1 − β rounded once on the host as
    // grpo-core does, and −ln β, −ln(1 − β) from the host so that a subnormal β (which WGSL may
    // flush to 0) never reaches a shader log. 32 bytes in all, asserted in vocab.rs.
    beta: f32,
    one_minus_beta: f32,
    neg_ln_beta: f32,
    neg_ln_one_minus_beta: f32,
}

@group(0) @binding(1) var<storage, read> targets: array<u32>;
@group(0) @binding(2) var<storage, read_write> stats: array<f32>;
@group(0) @binding(3) var<storage, read_write> status: array<u32>;
@group(0) @binding(4) var<uniform> params: VocabParams;
@group(0) @binding(6) var<storage, read_write> grad: array<f32>;
@group(0) @binding(7) var<storage, read> upstream: array<f32>;

// Online softmax state of a set of scaled logits x: m = max x, s = Σ_{x ≠ the max} e^{x−m}
// (the maximum's own 1 is kept out of the sum), t = Σ e^{x−m}(x − m). Then lse = m + ln(1 + s)
// and H = ln(1 + s) − t/(1 + s); t is relative to m so the entropy never subtracts large
// numbers. Keeping the 1 out matters for peaked rows: the lane holding the peak adds ~V/256
// terms far below half an ULP of 1, which a sum starting at 1 would drop (2.7e-6 of logp at
// V = 262144 in a prototype). s < 0 (−1) marks the empty state.
struct Online {
    m: f32,
    s: f32,
    t: f32,
}

fn online_empty() -> Online {
    return Online(NEG_BIG, -1.0, 0.0);
}

fn online_push(a: Online, x: f32) -> Online {
    if a.s < 0.0 {
        return Online(x, 0.0, 0.0);
    }
    if x > a.m {
        // New maximum: the old maximum and its sum become ordinary terms scaled by
        // c = e^{m_old − x} ≤ 1, and t shifts to the new m.
        let d = a.m - x;
        let c = exp(d);
        return Online(x, fma(c, a.s, c), c * fma(d, a.s + 1.0, a.t));
    }
    let d = x - a.m;
    let e = exp(d);
    return Online(a.m, a.s + e, fma(e, d, a.t));
}

// Merge `lo` into `hi` where hi.m ≥ lo.m and both are non-empty.
fn online_absorb(hi: Online, lo: Online) -> Online {
    let d = lo.m - hi.m;
    let c = exp(d);
    return Online(hi.m, hi.s + fma(c, lo.s, c), fma(c, fma(d, lo.s + 1.0, lo.t), hi.t));
}

fn online_merge(a: Online, b: Online) -> Online {
    if b.s < 0.0 {
        return a;
    }
    if a.s < 0.0 {
        return b;
    }
    if b.m > a.m {
        return online_absorb(b, a);
    }
    return online_absorb(a, b);
}

var<workgroup> wm: array<f32, WG>;
var<workgroup> ws: array<f32, WG>;
var<workgroup> wt: array<f32, WG>;
var<workgroup> wbad: atomic<u32>;
var<workgroup> wover: atomic<u32>;

// Fixed pairwise tree over the 256 lane states. Called from uniform control flow by every
// invocation (it contains barriers); every invocation gets the merged state.
fn workgroup_reduce(lid: u32, st: Online) -> Online {
    wm[lid] = st.m;
    ws[lid] = st.s;
    wt[lid] = st.t;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride >> 1u) {
        if lid < stride {
            let r = online_merge(Online(wm[lid], ws[lid], wt[lid]),
                                 Online(wm[lid + stride], ws[lid + stride], wt[lid + stride]));
            wm[lid] = r.m;
            ws[lid] = r.s;
            wt[lid] = r.t;
        }
        workgroupBarrier();
    }
    return Online(wm[0], ws[0], wt[0]);
}

// Pass over one row: the lane's online state; non-finite (NaN, +∞) columns lower `wbad`;
// −∞ columns are masked vocabulary entries and contribute exactly nothing.
fn scan_row(row_ok: bool, row: u32, lid: u32) -> Online {
    var st = online_empty();
    if row_ok {
        let start = params.base + row * params.vocab;
        for (var v = lid; v < params.vocab; v += WG) {
            let z = load_logit(start + v);
            if is_neg_inf_bits(z) {
                continue;
            }
            if !is_finite_bits(z) {
                atomicMin(&wbad, v);
                continue;
            }
            let x = z * params.inv_temp;
            if !is_finite_bits(x) {
                // z/T overflowed: +∞ is an error (grpo-core reports it), −∞ contributes nothing.
                if x > 0.0 {
                    atomicMin(&wover, v);
                }
                continue;
            }
            st = online_push(st, x);
        }
    }
    return st;
}

struct RowStats {
    lse: f32,
    ln_s: f32,
    entropy: f32,
    logp: f32,
    flags: u32,
}

fn row_stats(row: u32, r: Online) -> RowStats {
    // 1 + s ≥ 1 for a non-empty row; the empty state (s = −1) is mapped to 1 to avoid ln 0.
    let s1 = rmax(r.s + 1.0, 1.0);
    let ln_s = log(s1);
    var out = RowStats(r.m + ln_s, ln_s, ln_s - r.t / s1, 0.0, 0u);
    if r.s < 0.0 {
        out.flags = FLAG_EMPTY_ROW;
        out.lse = NEG_BIG;
        out.entropy = 0.0;
    }
    let y = targets[row];
    let zy = load_logit(params.base + row * params.vocab + y);
    if is_neg_inf_bits(zy) {
        out.flags = out.flags | FLAG_TARGET_NEG_INF;
    } else {
        // (z_y/T − m) is exact when z_y/T is near m (Sterbenz), so logp keeps its relative
        // accuracy even when lse is large.
        out.logp = (zy * params.inv_temp - r.m) - ln_s;
    }
    return out;
}

// Fused forward: lse, logp(target) and entropy of each row in one pass over the logits.
@compute @workgroup_size(256)
fn forward(@builtin(workgroup_id) wid: vec3<u32>,
           @builtin(local_invocation_index) lid: u32) {
    let row = wid.x;
    let row_ok = row < params.rows;
    if lid == 0u {
        atomicStore(&wbad, NO_INDEX);
        atomicStore(&wover, NO_INDEX);
    }
    workgroupBarrier();
    let st = scan_row(row_ok, row, lid);
    let r = workgroup_reduce(lid, st);
    let bad = atomicLoad(&wbad);
    let over = atomicLoad(&wover);
    if row_ok && lid == 0u {
        let o = row_stats(row, r);
        stats[row * 4u] = o.lse;
        stats[row * 4u + 1u] = o.logp;
        stats[row * 4u + 2u] = o.entropy;
        stats[row * 4u + 3u] = 0.0;
        status[row * 4u] = bad;
        status[row * 4u + 1u] = o.flags;
        status[row * 4u + 2u] = over;
        status[row * 4u + 3u] = 0u;
    }
}

// Fused backward: recomputes the row statistics, then writes
// grad_v = (g_lp·(1[v=y] − p_v) − g_H·p_v·(log p_v + H)) / T
// (∂logp(y)/∂z_v = (1[v=y] − p_v)/T, ∂H/∂z_v = −p_v(log p_v + H)/T; MATH.md §5), and the
// forward statistics as `forward` does. upstream = (g_lp, g_H) per row.
@compute @workgroup_size(256)
fn backward(@builtin(workgroup_id) wid: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    let row = wid.x;
    let row_ok = row < params.rows;
    if lid == 0u {
        atomicStore(&wbad, NO_INDEX);
        atomicStore(&wover, NO_INDEX);
    }
    workgroupBarrier();
    let st = scan_row(row_ok, row, lid);
    let r = workgroup_reduce(lid, st);
    let bad = atomicLoad(&wbad);
    let over = atomicLoad(&wover);
    if row_ok {
        let o = row_stats(row, r);
        let g_lp = upstream[row * 2u];
        let g_h = upstream[row * 2u + 1u];
        let y = targets[row];
        let start = params.base + row * params.vocab;
        let out0 = row * params.vocab;
        for (var v = lid; v < params.vocab; v += WG) {
            let z = load_logit(start + v);
            let x = z * params.inv_temp;
            var g = 0.0;
            if !is_neg_inf_bits(z) && is_finite_bits(x) {
                let lp = (x - r.m) - o.ln_s;
                let p = exp(lp);
                g = -g_lp * p - g_h * p * (lp + o.entropy);
                if v == y {
                    g = g + g_lp;
                }
            }
            grad[out0 + v] = g * params.inv_temp;
        }
        if lid == 0u {
            stats[row * 4u] = o.lse;
            stats[row * 4u + 1u] = o.logp;
            stats[row * 4u + 2u] = o.entropy;
            stats[row * 4u + 3u] = 0.0;
            status[row * 4u] = bad;
            status[row * 4u + 1u] = o.flags;
            status[row * 4u + 2u] = over;
            status[row * 4u + 3u] = 0u;
        }
    }
}

// KL(p‖q) between softmax(student/T) and softmax(teacher/T), one pass over both rows:
// KL = Σ p (x_p − x_q) − lse_p + lse_q, with u = Σ e^{x_p − m_p}(x_p − x_q) carried online.
var<workgroup> wu: array<f32, WG>;
var<workgroup> wmq: array<f32, WG>;
var<workgroup> wsq: array<f32, WG>;
var<workgroup> wflags: atomic<u32>;

@compute @workgroup_size(256)
fn kl(@builtin(workgroup_id) wid: vec3<u32>,
      @builtin(local_invocation_index) lid: u32) {
    let row = wid.x;
    let row_ok = row < params.rows;
    if lid == 0u {
        atomicStore(&wbad, NO_INDEX);
        atomicStore(&wflags, 0u);
    }
    workgroupBarrier();
    // Student state (m_p, s_p, u) with s_p excluding the maximum's 1 (−1 = empty), like Online.
    var mp = NEG_BIG;
    var sp = -1.0;
    var u = 0.0;
    var q = online_empty();
    if row_ok {
        let start = params.base + row * params.vocab;
        for (var v = lid; v < params.vocab; v += WG) {
            let zp = load_logit(start + v);
            let zq = load_teacher(start + v);
            let p_masked = is_neg_inf_bits(zp);
            let q_masked = is_neg_inf_bits(zq);
            if (!p_masked && !is_finite_bits(zp)) || (!q_masked && !is_finite_bits(zq)) {
                atomicMin(&wbad, v);
                continue;
            }
            if !q_masked {
                q = online_push(q, zq * params.inv_temp);
            }
            if p_masked {
                continue;
            }
            if q_masked {
                atomicOr(&wflags, FLAG_KL_INFINITE);
                continue;
            }
            let xp = zp * params.inv_temp;
            let diff = xp - zq * params.inv_temp;
            if sp < 0.0 {
                mp = xp;
                sp = 0.0;
                u = diff;
            } else if xp > mp {
                let c = exp(mp - xp);
                sp = fma(c, sp, c);
                u = fma(u, c, diff);
                mp = xp;
            } else {
                let e = exp(xp - mp);
                sp = sp + e;
                u = fma(e, diff, u);
            }
        }
    }
    // Student state rides in (wm, ws, wu); teacher state in (wmq, wsq).
    wm[lid] = mp;
    ws[lid] = sp;
    wu[lid] = u;
    wmq[lid] = q.m;
    wsq[lid] = q.s;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride >> 1u) {
        if lid < stride {
            let o = lid + stride;
            // Student: merge (m, s, u) — u rescales like s.
            if ws[o] >= 0.0 {
                if ws[lid] < 0.0 {
                    wm[lid] = wm[o];
                    ws[lid] = ws[o];
                    wu[lid] = wu[o];
                } else if wm[o] > wm[lid] {
                    let c = exp(wm[lid] - wm[o]);
                    ws[lid] = ws[o] + fma(c, ws[lid], c);
                    wu[lid] = fma(wu[lid], c, wu[o]);
                    wm[lid] = wm[o];
                } else {
                    let c = exp(wm[o] - wm[lid]);
                    ws[lid] = ws[lid] + fma(c, ws[o], c);
                    wu[lid] = fma(wu[o], c, wu[lid]);
                }
            }
            let mq = online_merge(Online(wmq[lid], wsq[lid], 0.0),
                                  Online(wmq[o], wsq[o], 0.0));
            wmq[lid] = mq.m;
            wsq[lid] = mq.s;
        }
        workgroupBarrier();
    }
    let bad = atomicLoad(&wbad);
    let flags_in = atomicLoad(&wflags);
    if row_ok && lid == 0u {
        var flags = flags_in;
        var value = 0.0;
        let sp1 = rmax(ws[0] + 1.0, 1.0);
        let sq1 = rmax(wsq[0] + 1.0, 1.0);
        if ws[0] < 0.0 || wsq[0] < 0.0 {
            flags = flags | FLAG_EMPTY_ROW;
        } else {
            value = wu[0] / sp1 - log(sp1) + log(sq1) + (wmq[0] - wm[0]);
        }
        stats[row * 4u] = wm[0] + log(sp1);
        stats[row * 4u + 1u] = wmq[0] + log(sq1);
        stats[row * 4u + 2u] = 0.0;
        stats[row * 4u + 3u] = value;
        status[row * 4u] = bad;
        status[row * 4u + 1u] = flags;
        status[row * 4u + 2u] = NO_INDEX;
        status[row * 4u + 3u] = 0u;
    }
}

// Generalised Jensen–Shannon divergence JSD_β [arXiv 2306.13649; MATH.md §5; grpo-core's
// vocab::jsd_rows]: with p = softmax(student/T), q = softmax(teacher/T), m = β q + (1 − β) p,
// JSD_β = β KL(q‖m) + (1 − β) KL(p‖m) = Σ_v β q_v (log q_v − log m_v) + (1 − β) p_v (log p_v − log m_v).
// Two passes over both rows: the online (max, sum) state of each row (single-pass merge, then the
// workgroup tree) gives both log-sum-exps; the second pass sums the per-column terms, each ≥ 0
// (log-sum inequality), and the workgroup tree adds the 256 partial sums.
//
// Status per row, 4 words: word 0 = first student column holding NaN or +∞ (NO_INDEX if none);
// word 1 = flags (FLAG_EMPTY_ROW: the student has no usable logit; FLAG_TEACHER_EMPTY: the
// teacher has none; FLAG_SCALE_OVERFLOW: a finite logit of either row has a non-finite z/T);
// word 2 = first teacher column holding NaN or +∞; word 3 unused. Any of these sends the row to
// grpo-core's own row checks on the host (which also accept an overflow to −∞ that is not the
// row maximum: such a column has probability 0 here, as it has there). stats = (lse_p, lse_q,
// 0, JSD_β).
const FLAG_TEACHER_EMPTY: u32 = 8u;
const FLAG_SCALE_OVERFLOW: u32 = 16u;
// grpo-core's D_MIN: floor of a log-probability (e^−88 is below the smallest normal f32).
const LOGP_MIN: f32 = -88.0;
// Smallest normal f32: floor of the mixture's scaled weight before its log (only a subnormal β
// can reach it, and then the term it multiplies is below 1e-36).
const MIN_NORMAL: f32 = 1.17549435e-38;

var<workgroup> wbad_q: atomic<u32>;

// Adds one logit to a row's online state; NaN/+∞ lower `bad` (returned), a finite logit whose
// z/T overflows sets FLAG_SCALE_OVERFLOW in `wflags`, −∞ (masked) contributes nothing.
fn jsd_push(st: Online, z: f32) -> Online {
    if is_neg_inf_bits(z) || !is_finite_bits(z) {
        return st;
    }
    let x = z * params.inv_temp;
    if !is_finite_bits(x) {
        atomicOr(&wflags, FLAG_SCALE_OVERFLOW);
        return st;
    }
    return online_push(st, x);
}

// log p_v = (z/T − m) − ln(1 + s), floored at LOGP_MIN (the difference is tested before use: it
// can overflow for logits near ±f32::MAX of opposite signs).
fn jsd_logp(x: f32, r: Online, ln_s: f32) -> f32 {
    let d = x - r.m;
    return select(LOGP_MIN, rmax(LOGP_MIN, d - ln_s), is_finite_bits(d));
}

// One column's term β q (log q − log m) + (1 − β) p (log p − log m). log m is taken relative to
// a = max(log p, log q): log m = a + ln(w_a + w_b e^{b − a}), so no column evaluates ln of a tiny
// number and identical columns give ln(β + (1 − β)) ≈ 0 instead of ln(e^{log p}) − log p, which
// would carry exp's 3 + 2|log p| ULP into every term. A masked side has weight 0: the term is
// (1 − β) p · (−ln(1 − β)) or β q · (−ln β).
fn jsd_term(lp: f32, lq: f32, p_on: bool, q_on: bool) -> f32 {
    let beta = params.beta;
    let omb = params.one_minus_beta;
    if p_on && q_on {
        let p = exp(lp);
        let q = exp(lq);
        let a = rmax(lp, lq);
        let e = exp(rmin(lp, lq) - a);
        let w = select(fma(beta, e, omb), fma(omb, e, beta), lq >= lp);
        let l = log(rmax(w, MIN_NORMAL));
        return fma(beta * q, (lq - a) - l, (omb * p) * ((lp - a) - l));
    }
    if p_on {
        return (omb * exp(lp)) * params.neg_ln_one_minus_beta;
    }
    if q_on {
        return (beta * exp(lq)) * params.neg_ln_beta;
    }
    return 0.0;
}

@compute @workgroup_size(256)
fn jsd(@builtin(workgroup_id) wid: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    let row = wid.x;
    let row_ok = row < params.rows;
    if lid == 0u {
        atomicStore(&wbad, NO_INDEX);
        atomicStore(&wbad_q, NO_INDEX);
        atomicStore(&wflags, 0u);
    }
    workgroupBarrier();
    // Pass 1: online state of each row.
    var sp = online_empty();
    var sq = online_empty();
    if row_ok {
        let start = params.base + row * params.vocab;
        for (var v = lid; v < params.vocab; v += WG) {
            let zp = load_logit(start + v);
            let zq = load_teacher(start + v);
            if !is_neg_inf_bits(zp) && !is_finite_bits(zp) {
                atomicMin(&wbad, v);
            }
            if !is_neg_inf_bits(zq) && !is_finite_bits(zq) {
                atomicMin(&wbad_q, v);
            }
            sp = jsd_push(sp, zp);
            sq = jsd_push(sq, zq);
        }
    }
    let rp = workgroup_reduce(lid, sp);
    // Every invocation has read the student's result from slot 0 before the teacher's tree
    // overwrites it.
    workgroupBarrier();
    let rq = workgroup_reduce(lid, sq);
    let ln_sp = log(rmax(rp.s + 1.0, 1.0));
    let ln_sq = log(rmax(rq.s + 1.0, 1.0));
    let usable = rp.s >= 0.0 && rq.s >= 0.0;
    // Pass 2: the lane's sum of terms (same strided columns as pass 1).
    var acc = 0.0;
    if row_ok && usable {
        let start = params.base + row * params.vocab;
        for (var v = lid; v < params.vocab; v += WG) {
            let xp = load_logit(start + v) * params.inv_temp;
            let xq = load_teacher(start + v) * params.inv_temp;
            // −∞ logits stay −∞ after ·τ; NaN/+∞ (an error reported above) count as masked too.
            let p_on = is_finite_bits(xp);
            let q_on = is_finite_bits(xq);
            let lp = select(LOGP_MIN, jsd_logp(xp, rp, ln_sp), p_on);
            let lq = select(LOGP_MIN, jsd_logp(xq, rq, ln_sq), q_on);
            acc = acc + jsd_term(lp, lq, p_on, q_on);
        }
    }
    // Fixed pairwise tree over the lane sums (in `wt`; every invocation read slot 0 of the
    // teacher's tree before this overwrites it).
    workgroupBarrier();
    wt[lid] = acc;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride >> 1u) {
        if lid < stride {
            wt[lid] = wt[lid] + wt[lid + stride];
        }
        workgroupBarrier();
    }
    let bad_p = atomicLoad(&wbad);
    let bad_q = atomicLoad(&wbad_q);
    let flags_in = atomicLoad(&wflags);
    if row_ok && lid == 0u {
        var flags = flags_in;
        if rp.s < 0.0 {
            flags = flags | FLAG_EMPTY_ROW;
        }
        if rq.s < 0.0 {
            flags = flags | FLAG_TEACHER_EMPTY;
        }
        stats[row * 4u] = rp.m + ln_sp;
        stats[row * 4u + 1u] = rq.m + ln_sq;
        stats[row * 4u + 2u] = 0.0;
        // grpo-core clamps the sum at 0 (rounding can leave a tiny negative for equal rows).
        stats[row * 4u + 3u] = rmax(wt[0], 0.0);
        status[row * 4u] = bad_p;
        status[row * 4u + 1u] = flags;
        status[row * 4u + 2u] = bad_q;
        status[row * 4u + 3u] = 0u;
    }
}
