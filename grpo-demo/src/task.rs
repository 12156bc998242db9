//! The verifiable task: 3-digit addition written little-endian.
//!
//! A prompt is `BOS a₀ a₁ a₂ + b₀ b₁ b₂ =` (least-significant digit first, zero-padded) and the
//! answer is the 4 digits of `a + b`, also least-significant first (`123 + 989 = 1112` is
//! `BOS 3 2 1 + 9 8 9 = 2 1 1 1`). Writing the digits in the order the carries flow makes answer
//! digit k a function of `a_k`, `b_k` and the previous carry only, so a small transformer can
//! learn the algorithm from reward alone; the reward is exact match of all 4 digits, checked
//! exactly by [`reward`].

use crate::rng::Rng;

/// Tokens 0..=9 are the digits.
pub const PLUS: u32 = 10;
/// The `=` token that ends the prompt.
pub const EQUALS: u32 = 11;
/// Beginning of sequence.
pub const BOS: u32 = 12;
/// Vocabulary size.
pub const VOCAB: usize = 13;
/// Tokens per prompt.
pub const PROMPT_LEN: usize = 9;
/// Tokens per answer (sampled completion length).
pub const ANSWER_LEN: usize = 4;
/// Longest input the model sees (prompt + answer − the last answer token).
pub const MAX_LEN: usize = PROMPT_LEN + ANSWER_LEN;

/// One addition problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Problem {
    /// First operand, 0..=999.
    pub a: u32,
    /// Second operand, 0..=999.
    pub b: u32,
}

impl Problem {
    /// The prompt tokens.
    pub fn prompt(&self) -> [u32; PROMPT_LEN] {
        let (a, b) = (self.a, self.b);
        [
            BOS,
            a % 10,
            a / 10 % 10,
            a / 100,
            PLUS,
            b % 10,
            b / 10 % 10,
            b / 100,
            EQUALS,
        ]
    }

    /// The correct answer tokens (little-endian digits of a + b).
    pub fn answer(&self) -> [u32; ANSWER_LEN] {
        let s = self.a + self.b;
        [s % 10, s / 10 % 10, s / 100 % 10, s / 1000]
    }
}

/// Exact-match reward: 1 if the completion is the correct answer, else 0.
pub fn reward(p: &Problem, completion: &[u32]) -> f32 {
    if completion == p.answer() { 1.0 } else { 0.0 }
}

/// Disjoint train and held-out problem sets drawn from all 10⁶ (a, b) pairs.
#[derive(Debug, Clone)]
pub struct Datasets {
    /// Problems the policy trains on (warm-up uses a prefix of them).
    pub train: Vec<Problem>,
    /// Problems never trained on; held-out accuracy is measured here.
    pub held_out: Vec<Problem>,
}

impl Datasets {
    /// Draws `n_train + n_held_out` distinct problems.
    pub fn new(rng: &mut Rng, n_train: usize, n_held_out: usize) -> Self {
        let total = n_train + n_held_out;
        let mut seen = std::collections::HashSet::with_capacity(total);
        let mut all = Vec::with_capacity(total);
        while all.len() < total.min(1_000_000) {
            let code = rng.below(1_000_000) as u32;
            if seen.insert(code) {
                all.push(Problem {
                    a: code / 1000,
                    b: code % 1000,
                });
            }
        }
        let held_out = all.split_off(n_train.min(all.len()));
        Datasets {
            train: all,
            held_out,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_and_checker() {
        // 123 + 989 = 1112 → little-endian digits 2,1,1,1.
        let p = Problem { a: 123, b: 989 };
        assert_eq!(p.prompt(), [BOS, 3, 2, 1, PLUS, 9, 8, 9, EQUALS]);
        assert_eq!(p.answer(), [2, 1, 1, 1]);
        assert_eq!(reward(&p, &[2, 1, 1, 1]), 1.0);
        assert_eq!(reward(&p, &[2, 1, 1, 0]), 0.0);
        // 5 + 7 = 12 → 2,1,0,0.
        assert_eq!(Problem { a: 5, b: 7 }.answer(), [2, 1, 0, 0]);
    }

    #[test]
    fn splits_are_disjoint() {
        let d = Datasets::new(&mut Rng::new(3), 500, 200);
        assert_eq!((d.train.len(), d.held_out.len()), (500, 200));
        let train: std::collections::HashSet<_> = d.train.iter().map(|p| (p.a, p.b)).collect();
        assert!(d.held_out.iter().all(|p| !train.contains(&(p.a, p.b))));
    }
}
