// Logit storage: bfloat16, two per u32 word, little-endian (element 2k in the low half).
// bf16 is the high half of an f32, so widening is a shift: exact, and no SHADER_F16 needed.
@group(0) @binding(0) var<storage, read> logits: array<u32>;
@group(0) @binding(5) var<storage, read> teacher: array<u32>;

fn bf16_at(w: u32, i: u32) -> f32 {
    return bitcast<f32>(select(w << 16u, w & 0xffff0000u, (i & 1u) == 1u));
}

fn load_logit(i: u32) -> f32 {
    return bf16_at(logits[i >> 1u], i);
}

fn load_teacher(i: u32) -> f32 {
    return bf16_at(teacher[i >> 1u], i);
}

// The in-place backward's output (binding 8): two elements per u32 word, as the logits.
const PER_WORD: u32 = 2u;

// x rounded to bf16 as `half::bf16::from_f32` rounds it (grpo-core's in-place backward): to
// nearest, ties to even, by the carry of x + 0x7fff + (bit 16 of x) into the upper half (which
// also rounds the largest finite values to ±∞); a NaN keeps its sign and upper payload bits, with
// the quiet bit set. Integer operations, so every device gives these bits.
fn narrow(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if (b & 0x7fffffffu) > 0x7f800000u {
        return (b >> 16u) | 0x0040u;
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}
