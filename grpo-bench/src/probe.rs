//! `grpo-bench probe`: how much of the memory's read bandwidth a loop keeps when it carries a
//! kernel's arithmetic — `grpo_cpu::roofline::read_with_fma` at several densities against the
//! plain `roofline::read` of the same bytes, timed interleaved.
//!
//! Fields of each JSON line in this mode: `probe` = `"read_fma"`; `fmas` = dependent fused
//! multiply-adds per 16-lane vector (the vocabulary steps issue about 17 vector operations per
//! vector, 9–11 of them FMAs); `backend`; `prefetch` (whether the stand-in issues the kernels'
//! software prefetches as `--prefetch on|off` set, or `"default"`: the backend's default,
//! `Backend::software_prefetch_default`); `threads`; `mib` = size of the streamed buffer;
//! `iters`; `stream_gbps` = the probe reading that buffer from memory; `read_gbps` = the plain
//! read of the same buffer, timed interleaved with it; `ratio = stream_gbps / read_gbps` (what
//! the vocabulary kernels' `ratio` is, for this stand-in); `cache_gbps` = the probe's
//! arithmetic rate: a buffer of 1 MiB per thread whose 256 KiB parts are each read 32 times
//! in a row (all passes but the first find the part in L2); `headroom = cache_gbps /
//! read_gbps` (how far the arithmetic alone could outrun memory).
//! Compare a kernel's own headroom with `grpo-bench vocab --rows 16 --vocab 32768` (in cache)
//! against its streaming `roofline_gbps`.

use grpo_cpu::roofline;

use crate::{Args, interleaved_medians};

/// The default densities.
const FMAS: &[usize] = &[0, 2, 4, 6, 8, 10, 12, 14, 16];

/// Values per thread of the in-cache buffer: 1 MiB of f32, four of `read_with_fma`'s parts.
const CACHE_VALUES_PER_THREAD: usize = 256 << 10;

/// How many times the in-cache measurement reads each part.
const PASSES: usize = 32;

pub(crate) fn main(args: &[String]) -> Result<(), String> {
    let a = Args::parse(
        args,
        &["fmas", "mib", "threads", "iters", "backend", "prefetch"],
    )?;
    let fmas: Vec<usize> = match a.get("fmas") {
        None => FMAS.to_vec(),
        Some(list) => list
            .split(',')
            .map(|f| {
                f.trim()
                    .parse()
                    .ok()
                    .filter(|&n| n <= roofline::MAX_PROBE_FMAS)
                    .ok_or_else(|| {
                        format!(
                            "--fmas {f:?}: expected numbers 0..={} separated by commas",
                            roofline::MAX_PROBE_FMAS
                        )
                    })
            })
            .collect::<Result<_, _>>()?,
    };
    let mib = a.num("mib")?.unwrap_or(256).max(1);
    let iters = a.num("iters")?.unwrap_or(7).max(1);
    let cpu = a.cpu()?;
    // Values in [−1, 0), like logits below their maximum: the polynomial stays in [−0.5, 1]
    // (no subnormals, whose microcode assists would slow the FMAs down).
    let n = mib << 18;
    let big: Vec<f32> = (0..n)
        .map(|i| -((i % 4093) as f32 + 1.0) / 4094.0)
        .collect();
    // The arithmetic rate: each thread reads its 256 KiB parts of a small buffer again and
    // again (the first of the `PASSES` passes streams, the others find the part in L2).
    let small = &big[..CACHE_VALUES_PER_THREAD * cpu.threads()];
    for &k in &fmas {
        let [stream_ms, read_ms] = interleaved_medians(
            iters,
            [
                &mut || {
                    std::hint::black_box(roofline::read_with_fma(&cpu, &big, k, 1));
                },
                &mut || {
                    std::hint::black_box(roofline::read(&cpu, &big));
                },
            ],
        );
        let [cache_ms] = interleaved_medians(
            iters,
            [&mut || {
                std::hint::black_box(roofline::read_with_fma(&cpu, small, k, PASSES));
            }],
        );
        let gbps = |bytes: usize, ms: f64| bytes as f64 / ms / 1e6;
        let stream = gbps(n * 4, stream_ms);
        let read = gbps(n * 4, read_ms);
        let cache = gbps(small.len() * 4 * PASSES, cache_ms);
        println!(
            "{{\"probe\":\"read_fma\",\"fmas\":{k},\"backend\":\"{}\",\"prefetch\":{},\"threads\":{},\"mib\":{mib},\"iters\":{iters},\"stream_gbps\":{stream:.2},\"read_gbps\":{read:.2},\"ratio\":{:.3},\"cache_gbps\":{cache:.2},\"headroom\":{:.2}}}",
            cpu.backend().name(),
            crate::prefetch_json(&cpu),
            cpu.threads(),
            stream / read,
            cache / read,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::main;

    fn run(args: &[&str]) -> Result<(), String> {
        main(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    /// Bad arguments are reported before any buffer is allocated or timed.
    #[test]
    fn bad_arguments_are_errors() {
        let e = run(&["--fmas", "4,17"]).unwrap_err();
        assert!(e.contains("--fmas \"17\""), "{e}");
        assert!(run(&["--fmas", "x"]).unwrap_err().contains("0..=16"));
        assert!(
            run(&["--mib", "lots"])
                .unwrap_err()
                .contains("not a number")
        );
        assert!(
            run(&["--backend", "mmx"])
                .unwrap_err()
                .contains("not available")
        );
        assert!(
            run(&["--rows", "4"])
                .unwrap_err()
                .contains("unknown argument")
        );
    }
}
