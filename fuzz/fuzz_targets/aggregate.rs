//! Aggregation and gradient scaling on untrusted layouts, modes and values: never panic; an
//! `Ok` scalar and the weights are finite, an `Err` leaves the weights untouched; scaled
//! gradients are finite or refused with the gradients untouched; `sequence_weights` agrees
//! with the per-token weights or leaves its output untouched.
#![no_main]

use grpo_core::aggregate::{
    AggConfig, AggMode, Denominator, SeqCount, aggregate, scale_gradients, sequence_weights,
};
use grpo_core::loss::LossLevel;
use grpo_core::{Error, Tokens};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, arbitrary::Arbitrary)]
struct Input {
    rows: u8,
    cols: u8,
    packed: bool,
    cu: Vec<u8>,
    mask: Vec<bool>,
    values: Vec<f64>,
    mode: u8,
    denom: u8,
    eps: f64,
    global: u16,
    procs: u8,
    max_len: Option<u16>,
    div: bool,
    level: bool,
}

fuzz_target!(|inp: Input| {
    let n = (inp.rows as usize % 8) * (inp.cols as usize % 16);
    let values: Vec<f64> = (0..n)
        .map(|i| inp.values.get(i).copied().unwrap_or(1.0))
        .collect();
    let mask = (!inp.mask.is_empty()).then(|| {
        (0..n)
            .map(|i| inp.mask[i % inp.mask.len()])
            .collect::<Vec<_>>()
    });
    let cu: Vec<usize> = inp.cu.iter().map(|&c| c as usize).collect();
    let tokens = if inp.packed {
        Tokens::packed(&cu, mask.as_deref())
    } else {
        Tokens::padded(
            inp.rows as usize % 8,
            inp.cols as usize % 16,
            mask.as_deref(),
        )
    };
    let mode = match inp.mode % 9 {
        0 => AggMode::TokenMean {
            global_tokens: None,
        },
        1 => AggMode::TokenMean {
            global_tokens: Some(inp.global as usize),
        },
        2 => AggMode::SeqMeanTokenMean,
        3 => AggMode::SeqMeanTokenSum,
        4 => AggMode::SeqMeanTokenSumNorm {
            max_len: inp.max_len.map(usize::from),
            divide_by_batch: inp.div,
        },
        5 => AggMode::Bnpo,
        6 => AggMode::Dapo {
            global_tokens: inp.global as usize,
            processes: inp.procs as usize,
        },
        _ => AggMode::Luspo,
    };
    let denominator = match inp.denom % 3 {
        0 => Denominator::Strict,
        1 => Denominator::ClampOne,
        _ => Denominator::PlusEps(inp.eps),
    };
    let sequences = if (inp.denom / 3) % 2 == 0 {
        SeqCount::All
    } else {
        SeqCount::NonEmpty
    };
    let cfg = AggConfig {
        mode,
        denominator,
        sequences,
    };
    let mut w = vec![7.0f64; n];
    let agg = aggregate(&cfg, tokens, &values, &mut w);
    if agg.is_err() {
        assert!(w.iter().all(|&x| x == 7.0));
    }
    if let Ok(loss) = agg {
        assert!(loss.is_finite());
        assert!(w.iter().all(|x| x.is_finite()));
        let level = if inp.level {
            LossLevel::Sequence
        } else {
            LossLevel::Token
        };
        // Unit gradients: the result is finite, or (finite weights whose sequence mass
        // overflows) refused with the gradients untouched.
        let mut g = vec![1.0f64; n];
        match scale_gradients(tokens, &w, level, &mut g) {
            Ok(()) => assert!(g.iter().all(|x| x.is_finite())),
            Err(e) => {
                assert!(matches!(
                    e,
                    Error::NonFinite {
                        what: "scaled gradient",
                        ..
                    }
                ));
                assert!(g.iter().all(|&x| x == 1.0));
            }
        }
    }
    // The per-sequence weights agree with the per-token ones wherever aggregate succeeds, and
    // an Err leaves them untouched.
    let b = tokens.num_sequences();
    let mut ws = vec![7.0f64; b];
    match sequence_weights(&cfg, tokens, n, &mut ws) {
        Ok(()) => {
            if aggregate(&cfg, tokens, &values, &mut w).is_ok() {
                for i in 0..b {
                    for t in tokens.valid_positions(i) {
                        assert_eq!(w[t].to_bits(), ws[i].to_bits());
                    }
                }
            }
        }
        Err(_) => assert!(ws.iter().all(|&x| x == 7.0)),
    }
});
