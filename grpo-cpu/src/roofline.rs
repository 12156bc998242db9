//! Memory-bandwidth probes: the plain streaming loops the vocabulary kernels are compared to.
//!
//! The benchmark program measures these in the same run as each kernel and reports the kernel's
//! bandwidth as a fraction of them (the machine's bandwidth drifts between runs, so only
//! same-run ratios are meaningful).

use rayon::prelude::*;

use crate::arch;
use crate::cpu::Cpu;
use crate::kernels::roofline::{Copy, ReadSum};

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
    let backend = cpu.backend();
    cpu.install(|| {
        data.par_chunks(CHUNK)
            .map(|c| arch::run(backend, ReadSum(c)))
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
    let backend = cpu.backend();
    cpu.install(|| {
        src.par_chunks(CHUNK)
            .zip(dst.par_chunks_mut(CHUNK))
            .for_each(|(s, d)| arch::run(backend, Copy(s, d)))
    })
}
