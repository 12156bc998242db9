// Logit storage: IEEE binary16 (`enable f16;` is prepended; needs Features::SHADER_F16).
// Widening f16 → f32 is exact, so every later operation is the f32 one.
@group(0) @binding(0) var<storage, read> logits: array<f16>;
@group(0) @binding(5) var<storage, read> teacher: array<f16>;

fn load_logit(i: u32) -> f32 {
    return f32(logits[i]);
}

fn load_teacher(i: u32) -> f32 {
    return f32(teacher[i]);
}

// The in-place backward's output (binding 8): two elements per u32 word, as the logits.
const PER_WORD: u32 = 2u;

// x rounded to binary16 as `half::f16::from_f32` rounds it (grpo-core's in-place backward): to
// nearest, ties to even, subnormal results rounded (not flushed), |x| ≥ 65520 to ±∞, a NaN kept
// quiet with its sign and upper payload bits. Integer operations (and a ties-to-even `round` of
// an exact product for subnormal results) rather than WGSL's conversion, whose rounding the
// specification leaves to the implementation.
fn narrow(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let a = b & 0x7fffffffu;
    if a > 0x7f800000u {
        return sign | 0x7e00u | ((a >> 13u) & 0x03ffu);
    }
    if a >= 0x477ff000u {
        return sign | 0x7c00u;
    }
    if a >= 0x38800000u {
        // Normal: the exponent rebiased from 127 to 15, the significand rounded at bit 13.
        let r = a - 0x38000000u;
        return sign | ((r + 0x0fffu + ((r >> 13u) & 1u)) >> 13u);
    }
    // Subnormal (or zero): |x|·2^24 is exact, and rounding it to an integer (ties to even)
    // gives the significand; 1024 is the smallest normal's pattern.
    return sign | u32(round(bitcast<f32>(a) * 16777216.0));
}
