//! The surrogate `sum(logits · stop_grad(dlogits))` with dlogits from the library's vocabulary
//! backward gives the same parameter gradients as differentiating the loss directly in candle.

use candle_core::{D, Device, Tensor};
use grpo_demo::model::{ModelConfig, Transformer, token_tensor};
use grpo_demo::rl;
use grpo_demo::rng::Rng;
use grpo_demo::train::surrogate;

#[test]
fn surrogate_gradient_equals_direct_loss_gradient() {
    let (vocab, b, t) = (7usize, 3usize, 5usize);
    let cfg = ModelConfig {
        vocab,
        max_len: t,
        d_model: 16,
        n_heads: 2,
        n_layers: 2,
        d_ff: 32,
    };
    let model = Transformer::new(cfg, &mut Rng::new(21)).unwrap();
    let mut rng = Rng::new(4);
    let toks: Vec<u32> = (0..b * t).map(|_| rng.below(vocab) as u32).collect();
    let targets: Vec<u32> = (0..b * t).map(|_| rng.below(vocab) as u32).collect();
    // Per-token coefficients: L = Σ_t (a_t·lp_t + c_t·H_t) — a policy-gradient-like lp term
    // with arbitrary signs plus an entropy term, so both halves of the vocab backward are used.
    let a: Vec<f32> = (0..b * t).map(|_| rng.normal() as f32).collect();
    let c: Vec<f32> = (0..b * t).map(|_| 0.3 * rng.normal() as f32).collect();
    let input = token_tensor(&toks, b, t).unwrap();

    // Direct: the loss built from candle ops, differentiated by candle.
    let logits = model
        .forward(&input)
        .unwrap()
        .reshape((b * t, vocab))
        .unwrap();
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap();
    let tgt = Tensor::from_vec(targets.clone(), (b * t, 1), &Device::Cpu).unwrap();
    let lp = logp.gather(&tgt, 1).unwrap().squeeze(1).unwrap();
    let h = (logp.exp().unwrap() * &logp)
        .unwrap()
        .sum(1)
        .unwrap()
        .neg()
        .unwrap();
    let at = Tensor::from_vec(a.clone(), b * t, &Device::Cpu).unwrap();
    let ct = Tensor::from_vec(c.clone(), b * t, &Device::Cpu).unwrap();
    let direct = ((lp * at).unwrap() + (h * ct).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    let g_direct = direct.backward().unwrap();

    // Surrogate: logits leave the graph, the library computes dL/dlogits, the surrogate brings it back.
    let logits = model
        .forward(&input)
        .unwrap()
        .reshape((b * t, vocab))
        .unwrap();
    let z: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
    let cpu = grpo_cpu::Cpu::detect();
    let rows = b * t;
    let (mut lp, mut ent) = (vec![0f32; rows], vec![0f32; rows]);
    let mut saved = vec![grpo_core::vocab::LseState::EMPTY; rows];
    rl::vocab_forward(&cpu, &z, vocab, &targets, &mut lp, &mut ent, &mut saved).unwrap();
    let mut dz = vec![0f32; z.len()];
    rl::vocab_backward(&cpu, &z, vocab, &saved, &targets, &a, &c, &mut dz).unwrap();
    let g_sur = surrogate(&logits, dz).unwrap().backward().unwrap();

    let mut worst = 0f32;
    for v in model.vars() {
        let x: Vec<f32> = g_direct
            .get(v.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let y: Vec<f32> = g_sur
            .get(v.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let scale = x.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        for (p, q) in x.iter().zip(&y) {
            worst = worst.max((p - q).abs() / scale);
        }
    }
    eprintln!("largest relative gradient difference: {worst:e}");
    assert!(worst < 1e-4, "relative gradient mismatch {worst}");
}
