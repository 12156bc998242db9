//! AVX-512F backend: the 16 lanes are one `__m512`.
//!
//! `vmaxps`/`vminps` implement the project's NaN rule exactly (`a > b ? a : b`; for a NaN or
//! equal operands the second operand is returned), so no select is needed.

use core::arch::x86_64::*;

use crate::kernels::Kernel;
use crate::lanes::{F32x16, bf16_round_bits};

/// 16 lanes in one 512-bit register. Created only inside `entry` and `entry_bf16`, after
/// [`run`]'s detection. `BF16` is set in `entry_bf16` only, which is also compiled for (and
/// entered after detecting) AVX512_BF16 and AVX512DQ: its [`F32x16::store_bf16`] rounds with
/// `vcvtneps2bf16`.
#[derive(Clone, Copy)]
pub(crate) struct Avx512<const BF16: bool = false>(__m512);

/// Whether the kernels should issue software prefetches on this CPU: not on AMD's AVX-512
/// cores. Measured on an AMD EPYC Zen 4 host (family 25 model 17, 2 vCPUs, 2026-12-05): eight
/// runs of `grpo-bench vocab --dtype all` alternating `--prefetch on` and `off`, two threads,
/// median per-pair time ratios off/on at 2048 × 32768 / 512 × 151936 of fused log-prob +
/// entropy 0.83 / 0.81, log-prob 0.74 / 0.77, KL 0.85 / 0.87, backward 0.82 / 0.87, bf16 fused
/// 0.84 / 0.86 (every kernel's: `kernels::vocab`'s `PREFETCH_BYTES`). There the hardware
/// prefetchers keep a core streaming at the step's in-cache rate: a copy of the one-pass step
/// over 256 MB on one thread moved 19.4–19.9 GB/s without software prefetches against
/// 15.5–19.2 GB/s with them (three alternated runs). Why the requests slow it down is not
/// established; leaving out only the L2 request (`prefetcht1`) was no cure (KL 1.07 / 1.07,
/// backward 0.92 / 1.03, six pairs). Re-checked with the table exponential inside one process
/// (`grpo-bench vocab --prefetch both`, both settings in the same rounds; median over five runs
/// of the per-round ratio off/on): every one-row pass and backward 0.85–1.00 in every storage
/// type, and only the pair passes on 16-bit rows slower at 2048 × 32768 (1.03–1.10; at
/// 512 × 151936 they gain, 0.89–0.98); in a later session on the same kind of host the 16-bit
/// KL gained more from them at 2048 × 32768 (on/off 0.75–0.91, eleven runs) and still nothing
/// at 512 × 151936 (0.94–1.11), while the other passes lost as before; so `kl_rows` over two
/// 16-bit rows prefetches whatever this says (`backend::Pass::NarrowKl`, with the figures of
/// 2026-12-06 in `Backend::software_prefetch_default`). On the Intel host the
/// same prefetches cut fused streaming from 22.2 / 25.4 to 16.0 / 17.1 ms, so other vendors
/// keep them; other AMD AVX-512 cores (Zen 5) follow Zen 4 unmeasured.
///
/// Read once per process: `CPUID` traps to the hypervisor under virtualisation, and every
/// `Cpu` constructor and every `math` call on a bare `Backend` asks.
pub(crate) fn prefetch_by_default() -> bool {
    static AMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    !*AMD.get_or_init(|| {
        // CPUID leaf 0: the vendor string in EBX, EDX, ECX ("Auth" "enti" "cAMD").
        let id = __cpuid(0);
        id.ebx == u32::from_le_bytes(*b"Auth")
            && id.edx == u32::from_le_bytes(*b"enti")
            && id.ecx == u32::from_le_bytes(*b"cAMD")
    })
}

/// The entry functions, in a module of their own so that their instantiations form a codegen
/// unit of their own (see [`super`]).
mod entries {
    use super::{_mm_sfence, Avx512, Kernel};

    /// Runs `k` compiled for AVX-512F + FMA: this backend's entry function, out of line.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, FMA and AVX512BW (for `F32x16::load_bf16`).
    #[target_feature(enable = "avx512f,fma")]
    #[inline(never)]
    pub(super) unsafe fn entry<K: Kernel>(k: K) -> K::Output {
        let out = k.run::<Avx512>();
        // Order the kernel's streaming stores before whatever signals completion to other threads.
        _mm_sfence();
        out
    }

    /// [`entry`] compiled also for AVX512_BF16 (`vcvtneps2bf16`) and AVX512DQ (`vfpclassps`, which
    /// finds subnormal lanes), for the kernels that store gradients in bf16
    /// ([`Kernel::STORES_BF16`]; only those kernels get this second instantiation).
    ///
    /// # Safety
    /// The CPU must support AVX-512F, FMA, AVX512BW, AVX512_BF16 and AVX512DQ.
    #[target_feature(enable = "avx512f,fma,avx512bf16,avx512dq")]
    #[inline(never)]
    pub(super) unsafe fn entry_bf16<K: Kernel>(k: K) -> K::Output {
        let out = k.run::<Avx512<true>>();
        // As in `entry`.
        _mm_sfence();
        out
    }
}
use entries::{entry, entry_bf16};

/// Whether the CPU has what this backend needs: AVX-512F and FMA, which `entry` is
/// compiled for, and AVX512BW, whose `vpermw` [`F32x16::load_bf16`] issues from `asm!` (every
/// AVX-512 CPU but the Xeon Phi has it).
pub(crate) fn detected() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("fma")
}

/// Runs `k` on this backend, or returns it if the CPU lacks AVX-512F, AVX512BW or FMA. A
/// kernel that stores bf16 runs from `entry_bf16` where the CPU has AVX512_BF16 and
/// AVX512DQ: the same bits (see [`F32x16::store_bf16`] below), measured 10 % faster for the
/// in-place bf16 backward on an Intel host; 13–20 % less time on a Zen 4 host (2026-12-05,
/// four runs alternated with a build that skipped `entry_bf16`: 19.1–19.9 against 23.6–24.0
/// ms at 2048 × 32768, 21.8–22.9 against 25.6–26.6 ms at 512 × 151936).
pub(crate) fn run<K: Kernel>(k: K) -> Result<K::Output, K> {
    if K::STORES_BF16
        && detected()
        && std::arch::is_x86_feature_detected!("avx512bf16")
        && std::arch::is_x86_feature_detected!("avx512dq")
    {
        // SAFETY: all four features `entry_bf16` is compiled for were detected just above
        // (and AVX512BW, see `detected`).
        return Ok(unsafe { entry_bf16(k) });
    }
    run_without_bf16(k)
}

/// [`run`] from `entry` only: every kernel that does not store bf16, and in tests the
/// integer bf16 rounding on a CPU that has AVX512_BF16.
pub(crate) fn run_without_bf16<K: Kernel>(k: K) -> Result<K::Output, K> {
    if detected() {
        // SAFETY: the features `entry` is compiled for were detected just above (and
        // AVX512BW, see `detected`).
        Ok(unsafe { entry(k) })
    } else {
        Err(k)
    }
}

/// `vpermw out, idx, h`: word `i` of `out` is word `idx[i] mod 32` of `h`.
///
/// # Safety
/// The CPU must support AVX-512F and AVX512BW. Compiled for AVX-512F only (the `zmm` operands'
/// register class), so that it inlines into `entry`; the assembler accepts `vpermw` whatever
/// the compiled features.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn widen_words(idx: __m512i, h: __m512i) -> __m512i {
    let out: __m512i;
    // SAFETY: the caller guarantees AVX512BW; the instruction reads and writes these
    // registers only and leaves the flags alone.
    unsafe {
        core::arch::asm!(
            "vpermw {out}, {idx}, {h}",
            out = lateout(zmm_reg) out,
            idx = in(zmm_reg) idx,
            h = in(zmm_reg) h,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    out
}

// SAFETY (every block below): an `Avx512` value exists only inside `entry` or `entry_bf16`,
// which run only after `run` detected AVX-512F, AVX512BW and FMA, so the intrinsics' target
// features are present. Loads and stores go through references to 16-element arrays, so the
// 64 (or 32) bytes they touch are in bounds; the unaligned forms are used, so no alignment is
// assumed.
impl<const BF16: bool> F32x16 for Avx512<BF16> {
    type Mask = __mmask16;
    /// 32 zmm registers, one per value.
    const REGISTERS: usize = 32;
    const SPECIALIZED_LOOPS: bool = true;
    const POW2_NORMAL_KEEPS_NAN: bool = true;

    #[inline(always)]
    fn splat(x: f32) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_set1_ps(x) })
    }
    #[inline(always)]
    fn from_array(a: [f32; 16]) -> Self {
        Self::load(&a)
    }
    #[inline(always)]
    fn to_array(self) -> [f32; 16] {
        let mut a = [0.0; 16];
        self.store(&mut a);
        a
    }
    #[inline(always)]
    fn load(src: &[f32; 16]) -> Self {
        // SAFETY: see the impl comment (64 readable bytes behind the reference).
        Avx512(unsafe { _mm512_loadu_ps(src.as_ptr()) })
    }
    /// bf16 → f32 is the 16 bits moved to the top of a 32-bit lane over 16 zero bits: exact
    /// for every value. One `vpermw` does it (word `2i + 1` ← bf16 `i`, word `2i` ← a zero
    /// word of the upper half, which the 256-bit load clears) instead of a widening move and a
    /// shift: one vector operation fewer per 16 logits in the compute-bound bf16 steps. It is
    /// issued from `asm!` ([`widen_words`]) because LLVM turns the intrinsic form into a
    /// two-source `vpermt2w`, which overwrites an operand and so costs a register copy per load
    /// (measured slower on Zen 4 and on the Intel host, see the README). Measured on Zen 4
    /// (2026-12-05) inside one process, both forms in the same rounds (the widening form in
    /// the place of the then separate build without prefetches, which `grpo-bench vocab
    /// --prefetch both` times in the same rounds), medians of the per-round time ratios: in
    /// cache (16 × 32768, one thread, three runs) fused 0.96, log-prob 0.96, KL 1.01,
    /// backward 0.97; streaming on two threads (five runs, 2048 × 32768 / 512 × 151936) fused
    /// 0.98 / 0.97, log-prob 0.98 / 0.995, KL 0.96 / 1.01, JSD 0.96 / 0.96, backward 0.985 /
    /// 0.98, `backward_kl` 0.95 / 0.95.
    #[inline(always)]
    fn load_bf16(src: &[half::bf16; 16]) -> Self {
        /// Word `2i + 1` takes bf16 `i`, word `2i` word 16 (zero).
        const WIDEN: [u16; 32] = {
            let mut idx = [16u16; 32];
            let mut i = 0;
            while i < 16 {
                idx[2 * i + 1] = i as u16;
                i += 1;
            }
            idx
        };
        // SAFETY: see the impl comment (32 readable bytes behind the reference; `WIDEN` is 64
        // readable bytes); `widen_words` needs AVX512BW besides, which `run` detected.
        Avx512(unsafe {
            let h = _mm512_zextsi256_si512(_mm256_loadu_si256(src.as_ptr().cast()));
            _mm512_castsi512_ps(widen_words(_mm512_loadu_si512(WIDEN.as_ptr().cast()), h))
        })
    }
    #[inline(always)]
    fn load_f16(src: &[half::f16; 16]) -> Self {
        // SAFETY: see the impl comment (32 readable bytes). `vcvtph2ps` is exact for every f16.
        Avx512(unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(src.as_ptr().cast())) })
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32; 16]) {
        // SAFETY: see the impl comment (64 writable bytes behind the exclusive reference).
        unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), self.0) }
    }
    #[inline(always)]
    fn store_bf16_bits(self, dst: &mut [half::bf16; 16]) {
        // SAFETY: see the impl comment (32 writable bytes behind the exclusive reference;
        // `half::bf16` is a `repr(transparent)` u16). `vpmovdw` keeps each lane's low 16 bits.
        unsafe {
            let h = _mm512_cvtepi32_epi16(_mm512_castps_si512(self.0));
            _mm256_storeu_si256(dst.as_mut_ptr().cast(), h)
        }
    }
    #[inline(always)]
    fn store_bf16(self, dst: &mut [half::bf16; 16]) {
        if !BF16 {
            return bf16_round_bits(self).store_bf16_bits(dst);
        }
        // SAFETY: see the impl comment; `BF16` is true only in `entry_bf16`, entered after
        // AVX512_BF16 and AVX512DQ were detected. 32 writable bytes behind the exclusive
        // reference; `__m256bh` and `__m256i` are both 32 bytes of plain bits.
        unsafe {
            // `vcvtneps2bf16` rounds to nearest even, overflows to ±∞ and quiets a NaN keeping
            // its sign and high payload bits, as `half` does, but reads subnormal inputs as
            // zero: a vector holding one (class 0x20 of `vfpclassps`) takes the integer rounding.
            if _mm512_fpclass_ps_mask::<0x20>(self.0) != 0 {
                return bf16_round_bits(self).store_bf16_bits(dst);
            }
            let h = _mm512_cvtneps_pbh(self.0);
            _mm256_storeu_si256(
                dst.as_mut_ptr().cast(),
                core::mem::transmute::<__m256bh, __m256i>(h),
            );
        }
    }
    #[inline(always)]
    fn store_f16(self, dst: &mut [half::f16; 16]) {
        // SAFETY: see the impl comment (32 writable bytes; `half::f16` is a `repr(transparent)`
        // u16). `vcvtps2ph` with an explicit round-to-nearest-even immediate rounds as IEEE
        // (and `half`) does, whatever MXCSR's rounding mode.
        unsafe {
            let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(self.0);
            _mm256_storeu_si256(dst.as_mut_ptr().cast(), h)
        }
    }
    #[inline(always)]
    fn store_stream(self, dst: &mut [f32; 16]) {
        let p = dst.as_mut_ptr();
        if p.addr().is_multiple_of(64) {
            // SAFETY: see the impl comment; `vmovntps` needs the 64-byte alignment checked above.
            unsafe { _mm512_stream_ps(p, self.0) }
        } else {
            self.store(dst);
        }
    }
    #[inline(always)]
    fn prefetch(p: *const u8) {
        // SAFETY: a prefetch never dereferences architecturally and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
    }
    #[inline(always)]
    fn prefetch_l2(p: *const u8) {
        // SAFETY: as `prefetch`.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) }
    }

    #[inline(always)]
    fn add(self, b: Self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_add_ps(self.0, b.0) })
    }
    #[inline(always)]
    fn sub(self, b: Self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_sub_ps(self.0, b.0) })
    }
    #[inline(always)]
    fn mul(self, b: Self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_mul_ps(self.0, b.0) })
    }
    #[inline(always)]
    fn div(self, b: Self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_div_ps(self.0, b.0) })
    }
    #[inline(always)]
    fn mul_add(self, b: Self, c: Self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_fmadd_ps(self.0, b.0, c.0) })
    }
    #[inline(always)]
    fn max(self, b: Self) -> Self {
        // SAFETY: see the impl comment. vmaxps(a, b) = a > b ? a : b, NaN → b.
        Avx512(unsafe { _mm512_max_ps(self.0, b.0) })
    }
    #[inline(always)]
    fn min(self, b: Self) -> Self {
        // SAFETY: see the impl comment. vminps(a, b) = a < b ? a : b, NaN → b.
        Avx512(unsafe { _mm512_min_ps(self.0, b.0) })
    }

    #[inline(always)]
    fn and(self, b: Self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_castsi512_ps(_mm512_and_si512(bits(self), bits(b))) })
    }
    #[inline(always)]
    fn or(self, b: Self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_castsi512_ps(_mm512_or_si512(bits(self), bits(b))) })
    }
    #[inline(always)]
    fn xor(self, b: Self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_castsi512_ps(_mm512_xor_si512(bits(self), bits(b))) })
    }
    #[inline(always)]
    fn andnot(self, b: Self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_castsi512_ps(_mm512_andnot_si512(bits(self), bits(b))) })
    }
    #[inline(always)]
    fn add_i32(self, b: Self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_castsi512_ps(_mm512_add_epi32(bits(self), bits(b))) })
    }
    #[inline(always)]
    fn sub_i32(self, b: Self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_castsi512_ps(_mm512_sub_epi32(bits(self), bits(b))) })
    }
    #[inline(always)]
    fn mul_pow2_normal(self, k: Self, _n_field: Self) -> Self {
        // SAFETY: see the impl comment. `vscalefps` computes `self · 2^floor(k)` rounded once
        // (MXCSR: nearest-even, no flush-to-zero in Rust); a normal product is exact.
        Avx512(unsafe { _mm512_scalef_ps(self.0, k.0) })
    }
    #[inline(always)]
    fn mul_pow2_or_zero(self, k: Self, _biased: Self) -> Self {
        // SAFETY: see the impl comment. Lanes with `k < −126` (`floor(k) = −127`) are zeroed
        // (+0, the product of a positive finite `self` with the reference's scale
        // `from_bits(0)`); a NaN `k` is "not less" (`_NLT_UQ`: unordered is true), so a NaN
        // lane keeps `vscalefps`'s NaN. The others are `self · 2^floor(k)` rounded once, as
        // the multiply by the normal float `2^n` (n ≥ −126) rounds it.
        Avx512(unsafe {
            let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(k.0, _mm512_set1_ps(-126.0));
            _mm512_maskz_scalef_ps(keep, self.0, k.0)
        })
    }
    #[inline(always)]
    fn lookup8(self, table: &[f32; 8]) -> Self {
        // SAFETY: see the impl comment; the reference covers the 32 bytes loaded. The table
        // fills the low half of a zmm (the upper half of the cast is never read) and the
        // 128-bit shuffle repeats it in the high half, so that `vpermps`, which reads the low
        // four bits of each index lane, picks `table[b & 7]`. In a loop both are invariant and
        // LLVM keeps the repeated table in a register.
        Avx512(unsafe {
            let half = _mm512_castps256_ps512(_mm256_loadu_ps(table.as_ptr()));
            let twice = _mm512_shuffle_f32x4::<0b01_00_01_00>(half, half);
            _mm512_permutexvar_ps(bits(self), twice)
        })
    }
    #[inline(always)]
    fn max_i32(self, b: Self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_castsi512_ps(_mm512_max_epi32(bits(self), bits(b))) })
    }
    #[inline(always)]
    fn shl<const N: u32>(self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<N>(bits(self))) })
    }
    #[inline(always)]
    fn shr_logical<const N: u32>(self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_castsi512_ps(_mm512_srli_epi32::<N>(bits(self))) })
    }
    #[inline(always)]
    fn shr_arith<const N: u32>(self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_castsi512_ps(_mm512_srai_epi32::<N>(bits(self))) })
    }
    #[inline(always)]
    fn i32_to_f32(self) -> Self {
        // SAFETY: see the impl comment. The MXCSR rounding mode is Rust's default (nearest).
        Avx512(unsafe { _mm512_cvtepi32_ps(bits(self)) })
    }
    #[inline(always)]
    fn f32_to_i32_round(self) -> Self {
        // SAFETY: see the impl comment. Rounds with MXCSR's mode: nearest-even in Rust.
        Avx512(unsafe { _mm512_castsi512_ps(_mm512_cvtps_epi32(self.0)) })
    }
    #[inline(always)]
    fn f32_to_i32_trunc(self) -> Self {
        // SAFETY: see the impl comment.
        Avx512(unsafe { _mm512_castsi512_ps(_mm512_cvttps_epi32(self.0)) })
    }

    #[inline(always)]
    fn gt(self, b: Self) -> __mmask16 {
        // SAFETY: see the impl comment. Ordered, quiet: false when either lane is NaN.
        unsafe { _mm512_cmp_ps_mask::<_CMP_GT_OQ>(self.0, b.0) }
    }
    #[inline(always)]
    fn ge(self, b: Self) -> __mmask16 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_cmp_ps_mask::<_CMP_GE_OQ>(self.0, b.0) }
    }
    #[inline(always)]
    fn lt(self, b: Self) -> __mmask16 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_cmp_ps_mask::<_CMP_LT_OQ>(self.0, b.0) }
    }
    #[inline(always)]
    fn le(self, b: Self) -> __mmask16 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_cmp_ps_mask::<_CMP_LE_OQ>(self.0, b.0) }
    }
    #[inline(always)]
    fn not_lt(self, b: Self) -> __mmask16 {
        // SAFETY: see the impl comment. Unordered: true when either lane is NaN.
        unsafe { _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(self.0, b.0) }
    }
    #[inline(always)]
    fn eq(self, b: Self) -> __mmask16 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(self.0, b.0) }
    }
    #[inline(always)]
    fn ne(self, b: Self) -> __mmask16 {
        // SAFETY: see the impl comment. Unordered: true when either lane is NaN, like Rust's `!=`.
        unsafe { _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(self.0, b.0) }
    }
    #[inline(always)]
    fn eq_i32(self, b: Self) -> __mmask16 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_cmpeq_epi32_mask(bits(self), bits(b)) }
    }
    #[inline(always)]
    fn select(m: __mmask16, a: Self, b: Self) -> Self {
        // SAFETY: see the impl comment. mask_blend takes the second operand where m is set.
        Avx512(unsafe { _mm512_mask_blend_ps(m, b.0, a.0) })
    }
    #[inline(always)]
    fn mask_and(a: __mmask16, b: __mmask16) -> __mmask16 {
        a & b
    }
    #[inline(always)]
    fn mask_or(a: __mmask16, b: __mmask16) -> __mmask16 {
        a | b
    }
    #[inline(always)]
    fn mask_andnot(a: __mmask16, b: __mmask16) -> __mmask16 {
        !a & b
    }
    #[inline(always)]
    fn mask_none() -> __mmask16 {
        0
    }
    #[inline(always)]
    fn mask_any(m: __mmask16) -> bool {
        m != 0
    }
    #[inline(always)]
    fn reduce_max(self) -> f32 {
        // SAFETY: see the impl comment (a shuffle-and-max sequence on registers).
        unsafe { _mm512_reduce_max_ps(self.0) }
    }
    #[inline(always)]
    fn reduce_min(self) -> f32 {
        // SAFETY: see the impl comment.
        unsafe { _mm512_reduce_min_ps(self.0) }
    }
}

#[inline(always)]
fn bits<const BF16: bool>(v: Avx512<BF16>) -> __m512i {
    // SAFETY: see the impl comment (a reinterpretation, no instruction).
    unsafe { _mm512_castps_si512(v.0) }
}
