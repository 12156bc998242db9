//! Deterministic test data for this crate's unit tests (the workspace's `grpo-tests` crate, which
//! has its own, depends on this one).

/// f32 in [0, 1) (24 random bits each) from xorshift64 with `seed` (made odd, so never zero).
pub(crate) fn uniform_f32(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    }
}
