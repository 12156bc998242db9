//! `cargo run --release -p grpo-demo`: GRPO fine-tuning of a small transformer on 3-digit
//! addition, end to end on the CPU. See "The main job" in the top-level README.md.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

use grpo_demo::report::{self, Summary};
use grpo_demo::rl::LossKind;
use grpo_demo::train::{StepMetrics, TrainConfig, Trainer};

/// GRPO on a verifiable task (little-endian 3-digit addition, exact-match reward) with a small
/// candle transformer; advantages, losses and vocabulary kernels from grpo-core / grpo-cpu.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// GRPO steps.
    #[arg(long, default_value_t = 150, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    steps: u32,
    /// Completions per prompt (G).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(2..=256))]
    group_size: u32,
    /// Policy-loss recipe.
    #[arg(long, value_enum, default_value_t = LossKind::Dapo)]
    loss: LossKind,
    /// Seed of every random draw.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Worker threads (candle matmuls, vocab kernels); results are deterministic per
    /// (seed, threads). Default 1: this model's matmuls are small, and idle rayon workers spin,
    /// which costs more than it saves on a shared 2-core machine.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    threads: u32,
    /// Output directory for metrics.csv, reward.png and summary.txt.
    #[arg(long, default_value = "out")]
    out: PathBuf,
    /// Most supervised warm-up steps (batch 64 from a 2000-example subset).
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u32).range(0..=100_000))]
    warmup_steps: u32,
    /// The warm-up stops early once greedy accuracy on 256 warm-up examples reaches this.
    #[arg(long, default_value_t = 0.10, value_parser = parse_fraction)]
    warmup_target: f64,
    /// Prompts per GRPO step.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    prompts: u32,
    /// Held-out problems (accuracy is measured on them).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    held_out: u32,
    /// Held-out evaluation interval in steps.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    eval_every: u32,
}

/// glibc keeps freed tensor buffers instead of returning them to the kernel and re-faulting
/// them every step (measured: ≈100 ms of a ≈400 ms step at d = 128). Same effect as the
/// environment variables MALLOC_TRIM_THRESHOLD_ / MALLOC_TOP_PAD_ / MALLOC_MMAP_THRESHOLD_.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_malloc() {
    // SAFETY: mallopt only changes allocator parameters; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 1 << 30);
        // glibc refuses thresholds above HEAP_MAX/2 (32 MiB on 64-bit); every tensor here is smaller.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_malloc() {}

fn setup_threads(threads: u32) -> Result<usize, String> {
    let n = threads as usize;
    // candle's CPU matmul (gemm) sizes its parallelism from RAYON_NUM_THREADS.
    // SAFETY: single-threaded at this point (before any pool or worker thread is started).
    unsafe { std::env::set_var("RAYON_NUM_THREADS", n.to_string()) };
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .map_err(|e| format!("cannot start {n} threads: {e}"))?;
    Ok(n)
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not in [0, 1]"))
    }
}

fn pct(v: f64) -> String {
    format!("{:.1}%", 100.0 * v)
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    tune_malloc();
    let threads = setup_threads(cli.threads)?;
    std::fs::create_dir_all(&cli.out)
        .map_err(|e| format!("cannot create output directory {}: {e}", cli.out.display()))?;
    let cfg = TrainConfig {
        seed: cli.seed,
        steps: cli.steps as usize,
        group_size: cli.group_size as usize,
        loss: cli.loss,
        warmup_steps: cli.warmup_steps as usize,
        warmup_target: cli.warmup_target,
        prompts_per_step: cli.prompts as usize,
        eval_every: cli.eval_every as usize,
        n_held_out: cli.held_out as usize,
        ..TrainConfig::default()
    };
    let mut t = Trainer::new(cfg.clone())?;
    eprintln!(
        "grpo-demo: {} parameters, recipe {}, G = {}, {} prompts/step, {} steps, seed {}, {} threads",
        t.model.num_params(),
        cfg.loss,
        cfg.group_size,
        cfg.prompts_per_step,
        cfg.steps,
        cfg.seed,
        threads
    );
    let random_acc = t.held_out_accuracy()?;

    let style =
        ProgressStyle::with_template("{prefix:>8} [{bar:30}] {pos:>4}/{len} {elapsed:>4} {msg}")
            .map_err(|e| e.to_string())?
            .progress_chars("=> ");
    let bar = ProgressBar::new(cfg.warmup_steps as u64)
        .with_style(style.clone())
        .with_prefix("warm-up");
    let warmup_steps = t.warmup(|i, nll| {
        if i % 5 == 0 {
            bar.set_message(format!("nll {nll:.3}"));
        }
        bar.inc(1);
    })?;
    bar.finish_with_message(format!("stopped after {warmup_steps} steps"));
    let warmup_s = t.elapsed();
    let warmup_acc = t.held_out_accuracy()?;
    eprintln!(
        "held-out accuracy: random init {}, after {warmup_steps} warm-up steps {} ({warmup_s:.1} s)",
        pct(random_acc),
        pct(warmup_acc)
    );

    let mut rows = vec![StepMetrics {
        step: 0,
        elapsed_s: t.elapsed(),
        held_out_acc: Some(warmup_acc),
        reward: f64::NAN,
        entropy: f64::NAN,
        clip_frac: f64::NAN,
        loss: f64::NAN,
        ..Default::default()
    }];
    let bar = ProgressBar::new(cfg.steps as u64)
        .with_style(style)
        .with_prefix("GRPO");
    let mut acc = warmup_acc;
    for step in 1..=cfg.steps {
        let mut m = t.grpo_step(step)?;
        if step % cfg.eval_every == 0 || step == cfg.steps {
            acc = t.held_out_accuracy()?;
            m.held_out_acc = Some(acc);
        }
        m.elapsed_s = t.elapsed();
        bar.set_message(format!(
            "reward {:.3} acc {} ent {:.3} clip {:.3} kept {}/{}",
            m.reward,
            pct(acc),
            m.entropy,
            m.clip_frac,
            m.groups_kept,
            m.groups_sampled
        ));
        bar.inc(1);
        rows.push(m);
    }
    bar.finish();
    let total_s = t.elapsed();

    let accs: Vec<f64> = rows.iter().filter_map(|m| m.held_out_acc).collect();
    let rewards: Vec<f64> = rows.iter().skip(1).map(|m| m.reward).collect();
    let mean = |v: &[f64]| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    let k = rewards.len().min(10);
    let summary = Summary {
        loss: cfg.loss.to_string(),
        random_acc,
        warmup_acc,
        final_acc: acc,
        best_acc: accs.iter().cloned().fold(0.0, f64::max),
        reward_first: mean(&rewards[..k]),
        reward_last: mean(&rewards[rewards.len() - k..]),
        warmup_steps,
        warmup_s,
        grpo_s: total_s - warmup_s,
        steps: cfg.steps,
        cpu_s: report::process_cpu_seconds(),
    };
    let table = summary.table();
    println!("{table}");
    report::write_file(&cli.out.join("metrics.csv"), &report::csv(&rows))?;
    report::write_file(&cli.out.join("summary.txt"), &format!("{table}\n"))?;
    let title = format!(
        "grpo-demo: {} (G = {}, seed {})",
        cfg.loss, cfg.group_size, cfg.seed
    );
    report::plot(&cli.out.join("reward.png"), &rows, &title).map_err(|e| format!("plot: {e}"))?;
    println!(
        "wrote {}/metrics.csv, reward.png, summary.txt ({total_s:.1} s)",
        cli.out.display()
    );
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse(); // invalid options: clap prints the reason and exits with status 2
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
