//! Criterion benchmarks of grpo-cpu's vocabulary kernels, one group per kernel, every available
//! backend, f32 and bf16 storage, 64 rows × 32768 (8 MiB of f32: past the L2, so the loads
//! stream). Throughput is reported in bytes of logits read. For the same-run roofline ratios,
//! use the `grpo-bench vocab` binary.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use grpo_core::vocab::{GradTerms, KlDirection, KlTerm, LseState, PairState};
use grpo_cpu::{Backend, Cpu, Storage};

const ROWS: usize = 64;
const VOCAB: usize = 32768;

fn logits<S: Storage>(seed: u64) -> Vec<S> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..ROWS * VOCAB)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            S::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 24.0 - 12.0)
        })
        .collect()
}

fn bench_dtype<S: Storage>(c: &mut Criterion, dtype: &str) {
    let z: Vec<S> = logits(1);
    let w: Vec<S> = logits(2);
    let targets: Vec<u32> = (0..ROWS).map(|r| (r * 7919 % VOCAB) as u32).collect();
    let ones = vec![1.0f32; ROWS];
    let bytes = (ROWS * VOCAB * size_of::<S>()) as u64;
    let (mut a, mut b) = (vec![0.0f32; ROWS], vec![0.0f32; ROWS]);
    let mut grad = vec![0.0f32; ROWS * VOCAB];
    for backend in Backend::available() {
        let cpu = Cpu::new(backend).unwrap();
        let id = |k: &str| BenchmarkId::new(format!("{k}/{dtype}"), backend.name());

        let mut g = c.benchmark_group("vocab");
        g.sample_size(20);
        g.throughput(Throughput::Bytes(bytes));
        g.bench_function(id("logprob_entropy"), |bench| {
            bench.iter(|| {
                cpu.logprob_entropy_rows(&z, VOCAB, &targets, 1.0, &mut a, Some(&mut b))
                    .unwrap()
            })
        });
        g.bench_function(id("logprob"), |bench| {
            bench.iter(|| {
                cpu.logprob_entropy_rows(&z, VOCAB, &targets, 1.0, &mut a, None)
                    .unwrap()
            })
        });
        g.bench_function(id("stats"), |bench| {
            bench.iter(|| cpu.stats_rows(&z, VOCAB, 1.0, &mut a, &mut b).unwrap())
        });
        g.throughput(Throughput::Bytes(2 * bytes));
        g.bench_function(id("kl"), |bench| {
            bench.iter(|| {
                cpu.kl_rows(&z, &w, VOCAB, 1.0, KlDirection::StudentTeacher, &mut a)
                    .unwrap()
            })
        });
        let mut pairs = vec![PairState::EMPTY; ROWS];
        g.bench_function(id("kl_saved"), |bench| {
            bench.iter(|| {
                cpu.kl_rows_saved(
                    &z,
                    &w,
                    VOCAB,
                    1.0,
                    KlDirection::StudentTeacher,
                    &mut a,
                    &mut pairs,
                )
                .unwrap()
            })
        });
        g.bench_function(id("jsd"), |bench| {
            bench.iter(|| cpu.jsd_rows(&z, &w, VOCAB, 0.5, 1.0, &mut a).unwrap())
        });
        g.throughput(Throughput::Bytes(bytes + (ROWS * VOCAB * 4) as u64));
        g.bench_function(id("backward"), |bench| {
            let terms: GradTerms<'_, u32> = GradTerms {
                logp: Some((&targets, &ones)),
                entropy: Some(&ones),
                kl: None,
            };
            bench.iter(|| {
                cpu.backward_rows(&z, VOCAB, 1.0, &terms, &mut grad)
                    .unwrap()
            })
        });
        // From the row states of one forward (not timed).
        g.bench_function(id("backward_saved"), |bench| {
            let terms: GradTerms<'_, u32> = GradTerms {
                logp: Some((&targets, &ones)),
                entropy: Some(&ones),
                kl: None,
            };
            let mut saved = vec![LseState::EMPTY; ROWS];
            cpu.logprob_entropy_rows_saved(&z, VOCAB, &targets, 1.0, &mut a, None, &mut saved)
                .unwrap();
            bench.iter(|| {
                cpu.backward_rows_saved(&z, VOCAB, 1.0, &saved, &terms, &mut grad)
                    .unwrap()
            })
        });
        // With a KL(p‖q) term: from the pair states of one KL forward (not timed).
        g.throughput(Throughput::Bytes(2 * bytes + (ROWS * VOCAB * 4) as u64));
        g.bench_function(id("backward_kl_saved"), |bench| {
            let terms: GradTerms<'_, u32, S> = GradTerms {
                logp: Some((&targets, &ones)),
                entropy: Some(&ones),
                kl: Some(KlTerm {
                    teacher: &w,
                    grad: &ones,
                    direction: KlDirection::StudentTeacher,
                }),
            };
            cpu.kl_rows_saved(
                &z,
                &w,
                VOCAB,
                1.0,
                KlDirection::StudentTeacher,
                &mut a,
                &mut pairs,
            )
            .unwrap();
            bench.iter(|| {
                cpu.backward_rows_saved(&z, VOCAB, 1.0, &pairs, &terms, &mut grad)
                    .unwrap()
            })
        });
        g.finish();
    }
}

fn benches(c: &mut Criterion) {
    bench_dtype::<f32>(c, "f32");
    bench_dtype::<half::bf16>(c, "bf16");
}

criterion_group!(vocab, benches);
criterion_main!(vocab);
