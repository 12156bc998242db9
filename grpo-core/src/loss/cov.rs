//! Covariance-selected losses: clip-cov and kl-cov [verl; "The Entropy Mechanism of RL for
//! Reasoning LMs", 2505.22617].

use super::{
    LossDiagnostics, LossLevel, PolicyInputs, TokenOut, check_clamp, clamp_log_ratio, drive,
    for_each_valid, mul0, ppo::ppo_core, validate_inputs,
};
use crate::divergence::RatioBounds;
use crate::error::{Error, Result, ensure};
use crate::presets::Preset;
use crate::real::Real;

/// SplitMix64 (Steele, Lea & Flood 2014): a tiny, `no_std`, fully specified 64-bit generator.
/// Used for the reproducible random selection of [`clip_cov`].
///
/// ```
/// use grpo_core::loss::SplitMix64;
/// // Reference values of SplitMix64 seeded with 0.
/// let mut r = SplitMix64::new(0);
/// assert_eq!(r.next_u64(), 0xe220a8397b1dcdaf);
/// assert_eq!(r.next_u64(), 0x6e789e6aa1b965f4);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose state is `seed`.
    pub const fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `[0, n)` by Lemire's multiply-shift `(next_u64 · n) >> 64` (bias at most
    /// `n / 2^64`; no rejection loop, so the number of draws is fixed). `n = 0` gives 0.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

/// Configuration of [`clip_cov`] (verl `clip_cov`).
///
/// | field | every preset (verl defaults) |
/// |---|---|
/// | `bounds` | `[0.8, 1.2]` |
/// | `ratio` (`clip_cov_ratio`) | 2e-4 |
/// | `cov_lb`, `cov_ub` | 1.0, 5.0 |
/// | `log_ratio_clamp` | `None` for `Verl` (verl's clip-cov has no clamp), else `Some(20)` |
/// | `seed` | 0 (set it per step for fresh randomness) |
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClipCovConfig<T> {
    /// PPO clip interval.
    pub bounds: RatioBounds<T>,
    /// Fraction of valid tokens to detach: `k = max(⌊ratio·N⌋, 1)` (> 0), verl's
    /// `int(ratio * N)` for an f32 ratio too (see `select_count`'s slack of one f32 epsilon).
    pub ratio: T,
    /// Candidates need `cov_lb < cov < cov_ub`.
    pub cov_lb: T,
    /// Upper covariance bound (> `cov_lb`).
    pub cov_ub: T,
    /// Log-ratio clamp `c` before `exp`.
    pub log_ratio_clamp: Option<T>,
    /// Seed of the selection's [`SplitMix64`].
    pub seed: u64,
}

impl<T: Real> Default for ClipCovConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl<T: Real> ClipCovConfig<T> {
    /// The preset's configuration (see the table on [`ClipCovConfig`]).
    pub fn from_preset(preset: Preset) -> Self {
        ClipCovConfig {
            bounds: RatioBounds {
                lo: T::from_f64(0.8),
                hi: T::from_f64(1.2),
            },
            ratio: T::from_f64(2e-4),
            cov_lb: T::ONE,
            cov_ub: T::from_f64(5.0),
            log_ratio_clamp: match preset {
                Preset::Verl | Preset::VerlVectorized => None,
                _ => Some(T::from_f64(super::DEFAULT_LOG_RATIO_CLAMP)),
            },
            seed: 0,
        }
    }
}

/// Masked means of `A` and `lp` over valid tokens (detached) and the valid count.
fn means<T: Real>(inp: &PolicyInputs<'_, T>) -> (T, T, usize) {
    let (mut sa, mut sl, mut n) = (T::ZERO, T::ZERO, 0usize);
    let _ = for_each_valid(&inp.tokens, |t| {
        sa += inp.adv[t];
        sl += inp.lp[t];
        n += 1;
        Ok(())
    });
    if n == 0 {
        return (T::ZERO, T::ZERO, 0);
    }
    let nt = T::from_usize(n);
    (sa / nt, sl / nt, n)
}

/// `max(⌊ratio·n⌋, 1)` as verl computes it: `int(ratio * n)` with the ratio a Python float
/// (f64). An f64 ratio gives that product itself. An f32 ratio is the intended one rounded to
/// f32 (0.0002 becomes 0.000199999995), whose product can fall just short of the integer verl
/// reaches (⌊0.000199999995·10000⌋ = 1 where verl selects 2, at every multiple of 5000 tokens
/// from 10000 on); it is floored with a relative slack of one f32 epsilon (2⁻²³), more than its
/// rounding (≤ 2⁻²⁴ relative), so only products that f32 cannot tell from an integer move up.
fn select_count<T: Real>(ratio: T, n: usize) -> usize {
    let eps = T::EPSILON.to_f64();
    let x = ratio.to_f64() * n as f64;
    let x = if eps > f64::EPSILON {
        x * (1.0 + eps)
    } else {
        x
    };
    let k = libm::floor(x);
    if k >= 1.0 { k as usize } else { 1 }
}

/// Clip-Cov [2505.22617; verl `clip_cov`]: PPO-clip (no dual-clip, no δ cap) in which a few
/// random high-covariance tokens are detached.
///
/// ```text
/// cov_t = (A_t − Ā)·(lp_t − mean(lp))          (means over valid tokens, detached)
/// candidates: valid, not already clipped (−A·clip(ρ) ≤ −A·ρ), cov_lb < cov_t < cov_ub
/// k = min(max(⌊ratio·N⌋, 1), #candidates)
/// selected tokens: L_t = 0, ∂L_t/∂lp = 0;   others: PPO-clip
/// ```
///
/// **Selection algorithm** (deterministic given `seed`): Knuth's selection sampling (TAOCP
/// Algorithm S). With `m` candidates visited in increasing position order, a
/// [`SplitMix64`] seeded with `seed` draws, for the `j`-th candidate (`j = 0, 1, …`), one
/// `u = below(m − j)`; the candidate is selected iff `u < k − (already selected)`. This picks
/// exactly `k` candidates, every `k`-subset equally likely (up to `below`'s bias ≤ n/2^64).
/// verl uses `torch.randperm`; the selected *set* differs from verl's, its distribution is the same.
///
/// `selected` in the diagnostics counts the detached tokens (verl reports their fraction as
/// `pg_clipfrac`).
///
/// # Errors
/// Bounds not containing 1, `ratio` not finite and > 0, `cov_lb ≥ cov_ub` (or NaN), clamp ≤ 0;
/// otherwise as [`ppo_clip`](super::ppo_clip).
///
/// # Example
/// ```
/// use grpo_core::loss::{ClipCovConfig, PolicyInputs, clip_cov};
/// use grpo_core::Tokens;
/// // Ā = 0, mean lp = 0; cov = (2·1, −2·−1, 0.1·0, −0.1·0) = (2, 2, 0, 0): two candidates in
/// // (1, 5); k = max(⌊2e-4·4⌋, 1) = 1, so exactly one of tokens 0, 1 is detached.
/// let lp = [1.0, -1.0, 0.0, 0.0];
/// let old = lp;
/// let adv = [2.0, -2.0, 0.1, -0.1];
/// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens: Tokens::padded(1, 4, None) };
/// let (mut v, mut g) = ([0.0; 4], [0.0; 4]);
/// let d = clip_cov(&ClipCovConfig::default(), &inp, &mut v, &mut g).unwrap();
/// assert_eq!(d.selected, 1);
/// assert_eq!((g[0] == 0.0) as u8 + (g[1] == 0.0) as u8, 1);
/// assert_eq!((g[2], g[3]), (-0.1, 0.1)); // −A·ρ with ρ = 1
/// ```
pub fn clip_cov<T: Real>(
    cfg: &ClipCovConfig<T>,
    inp: &PolicyInputs<'_, T>,
    value: &mut [T],
    grad: &mut [T],
) -> Result<LossDiagnostics<T>> {
    RatioBounds::new(cfg.bounds.lo, cfg.bounds.hi)?;
    ensure(
        cfg.ratio > T::ZERO && cfg.ratio.is_finite(),
        "ratio",
        "must be finite and > 0",
    )?;
    ensure(cfg.cov_lb < cfg.cov_ub, "cov_ub", "must be > cov_lb")?;
    check_clamp(cfg.log_ratio_clamp, "log_ratio_clamp")?;
    validate_inputs(inp, value.len(), grad.len())?;
    let c = *cfg;
    let (abar, lbar, n) = means(inp);
    // Per-token PPO result (no dual-clip, no cap), shared by counting and the kernel.
    let ppo = move |t: usize| {
        let (x, clamped) = clamp_log_ratio(inp.lp[t] - inp.old[t], c.log_ratio_clamp);
        let rho = x.exp();
        let drho = if clamped { T::ZERO } else { rho };
        let mut o = ppo_core(rho, drho, inp.adv[t], c.bounds.lo, c.bounds.hi, None, None);
        o.log_ratio = x;
        o.clamped = clamped;
        o
    };
    let is_candidate = move |t: usize, o: &TokenOut<T>| {
        // verl's `clip_by_origin`: the clipped branch is strictly larger.
        let a = inp.adv[t];
        let clipped_branch = -(a * o.ratio.clamp(c.bounds.lo, c.bounds.hi));
        let by_origin = a != T::ZERO && clipped_branch > -(a * o.ratio);
        let cov = mul0(a - abar, inp.lp[t] - lbar);
        !by_origin && cov > c.cov_lb && cov < c.cov_ub
    };
    let mut m = 0usize;
    for_each_valid(&inp.tokens, |t| {
        m += is_candidate(t, &ppo(t)) as usize;
        Ok(())
    })?;
    let k = if n == 0 {
        0
    } else {
        select_count(c.ratio, n).min(m)
    };
    drive(&inp.tokens, LossLevel::Token, value, grad, || {
        let mut rng = SplitMix64::new(c.seed);
        let (mut seen, mut chosen) = (0usize, 0usize);
        move |_i, t| {
            let mut o = ppo(t);
            if is_candidate(t, &o) {
                let u = rng.below((m - seen) as u64);
                seen += 1;
                if (u as usize) < k - chosen {
                    chosen += 1;
                    o.value = T::ZERO;
                    o.grad = T::ZERO;
                    o.selected = true;
                }
            }
            o
        }
    })
}

/// Configuration of [`kl_cov`] (verl `kl_cov`).
///
/// | field | every preset (verl defaults) |
/// |---|---|
/// | `ratio` (`kl_cov_ratio`) | 2e-4 |
/// | `coef` (`ppo_kl_coef`) | 1.0 |
/// | `log_ratio_clamp` | `None` for `Verl`, else `Some(20)` |
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlCovConfig<T> {
    /// Fraction of valid tokens to penalise: `k = max(⌊ratio·N⌋, 1)` (> 0), verl's
    /// `int(ratio * N)` for an f32 ratio too (see `select_count`'s slack of one f32 epsilon).
    pub ratio: T,
    /// Coefficient of the `|x|` penalty (finite).
    pub coef: T,
    /// Log-ratio clamp `c` before `exp`.
    pub log_ratio_clamp: Option<T>,
}

impl<T: Real> Default for KlCovConfig<T> {
    fn default() -> Self {
        Self::from_preset(Preset::Paper)
    }
}

impl<T: Real> KlCovConfig<T> {
    /// The preset's configuration (see the table on [`KlCovConfig`]).
    pub fn from_preset(preset: Preset) -> Self {
        KlCovConfig {
            ratio: T::from_f64(2e-4),
            coef: T::ONE,
            log_ratio_clamp: match preset {
                Preset::Verl | Preset::VerlVectorized => None,
                _ => Some(T::from_f64(super::DEFAULT_LOG_RATIO_CLAMP)),
            },
        }
    }
}

/// Scratch elements [`kl_cov`] needs for `n` token positions.
pub const fn kl_cov_scratch_len(n: usize) -> usize {
    n
}

/// KL-Cov [2505.22617; verl `kl_cov`]: the *unclipped* policy gradient, with an `|x|` penalty on
/// the `k` tokens of largest covariance.
///
/// ```text
/// cov_t = (A_t − Ā)·(lp_t − mean(lp))          (means over valid tokens, detached)
/// k = max(⌊ratio·N⌋, 1);  S = the k valid tokens of largest cov
/// L_t = −A·ρ + coef·|x|  (t ∈ S),   L_t = −A·ρ  (otherwise)
/// ∂L_t/∂lp = −A·ρ + coef·sgn(x)  /  −A·ρ        (x = clamped log-ratio; 0 terms if clamped)
/// ```
///
/// **Selection** (deterministic, no randomness): the threshold τ is the k-th largest cov
/// (`select_nth_unstable` on a copy in `scratch`); every token with cov > τ is selected, then
/// tokens with cov = τ in increasing position order until k are selected (verl's `topk` breaks
/// such ties in an unspecified order). A NaN cov (only from overflowing inputs) ranks lowest.
///
/// # Errors
/// `ratio` not finite and > 0, `coef` not finite, clamp ≤ 0,
/// [`Error::ScratchTooSmall`] (needs [`kl_cov_scratch_len`]`(n)`; its contents afterwards are
/// unspecified); otherwise as
/// [`ppo_clip`](super::ppo_clip).
///
/// # Example
/// ```
/// use grpo_core::loss::{KlCovConfig, PolicyInputs, kl_cov, kl_cov_scratch_len};
/// use grpo_core::Tokens;
/// // Ā = 0, mean lp = 0, cov = (1·1, −1·−1·…): lp = (1, −1, 0.5, −0.5), A = (1, 1, −1, −1) →
/// // Ā = 0, cov = (1, −1, −0.5, 0.5); k = 1 → token 0 is penalised.
/// let lp = [1.0, -1.0, 0.5, -0.5];
/// let old = [1.0, -1.0, 0.5, -0.5]; // ρ = 1, x = 0
/// let adv = [1.0, 1.0, -1.0, -1.0];
/// let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens: Tokens::padded(1, 4, None) };
/// let (mut v, mut g) = ([0.0; 4], [0.0; 4]);
/// let mut scratch = [0.0; kl_cov_scratch_len(4)];
/// let d = kl_cov(&KlCovConfig::default(), &inp, &mut scratch, &mut v, &mut g).unwrap();
/// assert_eq!(d.selected, 1);
/// assert_eq!(v, [-1.0, -1.0, 1.0, 1.0]); // |x| = 0, so the penalty adds nothing here
/// ```
pub fn kl_cov<T: Real>(
    cfg: &KlCovConfig<T>,
    inp: &PolicyInputs<'_, T>,
    scratch: &mut [T],
    value: &mut [T],
    grad: &mut [T],
) -> Result<LossDiagnostics<T>> {
    ensure(
        cfg.ratio > T::ZERO && cfg.ratio.is_finite(),
        "ratio",
        "must be finite and > 0",
    )?;
    ensure(cfg.coef.is_finite(), "coef", "must be finite")?;
    check_clamp(cfg.log_ratio_clamp, "log_ratio_clamp")?;
    validate_inputs(inp, value.len(), grad.len())?;
    let need = kl_cov_scratch_len(inp.lp.len());
    if scratch.len() < need {
        return Err(Error::ScratchTooSmall {
            needed: need,
            found: scratch.len(),
        });
    }
    let c = *cfg;
    let (abar, lbar, n) = means(inp);
    let cov = move |t: usize| {
        let v = mul0(inp.adv[t] - abar, inp.lp[t] - lbar);
        if v.is_nan() { T::NEG_INFINITY } else { v }
    };
    // Threshold: the k-th largest cov.
    let k = if n == 0 {
        0
    } else {
        select_count(c.ratio, n).min(n)
    };
    let (thr, above) = if k == 0 {
        (T::INFINITY, 0)
    } else {
        let mut j = 0usize;
        for_each_valid(&inp.tokens, |t| {
            scratch[j] = cov(t);
            j += 1;
            Ok(())
        })?;
        let s = &mut scratch[..n];
        let (_, thr, _) = s.select_nth_unstable_by(n - k, |a, b| {
            a.partial_cmp(b).unwrap_or(core::cmp::Ordering::Equal)
        });
        let thr = *thr;
        let mut above = 0usize;
        for_each_valid(&inp.tokens, |t| {
            above += (cov(t) > thr) as usize;
            Ok(())
        })?;
        (thr, above)
    };
    drive(&inp.tokens, LossLevel::Token, value, grad, || {
        let mut ties_left = k - above.min(k);
        move |_i, t| {
            let a = inp.adv[t];
            let (x, clamped) = clamp_log_ratio(inp.lp[t] - inp.old[t], c.log_ratio_clamp);
            let rho = x.exp();
            let drho = if clamped { T::ZERO } else { rho };
            let cv = cov(t);
            let selected = k > 0
                && (cv > thr || {
                    let tie = cv == thr && ties_left > 0;
                    if tie {
                        ties_left -= 1;
                    }
                    tie
                });
            let mut value = -mul0(a, rho);
            let mut grad = -mul0(a, drho);
            if selected {
                value += mul0(c.coef, x.abs());
                if !clamped {
                    grad += mul0(c.coef, x.signum0());
                }
            }
            TokenOut {
                value,
                grad,
                ratio: rho,
                log_ratio: x,
                clamped,
                selected,
                ..TokenOut::default()
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Tokens;

    #[test]
    fn select_count_is_verls_int_of_the_decimal_ratio() {
        // verl: int(0.0002 * N) in Python floats.
        for (n, want) in [
            (10_000, 2),
            (15_000, 3),
            (200_000, 40),
            (4_999, 1),
            (14_999, 2),
        ] {
            assert_eq!(select_count(0.0002f64, n), want, "f64, N = {n}");
            assert_eq!(select_count(0.0002f32, n), want, "f32, N = {n}");
        }
        // The f32 ratio alone would floor 1.99999995 to 1.
        assert_eq!(libm::floor(0.0002f32 as f64 * 10_000.0), 1.0);
        // At least one token; a ratio just short of an integer product stays below it.
        assert_eq!(select_count(0.0002f32, 10), 1);
        assert_eq!(select_count(0.19999f32, 10), 1);
        assert_eq!(select_count(0.5f32, 3), 1);
    }

    #[test]
    fn below_stays_in_range_and_zero_is_zero() {
        let mut r = SplitMix64::new(42);
        for n in 1..50u64 {
            assert!(r.below(n) < n);
        }
        assert_eq!(r.below(0), 0);
    }

    /// 40 tokens, all candidates: cov = (A − 0)(lp − 0) = 2 for every token (A = ±1,
    /// lp = ±2 with matching signs), ratio 0.1 → k = ⌊0.1·40⌋ = 4.
    fn all_candidates() -> ([f64; 40], [f64; 40]) {
        let mut lp = [0.0; 40];
        let mut adv = [0.0; 40];
        for t in 0..40 {
            let s = if t % 2 == 0 { 1.0 } else { -1.0 };
            lp[t] = 2.0 * s;
            adv[t] = s;
        }
        (lp, adv)
    }

    fn selected(seed: u64) -> [bool; 40] {
        let (lp, adv) = all_candidates();
        let inp = PolicyInputs {
            lp: &lp,
            old: &lp,
            adv: &adv,
            tokens: Tokens::padded(4, 10, None),
        };
        let cfg = ClipCovConfig {
            ratio: 0.1,
            seed,
            ..ClipCovConfig::default()
        };
        let (mut v, mut g) = ([0.0; 40], [0.0; 40]);
        let d = clip_cov(&cfg, &inp, &mut v, &mut g).unwrap();
        assert_eq!(d.selected, 4);
        let mut s = [false; 40];
        for t in 0..40 {
            // ρ = 1, so unselected tokens have gradient −A = ∓1.
            s[t] = g[t] == 0.0;
        }
        assert_eq!(s.iter().filter(|&&b| b).count(), 4);
        s
    }

    #[test]
    fn clip_cov_selection_is_deterministic_per_seed() {
        assert_eq!(selected(7), selected(7));
        // Different seeds pick different sets (these two do; a collision would be 1 in 91390).
        assert_ne!(selected(7), selected(8));
    }

    #[test]
    fn clip_cov_selection_is_roughly_uniform() {
        // Over 2000 seeds each of the 40 tokens is picked with probability k/m = 0.1:
        // expected 200 picks, std ≈ 13.4; allow ±6σ.
        let mut counts = [0u32; 40];
        for seed in 0..2000 {
            for (t, s) in selected(seed).iter().enumerate() {
                counts[t] += *s as u32;
            }
        }
        for c in counts {
            assert!((120..=280).contains(&c), "{c}");
        }
    }

    #[test]
    fn kl_cov_ties_go_to_the_earliest_positions() {
        // All covariances equal 2 (see `all_candidates`), k = 4 → positions 0..4 are penalised.
        let (lp, adv) = all_candidates();
        let old: [f64; 40] = core::array::from_fn(|t| lp[t] - 0.5); // x = 0.5, |x| = 0.5
        let inp = PolicyInputs {
            lp: &lp,
            old: &old,
            adv: &adv,
            tokens: Tokens::padded(4, 10, None),
        };
        let cfg = KlCovConfig {
            ratio: 0.1,
            ..KlCovConfig::default()
        };
        let (mut v, mut g, mut s) = ([0.0; 40], [0.0; 40], [0.0; 40]);
        let d = kl_cov(&cfg, &inp, &mut s, &mut v, &mut g).unwrap();
        assert_eq!(d.selected, 4);
        let rho = 0.5f64.exp();
        for t in 0..40 {
            // Selected: −A·ρ + 1·|0.5|, gradient −A·ρ + sgn(0.5).
            let pen = if t < 4 { 1.0 } else { 0.0 };
            assert!((v[t] - (-adv[t] * rho + 0.5 * pen)).abs() < 1e-12);
            assert!((g[t] - (-adv[t] * rho + pen)).abs() < 1e-12);
        }
    }
}
