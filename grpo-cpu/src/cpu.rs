//! The executor: which backend runs the kernels and on which threads.

use std::sync::Arc;

use rayon::{ThreadPool, ThreadPoolBuildError, ThreadPoolBuilder};

use crate::arch::Target;
use crate::backend::Backend;

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
/// Software prefetching follows [`Backend::software_prefetch_default`] unless
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
    prefetch: bool,
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
            prefetch: backend.software_prefetch_default(),
            pool: None,
        }
    }

    /// `backend` on the caller's rayon pool, or `None` if this CPU cannot run it (so tests can
    /// force each backend and skip the missing ones).
    pub fn new(backend: Backend) -> Option<Self> {
        Backend::available().any(|b| b == backend).then_some(Cpu {
            backend,
            prefetch: backend.software_prefetch_default(),
            pool: None,
        })
    }

    /// The same executor with the kernels' software prefetches on or off (the default is
    /// [`Backend::software_prefetch_default`]). Only the speed changes: the requests for cache
    /// lines ahead of the streaming loops have no effect on any result. For measuring which is
    /// faster on a CPU we have not tuned for (`grpo-bench vocab --prefetch on|off`).
    ///
    /// ```
    /// use grpo_cpu::Cpu;
    /// let z = [0.5f32, -1.0, 2.0, 0.0];
    /// let (mut a, mut b) = ([0.0f32; 2], [0.0f32; 2]);
    /// Cpu::detect().with_software_prefetch(true).stats_rows(&z, 4, 1.0, &mut a[..1], &mut b[..1]).unwrap();
    /// let off = Cpu::detect().with_software_prefetch(false);
    /// assert!(!off.software_prefetch());
    /// off.stats_rows(&z, 4, 1.0, &mut a[1..], &mut b[1..]).unwrap();
    /// assert_eq!((a[0].to_bits(), b[0].to_bits()), (a[1].to_bits(), b[1].to_bits()));
    /// ```
    pub fn with_software_prefetch(mut self, on: bool) -> Self {
        self.prefetch = on;
        self
    }

    /// Whether the kernels issue software prefetches.
    pub fn software_prefetch(&self) -> bool {
        self.prefetch
    }

    /// The compiled code the kernels run ([`arch::run`](crate::arch::run)).
    pub(crate) fn target(&self) -> Target {
        Target {
            backend: self.backend,
            prefetch: self.prefetch,
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
