//! `grpo-bench vocab`: the vocabulary kernels of grpo-cpu.

use crate::Args;

pub(crate) fn main(args: &[String]) -> Result<(), String> {
    let a = Args::parse(
        args,
        &["rows", "vocab", "dtype", "threads", "backend", "kernel", "iters"],
    )?;
    let rows = a.num("rows")?.unwrap_or(2048);
    let vocab = a.num("vocab")?.unwrap_or(32768);
    let threads = a.num("threads")?.unwrap_or(2);
    let iters = a.num("iters")?.unwrap_or(7);
    let cpu = grpo_cpu::Cpu::detect()
        .with_threads(threads)
        .map_err(|e| e.to_string())?;
    let data = vec![1.0f32; rows * vocab];
    let mut dst = vec![0.0f32; rows * vocab];
    let bytes = (rows * vocab * 4) as f64;
    let (r, c) = crate::interleaved_medians(
        iters,
        || {
            std::hint::black_box(grpo_cpu::roofline::read(&cpu, &data));
        },
        || grpo_cpu::roofline::copy(&cpu, &data, &mut dst),
    );
    println!(
        "{{\"read_ms\":{r:.3},\"read_gbps\":{:.2},\"copy_ms\":{c:.3},\"copy_gbps\":{:.2}}}",
        bytes / r / 1e6,
        2.0 * bytes / c / 1e6
    );
    Ok(())
}
