//! The memory roofline: the fastest plain streaming read (and read + write, with plain or
//! streaming stores) of a buffer, against which the vocabulary kernels' bandwidth is reported.
//!
//! Sixteen independent vector accumulators hide the add latency, so the loop is limited by the
//! memory system only; this is the "best vectorised read loop" a kernel is compared to.

use super::vocab::prefetch_ahead;
use super::{Kernel, software_prefetch};
use crate::lanes::F32x16;

/// Sums `data` with 16 vector accumulators (a bandwidth probe; the sum's order is not canonical).
pub(crate) struct ReadSum<'a>(pub(crate) &'a [f32]);

impl Kernel for ReadSum<'_> {
    type Output = f32;

    #[inline(always)]
    fn run<V: F32x16>(self) -> f32 {
        let mut acc = [V::splat(0.0); 16];
        let mut blocks = self.0.chunks_exact(256);
        for b in &mut blocks {
            let (vs, _) = b.as_chunks::<16>();
            for (a, v) in acc.iter_mut().zip(vs) {
                *a = a.add(V::load(v));
            }
        }
        let mut s = 0.0;
        for a in acc {
            s += a.to_array().iter().sum::<f32>();
        }
        s + blocks.remainder().iter().sum::<f32>()
    }
}

/// Copies `src` to `dst` 16 vectors at a time (read + write probe). Lengths must be equal.
pub(crate) struct Copy<'a>(pub(crate) &'a [f32], pub(crate) &'a mut [f32]);

impl Kernel for Copy<'_> {
    type Output = ();

    #[inline(always)]
    fn run<V: F32x16>(self) {
        let (src, dst) = (self.0, self.1);
        let (s, s_tail) = src.as_chunks::<16>();
        let (d, d_tail) = dst.as_chunks_mut::<16>();
        for (d, s) in d.iter_mut().zip(s) {
            V::load(s).store(d);
        }
        d_tail.copy_from_slice(s_tail);
    }
}

/// [`Copy`](struct@Copy) writing through [`F32x16::store_stream`] from the destination's first
/// 64-byte boundary on (plain stores before it and for the tail), as the backward kernels write
/// their gradients: on AVX-512 the streaming stores skip the read for ownership of each
/// destination line that plain stores pay, so this probe moves two bytes over the memory bus for
/// each byte copied where [`Copy`](struct@Copy) moves three. Lengths must be equal.
pub(crate) struct CopyStream<'a>(pub(crate) &'a [f32], pub(crate) &'a mut [f32]);

impl Kernel for CopyStream<'_> {
    type Output = ();

    #[inline(always)]
    fn run<V: F32x16>(self) {
        let (src, dst) = (self.0, self.1);
        let head = dst.as_ptr().align_offset(64).min(dst.len());
        dst[..head].copy_from_slice(&src[..head]);
        let (s, s_tail) = src[head..].as_chunks::<16>();
        let (d, d_tail) = dst[head..].as_chunks_mut::<16>();
        for (d, s) in d.iter_mut().zip(s) {
            V::load(s).store_stream(d);
        }
        d_tail.copy_from_slice(s_tail);
    }
}

/// Reads `data` as the vocabulary steps do — one vector per 16 values, the steps' software
/// prefetches ([`prefetch_ahead`]) — and spends `FMAS` dependent fused multiply-adds on each
/// vector (Horner's rule in the loaded value, as an exponential's polynomial is), summed into
/// four accumulators: a stand-in for a kernel of that arithmetic density. A bandwidth probe;
/// the sum's order is not canonical.
pub(crate) struct ReadFma<'a, const FMAS: usize>(pub(crate) &'a [f32]);

impl<const FMAS: usize> Kernel for ReadFma<'_, FMAS> {
    type Output = f32;

    #[inline(always)]
    fn run<V: F32x16>(self) -> f32 {
        let (c0, c1) = (V::splat(PROBE_C0), V::splat(PROBE_C1));
        let mut acc = [V::splat(0.0); 4];
        let (chunks, tail) = self.0.as_chunks::<16>();
        let mut quads = chunks.chunks_exact(4);
        let prefetch = software_prefetch();
        for (j, q) in (&mut quads).enumerate() {
            for (k, (c, a)) in q.iter().zip(&mut acc).enumerate() {
                prefetch_ahead::<V, f32>(c, 4 * j + k, prefetch);
                let x = V::load(c);
                let mut p = c0;
                for _ in 0..FMAS {
                    p = p.mul_add(x, c1);
                }
                *a = a.add(p);
            }
        }
        let mut s = 0.0;
        for a in acc {
            s += a.to_array().iter().sum::<f32>();
        }
        let rest = quads.remainder().iter().flatten().chain(tail);
        s + rest.sum::<f32>()
    }
}

/// The constant term [`ReadFma`] starts each vector's polynomial from.
pub(crate) const PROBE_C0: f32 = 0.25;
/// The coefficient [`ReadFma`] adds in each of its fused multiply-adds.
pub(crate) const PROBE_C1: f32 = 0.5;
