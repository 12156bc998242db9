//! `grpo-bench wgpu`: grpo-wgpu's kernels on device-resident data against a same-run device copy.
//!
//! ```text
//! grpo-bench wgpu [--rows N] [--vocab V] [--dtype f32|f16|bf16|all] [--tokens N] [--iters K]
//! ```
//!
//! Rows, one JSON object per line, in the fields of the other modes plus `adapter`:
//! - `fused`: the fused forward (log-sum-exp, target log-prob and entropy in one pass) per dtype;
//!   `dtype` = the logits' storage; bytes = the logits read once.
//! - `backward`: the fused backward per dtype; bytes = the logits read once + the f32 gradient
//!   written once (the kernel reads each row twice; the second read is not counted).
//! - `kl`: KL(p‖q) between every student row and a teacher row per dtype; bytes = both rows
//!   read once (the kernel reads each pair twice, its shifts taken to the final row maxima;
//!   the second read is not counted).
//! - `backward_saved`: the backward of `backward` from the softmax states a forward saved
//!   (`VocabKernel::backward_saved`; the states computed by grpo-core when the work is built);
//!   the same bytes as `backward`, which the kernel moves exactly (one read, one write).
//! - `backward_saved_in_place`: `backward_saved` writing the gradient in the logits' storage
//!   type (`VocabKernel::backward_saved_in_place`); bytes = the logits read once + the gradient
//!   written once, both in the storage type (for bf16 and f16 half of `backward_saved`'s write).
//! - `backward_kl_saved`: the same from pair states with a KL(p‖q) (student‖teacher) term as well; bytes = both
//!   rows read once + the f32 gradient written once.
//! - `ppo_clip`: per-token PPO-clip value + gradient (bounds [0.8, 1.2]) as in `grpo-bench loss`:
//!   `rows` = sequences of 1024 tokens, `vocab` = tokens per sequence, `tokens_per_s`; bytes =
//!   28 per token, what the kernel moves: lp, old, adv and the 4-byte mask word read, value,
//!   gradient and the mask word (rewritten with the token's clip/clamp events) written. The CPU
//!   rows of `grpo-bench loss` count 20 (no mask word), so compare their `tokens_per_s`, not
//!   their `gbps`.
//!
//! `backend` is wgpu's backend (`vulkan`, `metal`, `dx12`, …), `threads` is 0, `adapter` the
//! adapter's name. Every kernel runs on inputs uploaded once (grpo-wgpu's `#[doc(hidden)]`
//! resident hooks): a timed iteration records the dispatch, submits it and waits, with no upload
//! or readback. That the work these hooks build computes the public operations' bits is tested
//! in `tests/tests/wgpu_vocab.rs` and `wgpu_loss.rs` (each variant read back after one run). Two device copies of half the kernel's bytes — each reads and writes them, so it
//! moves the same total — are timed interleaved with the kernel (`interleaved_medians`):
//! `copy_buffer_to_buffer` (`copy_gbps`) and a compute shader (`shader_copy_gbps`, grpo-wgpu's
//! `copy.wgsl`; `null` where the device cannot bind that much). `roofline_gbps` is the faster of
//! the two and `ratio = gbps / roofline_gbps`: on an NVIDIA H200 (Vulkan) the buffer copy ran at
//! 0.34–0.80 TB/s and the shader copy at 2.3–3.3 TB/s, so a buffer copy alone would flatter the
//! kernels (PyTorch's device copy on the same GPU: 4.06 TB/s, so even the shader copy is a
//! Vulkan/WGSL roofline, not the memory's). Each measurement first runs all three untimed for
//! 300 ms, so that the GPU has raised its clock. Times include submit and wait, so small shapes
//! measure latency rather than bandwidth.
//!
//! Default shapes: 2048 × 151936 logits and 8 M tokens on a GPU; on a software adapter
//! (lavapipe / llvmpipe: wgpu's `DeviceType::Cpu`) 16 × 32768 and 1 M tokens, so the run takes
//! seconds. Rows that do not fit one storage binding of the device are reduced (a note on
//! stderr; the JSON line has the rows measured). Without an adapter the mode prints why on
//! stderr and exits 0, unless `GRPO_REQUIRE_GPU=1` (then it fails).

use grpo_core::Tokens;
use grpo_core::loss::{PolicyInputs, PpoClipConfig};
use grpo_wgpu::{GpuContext, GpuError, LogitStorage, Resident, ResidentVocab, VocabKernel};

use crate::{Args, interleaved_medians};

/// How long every measurement first runs its work untimed (see `Bench::time`).
const WARM_UP: std::time::Duration = std::time::Duration::from_millis(300);

/// Tokens per sequence of the PPO-clip batch (as `grpo-bench loss`).
const SEQ_LEN: usize = 1024;

/// What one run measures.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Options {
    pub(crate) rows: usize,
    pub(crate) vocab: usize,
    pub(crate) dtypes: Vec<&'static str>,
    pub(crate) tokens: usize,
    pub(crate) iters: usize,
}

impl Options {
    /// Parses the mode's arguments; `software` selects the small default shapes.
    pub(crate) fn parse(args: &[String], software: bool) -> Result<Self, String> {
        let a = Args::parse(args, &["rows", "vocab", "dtype", "tokens", "iters"])?;
        let (rows, vocab, tokens) = if software {
            (16, 32768, 1 << 20)
        } else {
            (2048, 151_936, 1 << 23)
        };
        let dtypes = match a.get("dtype") {
            None | Some("all") => vec!["f32", "f16", "bf16"],
            Some("f32") => vec!["f32"],
            Some("f16") => vec!["f16"],
            Some("bf16") => vec!["bf16"],
            Some(d) => return Err(format!("--dtype {d:?}: expected f32, f16, bf16 or all")),
        };
        Ok(Options {
            rows: a.num("rows")?.unwrap_or(rows).max(1),
            vocab: a.num("vocab")?.unwrap_or(vocab).max(1),
            dtypes,
            tokens: a.num("tokens")?.unwrap_or(tokens).max(1),
            iters: a.num("iters")?.unwrap_or(10).max(1),
        })
    }
}

/// One measured kernel: what is printed as one JSON line.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Row<'a> {
    pub(crate) kernel: &'a str,
    pub(crate) dtype: &'a str,
    pub(crate) rows: usize,
    pub(crate) vocab: usize,
    pub(crate) backend: &'a str,
    pub(crate) adapter: &'a str,
    pub(crate) iters: usize,
    /// Bytes the kernel must move.
    pub(crate) bytes: u64,
    pub(crate) timing: Timing,
    /// `"rows_per_s"` or `"tokens_per_s"`, and the count it divides by the time.
    pub(crate) rate: (&'a str, usize),
}

/// What one interleaved measurement gave (medians, ms).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Timing {
    pub(crate) kernel_ms: f64,
    /// `copy_buffer_to_buffer`: bytes moved (read + written) and time.
    pub(crate) copy: (u64, f64),
    /// The shader copy (`copy.wgsl`): bytes moved and time, if the device could bind it.
    pub(crate) shader_copy: Option<(u64, f64)>,
}

impl Row<'_> {
    pub(crate) fn json(&self) -> String {
        let t = &self.timing;
        let gbps = |bytes: u64, ms: f64| bytes as f64 / ms / 1e6;
        let kernel = gbps(self.bytes, t.kernel_ms);
        let copy = gbps(t.copy.0, t.copy.1);
        let shader_copy = t.shader_copy.map(|(b, ms)| gbps(b, ms));
        // The roofline is the faster of the two copies.
        let roof = shader_copy.map_or(copy, |s| s.max(copy));
        format!(
            "{{\"kernel\":{},\"dtype\":{},\"rows\":{},\"vocab\":{},\"backend\":{},\"threads\":0,\"iters\":{},\"median_ms\":{:.3},\"gbps\":{kernel:.2},\"roofline_gbps\":{roof:.2},\"ratio\":{:.3},\"{}\":{:.0},\"copy_gbps\":{copy:.2},\"shader_copy_gbps\":{},\"adapter\":{}}}",
            json_str(self.kernel),
            json_str(self.dtype),
            self.rows,
            self.vocab,
            json_str(self.backend),
            self.iters,
            t.kernel_ms,
            kernel / roof,
            self.rate.0,
            self.rate.1 as f64 / (t.kernel_ms / 1e3),
            shader_copy.map_or("null".to_string(), |g| format!("{g:.2}")),
            json_str(self.adapter),
        )
    }
}

/// A JSON string literal (quotes, backslashes and control characters escaped).
pub(crate) fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Whether `GRPO_REQUIRE_GPU=1` (a missing adapter is then a failure, as in the GPU tests).
fn gpu_required() -> bool {
    std::env::var("GRPO_REQUIRE_GPU").as_deref() == Ok("1")
}

pub(crate) fn main(args: &[String]) -> Result<(), String> {
    // Parse once before touching the device so a bad argument fails fast.
    Options::parse(args, true)?;
    let ctx = match GpuContext::new() {
        Ok(c) => c,
        Err(e @ GpuError::NoAdapter { .. }) if !gpu_required() => {
            eprintln!("grpo-bench wgpu: skipped: {e} (set GRPO_REQUIRE_GPU=1 to fail instead)");
            return Ok(());
        }
        Err(e) => return Err(format!("wgpu: {e}")),
    };
    let info = ctx.adapter_info().clone();
    let software = ctx.is_software();
    let o = Options::parse(args, software)?;
    let b = Bench {
        ctx: &ctx,
        backend: info.backend.to_str(),
        adapter: &info.name,
        iters: o.iters,
    };
    for &dtype in &o.dtypes {
        match dtype {
            "f32" => b.vocab::<f32>(dtype, &o, |x| x)?,
            "bf16" => b.vocab::<half::bf16>(dtype, &o, half::bf16::from_f32)?,
            _ if !ctx.supports_f16() => {
                let msg = format!("the adapter {:?} lacks SHADER_F16", info.name);
                if o.dtypes.len() == 1 {
                    return Err(format!("--dtype f16: {msg}"));
                }
                eprintln!("grpo-bench wgpu: f16 rows skipped: {msg}");
            }
            _ => b.vocab::<half::f16>(dtype, &o, half::f16::from_f32)?,
        }
    }
    b.ppo_clip(o.tokens)
}

struct Bench<'a> {
    ctx: &'a GpuContext,
    backend: &'a str,
    adapter: &'a str,
    iters: usize,
}

impl Bench<'_> {
    /// Median times of `work` and of the two device copies moving the same bytes (read +
    /// written), interleaved: `copy_buffer_to_buffer` and a shader copy (left out where the
    /// device cannot bind that much).
    fn time(&self, work: &Resident<'_>, bytes: u64) -> Result<Timing, String> {
        let half = (bytes / 2).max(4);
        let copy = self
            .ctx
            .resident_copy(half)
            .map_err(|e| format!("roofline copy: {e}"))?;
        let shader_copy = self
            .ctx
            .resident_shader_copy(half)
            .map_err(|e| eprintln!("grpo-bench wgpu: no shader copy of {half} bytes: {e}"))
            .ok();
        let fail = std::cell::RefCell::new(None);
        let run = |r: &Resident<'_>| {
            if let Err(e) = r.run() {
                fail.borrow_mut().get_or_insert(e);
            }
        };
        // A GPU idles at a low clock and takes a while to raise it: the first row of a run on
        // an NVIDIA H200 measured 0.70 where later rows and runs of the same kernel measured
        // 0.98–1.05. So all three run for WARM_UP before anything is timed.
        let start = std::time::Instant::now();
        while start.elapsed() < WARM_UP {
            run(work);
            run(&copy);
            shader_copy.iter().for_each(run);
        }
        let [kernel_ms, copy_ms, shader_copy_ms] = interleaved_medians(
            self.iters,
            [&mut || run(work), &mut || run(&copy), &mut || {
                shader_copy.iter().for_each(run)
            }],
        );
        match fail.into_inner() {
            Some(e) => Err(e.to_string()),
            None => Ok(Timing {
                kernel_ms,
                copy: (copy.bytes(), copy_ms),
                shader_copy: shader_copy.map(|c| (c.bytes(), shader_copy_ms)),
            }),
        }
    }

    fn vocab<L: LogitStorage>(
        &self,
        dtype: &str,
        o: &Options,
        conv: fn(f32) -> L,
    ) -> Result<(), String> {
        let elem = size_of::<L>() as u64;
        // One chunk per kernel: the logits and the f32 gradient must each fit one binding.
        let limit = self.ctx.limits().max_storage_buffer_binding_size;
        let limit = limit.min(self.ctx.limits().max_buffer_size);
        let per_row = o.vocab as u64 * elem.max(4);
        let fit = usize::try_from(limit / per_row.max(1))
            .unwrap_or(usize::MAX)
            .min(self.ctx.limits().max_compute_workgroups_per_dimension as usize);
        let rows = o.rows.min(fit);
        if rows == 0 {
            return Err(format!(
                "one row of {} {dtype} logits does not fit a storage binding ({limit} bytes)",
                o.vocab
            ));
        }
        if rows < o.rows {
            eprintln!(
                "grpo-bench wgpu: {dtype}: {} rows do not fit one binding ({limit} bytes); \
                 measuring {rows}",
                o.rows
            );
        }
        let logits = logits(rows * o.vocab, conv);
        // The teacher: the student's rows in reverse order (different rows, same values).
        let teacher: Vec<L> = logits.iter().rev().copied().collect();
        let k = VocabKernel::new(self.ctx);
        let n = (rows * o.vocab) as u64;
        for (kernel, what, bytes) in [
            ("fused", ResidentVocab::Forward, n * elem),
            ("backward", ResidentVocab::Backward, n * elem + n * 4),
            ("kl", ResidentVocab::Kl { teacher: &teacher }, 2 * n * elem),
            (
                "backward_saved",
                ResidentVocab::BackwardSaved,
                n * elem + n * 4,
            ),
            (
                "backward_saved_in_place",
                ResidentVocab::BackwardSavedInPlace,
                2 * n * elem,
            ),
            (
                "backward_kl_saved",
                ResidentVocab::BackwardKlSaved { teacher: &teacher },
                2 * n * elem + n * 4,
            ),
            // Both rows read (three times, counted once), the gradient written.
            (
                "jsd_backward",
                ResidentVocab::JsdBackward { teacher: &teacher },
                2 * n * elem + n * 4,
            ),
            // From saved states: both rows read once, the gradient written.
            (
                "jsd_backward_saved",
                ResidentVocab::JsdBackwardSaved { teacher: &teacher },
                2 * n * elem + n * 4,
            ),
        ] {
            let work = k
                .resident(&logits, o.vocab, what)
                .map_err(|e| format!("{kernel} {dtype}: {e}"))?;
            let timing = self.time(&work, bytes)?;
            drop(work);
            let row = Row {
                kernel,
                dtype,
                rows,
                vocab: o.vocab,
                backend: self.backend,
                adapter: self.adapter,
                iters: self.iters,
                bytes,
                timing,
                rate: ("rows_per_s", rows),
            };
            println!("{}", row.json());
        }
        Ok(())
    }

    fn ppo_clip(&self, tokens: usize) -> Result<(), String> {
        let cols = SEQ_LEN.min(tokens);
        let rows = tokens / cols;
        let n = rows * cols;
        let (lp, old, adv) = crate::loss::inputs(n);
        let inp = PolicyInputs {
            lp: &lp,
            old: &old,
            adv: &adv,
            tokens: Tokens::padded(rows, cols, None),
        };
        let work = grpo_wgpu::LossKernel::new(self.ctx)
            .resident_ppo_clip(&PpoClipConfig::default(), &inp)
            .map_err(|e| format!("ppo_clip: {e}"))?;
        let bytes = n as u64 * PPO_CLIP_BYTES_PER_TOKEN;
        let timing = self.time(&work, bytes)?;
        let row = Row {
            kernel: "ppo_clip",
            dtype: "f32",
            rows,
            vocab: cols,
            backend: self.backend,
            adapter: self.adapter,
            iters: self.iters,
            bytes,
            timing,
            rate: ("tokens_per_s", n),
        };
        println!("{}", row.json());
        Ok(())
    }
}

/// Bytes `loss.wgsl`'s `per_token` entry point moves for one valid token of the PPO-clip
/// benchmark (every token of its padded batch is valid): it reads the mask word `flags[i]`, then
/// `lp[i]`, `old[i]` and `adv[i]` (4 × 4 B), and writes `value[i]`, `grad[i]` and `flags[i]`
/// again, now holding the valid bit and the token's events (3 × 4 B). The rewritten word keeps
/// the valid bit, so every timed iteration does the same work. (A masked token would move 12 B:
/// the mask word read, value and gradient written as 0.)
const PPO_CLIP_BYTES_PER_TOKEN: u64 = 4 * 4 + 3 * 4;

/// Deterministic logits in [−8, 8).
fn logits<L>(n: usize, conv: fn(f32) -> L) -> Vec<L> {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            conv(((s >> 40) as f32 / (1u64 << 24) as f32) * 16.0 - 8.0)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn defaults_depend_on_the_adapter_kind() {
        let soft = Options::parse(&[], true).unwrap();
        assert_eq!(
            soft,
            Options {
                rows: 16,
                vocab: 32768,
                dtypes: vec!["f32", "f16", "bf16"],
                tokens: 1 << 20,
                iters: 10,
            }
        );
        let gpu = Options::parse(&[], false).unwrap();
        assert_eq!((gpu.rows, gpu.vocab, gpu.tokens), (2048, 151_936, 1 << 23));
    }

    #[test]
    fn explicit_arguments_win() {
        let a = strings(&[
            "--rows", "4", "--vocab", "1000", "--dtype", "bf16", "--iters", "3", "--tokens", "77",
        ]);
        let o = Options::parse(&a, false).unwrap();
        assert_eq!(
            o,
            Options {
                rows: 4,
                vocab: 1000,
                dtypes: vec!["bf16"],
                tokens: 77,
                iters: 3,
            }
        );
        // 0 is clamped to 1, so every shape is non-empty.
        let o = Options::parse(&strings(&["--rows", "0", "--iters", "0"]), true).unwrap();
        assert_eq!((o.rows, o.iters), (1, 1));
    }

    #[test]
    fn bad_arguments_are_errors() {
        let e = Options::parse(&strings(&["--dtype", "f64"]), true).unwrap_err();
        assert_eq!(e, "--dtype \"f64\": expected f32, f16, bf16 or all");
        let e = Options::parse(&strings(&["--rows", "x"]), true).unwrap_err();
        assert_eq!(e, "--rows: \"x\" is not a number");
        assert!(
            Options::parse(&strings(&["--threads", "2"]), true)
                .unwrap_err()
                .starts_with("unknown argument \"--threads\"")
        );
    }

    #[test]
    fn json_line_has_the_common_fields() {
        let r = Row {
            kernel: "fused",
            dtype: "bf16",
            rows: 16,
            vocab: 32768,
            backend: "vulkan",
            adapter: "llvmpipe (LLVM 15.0.7, 256 bits)",
            iters: 10,
            bytes: 1_048_576,
            timing: Timing {
                kernel_ms: 2.0,
                copy: (1_048_576, 0.5),
                shader_copy: Some((1_048_576, 0.25)),
            },
            rate: ("rows_per_s", 16),
        };
        // The roofline is the faster copy: the shader's 4.19 GB/s, not the buffer copy's 2.10.
        assert_eq!(
            r.json(),
            "{\"kernel\":\"fused\",\"dtype\":\"bf16\",\"rows\":16,\"vocab\":32768,\
             \"backend\":\"vulkan\",\"threads\":0,\"iters\":10,\"median_ms\":2.000,\
             \"gbps\":0.52,\"roofline_gbps\":4.19,\"ratio\":0.125,\"rows_per_s\":8000,\
             \"copy_gbps\":2.10,\"shader_copy_gbps\":4.19,\
             \"adapter\":\"llvmpipe (LLVM 15.0.7, 256 bits)\"}"
        );
        // Without a shader copy (too large to bind) the buffer copy is the roofline.
        let r = Row {
            timing: Timing {
                shader_copy: None,
                ..r.timing.clone()
            },
            ..r
        };
        assert!(r.json().contains(
            "\"roofline_gbps\":2.10,\"ratio\":0.250,\"rows_per_s\":8000,\
             \"copy_gbps\":2.10,\"shader_copy_gbps\":null,"
        ));
    }

    #[test]
    fn ppo_clip_counts_the_mask_word_both_ways() {
        // lp, old, adv (12 B) + value, gradient (8 B), as the CPU rows count, plus the 4-byte
        // mask word read and rewritten: 28 B per token, 28 MiB for the 1 M tokens of a
        // software adapter's default run.
        assert_eq!(PPO_CLIP_BYTES_PER_TOKEN, 20 + 2 * 4);
        assert_eq!((1u64 << 20) * PPO_CLIP_BYTES_PER_TOKEN, 29_360_128);
    }

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(json_str("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
        assert_eq!(json_str("Radeon™"), "\"Radeon™\"");
    }
}
