//! `grpo-bench loss`: grpo-cpu's multi-threaded per-token PPO-clip (GRPO bounds, and ATR-GRPO's
//! KL3 bounds) against the same-run read + write roofline.
//!
//! Fields of each JSON line in this mode: `kernel` = `"ppo_clip"` (bounds [0.8, 1.2]) or
//! `"atr_kl3_clip"` (ATR-GRPO's KL3 bounds, δ = 0.05); `dtype` = `"f32"`; `rows` = number of
//! sequences of the padded batch; `vocab` = tokens per sequence (this mode has no vocabulary);
//! `backend` = the detected SIMD backend that runs grpo-cpu's PPO-clip kernel (`avx512`, …);
//! `threads`; `median_ms`; `gbps` = bytes moved / time, bytes = lp, old, adv read
//! (3 × 4 B/token) + value, grad written (2 × 4 B/token); `roofline_gbps` = grpo-cpu's
//! multi-threaded copy of the same 20 B/token (half read, half written) on the same threads,
//! timed interleaved; `ratio = gbps / roofline_gbps`; `tokens_per_s`; `stream_roofline_gbps`
//! and `stream_ratio`, the same against the copy with streaming stores
//! (`grpo_cpu::roofline::copy_stream`, a stricter roofline where plain stores read each
//! destination line before writing it). `--clip core` (not in
//! `all`) times grpo-core's own single-threaded `ppo_clip` instead (`backend` = `"core"`,
//! `threads` = 1; its roofline is still the copy on the pool's threads).

use grpo_core::Tokens;
use grpo_core::loss::{PolicyInputs, PpoClipConfig};
use grpo_cpu::{Cpu, roofline};

use crate::{Args, interleaved_medians};

/// Tokens per sequence of the benchmark batch.
const SEQ_LEN: usize = 1024;

pub(crate) fn main(args: &[String]) -> Result<(), String> {
    let a = Args::parse(args, &["tokens", "threads", "iters", "clip"])?;
    let tokens = a.num("tokens")?.unwrap_or(1 << 23).max(1);
    let threads = a.num("threads")?.unwrap_or(2);
    let iters = a.num("iters")?.unwrap_or(7).max(1);
    let clips: Vec<&str> = match a.get("clip") {
        None | Some("all") => vec!["ppo", "kl3"],
        Some(c @ ("ppo" | "kl3" | "core")) => vec![c],
        Some(c) => return Err(format!("--clip {c:?}: expected ppo, kl3, core or all")),
    };
    let cpu = Cpu::detect()
        .with_threads(threads)
        .map_err(|e| e.to_string())?;
    // Padded [rows, cols]: whole sequences of SEQ_LEN tokens, or one sequence if fewer.
    let cols = SEQ_LEN.min(tokens);
    let rows = tokens / cols;
    let n = rows * cols;
    let (lp, old, adv) = inputs(n);
    let inp = PolicyInputs {
        lp: &lp,
        old: &old,
        adv: &adv,
        tokens: Tokens::padded(rows, cols, None),
    };
    let mut value = vec![0.0f32; n];
    let mut grad = vec![0.0f32; n];
    let half = n * 20 / 8;
    let src = vec![1.0f32; half];
    // One destination per copy probe: each closure borrows its own.
    let (mut dst, mut dst_stream) = (vec![0.0f32; half], vec![0.0f32; half]);
    for clip in clips {
        // `core`: grpo-core's own `ppo_clip` on the calling thread, for comparison.
        let on_core = clip == "core";
        let (name, cfg) = match clip {
            "ppo" | "core" => ("ppo_clip", PpoClipConfig::<f32>::default()),
            _ => (
                "atr_kl3_clip",
                PpoClipConfig::atr_kl3(0.05).map_err(|e| e.to_string())?,
            ),
        };
        let mut fail = None;
        let [ms, roof_ms, stream_ms] = interleaved_medians(
            iters,
            [
                &mut || {
                    let r = if on_core {
                        grpo_core::loss::ppo_clip(&cfg, &inp, &mut value, &mut grad)
                    } else {
                        cpu.ppo_clip(&cfg, &inp, &mut value, &mut grad)
                    };
                    if let Err(e) = r {
                        fail = Some(e.to_string());
                    }
                },
                &mut || roofline::copy(&cpu, &src, &mut dst),
                &mut || roofline::copy_stream(&cpu, &src, &mut dst_stream),
            ],
        );
        if let Some(e) = fail {
            return Err(format!("{name}: {e}"));
        }
        let bytes = (n * 20) as f64;
        let gbps = bytes / ms / 1e6;
        let roof = (half * 8) as f64 / roof_ms / 1e6;
        let stream_roof = (half * 8) as f64 / stream_ms / 1e6;
        println!(
            "{{\"kernel\":\"{name}\",\"dtype\":\"f32\",\"rows\":{rows},\"vocab\":{cols},\"backend\":\"{}\",\"threads\":{},\"iters\":{iters},\"median_ms\":{ms:.3},\"gbps\":{gbps:.2},\"roofline_gbps\":{roof:.2},\"ratio\":{:.3},\"tokens_per_s\":{:.0},\"stream_roofline_gbps\":{stream_roof:.2},\"stream_ratio\":{:.3}}}",
            if on_core {
                "core"
            } else {
                cpu.backend().name()
            },
            if on_core { 1 } else { cpu.threads() },
            gbps / roof,
            n as f64 / (ms / 1e3),
            gbps / stream_roof,
        );
    }
    Ok(())
}

/// Deterministic log-probabilities in [−4, 0) and π_old within ±0.3 of them (so some ratios
/// fall outside the clip bounds), advantages in [−2, 2) with one token in 16 at exactly 0.
pub(crate) fn inputs(n: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    let mut lp = Vec::with_capacity(n);
    let mut old = Vec::with_capacity(n);
    let mut adv = Vec::with_capacity(n);
    for t in 0..n {
        let l = -4.0 * next();
        lp.push(l);
        old.push(l + 0.6 * next() - 0.3);
        adv.push(if t % 16 == 0 { 0.0 } else { 4.0 * next() - 2.0 });
    }
    (lp, old, adv)
}
