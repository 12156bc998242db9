//! `grpo-bench vocab`: grpo-cpu's vocabulary kernels against the same-run memory roofline.

use grpo_core::vocab::{GradTerms, JsdState, KlDirection, KlTerm, LseState, PairState};
use grpo_cpu::{Cpu, Storage, roofline};

use crate::{Args, interleaved_times, median};

/// Every kernel the benchmark knows, in the default order.
pub(crate) const KERNELS: &[&str] = &[
    "fused",
    "logprob",
    "stats",
    "kl",
    "kl_saved",
    "jsd",
    "jsd_saved",
    "jsd_backward",
    "jsd_backward_in_place",
    "jsd_backward_saved",
    "backward",
    "backward_in_place",
    "backward_kl",
    "backward_saved",
    "backward_kl_saved",
];

/// The default shapes `(rows, vocab)`: a 32k-vocabulary batch and a Qwen-sized vocabulary.
const SHAPES: &[(usize, usize)] = &[(2048, 32768), (512, 151936)];

pub(crate) fn main(args: &[String]) -> Result<(), String> {
    let a = Args::parse(
        args,
        &[
            "rows",
            "vocab",
            "dtype",
            "threads",
            "backend",
            "prefetch",
            "kernel",
            "iters",
            "temperature",
            "masked",
        ],
    )?;
    let shapes: Vec<(usize, usize)> = match (a.num("rows")?, a.num("vocab")?) {
        (None, None) => SHAPES.to_vec(),
        (r, v) => vec![(r.unwrap_or(512), v.unwrap_or(32768))],
    };
    let dtypes: Vec<&str> = match a.get("dtype") {
        None => vec!["f32", "bf16"],
        Some("all") => vec!["f32", "bf16", "f16"],
        Some(d @ ("f32" | "bf16" | "f16")) => vec![d],
        Some(d) => return Err(format!("--dtype {d:?}: expected f32, bf16, f16 or all")),
    };
    let kernels: Vec<&str> = match a.get("kernel") {
        None | Some("all") => KERNELS.to_vec(),
        Some(k) if KERNELS.contains(&k) => vec![k],
        Some(k) => return Err(format!("--kernel {k:?}: expected one of {KERNELS:?}")),
    };
    let iters = a.num("iters")?.unwrap_or(7).max(1);
    // T = 1 by default (TRL's and verl's default); the kernels skip the exact `·1/T` there,
    // so other temperatures run one multiply more per element (two for the gradient).
    let temperature = match a.get("temperature") {
        None => 1.0f32,
        Some(v) => v
            .parse::<f32>()
            .ok()
            .filter(|t| t.is_finite() && *t > 0.0)
            .ok_or_else(|| format!("--temperature {v:?}: expected a finite number > 0"))?,
    };
    // Every `masked`-th logit is −∞ (a masked vocabulary entry); 0 = none.
    let masked = a.num("masked")?.unwrap_or(0);
    if masked == 1 {
        return Err("--masked 1 would mask every logit: expected 0 (none) or at least 2".into());
    }
    let cpus = a.cpus()?;
    for &(rows, vocab) in &shapes {
        for &dtype in &dtypes {
            let cfg = Config {
                cpus: &cpus,
                rows,
                vocab,
                dtype,
                iters,
                temperature,
                masked,
                kernels: &kernels,
            };
            match dtype {
                "f32" => run::<f32>(&cfg, |x| x),
                "bf16" => run::<half::bf16>(&cfg, half::bf16::from_f32),
                _ => run::<half::f16>(&cfg, half::f16::from_f32),
            }?;
        }
    }
    Ok(())
}

struct Config<'a> {
    /// One executor, or two (`--prefetch both`) timed interleaved against the same roofline.
    cpus: &'a [Cpu],
    rows: usize,
    vocab: usize,
    dtype: &'a str,
    iters: usize,
    temperature: f32,
    masked: usize,
    kernels: &'a [&'a str],
}

/// Deterministic logits uniform in [−12, 12); with `masked = k > 0` every k-th one (from index
/// 1, so no row's first entry) is −∞, a masked vocabulary entry.
fn logits(seed: u64, n: usize, masked: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            if masked > 0 && i % masked == 1 % masked {
                f32::NEG_INFINITY
            } else {
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 24.0 - 12.0
            }
        })
        .collect()
}

fn run<S: Storage>(c: &Config<'_>, conv: impl Fn(f32) -> S) -> Result<(), String> {
    let n = c.rows * c.vocab;
    let z: Vec<S> = logits(1, n, c.masked).into_iter().map(&conv).collect();
    let needs_teacher = c
        .kernels
        .iter()
        .any(|k| k.starts_with("kl") || k.starts_with("jsd") || k.starts_with("backward_kl"));
    let w: Vec<S> = if needs_teacher {
        logits(2, n, c.masked).into_iter().map(&conv).collect()
    } else {
        Vec::new()
    };
    // A target on a masked logit would be an error (log p = −∞): move it to the next entry.
    let is_masked = |i: usize| c.masked > 0 && i % c.masked == 1 % c.masked;
    let targets: Vec<u32> = (0..c.rows)
        .map(|r| {
            let t = (r * 7919 + 13) % c.vocab;
            let t = if is_masked(r * c.vocab + t) {
                (t + 1) % c.vocab
            } else {
                t
            };
            t as u32
        })
        .collect();
    let ones = vec![1.0f32; c.rows];
    let halves = vec![0.5f32; c.rows];
    let size = size_of::<S>();
    let mut a = vec![0.0f32; c.rows];
    let mut b = vec![0.0f32; c.rows];
    let mut grad: Vec<f32> = Vec::new();
    let mut inplace: Vec<S> = Vec::new();
    for &kernel in c.kernels {
        // Bytes the kernel must move: its inputs once, its gradient output once.
        let (read, write) = match kernel {
            // `kl_saved` and `jsd_saved` also write their states (eight and six f32 per row):
            // not counted.
            "kl" | "kl_saved" | "jsd" | "jsd_saved" => (2 * n * size, 0),
            // `backward_saved` reads the logits once, `backward` twice (its forward pass): the
            // same bytes to move.
            "backward" | "backward_saved" => (n * size, n * 4),
            // Distillation: student and teacher read, the student's gradient written (twice
            // read by `backward_kl`, once by `backward_kl_saved`).
            "backward_kl" | "backward_kl_saved" => (2 * n * size, n * 4),
            // The JSD's gradient reads both rows three times (statistics, KL(p‖m), gradient),
            // from saved states once: counted once.
            "jsd_backward" | "jsd_backward_saved" => (2 * n * size, n * 4),
            "jsd_backward_in_place" => (2 * n * size, n * size),
            "backward_in_place" => (n * size, n * size),
            _ => (n * size, 0),
        };
        // `backward_kl` and `backward_kl_saved` add a KL(p‖q) (student‖teacher) term towards the teacher
        // row.
        let with_kl = matches!(kernel, "backward_kl" | "backward_kl_saved");
        let terms: GradTerms<'_, u32, S> = GradTerms {
            logp: Some((&targets, &ones)),
            entropy: Some(&halves),
            kl: with_kl.then_some(KlTerm {
                teacher: &w,
                grad: &halves,
                direction: KlDirection::StudentTeacher,
            }),
        };
        // `backward_saved`: the row states of the forward a trainer has run anyway (untimed).
        let mut saved = Vec::new();
        if kernel == "backward_saved" {
            saved = vec![LseState::EMPTY; c.rows];
            let (lp, ent) = (&mut a, Some(&mut b[..]));
            c.cpus[0]
                .logprob_entropy_rows_saved(
                    &z,
                    c.vocab,
                    &targets,
                    c.temperature,
                    lp,
                    ent,
                    &mut saved,
                )
                .map_err(|e| format!("{kernel}: {e}"))?;
        }
        // `backward_kl_saved`: the pair states of the KL forward a distillation step has run
        // anyway (untimed).
        // `jsd_backward_saved`: the states of the saving JSD forward (untimed).
        let mut jsd_states = vec![JsdState::EMPTY; c.rows];
        if kernel == "jsd_backward_saved" {
            let (v, t) = (c.vocab, c.temperature);
            c.cpus[0]
                .jsd_rows_saved(&z, &w, v, 0.5, t, &mut a, &mut jsd_states)
                .map_err(|e| format!("{kernel}: {e}"))?;
        }
        let mut pairs = vec![PairState::EMPTY; c.rows];
        if kernel == "backward_kl_saved" {
            let (v, t, d) = (c.vocab, c.temperature, KlDirection::StudentTeacher);
            c.cpus[0]
                .kl_rows_saved(&z, &w, v, t, d, &mut a, &mut pairs)
                .map_err(|e| format!("{kernel}: {e}"))?;
        }
        let lse_terms: GradTerms<'_, u32> = GradTerms {
            logp: Some((&targets, &ones)),
            entropy: Some(&halves),
            kl: None,
        };
        let mut fail: Option<String> = None;
        let cpus = c.cpus;
        let roof_cpu = &cpus[0];
        // Job `j < cpus.len()` is the kernel on `cpus[j]`; the next is the roofline, and for
        // the kernels that write, the one after it the copy with streaming stores.
        let (times, roof_bytes);
        if write == 0 {
            let probe = vec![1.0f32; read / 4];
            roof_bytes = probe.len() * 4;
            times = interleaved_times(c.iters, cpus.len() + 1, |j| {
                let Some(cpu) = cpus.get(j) else {
                    std::hint::black_box(roofline::read(roof_cpu, &probe));
                    return;
                };
                let r = match kernel {
                    "fused" => cpu.logprob_entropy_rows(
                        &z,
                        c.vocab,
                        &targets,
                        c.temperature,
                        &mut a,
                        Some(&mut b),
                    ),
                    "logprob" => {
                        cpu.logprob_entropy_rows(&z, c.vocab, &targets, c.temperature, &mut a, None)
                    }
                    "stats" => cpu.stats_rows(&z, c.vocab, c.temperature, &mut a, &mut b),
                    "kl" => cpu.kl_rows(
                        &z,
                        &w,
                        c.vocab,
                        c.temperature,
                        KlDirection::StudentTeacher,
                        &mut a,
                    ),
                    "kl_saved" => {
                        let (v, t, d) = (c.vocab, c.temperature, KlDirection::StudentTeacher);
                        cpu.kl_rows_saved(&z, &w, v, t, d, &mut a, &mut pairs)
                    }
                    "jsd_saved" => {
                        let (v, t) = (c.vocab, c.temperature);
                        cpu.jsd_rows_saved(&z, &w, v, 0.5, t, &mut a, &mut jsd_states)
                    }
                    _ => cpu.jsd_rows(&z, &w, c.vocab, 0.5, c.temperature, &mut a),
                };
                if let Err(e) = r {
                    fail = Some(e.to_string());
                }
            });
        } else {
            let half_elems = (read + write) / 8;
            let src = vec![1.0f32; half_elems];
            let mut dst = vec![0.0f32; half_elems];
            roof_bytes = half_elems * 8;
            if kernel.ends_with("in_place") {
                inplace = z.clone();
            } else {
                grad = vec![0.0f32; n];
            }
            times = interleaved_times(c.iters, cpus.len() + 2, |j| {
                let Some(cpu) = cpus.get(j) else {
                    if j == cpus.len() {
                        roofline::copy(roof_cpu, &src, &mut dst);
                    } else {
                        roofline::copy_stream(roof_cpu, &src, &mut dst);
                    }
                    return;
                };
                let r = match kernel {
                    // Re-running in place overwrites logits with gradients; still valid input
                    // (finite), so every iteration does the same amount of work.
                    "backward_in_place" => {
                        cpu.backward_rows_in_place(&mut inplace, c.vocab, c.temperature, &terms)
                    }
                    "backward_saved" => {
                        let t = c.temperature;
                        cpu.backward_rows_saved(&z, c.vocab, t, &saved, &lse_terms, &mut grad)
                    }
                    "backward_kl_saved" => {
                        let t = c.temperature;
                        cpu.backward_rows_saved(&z, c.vocab, t, &pairs, &terms, &mut grad)
                    }
                    "jsd_backward" => {
                        let t = c.temperature;
                        cpu.jsd_backward_rows(&z, &w, c.vocab, 0.5, t, &halves, &mut grad)
                    }
                    // Gradients over gradients: finite and as expensive (the same passes).
                    "jsd_backward_in_place" => {
                        let (v, t) = (c.vocab, c.temperature);
                        cpu.jsd_backward_rows_in_place(&mut inplace, &w, v, 0.5, t, &halves)
                    }
                    // The states stay those of the original rows: the same work per element.
                    "jsd_backward_saved" => {
                        let (v, t, st) = (c.vocab, c.temperature, &jsd_states);
                        cpu.jsd_backward_rows_saved(&z, &w, v, t, st, &halves, &mut grad)
                    }
                    _ => cpu.backward_rows(&z, c.vocab, c.temperature, &terms, &mut grad),
                };
                if let Err(e) = r {
                    fail = Some(e.to_string());
                }
            });
        }
        if let Some(e) = fail {
            return Err(format!("{kernel}: {e}"));
        }
        let bytes = (read + write) as f64;
        let roof_ms = median(&mut times[cpus.len()].clone());
        let roof = roof_bytes as f64 / roof_ms / 1e6;
        // The kernels that write: the copy with streaming stores as a second, stricter
        // read + write roofline (see `roofline::copy_stream`).
        let stream_roof = times
            .get(cpus.len() + 1)
            .map(|t| roof_bytes as f64 / median(&mut t.clone()) / 1e6);
        for (j, cpu) in cpus.iter().enumerate() {
            let kernel_ms = median(&mut times[j].clone());
            let gbps = bytes / kernel_ms / 1e6;
            // With both prefetch settings: the median over rounds of this setting's time over
            // the other's in the same round.
            let paired = match cpus.len() {
                2 => {
                    let mut r: Vec<f64> = times[j]
                        .iter()
                        .zip(&times[1 - j])
                        .map(|(t, o)| t / o)
                        .collect();
                    format!(",\"time_vs_other_prefetch\":{:.3}", median(&mut r))
                }
                _ => String::new(),
            };
            let stream = stream_roof.map_or(String::new(), |r| {
                format!(
                    ",\"stream_roofline_gbps\":{r:.2},\"stream_ratio\":{:.3}",
                    gbps / r
                )
            });
            println!(
                "{{\"kernel\":\"{kernel}\",\"dtype\":\"{}\",\"rows\":{},\"vocab\":{},\"temperature\":{},\"masked\":{},\"backend\":\"{}\",\"prefetch\":{},\"threads\":{},\"iters\":{},\"median_ms\":{kernel_ms:.3},\"gbps\":{gbps:.2},\"roofline_gbps\":{roof:.2},\"ratio\":{:.3},\"rows_per_s\":{:.0}{stream}{paired}}}",
                c.dtype,
                c.rows,
                c.vocab,
                c.temperature,
                c.masked,
                cpu.backend().name(),
                crate::prefetch_json(cpu),
                cpu.threads(),
                c.iters,
                gbps / roof,
                c.rows as f64 / (kernel_ms / 1e3),
            );
        }
    }
    Ok(())
}
