//! Which instruction set the kernels run on, detected once at run time.

/// A CPU code path. Every path computes the same bits; they differ only in speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Scalar code, no ISA requirement (also used on x86 CPUs without FMA, since the canonical
    /// arithmetic uses fused multiply-add).
    Portable,
    /// x86-64 with AVX2, FMA and F16C: 16 lanes held in two 256-bit registers.
    Avx2Fma,
    /// x86-64 with AVX-512F, AVX512BW and FMA: 16 lanes in one register (bf16 widened by one
    /// `vpermw`, AVX512BW). Where the CPU also has AVX512_BF16 and AVX512DQ, gradients written
    /// over bf16 logits are rounded with `vcvtneps2bf16` (with the integer rounding for vectors
    /// holding a subnormal, which the instruction would flush): the same bits as without it.
    Avx512,
    /// AArch64 NEON: 16 lanes in four 128-bit registers.
    Neon,
}

/// A kernel pass, as far as its software-prefetch default goes ([`Backend::prefetch_default`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    /// Every pass but [`NarrowKl`](Pass::NarrowKl): the backend's default.
    General,
    /// [`Cpu::kl_rows`](crate::Cpu::kl_rows)'s pass when student and teacher are both 16-bit
    /// (bf16 or f16): it reads half the bytes per logit of f32 rows and computes two
    /// exponentials per logit pair, so it runs below the memory's speed, and on AMD Zen 4,
    /// where every other pass streams faster without the requests, it runs up to a fifth
    /// faster with them at most row lengths and at most a tenth slower at the others
    /// (figures in [`Backend::software_prefetch_default`]).
    NarrowKl,
}

impl Pass {
    /// The pass of `kl_rows` over student rows of `S` and teacher rows of `U`.
    pub(crate) fn kl<S, U>() -> Pass {
        if size_of::<S>() == 2 && size_of::<U>() == 2 {
            Pass::NarrowKl
        } else {
            Pass::General
        }
    }
}

impl Backend {
    /// The fastest backend this CPU supports (detected on every call; cheap after the first,
    /// since `std` caches the CPUID result).
    pub fn detect() -> Self {
        Self::avx512()
            .or_else(Self::avx2_fma)
            .or_else(Self::neon)
            .unwrap_or(Backend::Portable)
    }

    /// Every backend this CPU can run, fastest first; always ends with `Portable`.
    pub fn available() -> impl Iterator<Item = Backend> {
        [
            Self::avx512(),
            Self::avx2_fma(),
            Self::neon(),
            Some(Backend::Portable),
        ]
        .into_iter()
        .flatten()
    }

    /// `Some(Avx512)` if the CPU has AVX-512F, AVX512BW and FMA (every AVX-512 CPU but the
    /// Xeon Phi; those run `Avx2Fma`).
    pub fn avx512() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if crate::arch::avx512::detected() {
            return Some(Backend::Avx512);
        }
        None
    }

    /// `Some(Avx2Fma)` if the CPU has AVX2, FMA and F16C (the backend's f16 conversions), so
    /// that a backend this lists is one whose code runs, not the portable fallback.
    pub fn avx2_fma() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if crate::arch::avx2::detected() {
            return Some(Backend::Avx2Fma);
        }
        None
    }

    /// `Some(Neon)` on AArch64 with NEON (always present on AArch64 Linux/macOS).
    pub fn neon() -> Option<Self> {
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("neon") {
            return Some(Backend::Neon);
        }
        None
    }

    /// Whether the kernels issue software prefetches on this backend unless told otherwise
    /// ([`Cpu::with_software_prefetch`](crate::Cpu::with_software_prefetch)): `false` for
    /// AVX-512 on an AMD CPU, where leaving them out cut the fused forward's streaming time by
    /// 17–19 % on Zen 4 (separate processes alternated), and by 5–8 % with the table
    /// exponential (both settings timed in the same rounds of one process, `grpo-bench vocab
    /// --prefetch both`); `true` everywhere else (on an Intel AVX-512 host they cut it by
    /// 28–33 %). `Portable` issues none either way.
    ///
    /// This is every pass's default but one's: [`Cpu::kl_rows`](crate::Cpu::kl_rows) over two
    /// 16-bit rows prefetches on every backend (see [`Cpu::software_prefetch`](crate::Cpu::software_prefetch)).
    /// On the same Zen 4 host, five runs of `grpo-bench vocab --dtype all --kernel kl
    /// --prefetch both` (2026-12-06) measured its time without them over its time with them
    /// at 1.18–1.29 (bf16) and 1.07–1.22 (f16) at 2048 × 32768, and 0.98–1.05 (bf16) and
    /// 0.90–0.95 (f16) at 512 × 151936, while f32 rows measured 0.89–1.01; bf16 rows of other
    /// lengths medians of 1.10–1.19 (8192, 16384, 50304, 65536, 131072, 262144 logits) and
    /// 0.97–1.00 (98304, 128256, 196608). Without them the bf16 KL at 2048 × 32768 stalled at
    /// about the f32 KL's rows per second (18.7–19.5 against 18.5–18.6 ms), which is bound by
    /// memory, with them it ran at the rate of its arithmetic (15.3–16.8 ms).
    ///
    /// ```
    /// use grpo_cpu::Backend;
    /// assert!(Backend::Portable.software_prefetch_default());
    /// assert!(Backend::Avx2Fma.software_prefetch_default());
    /// ```
    pub fn software_prefetch_default(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Backend::Avx512 => crate::arch::avx512::prefetch_by_default(),
            _ => true,
        }
    }

    /// Whether `pass` prefetches by default on this backend (what a [`Cpu`](crate::Cpu)
    /// runs unless told otherwise): [`software_prefetch_default`](Self::software_prefetch_default),
    /// except that the KL pass over two 16-bit rows prefetches everywhere.
    pub(crate) fn prefetch_default(self, pass: Pass) -> bool {
        match pass {
            Pass::General => self.software_prefetch_default(),
            Pass::NarrowKl => true,
        }
    }

    /// Short lowercase name (`"avx512"`, `"avx2-fma"`, `"neon"`, `"portable"`).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Portable => "portable",
            Backend::Avx2Fma => "avx2-fma",
            Backend::Avx512 => "avx512",
            Backend::Neon => "neon",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Backend, Pass};

    /// Only a KL between two 16-bit rows is the narrow pass: mixed pairs read at least 6 bytes
    /// per logit pair, as many as one f32 row and a half.
    #[test]
    fn the_narrow_kl_pass_is_two_16_bit_rows() {
        use half::{bf16, f16};
        assert_eq!(Pass::kl::<bf16, bf16>(), Pass::NarrowKl);
        assert_eq!(Pass::kl::<f16, bf16>(), Pass::NarrowKl);
        assert_eq!(Pass::kl::<f16, f16>(), Pass::NarrowKl);
        assert_eq!(Pass::kl::<f32, bf16>(), Pass::General);
        assert_eq!(Pass::kl::<bf16, f32>(), Pass::General);
        assert_eq!(Pass::kl::<f32, f32>(), Pass::General);
    }

    #[test]
    fn detection_is_consistent() {
        let all: Vec<_> = Backend::available().collect();
        assert_eq!(all.last(), Some(&Backend::Portable));
        assert_eq!(all[0], Backend::detect());
        #[cfg(target_arch = "x86_64")]
        {
            let has = std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("fma");
            assert_eq!(Backend::avx512().is_some(), has);
            let has = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c");
            assert_eq!(Backend::avx2_fma().is_some(), has);
            assert_eq!(Backend::neon(), None);
        }
        // NEON is part of the AArch64 baseline (CI runs these tests under qemu-aarch64).
        #[cfg(target_arch = "aarch64")]
        assert_eq!(Backend::detect(), Backend::Neon);
    }

    /// AVX-512 prefetches unless the CPU is AMD's, read from the kernel's `vendor_id` (Linux)
    /// independently of the CPUID decoding under test; every other backend prefetches.
    #[test]
    fn software_prefetch_default_follows_the_vendor() {
        for b in [Backend::Portable, Backend::Avx2Fma, Backend::Neon] {
            assert!(b.software_prefetch_default(), "{b:?}");
        }
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        if let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") {
            let vendor = info
                .lines()
                .find_map(|l| l.strip_prefix("vendor_id"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).trim());
            if let Some(vendor) = vendor {
                let amd = vendor == "AuthenticAMD";
                assert_eq!(
                    Backend::Avx512.software_prefetch_default(),
                    !amd,
                    "{vendor}"
                );
            }
        }
    }
}
