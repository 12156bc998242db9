//! The error type of grpo-wgpu.

use core::fmt;

/// Why a GPU operation did not produce a result.
///
/// Validation failures are [`GpuError::Core`] wrapping the very [`grpo_core::Error`] that
/// grpo-core returns for the same input, so callers match one set of variants whatever the
/// backend. Like grpo-core, every operation leaves its output buffers untouched on `Err`.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum GpuError {
    /// No adapter (GPU or software rasteriser) was found for the enabled backends.
    NoAdapter {
        /// What wgpu reported.
        reason: String,
    },
    /// The adapter lacks a feature this operation needs (e.g. `SHADER_F16` for f16 logits).
    MissingFeature {
        /// The wgpu feature's name.
        feature: &'static str,
    },
    /// An input is too large for the device even after chunking (e.g. one logit row larger than
    /// the largest storage binding). Counted in bytes; a dispatch with too many workgroups is
    /// [`GpuError::TooManyWorkgroups`].
    TooLarge {
        /// The argument.
        what: &'static str,
        /// Bytes needed in one binding.
        bytes: u64,
        /// The device limit in bytes.
        limit: u64,
    },
    /// One dispatch would need more workgroups than the device can run: the one-thread-per-item
    /// kernels lay their workgroups out as a 2-D grid of at most `per_dimension` ×
    /// `per_dimension` (the device's `max_compute_workgroups_per_dimension`), further bounded by
    /// 2³² invocations so that the shaders' `u32` invocation index cannot wrap; `limit` is the
    /// resulting maximum. Counted in workgroups, not bytes.
    TooManyWorkgroups {
        /// Workgroups the dispatch needs.
        needed: u64,
        /// The most workgroups one dispatch of this entry point can have on this device.
        limit: u64,
        /// The device's (or the test hook's) `max_compute_workgroups_per_dimension`.
        per_dimension: u32,
    },
    /// The input is invalid: exactly what grpo-core returns for it.
    Core(grpo_core::Error),
    /// The device failed (creation, lost device, mapping, or a wgpu validation error).
    Device {
        /// What wgpu reported.
        message: String,
    },
    /// One submission was not finished (its outputs not mapped for reading) within the
    /// context's limit ([`GpuContext::set_timeout`](crate::GpuContext::set_timeout)): a hung
    /// or lost device, or work too large for the limit. The outputs are untouched.
    Timeout {
        /// The limit that ran out.
        limit: core::time::Duration,
    },
}

impl fmt::Display for GpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuError::NoAdapter { reason } => write!(f, "no GPU adapter available: {reason}"),
            GpuError::MissingFeature { feature } => {
                write!(f, "the GPU adapter lacks the `{feature}` feature")
            }
            GpuError::TooLarge { what, bytes, limit } => write!(
                f,
                "`{what}` needs {bytes} bytes in one buffer binding; the device allows {limit}"
            ),
            GpuError::TooManyWorkgroups {
                needed,
                limit,
                per_dimension,
            } => write!(
                f,
                "one dispatch needs {needed} workgroups; the device runs at most {limit} \
                 ({per_dimension} per dimension)"
            ),
            GpuError::Core(e) => write!(f, "{e}"),
            GpuError::Device { message } => write!(f, "GPU device error: {message}"),
            GpuError::Timeout { limit } => write!(
                f,
                "the GPU did not finish one submission within {limit:?} (the context's \
                 timeout); the device may be hung, or the work too large for the limit"
            ),
        }
    }
}

impl std::error::Error for GpuError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            GpuError::Core(e) => Some(e),
            _ => None,
        }
    }
}

impl From<grpo_core::Error> for GpuError {
    fn from(e: grpo_core::Error) -> Self {
        GpuError::Core(e)
    }
}

/// Result alias of grpo-wgpu.
pub type Result<T> = core::result::Result<T, GpuError>;

/// [`GpuError::Device`] with what wgpu reported.
pub(crate) fn device_error(e: impl fmt::Display) -> GpuError {
    GpuError::Device {
        message: e.to_string(),
    }
}

/// `Err(Core(LengthMismatch))` unless `found == expected` (same variant grpo-core returns).
pub(crate) fn check_len(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if expected == found {
        Ok(())
    } else {
        Err(GpuError::Core(grpo_core::Error::LengthMismatch {
            what,
            expected,
            found,
        }))
    }
}

/// `Err(Core(InvalidParam))` unless `ok`.
pub(crate) fn ensure(ok: bool, name: &'static str, reason: &'static str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(GpuError::Core(grpo_core::Error::InvalidParam {
            name,
            reason,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core_errors_are_wrapped_unchanged() {
        let e = grpo_core::Error::NonFinite {
            what: "logits",
            index: 5,
        };
        let g: GpuError = e.into();
        assert_eq!(g, GpuError::Core(e));
        assert_eq!(g.to_string(), e.to_string());
        assert!(std::error::Error::source(&g).is_some());
    }

    #[test]
    fn messages_name_the_problem() {
        let e = GpuError::TooLarge {
            what: "logits row",
            bytes: 10,
            limit: 8,
        };
        assert_eq!(
            e.to_string(),
            "`logits row` needs 10 bytes in one buffer binding; the device allows 8"
        );
        assert_eq!(
            GpuError::TooManyWorkgroups {
                needed: 32,
                limit: 1,
                per_dimension: 1
            }
            .to_string(),
            "one dispatch needs 32 workgroups; the device runs at most 1 (1 per dimension)"
        );
        assert_eq!(
            GpuError::MissingFeature {
                feature: "SHADER_F16"
            }
            .to_string(),
            "the GPU adapter lacks the `SHADER_F16` feature"
        );
        assert_eq!(
            GpuError::Timeout {
                limit: core::time::Duration::from_millis(1500)
            }
            .to_string(),
            "the GPU did not finish one submission within 1.5s (the context's timeout); the \
             device may be hung, or the work too large for the limit"
        );
        assert_eq!(
            check_len("out", 3, 2),
            Err(GpuError::Core(grpo_core::Error::LengthMismatch {
                what: "out",
                expected: 3,
                found: 2
            }))
        );
    }
}
