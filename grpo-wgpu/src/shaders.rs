//! The WGSL sources (the workspace's `shaders/` directory) and how modules are composed.
//!
//! Every module is `common.wgsl` followed by its body; vocabulary modules insert a storage
//! prelude (`load_f32.wgsl`, `load_f16.wgsl` with `enable f16;`, `load_bf16.wgsl`) that declares
//! the logit bindings, widens to f32 and (`narrow`) rounds an in-place gradient back to the
//! storage type. [`ShaderId::ALL`] lists every module so the test suite
//! can validate each one with naga without an adapter.

/// `common.wgsl`: constants and helpers mirrored from grpo-core.
pub const COMMON: &str = include_str!("../../shaders/common.wgsl");
/// `vocab.wgsl`: log-sum-exp, log-prob, entropy, KL, JSD_β, fused backward.
pub const VOCAB: &str = include_str!("../../shaders/vocab.wgsl");
/// `load_f32.wgsl`.
pub const LOAD_F32: &str = include_str!("../../shaders/load_f32.wgsl");
/// `load_f16.wgsl`.
pub const LOAD_F16: &str = include_str!("../../shaders/load_f16.wgsl");
/// `load_bf16.wgsl`.
pub const LOAD_BF16: &str = include_str!("../../shaders/load_bf16.wgsl");
/// `advantage.wgsl`: group advantage estimators.
pub const ADVANTAGE: &str = include_str!("../../shaders/advantage.wgsl");
/// `loss.wgsl`: per-token policy losses, KL penalties, IS weights, rejection and off-policy
/// sequence masks, and reductions.
pub const LOSS: &str = include_str!("../../shaders/loss.wgsl");
/// `copy.wgsl`: a shader copy, the roofline of `grpo-bench wgpu`.
pub const COPY: &str = include_str!("../../shaders/copy.wgsl");

/// How logits are stored in memory (accumulation is always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LogitDtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16 (needs `Features::SHADER_F16`).
    F16,
    /// bfloat16, packed two per `u32`, little-endian.
    Bf16,
}

impl LogitDtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            LogitDtype::F32 => 4,
            LogitDtype::F16 | LogitDtype::Bf16 => 2,
        }
    }
}

/// One composed WGSL module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShaderId {
    /// Vocabulary kernels for one storage type.
    Vocab(LogitDtype),
    /// Advantage estimators.
    Advantage,
    /// Per-token losses and reductions.
    Loss,
    /// A device-side copy by a shader (the benchmark's roofline).
    Copy,
}

impl ShaderId {
    /// Every module the crate compiles.
    pub const ALL: [ShaderId; 6] = [
        ShaderId::Vocab(LogitDtype::F32),
        ShaderId::Vocab(LogitDtype::F16),
        ShaderId::Vocab(LogitDtype::Bf16),
        ShaderId::Advantage,
        ShaderId::Loss,
        ShaderId::Copy,
    ];

    /// A short name (used as the wgpu label).
    pub const fn name(self) -> &'static str {
        match self {
            ShaderId::Vocab(LogitDtype::F32) => "vocab_f32",
            ShaderId::Vocab(LogitDtype::F16) => "vocab_f16",
            ShaderId::Vocab(LogitDtype::Bf16) => "vocab_bf16",
            ShaderId::Advantage => "advantage",
            ShaderId::Loss => "loss",
            ShaderId::Copy => "copy",
        }
    }

    /// Entry points of the module.
    pub const fn entry_points(self) -> &'static [&'static str] {
        match self {
            ShaderId::Vocab(_) => &[
                "forward",
                "forward_saved",
                "backward",
                "backward_saved",
                "backward_saved_kl_student_teacher",
                "backward_saved_kl_teacher_student",
                "backward_saved_in_place",
                "backward_saved_in_place_kl_student_teacher",
                "backward_saved_in_place_kl_teacher_student",
                "kl",
                "kl_saved",
                "jsd",
                "jsd_saved",
                "jsd_backward",
                "jsd_backward_saved",
                "jsd_backward_saved_in_place",
            ],
            ShaderId::Advantage => &[
                "group_stats",
                "group_rank",
                "batch_moments",
                "finish",
                "gdpo_sum",
            ],
            ShaderId::Loss => &[
                "per_token",
                "agg_seq",
                "agg_total",
                "seq_ratio",
                "is_weights",
                "ess_seq",
                "ess_total",
                "rejection",
                "opsm",
            ],
            ShaderId::Copy => &["copy"],
        }
    }

    /// The wgpu features the module needs.
    pub fn required_features(self) -> wgpu::Features {
        match self {
            ShaderId::Vocab(LogitDtype::F16) => wgpu::Features::SHADER_F16,
            _ => wgpu::Features::empty(),
        }
    }

    /// The full WGSL text of the module.
    pub fn source(self) -> String {
        let (directive, prelude, body) = match self {
            ShaderId::Vocab(LogitDtype::F32) => ("", LOAD_F32, VOCAB),
            ShaderId::Vocab(LogitDtype::F16) => ("enable f16;\n", LOAD_F16, VOCAB),
            ShaderId::Vocab(LogitDtype::Bf16) => ("", LOAD_BF16, VOCAB),
            ShaderId::Advantage => ("", "", ADVANTAGE),
            ShaderId::Loss => ("", "", LOSS),
            ShaderId::Copy => ("", "", COPY),
        };
        let mut s =
            String::with_capacity(directive.len() + COMMON.len() + prelude.len() + body.len() + 2);
        s.push_str(directive);
        s.push_str(COMMON);
        s.push('\n');
        s.push_str(prelude);
        s.push('\n');
        s.push_str(body);
        s
    }
}

/// Re-export of `wgpu::Features` so tests can name the features without depending on wgpu.
pub use wgpu::Features as WgpuFeatures;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives_come_first_and_only_where_needed() {
        for id in ShaderId::ALL {
            let src = id.source();
            let f16 = id == ShaderId::Vocab(LogitDtype::F16);
            assert_eq!(src.starts_with("enable f16;"), f16, "{}", id.name());
            let directives = src.lines().filter(|l| l.starts_with("enable ")).count();
            assert_eq!(directives, usize::from(f16), "{}", id.name());
            assert_eq!(
                id.required_features().contains(wgpu::Features::SHADER_F16),
                f16
            );
        }
    }

    #[test]
    fn dtype_sizes() {
        assert_eq!(LogitDtype::F32.size(), 4);
        assert_eq!(LogitDtype::F16.size(), 2);
        assert_eq!(LogitDtype::Bf16.size(), 2);
    }
}
