//! [`GpuContext`]: one device and queue, compiled pipelines and reusable buffers.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::error::{GpuError, Result, device_error};
use crate::shaders::ShaderId;

/// How a shader binding is declared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// `var<storage, read>`.
    Read,
    /// `var<storage, read_write>`.
    ReadWrite,
    /// `var<uniform>`.
    Uniform,
}

/// The bindings (group 0) of each module, the union over its entry points: one explicit layout per
/// module lets every entry point share one bind group.
fn slots(id: ShaderId) -> &'static [(u32, Slot)] {
    use Slot::*;
    match id {
        ShaderId::Vocab(_) => &[
            (0, Read),
            (1, Read),
            (2, ReadWrite),
            (3, ReadWrite),
            (4, Uniform),
            (5, Read),
            (6, ReadWrite),
            (7, Read),
            (8, ReadWrite),
        ],
        ShaderId::Advantage => &[
            (0, Read),
            (1, Read),
            (2, ReadWrite),
            (3, ReadWrite),
            (4, Uniform),
            (5, Read),
            (6, ReadWrite),
            (7, Read),
        ],
        ShaderId::Loss => &[
            (0, Read),
            (1, Read),
            (2, Read),
            (3, ReadWrite),
            (4, Uniform),
            (5, ReadWrite),
            (6, ReadWrite),
        ],
        ShaderId::Copy => &[(0, Read), (1, ReadWrite)],
    }
}

/// One argument of a dispatch: bytes to upload, an output to read back, or the uniform block.
#[doc(hidden)]
#[derive(Clone, Copy)]
pub enum Arg<'a> {
    /// Read-only input.
    In(&'a [u8]),
    /// Output of this many bytes (read back).
    Out(u64),
    /// Input that the shader rewrites (read back).
    InOut(&'a [u8]),
    /// Uniform parameters.
    Uniform(&'a [u8]),
    /// Read-only input already on the device ([`GpuContext::upload`]): bound as it is, so
    /// that the dispatches of several submissions read one upload.
    Uploaded(&'a Uploaded<'a>),
}

const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_DST)
    .union(wgpu::BufferUsages::COPY_SRC);
const UNIFORM: wgpu::BufferUsages = wgpu::BufferUsages::UNIFORM.union(wgpu::BufferUsages::COPY_DST);
const STAGING: wgpu::BufferUsages =
    wgpu::BufferUsages::MAP_READ.union(wgpu::BufferUsages::COPY_DST);

/// A wgpu device and queue with everything grpo-wgpu's operations reuse across calls: compiled
/// pipelines (one per shader entry point, built on first use) and a pool of buffers (bucketed by
/// power-of-two size, so a training loop with stable shapes allocates nothing after its first
/// step).
///
/// Create one per process and share it (`&GpuContext` is `Sync`). Each operation uploads its
/// inputs, records all of its dispatches and the copy to a staging buffer in one command buffer,
/// submits once (once per chunk when an input exceeds a binding limit) and reads back.
pub struct GpuContext {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    features: wgpu::Features,
    layouts: Mutex<HashMap<ShaderId, (wgpu::BindGroupLayout, wgpu::PipelineLayout)>>,
    pipelines: Mutex<HashMap<(ShaderId, &'static str), wgpu::ComputePipeline>>,
    pool: Mutex<HashMap<(u32, u64), Vec<wgpu::Buffer>>>,
    binding_cap: std::sync::atomic::AtomicU64,
    groups_cap: std::sync::atomic::AtomicU32,
    uploaded: std::sync::atomic::AtomicU64,
    timeout: Mutex<Option<Duration>>,
}

/// How long a [`GpuContext`] waits for one submission unless told otherwise
/// ([`GpuContext::set_timeout`]): five minutes, far beyond what one chunk of any operation
/// takes even on a software rasteriser (the largest in grpo-bench, 512 × 151936 f32 logits,
/// takes seconds on lavapipe), so that a hung device becomes an error instead of a wait that
/// never ends.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

impl std::fmt::Debug for GpuContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuContext")
            .field("adapter", &self.info.name)
            .field("backend", &self.info.backend)
            .field("features", &self.features)
            .finish_non_exhaustive()
    }
}

impl GpuContext {
    /// Blocking [`GpuContext::new_async`] (through `pollster`).
    ///
    /// # Errors
    /// [`GpuError::NoAdapter`] when wgpu finds no adapter; [`GpuError::Device`] when the device
    /// cannot be created.
    pub fn new() -> Result<Self> {
        pollster::block_on(Self::new_async())
    }

    /// Picks an adapter the way wgpu's examples do — honouring `WGPU_BACKEND` (e.g. `vulkan`),
    /// `WGPU_ADAPTER_NAME` and `WGPU_POWER_PREF` — and opens a device with the adapter's full
    /// limits and, where available, `SHADER_F16` (needed only for f16 logits).
    ///
    /// # Errors
    /// As [`GpuContext::new`].
    pub async fn new_async() -> Result<Self> {
        let instance =
            wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapter = wgpu::util::initialize_adapter_from_env_or_default(&instance, None)
            .await
            .map_err(|e| GpuError::NoAdapter {
                reason: e.to_string(),
            })?;
        Self::from_adapter(&adapter).await
    }

    /// Opens a device on a caller-chosen adapter.
    ///
    /// # Errors
    /// [`GpuError::Device`] when the device cannot be created.
    pub async fn from_adapter(adapter: &wgpu::Adapter) -> Result<Self> {
        let features = adapter.features() & wgpu::Features::SHADER_F16;
        let limits = adapter.limits();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("grpo-wgpu"),
                required_features: features,
                required_limits: limits.clone(),
                ..Default::default()
            })
            .await
            .map_err(device_error)?;
        Ok(GpuContext {
            device,
            queue,
            info: adapter.get_info(),
            limits,
            features,
            layouts: Mutex::new(HashMap::new()),
            pipelines: Mutex::new(HashMap::new()),
            pool: Mutex::new(HashMap::new()),
            binding_cap: std::sync::atomic::AtomicU64::new(u64::MAX),
            groups_cap: std::sync::atomic::AtomicU32::new(u32::MAX),
            uploaded: std::sync::atomic::AtomicU64::new(0),
            timeout: Mutex::new(Some(DEFAULT_TIMEOUT)),
        })
    }

    /// How long each wait for one submission (one chunk of an operation: its dispatches, the
    /// copy to the staging buffers and their mapping) may take before the operation returns
    /// [`GpuError::Timeout`]; `None` waits as long as it takes. [`DEFAULT_TIMEOUT`] until set.
    ///
    /// The blocking operations wait on the device with this limit (wgpu's `PollType::Wait`),
    /// then poll until the staging buffers' map callbacks have run, up to the same deadline;
    /// the `_async` ones poll the device each time the executor polls them, and fail once the
    /// deadline has passed with a mapping still pending. The limit counts from the
    /// submission, and the deadline is checked before the device is polled: outputs not read
    /// back by then are abandoned even if the device has finished them meanwhile (so with a
    /// zero limit every operation fails). An operation that times out leaves its outputs
    /// untouched, and the context stays usable: the device finishes the abandoned work in
    /// submission order before the next operation's, whose wait therefore includes it.
    ///
    /// ```
    /// use std::time::Duration;
    /// use grpo_wgpu::{GpuContext, DEFAULT_TIMEOUT};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// assert_eq!(ctx.timeout(), Some(DEFAULT_TIMEOUT));
    /// ctx.set_timeout(Some(Duration::from_secs(20)));
    /// assert_eq!(ctx.timeout(), Some(Duration::from_secs(20)));
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    pub fn set_timeout(&self, timeout: Option<Duration>) {
        *self.timeout.lock().unwrap_or_else(|p| p.into_inner()) = timeout;
    }

    /// The limit of each wait for one submission ([`GpuContext::set_timeout`]).
    pub fn timeout(&self) -> Option<Duration> {
        *self.timeout.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The adapter's name, backend and driver.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.info
    }

    /// Whether the adapter is a software rasteriser (wgpu's `DeviceType::Cpu`: Mesa lavapipe /
    /// llvmpipe, WARP), where timings measure the CPU, not a GPU.
    pub fn is_software(&self) -> bool {
        self.info.device_type == wgpu::DeviceType::Cpu
    }

    /// The device's limits (the adapter's, requested in full).
    pub fn limits(&self) -> &wgpu::Limits {
        &self.limits
    }

    /// Whether f16 logits are supported (`Features::SHADER_F16`).
    pub fn supports_f16(&self) -> bool {
        self.features.contains(wgpu::Features::SHADER_F16)
    }

    /// The underlying device (to share it with other wgpu code).
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// The underlying queue.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    /// Largest byte size one storage binding may have on this device.
    pub(crate) fn max_binding(&self) -> u64 {
        self.limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
            .min(self.binding_cap.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Test hook: pretend one storage binding may hold at most `bytes` bytes, so the chunking
    /// paths run on small inputs (`u64::MAX` restores the device limit).
    #[doc(hidden)]
    pub fn set_binding_cap(&self, bytes: u64) {
        self.binding_cap
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Test hook: how many bytes this context has written to the device since it was created
    /// (every input and uniform block of every dispatch, zero padding included), so that a
    /// test can check what an operation uploads.
    #[doc(hidden)]
    pub fn bytes_uploaded(&self) -> u64 {
        self.uploaded.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Writes `data` at the start of `buf`, counted by [`GpuContext::bytes_uploaded`]; pads
    /// it with zeros to a multiple of 4 bytes (wgpu's copy alignment).
    fn write(&self, buf: &wgpu::Buffer, data: &[u8]) {
        let padded;
        let data = if data.len().is_multiple_of(4) {
            data
        } else {
            padded = [data, &[0; 3][..4 - data.len() % 4]].concat();
            &padded[..]
        };
        self.uploaded
            .fetch_add(data.len() as u64, std::sync::atomic::Ordering::Relaxed);
        self.queue.write_buffer(buf, 0, data);
    }

    /// Largest number of workgroups in one dispatch dimension.
    pub(crate) fn max_groups(&self) -> u32 {
        self.limits
            .max_compute_workgroups_per_dimension
            .min(self.groups_cap.load(std::sync::atomic::Ordering::Relaxed))
            .max(1)
    }

    /// Test hook: pretend one dispatch dimension may hold at most `groups` workgroups, so the
    /// 2-D dispatch of the one-thread-per-item kernels (and the row chunking of the vocabulary
    /// kernels) runs on small inputs (`u32::MAX` restores the device limit).
    #[doc(hidden)]
    pub fn set_max_workgroups_per_dimension(&self, groups: u32) {
        self.groups_cap
            .store(groups, std::sync::atomic::Ordering::Relaxed);
    }

    /// The workgroup grid covering `items` invocations of a `size`-wide entry point that
    /// linearises its index (`linear_index` in common.wgsl): `[x, y, 1]` with x at most the
    /// per-dimension limit, so a batch of more than `limit · size` items (16.7 M tokens at the
    /// usual 65535 × 256) still runs in one dispatch. `[0, 1, 1]` (skipped) for no items.
    ///
    /// # Errors
    /// [`GpuError::TooManyWorkgroups`] when even the square grid is too small, or when the
    /// grid's invocation indices would overflow the shaders' `u32`.
    pub(crate) fn grid(&self, items: usize, size: u32) -> Result<[u32; 3]> {
        let per_dimension = self.max_groups();
        let max = u64::from(per_dimension);
        let groups = (items as u64).div_ceil(u64::from(size));
        if groups == 0 {
            return Ok([0, 1, 1]);
        }
        let x = groups.min(max);
        let y = groups.div_ceil(x);
        // Every invocation index x·size·y must fit a u32 (the guard `i >= n` sees it unwrapped).
        if y > max
            || items as u64 > u64::from(u32::MAX)
            || x * y * u64::from(size) > u64::from(u32::MAX) + 1
        {
            return Err(GpuError::TooManyWorkgroups {
                needed: groups,
                limit: max
                    .saturating_mul(max)
                    .min((u64::from(u32::MAX) + 1) / u64::from(size)),
                per_dimension,
            });
        }
        Ok([x as u32, y as u32, 1])
    }

    /// `Err(TooLarge)` unless `items` 32-bit words can be indexed by the shaders' `u32`
    /// (`what` names the buffer; sizes in bytes).
    pub(crate) fn check_items(&self, what: &'static str, items: usize) -> Result<()> {
        if items as u64 > u64::from(u32::MAX) {
            return Err(GpuError::TooLarge {
                what,
                bytes: (items as u64).saturating_mul(4),
                limit: u64::from(u32::MAX) * 4,
            });
        }
        Ok(())
    }

    /// Builds (once) and returns the pipeline of one entry point.
    ///
    /// # Errors
    /// [`GpuError::MissingFeature`] if the module needs a feature the device lacks;
    /// [`GpuError::Device`] if wgpu rejects the module (a bug: the test suite validates every
    /// module with naga).
    pub(crate) fn pipeline(
        &self,
        id: ShaderId,
        entry: &'static str,
    ) -> Result<(wgpu::ComputePipeline, wgpu::BindGroupLayout)> {
        if !self.features.contains(id.required_features()) {
            return Err(GpuError::MissingFeature {
                feature: "SHADER_F16",
            });
        }
        let (bgl, layout) = self.layout(id);
        let mut cache = self.pipelines.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = cache.get(&(id, entry)) {
            return Ok((p.clone(), bgl));
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let source = id.source();
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(id.name()),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: Some(&layout),
                module: &module,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(device_error(e));
        }
        cache.insert((id, entry), pipeline.clone());
        Ok((pipeline, bgl))
    }

    fn layout(&self, id: ShaderId) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
        let mut layouts = self.layouts.lock().unwrap_or_else(|p| p.into_inner());
        layouts
            .entry(id)
            .or_insert_with(|| {
                let entries: Vec<wgpu::BindGroupLayoutEntry> = slots(id)
                    .iter()
                    .map(|&(binding, slot)| wgpu::BindGroupLayoutEntry {
                        binding,
                        visibility: wgpu::ShaderStages::COMPUTE,
                        ty: wgpu::BindingType::Buffer {
                            ty: match slot {
                                Slot::Read => wgpu::BufferBindingType::Storage { read_only: true },
                                Slot::ReadWrite => {
                                    wgpu::BufferBindingType::Storage { read_only: false }
                                }
                                Slot::Uniform => wgpu::BufferBindingType::Uniform,
                            },
                            has_dynamic_offset: false,
                            min_binding_size: None,
                        },
                        count: None,
                    })
                    .collect();
                let bgl = self
                    .device
                    .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                        label: Some(id.name()),
                        entries: &entries,
                    });
                let layout = self
                    .device
                    .create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                        label: Some(id.name()),
                        bind_group_layouts: &[Some(&bgl)],
                        immediate_size: 0,
                    });
                (bgl, layout)
            })
            .clone()
    }

    /// A pooled buffer of at least `size` bytes (power-of-two bucket when it fits the limits).
    fn take(&self, usage: wgpu::BufferUsages, size: u64) -> (u64, wgpu::Buffer) {
        let size = size.max(16).next_multiple_of(16);
        let bucket = size
            .checked_next_power_of_two()
            .filter(|&b| b <= self.limits.max_buffer_size)
            .unwrap_or(size);
        let key = (usage.bits(), bucket);
        if let Some(b) = self
            .pool
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&key)
            .and_then(Vec::pop)
        {
            return (bucket, b);
        }
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("grpo-wgpu pooled"),
            size: bucket,
            usage,
            mapped_at_creation: false,
        });
        (bucket, buf)
    }

    fn give(&self, usage: wgpu::BufferUsages, bucket: u64, buf: wgpu::Buffer) {
        self.pool
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((usage.bits(), bucket))
            .or_default()
            .push(buf);
    }

    /// Drops every pooled buffer (they are re-created on demand).
    pub fn release_buffers(&self) {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Uploads `data` into a pooled storage buffer that outlives one submission (see
    /// [`Uploaded`]).
    ///
    /// # Errors
    /// [`GpuError::TooLarge`] over [`GpuContext::max_binding`]; [`GpuError::Device`] when the
    /// device cannot create the buffer.
    pub(crate) fn upload(&self, data: &[u8]) -> Result<Uploaded<'_>> {
        let bytes = (data.len() as u64).max(4).next_multiple_of(4);
        let limit = self.max_binding();
        if bytes > limit {
            return Err(GpuError::TooLarge {
                what: "buffer binding",
                bytes,
                limit,
            });
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let (bucket, buf) = self.take(STORAGE, bytes);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Device {
                message: format!("cannot create an input buffer: {e}"),
            });
        }
        self.write(&buf, data);
        Ok(Uploaded {
            ctx: self,
            bucket,
            buf,
            bytes,
            source: (data.as_ptr() as usize, data.len()),
        })
    }

    /// Creates (or takes from the pool) one buffer per binding of `id`, uploads the inputs, and
    /// checks each binding against [`GpuContext::max_binding`]. Buffer creation runs inside an
    /// out-of-memory and validation error scope, so a buffer the device cannot create is an
    /// `Err(GpuError::Device)` instead of wgpu's uncaptured-error panic.
    fn bind_args(&self, id: ShaderId, args: &[(u32, Arg<'_>)], pooled: bool) -> Result<Vec<Held>> {
        let max_binding = self.max_binding();
        let mut wanted = Vec::new();
        for &(binding, slot) in slots(id) {
            let arg = args.iter().find(|(b, _)| *b == binding).map(|(_, a)| a);
            let (usage, bytes, data): (_, u64, Option<&[u8]>) = match (arg, slot) {
                (Some(Arg::Uniform(d)), _) => (UNIFORM, d.len() as u64, Some(d)),
                (Some(Arg::In(d) | Arg::InOut(d)), _) => (STORAGE, d.len() as u64, Some(d)),
                (Some(Arg::Out(n)), _) => (STORAGE, *n, None),
                (Some(Arg::Uploaded(u)), _) => (STORAGE, u.bytes, None),
                (None, Slot::Uniform) => (UNIFORM, 16, None),
                (None, _) => (STORAGE, 16, None),
            };
            let bytes = bytes.max(4).next_multiple_of(4);
            if bytes > max_binding {
                return Err(GpuError::TooLarge {
                    what: "buffer binding",
                    bytes,
                    limit: max_binding,
                });
            }
            let out = matches!(arg, Some(Arg::Out(_) | Arg::InOut(_)));
            let uploaded = match arg {
                Some(Arg::Uploaded(u)) => Some(u.buf.clone()),
                _ => None,
            };
            wanted.push((binding, usage, bytes, data, out, uploaded));
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let inner = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut held = Vec::with_capacity(wanted.len());
        for (binding, usage, bytes, data, out, uploaded) in wanted {
            if let Some(buf) = uploaded {
                // Bound as it is; its `Uploaded` gives it back to the pool, not this dispatch.
                held.push(Held {
                    binding,
                    usage,
                    bucket: 0,
                    buf,
                    bytes,
                    out,
                    owned: false,
                });
                continue;
            }
            let (bucket, buf) = if pooled {
                self.take(usage, bytes)
            } else {
                let size = bytes.next_multiple_of(16);
                let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("grpo-wgpu resident"),
                    size,
                    usage,
                    mapped_at_creation: false,
                });
                (size, buf)
            };
            if let Some(d) = data {
                self.write(&buf, d);
            }
            held.push(Held {
                binding,
                usage,
                bucket,
                buf,
                bytes,
                out,
                owned: true,
            });
        }
        let errors = pollster::block_on(async { (inner.pop().await, scope.pop().await) });
        if let (Some(e), _) | (None, Some(e)) = errors {
            // Pooled or not, a buffer from a failed creation is not reused.
            return Err(GpuError::Device {
                message: format!("cannot create the buffers of `{}`: {e}", id.name()),
            });
        }
        Ok(held)
    }

    fn bind_group(
        &self,
        id: ShaderId,
        bgl: &wgpu::BindGroupLayout,
        held: &[Held],
    ) -> wgpu::BindGroup {
        let entries: Vec<wgpu::BindGroupEntry<'_>> = held
            .iter()
            .map(|h| wgpu::BindGroupEntry {
                binding: h.binding,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &h.buf,
                    offset: 0,
                    size: wgpu::BufferSize::new(h.bytes),
                }),
            })
            .collect();
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(id.name()),
            layout: bgl,
            entries: &entries,
        })
    }

    fn pipelines(
        &self,
        id: ShaderId,
        passes: &[(&'static str, [u32; 3])],
    ) -> Result<(Vec<Pass>, wgpu::BindGroupLayout)> {
        let mut pipelines = Vec::with_capacity(passes.len());
        let mut bgl = None;
        for &(entry, groups) in passes {
            let (p, l) = self.pipeline(id, entry)?;
            pipelines.push((p, groups));
            bgl = Some(l);
        }
        match bgl {
            Some(bgl) => Ok((pipelines, bgl)),
            None => Err(GpuError::Device {
                message: "no pass to run".into(),
            }),
        }
    }

    /// Uploads `args`, runs `passes` (entry point, workgroup counts) in order in one compute pass,
    /// copies every `Arg::Out` into staging buffers (as few as the device's buffer limits allow),
    /// submits once, and returns a future of the outputs' bytes (in the order of the `Out` args).
    pub(crate) fn submit(
        &self,
        id: ShaderId,
        args: &[(u32, Arg<'_>)],
        passes: &[(&'static str, [u32; 3])],
    ) -> Result<Readback<'_>> {
        let (pipelines, bgl) = self.pipelines(id, passes)?;
        let held = self.bind_args(id, args, true)?;
        let bind_group = self.bind_group(id, &bgl, &held);
        // Outputs are packed into staging buffers of at most one binding's size each: every
        // output fits one binding, and their sum may exceed `max_buffer_size` (a loss over n
        // tokens reads back 12·n bytes).
        let cap = self.max_binding();
        let mut sizes: Vec<u64> = Vec::new();
        let mut ranges = Vec::new();
        for h in held.iter().filter(|h| h.out) {
            let k = sizes.len().wrapping_sub(1);
            match sizes.last_mut() {
                Some(total) if *total + h.bytes <= cap => {
                    ranges.push((k, *total..*total + h.bytes));
                    *total += h.bytes;
                }
                _ => {
                    ranges.push((sizes.len(), 0..h.bytes));
                    sizes.push(h.bytes);
                }
            }
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let staging: Vec<(u64, wgpu::Buffer, u64)> = sizes
            .iter()
            .map(|&total| {
                let (bucket, buf) = self.take(STAGING, total);
                (bucket, buf, total)
            })
            .collect();
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Device {
                message: format!("cannot create the staging buffers of `{}`: {e}", id.name()),
            });
        }
        let mut encoder = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some(id.name()),
            });
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(id.name()),
                timestamp_writes: None,
            });
            pass.set_bind_group(0, &bind_group, &[]);
            for (p, g) in &pipelines {
                if g.iter().all(|&n| n > 0) {
                    pass.set_pipeline(p);
                    pass.dispatch_workgroups(g[0], g[1], g[2]);
                }
            }
        }
        for (h, (k, r)) in held.iter().filter(|h| h.out).zip(&ranges) {
            encoder.copy_buffer_to_buffer(&h.buf, 0, &staging[*k].1, r.start, h.bytes);
        }
        let index = self.queue.submit(Some(encoder.finish()));
        drop(bind_group);
        for h in held.into_iter().filter(|h| h.owned) {
            self.give(h.usage, h.bucket, h.buf);
        }
        Ok(Readback::new(self, staging, ranges, index))
    }

    /// Benchmark hook: uploads `args` once into buffers owned by the returned [`Resident`] and
    /// binds them; each [`Resident::run`] then records `passes`, submits and waits, with every
    /// input resident on the device (no upload, no readback). The matching roofline is
    /// [`GpuContext::resident_copy`].
    ///
    /// ```
    /// use grpo_wgpu::{Arg, GpuContext, ShaderId};
    /// // Without an adapter there is nothing to run on (CI sets GRPO_REQUIRE_GPU=1: fail there).
    /// let Ok(ctx) = GpuContext::new() else {
    /// #   assert_ne!(std::env::var("GRPO_REQUIRE_GPU").as_deref(), Ok("1"), "no GPU adapter");
    ///     return Ok(());
    /// };
    /// // `copy.wgsl` over 32 bytes (two 16-byte words): the input is uploaded here, once.
    /// let src: Vec<u8> = (0..32).collect();
    /// let before = ctx.bytes_uploaded();
    /// let r = ctx.resident(
    ///     ShaderId::Copy,
    ///     &[(0, Arg::In(&src)), (1, Arg::Out(32))],
    ///     &[("copy", [1, 1, 1])],
    /// )?;
    /// assert_eq!((ctx.bytes_uploaded() - before, r.bytes()), (32, 64));
    /// // Nothing has run yet: the output is wgpu's zero-initialised buffer.
    /// assert_eq!(r.read(1)?, [0u8; 32]);
    /// // Each run is one submission on the resident buffers: no upload, no readback (what a
    /// // benchmark times; `r.bytes()` is the traffic it divides by).
    /// r.run()?;
    /// r.run()?;
    /// assert_eq!(ctx.bytes_uploaded() - before, 32);
    /// assert_eq!(r.read(1)?, src);
    /// // Copy binds 0 and 1 only.
    /// assert!(r.read(2).is_err());
    /// # Ok::<(), grpo_wgpu::GpuError>(())
    /// ```
    ///
    /// # Errors
    /// As the kernels: a missing feature, a binding over the device limit
    /// ([`GpuError::TooLarge`]), or a buffer the device cannot create ([`GpuError::Device`]).
    #[doc(hidden)]
    pub fn resident(
        &self,
        id: ShaderId,
        args: &[(u32, Arg<'_>)],
        passes: &[(&'static str, [u32; 3])],
    ) -> Result<Resident<'_>> {
        let (pipelines, bgl) = self.pipelines(id, passes)?;
        let held = self.bind_args(id, args, false)?;
        let bind_group = self.bind_group(id, &bgl, &held);
        let bytes = held.iter().map(|h| h.bytes).sum();
        Ok(Resident {
            ctx: self,
            work: Work::Passes {
                pipelines,
                bind_group,
                buffers: held
                    .into_iter()
                    .map(|h| (h.binding, h.buf, h.bytes))
                    .collect(),
            },
            bytes,
        })
    }

    /// Benchmark hook, a roofline of [`GpuContext::resident`]: a device-side copy of `bytes`
    /// bytes between two buffers (so it reads `bytes` and writes `bytes`), one
    /// `copy_buffer_to_buffer` per [`Resident::run`]. See also
    /// [`GpuContext::resident_shader_copy`].
    ///
    /// # Errors
    /// [`GpuError::TooLarge`] over `max_buffer_size`; [`GpuError::Device`] when the device cannot
    /// create the buffers.
    #[doc(hidden)]
    pub fn resident_copy(&self, bytes: u64) -> Result<Resident<'_>> {
        let bytes = bytes.max(4).next_multiple_of(4);
        if bytes > self.limits.max_buffer_size {
            return Err(GpuError::TooLarge {
                what: "copy buffer",
                bytes,
                limit: self.limits.max_buffer_size,
            });
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let mk = || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("grpo-wgpu copy roofline"),
                size: bytes,
                usage: STORAGE,
                mapped_at_creation: false,
            })
        };
        let (src, dst) = (mk(), mk());
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Device {
                message: format!("cannot create the copy buffers: {e}"),
            });
        }
        Ok(Resident {
            ctx: self,
            work: Work::Copy { src, dst, bytes },
            bytes: 2 * bytes,
        })
    }

    /// [`GpuContext::submit`], then block until the outputs are read back.
    pub(crate) fn run(
        &self,
        id: ShaderId,
        args: &[(u32, Arg<'_>)],
        passes: &[(&'static str, [u32; 3])],
    ) -> Result<Vec<Vec<u8>>> {
        let rb = self.submit(id, args, passes)?;
        rb.wait()
    }

    /// Benchmark hook, a roofline of [`GpuContext::resident`]: the same copy as
    /// [`GpuContext::resident_copy`] (`bytes` rounded up to 16) done by a compute shader
    /// (`copy.wgsl`: 16-byte words, grid-stride), one dispatch per [`Resident::run`]. Some devices
    /// run `copy_buffer_to_buffer` on a copy engine far below the bandwidth shaders reach, others
    /// the other way round; a benchmark should time both.
    ///
    /// # Errors
    /// [`GpuError::TooLarge`] over the storage-binding limit; [`GpuError::Device`] when the
    /// device cannot create the buffers.
    #[doc(hidden)]
    pub fn resident_shader_copy(&self, bytes: u64) -> Result<Resident<'_>> {
        let bytes = bytes.max(16).next_multiple_of(16);
        let groups = (bytes / 16)
            .div_ceil(256)
            .min(u64::from(self.limits.max_compute_workgroups_per_dimension))
            .max(1) as u32;
        self.resident(
            ShaderId::Copy,
            &[(0, Arg::Out(bytes)), (1, Arg::Out(bytes))],
            &[("copy", [groups, 1, 1])],
        )
    }

    /// Blocks until submission `index` has finished on the device, or `deadline` has passed.
    fn wait_for(&self, index: wgpu::SubmissionIndex, deadline: Deadline) -> Result<()> {
        loop {
            let waited = self.device.poll(wgpu::PollType::Wait {
                submission_index: Some(index.clone()),
                timeout: deadline.remaining(),
            });
            match waited {
                Ok(_) => return Ok(()),
                // Some backends cut one wait short (wgpu-hal's OpenGL waits at most about 2 s
                // at a time): wait again with the time that is left.
                Err(wgpu::PollError::Timeout) if !deadline.passed() => {}
                Err(wgpu::PollError::Timeout) => return Err(deadline.error()),
                Err(e) => {
                    return Err(device_error(e));
                }
            }
        }
    }
}

/// A compiled entry point and its workgroup counts.
type Pass = (wgpu::ComputePipeline, [u32; 3]);

/// One bound buffer of a dispatch.
struct Held {
    binding: u32,
    usage: wgpu::BufferUsages,
    bucket: u64,
    buf: wgpu::Buffer,
    /// Bytes bound (a multiple of 4; the buffer may be larger).
    bytes: u64,
    /// Read back after the dispatch.
    out: bool,
    /// Taken for this dispatch (given back to the pool after it), not an [`Uploaded`]'s.
    owned: bool,
}

/// Bytes uploaded once into a pooled storage buffer ([`GpuContext::upload`]) and bound by the
/// dispatches of several submissions ([`Arg::Uploaded`]): an operation whose dispatches run in
/// two submissions (its host work between them needs the first one's results) uploads each
/// input once. The buffer goes back to the pool when this is dropped; a submission that bound
/// it keeps its own reference until the device is done with it.
#[doc(hidden)]
pub struct Uploaded<'c> {
    ctx: &'c GpuContext,
    bucket: u64,
    buf: wgpu::Buffer,
    /// Bytes bound (the uploaded length rounded up to 4).
    bytes: u64,
    /// Address and length of the host bytes it holds (see [`Uploaded::holds`]).
    source: (usize, usize),
}

impl Uploaded<'_> {
    /// Whether these are the very host bytes uploaded (same address, same length): while the
    /// operation that uploaded them borrows them, they cannot have changed.
    pub(crate) fn holds(&self, bytes: &[u8]) -> bool {
        self.source == (bytes.as_ptr() as usize, bytes.len())
    }
}

impl Drop for Uploaded<'_> {
    fn drop(&mut self) {
        self.ctx.give(STORAGE, self.bucket, self.buf.clone());
    }
}

/// Work prepared on the device by [`GpuContext::resident`] or [`GpuContext::resident_copy`]
/// (benchmark hooks): its buffers live as long as it does.
#[doc(hidden)]
pub struct Resident<'c> {
    ctx: &'c GpuContext,
    work: Work,
    bytes: u64,
}

enum Work {
    Passes {
        pipelines: Vec<Pass>,
        bind_group: wgpu::BindGroup,
        /// (binding, buffer, bytes bound) of every argument.
        buffers: Vec<(u32, wgpu::Buffer, u64)>,
    },
    Copy {
        src: wgpu::Buffer,
        dst: wgpu::Buffer,
        bytes: u64,
    },
}

impl std::fmt::Debug for Resident<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resident")
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl Resident<'_> {
    /// Records the work, submits it and blocks until the device has finished it.
    ///
    /// # Errors
    /// [`GpuError::Device`] when waiting fails (a lost device); [`GpuError::Timeout`] past the
    /// context's limit ([`GpuContext::set_timeout`]).
    pub fn run(&self) -> Result<()> {
        let mut encoder = self
            .ctx
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        match &self.work {
            Work::Passes {
                pipelines,
                bind_group,
                ..
            } => {
                let mut pass = encoder.begin_compute_pass(&Default::default());
                pass.set_bind_group(0, bind_group, &[]);
                for (p, g) in pipelines {
                    if g.iter().all(|&n| n > 0) {
                        pass.set_pipeline(p);
                        pass.dispatch_workgroups(g[0], g[1], g[2]);
                    }
                }
            }
            Work::Copy { src, dst, bytes } => {
                encoder.copy_buffer_to_buffer(src, 0, dst, 0, *bytes);
            }
        }
        let deadline = Deadline::start(self.ctx.timeout());
        let index = self.ctx.queue.submit(Some(encoder.finish()));
        self.ctx.wait_for(index, deadline)
    }

    /// Bytes of device memory the work holds bound (a copy: source plus destination).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The bytes bound at `binding` as the device holds them now (after a [`Resident::run`]:
    /// what the kernel wrote there), so that a test can check that the benchmarked work
    /// computes what the public operation computes. A copy's work has no bindings.
    ///
    /// # Errors
    /// [`GpuError::Core`] (`InvalidParam { name: "binding" }`) for a binding outside the
    /// shader's layout, or any binding of a copy's work (every binding of the layout is held:
    /// one the operation leaves unused holds a 16-byte placeholder, which reads as zeros);
    /// [`GpuError::Device`] when the read-back fails; [`GpuError::Timeout`] past the context's
    /// limit ([`GpuContext::set_timeout`]).
    pub fn read(&self, binding: u32) -> Result<Vec<u8>> {
        let found = match &self.work {
            Work::Passes { buffers, .. } => buffers.iter().find(|(b, _, _)| *b == binding),
            Work::Copy { .. } => None,
        };
        let Some((_, buf, bytes)) = found else {
            return Err(GpuError::Core(grpo_core::Error::InvalidParam {
                name: "binding",
                reason: "not one the resident work holds",
            }));
        };
        let scope = self
            .ctx
            .device
            .push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let (bucket, staging) = self.ctx.take(STAGING, *bytes);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Device {
                message: format!("cannot create the read-back buffer: {e}"),
            });
        }
        let mut encoder = self.ctx.device.create_command_encoder(&Default::default());
        encoder.copy_buffer_to_buffer(buf, 0, &staging, 0, *bytes);
        let index = self.ctx.queue.submit(Some(encoder.finish()));
        // Through `Readback`, which polls the device until the mapping's callback has run:
        // waiting for the copy's submission alone left the buffer unmapped in about one run of
        // `wgpu_loss` in fifteen on lavapipe ("the read-back buffer was not mapped").
        let staging = vec![(bucket, staging, *bytes)];
        let out = Readback::new(self.ctx, staging, vec![(0, 0..*bytes)], index).wait()?;
        out.into_iter().next().ok_or_else(|| GpuError::Device {
            message: "the read-back returned no output".into(),
        })
    }
}

/// When a wait for one submission gives up: its limit ([`GpuContext::timeout`]) counted from
/// the submission.
#[derive(Debug, Clone, Copy)]
struct Deadline {
    started: Instant,
    limit: Option<Duration>,
}

impl Deadline {
    /// A deadline `limit` from now (none for `None`).
    fn start(limit: Option<Duration>) -> Self {
        Deadline {
            started: Instant::now(),
            limit,
        }
    }

    /// The time left (zero once passed), or `None` without a limit.
    fn remaining(&self) -> Option<Duration> {
        self.limit.map(|l| l.saturating_sub(self.started.elapsed()))
    }

    /// Whether the deadline has passed.
    fn passed(&self) -> bool {
        self.remaining() == Some(Duration::ZERO)
    }

    /// The error of a wait that ran out of time.
    fn error(&self) -> GpuError {
        GpuError::Timeout {
            limit: self.limit.unwrap_or(Duration::MAX),
        }
    }
}

/// Outstanding map callbacks, and the first mapping error.
type MapState = Arc<Mutex<(usize, Option<wgpu::BufferAsyncError>)>>;

/// The pending outputs of one submission: `.await` it (it drives the device with non-blocking
/// polls, yielding to the executor in between) or call [`Readback::wait`] to block.
pub(crate) struct Readback<'a> {
    ctx: &'a GpuContext,
    /// (bucket, buffer, bytes mapped) of each staging buffer.
    staging: Vec<(u64, wgpu::Buffer, u64)>,
    /// (staging buffer, byte range) of each output.
    ranges: Vec<(usize, core::ops::Range<u64>)>,
    index: wgpu::SubmissionIndex,
    state: MapState,
    deadline: Deadline,
    done: bool,
}

impl<'a> Readback<'a> {
    /// Maps `staging` (bucket, buffer, bytes to map) for reading once submission `index`, which
    /// copies the outputs there, is done; output `k` is the byte range `ranges[k].1` of staging
    /// buffer `ranges[k].0`. The buffers go back to `ctx`'s pool when the outputs are read.
    /// The wait's deadline ([`GpuContext::timeout`]) counts from here, just after the submission.
    fn new(
        ctx: &'a GpuContext,
        staging: Vec<(u64, wgpu::Buffer, u64)>,
        ranges: Vec<(usize, core::ops::Range<u64>)>,
        index: wgpu::SubmissionIndex,
    ) -> Self {
        let state: MapState = Arc::new(Mutex::new((staging.len(), None)));
        for (_, buf, total) in &staging {
            let s2 = Arc::clone(&state);
            buf.map_async(wgpu::MapMode::Read, 0..*total, move |r| {
                let mut s = s2.lock().unwrap_or_else(|p| p.into_inner());
                s.0 -= 1;
                if let Err(e) = r {
                    s.1.get_or_insert(e);
                }
            });
        }
        Readback {
            ctx,
            staging,
            ranges,
            index,
            state,
            deadline: Deadline::start(ctx.timeout()),
            done: false,
        }
    }

    /// Blocks until the GPU is done, then returns the outputs; [`GpuError::Timeout`] when the
    /// submission or the mappings are not done by the deadline. As the awaited form, a wait
    /// that begins after its deadline fails without asking the device.
    pub(crate) fn wait(mut self) -> Result<Vec<Vec<u8>>> {
        if self.deadline.passed() {
            return Err(self.deadline.error());
        }
        self.ctx.wait_for(self.index.clone(), self.deadline)?;
        loop {
            if let Some(out) = self.step() {
                return out;
            }
            // The submission is done, but another thread's poll may have collected its map
            // callbacks and not run them yet: give that thread the core.
            std::thread::yield_now();
        }
    }

    /// One step of the wait: the outputs once every map callback has run, an error (a
    /// mapping's, the device's, or the deadline's), or `None` while a mapping is pending, after
    /// one non-blocking poll of the device. The deadline is checked before the device is
    /// polled, so an operation whose outputs were not collected by its deadline fails whether
    /// or not the device has finished meanwhile: with a zero limit every operation fails.
    fn step(&mut self) -> Option<Result<Vec<Vec<u8>>>> {
        let (pending, error) = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            (s.0, s.1.take())
        };
        if let Some(e) = error {
            return Some(Err(device_error(e)));
        }
        if pending == 0 {
            return Some(self.finish());
        }
        if self.deadline.passed() {
            return Some(Err(self.deadline.error()));
        }
        if let Err(e) = self.ctx.device.poll(wgpu::PollType::Poll) {
            return Some(Err(device_error(e)));
        }
        None
    }

    fn finish(&mut self) -> Result<Vec<Vec<u8>>> {
        if self.done {
            return Err(GpuError::Device {
                message: "readback polled after completion".into(),
            });
        }
        self.done = true;
        let mut out = Vec::with_capacity(self.ranges.len());
        {
            let views = self
                .staging
                .iter()
                .map(|(_, buf, total)| buf.get_mapped_range(0..*total).map_err(device_error))
                .collect::<Result<Vec<_>>>()?;
            for (k, r) in &self.ranges {
                out.push(views[*k][r.start as usize..r.end as usize].to_vec());
            }
        }
        for (bucket, buf, _) in self.staging.drain(..) {
            buf.unmap();
            self.ctx.give(STAGING, bucket, buf);
        }
        Ok(out)
    }
}

impl Future for Readback<'_> {
    type Output = Result<Vec<Vec<u8>>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut().step() {
            Some(out) => Poll::Ready(out),
            None => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }
}
