//! The shared GPU context of the GPU tests and the skip/require rule of DESIGN.md: without an
//! adapter a GPU test prints why it skips and passes, unless `GRPO_REQUIRE_GPU=1`, where it fails;
//! and the proptest runner every GPU property test uses.

use std::sync::OnceLock;

use grpo_wgpu::GpuContext;
use proptest::test_runner::{Config, TestRunner};

static CTX: OnceLock<Result<GpuContext, String>> = OnceLock::new();

/// The process-wide context, or `None` (after printing the skip reason) when no adapter exists.
///
/// # Panics
/// When no adapter exists and `GRPO_REQUIRE_GPU=1`.
pub fn context(test: &str) -> Option<&'static GpuContext> {
    let ctx = CTX.get_or_init(|| match GpuContext::new() {
        Ok(c) => {
            let i = c.adapter_info();
            eprintln!(
                "grpo-wgpu tests: adapter \"{}\" ({:?}, driver {} {}), f16: {}",
                i.name,
                i.backend,
                i.driver,
                i.driver_info,
                c.supports_f16()
            );
            Ok(c)
        }
        Err(e) => Err(e.to_string()),
    });
    match ctx {
        Ok(c) => Some(c),
        Err(reason) => {
            if std::env::var("GRPO_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("{test}: GRPO_REQUIRE_GPU=1 but no GPU adapter: {reason}");
            }
            eprintln!("{test}: SKIPPED (no GPU adapter: {reason}; set GRPO_REQUIRE_GPU=1 to fail)");
            None
        }
    }
}

/// Number of proptest cases for GPU tests (`GRPO_GPU_CASES`, default 48: lavapipe is a CPU).
pub fn cases() -> u32 {
    std::env::var("GRPO_GPU_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(48)
}

/// The proptest runner of the GPU property tests: [`cases`] cases.
pub fn runner() -> TestRunner {
    runner_with_cases(cases())
}

/// Shrink steps of a failing GPU property test (`PROPTEST_MAX_SHRINK_ITERS` overrides it).
pub const MAX_SHRINK_ITERS: u32 = 64;

/// A GPU proptest runner of `n` cases, without failure persistence (a failing case is printed
/// with its inputs instead of written to a file), and with bounded shrinking: each shrink step
/// runs the case again, GPU work included (buffers, a submission, a blocking readback), so
/// proptest's default budget of 1024 steps per failure, times a suite's configs, could keep a
/// failing executable busy for minutes before it reports. [`MAX_SHRINK_ITERS`] steps still
/// shrink the batch sizes of these tests a long way, and the failing case is printed in full.
pub fn runner_with_cases(n: u32) -> TestRunner {
    let max_shrink_iters = std::env::var("PROPTEST_MAX_SHRINK_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(MAX_SHRINK_ITERS);
    TestRunner::new(Config {
        cases: n,
        failure_persistence: None,
        max_shrink_iters,
        ..Config::default()
    })
}

/// The first `n` little-endian `f32` of a buffer read back from the device, as bits (the
/// benchmark hooks' `Resident::read`).
///
/// # Panics
/// When `bytes` holds fewer than `n` floats.
pub fn f32_bits(bytes: &[u8], n: usize) -> Vec<u32> {
    bytes[..n * 4]
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
        .collect()
}
