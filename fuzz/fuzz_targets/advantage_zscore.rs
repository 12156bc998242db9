//! The z-score family of advantage estimators on untrusted sizes, layouts, values and
//! parameters: never panic, and every `Ok` result is finite.
#![no_main]

use grpo_core::advantage::gpg::{GpgConfig, gpg};
use grpo_core::advantage::multi_reward::{DvaoConfig, GdpoConfig, dvao, gdpo, reward_combination};
use grpo_core::advantage::opo::{OpoConfig, opo};
use grpo_core::advantage::passk::{PassKConfig, pass_at_k};
use grpo_core::advantage::rloo::{RlooConfig, rloo};
use grpo_core::advantage::zscore::{Scale, ZScoreConfig, zscore};
use grpo_core::advantage::{NanPolicy, SingletonRule};
use grpo_core::stats::Bessel;
use grpo_core::{Groups, Preset};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, arbitrary::Arbitrary)]
struct Input {
    scores: Vec<f64>,
    lengths: Vec<u16>,
    layout: u8,
    group_size: u8,
    offsets: Vec<u8>,
    ids: Vec<u8>,
    num_groups: u8,
    num_rewards: u8,
    weights: Vec<f64>,
    eps: f64,
    gamma: f64,
    floor: Option<f64>,
    f_norm: f64,
    out_len: u8,
    scratch_len: u8,
    flags: u8,
    f32_too: bool,
}

const PRESETS: [Preset; 5] = [
    Preset::Paper,
    Preset::Verl,
    Preset::VerlVectorized,
    Preset::Trl,
    Preset::OpenRlhf,
];

fn finite<T: grpo_core::Real>(out: &[T]) {
    assert!(
        out.iter().all(|x| x.is_finite()),
        "Ok with a non-finite advantage"
    );
}

fuzz_target!(|inp: Input| {
    let scores = &inp.scores[..inp.scores.len().min(256)];
    // Usually the output matches the scores; sometimes not (length errors must not panic).
    let n = if inp.flags & 0x80 != 0 {
        inp.out_len as usize
    } else {
        scores.len()
    };
    let offsets: Vec<usize> = inp.offsets.iter().map(|&o| o as usize).collect();
    let ids: Vec<usize> = inp.ids.iter().map(|&i| i as usize).collect();
    let mut id_scratch =
        vec![0usize; Groups::group_ids_scratch_len(ids.len(), inp.num_groups as usize)];
    let groups = match inp.layout % 3 {
        0 => Groups::Uniform(inp.group_size as usize),
        1 => Groups::Offsets(&offsets),
        _ => match Groups::from_group_ids(&ids, inp.num_groups as usize, &mut id_scratch) {
            Ok(g) => g,
            Err(_) => return,
        },
    };
    let preset = PRESETS[(inp.flags % 5) as usize];
    let scale = [Scale::Group, Scale::Batch, Scale::None][(inp.flags as usize / 5) % 3];
    let singleton = [
        SingletonRule::Zero,
        SingletonRule::VerlLoop,
        SingletonRule::Reject,
    ][(inp.flags as usize / 15) % 3];
    let nan = if inp.flags & 0x40 != 0 {
        NanPolicy::Exclude
    } else {
        NanPolicy::Reject
    };
    let bessel = if inp.flags & 0x20 != 0 {
        Bessel::Population
    } else {
        Bessel::Unbiased
    };

    let zcfg = ZScoreConfig {
        eps: inp.eps,
        gamma: inp.gamma,
        var_floor: inp.floor,
        scale,
        singleton,
        nan,
        bessel,
    };
    let mut out = vec![0.0f64; n];
    for cfg in [zcfg, ZScoreConfig::from_preset(preset).with_scale(scale)] {
        if zscore(scores, groups, &cfg, &mut out).is_ok() {
            finite(&out);
        }
    }
    if inp.f32_too {
        let s32: Vec<f32> = scores.iter().map(|&x| x as f32).collect();
        let mut o32 = vec![0.0f32; n];
        if zscore(&s32, groups, &zcfg, &mut o32).is_ok() {
            finite(&o32);
        }
        if rloo(&s32, groups, &RlooConfig { singleton, nan }, &mut o32).is_ok() {
            finite(&o32);
        }
    }
    if rloo(scores, groups, &RlooConfig { singleton, nan }, &mut out).is_ok() {
        finite(&out);
    }
    let pcfg = PassKConfig {
        normalize: inp.flags & 1 != 0,
        eps: inp.eps,
        bessel,
        nan,
    };
    if pass_at_k(scores, groups, &pcfg, &mut out).is_ok() {
        finite(&out);
    }
    let lengths: Vec<usize> = inp.lengths.iter().map(|&l| l as usize).collect();
    if opo(
        scores,
        &lengths,
        groups,
        &OpoConfig { singleton, nan },
        &mut out,
    )
    .is_ok()
    {
        finite(&out);
    }
    let gcfg = GpgConfig {
        f_norm: inp.f_norm,
        singleton,
        nan,
    };
    if gpg(scores, groups, &gcfg, &mut out).is_ok() {
        finite(&out);
    }

    // Multi-reward: scores as a [n, K] matrix.
    let k = inp.num_rewards as usize % 5;
    let mut scratch = vec![0.0f64; inp.scratch_len as usize % 12];
    let m = if k == 0 { n } else { scores.len() / k };
    let mut out = vec![0.0f64; if inp.flags & 0x80 != 0 { n } else { m }];
    let dcfg = GdpoConfig {
        reward_eps: inp.eps,
        batch_eps: inp.eps.abs(),
        bessel,
        singleton,
        nan,
    };
    if gdpo(
        scores,
        k,
        &inp.weights,
        groups,
        &dcfg,
        &mut scratch,
        &mut out,
    )
    .is_ok()
    {
        finite(&out);
    }
    if reward_combination(scores, k, &inp.weights, groups, &zcfg, &mut out).is_ok() {
        finite(&out);
    }
    let vcfg = DvaoConfig {
        eps: inp.eps,
        bessel,
        singleton,
        nan,
    };
    if dvao(scores, k, groups, &vcfg, &mut scratch, &mut out).is_ok() {
        finite(&out);
    }
});
