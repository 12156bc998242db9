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
// The in-place saved backward's gradient in the logits' storage type (`PER_WORD` elements per
// word, `narrow` in the storage prelude), which the host writes over the logits.
@group(0) @binding(8) var<storage, read_write> grad_words: array<u32>;

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

// One column z (at index v) of a lane's pass. Non-finite columns (NaN, +∞) lower `wbad`; −∞
// columns are masked vocabulary entries and contribute exactly nothing; a finite z whose z/T
// overflows to +∞ lowers `wover` (grpo-core reports it), to −∞ contributes nothing. The common
// case is tested first and alone: x = z/T finite implies z finite (1/T is finite and positive).
fn scan_push(sc: ptr<function, Scan>, z: f32, v: u32) {
    let x = z * params.inv_temp;
    if is_finite_bits(x) {
        (*sc).z = rmax((*sc).z, z);
        (*sc).st = online_push((*sc).st, x);
        return;
    }
    if is_neg_inf_bits(z) {
        return;
    }
    if !is_finite_bits(z) {
        atomicMin(&wbad, v);
        return;
    }
    (*sc).z = rmax((*sc).z, z);
    if x > 0.0 {
        atomicMin(&wover, v);
    }
}

// |z| as bits: ≥ EXP_MASK exactly for NaN and ±∞.
fn abs_bits(z: f32) -> u32 {
    return bitcast<u32>(z) & 0x7fffffffu;
}

// Columns a lane loads before it pushes the first of them in `scan_row`.
const SCAN_BATCH: u32 = 16u;

// Pass over one row: the lane's online state of columns lid, lid + 256, lid + 512, … The
// columns are loaded SCAN_BATCH at a time before any of them is used: a GPU hides memory latency
// with loads in flight, and one load per loop iteration (each waiting on the previous push's
// branch) leaves a large GPU far below its bandwidth. A batch whose columns are all finite (the
// common case) then takes a fast path with about 10 operations per column instead of the ~25 of
// `scan_push`'s tests and branches; any other batch (masked, NaN, overflowing columns) is pushed
// column by column with the exact per-column rules. On an NVIDIA H200 (2048 × 151936 f32) the
// fused forward took 0.90 ms with one load per iteration (one run), 0.54–0.61 ms with 8 or 16
// loads in flight and 0.42–0.45 ms with the fast path as well (medians of 30, warm GPU). The fast path sums a batch before adding
// it to the state, so the rounding differs from a one-column loop's by a few ULP of the sums
// (within the accuracy contract the tests check against f64).
fn scan_row(row_ok: bool, row: u32, lid: u32) -> Scan {
    var sc = Scan(online_empty(), NEG_BIG);
    if row_ok {
        let start = params.base + row * params.vocab;
        let n = params.vocab;
        var v = lid;
        // `n − v > (SCAN_BATCH − 1)·WG` (with v < n) avoids overflowing v + (SCAN_BATCH − 1)·WG.
        for (; v < n && n - v > (SCAN_BATCH - 1u) * WG; v += SCAN_BATCH * WG) {
            let i = start + v;
            let z0 = load_logit(i);
            let z1 = load_logit(i + WG);
            let z2 = load_logit(i + 2u * WG);
            let z3 = load_logit(i + 3u * WG);
            let z4 = load_logit(i + 4u * WG);
            let z5 = load_logit(i + 5u * WG);
            let z6 = load_logit(i + 6u * WG);
            let z7 = load_logit(i + 7u * WG);
            let z8 = load_logit(i + 8u * WG);
            let z9 = load_logit(i + 9u * WG);
            let z10 = load_logit(i + 10u * WG);
            let z11 = load_logit(i + 11u * WG);
            let z12 = load_logit(i + 12u * WG);
            let z13 = load_logit(i + 13u * WG);
            let z14 = load_logit(i + 14u * WG);
            let z15 = load_logit(i + 15u * WG);
            // The batch's largest raw logit and largest magnitude (as bits: any NaN or ±∞
            // makes it ≥ EXP_MASK), and the lane's largest raw logit zm with this batch.
            let zb = max(max(max(max(z0, z1), max(z2, z3)), max(max(z4, z5), max(z6, z7))),
                         max(max(max(z8, z9), max(z10, z11)), max(max(z12, z13), max(z14, z15))));
            let ab = max(max(max(max(abs_bits(z0), abs_bits(z1)), max(abs_bits(z2), abs_bits(z3))),
                             max(max(abs_bits(z4), abs_bits(z5)), max(abs_bits(z6), abs_bits(z7)))),
                         max(max(max(abs_bits(z8), abs_bits(z9)), max(abs_bits(z10), abs_bits(z11))),
                             max(max(abs_bits(z12), abs_bits(z13)), max(abs_bits(z14), abs_bits(z15)))));
            let tau = params.inv_temp;
            var zm = zb;
            if sc.st.s >= 0.0 {
                zm = rmax(sc.z, zb);
            }
            if ab < EXP_MASK && is_finite_bits((abs(zm) + bitcast<f32>(ab)) * tau) {
                // Fast path: every column finite, and every (z − zm)/T finite, so the
                // per-column tests of `scan_push` cannot fire. The state moves to the new
                // maximum m = zm/T once (rounding is monotone and 1/T > 0, so it is the largest
                // x = z/T); then each column adds e = e^{max((z − zm)/T, D_MIN)} to a batch sum
                // and e·(z − zm)/T to t. The shift is taken on the raw logits, so the maximum's
                // own shift is 0·(1/T) = 0 exactly: a driver that fuses z·(1/T) − m into one
                // FMA (NVIDIA's Vulkan driver does) would leave it ±½ ULP of m instead, and
                // e^{−δ} < 1 below. The maximum's term e^0 = 1 is taken out of the batch sum
                // again (`excl`), as `online_push` keeps it out; the result is ≥ 0 (a sum of
                // non-negative terms holding that 1), and it is clamped there all the same,
                // because s < 0 marks the empty state.
                let m = zm * tau;
                var st = sc.st;
                var excl = 0.0;
                if st.s < 0.0 {
                    st = Online(m, 0.0, 0.0);
                    excl = 1.0;
                } else if m > st.m {
                    let d = floor_shift(st.m - m, LOGP_MIN);
                    let c = exp(d);
                    st = Online(m, fma(c, st.s, c), c * fma(d, st.s + 1.0, st.t));
                    excl = 1.0;
                }
                var sb = 0.0;
                var t = st.t;
                var d = 0.0;
                var e = 0.0;
                d = rmax((z0 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                d = rmax((z1 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                d = rmax((z2 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                d = rmax((z3 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                d = rmax((z4 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                d = rmax((z5 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                d = rmax((z6 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                d = rmax((z7 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                d = rmax((z8 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                d = rmax((z9 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                d = rmax((z10 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                d = rmax((z11 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                d = rmax((z12 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                d = rmax((z13 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                d = rmax((z14 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                d = rmax((z15 - zm) * tau, LOGP_MIN);
                e = exp(d);
                sb = sb + e;
                t = fma(e, d, t);
                sc.st = Online(m, rmax(st.s + (sb - excl), 0.0), t);
                sc.z = rmax(sc.z, zb);
                continue;
            }
            scan_push(&sc, z0, v);
            scan_push(&sc, z1, v + WG);
            scan_push(&sc, z2, v + 2u * WG);
            scan_push(&sc, z3, v + 3u * WG);
            scan_push(&sc, z4, v + 4u * WG);
            scan_push(&sc, z5, v + 5u * WG);
            scan_push(&sc, z6, v + 6u * WG);
            scan_push(&sc, z7, v + 7u * WG);
            scan_push(&sc, z8, v + 8u * WG);
            scan_push(&sc, z9, v + 9u * WG);
            scan_push(&sc, z10, v + 10u * WG);
            scan_push(&sc, z11, v + 11u * WG);
            scan_push(&sc, z12, v + 12u * WG);
            scan_push(&sc, z13, v + 13u * WG);
            scan_push(&sc, z14, v + 14u * WG);
            scan_push(&sc, z15, v + 15u * WG);
        }
        for (; v < n; v += WG) {
            scan_push(&sc, load_logit(start + v), v);
        }
    }
    return sc;
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
    forward_row(wid.x, lid, false);
}

// Fused forward that also saves each row's softmax state for `backward_saved` [grpo-core's
// logprob_entropy_rows_saved]: what `forward` writes, plus grpo-core's LseState in binding 6
// (`grad`, 4 floats per row): (reference = the raw maximum, Σ e^{d} with the maximum's own 1,
// Σ e^{d}·d, 0), d = (z − max z)/T as the scan shifts.
@compute @workgroup_size(256)
fn forward_saved(@builtin(workgroup_id) wid: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    forward_row(wid.x, lid, true);
}

fn forward_row(row: u32, lid: u32, save: bool) {
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
        if save {
            grad[row * 4u] = zmax;
            grad[row * 4u + 1u] = rmax(r.s + 1.0, 1.0);
            grad[row * 4u + 2u] = r.t;
            grad[row * 4u + 3u] = 0.0;
        }
    }
}

// ∂/∂z_v of g_lp·logp(y) + g_H·H for column v holding z (row statistics o, raw maximum zmax).
// grpo-core's grad_step: log p = (z − max z)/T − ln s floored at D_MIN; a shift that overflows
// (p = 0 there too) leaves the gradient 0, as a masked logit does.
fn grad_at(z: f32, v: u32, y: u32, o: RowStats, zmax: f32, g_lp: f32, g_h: f32) -> f32 {
    var g = 0.0;
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
    return g * params.inv_temp;
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
        let n = params.vocab;
        var v = lid;
        // SCAN_BATCH columns loaded before the first is used, as in `scan_row`.
        for (; v < n && n - v > (SCAN_BATCH - 1u) * WG; v += SCAN_BATCH * WG) {
            let i = start + v;
            let z0 = load_logit(i);
            let z1 = load_logit(i + WG);
            let z2 = load_logit(i + 2u * WG);
            let z3 = load_logit(i + 3u * WG);
            let z4 = load_logit(i + 4u * WG);
            let z5 = load_logit(i + 5u * WG);
            let z6 = load_logit(i + 6u * WG);
            let z7 = load_logit(i + 7u * WG);
            let z8 = load_logit(i + 8u * WG);
            let z9 = load_logit(i + 9u * WG);
            let z10 = load_logit(i + 10u * WG);
            let z11 = load_logit(i + 11u * WG);
            let z12 = load_logit(i + 12u * WG);
            let z13 = load_logit(i + 13u * WG);
            let z14 = load_logit(i + 14u * WG);
            let z15 = load_logit(i + 15u * WG);
            let j = out0 + v;
            grad[j] = grad_at(z0, v, y, o, zmax, g_lp, g_h);
            grad[j + WG] = grad_at(z1, v + WG, y, o, zmax, g_lp, g_h);
            grad[j + 2u * WG] = grad_at(z2, v + 2u * WG, y, o, zmax, g_lp, g_h);
            grad[j + 3u * WG] = grad_at(z3, v + 3u * WG, y, o, zmax, g_lp, g_h);
            grad[j + 4u * WG] = grad_at(z4, v + 4u * WG, y, o, zmax, g_lp, g_h);
            grad[j + 5u * WG] = grad_at(z5, v + 5u * WG, y, o, zmax, g_lp, g_h);
            grad[j + 6u * WG] = grad_at(z6, v + 6u * WG, y, o, zmax, g_lp, g_h);
            grad[j + 7u * WG] = grad_at(z7, v + 7u * WG, y, o, zmax, g_lp, g_h);
            grad[j + 8u * WG] = grad_at(z8, v + 8u * WG, y, o, zmax, g_lp, g_h);
            grad[j + 9u * WG] = grad_at(z9, v + 9u * WG, y, o, zmax, g_lp, g_h);
            grad[j + 10u * WG] = grad_at(z10, v + 10u * WG, y, o, zmax, g_lp, g_h);
            grad[j + 11u * WG] = grad_at(z11, v + 11u * WG, y, o, zmax, g_lp, g_h);
            grad[j + 12u * WG] = grad_at(z12, v + 12u * WG, y, o, zmax, g_lp, g_h);
            grad[j + 13u * WG] = grad_at(z13, v + 13u * WG, y, o, zmax, g_lp, g_h);
            grad[j + 14u * WG] = grad_at(z14, v + 14u * WG, y, o, zmax, g_lp, g_h);
            grad[j + 15u * WG] = grad_at(z15, v + 15u * WG, y, o, zmax, g_lp, g_h);
        }
        for (; v < n; v += WG) {
            grad[out0 + v] = grad_at(load_logit(start + v), v, y, o, zmax, g_lp, g_h);
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

// The backward from saved row states [grpo-core's backward_rows_saved]: the host validated the
// states (grpo-core's validate::backward_saved) and turned each into grpo-core's per-row
// coefficients (SavedState::coef → canon::GradCoef), so this pass has no reduction: one read of
// each logit (and, with a KL term, teacher logit) and one write of its gradient.
//
// Coefficients per row in binding 7 (`upstream`, SAVED_COEF floats): the student's log-softmax
// (reference, −ln Σ), H, the weights g_lp, g_H, g_KL, the teacher's log-softmax (reference,
// −ln Σ), KL(p‖q), and three unused. The target of each row is in binding 1 (NO_INDEX without a
// log-probability term).
//
// The JSD's gradient from saved states [grpo-core's jsd_backward_rows_saved] is the divergence
// term KL_JSD of the same passes, with no other term: the log-softmaxes of its state, the row
// constant K = KL(p‖m) in the KL's slot, c = (g·(1 − β))·τ in g_KL's, and β, 1 − β, −ln(1 − β)
// in the last three (from the host, as the uniform parameters of `jsd`).
const SAVED_COEF: u32 = 12u;
const KL_NONE: u32 = 0u;
const KL_STUDENT_TEACHER: u32 = 1u;
const KL_TEACHER_STUDENT: u32 = 2u;
const KL_JSD: u32 = 3u;

struct SavedCoef {
    p_max: f32,
    p_neg_ln_sum: f32,
    h: f32,
    g_lp: f32,
    g_h: f32,
    g_kl: f32,
    q_max: f32,
    q_neg_ln_sum: f32,
    kl: f32,
    beta: f32,
    one_minus_beta: f32,
    neg_ln_one_minus_beta: f32,
}

fn saved_coef(row: u32) -> SavedCoef {
    let b = row * SAVED_COEF;
    return SavedCoef(upstream[b], upstream[b + 1u], upstream[b + 2u], upstream[b + 3u],
                     upstream[b + 4u], upstream[b + 5u], upstream[b + 6u], upstream[b + 7u],
                     upstream[b + 8u], upstream[b + 9u], upstream[b + 10u], upstream[b + 11u]);
}

// grpo-core's log_prob fma(z − max, τ, −ln Σ) floored at LOG_RATIO_FLOOR, its −∞ (a masked
// logit, or a shift that overflows) taken to the floor on its bits: every use of it floors it at
// LOG_RATIO_FLOOR or higher (canon::grad_step).
fn saved_log_prob(z: f32, mx: f32, neg_ln_sum: f32) -> f32 {
    if is_neg_inf_bits(z) {
        return LOG_RATIO_FLOOR;
    }
    let d = (z - mx) * params.inv_temp;
    if !is_finite_bits(d) {
        return LOG_RATIO_FLOOR;
    }
    return rmax(LOG_RATIO_FLOOR, fma(z - mx, params.inv_temp, neg_ln_sum));
}

// grpo-core's canon::grad_step for column v (student logit z, teacher logit w): with
// lp = log p_v, lpc = max(D_MIN, lp), p = e^{lpc} (grpo-core also clamps lpc at D_MAX = 88, which
// changes nothing for the logits the states came from; for others — not validated, as in
// grpo-core — this shader's results are not grpo-core's: a non-finite shift counts as masked,
// and e^{lpc} overflows to +∞ past 88.72):
//   k = g_H·(lpc + H) + g_lp,  o = g_lp·1[v = y]
//   KL(p‖q): k −= g_KL·(lp − lq − KL);  KL(q‖p): k −= g_KL, o −= g_KL·q_v
//   grad = (o − p·k)/T.
fn saved_grad(z: f32, w: f32, is_target: bool, c: SavedCoef, kl: u32) -> f32 {
    if kl == KL_JSD {
        return jsd_saved_grad(z, w, c);
    }
    let lp = saved_log_prob(z, c.p_max, c.p_neg_ln_sum);
    let lpc = rmax(LOGP_MIN, lp);
    let p = exp(lpc);
    var k = fma(c.g_h, lpc + c.h, c.g_lp);
    var o = select(0.0, c.g_lp, is_target);
    if kl == KL_STUDENT_TEACHER {
        let lq = saved_log_prob(w, c.q_max, c.q_neg_ln_sum);
        k = fma(-c.g_kl, (lp - lq) - c.kl, k);
    } else if kl == KL_TEACHER_STUDENT {
        let lq = saved_log_prob(w, c.q_max, c.q_neg_ln_sum);
        k = k - c.g_kl;
        o = fma(-c.g_kl, exp(rmax(LOGP_MIN, lq)), o);
    }
    return fma(-p, k, o) * params.inv_temp;
}

// grpo-core's canon::jsd_grad_step for column v from a saved JSD state (KL_JSD above):
// c·p_v·((log p_v − log m_v) − K), the log-ratio relative to max(log p, log q) as in `jsd_row`.
// A student column with p_v = 0 (masked, an overflowing shift, or log p_v at the −88 floor,
// where grpo-core's p_v is 0) gets 0; a teacher column with q_v = 0 the log-ratio −ln(1 − β).
fn jsd_saved_grad(z: f32, w: f32, c: SavedCoef) -> f32 {
    let lp = saved_log_prob(z, c.p_max, c.p_neg_ln_sum);
    if lp <= LOGP_MIN {
        return 0.0;
    }
    let lq = rmax(LOGP_MIN, saved_log_prob(w, c.q_max, c.q_neg_ln_sum));
    let ratio = jsd_log_ratio_with(lp, lq, lq > LOGP_MIN, c.beta, c.one_minus_beta,
                                   c.neg_ln_one_minus_beta);
    return (exp(lp) * (ratio - c.kl)) * c.g_kl;
}

// One row of the saved backward. Columns are loaded SAVED_BATCH at a time before the first is
// used (as `scan_row` does, so that loads are in flight together).
const SAVED_BATCH: u32 = 4u;

fn saved_row(row: u32, lid: u32, kl: u32) {
    if row >= params.rows {
        return;
    }
    let c = saved_coef(row);
    let y = targets[row];
    let start = params.base + row * params.vocab;
    let out0 = row * params.vocab;
    let n = params.vocab;
    var v = lid;
    for (; v < n && n - v > (SAVED_BATCH - 1u) * WG; v += SAVED_BATCH * WG) {
        let i = start + v;
        let z0 = load_logit(i);
        let z1 = load_logit(i + WG);
        let z2 = load_logit(i + 2u * WG);
        let z3 = load_logit(i + 3u * WG);
        var w = vec4<f32>(0.0);
        if kl != KL_NONE {
            w = vec4<f32>(load_teacher(i), load_teacher(i + WG), load_teacher(i + 2u * WG),
                          load_teacher(i + 3u * WG));
        }
        let j = out0 + v;
        grad[j] = saved_grad(z0, w.x, v == y, c, kl);
        grad[j + WG] = saved_grad(z1, w.y, v + WG == y, c, kl);
        grad[j + 2u * WG] = saved_grad(z2, w.z, v + 2u * WG == y, c, kl);
        grad[j + 3u * WG] = saved_grad(z3, w.w, v + 3u * WG == y, c, kl);
    }
    for (; v < n; v += WG) {
        var w = 0.0;
        if kl != KL_NONE {
            w = load_teacher(start + v);
        }
        grad[out0 + v] = saved_grad(load_logit(start + v), w, v == y, c, kl);
    }
}

// The saved backward written in the logits' storage type [grpo-core's
// backward_rows_in_place_saved]: each element's gradient as `saved_row` computes it, rounded by
// the storage prelude's `narrow` and packed PER_WORD to a word of `grad_words`, element i of the
// chunk (row i / vocab, column i mod vocab) in word i / PER_WORD. Row `row`'s workgroup writes
// the words whose first element is in the row, so with an odd vocabulary of 16-bit logits a
// word's second element may be the next row's first, computed here with that row's
// coefficients and target (every word has one writer); past the chunk's last element a word is
// padded with zeros.
fn saved_row_in_place(row: u32, lid: u32, kl: u32) {
    if row >= params.rows {
        return;
    }
    let n = params.vocab;
    let first = row * n;
    let end = first + n;
    let c = saved_coef(row);
    let y = targets[row];
    // Words [k0, k1) have their first element in this row; [k0, whole) lie wholly in it.
    let k0 = (first + PER_WORD - 1u) / PER_WORD;
    let k1 = (end + PER_WORD - 1u) / PER_WORD;
    let whole = end / PER_WORD;
    for (var k = k0 + lid; k < whole; k += WG) {
        var word = 0u;
        for (var h = 0u; h < PER_WORD; h++) {
            let i = k * PER_WORD + h;
            word = word | (narrow(saved_elem(i, i - first, y, c, kl)) << (16u * h));
        }
        grad_words[k] = word;
    }
    // The row's last word, when it reaches into the next row (or past the chunk's end).
    if lid == 0u && whole < k1 {
        let i = whole * PER_WORD;
        var word = narrow(saved_elem(i, i - first, y, c, kl));
        if end < params.rows * n {
            let next = saved_elem(end, 0u, targets[row + 1u], saved_coef(row + 1u), kl);
            word = word | (narrow(next) << 16u);
        }
        grad_words[whole] = word;
    }
}

// The saved gradient of element i of the chunk (column v of its row; y the row's target, c its
// coefficients).
fn saved_elem(i: u32, v: u32, y: u32, c: SavedCoef, kl: u32) -> f32 {
    let j = params.base + i;
    var w = 0.0;
    if kl != KL_NONE {
        w = load_teacher(j);
    }
    return saved_grad(load_logit(j), w, v == y, c, kl);
}

// No barrier in these eight, so returning early (rows past the chunk) is allowed.
@compute @workgroup_size(256)
fn backward_saved(@builtin(workgroup_id) wid: vec3<u32>,
                  @builtin(local_invocation_index) lid: u32) {
    saved_row(wid.x, lid, KL_NONE);
}

@compute @workgroup_size(256)
fn backward_saved_kl_student_teacher(@builtin(workgroup_id) wid: vec3<u32>,
                             @builtin(local_invocation_index) lid: u32) {
    saved_row(wid.x, lid, KL_STUDENT_TEACHER);
}

@compute @workgroup_size(256)
fn backward_saved_kl_teacher_student(@builtin(workgroup_id) wid: vec3<u32>,
                             @builtin(local_invocation_index) lid: u32) {
    saved_row(wid.x, lid, KL_TEACHER_STUDENT);
}

@compute @workgroup_size(256)
fn backward_saved_in_place(@builtin(workgroup_id) wid: vec3<u32>,
                           @builtin(local_invocation_index) lid: u32) {
    saved_row_in_place(wid.x, lid, KL_NONE);
}

@compute @workgroup_size(256)
fn backward_saved_in_place_kl_student_teacher(@builtin(workgroup_id) wid: vec3<u32>,
                                      @builtin(local_invocation_index) lid: u32) {
    saved_row_in_place(wid.x, lid, KL_STUDENT_TEACHER);
}

@compute @workgroup_size(256)
fn backward_saved_in_place_kl_teacher_student(@builtin(workgroup_id) wid: vec3<u32>,
                                      @builtin(local_invocation_index) lid: u32) {
    saved_row_in_place(wid.x, lid, KL_TEACHER_STUDENT);
}

@compute @workgroup_size(256)
fn jsd_backward_saved(@builtin(workgroup_id) wid: vec3<u32>,
                      @builtin(local_invocation_index) lid: u32) {
    saved_row(wid.x, lid, KL_JSD);
}

@compute @workgroup_size(256)
fn jsd_backward_saved_in_place(@builtin(workgroup_id) wid: vec3<u32>,
                               @builtin(local_invocation_index) lid: u32) {
    saved_row_in_place(wid.x, lid, KL_JSD);
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
// is −∞ where the student has mass; FLAG_KL_TEACHER_STUDENT_INFINITE: the other way round;
// FLAG_SCALE_OVERFLOW: a finite logit of either row has a non-finite z/T); words 2, 3 unused. Any
// of these (or a non-finite value) sends the row to grpo-core on the host, which gives the exact
// error or the value (the host reads the support flag of the direction it asked for; in
// `kl_saved` with KL(q‖p), FLAG_KL_INFINITE instead makes the host record u = +∞ in the row's
// state, as grpo-core does).
// stats = (lse_p, lse_q, 0 — KL(q‖p) in `kl_saved` —, KL(p‖q)).
var<workgroup> wflags: atomic<u32>;

@compute @workgroup_size(256)
fn kl(@builtin(workgroup_id) wid: vec3<u32>,
      @builtin(local_invocation_index) lid: u32) {
    kl_row(wid.x, lid, false);
}

// `kl` that also saves each row pair's state for `backward_saved_kl_*` [grpo-core's
// kl_rows_saved]: grpo-core's PairState in binding 6 (`grad`, 8 floats per row: the student's
// reference = raw maximum, Σ e^{dp}, Σ e^{dp}·dp, the teacher's three, u = Σ e^{dp}(⌊dp⌋ − ⌊dq⌋),
// v = Σ e^{dq}(⌊dq⌋ − ⌊dp⌋)), and KL(q‖p) = (ln S_p − ln S_q) + v/S_q in stats slot 2. The
// host passes the student as the first row whatever the direction; FLAG_KL_TEACHER_STUDENT_INFINITE
// marks a row where the student is −∞ where the teacher has mass (KL(q‖p) = +∞).
@compute @workgroup_size(256)
fn kl_saved(@builtin(workgroup_id) wid: vec3<u32>,
            @builtin(local_invocation_index) lid: u32) {
    kl_row(wid.x, lid, true);
}

const FLAG_KL_TEACHER_STUDENT_INFINITE: u32 = 32u;

fn kl_row(row: u32, lid: u32, save: bool) {
    let row_ok = row < params.rows;
    if lid == 0u {
        atomicStore(&wbad, NO_INDEX);
        atomicStore(&wflags, 0u);
    }
    workgroupBarrier();
    // Pass 1: online state of each row, and (to save the states) each row's largest raw logit
    // among those the state holds.
    var sp = online_empty();
    var sq = online_empty();
    var zp_max = NEG_BIG;
    var zq_max = NEG_BIG;
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
            if p_masked && !q_masked {
                atomicOr(&wflags, FLAG_KL_TEACHER_STUDENT_INFINITE);
            }
            sp = pair_push(sp, zp);
            sq = pair_push(sq, zq);
            if save {
                if !p_masked && is_finite_bits(zp * params.inv_temp) {
                    zp_max = rmax(zp_max, zp);
                }
                if !q_masked && is_finite_bits(zq * params.inv_temp) {
                    zq_max = rmax(zq_max, zq);
                }
            }
        }
    }
    let rp = workgroup_reduce(lid, sp, zp_max);
    let zp_ref = wz[0];
    // Every invocation has read the student's results from slot 0 before the teacher's tree
    // overwrites them.
    workgroupBarrier();
    let rq = workgroup_reduce(lid, sq, zq_max);
    let zq_ref = wz[0];
    let sp1 = rmax(rp.s + 1.0, 1.0);
    let sq1 = rmax(rq.s + 1.0, 1.0);
    let usable = rp.s >= 0.0 && rq.s >= 0.0;
    // Pass 2: the lane's part of u (same strided columns as pass 1), and to save the states of
    // v. Columns where the expectation's row has no mass (masked, overflowed, or e^{d} below
    // e^{D_MIN}) add nothing; a non-finite x (masked, or overflowed: flagged above) has its
    // shift floored.
    var acc = 0.0;
    var acc_v = 0.0;
    if row_ok && usable {
        let start = params.base + row * params.vocab;
        for (var v = lid; v < params.vocab; v += WG) {
            let xp = load_logit(start + v) * params.inv_temp;
            let xq = load_teacher(start + v) * params.inv_temp;
            var dp = LOG_RATIO_FLOOR;
            if is_finite_bits(xp) {
                dp = floor_shift(xp - rp.m, LOG_RATIO_FLOOR);
            }
            var dq = LOG_RATIO_FLOOR;
            if is_finite_bits(xq) {
                dq = floor_shift(xq - rq.m, LOG_RATIO_FLOOR);
            }
            if dp > LOGP_MIN {
                acc = fma(exp(dp), dp - dq, acc);
            }
            if save && dq > LOGP_MIN {
                acc_v = fma(exp(dq), dq - dp, acc_v);
            }
        }
    }
    // One fixed pairwise tree over the lane sums, u in `wt` and v in `ws` side by side (each the
    // same pairwise order as a tree of its own; every invocation read slot 0 of the teacher's
    // state tree before the first write). `kl` adds its zero v beside u at no extra barrier.
    workgroupBarrier();
    wt[lid] = acc;
    ws[lid] = acc_v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride >> 1u) {
        if lid < stride {
            wt[lid] = wt[lid] + wt[lid + stride];
            ws[lid] = ws[lid] + ws[lid + stride];
        }
        workgroupBarrier();
    }
    let u = wt[0];
    let v_sum = ws[0];
    let bad = atomicLoad(&wbad);
    let flags_in = atomicLoad(&wflags);
    if row_ok && lid == 0u {
        var flags = flags_in;
        var value = 0.0;
        var reverse = 0.0;
        if !usable {
            flags = flags | FLAG_EMPTY_ROW;
        } else {
            value = (log(sq1) - log(sp1)) + u / sp1;
            if save {
                reverse = (log(sp1) - log(sq1)) + v_sum / sq1;
            }
        }
        stats[row * 4u] = rp.m + log(sp1);
        stats[row * 4u + 1u] = rq.m + log(sq1);
        stats[row * 4u + 2u] = reverse;
        stats[row * 4u + 3u] = value;
        status[row * 4u] = bad;
        status[row * 4u + 1u] = flags;
        status[row * 4u + 2u] = NO_INDEX;
        status[row * 4u + 3u] = 0u;
        if save {
            let o = row * 8u;
            grad[o] = zp_ref;
            grad[o + 1u] = sp1;
            grad[o + 2u] = rp.t;
            grad[o + 3u] = zq_ref;
            grad[o + 4u] = sq1;
            grad[o + 5u] = rq.t;
            grad[o + 6u] = u;
            grad[o + 7u] = v_sum;
        }
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
        let l = jsd_log_mix(lp, lq, a, beta, omb);
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

// ln(m) − a for a = max(log p, log q) of a column where both sides are unmasked (see
// `jsd_term`), with the mixture's weights β and omb = 1 − β.
fn jsd_log_mix(lp: f32, lq: f32, a: f32, beta: f32, omb: f32) -> f32 {
    let e = exp(rmin(lp, lq) - a);
    let w = select(fma(beta, e, omb), fma(omb, e, beta), lq >= lp);
    return log(rmax(w, MIN_NORMAL));
}

// log p − log m of a column whose student side is unmasked (relative to a = max(log p, log q) as
// in `jsd_term`; −ln(1 − β) where the teacher's is masked): the student's log-ratio to the
// mixture, which the JSD's gradient weights by p. β, 1 − β and −ln(1 − β) are the uniform
// parameters' here, a saved state's in `jsd_saved_grad`.
fn jsd_log_ratio(lp: f32, lq: f32, q_on: bool) -> f32 {
    return jsd_log_ratio_with(lp, lq, q_on, params.beta, params.one_minus_beta,
                              params.neg_ln_one_minus_beta);
}

fn jsd_log_ratio_with(lp: f32, lq: f32, q_on: bool, beta: f32, omb: f32,
                      neg_ln_omb: f32) -> f32 {
    if q_on {
        let a = rmax(lp, lq);
        return (lp - a) - jsd_log_mix(lp, lq, a, beta, omb);
    }
    return neg_ln_omb;
}

// What a `jsd_row` computes: the JSD (`jsd`), the JSD's gradient (`jsd_backward`), or the JSD
// and the state its gradient needs (`jsd_saved`).
const JSD_VALUE: u32 = 0u;
const JSD_GRADIENT: u32 = 1u;
const JSD_SAVE: u32 = 2u;

@compute @workgroup_size(256)
fn jsd(@builtin(workgroup_id) wid: vec3<u32>,
       @builtin(local_invocation_index) lid: u32) {
    jsd_row(wid.x, lid, JSD_VALUE);
}

// `jsd` that also saves each row pair's state for the gradient [grpo-core's jsd_rows_saved]:
// grpo-core's JsdState but β in binding 6 (`grad`, JSD_STATE floats per row: the student's raw
// maximum and −ln Σ, the teacher's two, K = KL(p‖m) = Σ_v p_v (log p_v − log m_v), a second
// tree beside the JSD's, whose bits are `jsd`'s).
const JSD_STATE: u32 = 5u;

@compute @workgroup_size(256)
fn jsd_saved(@builtin(workgroup_id) wid: vec3<u32>,
             @builtin(local_invocation_index) lid: u32) {
    jsd_row(wid.x, lid, JSD_SAVE);
}

// The JSD's gradient with respect to the student logits, grpo-core's `jsd_backward_rows`:
// grad[r, v] = c·p_v·((log p_v − log m_v) − K) with K = KL(p‖m) = Σ_v p_v (log p_v − log m_v)
// (a second tree) and c = (g·(1 − β))·τ, g = upstream[row]. Validation words as `jsd`; stats =
// (lse_p, lse_q, 0, K).
@compute @workgroup_size(256)
fn jsd_backward(@builtin(workgroup_id) wid: vec3<u32>,
                @builtin(local_invocation_index) lid: u32) {
    jsd_row(wid.x, lid, JSD_GRADIENT);
}

// One row pair of `jsd`, `jsd_backward` or `jsd_saved` (`mode`).
fn jsd_row(row: u32, lid: u32, mode: u32) {
    let gradient = mode == JSD_GRADIENT;
    let save = mode == JSD_SAVE;
    let row_ok = row < params.rows;
    if lid == 0u {
        atomicStore(&wbad, NO_INDEX);
        atomicStore(&wbad_q, NO_INDEX);
        atomicStore(&wflags, 0u);
    }
    workgroupBarrier();
    // Pass 1: online state of each row, and (to save the states) each row's largest raw logit
    // among those the state holds.
    var sp = online_empty();
    var sq = online_empty();
    var zp_max = NEG_BIG;
    var zq_max = NEG_BIG;
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
            if save {
                if is_finite_bits(zp) && is_finite_bits(zp * params.inv_temp) {
                    zp_max = rmax(zp_max, zp);
                }
                if is_finite_bits(zq) && is_finite_bits(zq * params.inv_temp) {
                    zq_max = rmax(zq_max, zq);
                }
            }
        }
    }
    let rp = workgroup_reduce(lid, sp, zp_max);
    let zp_ref = wz[0];
    // Every invocation has read the student's results from slot 0 before the teacher's tree
    // overwrites them.
    workgroupBarrier();
    let rq = workgroup_reduce(lid, sq, zq_max);
    let zq_ref = wz[0];
    let ln_sp = log(rmax(rp.s + 1.0, 1.0));
    let ln_sq = log(rmax(rq.s + 1.0, 1.0));
    let usable = rp.s >= 0.0 && rq.s >= 0.0;
    // Pass 2: the lane's sum of terms (same strided columns as pass 1): the JSD's, or for the
    // gradient the student's p (log p − log m) — both to save the state (`acc_k`).
    var acc = 0.0;
    var acc_k = 0.0;
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
            if gradient {
                if p_on {
                    acc = acc + exp(lp) * jsd_log_ratio(lp, lq, q_on);
                }
            } else {
                acc = acc + jsd_term(lp, lq, p_on, q_on);
                if save && p_on {
                    acc_k = acc_k + exp(lp) * jsd_log_ratio(lp, lq, q_on);
                }
            }
        }
    }
    // Fixed pairwise tree over the lane sums, in `wt`, and K's beside it in `ws` when saving
    // (every invocation read slot 0 of the teacher's tree before this overwrites it).
    workgroupBarrier();
    wt[lid] = acc;
    ws[lid] = acc_k;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride >> 1u) {
        if lid < stride {
            wt[lid] = wt[lid] + wt[lid + stride];
            ws[lid] = ws[lid] + ws[lid + stride];
        }
        workgroupBarrier();
    }
    let total = wt[0];
    let kl_pm = ws[0];
    // Pass 3 (gradient): every column of the row; a masked student column gets 0.
    if gradient && row_ok && usable {
        let start = params.base + row * params.vocab;
        let c = (upstream[row] * params.one_minus_beta) * params.inv_temp;
        for (var v = lid; v < params.vocab; v += WG) {
            let xp = load_logit(start + v) * params.inv_temp;
            let xq = load_teacher(start + v) * params.inv_temp;
            let p_on = is_finite_bits(xp);
            let q_on = is_finite_bits(xq);
            var g = 0.0;
            if p_on {
                let lp = jsd_logp(xp, rp, ln_sp);
                let lq = select(LOGP_MIN, jsd_logp(xq, rq, ln_sq), q_on);
                g = (exp(lp) * (jsd_log_ratio(lp, lq, q_on) - total)) * c;
            }
            grad[row * params.vocab + v] = g;
        }
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
        // grpo-core clamps the JSD at 0 (rounding can leave a tiny negative for equal rows); the
        // gradient's K is used as it is.
        stats[row * 4u + 3u] = select(rmax(total, 0.0), total, gradient);
        status[row * 4u] = bad_p;
        status[row * 4u + 1u] = flags;
        status[row * 4u + 2u] = bad_q;
        status[row * 4u + 3u] = 0u;
        if save {
            let o = row * JSD_STATE;
            grad[o] = zp_ref;
            grad[o + 1u] = -ln_sp;
            grad[o + 2u] = zq_ref;
            grad[o + 3u] = -ln_sq;
            grad[o + 4u] = kl_pm;
        }
    }
}
