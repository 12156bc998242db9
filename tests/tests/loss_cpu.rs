//! grpo-cpu's multi-threaded `Cpu::ppo_clip` against grpo-core's `ppo_clip`, bit for bit:
//! packed and padded layouts with masks (garbage, NaN included, in masked positions), GRPO /
//! DAPO / verl dual-clip / TRL / δ-cap / ATR-GRPO KL3 configs, pools of 1, 2 and 3 threads.
//! f64 runs grpo-core per block (blocks of 1, 3, 7 and 64 positions and the default block);
//! f32 runs the SIMD kernel on every backend this CPU has (lengths around multiples of 16, of
//! grpo-core's 2048-position blocks and of the kernel's spans; ±0, subnormal, huge and
//! overflowing values). Errors must be grpo-core's `Err` value with both outputs untouched; the
//! diagnostics, `kl_sum` included, must be grpo-core's exactly (except for the small test
//! blocks, whose `kl_sum` association differs by design).

use std::sync::OnceLock;

use grpo_core::loss::{LossDiagnostics, PolicyInputs, PpoClipConfig, ppo_clip};
use grpo_core::{Preset, Tokens};
use grpo_cpu::{Backend, Cpu, LOSS_BLOCK};
use proptest::prelude::*;

fn cpus() -> &'static [Cpu] {
    static CPUS: OnceLock<Vec<Cpu>> = OnceLock::new();
    CPUS.get_or_init(|| {
        [1, 2, 3]
            .map(|t| {
                Cpu::new(Backend::Portable)
                    .unwrap()
                    .with_threads(t)
                    .unwrap()
            })
            .to_vec()
    })
}

fn configs() -> Vec<PpoClipConfig<f64>> {
    let mut capped = PpoClipConfig::from_preset(Preset::Trl);
    capped.delta_cap = Some(1.5);
    vec![
        PpoClipConfig::default(),
        PpoClipConfig::dapo(),
        PpoClipConfig::from_preset(Preset::Verl),
        PpoClipConfig::from_preset(Preset::Trl),
        capped,
        PpoClipConfig::atr_kl3(0.05).unwrap(),
    ]
}

fn bits(x: &[f64]) -> Vec<u64> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Every field except `kl_sum` exactly; with blocks that are not power-of-two multiples of
/// grpo-core's 2048-position blocks `kl_sum` is associated differently (documented), so only
/// close.
fn same_diag(a: &LossDiagnostics<f64>, b: &LossDiagnostics<f64>) -> bool {
    let mut a2 = *a;
    a2.kl_sum = b.kl_sum;
    a2 == *b && (a.kl_sum - b.kl_sum).abs() <= 1e-9 * (1.0 + b.kl_sum.abs())
}

#[derive(Debug, Clone)]
struct Batch {
    lp: Vec<f64>,
    old: Vec<f64>,
    adv: Vec<f64>,
    mask: Vec<bool>,
    /// Packed sequence lengths; the padded view uses `rows × cols` over the same arrays.
    lens: Vec<usize>,
    cols: usize,
}

fn batch() -> impl Strategy<Value = Batch> {
    (1usize..6, 1usize..30).prop_flat_map(|(rows, cols)| {
        let n = rows * cols;
        (
            prop::collection::vec(-3.0f64..0.0, n),
            prop::collection::vec(-3.0f64..0.0, n),
            prop::collection::vec(prop_oneof![Just(0.0), -2.0f64..2.0], n),
            prop::collection::vec(prop::bool::weighted(0.8), n),
            prop::collection::vec(0usize..20, 0..8),
        )
            .prop_map(move |(lp, old, adv, mask, mut lens)| {
                // Packed lengths that sum to n: the drawn ones while they fit, the rest last.
                let mut left = n;
                lens.retain_mut(|l| {
                    *l = (*l).min(left);
                    left -= *l;
                    true
                });
                lens.push(left);
                let (mut lp, mut old, mut adv) = (lp, old, adv);
                // Garbage in masked positions must never matter.
                for t in 0..n {
                    if !mask[t] {
                        lp[t] = f64::NAN;
                        old[t] = f64::INFINITY;
                        adv[t] = f64::NAN;
                    }
                }
                Batch {
                    lp,
                    old,
                    adv,
                    mask,
                    lens,
                    cols,
                }
            })
    })
}

fn cu(lens: &[usize]) -> Vec<usize> {
    let mut cu = vec![0];
    for l in lens {
        cu.push(cu.last().unwrap() + l);
    }
    cu
}

/// Runs grpo-core and every (pool, block) of grpo-cpu on `inp`; both must give the same bits
/// (or the same error with untouched outputs).
fn check(cfg: &PpoClipConfig<f64>, inp: &PolicyInputs<'_, f64>, out_len: usize) {
    let (mut v0, mut g0) = (vec![7.0; out_len], vec![7.0; out_len]);
    let want = ppo_clip(cfg, inp, &mut v0, &mut g0);
    for cpu in cpus() {
        for block in [1, 3, 7, 64, LOSS_BLOCK] {
            let (mut v, mut g) = (vec![7.0; out_len], vec![7.0; out_len]);
            let got = cpu.ppo_clip_blocks(cfg, inp, &mut v, &mut g, block);
            match (&want, &got) {
                (Ok(a), Ok(b)) if block == LOSS_BLOCK => assert_eq!(a, b),
                (Ok(a), Ok(b)) => assert!(same_diag(b, a), "{b:?} vs {a:?}"),
                (Err(a), Err(b)) => assert_eq!(a, b),
                _ => panic!("core {want:?}, cpu {got:?}"),
            }
            // On Err both are still the sentinel, on Ok both hold the same bits.
            assert_eq!(
                bits(&v),
                bits(&v0),
                "threads {} block {block}",
                cpu.threads()
            );
            assert_eq!(
                bits(&g),
                bits(&g0),
                "threads {} block {block}",
                cpu.threads()
            );
        }
    }
}

fn to_f32(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

fn cfg32(ci: usize) -> PpoClipConfig<f32> {
    let c = configs()[ci];
    PpoClipConfig {
        bounds: grpo_core::divergence::RatioBounds {
            lo: c.bounds.lo as f32,
            hi: c.bounds.hi as f32,
        },
        dual_clip: c.dual_clip.map(|x| x as f32),
        delta_cap: c.delta_cap.map(|x| x as f32),
        log_ratio_clamp: c.log_ratio_clamp.map(|x| x as f32),
    }
}

/// Every f32 backend of this CPU on pools of 1, 2 and 3 threads.
fn cpus_f32() -> &'static [Cpu] {
    static CPUS: OnceLock<Vec<Cpu>> = OnceLock::new();
    CPUS.get_or_init(|| {
        Backend::available()
            .flat_map(|b| [1, 2, 3].map(move |t| Cpu::new(b).unwrap().with_threads(t).unwrap()))
            .collect()
    })
}

fn bits32(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// grpo-core against the SIMD path of every backend and pool: same bits, same diagnostics
/// (`kl_sum` included), or the same error with untouched outputs.
fn check_f32(cfg: &PpoClipConfig<f32>, inp: &PolicyInputs<'_, f32>, out_len: usize) {
    let (mut v0, mut g0) = (vec![7.0f32; out_len], vec![7.0f32; out_len]);
    let want = ppo_clip(cfg, inp, &mut v0, &mut g0);
    for cpu in cpus_f32() {
        let (mut v, mut g) = (vec![7.0f32; out_len], vec![7.0f32; out_len]);
        let got = cpu.ppo_clip(cfg, inp, &mut v, &mut g);
        let who = format!("{:?}, {} threads", cpu.backend(), cpu.threads());
        match (&want, &got) {
            (Ok(a), Ok(b)) => {
                assert_eq!(a, b, "{who}");
                assert_eq!(a.kl_sum.to_bits(), b.kl_sum.to_bits(), "{who}");
            }
            (Err(a), Err(b)) => assert_eq!(a, b, "{who}"),
            _ => panic!("{who}: core {want:?}, cpu {got:?}"),
        }
        assert_eq!(bits32(&v), bits32(&v0), "{who}: values");
        assert_eq!(bits32(&g), bits32(&g0), "{who}: gradients");
    }
}

/// f32 values that stress the kernel: signed zeros, subnormals, huge, ordinary.
fn edge_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        Just(0.0f32),
        Just(-0.0f32),
        Just(1e-40f32),
        Just(-1e-40f32),
        Just(80.0f32),
        Just(-80.0f32),
        Just(1e30f32),
        Just(-1e30f32),
        Just(20.0f32),
        Just(-20.0f32),
        -3.0f32..3.0,
        -3.0f32..3.0,
        -3.0f32..3.0,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn bit_identical_packed_and_padded(b in batch(), ci in 0usize..6) {
        let cfg = configs()[ci];
        let n = b.lp.len();
        let cu = cu(&b.lens);
        for tokens in [
            Tokens::packed(&cu, Some(&b.mask)),
            Tokens::padded(n / b.cols, b.cols, Some(&b.mask)),
        ] {
            let inp = PolicyInputs { lp: &b.lp, old: &b.old, adv: &b.adv, tokens };
            check(&cfg, &inp, n);
            let (lp, old, adv) = (to_f32(&b.lp), to_f32(&b.old), to_f32(&b.adv));
            let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens };
            check_f32(&cfg32(ci), &inp, n);
        }
    }

    /// f32 SIMD kernel on edge values: ±0, subnormal and huge advantages, log-ratios far outside
    /// the clamp (or overflowing without it), lengths around multiples of 16.
    #[test]
    fn simd_f32_edge_values(
        vals in prop::collection::vec((edge_f32(), edge_f32(), edge_f32(), prop::bool::weighted(0.85)), 0..70),
        ci in 0usize..6,
    ) {
        let n = vals.len();
        let lp: Vec<f32> = vals.iter().map(|v| v.0).collect();
        let old: Vec<f32> = vals.iter().map(|v| v.1).collect();
        let adv: Vec<f32> = vals.iter().map(|v| v.2).collect();
        let mask: Vec<bool> = vals.iter().map(|v| v.3).collect();
        for m in [None, Some(&mask[..])] {
            let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens: Tokens::padded(1, n, m) };
            check_f32(&cfg32(ci), &inp, n);
        }
    }

    #[test]
    fn errors_match_with_outputs_untouched(b in batch(), ci in 0usize..6, at in any::<prop::sample::Index>(), kind in 0usize..4) {
        let cfg = configs()[ci];
        let n = b.lp.len();
        let (mut lp, mut adv, mut mask) = (b.lp.clone(), b.adv.clone(), b.mask.clone());
        let t = at.index(n);
        mask[t] = true;
        let old_t = if b.old[t].is_finite() { b.old[t] } else { -1.0 };
        let mut old = b.old.clone();
        old[t] = old_t;
        lp[t] = -1.0;
        adv[t] = 1.0;
        match kind {
            // A non-finite valid input.
            0 => lp[t] = f64::NAN,
            1 => adv[t] = f64::INFINITY,
            // lp − old overflows although both are finite.
            2 => {
                lp[t] = f64::MAX;
                old[t] = -f64::MAX;
            }
            // A loss value overflow: no clamp (TRL), ρ = e^700, A = 1e300, in the unclipped
            // branch (A < 0 and ρ > hi keeps −A·ρ, which is +∞).
            _ => {
                lp[t] = 700.0;
                old[t] = 0.0;
                adv[t] = -1e300;
            }
        }
        let cfg = if kind == 3 { PpoClipConfig::from_preset(Preset::Trl) } else { cfg };
        let cu = cu(&b.lens);
        for tokens in [
            Tokens::packed(&cu, Some(&mask)),
            Tokens::padded(n / b.cols, b.cols, Some(&mask)),
        ] {
            let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens };
            let (mut v, mut g) = (vec![0.0; n], vec![0.0; n]);
            prop_assert!(ppo_clip(&cfg, &inp, &mut v, &mut g).is_err());
            check(&cfg, &inp, n);
            // The same batch in f32 (kind 2 and 3 overflow f32 just the same).
            let (lp, old, adv) = (to_f32(&lp), to_f32(&old), to_f32(&adv));
            let inp = PolicyInputs { lp: &lp, old: &old, adv: &adv, tokens };
            let cfg = if kind == 3 { PpoClipConfig::from_preset(Preset::Trl) } else { cfg32(ci) };
            let (mut v, mut g) = (vec![0.0f32; n], vec![0.0f32; n]);
            prop_assert!(ppo_clip(&cfg, &inp, &mut v, &mut g).is_err());
            check_f32(&cfg, &inp, n);
        }
    }
}

#[test]
fn layout_and_config_errors_match() {
    let lp = [-1.0; 10];
    let cfg = PpoClipConfig::<f64>::default();
    let bad_cu = [0, 6, 4, 10];
    for (tokens, out_len) in [
        (Tokens::packed(&bad_cu, None), 10),
        (Tokens::padded(3, 3, None), 10),
        (Tokens::padded(2, 5, None), 9),
    ] {
        let inp = PolicyInputs {
            lp: &lp,
            old: &lp,
            adv: &lp,
            tokens,
        };
        check(&cfg, &inp, out_len);
    }
    let mut bad = cfg;
    bad.dual_clip = Some(0.5);
    let inp = PolicyInputs {
        lp: &lp,
        old: &lp,
        adv: &lp,
        tokens: Tokens::padded(2, 5, None),
    };
    check(&bad, &inp, 10);
    // The error of a bad config on a long batch is grpo-core's, outputs untouched.
    let mut v = [3.0; 10];
    let mut g = [3.0; 10];
    let e = cpus()[1].ppo_clip_blocks(&bad, &inp, &mut v, &mut g, 2);
    assert!(matches!(
        e,
        Err(grpo_core::Error::InvalidParam {
            name: "dual_clip",
            ..
        })
    ));
    assert_eq!((v, g), ([3.0; 10], [3.0; 10]));
}

/// Several default blocks in f32 through the public entry point, with hand-checked tokens.
#[test]
fn default_blocks_f32() {
    let n = 3 * LOSS_BLOCK + 5;
    let lp: Vec<f32> = (0..n).map(|t| -((t % 97) as f32) / 50.0).collect();
    let old: Vec<f32> = (0..n).map(|t| -((t % 89) as f32) / 50.0).collect();
    let adv: Vec<f32> = (0..n).map(|t| ((t % 7) as f32) - 3.0).collect();
    let inp = PolicyInputs {
        lp: &lp,
        old: &old,
        adv: &adv,
        tokens: Tokens::padded(1, n, None),
    };
    let cfg = PpoClipConfig::<f32>::atr_kl3(0.05).unwrap();
    let (mut v0, mut g0) = (vec![0.0f32; n], vec![0.0f32; n]);
    let d0 = ppo_clip(&cfg, &inp, &mut v0, &mut g0).unwrap();
    for cpu in cpus() {
        let (mut v, mut g) = (vec![0.0f32; n], vec![0.0f32; n]);
        let d = cpu.ppo_clip(&cfg, &inp, &mut v, &mut g).unwrap();
        assert_eq!(
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            v0.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(
            g.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            g0.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(d, d0);
    }
    // Token 0: lp = old = 0, ρ = 1, A = 0 − 3 = −3: L = 3, ∂L/∂lp = −A·ρ = 3.
    assert_eq!((v0[0], g0[0]), (3.0, 3.0));
    // Token 3: A = 0: L = 0, grad 0.
    assert_eq!((v0[3], g0[3]), (0.0, 0.0));
}

/// `n` ordinary f32 tokens from `next` (uniform in [0, 1)): log-probabilities in [−4, 0), π_old
/// within ±0.4 of them (so ratios cross the clip bounds), advantages in [−2, 2) with every 11th
/// exactly 0, and a mask with about one position in ten masked out.
fn ordinary_f32_batch(
    n: usize,
    next: &mut impl FnMut() -> f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<bool>) {
    let lp: Vec<f32> = (0..n).map(|_| -4.0 * next()).collect();
    let old: Vec<f32> = lp.iter().map(|&l| l + 0.8 * next() - 0.4).collect();
    let adv: Vec<f32> = (0..n)
        .map(|t| if t % 11 == 0 { 0.0 } else { 4.0 * next() - 2.0 })
        .collect();
    let mask: Vec<bool> = (0..n).map(|_| next() < 0.9).collect();
    (lp, old, adv, mask)
}

/// Long f32 batches on every backend: lengths around grpo-core's 2048-position blocks and the
/// SIMD kernel's 16384-position spans (so the spans' `kl_sum`s must fold into grpo-core's exact
/// association), masked and unmasked, every config.
#[test]
fn long_f32_batches_every_backend() {
    let mut next = grpo_tests::uniform_f32(0x2545_f491_4f6c_dd1du64);
    for n in [
        2047usize,
        2048,
        2049,
        16384 - 1,
        16384 + 17,
        3 * 16384 + 2048 * 3 + 5,
    ] {
        let (lp, old, adv, mask) = ordinary_f32_batch(n, &mut next);
        for ci in 0..configs().len() {
            for m in [None, Some(&mask[..])] {
                let inp = PolicyInputs {
                    lp: &lp,
                    old: &old,
                    adv: &adv,
                    tokens: Tokens::padded(1, n, m),
                };
                check_f32(&cfg32(ci), &inp, n);
            }
        }
    }
}

/// The SIMD check is conservative: batches just outside its bounds, which grpo-core may accept,
/// go to grpo-core, and grpo-cpu must return its result (or its error) bit for bit.
/// - Without a log-ratio clamp (TRL) the check passes log-ratios up to 80 only: `lp − old = 85`
///   with `A = 1e-6` has a finite `A·ρ ≈ 8e30`.
/// - Under the default clamp of 20 it passes `|A| ≤ f32::MAX / e^20 ≈ 7e29` only: `A = ±1e31`
///   at `ρ ≈ 1` is finite everywhere.
/// - Without a clamp, `x = 30` with `A = 1e30` clips high (value `−A·hi`, finite) although
///   `A·ρ` overflows in the branch the clip discards; with `A = −1e30` the unclipped branch
///   wins with `+∞` and both return the same error.
///
/// Just inside the bounds (80, 7e29) the SIMD kernel runs; the results are the same.
#[test]
fn beyond_the_check_bounds_matches_core() {
    let trl = PpoClipConfig::<f32>::from_preset(Preset::Trl);
    let default = PpoClipConfig::<f32>::default();
    assert_eq!(
        (trl.log_ratio_clamp, default.log_ratio_clamp),
        (None, Some(20.0))
    );
    let n = 2 * 16384 + 3 * 16 + 5;
    for (cfg, lp_at, a_at) in [
        (&trl, 85.0f32, 1e-6f32),
        (&trl, 80.0, 1e-6),
        (&trl, 30.0, 1e30),
        (&trl, 30.0, -1e30),
        (&default, -0.1, 1e31),
        (&default, -0.1, -1e31),
        (&default, -0.1, 7e29),
    ] {
        for at in [20, n - 2] {
            let lp: Vec<f32> = (0..n)
                .map(|t| {
                    if t == at {
                        lp_at
                    } else {
                        -0.001 * (t % 1000) as f32
                    }
                })
                .collect();
            let old = vec![0.0f32; n];
            let adv: Vec<f32> = (0..n).map(|t| if t == at { a_at } else { 1.0 }).collect();
            let inp = PolicyInputs {
                lp: &lp,
                old: &old,
                adv: &adv,
                tokens: Tokens::padded(1, n, None),
            };
            let (mut v, mut g) = (vec![0.0f32; n], vec![0.0f32; n]);
            match ppo_clip(cfg, &inp, &mut v, &mut g) {
                Ok(d) if lp_at == 30.0 => {
                    // −(A·hi) rounded once; the clipped branch's gradient is −mul0(A, 0) = −0.
                    assert_eq!(v[at], -(a_at * cfg.bounds.hi));
                    assert_eq!(g[at].to_bits(), (-0.0f32).to_bits());
                    assert_eq!(d.clipped_high, 1);
                }
                Ok(d) => {
                    assert!(v[at].is_finite() && v[at] != 0.0, "{} at {at}", v[at]);
                    assert_eq!(d.tokens, n);
                }
                Err(e) => assert!(lp_at == 30.0 && a_at < 0.0, "{e:?}"),
            }
            check_f32(cfg, &inp, n);
        }
    }
}

/// Log-ratios whose ratios lie a few ULP around each config's bounds, dual constant and δ cap,
/// with advantages for which `−A·ρ` and `−A·bound` round to the same f32 while the ratios
/// differ: every backend gives grpo-core's bits and diagnostics, and grpo-core clips a token
/// one ULP past a bound (no gradient) as the rule says.
#[test]
fn rounding_ties_at_the_bounds_match_core() {
    // grpo-core's f32 exponential (an inherent `f32::exp` would be std's).
    use grpo_core::Real;
    for ci in 0..configs().len() {
        let cfg = cfg32(ci);
        let mut bounds = vec![cfg.bounds.lo, cfg.bounds.hi];
        bounds.extend(cfg.dual_clip.into_iter().chain(cfg.delta_cap));
        let (lp, adv) = grpo_tests::bound_tie_grid(&bounds);
        let n = lp.len();
        let old = vec![0.0f32; n];
        // The grid must hold ties at a bound it crosses.
        let ties = lp
            .iter()
            .zip(&adv)
            .filter(|&(&x, &a)| {
                let rho = Real::exp(x);
                bounds.iter().any(|&b| rho != b && a * rho == a * b)
            })
            .count();
        assert!(ties > 20, "config {ci}: {ties} ties");
        let inp = PolicyInputs {
            lp: &lp,
            old: &old,
            adv: &adv,
            tokens: Tokens::padded(1, n, None),
        };
        let (mut v, mut g) = (vec![0.0f32; n], vec![0.0f32; n]);
        let d = ppo_clip(&cfg, &inp, &mut v, &mut g).unwrap();
        // The tokens past a bound against their advantage's sign get no gradient.
        let (lo, hi) = (cfg.bounds.lo, cfg.bounds.hi);
        let clipped = (0..n)
            .filter(|&t| {
                let rho = Real::exp(lp[t]);
                (adv[t] > 0.0 && rho > hi) || (adv[t] < 0.0 && rho < lo)
            })
            .inspect(|&t| assert_eq!(g[t], 0.0, "config {ci}, token {t}"))
            .count();
        assert_eq!(clipped, d.clipped_high + d.clipped_low, "config {ci}");
        check_f32(&cfg, &inp, n);
    }
}

/// `src` copied into `buf` from the first index whose address lies `4·q` bytes past a 64-byte
/// boundary (`q` < 16 floats); returns that index.
fn place_at(buf: &mut [f32], src: &[f32], q: usize) -> usize {
    let addr = buf.as_ptr() as usize;
    let at = (0..16)
        .find(|&i| (addr + 4 * i) % 64 == 4 * q)
        .expect("an f32 buffer is 4-byte aligned");
    buf[at..at + src.len()].copy_from_slice(src);
    at
}

/// The write pass reads and writes in chunks aligned to the arrays where all five lie equally
/// far from a 64-byte boundary, after a partial chunk of the positions before it (0–15 of
/// them), and in the canonical chunks otherwise. Every such placement — the same offset
/// `q = 0..16` floats for all five, and mixed offsets (inputs on a boundary and outputs not,
/// and the reverse, and one array off) — must give grpo-core's values, gradients and
/// diagnostics (`kl_sum` bits included) on every backend and pool, over lengths that end
/// inside the first chunk, inside a block and after several spans, masked and not.
#[test]
fn every_array_placement_matches_core() {
    let mut next = grpo_tests::uniform_f32(0x9e37_79b9_7f4a_7c15u64);
    let same = (0..16).map(|q| [q; 5]);
    let mixed = [
        [0, 0, 0, 4, 4],
        [4, 4, 4, 0, 0],
        [0, 0, 0, 0, 7],
        [3, 0, 0, 0, 0],
        [1, 2, 3, 4, 5],
    ];
    let placements: Vec<[usize; 5]> = same.chain(mixed).collect();
    for n in [9usize, 40, 2048 + 33, 2 * 16384 + 2048 + 21] {
        let (lp, old, adv, mask) = ordinary_f32_batch(n, &mut next);
        for q in &placements {
            let mut bufs: Vec<Vec<f32>> = (0..5).map(|_| vec![7.0f32; n + 16]).collect();
            let at: Vec<usize> = (0..5)
                .map(|k| {
                    let src = [&lp[..], &old[..], &adv[..], &lp[..], &lp[..]][k];
                    place_at(&mut bufs[k], src, q[k])
                })
                .collect();
            // The outputs start as 7.0 everywhere (the copied logits are overwritten here).
            for k in 3..5 {
                bufs[k].fill(7.0);
            }
            let [lb, ob, ab, vb, gb] = &mut bufs[..] else {
                unreachable!()
            };
            for ci in [0, 2, 3, 4] {
                let cfg = cfg32(ci);
                for m in [None, Some(&mask[..])] {
                    let inp = PolicyInputs {
                        lp: &lb[at[0]..at[0] + n],
                        old: &ob[at[1]..at[1] + n],
                        adv: &ab[at[2]..at[2] + n],
                        tokens: Tokens::padded(1, n, m),
                    };
                    let (mut v0, mut g0) = (vec![7.0f32; n], vec![7.0f32; n]);
                    let want = ppo_clip(&cfg, &inp, &mut v0, &mut g0).unwrap();
                    for cpu in cpus_f32() {
                        let (v, g) = (&mut vb[at[3]..at[3] + n], &mut gb[at[4]..at[4] + n]);
                        v.fill(7.0);
                        g.fill(7.0);
                        let got = cpu.ppo_clip(&cfg, &inp, v, g).unwrap();
                        let who = format!(
                            "n = {n}, offsets {q:?}, config {ci}, mask {}, {:?}, {} threads",
                            m.is_some(),
                            cpu.backend(),
                            cpu.threads()
                        );
                        assert_eq!(got, want, "{who}");
                        assert_eq!(got.kl_sum.to_bits(), want.kl_sum.to_bits(), "{who}");
                        assert_eq!(bits32(v), bits32(&v0), "{who}: values");
                        assert_eq!(bits32(g), bits32(&g0), "{who}: gradients");
                        // Nothing written outside the outputs.
                        assert!(vb[..at[3]].iter().all(|&x| x == 7.0), "{who}");
                        assert!(gb[at[4] + n..].iter().all(|&x| x == 7.0), "{who}");
                    }
                }
            }
        }
    }
}
