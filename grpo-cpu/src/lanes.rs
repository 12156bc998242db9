//! The one vector abstraction every kernel is written against: 16 f32 lanes.
//!
//! Sixteen lanes is the width of grpo-core's canonical reduction (16 strided accumulators), so a
//! kernel written once over [`F32x16`] reproduces the reference's order on every ISA: AVX-512
//! holds the lanes in one register, AVX2+FMA in two, NEON in four and the portable backend in an
//! array. Every operation is exactly specified by IEEE 754 (+ − × ÷ with one rounding, fused
//! multiply-add with one rounding, bit operations, exact conversions), so all implementations
//! give the same bits lane by lane.
//!
//! Integer operations act on the lanes' bit patterns (`i32`/`u32` per lane), the way branch-free
//! `exp`/`ln` build and take apart floats. Masks are an associated type because AVX-512 keeps
//! them in mask registers while the other ISAs use all-ones lanes.
//!
//! Style: memchr's vector trait — every method `#[inline(always)]`, `#[target_feature]` only on
//! the entry functions in `arch/`, so the whole kernel is inlined into a function compiled for
//! the ISA.

/// 16 lanes of `f32` with exactly specified operations.
///
/// Implementations exist only in `arch/`; a value of an ISA's type can only be created inside a
/// function compiled for that ISA after run-time detection, which is what makes the safe methods
/// sound.
pub trait F32x16: Copy {
    /// Lane mask produced by comparisons.
    type Mask: Copy;

    /// How many values of this type the ISA's vector registers hold at once: 32 on AVX-512
    /// (32 zmm), 8 on AVX2 (16 ymm, two per value) and NEON (32 q, four per value). The
    /// kernels size their working sets by it (see `kernels::vocab::ROOMY_REGISTERS`): a loop
    /// whose live values exceed the register file spills them to the stack, and in the
    /// compute-bound steps every spill and reload is an instruction more.
    const REGISTERS: usize;

    /// Whether the kernels compile their specialised loops for these lanes beside the general
    /// one: the steps without the `·τ` at τ = 1 and with the exponent-add exponential
    /// (`NORMAL`) in `kernels::vocab`. Which loop runs never changes a bit; the choice only
    /// trades speed against compiled code.
    ///
    /// True for the SIMD backends, whose steps are bound by their arithmetic. False for the
    /// portable lanes: there every lane operation is a scalar loop and `mul_add` a software
    /// `fmaf` (about 60 times slower than AVX2), so a multiply or a clamp saved per element
    /// gains little, while each specialisation is one more copy of every step for every
    /// storage type (the pair step had eight per student/teacher type pair and need). Without
    /// them, `cargo test -p grpo-cpu --no-run` took 126 s instead of 168 s on the 2-core build
    /// machine, and the portable kernels measured 2–4 % slower (`grpo-bench vocab --backend
    /// portable`, 64 × 32768 f32, one thread, fastest of three to five alternated runs: fused
    /// 44.6 → 46.4 ms, KL 84.6 → 87.7 ms, backward 95.9 → 98.4 ms). The kernels test this
    /// constant in `const` blocks, which the compiler decides before it instantiates what
    /// they guard.
    const SPECIALIZED_LOOPS: bool;
    /// Whether [`mul_pow2_normal`](F32x16::mul_pow2_normal) returns a NaN for a NaN `self`
    /// (and `k`) in every lane. The default's exponent add can turn a NaN into a number (its
    /// integer add may carry out of the exponent field), so the steps that use it check their
    /// arguments for NaN with a sum of their own; AVX-512's `vscalefps` keeps a NaN, so there
    /// a NaN argument already reaches the step's sum of exponentials (see
    /// `kernels::vocab::lse_steps`).
    const POW2_NORMAL_KEEPS_NAN: bool = false;

    /// Every lane `x`.
    fn splat(x: f32) -> Self;
    /// Lanes from an array (index order = lane order).
    fn from_array(a: [f32; 16]) -> Self;
    /// Lanes to an array (index order = lane order).
    fn to_array(self) -> [f32; 16];
    /// Loads 16 consecutive `f32`.
    fn load(src: &[f32; 16]) -> Self;
    /// Loads 16 consecutive `bf16` and widens them exactly (a 16-bit shift).
    fn load_bf16(src: &[half::bf16; 16]) -> Self;
    /// Loads 16 consecutive `f16` and widens them exactly.
    fn load_f16(src: &[half::f16; 16]) -> Self;
    /// Stores the lanes to 16 consecutive `f32`.
    fn store(self, dst: &mut [f32; 16]);
    /// Stores the low 16 bits of each lane's bit pattern as the bits of 16 consecutive `bf16`
    /// (a narrowing store). Every lane's pattern must be at most `0xFFFF` read as `u32`; for
    /// larger ones the stored bits are unspecified.
    fn store_bf16_bits(self, dst: &mut [half::bf16; 16]);
    /// Stores the lanes rounded to 16 consecutive `bf16` exactly as `half::bf16::from_f32`
    /// does: round to nearest, ties to even, subnormal results rounded (not flushed), overflow
    /// to ±∞, a NaN quieted (`0x0040` set) with its sign and high payload bits kept. The
    /// default rounds in lane integer operations ([`bf16_round_bits`]) and narrows with
    /// [`store_bf16_bits`](F32x16::store_bf16_bits); AVX-512 overrides it with `vcvtneps2bf16`
    /// where the CPU has AVX512_BF16 (see `arch::avx512`).
    #[inline(always)]
    fn store_bf16(self, dst: &mut [half::bf16; 16]) {
        bf16_round_bits(self).store_bf16_bits(dst);
    }
    /// Stores the lanes rounded to 16 consecutive `f16` exactly as `half::f16::from_f32` does:
    /// IEEE round to nearest, ties to even, subnormal results rounded (not flushed), overflow
    /// to ±∞, a NaN quieted with its sign and high payload bits kept. The default converts
    /// lane by lane; x86 overrides it with `vcvtps2ph`.
    #[inline(always)]
    fn store_f16(self, dst: &mut [half::f16; 16]) {
        for (d, x) in dst.iter_mut().zip(self.to_array()) {
            *d = half::f16::from_f32(x);
        }
    }
    /// Stores a value that is written once and not read back soon, like
    /// [`store`](F32x16::store): AVX-512 bypasses the caches (`vmovntps`, where `dst` is
    /// aligned enough; a write-only stream saves the read for ownership of the line) and
    /// fences after the kernel, so the data is visible to other threads when the kernel
    /// returns. AVX2 stores through the caches, as measured faster on the AVX2 host we have
    /// (see `arch::avx2`), and so do NEON and the portable backend.
    fn store_stream(self, dst: &mut [f32; 16]);
    /// Hints that the cache line at `p` will be read soon. `p` is never dereferenced, so any
    /// address is allowed (a prefetch never faults).
    fn prefetch(p: *const u8);
    /// Hints that the cache line at `p` will be read later: fetched into the L2 cache, not L1
    /// (x86 `prefetcht1`, Arm `prfm pldl2keep`; nothing on the portable backend). As
    /// [`prefetch`](F32x16::prefetch), any address is allowed.
    fn prefetch_l2(p: *const u8);

    /// `a + b`, one rounding.
    fn add(self, b: Self) -> Self;
    /// `a − b`, one rounding.
    fn sub(self, b: Self) -> Self;
    /// `a × b`, one rounding.
    fn mul(self, b: Self) -> Self;
    /// `a ÷ b`, one rounding.
    fn div(self, b: Self) -> Self;
    /// `a × b + c` with a single rounding (fused multiply-add).
    fn mul_add(self, b: Self, c: Self) -> Self;
    /// `self · 2^floor(k)` where `n_field` holds `floor(k) << 23` as `i32` bit patterns, for
    /// lanes where the product is a normal float — then it is exact, the same bits however it
    /// is formed. Other lanes (a subnormal, overflowing or NaN product) are unspecified:
    /// callers check their domain.
    ///
    /// The default adds `n_field` to the exponent field in integer arithmetic (one add);
    /// AVX-512 overrides it with `vscalefps`, one operation that takes `k` as a float (the
    /// exponential's reduction has it already, and the floor is part of the instruction),
    /// which saves vector operations in the compute-bound exponentials (see `kernels::math`).
    #[inline(always)]
    fn mul_pow2_normal(self, k: Self, n_field: Self) -> Self {
        let _ = k;
        self.add_i32(n_field)
    }
    /// `self · s_n` with `n = floor(k)` and `s_n = from_bits((n + 127) << 23)` — grpo-core's
    /// `exp_nonpos` scaling — for lanes of `k` in [−127, 128) and `biased` holding `n + 127`
    /// as `i32` bit patterns: `self · 2^n` rounded once for `n ≥ −126`, and `self · (+0)`
    /// for `n = −127`. Specified for lanes where `self` is positive and finite, and for lanes
    /// where `self` and `k` are both NaN (a NaN; the exponential's reduction gives both from a
    /// NaN argument); other lanes are not.
    ///
    /// The default multiplies by the scale built from `biased` (a shift and a multiply);
    /// AVX-512 overrides it with `vscalefps` under a zeroing mask (`k ≥ −126`), which rounds
    /// `self · 2^n` once like the multiply.
    #[inline(always)]
    fn mul_pow2_or_zero(self, k: Self, biased: Self) -> Self {
        let _ = k;
        self.mul(biased.shl::<23>())
    }
    /// `table[b & 7]` per lane, `b` the lane's bit pattern (only its low three bits are read):
    /// the exponential's table read (grpo-core's `EXP_TABLE`). The default reads the table
    /// lane by lane; AVX2 overrides it with one `vpermps` per half (which reads exactly those
    /// three bits), AVX-512 with one `vpermps` of the table repeated twice, NEON with a byte
    /// table lookup.
    #[inline(always)]
    fn lookup8(self, table: &[f32; 8]) -> Self {
        Self::from_array(self.to_array().map(|x| table[(x.to_bits() & 7) as usize]))
    }
    /// `if a > b { a } else { b }` per lane (the project's NaN rule: a NaN in `a` or `b` yields `b`).
    fn max(self, b: Self) -> Self;
    /// `if a < b { a } else { b }` per lane.
    fn min(self, b: Self) -> Self;

    /// Bitwise and.
    fn and(self, b: Self) -> Self;
    /// Bitwise or.
    fn or(self, b: Self) -> Self;
    /// Bitwise xor.
    fn xor(self, b: Self) -> Self;
    /// Bitwise `!a & b`.
    fn andnot(self, b: Self) -> Self;
    /// Lanes from bit patterns.
    fn from_bits(bits: u32) -> Self {
        Self::splat(f32::from_bits(bits))
    }
    /// Wrapping `i32` addition of the bit patterns.
    fn add_i32(self, b: Self) -> Self;
    /// Wrapping `i32` subtraction of the bit patterns.
    fn sub_i32(self, b: Self) -> Self;
    /// Larger of the bit patterns read as `i32`.
    fn max_i32(self, b: Self) -> Self;
    /// Bit pattern shifted left by `N`.
    fn shl<const N: u32>(self) -> Self;
    /// Bit pattern shifted right by `N`, filling with zeros.
    fn shr_logical<const N: u32>(self) -> Self;
    /// Bit pattern shifted right by `N`, filling with the sign bit.
    fn shr_arith<const N: u32>(self) -> Self;
    /// Bit pattern read as `i32`, converted to the nearest `f32` (ties to even; exact below 2²⁴).
    fn i32_to_f32(self) -> Self;
    /// `f32` converted to `i32` rounding to nearest, ties to even, stored as the bit pattern.
    /// Out-of-range and NaN lanes give `i32::MIN` (x86's "integer indefinite"); callers keep their
    /// inputs in range.
    fn f32_to_i32_round(self) -> Self;
    /// `f32` converted to `i32` truncating toward zero, stored as the bit pattern (out of range:
    /// `i32::MIN`).
    fn f32_to_i32_trunc(self) -> Self;

    /// `a > b` (false when either is NaN).
    fn gt(self, b: Self) -> Self::Mask;
    /// `a >= b` (false when either is NaN).
    fn ge(self, b: Self) -> Self::Mask;
    /// `a < b` (false when either is NaN).
    fn lt(self, b: Self) -> Self::Mask;
    /// `a <= b` (false when either is NaN).
    fn le(self, b: Self) -> Self::Mask;
    /// `!(a < b)` (true when either is NaN).
    fn not_lt(self, b: Self) -> Self::Mask;
    /// `a == b` (false when either is NaN).
    fn eq(self, b: Self) -> Self::Mask;
    /// `a != b` (true when either is NaN).
    fn ne(self, b: Self) -> Self::Mask;
    /// Lanes whose bit patterns are equal as `i32`.
    fn eq_i32(self, b: Self) -> Self::Mask;
    /// Per lane `if m { a } else { b }`.
    fn select(m: Self::Mask, a: Self, b: Self) -> Self;
    /// Lanes where both masks are set.
    fn mask_and(a: Self::Mask, b: Self::Mask) -> Self::Mask;
    /// Lanes where either mask is set.
    fn mask_or(a: Self::Mask, b: Self::Mask) -> Self::Mask;
    /// Lanes set in `b` but not in `a`.
    fn mask_andnot(a: Self::Mask, b: Self::Mask) -> Self::Mask;
    /// No lane set.
    fn mask_none() -> Self::Mask;
    /// Whether any lane of the mask is set.
    fn mask_any(m: Self::Mask) -> bool;
    /// A lane counter: `acc + 1` as a wrapping `u32` add on the lanes' bit patterns where `m`
    /// is set, `acc` elsewhere. The default is an integer add under the mask (on AVX-512 one
    /// masked `vpaddd`, as in the release `grpo-bench` binary); backends whose set mask lanes
    /// are all ones subtract the mask (−1) instead, one operation where a float count took an
    /// add and a blend.
    #[inline(always)]
    fn count_lanes(acc: Self, m: Self::Mask) -> Self {
        Self::select(m, acc.add_i32(Self::from_bits(1)), acc)
    }

    /// The largest lane, in an unspecified order (exact for non-NaN lanes except the sign of a
    /// zero; a NaN lane may or may not be the result). The default folds the lanes in order;
    /// a backend may use a shuffle tree, which is shorter on the critical path between blocks.
    #[inline(always)]
    fn reduce_max(self) -> f32 {
        self.to_array()
            .into_iter()
            .fold(f32::NEG_INFINITY, |a, b| if a > b { a } else { b })
    }

    /// The smallest lane, in an unspecified order (as [`F32x16::reduce_max`]).
    #[inline(always)]
    fn reduce_min(self) -> f32 {
        self.to_array()
            .into_iter()
            .fold(f32::INFINITY, |a, b| if a < b { a } else { b })
    }
}

/// `half::bf16::from_f32` of every lane, as the bf16 bit pattern in the low 16 bits.
///
/// `half` rounds to nearest, ties to even: it adds 1 to the upper half `x >> 16` when the
/// dropped half is above `0x8000`, or exactly `0x8000` with the kept half odd. That is the
/// carry of `x + 0x7FFF + lsb` into bit 16 (`lsb` = bit 16 of `x`); the carry also runs into
/// the exponent, rounding the largest finite values to ±∞ as IEEE does. A NaN keeps its sign
/// and upper payload bits with the quiet bit (`0x0040`) set. Eight integer operations per 16
/// values instead of sixteen scalar conversions.
#[inline(always)]
pub(crate) fn bf16_round_bits<V: F32x16>(x: V) -> V {
    let hi = x.shr_logical::<16>();
    let lsb = hi.and(V::from_bits(1));
    let rounded = x
        .add_i32(V::from_bits(0x7fff))
        .add_i32(lsb)
        .shr_logical::<16>();
    V::select(x.ne(x), hi.or(V::from_bits(0x0040)), rounded)
}
