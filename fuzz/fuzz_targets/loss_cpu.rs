//! grpo-cpu's multi-threaded PPO-clip against grpo-core's on untrusted sizes, layouts, parameters
//! and values: never panic, the same `Ok`/`Err` (the same error value), and on `Ok` the same
//! bits and diagnostics — for the `f32` SIMD kernel on the detected backend and for the
//! per-block path with small blocks. The fuzzer also places each of the five arrays at its
//! choice of distance from a 64-byte boundary (the SIMD write pass chunks differently when
//! all five lie equally far from one).
#![no_main]

use grpo_core::Tokens;
use grpo_core::divergence::RatioBounds;
use grpo_core::loss::{PolicyInputs, PpoClipConfig, ppo_clip};
use grpo_cpu::{Backend, Cpu};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

#[derive(Debug, arbitrary::Arbitrary)]
struct Input {
    rows: u8,
    cols: u8,
    packed: bool,
    cu: Vec<u8>,
    mask: Vec<bool>,
    lp: Vec<f32>,
    old: Vec<f32>,
    adv: Vec<f32>,
    lo: f32,
    hi: f32,
    dual: Option<f32>,
    clamp: Option<f32>,
    cap: Option<f32>,
    block: u8,
    /// Distance of `lp`, `old`, `adv`, values and gradients from a 64-byte boundary, in floats
    /// (mod 16).
    place: [u8; 5],
}

/// A buffer holding `v` from its first index whose address lies `4·(q mod 16)` bytes past a
/// 64-byte boundary, and that index.
fn placed(v: &[f32], q: u8) -> (Vec<f32>, usize) {
    let mut buf = vec![7.0f32; v.len() + 16];
    let q = q as usize % 16;
    let at = (0..16)
        .find(|&i| (buf.as_ptr() as usize + 4 * i) % 64 == 4 * q)
        .expect("an f32 buffer is 4-byte aligned");
    buf[at..at + v.len()].copy_from_slice(v);
    (buf, at)
}

/// The detected (fastest) backend: `Cpu::ppo_clip` runs the SIMD kernel for `f32`.
fn simd() -> &'static Cpu {
    static CPU: OnceLock<Cpu> = OnceLock::new();
    CPU.get_or_init(|| Cpu::detect().with_threads(2).expect("a 2-thread pool"))
}

fn cpu() -> &'static Cpu {
    static CPU: OnceLock<Cpu> = OnceLock::new();
    CPU.get_or_init(|| {
        Cpu::new(Backend::Portable)
            .expect("portable")
            .with_threads(2)
            .expect("a 2-thread pool")
    })
}

fuzz_target!(|inp: Input| {
    let (rows, cols) = (inp.rows as usize % 8, inp.cols as usize % 64);
    let n = rows * cols;
    let fit =
        |v: &[f32]| -> Vec<f32> { (0..n).map(|i| v.get(i).copied().unwrap_or(0.5)).collect() };
    let (lb, la) = placed(&fit(&inp.lp), inp.place[0]);
    let (ob, oa) = placed(&fit(&inp.old), inp.place[1]);
    let (ab, aa) = placed(&fit(&inp.adv), inp.place[2]);
    let (lp, old, adv) = (&lb[la..la + n], &ob[oa..oa + n], &ab[aa..aa + n]);
    let mask = (!inp.mask.is_empty()).then(|| {
        (0..n)
            .map(|i| inp.mask[i % inp.mask.len()])
            .collect::<Vec<_>>()
    });
    let cu: Vec<usize> = inp.cu.iter().map(|&c| c as usize).collect();
    let tokens = if inp.packed {
        Tokens::packed(&cu, mask.as_deref())
    } else {
        Tokens::padded(rows, cols, mask.as_deref())
    };
    let cfg = PpoClipConfig {
        bounds: RatioBounds {
            lo: inp.lo,
            hi: inp.hi,
        },
        dual_clip: inp.dual,
        delta_cap: inp.cap,
        log_ratio_clamp: inp.clamp,
    };
    let pi = PolicyInputs {
        lp,
        old,
        adv,
        tokens,
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let (mut v1, mut g1) = (vec![7.0f32; n], vec![7.0f32; n]);
    let core = ppo_clip(&cfg, &pi, &mut v1, &mut g1);
    let (mut v2, mut g2) = (vec![7.0f32; n], vec![7.0f32; n]);
    let blocks = cpu().ppo_clip_blocks(&cfg, &pi, &mut v2, &mut g2, 1 + inp.block as usize % 16);
    let (mut vb, va) = placed(&vec![7.0f32; n], inp.place[3]);
    let (mut gb, ga) = placed(&vec![7.0f32; n], inp.place[4]);
    let simd_out = simd().ppo_clip(&cfg, &pi, &mut vb[va..va + n], &mut gb[ga..ga + n]);
    let (v3, g3) = (vb[va..va + n].to_vec(), gb[ga..ga + n].to_vec());
    for (name, fast, v, g) in [("blocks", &blocks, &v2, &g2), ("simd", &simd_out, &v3, &g3)] {
        assert_eq!(core.is_ok(), fast.is_ok(), "{name}: {core:?} vs {fast:?}");
        if let (Err(a), Err(b)) = (&core, fast) {
            assert_eq!(a, b, "{name}");
        }
        assert_eq!(bits(&v1), bits(v), "{name}: values");
        assert_eq!(bits(&g1), bits(g), "{name}: gradients");
    }
    // Nothing written around the SIMD path's outputs.
    assert!(vb[..va].iter().chain(&vb[va + n..]).all(|&x| x == 7.0));
    assert!(gb[..ga].iter().chain(&gb[ga + n..]).all(|&x| x == 7.0));
    // The SIMD path also reproduces every diagnostic (kl_sum bit for bit, or both NaN: a sum
    // of finite log-ratios may overflow to ±∞ and then meet the other infinity).
    if let (Ok(a), Ok(b)) = (&core, &simd_out) {
        let (mut a0, mut b0) = (*a, *b);
        (a0.kl_sum, b0.kl_sum) = (0.0, 0.0);
        assert_eq!(a0, b0);
        let same = a.kl_sum.to_bits() == b.kl_sum.to_bits();
        assert!(
            same || (a.kl_sum.is_nan() && b.kl_sum.is_nan()),
            "{a:?} vs {b:?}"
        );
    }
});
