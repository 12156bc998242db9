//! The executor: which backend runs the kernels and on which threads.

use std::sync::Arc;

use rayon::{ThreadPool, ThreadPoolBuildError, ThreadPoolBuilder};

use crate::arch::Target;
use crate::backend::{Backend, Pass};

/// Where and how grpo-cpu's kernels run: a [`Backend`] (instruction set), whether its kernels
/// issue software prefetches, and a thread pool.
///
/// Rows of a batch are handed to threads whole, and each row is computed by the same canonical
/// sequence of operations on every backend, so neither the backend nor the thread count changes
/// a single bit of any result.
///
/// Without an explicit pool, work runs on the rayon pool of the calling context (the global pool,
/// or the pool of an enclosing `ThreadPool::install`).
///
/// Software prefetching follows each pass's default ([`Backend::software_prefetch_default`],
/// and on for [`kl_rows`](Cpu::kl_rows) over two 16-bit rows) unless
/// [`with_software_prefetch`](Cpu::with_software_prefetch) says otherwise; it changes speed
/// only, never a bit.
///
/// ```
/// use grpo_cpu::{Backend, Cpu};
/// let cpu = Cpu::new(Backend::Portable).unwrap().with_threads(2).unwrap();
/// assert_eq!(cpu.backend(), Backend::Portable);
/// assert_eq!(cpu.threads(), 2);
/// ```
#[derive(Clone, Debug)]
pub struct Cpu {
    backend: Backend,
    /// `Some(on)`: every pass prefetches (or not) as told; `None`: each follows its default.
    prefetch: Option<bool>,
    pool: Option<Arc<ThreadPool>>,
}

impl Default for Cpu {
    fn default() -> Self {
        Self::detect()
    }
}

impl Cpu {
    /// The fastest backend of this CPU ([`Backend::detect`]) on the caller's rayon pool.
    pub fn detect() -> Self {
        let backend = Backend::detect();
        Cpu {
            backend,
            prefetch: None,
            pool: None,
        }
    }

    /// `backend` on the caller's rayon pool, or `None` if this CPU cannot run it (so tests can
    /// force each backend and skip the missing ones).
    pub fn new(backend: Backend) -> Option<Self> {
        Backend::available().any(|b| b == backend).then_some(Cpu {
            backend,
            prefetch: None,
            pool: None,
        })
    }

    /// The same executor with every kernel's software prefetches on or off, instead of each
    /// pass's default (see [`software_prefetch`](Cpu::software_prefetch)). Only the speed
    /// changes: the requests for cache lines ahead of the streaming loops have no effect on any
    /// result. For measuring which is faster on a CPU we have not tuned for (`grpo-bench vocab
    /// --prefetch on|off|both`).
    ///
    /// ```
    /// use grpo_cpu::Cpu;
    /// let z = [0.5f32, -1.0, 2.0, 0.0];
    /// let (mut a, mut b) = ([0.0f32; 2], [0.0f32; 2]);
    /// let on = Cpu::detect().with_software_prefetch(true);
    /// assert_eq!(on.software_prefetch(), Some(true));
    /// on.stats_rows(&z, 4, 1.0, &mut a[..1], &mut b[..1]).unwrap();
    /// let off = Cpu::detect().with_software_prefetch(false);
    /// off.stats_rows(&z, 4, 1.0, &mut a[1..], &mut b[1..]).unwrap();
    /// assert_eq!((a[0].to_bits(), b[0].to_bits()), (a[1].to_bits(), b[1].to_bits()));
    /// ```
    pub fn with_software_prefetch(mut self, on: bool) -> Self {
        self.prefetch = Some(on);
        self
    }

    /// `Some(on)` if [`with_software_prefetch`](Cpu::with_software_prefetch) set every kernel's
    /// software prefetches, `None` (the default) if each pass follows its own:
    /// [`Backend::software_prefetch_default`] for all but one, and on, whatever the backend,
    /// for the pass of [`kl_rows`](Cpu::kl_rows) when student and teacher are both 16-bit
    /// (bf16 or f16). That pass is bound by its arithmetic rather than by memory, and on the
    /// AMD Zen 4 host where every other pass streams faster without the requests it measured
    /// faster with them (see `Backend::software_prefetch_default`).
    ///
    /// ```
    /// use grpo_cpu::Cpu;
    /// assert_eq!(Cpu::detect().software_prefetch(), None);
    /// assert_eq!(Cpu::detect().with_software_prefetch(false).software_prefetch(), Some(false));
    /// ```
    pub fn software_prefetch(&self) -> Option<bool> {
        self.prefetch
    }

    /// The backend and software-prefetch setting the kernels of `pass` run with
    /// ([`arch::run`](crate::arch::run)).
    pub(crate) fn target(&self, pass: Pass) -> Target {
        Target {
            backend: self.backend,
            prefetch: self
                .prefetch
                .unwrap_or_else(|| self.backend.prefetch_default(pass)),
        }
    }

    /// Runs on a new pool of exactly `threads` threads (`0` = rayon's default count).
    pub fn with_threads(self, threads: usize) -> Result<Self, ThreadPoolBuildError> {
        let pool = ThreadPoolBuilder::new().num_threads(threads).build()?;
        Ok(self.with_pool(Arc::new(pool)))
    }

    /// Runs on the caller's pool.
    pub fn with_pool(mut self, pool: Arc<ThreadPool>) -> Self {
        self.pool = Some(pool);
        self
    }

    /// The instruction set the kernels use.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// How many threads share the rows.
    pub fn threads(&self) -> usize {
        match &self.pool {
            Some(p) => p.current_num_threads(),
            None => rayon::current_num_threads(),
        }
    }

    /// Runs `f` inside this executor's pool.
    pub(crate) fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }

    /// Rows per rayon task for a batch of `rows`: a few tasks per thread so a core slowed by a
    /// neighbour process does not hold up the batch, never splitting a row.
    pub(crate) fn rows_per_task(&self, rows: usize) -> usize {
        rows.div_ceil(self.threads().max(1) * 4).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::Cpu;
    use crate::backend::{Backend, Pass};

    /// Without `with_software_prefetch` each pass follows its own default; with it, every
    /// pass does as told.
    #[test]
    fn software_prefetch_is_per_pass_until_set() {
        for b in Backend::available() {
            let cpu = Cpu::new(b).unwrap();
            assert_eq!(cpu.software_prefetch(), None);
            let streaming = cpu.target(Pass::General);
            assert_eq!(streaming.backend, b);
            assert_eq!(streaming.prefetch, b.software_prefetch_default(), "{b:?}");
            assert!(cpu.target(Pass::NarrowKl).prefetch, "{b:?}");
            for on in [false, true] {
                let set = cpu.clone().with_software_prefetch(on);
                assert_eq!(set.software_prefetch(), Some(on));
                for pass in [Pass::General, Pass::NarrowKl] {
                    assert_eq!(set.target(pass).prefetch, on, "{b:?} {pass:?}");
                }
            }
        }
    }
}
