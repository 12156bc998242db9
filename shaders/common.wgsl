// common.wgsl — constants and helpers shared by every grpo-kernels shader.
// Mirrors grpo-core's constants (MATH.md §0, §3, §5). Prepended to each module by grpo-wgpu.

// The most negative finite f32, used instead of −∞: WGSL lets an implementation assume that
// no infinity reaches arithmetic, so −∞ is never produced or consumed by arithmetic here.
const NEG_BIG: f32 = -3.40282347e38;
// Bit pattern of −∞ (masked vocabulary entries are stored as −∞ by callers); compared as bits.
const NEG_INF_BITS: u32 = 0xff800000u;
// Exponent field of an f32: all ones means ±∞ or NaN.
const EXP_MASK: u32 = 0x7f800000u;
// "No index": status words start here and are lowered with atomicMin / min.
const NO_INDEX: u32 = 0xffffffffu;
// Default log-ratio clamp before any exp of a log-ratio (verl, OpenRLHF; MATH.md §0).
const LOG_RATIO_CLAMP: f32 = 20.0;

// Finite test on the bit pattern (never folded away by a compiler that assumes finite math).
fn is_finite_bits(x: f32) -> bool {
    return (bitcast<u32>(x) & EXP_MASK) != EXP_MASK;
}

fn is_neg_inf_bits(x: f32) -> bool {
    return bitcast<u32>(x) == NEG_INF_BITS;
}

fn is_nan_bits(x: f32) -> bool {
    let b = bitcast<u32>(x);
    return (b & EXP_MASK) == EXP_MASK && (b & 0x007fffffu) != 0u;
}

// The project-wide NaN rule for max/min: `if a > b { a } else { b }` (MATH.md, DESIGN.md).
fn rmax(a: f32, b: f32) -> f32 {
    return select(b, a, a > b);
}

fn rmin(a: f32, b: f32) -> f32 {
    return select(b, a, a < b);
}

fn rclamp(x: f32, lo: f32, hi: f32) -> f32 {
    return rmin(rmax(x, lo), hi);
}

// The linear index of an invocation of a one-thread-per-item entry point. The host dispatches
// ceil(items / size) workgroups as a 2-D grid [x, y, 1] with x ≤ the device's
// max_compute_workgroups_per_dimension (GpuContext::grid), so batches beyond x·size items
// still run in one dispatch; invocations past the item count are guarded by each caller.
fn linear_index(gid: vec3<u32>, groups: vec3<u32>, size: u32) -> u32 {
    return gid.x + gid.y * (groups.x * size);
}
