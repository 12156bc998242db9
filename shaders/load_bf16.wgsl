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
