//! Group and token layouts from untrusted sizes: never panic.
#![no_main]

use grpo_core::layout::{Groups, Tokens};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, arbitrary::Arbitrary)]
struct Input {
    n: u8,
    group_size: u8,
    offsets: Vec<u8>,
    ids: Vec<u8>,
    num_groups: u8,
    scratch: u8,
    rows: u8,
    cols: u8,
    mask: Vec<bool>,
}

fuzz_target!(|inp: Input| {
    let n = inp.n as usize;
    for g in [
        Groups::Uniform(inp.group_size as usize),
        Groups::Offsets(&inp.offsets.iter().map(|&o| o as usize).collect::<Vec<_>>()),
    ] {
        if let Ok(k) = g.validate(n) {
            let total: usize = (0..k).map(|i| g.members(i).count()).sum();
            assert_eq!(total, n);
        }
    }
    let ids: Vec<usize> = inp.ids.iter().map(|&i| i as usize).collect();
    let mut scratch = vec![0usize; inp.scratch as usize];
    if let Ok(g) = Groups::from_group_ids(&ids, inp.num_groups as usize, &mut scratch) {
        let k = g.validate(ids.len()).unwrap();
        for i in 0..k {
            assert!(g.members(i).all(|s| ids[s] == i));
        }
    }
    let mask = (!inp.mask.is_empty()).then_some(&inp.mask[..]);
    let t = Tokens::padded(inp.rows as usize, inp.cols as usize, mask);
    if let Ok(s) = t.validate(inp.rows as usize * inp.cols as usize) {
        assert!(t.total_valid() <= s * inp.cols as usize);
    }
});
