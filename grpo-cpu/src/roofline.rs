//! Memory-bandwidth probes: the plain streaming loops the vocabulary kernels are compared to.
//!
//! The benchmark program measures these in the same run as each kernel and reports the kernel's
//! bandwidth as a fraction of them (the machine's bandwidth drifts between runs, so only
//! same-run ratios are meaningful).

use rayon::prelude::*;

use crate::arch;
use crate::backend::Pass;
use crate::cpu::Cpu;
use crate::kernels::roofline::{Copy, CopyStream, ReadFma, ReadSum};

/// Elements per parallel task: 256 KiB of f32, a multiple of the 16 × 16-lane unrolled block.
const CHUNK: usize = 1 << 16;

/// Reads all of `data` on `cpu`'s threads (16 vector accumulators per thread) and returns a sum
/// so the reads cannot be optimised away. The summation order is not canonical: this is a
/// bandwidth probe, not an API for sums.
///
/// ```
/// let cpu = grpo_cpu::Cpu::detect();
/// assert_eq!(grpo_cpu::roofline::read(&cpu, &[1.0; 1000]), 1000.0);
/// ```
pub fn read(cpu: &Cpu, data: &[f32]) -> f32 {
    let target = cpu.target(Pass::General);
    cpu.install(|| {
        data.par_chunks(CHUNK)
            .map(|c| arch::run(target, ReadSum(c)))
            .sum()
    })
}

/// The largest arithmetic density [`read_with_fma`] offers.
pub const MAX_PROBE_FMAS: usize = 16;

/// Reads all of `data` on `cpu`'s threads as the vocabulary kernels' steps read logits (one
/// 16-lane vector at a time, with their software prefetches) and spends `fmas` dependent fused
/// multiply-adds on every vector: the [`read`] probe with a kernel's arithmetic density. Each
/// task reads its part of `data` (256 KiB) `passes` times before the next: with `passes = 1`
/// the probe streams from memory, with more the repeated passes find the part in the core's
/// L2 and time the arithmetic instead.
///
/// Timed against [`read`] over the same bytes, streaming and in cache, it tells how much of
/// the memory bandwidth a kernel with that much arithmetic can keep on a host (`grpo-bench
/// probe` prints that table). Each pass over a part adds, for every whole group of four
/// vectors, the polynomial `p = fma(… fma(0.25, x, 0.5) …, x, 0.5)` (`fmas` steps) of each of
/// its values, and the values after the last whole group as they are. `fmas` is clamped to
/// [`MAX_PROBE_FMAS`]. The summation order is not canonical: a probe, not an API for sums.
///
/// ```
/// use grpo_cpu::roofline::read_with_fma;
/// let cpu = grpo_cpu::Cpu::detect();
/// // four vectors of zeros: every lane's polynomial is 0.5 after a step, 0.25 before any
/// assert_eq!(read_with_fma(&cpu, &[0.0; 64], 3, 1), 32.0);
/// assert_eq!(read_with_fma(&cpu, &[0.0; 64], 0, 1), 16.0);
/// assert_eq!(read_with_fma(&cpu, &[0.0; 64], 99, 1), 32.0); // clamped to 16 steps
/// assert_eq!(read_with_fma(&cpu, &[0.0; 64], 3, 2), 64.0); // read twice
/// // the 16 values after the group of four vectors are added as they are
/// let mut z = [0.0f32; 80];
/// z[64..].fill(1.0);
/// assert_eq!(read_with_fma(&cpu, &z, 1, 1), 48.0);
/// ```
pub fn read_with_fma(cpu: &Cpu, data: &[f32], fmas: usize, passes: usize) -> f32 {
    macro_rules! with_fmas {
        ($($n:literal)*) => {
            match fmas.min(MAX_PROBE_FMAS) {
                $($n => read_parts::<$n>(cpu, data, passes),)*
                _ => unreachable!("clamped to MAX_PROBE_FMAS above"),
            }
        };
    }
    with_fmas!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
}

/// [`read_with_fma`] for a fixed count.
fn read_parts<const FMAS: usize>(cpu: &Cpu, data: &[f32], passes: usize) -> f32 {
    let target = cpu.target(Pass::General);
    cpu.install(|| {
        data.par_chunks(CHUNK)
            .map(|c| {
                (0..passes)
                    .map(|_| arch::run(target, ReadFma::<FMAS>(c)))
                    .sum::<f32>()
            })
            .sum()
    })
}

/// Copies `src` into `dst` on `cpu`'s threads (one read and one write stream).
///
/// # Panics
/// If the lengths differ.
///
/// ```
/// let cpu = grpo_cpu::Cpu::detect();
/// let mut dst = [0.0; 40];
/// grpo_cpu::roofline::copy(&cpu, &[2.0; 40], &mut dst);
/// assert_eq!(dst, [2.0; 40]);
/// ```
pub fn copy(cpu: &Cpu, src: &[f32], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "roofline::copy: lengths differ");
    let target = cpu.target(Pass::General);
    cpu.install(|| {
        src.par_chunks(CHUNK)
            .zip(dst.par_chunks_mut(CHUNK))
            .for_each(|(s, d)| arch::run(target, Copy(s, d)))
    })
}

/// [`copy`] with the stores the backward kernels use for their gradients: on AVX-512
/// streaming stores (`vmovntps`) from each part's first 64-byte boundary on, which write a
/// line without reading it first; elsewhere the same plain stores as [`copy`], as the
/// backwards use there. A read + write roofline is the
/// faster of the two probes: plain stores move three bytes over the memory bus per byte copied
/// (the destination line is read for ownership, then written back), streaming ones two.
///
/// # Panics
/// If the lengths differ.
///
/// ```
/// let cpu = grpo_cpu::Cpu::detect();
/// let src: Vec<f32> = (0..100).map(|i| i as f32).collect();
/// let mut dst = vec![0.0; 99];
/// grpo_cpu::roofline::copy_stream(&cpu, &src[1..], &mut dst);
/// assert_eq!(dst, src[1..]);
/// ```
pub fn copy_stream(cpu: &Cpu, src: &[f32], dst: &mut [f32]) {
    assert_eq!(
        src.len(),
        dst.len(),
        "roofline::copy_stream: lengths differ"
    );
    let target = cpu.target(Pass::General);
    cpu.install(|| {
        src.par_chunks(CHUNK)
            .zip(dst.par_chunks_mut(CHUNK))
            .for_each(|(s, d)| arch::run(target, CopyStream(s, d)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backend;

    /// Both copies on every backend and thread count, at every destination alignment and
    /// around the task size: the source's values, every one, and nothing past the end.
    #[test]
    fn copies_copy_at_every_alignment_on_every_backend() {
        let src: Vec<f32> = (0..CHUNK + 100).map(|i| i as f32 * 0.5 - 7.0).collect();
        for b in Backend::available() {
            for threads in [1, 2] {
                let cpu = Cpu::new(b)
                    .expect("available")
                    .with_threads(threads)
                    .expect("pool");
                for offset in 0..17 {
                    for len in [0, 1, 15, 16, 17, 63, 64, 65, 1000, CHUNK - 1, CHUNK + 3] {
                        let s = &src[offset..offset + len];
                        let mut dst = vec![f32::NAN; len + offset + 1];
                        copy_stream(&cpu, s, &mut dst[offset..offset + len]);
                        assert_eq!(&dst[offset..offset + len], s, "{b:?} {offset} {len}");
                        let untouched = |x: &[f32]| x.iter().all(|v| v.is_nan());
                        assert!(untouched(&dst[..offset]) && untouched(&dst[offset + len..]));
                        let mut plain = vec![0.0; len];
                        copy(&cpu, s, &mut plain);
                        assert_eq!(plain, s, "{b:?} {offset} {len}");
                    }
                }
            }
        }
    }

    /// Every backend computes the probe's documented sum (one task: under [`CHUNK`] values),
    /// against a scalar model of it in the same order.
    #[test]
    fn read_with_fma_computes_its_documented_sum_on_every_backend() {
        let mut s = 7u32;
        let data: Vec<f32> = (0..16 * 4 * 9 + 16 * 3 + 5)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                -((s >> 8) as f32) / (1u32 << 24) as f32
            })
            .collect();
        for fmas in [0, 1, 5, MAX_PROBE_FMAS, MAX_PROBE_FMAS + 3] {
            let mut acc = [[0.0f32; 16]; 4];
            let groups = data.len() / 64;
            for g in 0..groups {
                for (k, a) in acc.iter_mut().enumerate() {
                    for (lane, a) in a.iter_mut().enumerate() {
                        let x = data[64 * g + 16 * k + lane];
                        let mut p = 0.25f32;
                        for _ in 0..fmas.min(MAX_PROBE_FMAS) {
                            p = p.mul_add(x, 0.5);
                        }
                        *a += p;
                    }
                }
            }
            let mut want = 0.0f32;
            for a in acc {
                want += a.iter().sum::<f32>();
            }
            want += data[64 * groups..].iter().sum::<f32>();
            for b in Backend::available() {
                let cpu = Cpu::new(b)
                    .expect("available")
                    .with_threads(1)
                    .expect("pool");
                let got = read_with_fma(&cpu, &data, fmas, 1);
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{b:?} fmas {fmas}: {got} vs {want}"
                );
            }
        }
    }
}
