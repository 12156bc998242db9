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
// if none); word 1 = flags (1: every logit is −∞; 2: the target's shift (z_y − max z)/T is not
// finite — a −∞ target logit, or one so far below the maximum that the shift overflows, which
// grpo-core's `validate::target` rejects; 4: KL is +∞ because the teacher is −∞ where the
// student has mass); word 2 = first column whose z/T overflows to +∞ (NO_INDEX if none); word 3
// unused. `kl` and `jsd` use their own layouts (see there).
//
// Overflowing shifts. Logits near ±f32::MAX of opposite signs (or a large 1/T) make a shift
// x − m overflow to −∞. grpo-core floors every shift at D_MIN = −88 before its exponential and
// at LOG_RATIO_FLOOR where it enters a log-ratio (canon.rs), so such a column has probability 0
// and a bounded log-ratio; the shaders do the same, testing the bits of a shift before using it
// (WGSL lets an implementation assume that no infinity reaches arithmetic), so 0·(−∞) never
// turns a sum into NaN.


const WG: u32 = 256u;
const FLAG_EMPTY_ROW: u32 = 1u;
const FLAG_TARGET_NON_FINITE: u32 = 2u;
const FLAG_KL_INFINITE: u32 = 4u;
// grpo-core's D_MIN: floor of a shift or log-probability before exp (e^−88 is below the smallest
// normal f32, so a floored column contributes nothing measurable).
const LOGP_MIN: f32 = -88.0;
// grpo-core's LOG_RATIO_FLOOR = −2^64: floor of a shift where it enters a log-ratio (KL terms);
// it keeps −∞ − (−∞) and overflowed shifts finite and bounds every term.
const LOG_RATIO_FLOOR: f32 = -18446744073709551616.0;

// A shift x − m (≤ 0, or −∞ once it overflowed) floored at `floor`, tested on its bits.
fn floor_shift(d: f32, floor: f32) -> f32 {
    return select(floor, rmax(floor, d), is_finite_bits(d));
}

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
        // c = e^{m_old − x} ≤ 1, and t shifts to the new m. The shift is floored at D_MIN as in
        // grpo-core (LseState::merge): it overflows for maxima of opposite signs near f32::MAX.
        let d = floor_shift(a.m - x, LOGP_MIN);
        let c = exp(d);
        return Online(x, fma(c, a.s, c), c * fma(d, a.s + 1.0, a.t));
    }
    let d = floor_shift(x - a.m, LOGP_MIN);
    let e = exp(d);
    return Online(a.m, a.s + e, fma(e, d, a.t));
}

// Merge `lo` into `hi` where hi.m ≥ lo.m and both are non-empty (shift floored as above).
fn online_absorb(hi: Online, lo: Online) -> Online {
    let d = floor_shift(lo.m - hi.m, LOGP_MIN);
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
var<workgroup> wz: array<f32, WG>;
var<workgroup> wbad: atomic<u32>;
var<workgroup> wover: atomic<u32>;

// Fixed pairwise tree over the 256 lane states, and alongside it the maximum of the lanes' raw
// (unscaled) logits `z` (read `wz[0]` after the call; NEG_BIG where unused). Called from uniform
// control flow by every invocation (it contains barriers); every invocation gets the merged
// state.
fn workgroup_reduce(lid: u32, st: Online, z: f32) -> Online {
    wm[lid] = st.m;
    ws[lid] = st.s;
    wt[lid] = st.t;
    wz[lid] = z;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride >> 1u) {
        if lid < stride {
            let r = online_merge(Online(wm[lid], ws[lid], wt[lid]),
                                 Online(wm[lid + stride], ws[lid + stride], wt[lid + stride]));
            wm[lid] = r.m;
            ws[lid] = r.s;
            wt[lid] = r.t;
            wz[lid] = rmax(wz[lid], wz[lid + stride]);
        }
        workgroupBarrier();
    }
    return Online(wm[0], ws[0], wt[0]);
}

// A lane's part of a row: its online state of the scaled logits x = z/T and the largest raw
// logit z it saw (grpo-core's `validate::target` and log-probabilities shift the raw logits).
struct Scan {
    st: Online,
    z: f32,
}

// Pass over one row: the lane's online state; non-finite (NaN, +∞) columns lower `wbad`;
// −∞ columns are masked vocabulary entries and contribute exactly nothing.
fn scan_row(row_ok: bool, row: u32, lid: u32) -> Scan {
    var st = online_empty();
    var zmax = NEG_BIG;
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
            zmax = rmax(zmax, z);
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
    return Scan(st, zmax);
}

struct RowStats {
    lse: f32,
    ln_s: f32,
    entropy: f32,
    logp: f32,
    flags: u32,
}

// `zmax` is the row's largest raw logit (r.m = zmax/T rounded).
fn row_stats(row: u32, r: Online, zmax: f32) -> RowStats {
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
    // grpo-core's target check and log-probability: the shift (z_y − max z)/T of the raw
    // logits must be finite (a −∞ target, or one so far below the maximum that the shift
    // overflows, is an error); logp = shift − ln(1 + s). z_y − max z is exact when z_y is near
    // the maximum (Sterbenz), so logp keeps its relative accuracy even when lse is large.
    var dy = 0.0;
    if !is_neg_inf_bits(zy) {
        dy = (zy - zmax) * params.inv_temp;
    }
    if is_neg_inf_bits(zy) || !is_finite_bits(dy) {
        out.flags = out.flags | FLAG_TARGET_NON_FINITE;
    } else {
        out.logp = dy - ln_s;
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
    let sc = scan_row(row_ok, row, lid);
    let r = workgroup_reduce(lid, sc.st, sc.z);
    let zmax = wz[0];
    let bad = atomicLoad(&wbad);
    let over = atomicLoad(&wover);
    if row_ok && lid == 0u {
        let o = row_stats(row, r, zmax);
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
    let sc = scan_row(row_ok, row, lid);
    let r = workgroup_reduce(lid, sc.st, sc.z);
    let zmax = wz[0];
    let bad = atomicLoad(&wbad);
    let over = atomicLoad(&wover);
    if row_ok {
        let o = row_stats(row, r, zmax);
        let g_lp = upstream[row * 2u];
        let g_h = upstream[row * 2u + 1u];
        let y = targets[row];
        let start = params.base + row * params.vocab;
        let out0 = row * params.vocab;
        for (var v = lid; v < params.vocab; v += WG) {
            let z = load_logit(start + v);
            var g = 0.0;
            // grpo-core's grad_step: log p = (z − max z)/T − ln s floored at D_MIN; a shift that
            // overflows (p = 0 there too) leaves the gradient 0, as a masked logit does.
            var dz = 0.0;
            if !is_neg_inf_bits(z) {
                dz = (z - zmax) * params.inv_temp;
            }
            if !is_neg_inf_bits(z) && is_finite_bits(dz) {
                let lp = rmax(dz - o.ln_s, LOGP_MIN);
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

// KL(p‖q) between p = softmax(student/T) and q = softmax(teacher/T) [grpo-core's kl_rows], in
// grpo-core's form KL = (ln S_q − ln S_p) + u/S_p with u = Σ_v e^{dp_v}·(⌊dp_v⌋ − ⌊dq_v⌋), where
// dp_v = x_p − m_p and dq_v = x_q − m_q are the shifts of the scaled logits to their row maxima,
// S = Σ e^{d} the row sums and ⌊·⌋ the floor at LOG_RATIO_FLOOR (canon.rs: pair_step, finish_kl).
// The shifts are relative to the *final* maxima, so the row maxima never enter the value (in a
// single pass they would: Σ p·(x_p − x_q) and m_q − m_p cancel, losing everything to the size of
// logits near ±f32::MAX, or ulp(|x|) for merely large ones). Two passes over both rows, as JSD:
// the online (max, sum) state of each row, then the terms.
//
// Status per row, 4 words: word 0 = first column where either row holds NaN or +∞ (NO_INDEX if
// none); word 1 = flags (FLAG_EMPTY_ROW: a row has no usable logit; FLAG_KL_INFINITE: the teacher
// is −∞ where the student has mass; FLAG_SCALE_OVERFLOW: a finite logit of either row has a
// non-finite z/T); words 2, 3 unused. Any of these (or a non-finite value) sends the row to
// grpo-core on the host, which gives the exact error or the value. stats = (lse_p, lse_q, 0, KL).
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
    // Pass 1: online state of each row.
    var sp = online_empty();
    var sq = online_empty();
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
            if q_masked && !p_masked {
                atomicOr(&wflags, FLAG_KL_INFINITE);
            }
            sp = pair_push(sp, zp);
            sq = pair_push(sq, zq);
        }
    }
    let rp = workgroup_reduce(lid, sp, NEG_BIG);
    // Every invocation has read the student's result from slot 0 before the teacher's tree
    // overwrites it.
    workgroupBarrier();
    let rq = workgroup_reduce(lid, sq, NEG_BIG);
    let sp1 = rmax(rp.s + 1.0, 1.0);
    let sq1 = rmax(rq.s + 1.0, 1.0);
    let usable = rp.s >= 0.0 && rq.s >= 0.0;
    // Pass 2: the lane's part of u (same strided columns as pass 1). Columns where the student
    // has no mass (masked, overflowed, or e^{dp} below e^{D_MIN}) add nothing.
    var acc = 0.0;
    if row_ok && usable {
        let start = params.base + row * params.vocab;
        for (var v = lid; v < params.vocab; v += WG) {
            let xp = load_logit(start + v) * params.inv_temp;
            let xq = load_teacher(start + v) * params.inv_temp;
            if !is_finite_bits(xp) {
                continue;
            }
            let dp = xp - rp.m;
            if !(floor_shift(dp, LOGP_MIN) > LOGP_MIN) {
                continue;
            }
            // A non-finite x_q (masked, or overflowed) is flagged above; its shift floors.
            var dq = LOG_RATIO_FLOOR;
            if is_finite_bits(xq) {
                dq = floor_shift(xq - rq.m, LOG_RATIO_FLOOR);
            }
            acc = fma(exp(dp), dp - dq, acc);
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
    let bad = atomicLoad(&wbad);
    let flags_in = atomicLoad(&wflags);
    if row_ok && lid == 0u {
        var flags = flags_in;
        var value = 0.0;
        if !usable {
            flags = flags | FLAG_EMPTY_ROW;
        } else {
            value = (log(sq1) - log(sp1)) + wt[0] / sp1;
        }
        stats[row * 4u] = rp.m + log(sp1);
        stats[row * 4u + 1u] = rq.m + log(sq1);
        stats[row * 4u + 2u] = 0.0;
        stats[row * 4u + 3u] = value;
        status[row * 4u] = bad;
        status[row * 4u + 1u] = flags;
        status[row * 4u + 2u] = NO_INDEX;
        status[row * 4u + 3u] = 0u;
    }
}

// Adds one logit to a row's online state (kl, jsd): NaN/+∞ are skipped (the caller records
// them), a finite logit whose z/T overflows sets FLAG_SCALE_OVERFLOW in `wflags`, −∞ (masked)
// contributes nothing.
fn pair_push(st: Online, z: f32) -> Online {
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
// Smallest normal f32: floor of the mixture's scaled weight before its log (only a subnormal β
// can reach it, and then the term it multiplies is below 1e-36).
const MIN_NORMAL: f32 = 1.17549435e-38;

var<workgroup> wbad_q: atomic<u32>;

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
            sp = pair_push(sp, zp);
            sq = pair_push(sq, zq);
        }
    }
    let rp = workgroup_reduce(lid, sp, NEG_BIG);
    // Every invocation has read the student's result from slot 0 before the teacher's tree
    // overwrites it.
    workgroupBarrier();
    let rq = workgroup_reduce(lid, sq, NEG_BIG);
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
