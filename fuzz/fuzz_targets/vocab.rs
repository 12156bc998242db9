//! Vocabulary row kernels from untrusted sizes and values: never panic, every `Ok` result is
//! finite, every `Err` leaves the outputs (or, in place, the logits) untouched, and every
//! single-row function agrees with its batched counterpart on the same row: the same bits, or
//! the same error. The forward that saves its row states gives the log-probabilities of the one
//! that does not, and the backward from those states the gradient of the one that recomputes
//! them; from altered states it may return anything but a panic (its documented precondition).
//! Likewise the KL forward that saves its pair states, and the backward (with a KL term) from
//! them. The JSD's gradient is checked for panics, finiteness and untouched outputs; the JSD
//! forward that saves its states gives the JSD's bits, and the gradient from them the bits of
//! the one that recomputes them (from altered states: no panic, nothing written on `Err`).
#![no_main]

use grpo_core::Result;
use grpo_core::vocab::{
    self, GradTerms, JsdState, KlDirection, KlTerm, Logit, LseState, PairState, SavedState,
    backward_rows, backward_rows_in_place, backward_rows_in_place_saved, backward_rows_saved,
    jsd_rows, kl_rows, kl_rows_saved, logprob_entropy_rows, logprob_entropy_rows_saved, stats_rows,
};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, arbitrary::Arbitrary)]
struct Input {
    vocab: u8,
    rows: u8,
    /// Logit values: raw bits, or (when the top bit of the selector is set) picks from a table
    /// of edge values, so that −∞, huge and tiny values are common.
    student: Vec<(u8, u32)>,
    teacher: Vec<(u8, u32)>,
    targets: Vec<u16>,
    temperature: u32,
    beta: u32,
    weights: Vec<u32>,
    bf16: bool,
    /// The saved states: how many (`states % 8` rows when below 6, else one per target, or per
    /// row for pair states), and whether one field of one of them is replaced by `poison`'s
    /// bits (bits 3–7: which).
    states: u8,
    poison: u32,
}

const EDGE: [f32; 12] = [
    f32::NEG_INFINITY,
    0.0,
    -0.0,
    1.0,
    -1.0,
    3.0e38,
    -3.0e38,
    1e-40,
    -88.0,
    20.0,
    -1e19,
    f32::NAN,
];

const DIRECTIONS: [KlDirection; 2] = [KlDirection::StudentTeacher, KlDirection::TeacherStudent];

/// What the outputs are filled with before each call. No function writes a NaN on `Ok`, and
/// the payload tells this one apart from any NaN a broken kernel might compute.
const SENTINEL: f32 = f32::from_bits(0x7fc0_5a5a);

fn value((sel, bits): (u8, u32)) -> f32 {
    if sel & 0x80 != 0 {
        EDGE[(sel as usize) % EDGE.len()]
    } else if sel & 0x40 != 0 {
        f32::from_bits(bits)
    } else {
        // moderate logits
        (bits as i32 as f32) * 1e-8
    }
}

fn all_finite(x: &[f32]) -> bool {
    x.iter().all(|v| v.is_finite())
}

fn fresh(len: usize) -> Vec<f32> {
    vec![SENTINEL; len]
}

fn untouched(x: &[f32]) -> bool {
    x.iter().all(|v| v.to_bits() == SENTINEL.to_bits())
}

/// The outcome contract of a batched call: every output finite on `Ok`, all still the
/// sentinel on `Err`.
fn check(res: Result<()>, outs: &[&[f32]]) -> bool {
    let ok = res.is_ok();
    for o in outs {
        assert!(
            if ok { all_finite(o) } else { untouched(o) },
            "{res:?}: {o:?}"
        );
    }
    ok
}

/// Exact bit patterns (any NaN included), for "untouched" checks on logits.
fn raw<S: Logit>(x: &[S]) -> Vec<u32> {
    x.iter().map(|v| v.to_f32().to_bits()).collect()
}

/// Asserts that a single-row result equals the batched function's on that row alone: `Ok`
/// with the same (finite) bits, or the same error with the batched outputs untouched.
fn agree<const N: usize>(single: Result<[f32; N]>, batched: Result<()>, outs: [f32; N]) {
    match (single, batched) {
        (Ok(a), Ok(())) => {
            assert!(all_finite(&a));
            assert_eq!(a.map(f32::to_bits), outs.map(f32::to_bits));
        }
        (Err(a), Err(b)) => {
            assert_eq!(a, b);
            assert!(untouched(&outs), "{outs:?}");
        }
        (a, b) => panic!("single row {a:?}, batched {b:?}"),
    }
}

/// Bit patterns of a result, so that results can be compared with `==` (and `Err`s by value).
fn bits<const N: usize>(r: Result<[f32; N]>) -> Result<[u32; N]> {
    r.map(|a| a.map(f32::to_bits))
}

/// The single-row results for one row, kept for the check against the whole batch.
struct Single {
    stats: Result<[f32; 2]>,
    logprob: Result<[f32; 2]>,
    kl: [Result<[f32; 1]>; 2],
    jsd: Result<[f32; 1]>,
}

/// Every single-row function on one student row `z`, teacher row `w` and target `y` (any
/// lengths), each against its batched function on that row alone, and the derived functions
/// (`log_sum_exp`, `entropy`, `token_logprob`) against the ones they derive from.
fn single_row<S: Logit>(z: &[S], w: &[S], y: u32, t: f32, beta: f32) -> Single {
    let v = z.len();
    let stats = vocab::row_stats(z, t).map(|s| [s.lse, s.entropy]);
    let (mut l, mut h) = ([SENTINEL], [SENTINEL]);
    agree(stats, stats_rows(z, v, t, &mut l, &mut h), [l[0], h[0]]);
    assert_eq!(
        bits(vocab::log_sum_exp(z, t).map(|x| [x])),
        bits(stats.map(|s| [s[0]]))
    );
    assert_eq!(
        bits(vocab::entropy(z, t).map(|x| [x])),
        bits(stats.map(|s| [s[1]]))
    );

    let logprob = vocab::logprob_entropy(z, y, t).map(|(lp, h)| [lp, h]);
    let (mut lp, mut h) = ([SENTINEL], [SENTINEL]);
    let batched = logprob_entropy_rows(z, v, &[y], t, &mut lp, Some(&mut h));
    agree(logprob, batched, [lp[0], h[0]]);
    let token = vocab::token_logprob(z, y, t).map(|x| [x]);
    assert_eq!(bits(token), bits(logprob.map(|r| [r[0]])));
    if let (Ok(s), Ok(r)) = (stats, logprob) {
        // One row state, one entropy.
        assert_eq!(s[1].to_bits(), r[1].to_bits());
        assert!(r[0] <= 1e-5);
    }

    let kl = DIRECTIONS.map(|dir| {
        let single = vocab::kl_divergence(z, w, t, dir).map(|x| [x]);
        let mut k = [SENTINEL];
        agree(single, kl_rows(z, w, v, t, dir, &mut k), k);
        single
    });
    let jsd = vocab::jsd(z, w, beta, t).map(|x| [x]);
    let mut j = [SENTINEL];
    agree(jsd, jsd_rows(z, w, v, beta, t, &mut j), j);
    Single {
        stats,
        logprob,
        kl,
        jsd,
    }
}

/// The backwards from saved states `(saved, poisoned, whether the saving forward succeeded)`,
/// with `reference` the recomputing backward's result and gradient for the same terms: from
/// the saved states its bits; from the poisoned ones (possibly equal to them) no panic, and
/// on `Err` nothing written.
fn from_saved<St: SavedState + PartialEq>(
    z: &[f32],
    vocab: usize,
    t: f32,
    (saved, poisoned, forward_ok): (&[St], &[St], bool),
    terms: &GradTerms<'_, u32>,
    reference: (Result<()>, &[f32]),
) {
    let mut g = fresh(z.len());
    let r = backward_rows_saved(z, vocab, t, saved, terms, &mut g);
    let checks = vocab::validate::backward_saved(z, vocab, t, saved, terms, Some(g.len()));
    assert_eq!(checks.err(), r.err());
    if forward_ok && reference.0.is_ok() {
        assert_eq!(r, Ok(()));
        assert_eq!(raw(&g), raw(reference.1));
    } else if r.is_err() {
        assert!(untouched(&g));
    }
    let mut g_bad = fresh(z.len());
    if backward_rows_saved(z, vocab, t, poisoned, terms, &mut g_bad).is_err() {
        assert!(untouched(&g_bad));
    }
    let mut zs = z.to_vec();
    match backward_rows_in_place_saved(&mut zs, vocab, t, poisoned, terms) {
        Ok(()) if poisoned == saved && r.is_ok() => assert_eq!(raw(&zs), raw(&g)),
        Ok(()) => {}
        Err(_) => assert_eq!(raw(&zs), raw(z)),
    }
}

/// Row `r` of a `[rows, vocab]` slice, clipped to what `x` holds (possibly short or empty).
fn row_of<T>(x: &[T], vocab: usize, r: usize) -> &[T] {
    let end = ((r + 1) * vocab).min(x.len());
    &x[(r * vocab).min(end)..end]
}

fuzz_target!(|inp: Input| {
    let vocab = inp.vocab as usize % 40;
    let rows = inp.rows as usize % 5;
    let n = rows * vocab;
    let z: Vec<f32> = inp.student.iter().map(|&p| value(p)).take(n + 1).collect();
    let w: Vec<f32> = inp.teacher.iter().map(|&p| value(p)).take(n + 1).collect();
    let temperature = if inp.temperature & 1 == 0 {
        1.0
    } else {
        f32::from_bits(inp.temperature)
    };
    let beta = f32::from_bits(inp.beta);
    let targets: Vec<u32> = inp
        .targets
        .iter()
        .map(|&t| t as u32 % 48)
        .take(rows)
        .collect();
    let weights: Vec<f32> = inp
        .weights
        .iter()
        .map(|&b| {
            if b & 1 == 0 {
                (b as f32) * 1e-9
            } else {
                f32::from_bits(b)
            }
        })
        .take(rows)
        .collect();

    // The single-row functions on each row of the student (a trailing partial row included;
    // one empty row when there is none), with the teacher's and the target of the same row.
    let single_rows = if vocab == 0 {
        1
    } else {
        z.len().div_ceil(vocab).max(1)
    };
    let target = |r: usize| targets.get(r).copied().unwrap_or(0);
    let singles: Vec<Single> = (0..single_rows)
        .map(|r| {
            let (zr, wr) = (row_of(&z, vocab, r), row_of(&w, vocab, r));
            if inp.bf16 {
                let to_bf16 = |x: &[f32]| -> Vec<half::bf16> {
                    x.iter().map(|&v| half::bf16::from_f32(v)).collect()
                };
                let (zb, wb) = (to_bf16(zr), to_bf16(wr));
                single_row(&zb, &wb, target(r), temperature, beta);
            }
            single_row(zr, wr, target(r), temperature, beta)
        })
        .collect();
    // When a batched call succeeds, `singles` holds its `rows` rows (the lengths matched).
    let same = |single: Result<[f32; 2]>, a: f32, b: f32| {
        assert_eq!(bits(single), Ok([a.to_bits(), b.to_bits()]));
    };

    let (mut lse, mut h) = (fresh(rows), fresh(rows));
    if check(
        stats_rows(&z, vocab, temperature, &mut lse, &mut h),
        &[&lse, &h],
    ) {
        for r in 0..rows {
            same(singles[r].stats, lse[r], h[r]);
        }
    }
    let (mut lp, mut h2) = (fresh(targets.len()), fresh(targets.len()));
    let res = logprob_entropy_rows(&z, vocab, &targets, temperature, &mut lp, Some(&mut h2));
    if check(res, &[&lp, &h2]) {
        assert!(lp.iter().all(|&x| x <= 1e-5));
        // `targets` may be shorter than `rows`: the batch then has `targets.len()` rows.
        for r in 0..lp.len() {
            same(singles[r].logprob, lp[r], h2[r]);
        }
    }
    // The saving forward: the same log-probabilities, and states for the backward below.
    let n_states = match inp.states % 8 {
        k @ 0..6 => usize::from(k),
        _ => targets.len(),
    };
    let mut saved = vec![LseState::EMPTY; n_states];
    let mut lp3 = fresh(targets.len());
    let res =
        logprob_entropy_rows_saved(&z, vocab, &targets, temperature, &mut lp3, None, &mut saved);
    if check(res, &[&lp3]) {
        assert_eq!(
            lp3.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            lp.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert!(saved.iter().all(|s| s.max.is_finite() && s.sum >= 0.5));
    } else {
        assert!(saved.iter().all(|s| *s == LseState::EMPTY));
    }
    for (d, dir) in DIRECTIONS.into_iter().enumerate() {
        let mut kl = fresh(rows);
        if check(kl_rows(&z, &w, vocab, temperature, dir, &mut kl), &[&kl]) {
            for r in 0..rows {
                assert_eq!(bits(singles[r].kl[d]), Ok([kl[r].to_bits()]));
            }
        }
    }
    let mut j = fresh(rows);
    let j_res = jsd_rows(&z, &w, vocab, beta, temperature, &mut j);
    // The saving JSD: the same result and bits, its states `EMPTY` on `Err`.
    let (mut js, mut jst) = (fresh(rows), vec![JsdState::EMPTY; rows]);
    let js_res = vocab::jsd_rows_saved(&z, &w, vocab, beta, temperature, &mut js, &mut jst);
    assert_eq!(js_res, j_res);
    assert_eq!(raw(&js), raw(&j));
    if check(j_res, &[&j]) {
        for r in 0..rows {
            assert_eq!(bits(singles[r].jsd), Ok([j[r].to_bits()]));
        }
        assert!(jst.iter().all(|s| s.beta == beta && s.kl_pm.is_finite()));
    } else {
        assert!(jst.iter().all(|s| *s == JsdState::EMPTY));
    }
    // The JSD's gradient: finite, or its error with the output untouched; it makes the JSD's
    // checks, so where it succeeds the JSD of its rows does too; in place the same values or
    // the same failure with the logits untouched. In bf16 storage as well.
    let mut jg = fresh(z.len());
    let jres = vocab::jsd_backward_rows(&z, &w, vocab, beta, temperature, &weights, &mut jg);
    // In place (`out` is as long as the logits here, so the checks are the same): the same
    // result, the gradient's bits over the logits (f32) or the logits untouched.
    let mut zi = z.clone();
    let ires = vocab::jsd_backward_rows_in_place(&mut zi, &w, vocab, beta, temperature, &weights);
    assert_eq!(ires, jres);
    assert_eq!(raw(&zi), raw(if ires.is_ok() { &jg } else { &z }));
    // From the saved states (`EMPTY` where the forward failed): where the forward and the
    // recomputing gradient succeed, the recomputing gradient's bits (out of place and in
    // place); otherwise finite or nothing written.
    let mut jgs = fresh(z.len());
    let sres = vocab::jsd_backward_rows_saved(&z, &w, vocab, temperature, &jst, &weights, &mut jgs);
    let mut zs = z.clone();
    let sires =
        vocab::jsd_backward_rows_in_place_saved(&mut zs, &w, vocab, temperature, &jst, &weights);
    assert_eq!(sires, sres);
    assert_eq!(raw(&zs), raw(if sires.is_ok() { &jgs } else { &z }));
    if check(jres, &[&jg]) {
        let mut jj = fresh(z.len() / vocab);
        assert!(jsd_rows(&z, &w, vocab, beta, temperature, &mut jj).is_ok());
        if js_res.is_ok() && jst.len() == z.len() / vocab {
            assert_eq!(sres, Ok(()));
            assert_eq!(raw(&jgs), raw(&jg));
        }
    }
    check(sres, &[&jgs]);
    // From altered states: no panic, nothing written on `Err`.
    let mut poisoned = jst.clone();
    let which = usize::from(inp.states >> 3);
    if let Some(st) = poisoned.get_mut(which / 6) {
        let x = f32::from_bits(inp.poison);
        let fields = [
            &mut st.student.max,
            &mut st.student.neg_ln_sum,
            &mut st.teacher.max,
            &mut st.teacher.neg_ln_sum,
            &mut st.beta,
            &mut st.kl_pm,
        ];
        *fields.into_iter().nth(which % 6).unwrap() = x;
    }
    let mut g_bad = fresh(z.len());
    let t = temperature;
    if vocab::jsd_backward_rows_saved(&z, &w, vocab, t, &poisoned, &weights, &mut g_bad).is_err() {
        assert!(untouched(&g_bad));
    }
    if inp.bf16 {
        let (zb, wb) = (
            z.iter()
                .map(|&v| half::bf16::from_f32(v))
                .collect::<Vec<_>>(),
            w.iter()
                .map(|&v| half::bf16::from_f32(v))
                .collect::<Vec<_>>(),
        );
        let mut jb = fresh(z.len());
        let jres = vocab::jsd_backward_rows(&zb, &wb, vocab, beta, temperature, &weights, &mut jb);
        check(jres, &[&jb]);
    }

    let terms = GradTerms {
        logp: Some((&targets[..], &weights[..])),
        entropy: Some(&weights[..]),
        kl: Some(KlTerm {
            teacher: &w[..],
            grad: &weights[..],
            direction: if inp.bf16 {
                KlDirection::StudentTeacher
            } else {
                KlDirection::TeacherStudent
            },
        }),
    };
    let mut g = fresh(z.len());
    let r_full = backward_rows(&z, vocab, temperature, &terms, &mut g);
    check(r_full, &[&g]);
    // The public checks other backends run instead (grpo-wgpu): the backward's own result, and
    // those that read no logit fail only where it fails.
    let out = Some(g.len());
    assert_eq!(
        vocab::validate::backward(&z, vocab, temperature, &terms, out).err(),
        r_full.err()
    );
    if vocab::validate::backward_args(z.len(), vocab, temperature, &terms, out).is_err() {
        assert!(r_full.is_err());
    }

    // The backward from the saved states (log-probability and entropy terms): from states the
    // forward saved, the recomputing backward's bits; from altered ones, no panic, and on `Err`
    // nothing written.
    let lse_terms: GradTerms<'_, u32> = GradTerms {
        logp: terms.logp,
        entropy: terms.entropy,
        kl: None,
    };
    let mut poisoned = saved.clone();
    let which = usize::from(inp.states >> 3);
    if let Some(st) = poisoned.get_mut(which / 3) {
        let x = f32::from_bits(inp.poison);
        *[&mut st.max, &mut st.sum, &mut st.dot][which % 3] = x;
    }
    let mut g_ref = fresh(z.len());
    let r_ref = backward_rows(&z, vocab, temperature, &lse_terms, &mut g_ref);
    let from = (&saved[..], &poisoned[..], res.is_ok());
    from_saved(&z, vocab, temperature, from, &lse_terms, (r_ref, &g_ref));

    // The KL forward that saves its pair states (those of the KL term's direction), and the
    // backward with every term from them: as above.
    let kl_dir = terms
        .kl
        .map(|k| k.direction)
        .unwrap_or(KlDirection::StudentTeacher);
    let n_pairs = match inp.states % 8 {
        k @ 0..6 => usize::from(k),
        _ => rows,
    };
    let mut pairs = vec![PairState::EMPTY; n_pairs];
    let (mut kl, mut kl_ref) = (fresh(rows), fresh(rows));
    let res_kl = kl_rows_saved(&z, &w, vocab, temperature, kl_dir, &mut kl, &mut pairs);
    if check(res_kl, &[&kl]) {
        assert_eq!(
            kl_rows(&z, &w, vocab, temperature, kl_dir, &mut kl_ref),
            Ok(())
        );
        assert_eq!(raw(&kl), raw(&kl_ref));
        assert!(pairs.iter().all(|s| s.sz >= 0.5 && s.sw >= 0.5));
    } else {
        assert!(pairs.iter().all(|s| *s == PairState::EMPTY));
    }
    let mut poisoned_pairs = pairs.clone();
    if let Some(st) = poisoned_pairs.get_mut(which / 8) {
        let x = f32::from_bits(inp.poison);
        let fields = [
            &mut st.zmax,
            &mut st.sz,
            &mut st.tz,
            &mut st.wmax,
            &mut st.sw,
            &mut st.tw,
            &mut st.u,
            &mut st.v,
        ];
        *fields.into_iter().nth(which % 8).unwrap() = x;
    }
    let from = (&pairs[..], &poisoned_pairs[..], res_kl.is_ok());
    from_saved(&z, vocab, temperature, from, &terms, (r_full, &g));

    // A KL(p‖q) term from the KL(q‖p) direction's states, which record an infinite KL(p‖q) as
    // u = +∞: accepted only where the recomputing backward accepts it, and then with its
    // bits; refused with the gradient untouched.
    if terms
        .kl
        .is_some_and(|k| k.direction == KlDirection::StudentTeacher)
    {
        let mut qp = vec![PairState::EMPTY; rows];
        let mut o = fresh(rows);
        let qp_dir = KlDirection::TeacherStudent;
        if kl_rows_saved(&z, &w, vocab, temperature, qp_dir, &mut o, &mut qp).is_ok() {
            let mut gq = fresh(z.len());
            match backward_rows_saved(&z, vocab, temperature, &qp, &terms, &mut gq) {
                Ok(()) => {
                    assert!(
                        r_full.is_ok(),
                        "KL(q‖p) states served a refused KL(p‖q) term"
                    );
                    assert_eq!(raw(&gq), raw(&g));
                }
                Err(_) => assert_eq!(raw(&gq), raw(&fresh(z.len()))),
            }
        }
    }

    if inp.bf16 {
        let mut zb: Vec<half::bf16> = z.iter().map(|&x| half::bf16::from_f32(x)).collect();
        let before = raw(&zb);
        if backward_rows_in_place(&mut zb, vocab, temperature, &terms).is_ok() {
            assert!(zb.iter().all(|v| v.to_f32().is_finite()));
        } else {
            assert_eq!(raw(&zb), before);
        }
    } else {
        let mut zz = z.clone();
        match backward_rows_in_place(&mut zz, vocab, temperature, &terms) {
            Ok(()) => assert_eq!(zz, g),
            Err(_) => assert_eq!(raw(&zz), raw(&z)),
        }
    }
});
