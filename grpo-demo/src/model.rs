//! A small decoder-only transformer (pre-LayerNorm, learned positions, ReLU MLP, untied head)
//! built from candle tensors, randomly initialised from the demo's seeded [`Rng`].
//!
//! candle 0.11 facts this file depends on: `candle_nn::LayerNorm`'s fast path and
//! `ops::softmax_last_dim` have no backward pass (gradients silently stop), so it uses
//! `ops::layer_norm_slow` and `ops::softmax(x, D::Minus1)`; the unit test
//! `every_parameter_gets_a_gradient` guards against regressions of that kind.

use candle_core::{D, DType, Device, Result, Tensor, Var};
use candle_nn::ops;

use crate::rng::Rng;

/// Shape of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest sequence (number of learned positions).
    pub max_len: usize,
    /// Residual width.
    pub d_model: usize,
    /// Attention heads (`d_model % n_heads == 0`).
    pub n_heads: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// MLP hidden width.
    pub d_ff: usize,
}

struct Block {
    ln1_g: Var,
    ln1_b: Var,
    wq: Var,
    wk: Var,
    wv: Var,
    wo: Var,
    bo: Var,
    ln2_g: Var,
    ln2_b: Var,
    w1: Var,
    b1: Var,
    w2: Var,
    b2: Var,
}

/// The policy network.
pub struct Transformer {
    cfg: ModelConfig,
    tok_emb: Var,
    pos_emb: Var,
    blocks: Vec<Block>,
    lnf_g: Var,
    lnf_b: Var,
    head: Var,
}

const LN_EPS: f32 = 1e-5;

fn normal(rng: &mut Rng, shape: (usize, usize), std: f64) -> Result<Var> {
    let n = shape.0 * shape.1;
    let v: Vec<f32> = (0..n).map(|_| (rng.normal() * std) as f32).collect();
    Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu)?)
}

fn filled(n: usize, value: f32) -> Result<Var> {
    Var::from_tensor(&Tensor::full(value, n, &Device::Cpu)?)
}

/// `x [N, in] · w [in, out] (+ b)`.
fn linear(x: &Tensor, w: &Var, b: Option<&Var>) -> Result<Tensor> {
    let y = x.matmul(w.as_tensor())?;
    match b {
        Some(b) => y.broadcast_add(b.as_tensor()),
        None => Ok(y),
    }
}

impl Transformer {
    /// A randomly initialised model (N(0, 0.02²) weights, residual projections scaled by
    /// 1/√(2·layers) as in GPT-2, LayerNorm γ = 1, β = 0, biases 0).
    pub fn new(cfg: ModelConfig, rng: &mut Rng) -> Result<Self> {
        assert!(
            cfg.d_model.is_multiple_of(cfg.n_heads),
            "d_model must be a multiple of n_heads"
        );
        let (d, f) = (cfg.d_model, cfg.d_ff);
        let std = 0.02;
        let resid_std = std / ((2 * cfg.n_layers) as f64).sqrt();
        let tok_emb = normal(rng, (cfg.vocab, d), std)?;
        let pos_emb = normal(rng, (cfg.max_len, d), std)?;
        let mut blocks = Vec::with_capacity(cfg.n_layers);
        for _ in 0..cfg.n_layers {
            blocks.push(Block {
                ln1_g: filled(d, 1.0)?,
                ln1_b: filled(d, 0.0)?,
                wq: normal(rng, (d, d), std)?,
                wk: normal(rng, (d, d), std)?,
                wv: normal(rng, (d, d), std)?,
                wo: normal(rng, (d, d), resid_std)?,
                bo: filled(d, 0.0)?,
                ln2_g: filled(d, 1.0)?,
                ln2_b: filled(d, 0.0)?,
                w1: normal(rng, (d, f), std)?,
                b1: filled(f, 0.0)?,
                w2: normal(rng, (f, d), resid_std)?,
                b2: filled(d, 0.0)?,
            });
        }
        Ok(Transformer {
            cfg,
            tok_emb,
            pos_emb,
            blocks,
            lnf_g: filled(d, 1.0)?,
            lnf_b: filled(d, 0.0)?,
            head: normal(rng, (d, cfg.vocab), std)?,
        })
    }

    /// The model's shape.
    pub fn config(&self) -> ModelConfig {
        self.cfg
    }

    /// Every trainable parameter, in a fixed order.
    pub fn vars(&self) -> Vec<Var> {
        let mut v = vec![self.tok_emb.clone(), self.pos_emb.clone()];
        for b in &self.blocks {
            v.extend(
                [
                    &b.ln1_g, &b.ln1_b, &b.wq, &b.wk, &b.wv, &b.wo, &b.bo, &b.ln2_g, &b.ln2_b,
                    &b.w1, &b.b1, &b.w2, &b.b2,
                ]
                .into_iter()
                .cloned(),
            );
        }
        v.extend([self.lnf_g.clone(), self.lnf_b.clone(), self.head.clone()]);
        v
    }

    /// Number of scalar parameters.
    pub fn num_params(&self) -> usize {
        self.vars().iter().map(|v| v.elem_count()).sum()
    }

    /// Final hidden states `[B, T, d]` for tokens `[B, T]` (u32), causal attention.
    pub fn hidden(&self, tokens: &Tensor) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        let (d, h) = (self.cfg.d_model, self.cfg.n_heads);
        let dh = d / h;
        let emb = self
            .tok_emb
            .as_tensor()
            .index_select(&tokens.flatten_all()?, 0)?
            .reshape((b, t, d))?;
        let pos = self.pos_emb.as_tensor().narrow(0, 0, t)?;
        let mut x = emb.broadcast_add(&pos)?.reshape((b * t, d))?;
        // Additive causal mask: −1e9 above the diagonal (finite, so softmax never sees inf − inf).
        let mask: Vec<f32> = (0..t * t)
            .map(|k| if k % t > k / t { -1e9 } else { 0.0 })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu)?;
        let scale = 1.0 / (dh as f64).sqrt();
        for blk in &self.blocks {
            let y = ops::layer_norm_slow(&x, blk.ln1_g.as_tensor(), blk.ln1_b.as_tensor(), LN_EPS)?;
            let heads = |w: &Var| -> Result<Tensor> {
                linear(&y, w, None)?
                    .reshape((b, t, h, dh))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let (q, k, v) = (heads(&blk.wq)?, heads(&blk.wk)?, heads(&blk.wv)?);
            let att = (q.matmul(&k.t()?)? * scale)?.broadcast_add(&mask)?;
            let att = ops::softmax(&att, D::Minus1)?;
            let ctx = att
                .matmul(&v)?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((b * t, d))?;
            x = (x + linear(&ctx, &blk.wo, Some(&blk.bo))?)?;
            let y = ops::layer_norm_slow(&x, blk.ln2_g.as_tensor(), blk.ln2_b.as_tensor(), LN_EPS)?;
            let m = linear(&y, &blk.w1, Some(&blk.b1))?.relu()?;
            x = (x + linear(&m, &blk.w2, Some(&blk.b2))?)?;
        }
        let x = ops::layer_norm_slow(&x, self.lnf_g.as_tensor(), self.lnf_b.as_tensor(), LN_EPS)?;
        x.reshape((b, t, d))
    }

    /// Logits `[N, V]` from hidden states `[N, d]`.
    pub fn head(&self, hidden: &Tensor) -> Result<Tensor> {
        linear(hidden, &self.head, None)
    }

    /// Logits `[B, T, V]` for tokens `[B, T]`.
    pub fn forward(&self, tokens: &Tensor) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        let h = self.hidden(tokens)?.reshape((b * t, self.cfg.d_model))?;
        self.head(&h)?.reshape((b, t, self.cfg.vocab))
    }

    /// Logits `[B, len, V]` of positions `start..start + len` only (the head runs on those rows).
    pub fn forward_positions(&self, tokens: &Tensor, start: usize, len: usize) -> Result<Tensor> {
        let b = tokens.dim(0)?;
        let h = self
            .hidden(tokens)?
            .narrow(1, start, len)?
            .contiguous()?
            .reshape((b * len, self.cfg.d_model))?;
        self.head(&h)?.reshape((b, len, self.cfg.vocab))
    }
}

/// Tokens as a `[rows, cols]` u32 tensor.
pub fn token_tensor(tokens: &[u32], rows: usize, cols: usize) -> Result<Tensor> {
    Tensor::from_vec(tokens.to_vec(), (rows, cols), &Device::Cpu)?.to_dtype(DType::U32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Transformer {
        let cfg = ModelConfig {
            vocab: 7,
            max_len: 6,
            d_model: 16,
            n_heads: 2,
            n_layers: 2,
            d_ff: 32,
        };
        Transformer::new(cfg, &mut Rng::new(11)).unwrap()
    }

    #[test]
    fn every_parameter_gets_a_gradient() {
        let m = tiny();
        let toks = token_tensor(&[1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5], 2, 6).unwrap();
        let logits = m.forward(&toks).unwrap();
        // A random linear functional of the logits: every parameter influences it.
        let mut rng = Rng::new(5);
        let w: Vec<f32> = (0..logits.elem_count())
            .map(|_| rng.normal() as f32)
            .collect();
        let w = Tensor::from_vec(w, logits.shape(), &Device::Cpu).unwrap();
        let loss = (logits * w).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        for (i, v) in m.vars().iter().enumerate() {
            let g = grads
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("parameter {i} has no gradient"));
            let norm: f32 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
            assert!(
                norm > 0.0 && norm.is_finite(),
                "parameter {i}: |g|² = {norm}"
            );
        }
    }

    #[test]
    fn attention_is_causal() {
        // Changing a later token must not change earlier positions' logits.
        let m = tiny();
        let a = m
            .forward(&token_tensor(&[1, 2, 3, 4], 1, 4).unwrap())
            .unwrap();
        let b = m
            .forward(&token_tensor(&[1, 2, 3, 6], 1, 4).unwrap())
            .unwrap();
        let a: Vec<f32> = a
            .narrow(1, 0, 3)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let b: Vec<f32> = b
            .narrow(1, 0, 3)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(a, b);
        let c = m
            .forward(&token_tensor(&[1, 2, 5, 4], 1, 4).unwrap())
            .unwrap();
        let c: Vec<f32> = c
            .narrow(1, 2, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_ne!(c, a[2 * 7..3 * 7].to_vec());
    }
}
