//! `cargo run --release -p grpo-wgpu --example bench -- [--rows N] [--vocab V] [--iters K]`
//!
//! Throughput of grpo-wgpu's vocabulary kernels on device-resident logits, one JSON object per
//! line in grpo-bench's format (kernel, dtype, rows, vocab, backend, threads, iters, median_ms,
//! gbps, roofline_gbps, ratio, rows_per_s). `gbps` counts the bytes the kernel must move (logits
//! read; plus the f32 gradient written for the backward); `roofline_gbps` is a device-side buffer
//! copy of the same number of bytes timed in the same run (a copy reads and writes, so it is a
//! conservative bandwidth for a read-only kernel); `ratio = gbps / roofline_gbps`. Times are
//! per submission including submit and wait, so small problems measure latency, not bandwidth.
//! (grpo-bench itself lives on another branch; these rows use its format so they can be merged.)

use grpo_wgpu::{GpuContext, LogitStorage, VocabKernel};

fn arg(args: &[String], key: &str, default: usize) -> usize {
    args.windows(2)
        .find(|w| w[0] == key)
        .and_then(|w| w[1].parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn run<L: LogitStorage>(
    ctx: &GpuContext,
    name: &str,
    rows: usize,
    vocab: usize,
    iters: usize,
    conv: fn(f32) -> L,
) -> Result<(), grpo_wgpu::GpuError> {
    let k = VocabKernel::new(ctx);
    let mut state = 0x2545f4914f6cdd1du64;
    let logits: Vec<L> = (0..rows * vocab)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            conv(((state >> 40) as f32 / (1u64 << 24) as f32) * 16.0 - 8.0)
        })
        .collect();
    let elem = size_of::<L>();
    for (kernel, backward) in [("fused_forward", false), ("fused_backward", true)] {
        let bytes = (rows * vocab * elem + if backward { rows * vocab * 4 } else { 0 }) as u64;
        let ms = median(k.bench_resident(&logits, vocab, backward, iters)?);
        let roof_ms = median(ctx.bench_copy(bytes, iters)?);
        let gbps = bytes as f64 / (ms * 1e6);
        // A copy moves `bytes` in and `bytes` out.
        let roof = 2.0 * bytes as f64 / (roof_ms * 1e6);
        let info = ctx.adapter_info();
        println!(
            "{{\"kernel\":\"{kernel}\",\"dtype\":\"{name}\",\"rows\":{rows},\"vocab\":{vocab},\"backend\":\"wgpu-{:?}:{}\",\"threads\":0,\"iters\":{iters},\"median_ms\":{ms:.3},\"gbps\":{gbps:.2},\"roofline_gbps\":{roof:.2},\"ratio\":{:.3},\"rows_per_s\":{:.0}}}",
            info.backend,
            info.name.replace('"', "'"),
            gbps / roof,
            rows as f64 / (ms * 1e-3)
        );
    }
    Ok(())
}

fn main() -> Result<(), grpo_wgpu::GpuError> {
    let args: Vec<String> = std::env::args().collect();
    let rows = arg(&args, "--rows", 64);
    let vocab = arg(&args, "--vocab", 151_936);
    let iters = arg(&args, "--iters", 10);
    let ctx = GpuContext::new()?;
    run::<f32>(&ctx, "f32", rows, vocab, iters, |x| x)?;
    run::<half::bf16>(&ctx, "bf16", rows, vocab, iters, half::bf16::from_f32)?;
    if ctx.supports_f16() {
        run::<half::f16>(&ctx, "f16", rows, vocab, iters, half::f16::from_f32)?;
    }
    Ok(())
}
