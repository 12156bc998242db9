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
