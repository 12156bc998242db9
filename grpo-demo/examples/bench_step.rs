//! Times the pieces of one step (forward, backward, generation) in CPU seconds.
use grpo_demo::model::token_tensor;
use grpo_demo::train::{TrainConfig, Trainer, surrogate};
fn cpu() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap();
    let f: Vec<&str> = s.rsplit(')').next().unwrap().split_whitespace().collect();
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0
}
fn main() {
    let t = Trainer::new(TrainConfig::default()).unwrap();
    let b = 128;
    let toks: Vec<u32> = (0..b * 12).map(|i| (i % 13) as u32).collect();
    let x = token_tensor(&toks, b, 12).unwrap();
    for _ in 0..2 {
        let c0 = cpu();
        for _ in 0..10 {
            let _ = t.model.forward_positions(&x, 8, 4).unwrap();
        }
        let c1 = cpu();
        for _ in 0..10 {
            let l = t.model.forward_positions(&x, 8, 4).unwrap();
            let n = l.elem_count();
            let _ = surrogate(&l, vec![0.01; n]).unwrap().backward().unwrap();
        }
        let c2 = cpu();
        println!(
            "fwd {:.1} ms, fwd+bwd {:.1} ms (cpu time)",
            (c1 - c0) * 100.0,
            (c2 - c1) * 100.0
        );
    }
}
