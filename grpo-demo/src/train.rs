//! Supervised warm-up and the GRPO loop.
//!
//! Gradient path (no loss is built from candle ops): the model's logits for the answer positions
//! leave the graph as plain `f32` rows; the library computes log-probs and entropies
//! ([`rl::vocab_forward`]), the per-token dL/dlp of the aggregated policy loss
//! ([`rl::policy_loss_grad`]) and the gradient w.r.t. the logits ([`rl::vocab_backward`]); that
//! gradient re-enters the graph through the surrogate `sum(logits · stop_grad(dlogits))`, whose
//! gradient w.r.t. every parameter is exactly the chain rule through the logits.

use candle_core::backprop::GradStore;
use candle_core::{Device, Result, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};

use crate::model::{ModelConfig, Transformer, token_tensor};
use grpo_core::vocab::LseState;
use grpo_cpu::Cpu;

use crate::rl::{self, LossKind};
use crate::rng::Rng;
use crate::task::{ANSWER_LEN, Datasets, MAX_LEN, PROMPT_LEN, Problem, VOCAB, reward};

/// Everything a run depends on.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Model shape.
    pub model: ModelConfig,
    /// Seed of every random draw (init, data, sampling).
    pub seed: u64,
    /// Training prompts (warm-up uses the first `warmup_examples`).
    pub n_train: usize,
    /// Held-out prompts for accuracy.
    pub n_held_out: usize,
    /// Size of the warm-up subset.
    pub warmup_examples: usize,
    /// Most supervised warm-up optimizer steps.
    pub warmup_steps: usize,
    /// The warm-up stops once greedy accuracy on a probe of the warm-up subset reaches this
    /// (checked every `warmup_check_every` steps). Supervised training of this task has a sharp
    /// phase transition (≈0 % → ≈70 % held-out within ~50 steps), so a fixed step count would
    /// land on either side of it depending on the seed; a target lands just after its onset.
    pub warmup_target: f64,
    /// Interval of the warm-up probe.
    pub warmup_check_every: usize,
    /// Size of the warm-up probe (a prefix of the warm-up subset).
    pub warmup_probe: usize,
    /// Warm-up batch size.
    pub warmup_batch: usize,
    /// Warm-up learning rate.
    pub warmup_lr: f64,
    /// GRPO steps.
    pub steps: usize,
    /// Completions per prompt (G).
    pub group_size: usize,
    /// Prompts (groups) trained on per step.
    pub prompts_per_step: usize,
    /// With dynamic sampling: at most this many sampling rounds to fill `prompts_per_step` groups.
    pub max_sampling_rounds: usize,
    /// Optimizer steps per batch of rollouts (PPO epochs; the first has ρ = 1).
    pub updates_per_step: usize,
    /// RL learning rate. The RL phase continues the warm-up's AdamW (plain Adam: weight
    /// decay 0) at this rate, its moment estimates included.
    pub lr: f64,
    /// Global gradient-norm clip.
    pub max_grad_norm: f64,
    /// Entropy bonus coefficient (g_H = −coef · aggregation weight).
    pub entropy_coef: f32,
    /// Recipe.
    pub loss: LossKind,
    /// Evaluate held-out accuracy every this many steps (and at the end).
    pub eval_every: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            model: ModelConfig {
                vocab: VOCAB,
                max_len: MAX_LEN,
                d_model: 128,
                n_heads: 4,
                n_layers: 2,
                d_ff: 512,
            },
            seed: 0,
            n_train: 50_000,
            n_held_out: 500,
            warmup_examples: 2000,
            warmup_steps: 600,
            warmup_target: 0.10,
            warmup_check_every: 5,
            warmup_probe: 256,
            warmup_batch: 64,
            warmup_lr: 1e-3,
            steps: 150,
            group_size: 8,
            prompts_per_step: 16,
            max_sampling_rounds: 3,
            updates_per_step: 2,
            lr: 3e-4,
            max_grad_norm: 1.0,
            entropy_coef: 0.0,
            loss: LossKind::Dapo,
            eval_every: 5,
        }
    }
}

/// Metrics of one GRPO step (step 0 = after warm-up, before any RL update).
#[derive(Debug, Clone, Default)]
pub struct StepMetrics {
    /// Step number.
    pub step: usize,
    /// Seconds since the start of the run.
    pub elapsed_s: f64,
    /// Mean exact-match reward of the step's first sampling round.
    pub reward: f64,
    /// Groups trained on.
    pub groups_kept: usize,
    /// Groups sampled (all rounds).
    pub groups_sampled: usize,
    /// Mean token entropy (nats) of the trained completions under the sampling policy (NaN
    /// when no group was kept).
    pub entropy: f64,
    /// Fraction of tokens whose gradient the clip removed (updates after the first; NaN with
    /// one update per step or when no group was kept).
    pub clip_frac: f64,
    /// Aggregated policy loss of the first update (NaN when no group was kept).
    pub loss: f64,
    /// Held-out greedy exact-match accuracy, when evaluated at this step.
    pub held_out_acc: Option<f64>,
}

/// A run: model, optimizer, data and random streams.
pub struct Trainer {
    /// Configuration.
    pub cfg: TrainConfig,
    /// Policy.
    pub model: Transformer,
    /// Train / held-out problems.
    pub data: Datasets,
    opt: AdamW,
    cpu: Cpu,
    sample_rng: Rng,
    batch_rng: Rng,
    start: std::time::Instant,
}

/// `sum(logits · stop_grad(dlogits))`: its gradient w.r.t. any parameter θ is
/// Σ dlogits · ∂logits/∂θ, i.e. the loss gradient when dlogits = ∂L/∂logits.
pub fn surrogate(logits: &Tensor, dlogits: Vec<f32>) -> Result<Tensor> {
    // A tensor built from a Vec is a constant of the graph: that is the stop-gradient.
    let d = Tensor::from_vec(dlogits, logits.shape(), &Device::Cpu)?;
    (logits * d)?.sum_all()
}

/// A library error as a candle error (the demo's `Result`).
fn lib_err(e: grpo_core::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("grpo-core: {e}"))
}

fn clip_grad_norm(grads: &mut GradStore, model: &Transformer, max_norm: f64) -> Result<f64> {
    let vars = model.vars();
    let mut sq = 0.0f64;
    for v in &vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        }
    }
    let norm = sq.sqrt();
    if norm > max_norm {
        let scale = max_norm / (norm + 1e-6);
        for v in &vars {
            if let Some(g) = grads.remove(v.as_tensor()) {
                grads.insert(v.as_tensor(), (g * scale)?);
            }
        }
    }
    Ok(norm)
}

/// How completions are drawn.
pub enum Decode<'a> {
    /// Argmax (evaluation).
    Greedy,
    /// Sample from softmax(logits) (training rollouts).
    Sample(&'a mut Rng),
}

/// Decodes `ANSWER_LEN` tokens after each prompt; returns full sequences `[n, MAX_LEN]`.
pub fn generate(
    model: &Transformer,
    prompts: &[[u32; PROMPT_LEN]],
    mut decode: Decode<'_>,
) -> Result<Vec<u32>> {
    let n = prompts.len();
    let mut seqs = vec![0u32; n * MAX_LEN];
    for (i, p) in prompts.iter().enumerate() {
        seqs[i * MAX_LEN..i * MAX_LEN + PROMPT_LEN].copy_from_slice(p);
    }
    let vocab = model.config().vocab;
    for k in 0..ANSWER_LEN {
        let len = PROMPT_LEN + k;
        let input: Vec<u32> = seqs
            .chunks(MAX_LEN)
            .flat_map(|s| s[..len].iter().copied())
            .collect();
        let logits = model.forward_positions(&token_tensor(&input, n, len)?, len - 1, 1)?;
        let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        for (i, z) in logits.chunks(vocab).enumerate() {
            let tok = match &mut decode {
                Decode::Greedy => argmax(z),
                Decode::Sample(rng) => sample(z, rng),
            };
            seqs[i * MAX_LEN + len] = tok;
        }
    }
    Ok(seqs)
}

fn argmax(z: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in z.iter().enumerate() {
        if v > z[best] {
            best = i;
        }
    }
    best as u32
}

/// Inverse-CDF draw from softmax(z) (the rollout sampler, not part of the GRPO math).
fn sample(z: &[f32], rng: &mut Rng) -> u32 {
    let m = z
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    let w: Vec<f64> = z.iter().map(|&v| ((v - m) as f64).exp()).collect();
    let mut u = rng.uniform() * w.iter().sum::<f64>();
    for (i, &wi) in w.iter().enumerate() {
        if u < wi {
            return i as u32;
        }
        u -= wi;
    }
    (z.len() - 1) as u32
}

/// Inputs `[n, MAX_LEN − 1]` and answer targets `[n · ANSWER_LEN]` of full sequences.
fn split_sequences(seqs: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let mut inputs = Vec::with_capacity(seqs.len());
    let mut targets = Vec::with_capacity(seqs.len() / MAX_LEN * ANSWER_LEN);
    for s in seqs.chunks(MAX_LEN) {
        inputs.extend_from_slice(&s[..MAX_LEN - 1]);
        targets.extend_from_slice(&s[PROMPT_LEN..]);
    }
    (inputs, targets)
}

impl Trainer {
    /// Builds the model and data from the config's seed.
    pub fn new(cfg: TrainConfig) -> Result<Self> {
        let mut root = Rng::new(cfg.seed);
        let mut init_rng = root.fork(1);
        let mut data_rng = root.fork(2);
        let sample_rng = root.fork(3);
        let batch_rng = root.fork(4);
        let model = Transformer::new(cfg.model, &mut init_rng)?;
        let data = Datasets::new(&mut data_rng, cfg.n_train, cfg.n_held_out);
        let opt = AdamW::new(
            model.vars(),
            ParamsAdamW {
                lr: cfg.warmup_lr,
                weight_decay: 0.0,
                ..Default::default()
            },
        )?;
        Ok(Trainer {
            cfg,
            model,
            data,
            opt,
            cpu: Cpu::detect(),
            sample_rng,
            batch_rng,
            start: std::time::Instant::now(),
        })
    }

    /// Seconds since [`Trainer::new`].
    pub fn elapsed(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Greedy exact-match accuracy on the held-out set.
    pub fn held_out_accuracy(&self) -> Result<f64> {
        let probs: Vec<Problem> = self.data.held_out.clone();
        accuracy(&self.model, &probs)
    }

    /// Logits of the answer positions `[n, ANSWER_LEN, V]` for full sequences' inputs.
    fn answer_logits(&self, inputs: &[u32], n: usize) -> Result<Tensor> {
        self.model.forward_positions(
            &token_tensor(inputs, n, MAX_LEN - 1)?,
            PROMPT_LEN - 1,
            ANSWER_LEN,
        )
    }

    fn apply(&mut self, loss_surrogate: &Tensor) -> Result<()> {
        let mut grads = loss_surrogate.backward()?;
        clip_grad_norm(&mut grads, &self.model, self.cfg.max_grad_norm)?;
        self.opt.step(&grads)
    }

    /// One supervised step on a random batch of the warm-up subset; returns the mean NLL.
    /// The cross-entropy gradient also goes through the library's vocab kernels (g_lp = −1/N).
    pub fn warmup_step(&mut self) -> Result<f64> {
        self.opt.set_learning_rate(self.cfg.warmup_lr);
        let subset = self.cfg.warmup_examples.min(self.data.train.len());
        let b = self.cfg.warmup_batch;
        let mut seqs = Vec::with_capacity(b * MAX_LEN);
        for _ in 0..b {
            let p = self.data.train[self.batch_rng.below(subset)];
            seqs.extend_from_slice(&p.prompt());
            seqs.extend_from_slice(&p.answer());
        }
        let (inputs, targets) = split_sequences(&seqs);
        let logits = self.answer_logits(&inputs, b)?;
        let z: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        let rows = targets.len();
        let (mut lp, mut ent) = (vec![0f32; rows], vec![0f32; rows]);
        let mut saved = vec![LseState::EMPTY; rows];
        rl::vocab_forward(
            &self.cpu, &z, VOCAB, &targets, &mut lp, &mut ent, &mut saved,
        )
        .map_err(lib_err)?;
        let g_lp = vec![-1.0 / rows as f32; rows];
        let mut dz = vec![0f32; z.len()];
        rl::vocab_backward(
            &self.cpu,
            &z,
            VOCAB,
            &saved,
            &targets,
            &g_lp,
            &vec![0.0; rows],
            &mut dz,
        )
        .map_err(lib_err)?;
        self.apply(&surrogate(&logits, dz)?)?;
        Ok(-lp.iter().map(|&v| v as f64).sum::<f64>() / rows as f64)
    }

    /// Greedy accuracy on the warm-up probe (seen examples).
    pub fn warmup_probe_accuracy(&self) -> Result<f64> {
        let n = self
            .cfg
            .warmup_probe
            .min(self.cfg.warmup_examples)
            .min(self.data.train.len());
        accuracy(&self.model, &self.data.train[..n])
    }

    /// The supervised warm-up: steps until the probe accuracy reaches `warmup_target` or
    /// `warmup_steps` were taken; `on_step(step, nll)` after each step. Returns the steps taken.
    pub fn warmup(&mut self, mut on_step: impl FnMut(usize, f64)) -> Result<usize> {
        for i in 1..=self.cfg.warmup_steps {
            let nll = self.warmup_step()?;
            on_step(i, nll);
            if i % self.cfg.warmup_check_every.max(1) == 0
                && self.warmup_probe_accuracy()? >= self.cfg.warmup_target
            {
                return Ok(i);
            }
        }
        Ok(self.cfg.warmup_steps)
    }

    /// Samples `group_size` completions for each of `prompts_per_step` random train prompts;
    /// returns (problems, sequences, rewards).
    fn rollouts(&mut self) -> Result<(Vec<Problem>, Vec<u32>, Vec<f32>)> {
        let (p, g) = (self.cfg.prompts_per_step, self.cfg.group_size);
        let probs: Vec<Problem> = (0..p)
            .map(|_| self.data.train[self.batch_rng.below(self.data.train.len())])
            .collect();
        let prompts: Vec<[u32; PROMPT_LEN]> = probs
            .iter()
            .flat_map(|q| std::iter::repeat_n(q.prompt(), g))
            .collect();
        let seqs = generate(&self.model, &prompts, Decode::Sample(&mut self.sample_rng))?;
        let rewards: Vec<f32> = seqs
            .chunks(MAX_LEN)
            .enumerate()
            .map(|(i, s)| reward(&probs[i / g], &s[PROMPT_LEN..]))
            .collect();
        Ok((probs, seqs, rewards))
    }

    /// One GRPO step: rollouts (with dynamic sampling when the recipe uses it), advantages,
    /// `updates_per_step` clipped policy-gradient updates.
    pub fn grpo_step(&mut self, step: usize) -> Result<StepMetrics> {
        self.opt.set_learning_rate(self.cfg.lr);
        let (g, target) = (self.cfg.group_size, self.cfg.prompts_per_step);
        // Entropy, loss and clip fraction stay NaN unless measured (no group kept, or one
        // update: no clip fraction), so that metrics.csv never shows an unmeasured 0.
        let mut m = StepMetrics {
            step,
            entropy: f64::NAN,
            loss: f64::NAN,
            clip_frac: f64::NAN,
            ..Default::default()
        };
        // Gather groups (DAPO dynamic sampling: keep only groups with mixed rewards).
        let mut seqs: Vec<u32> = Vec::new();
        let mut rewards: Vec<f32> = Vec::new();
        let rounds = if self.cfg.loss.dynamic_sampling() {
            self.cfg.max_sampling_rounds.max(1)
        } else {
            1
        };
        for round in 0..rounds {
            let (_, s, r) = self.rollouts()?;
            if round == 0 {
                m.reward = r.iter().map(|&v| v as f64).sum::<f64>() / r.len() as f64;
            }
            m.groups_sampled += target;
            let mut keep = vec![true; target];
            if self.cfg.loss.dynamic_sampling() {
                rl::keep_groups(&r, g, &mut keep).map_err(lib_err)?;
            }
            for (k, kept) in keep.iter().enumerate() {
                if *kept && rewards.len() / g < target {
                    seqs.extend_from_slice(&s[k * g * MAX_LEN..(k + 1) * g * MAX_LEN]);
                    rewards.extend_from_slice(&r[k * g..(k + 1) * g]);
                }
            }
            if rewards.len() / g >= target {
                break;
            }
        }
        m.groups_kept = rewards.len() / g;
        if rewards.is_empty() {
            return Ok(m);
        }
        let n = rewards.len();
        let mut adv = vec![0f32; n];
        rl::advantages(self.cfg.loss, &rewards, g, &mut adv).map_err(lib_err)?;
        let (inputs, targets) = split_sequences(&seqs);
        let rows = targets.len();
        let mut old = vec![0f32; rows];
        let (mut lp, mut ent) = (vec![0f32; rows], vec![0f32; rows]);
        let mut saved = vec![LseState::EMPTY; rows];
        let (mut g_lp, mut dz) = (vec![0f32; rows], Vec::new());
        let mut agg = vec![0f32; rows];
        let mut clip_sum = 0.0;
        for u in 0..self.cfg.updates_per_step {
            let logits = self.answer_logits(&inputs, n)?;
            let z: Vec<f32> = logits.flatten_all()?.to_vec1()?;
            rl::vocab_forward(
                &self.cpu, &z, VOCAB, &targets, &mut lp, &mut ent, &mut saved,
            )
            .map_err(lib_err)?;
            if u == 0 {
                // The policy that sampled the batch is the current one: old log-probs = lp.
                old.copy_from_slice(&lp);
                m.entropy = ent.iter().map(|&v| v as f64).sum::<f64>() / rows as f64;
            }
            let stats = rl::policy_loss_grad(
                self.cfg.loss,
                &lp,
                &old,
                &adv,
                ANSWER_LEN,
                &mut g_lp,
                &mut agg,
            )
            .map_err(lib_err)?;
            if u == 0 {
                m.loss = stats.loss;
            } else {
                clip_sum += stats.clip_frac;
            }
            // The entropy bonus −c·H_t, aggregated as the loss is: ∂/∂H_t = −c·w_t.
            let g_h: Vec<f32> = agg.iter().map(|&w| -self.cfg.entropy_coef * w).collect();
            dz.resize(z.len(), 0.0);
            rl::vocab_backward(&self.cpu, &z, VOCAB, &saved, &targets, &g_lp, &g_h, &mut dz)
                .map_err(lib_err)?;
            self.apply(&surrogate(&logits, std::mem::take(&mut dz))?)?;
        }
        if self.cfg.updates_per_step > 1 {
            m.clip_frac = clip_sum / (self.cfg.updates_per_step - 1) as f64;
        }
        Ok(m)
    }
}

/// Greedy exact-match accuracy of `model` on `problems`.
pub fn accuracy(model: &Transformer, problems: &[Problem]) -> Result<f64> {
    if problems.is_empty() {
        return Ok(0.0);
    }
    let mut correct = 0usize;
    for chunk in problems.chunks(1000) {
        let prompts: Vec<[u32; PROMPT_LEN]> = chunk.iter().map(|p| p.prompt()).collect();
        let seqs = generate(model, &prompts, Decode::Greedy)?;
        for (p, s) in chunk.iter().zip(seqs.chunks(MAX_LEN)) {
            correct += (reward(p, &s[PROMPT_LEN..]) == 1.0) as usize;
        }
    }
    Ok(correct as f64 / problems.len() as f64)
}
