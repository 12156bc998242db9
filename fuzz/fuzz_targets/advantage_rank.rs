//! Whitening (in place too), ranks, the normal quantile, REINFORCE++ (returns, baseline), GAE,
//! ReMax, GOPO, G²RPO, group filters and overlong shaping on untrusted sizes, values and
//! parameters: never panic; Ok ⇒ every output finite; Err ⇒ outputs untouched.
#![no_main]

use grpo_core::advantage::baseline::{BaselineConfig, reinforce_pp_baseline};
use grpo_core::advantage::filter::{
    DynamicSamplingConfig, RangeFilterConfig, dynamic_sampling_keep, dynamic_sampling_keep_correct,
    range_filter_keep,
};
use grpo_core::advantage::gae::{GaeConfig, gae};
use grpo_core::advantage::overlong::{OverlongConfig, overlong_penalty};
use grpo_core::advantage::rank::{G2rpoConfig, GopoConfig, g2rpo, gopo};
use grpo_core::advantage::returns::{MaskedTokens, ReturnsConfig, reinforce_pp_returns, remax};
use grpo_core::advantage::whiten::{
    EpsPlacement, WhitenConfig, apply_whitening, apply_whitening_in_place, whiten, whiten_moments,
};
use grpo_core::advantage::{NanPolicy, SingletonRule};
use grpo_core::layout::{Groups, Tokens};
use grpo_core::stats::{Bessel, RankOrder, TiePolicy, norm_quantile, ranks};
use grpo_core::{Preset, Real};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, arbitrary::Arbitrary)]
struct Input {
    values: Vec<f64>,
    values2: Vec<f64>,
    scores: Vec<f64>,
    mask: Vec<bool>,
    use_mask: bool,
    packed: bool,
    offsets: Vec<u8>,
    rows: u8,
    cols: u8,
    group_size: u8,
    group_offsets: Vec<u8>,
    use_offsets: bool,
    ids: Vec<u8>,
    num_groups: u8,
    gamma: f64,
    lambda: f64,
    eps: f64,
    preset: u8,
    flags: u8,
    clip: (f64, f64),
    scratch: u8,
    lengths: Vec<u16>,
    max_len: u16,
    cache_len: u16,
    factor: f64,
    f32_mode: bool,
}

fn preset(p: u8) -> Preset {
    match p % 5 {
        0 => Preset::Paper,
        1 => Preset::Verl,
        2 => Preset::VerlVectorized,
        3 => Preset::Trl,
        _ => Preset::OpenRlhf,
    }
}

fn masked(f: u8) -> MaskedTokens {
    match f % 3 {
        0 => MaskedTokens::Reset,
        1 => MaskedTokens::Skip,
        _ => MaskedTokens::ZeroFill,
    }
}

fn all_finite<T: Real>(xs: &[T]) -> bool {
    xs.iter().all(|x| x.is_finite())
}

const SENTINEL: f64 = 4242.0;

fn untouched<T: Real>(xs: &[T]) -> bool {
    xs.iter().all(|&x| x == T::from_f64(SENTINEL))
}

fn run<T: Real>(inp: &Input) {
    let conv = |v: &[f64]| v.iter().map(|&x| T::from_f64(x)).collect::<Vec<T>>();
    let values = conv(&inp.values);
    let n = values.len();
    let values2: Vec<T> = (0..n)
        .map(|i| T::from_f64(inp.values2.get(i).copied().unwrap_or(0.5)))
        .collect();
    let scores = conv(&inp.scores);
    let offsets: Vec<usize> = inp.offsets.iter().map(|&o| o as usize).collect();
    let mask = inp.use_mask.then_some(&inp.mask[..]);
    let tokens = if inp.packed {
        Tokens::packed(&offsets, mask)
    } else {
        Tokens::padded(inp.rows as usize, inp.cols as usize, mask)
    };
    let p = preset(inp.preset);
    let mut wcfg = WhitenConfig::<T>::from_preset(p);
    if inp.flags & 1 != 0 {
        wcfg = WhitenConfig {
            bessel: if inp.flags & 2 != 0 {
                Bessel::Population
            } else {
                Bessel::Unbiased
            },
            eps: T::from_f64(inp.eps),
            eps_placement: if inp.flags & 4 != 0 {
                EpsPlacement::Floor
            } else {
                EpsPlacement::Add
            },
            shift_mean: inp.flags & 8 != 0,
        };
    }
    let whiten_opt = (inp.flags & 16 == 0).then_some(wcfg);

    // Whitening.
    let mut out = vec![T::from_f64(SENTINEL); n];
    match whiten(&values, &tokens, &wcfg, &mut out) {
        Ok(_) => assert!(all_finite(&out)),
        Err(_) => assert!(untouched(&out)),
    }
    if let Ok(m) = whiten_moments(&values, &tokens) {
        let mut out = vec![T::from_f64(SENTINEL); n];
        let applied = apply_whitening(&values, &tokens, &m, &wcfg, &mut out);
        match applied {
            Ok(()) => assert!(all_finite(&out)),
            Err(_) => assert!(untouched(&out)),
        }
        // In place: the same result and the same error, the values untouched on Err.
        let mut over = values.clone();
        let in_place = apply_whitening_in_place(&mut over, &tokens, &m, &wcfg);
        assert_eq!(in_place, applied);
        let bits = |v: &[T]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>();
        match in_place {
            Ok(()) => assert_eq!(bits(&over), bits(&out)),
            Err(_) => assert_eq!(bits(&over), bits(&values)),
        }
    }

    // Ranks of the scores (scratch of a fuzzed size): Ok ⇒ 1-based ranks summing to
    // n(n + 1)/2; Err ⇒ `out` untouched.
    let ties = if inp.flags & 1 != 0 {
        TiePolicy::Ordinal
    } else {
        TiePolicy::Average
    };
    let order = if inp.flags & 2 != 0 {
        RankOrder::Descending
    } else {
        RankOrder::Ascending
    };
    let m = scores.len();
    let mut scratch = vec![0usize; (inp.scratch as usize).min(m + 1)];
    if inp.flags & 4 != 0 {
        scratch.resize(m, 0);
    }
    let mut rk = vec![T::from_f64(SENTINEL); m];
    match ranks(&scores, ties, order, &mut scratch, &mut rk) {
        Ok(()) => {
            let top = T::from_usize(m);
            assert!(rk.iter().all(|&r| r >= T::ONE && r <= top), "{rk:?}");
            let sum: f64 = rk.iter().map(|r| r.to_f64()).sum();
            let want = (m * (m + 1) / 2) as f64;
            assert!((sum - want).abs() <= 1e-6 * want.max(1.0), "{sum} {want}");
        }
        Err(_) => assert!(untouched(&rk)),
    }

    // The normal quantile: Ok ⇔ 0 < u < 1, finite, with u − ½'s sign.
    for &u in &scores {
        match norm_quantile(u) {
            Ok(q) => {
                assert!(u > T::ZERO && u < T::ONE && q.is_finite(), "{u:?} {q:?}");
                assert!(
                    (u < T::HALF && q <= T::ZERO) || (u > T::HALF && q >= T::ZERO) || u == T::HALF
                );
            }
            Err(_) => assert!(!(u > T::ZERO && u < T::ONE)),
        }
    }

    // REINFORCE++ returns and GAE.
    let rcfg = ReturnsConfig {
        gamma: T::from_f64(inp.gamma),
        masked: masked(inp.flags >> 5),
        whiten: whiten_opt,
    };
    let (mut a, mut g) = (
        vec![T::from_f64(SENTINEL); n],
        vec![T::from_f64(SENTINEL); n],
    );
    match reinforce_pp_returns(&values, &tokens, &rcfg, &mut a, &mut g) {
        Ok(_) => assert!(all_finite(&a) && all_finite(&g)),
        Err(_) => assert!(untouched(&a) && untouched(&g)),
    }
    let gcfg = GaeConfig {
        gamma: T::from_f64(inp.gamma),
        lambda: T::from_f64(inp.lambda),
        masked: masked(inp.flags >> 5),
        whiten: whiten_opt,
    };
    let (mut a, mut g) = (
        vec![T::from_f64(SENTINEL); n],
        vec![T::from_f64(SENTINEL); n],
    );
    match gae(&values, &values2, &tokens, &gcfg, &mut a, &mut g) {
        Ok(_) => assert!(all_finite(&a) && all_finite(&g)),
        Err(_) => assert!(untouched(&a) && untouched(&g)),
    }
    let (mut a, mut g) = (
        vec![T::from_f64(SENTINEL); n],
        vec![T::from_f64(SENTINEL); n],
    );
    match remax(&values, &tokens, &scores, &mut a, &mut g) {
        Ok(_) => assert!(all_finite(&a) && all_finite(&g)),
        Err(_) => assert!(untouched(&a) && untouched(&g)),
    }

    // Groups over the scores.
    let group_offsets: Vec<usize> = inp.group_offsets.iter().map(|&o| o as usize).collect();
    let ids: Vec<usize> = (0..scores.len())
        .map(|i| inp.ids.get(i).copied().unwrap_or(0) as usize)
        .collect();
    let mut gscratch =
        vec![0usize; Groups::group_ids_scratch_len(ids.len(), inp.num_groups as usize)];
    let permuted = Groups::from_group_ids(&ids, inp.num_groups as usize, &mut gscratch).ok();
    let groups = match (inp.flags % 3, permuted) {
        (0, Some(p)) => p,
        _ if inp.use_offsets => Groups::Offsets(&group_offsets),
        _ => Groups::Uniform(inp.group_size as usize),
    };
    let nan = if inp.flags & 64 != 0 {
        NanPolicy::Exclude
    } else {
        NanPolicy::Reject
    };

    let mut bcfg = BaselineConfig::<T>::from_preset(p);
    bcfg.nan = nan;
    bcfg.whiten = whiten_opt;
    bcfg.singleton = match inp.preset / 5 % 3 {
        0 => SingletonRule::Zero,
        1 => SingletonRule::VerlLoop,
        _ => SingletonRule::Reject,
    };
    if inp.flags & 128 != 0 {
        bcfg.reward_clip = Some((T::from_f64(inp.clip.0), T::from_f64(inp.clip.1)));
    }
    let mut out = vec![T::from_f64(SENTINEL); n];
    match reinforce_pp_baseline(&scores, groups, &tokens, &bcfg, &mut out) {
        Ok(_) => assert!(all_finite(&out)),
        Err(_) => assert!(untouched(&out)),
    }

    let ties = if inp.flags & 1 != 0 {
        TiePolicy::Average
    } else {
        TiePolicy::Ordinal
    };
    let mut scratch = vec![0usize; inp.scratch as usize];
    let mut out = vec![T::from_f64(SENTINEL); scores.len()];
    match gopo(
        &scores,
        groups,
        &GopoConfig { ties, nan },
        &mut scratch,
        &mut out,
    ) {
        Ok(_) => assert!(all_finite(&out) && out.iter().all(|a| a.abs() <= T::TWO)),
        Err(_) => assert!(untouched(&out)),
    }
    let mut out = vec![T::from_f64(SENTINEL); scores.len()];
    match g2rpo(
        &scores,
        groups,
        &G2rpoConfig { nan },
        &mut scratch,
        &mut out,
    ) {
        Ok(_) => assert!(all_finite(&out)),
        Err(_) => assert!(untouched(&out)),
    }

    let k = groups.len(scores.len());
    let correct: Vec<bool> = scores.iter().map(|s| *s > T::HALF).collect();
    let mut keep = vec![true; k];
    let ds = DynamicSamplingConfig {
        keep_singletons: inp.flags & 2 != 0,
    };
    let _ = dynamic_sampling_keep_correct(&correct, groups, &ds, &mut keep);
    let _ = dynamic_sampling_keep(&scores, groups, &ds, &mut keep);
    let rf = RangeFilterConfig {
        lo: T::from_f64(inp.clip.0),
        hi: T::from_f64(inp.clip.1),
    };
    let _ = range_filter_keep(&scores, groups, &rf, &mut keep);

    let lengths: Vec<usize> = inp.lengths.iter().map(|&l| l as usize).collect();
    let ocfg = OverlongConfig {
        max_len: inp.max_len as usize,
        cache_len: inp.cache_len as usize,
        factor: T::from_f64(inp.factor),
    };
    let mut out = vec![T::from_f64(SENTINEL); lengths.len()];
    match overlong_penalty(&lengths, &ocfg, &mut out) {
        Ok(()) => assert!(all_finite(&out)),
        Err(_) => assert!(untouched(&out)),
    }
}

fuzz_target!(|inp: Input| {
    if inp.f32_mode {
        run::<f32>(&inp);
    } else {
        run::<f64>(&inp);
    }
});
