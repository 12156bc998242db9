//! grpo-bench: kernel throughput against a memory roofline measured in the same run.
//!
//! ```text
//! cargo run --release -p grpo-bench -- vocab [--rows N --vocab V --dtype f32|bf16|f16|all
//!     --threads T --backend NAME --prefetch on|off|both --kernel NAME --iters K --temperature T]
//! cargo run --release -p grpo-bench -- loss [--tokens N --threads T --iters K --clip ppo|kl3|all]
//! cargo run --release -p grpo-bench -- wgpu [--rows N --vocab V --dtype f32|f16|bf16|all
//!     --tokens N --iters K]
//! cargo run --release -p grpo-bench -- probe [--fmas 0,4,8 --mib M --threads T --iters K
//!     --backend NAME --prefetch on|off]
//! cargo run --release -p grpo-bench [-- all]    # vocab, then loss, with their defaults
//! ```
//!
//! `all` (and no mode) is the CPU benchmarks only: the `wgpu` mode creates a device (seconds on
//! lavapipe, and a software adapter's work competes with the CPU kernels for the same cores), so
//! it runs only when asked for.
//!
//! Prints one JSON object per line. `gbps` counts the bytes a kernel must move (logits read,
//! gradients written); `roofline_gbps` is a plain multi-threaded streaming read (forward
//! kernels) or read + write (backward) of the same number of bytes on the same threads, timed
//! interleaved with the kernel so machine drift hits both alike; `ratio = gbps / roofline_gbps`.
//! The kernels that write (the backwards) also get `stream_roofline_gbps` and `stream_ratio`:
//! the same against a copy with streaming stores (`grpo_cpu::roofline::copy_stream`), which on
//! AVX-512 moves two bytes over the memory bus per byte copied where the plain copy's stores
//! move three (each destination line is read before it is written) — the stricter read + write
//! roofline, since the AVX-512 backwards write their gradients with streaming stores too.
//! `vocab --prefetch both` times each kernel with the software prefetches on and off in the
//! same rounds, against one roofline, and prints a line for each with `time_vs_other_prefetch`:
//! the median over rounds of its time over the other setting's (so the setting a CPU should
//! default to can be measured without the order bias between two processes). Without
//! `--prefetch`, `prefetch` reads `"default"`: each kernel pass prefetches as grpo-cpu
//! chooses for it (`Cpu::software_prefetch`).
//! The `loss` mode's fields are described in its module (`rows` = sequences, `vocab` = tokens
//! per sequence there); the `wgpu` mode's (roofline = a device buffer copy, plus `adapter`) in
//! its module. The `probe` mode measures the host rather than a kernel: how much of the read
//! bandwidth a loop with a given amount of arithmetic per vector keeps (fields in its module).

use std::process::ExitCode;
use std::time::Instant;

mod gpu;
mod loss;
mod probe;
mod vocab;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("vocab") => vocab::main(&args[1..]),
        Some("loss") => loss::main(&args[1..]),
        Some("wgpu") => gpu::main(&args[1..]),
        Some("probe") => probe::main(&args[1..]),
        None | Some("all") if args.len() <= 1 => vocab::main(&[]).and_then(|()| loss::main(&[])),
        _ => Err(USAGE.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("grpo-bench: {e}");
            ExitCode::from(2)
        }
    }
}

const USAGE: &str = "usage: grpo-bench vocab [--rows N] [--vocab V] [--dtype f32|bf16|f16|all] \
[--threads T] [--backend avx512|avx2-fma|neon|portable] [--prefetch on|off|both] [--kernel NAME] \
[--iters K] [--temperature T] [--masked K (every K-th logit −∞)]
       grpo-bench loss [--tokens N] [--threads T] [--iters K] [--clip ppo|kl3|core|all]
       grpo-bench wgpu [--rows N] [--vocab V] [--dtype f32|f16|bf16|all] [--tokens N] [--iters K]
       grpo-bench probe [--fmas 0,2,…,16] [--mib M] [--threads T] [--iters K] [--backend NAME] \
[--prefetch on|off]
       grpo-bench [all]    (vocab, then loss: the CPU modes only)";

/// Median wall time in milliseconds of each of `work`'s closures over `iters` rounds
/// ([`interleaved_times`]).
pub(crate) fn interleaved_medians<const N: usize>(
    iters: usize,
    mut work: [&mut dyn FnMut(); N],
) -> [f64; N] {
    let times = interleaved_times(iters, N, |j| work[j]());
    std::array::from_fn(|j| median(&mut times[j].clone()))
}

/// Wall times in milliseconds of `jobs` jobs (`run(j)` runs job `j`) over `iters` rounds: each
/// round runs every job once, so all of them see the same machine state (shared, noisy hosts),
/// and round `r` starts with job `r mod jobs`, so no job always runs right after the same one
/// or first. One untimed warm-up round first. `times[j][r]` is job `j`'s time in round `r`.
pub(crate) fn interleaved_times(
    iters: usize,
    jobs: usize,
    mut run: impl FnMut(usize),
) -> Vec<Vec<f64>> {
    (0..jobs).for_each(&mut run);
    let mut times = vec![Vec::with_capacity(iters); jobs];
    for round in 0..iters {
        for j in (0..jobs).map(|i| (round + i) % jobs) {
            let start = Instant::now();
            run(j);
            times[j].push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
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

/// A tiny argument parser: `--key value` pairs.
pub(crate) struct Args(Vec<(String, String)>);

impl Args {
    pub(crate) fn parse(args: &[String], known: &[&str]) -> Result<Self, String> {
        let mut out = Vec::new();
        let mut it = args.iter();
        while let Some(k) = it.next() {
            let key = k
                .strip_prefix("--")
                .filter(|k| known.contains(k))
                .ok_or_else(|| format!("unknown argument {k:?}\n{USAGE}"))?;
            let v = it
                .next()
                .ok_or_else(|| format!("--{key} needs a value\n{USAGE}"))?;
            out.push((key.to_string(), v.clone()));
        }
        Ok(Args(out))
    }

    pub(crate) fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// The pool `--backend NAME` (default: the detected one), `--threads T` (default 2) and
    /// `--prefetch on|off` (default: each kernel pass's own, `Cpu::software_prefetch`) ask
    /// for.
    pub(crate) fn cpu(&self) -> Result<grpo_cpu::Cpu, String> {
        let mut cpus = self.cpus()?;
        match cpus.len() {
            1 => Ok(cpus.remove(0)),
            _ => Err("--prefetch both: only the vocab mode compares the two settings".into()),
        }
    }

    /// As [`cpu`](Self::cpu), and `--prefetch both` gives two executors on one thread pool,
    /// prefetching on and then off, for comparing the two within one process.
    pub(crate) fn cpus(&self) -> Result<Vec<grpo_cpu::Cpu>, String> {
        let backend = match self.get("backend") {
            None => grpo_cpu::Backend::detect(),
            Some(name) => grpo_cpu::Backend::available()
                .find(|b| b.name() == name)
                .ok_or_else(|| format!("--backend {name:?} is not available on this CPU"))?,
        };
        let threads = self.num("threads")?.unwrap_or(2);
        let settings: &[Option<bool>] = match self.get("prefetch") {
            None => &[None],
            Some("on") => &[Some(true)],
            Some("off") => &[Some(false)],
            Some("both") => &[Some(true), Some(false)],
            Some(v) => {
                return Err(format!(
                    "--prefetch: {v:?} is neither \"on\", \"off\" nor \"both\""
                ));
            }
        };
        let pool = grpo_cpu::Cpu::new(backend)
            .ok_or("backend unavailable")?
            .with_threads(threads)
            .map_err(|e| e.to_string())?;
        Ok(settings
            .iter()
            .map(|&on| match on {
                Some(on) => pool.clone().with_software_prefetch(on),
                None => pool.clone(),
            })
            .collect())
    }

    pub(crate) fn num(&self, key: &str) -> Result<Option<usize>, String> {
        self.get(key)
            .map(|v| {
                v.parse()
                    .map_err(|_| format!("--{key}: {v:?} is not a number"))
            })
            .transpose()
    }
}

/// The `prefetch` field of a JSON line: `true` or `false` where `--prefetch` set every pass,
/// `"default"` where each pass follows its own default (`Cpu::software_prefetch`).
pub(crate) fn prefetch_json(cpu: &grpo_cpu::Cpu) -> &'static str {
    match cpu.software_prefetch() {
        Some(true) => "true",
        Some(false) => "false",
        None => "\"default\"",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    /// Every job runs once per round (plus the warm-up round), and each round starts with the
    /// next job in turn.
    #[test]
    fn interleaved_rounds_rotate() {
        let mut order = Vec::new();
        let times = interleaved_times(4, 3, |j| order.push(j));
        assert_eq!(order, [0, 1, 2, 0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]);
        assert!(times.iter().all(|t| t.len() == 4));
    }

    #[test]
    fn args_parse() {
        let a: Vec<String> = ["--rows", "4", "--dtype", "bf16"]
            .map(String::from)
            .to_vec();
        let p = Args::parse(&a, &["rows", "dtype"]).unwrap();
        assert_eq!(p.num("rows").unwrap(), Some(4));
        assert_eq!(p.get("dtype"), Some("bf16"));
        assert!(Args::parse(&a, &["rows"]).is_err());
    }
}
