// Logit storage: f32, one element per array slot.
@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(5) var<storage, read> teacher: array<f32>;

fn load_logit(i: u32) -> f32 {
    return logits[i];
}

fn load_teacher(i: u32) -> f32 {
    return teacher[i];
}

// The in-place backward's output (binding 8): one element per u32 word, the f32's bits.
const PER_WORD: u32 = 1u;

fn narrow(x: f32) -> u32 {
    return bitcast<u32>(x);
}
