//! Held-out accuracy along the supervised warm-up (for choosing its length).
use grpo_demo::train::{TrainConfig, Trainer};
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let steps: usize = args.get(1).map_or(600, |s| s.parse().unwrap());
    let lr: f64 = args.get(2).map_or(1e-3, |s| s.parse().unwrap());
    let subset: usize = args.get(3).map_or(2000, |s| s.parse().unwrap());
    let mut t = Trainer::new(TrainConfig {
        warmup_lr: lr,
        warmup_examples: subset,
        ..TrainConfig::default()
    })
    .unwrap();
    let t0 = std::time::Instant::now();
    let mut nll = 0.0;
    for i in 1..=steps {
        nll = t.warmup_step().unwrap();
        if i % 50 == 0 {
            println!(
                "{i:5} nll {nll:.3} acc {:.3} ({:.0} s)",
                t.held_out_accuracy().unwrap(),
                t0.elapsed().as_secs_f64()
            );
        }
    }
    let _ = nll;
}
