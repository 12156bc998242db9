//! [`GpuContext`]: one device and queue, compiled pipelines and reusable buffers.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use crate::error::{GpuError, Result};
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
    }
}

/// One argument of a dispatch: bytes to upload, an output to read back, or the uniform block.
#[doc(hidden)]
pub enum Arg<'a> {
    /// Read-only input.
    In(&'a [u8]),
    /// Output of this many bytes (read back).
    Out(u64),
    /// Input that the shader rewrites (read back).
    InOut(&'a [u8]),
    /// Uniform parameters.
    Uniform(&'a [u8]),
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
}

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
            .map_err(|e| GpuError::Device {
                message: e.to_string(),
            })?;
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
        })
    }

    /// The adapter's name, backend and driver.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.info
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

    /// Largest number of workgroups in one dispatch dimension.
    pub(crate) fn max_groups(&self) -> u32 {
        self.limits.max_compute_workgroups_per_dimension
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
            return Err(GpuError::Device {
                message: e.to_string(),
            });
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

    /// Uploads `args`, runs `passes` (entry point, workgroup counts) in order in one compute pass,
    /// copies every `Arg::Out` into one staging buffer, submits once, and returns a future of the
    /// outputs' bytes (in the order of the `Out` args).
    pub(crate) fn submit(
        &self,
        id: ShaderId,
        args: &[(u32, Arg<'_>)],
        passes: &[(&'static str, [u32; 3])],
    ) -> Result<Readback<'_>> {
        let mut pipelines = Vec::with_capacity(passes.len());
        let mut bgl = None;
        for &(entry, groups) in passes {
            let (p, l) = self.pipeline(id, entry)?;
            pipelines.push((p, groups));
            bgl = Some(l);
        }
        let Some(bgl) = bgl else {
            return Err(GpuError::Device {
                message: "no pass to run".into(),
            });
        };
        let max_binding = self.max_binding();
        let mut held: Vec<(wgpu::BufferUsages, u64, wgpu::Buffer)> = Vec::new();
        let mut bound: Vec<(u32, usize, u64)> = Vec::new(); // (binding, index in held, bytes)
        let mut outs: Vec<(usize, u64)> = Vec::new(); // (index in held, bytes)
        for &(binding, slot) in slots(id) {
            let arg = args.iter().find(|(b, _)| *b == binding).map(|(_, a)| a);
            let (usage, bytes, data): (_, u64, Option<&[u8]>) = match (arg, slot) {
                (Some(Arg::Uniform(d)), _) => (UNIFORM, d.len() as u64, Some(d)),
                (Some(Arg::In(d)), _) => (STORAGE, d.len() as u64, Some(d)),
                (Some(Arg::Out(n)), _) => (STORAGE, *n, None),
                (Some(Arg::InOut(d)), _) => (STORAGE, d.len() as u64, Some(d)),
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
            let (bucket, buf) = self.take(usage, bytes);
            if let Some(d) = data {
                if d.len() % 4 == 0 {
                    self.queue.write_buffer(&buf, 0, d);
                } else {
                    let mut padded = d.to_vec();
                    padded.resize(d.len().next_multiple_of(4), 0);
                    self.queue.write_buffer(&buf, 0, &padded);
                }
            }
            if matches!(arg, Some(Arg::Out(_) | Arg::InOut(_))) {
                outs.push((held.len(), bytes));
            }
            bound.push((binding, held.len(), bytes));
            held.push((usage, bucket, buf));
        }
        let entries: Vec<wgpu::BindGroupEntry<'_>> = bound
            .iter()
            .map(|&(binding, i, bytes)| wgpu::BindGroupEntry {
                binding,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &held[i].2,
                    offset: 0,
                    size: wgpu::BufferSize::new(bytes),
                }),
            })
            .collect();
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(id.name()),
            layout: &bgl,
            entries: &entries,
        });
        let total: u64 = outs.iter().map(|&(_, b)| b).sum();
        let (staging_bucket, staging) = self.take(STAGING, total);
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
        let mut ranges = Vec::with_capacity(outs.len());
        let mut offset = 0u64;
        for &(i, bytes) in &outs {
            encoder.copy_buffer_to_buffer(&held[i].2, 0, &staging, offset, bytes);
            ranges.push(offset..offset + bytes);
            offset += bytes;
        }
        let index = self.queue.submit(Some(encoder.finish()));
        drop(bind_group);
        for (usage, bucket, buf) in held {
            self.give(usage, bucket, buf);
        }
        let state = Arc::new(Mutex::new(None));
        let s2 = Arc::clone(&state);
        if total > 0 {
            staging.map_async(wgpu::MapMode::Read, 0..total, move |r| {
                *s2.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            });
        } else {
            *state.lock().unwrap_or_else(|p| p.into_inner()) = Some(Ok(()));
        }
        Ok(Readback {
            ctx: self,
            staging: Some((staging_bucket, staging)),
            ranges,
            total,
            index,
            state,
        })
    }

    /// Benchmark hook: uploads `args` once, then times `iters` rounds of (record `passes`, submit,
    /// wait) with inputs resident on the device; returns each round's wall time in ms. The
    /// matching roofline is [`GpuContext::bench_copy`].
    #[doc(hidden)]
    pub fn bench_resident(
        &self,
        id: ShaderId,
        args: &[(u32, Arg<'_>)],
        passes: &[(&'static str, [u32; 3])],
        iters: usize,
    ) -> Result<Vec<f64>> {
        let mut pipelines = Vec::new();
        let mut bgl = None;
        for &(entry, groups) in passes {
            let (p, l) = self.pipeline(id, entry)?;
            pipelines.push((p, groups));
            bgl = Some(l);
        }
        let Some(bgl) = bgl else {
            return Ok(Vec::new());
        };
        let mut bufs = Vec::new();
        for &(binding, slot) in slots(id) {
            let arg = args.iter().find(|(b, _)| *b == binding).map(|(_, a)| a);
            let (usage, bytes, data): (_, u64, Option<&[u8]>) = match (arg, slot) {
                (Some(Arg::Uniform(d)), _) => (UNIFORM, d.len() as u64, Some(d)),
                (Some(Arg::In(d) | Arg::InOut(d)), _) => (STORAGE, d.len() as u64, Some(d)),
                (Some(Arg::Out(n)), _) => (STORAGE, *n, None),
                (None, Slot::Uniform) => (UNIFORM, 16, None),
                (None, _) => (STORAGE, 16, None),
            };
            let bytes = bytes.max(4).next_multiple_of(4);
            let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("grpo-wgpu bench"),
                size: bytes.next_multiple_of(16),
                usage,
                mapped_at_creation: false,
            });
            if let Some(d) = data {
                let mut padded = d.to_vec();
                padded.resize(d.len().next_multiple_of(4), 0);
                self.queue.write_buffer(&buf, 0, &padded);
            }
            bufs.push((binding, buf, bytes));
        }
        let entries: Vec<wgpu::BindGroupEntry<'_>> = bufs
            .iter()
            .map(|(binding, buf, bytes)| wgpu::BindGroupEntry {
                binding: *binding,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: buf,
                    offset: 0,
                    size: wgpu::BufferSize::new(*bytes),
                }),
            })
            .collect();
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("bench"),
            layout: &bgl,
            entries: &entries,
        });
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters + 1 {
            let t = std::time::Instant::now();
            let mut encoder = self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            {
                let mut pass = encoder.begin_compute_pass(&Default::default());
                pass.set_bind_group(0, &bind_group, &[]);
                for (p, g) in &pipelines {
                    pass.set_pipeline(p);
                    pass.dispatch_workgroups(g[0], g[1], g[2]);
                }
            }
            let index = self.queue.submit(Some(encoder.finish()));
            self.device
                .poll(wgpu::PollType::Wait {
                    submission_index: Some(index),
                    timeout: None,
                })
                .map_err(|e| GpuError::Device {
                    message: e.to_string(),
                })?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        times.remove(0);
        Ok(times)
    }

    /// Roofline for [`GpuContext::bench_resident`]: times `iters` device-side copies of `bytes`
    /// bytes between two storage buffers (submit + wait each), in ms.
    #[doc(hidden)]
    pub fn bench_copy(&self, bytes: u64, iters: usize) -> Result<Vec<f64>> {
        let bytes = bytes.max(4).next_multiple_of(4);
        let mk = || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("bench copy"),
                size: bytes,
                usage: STORAGE,
                mapped_at_creation: false,
            })
        };
        let (a, b) = (mk(), mk());
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters + 1 {
            let t = std::time::Instant::now();
            let mut encoder = self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            encoder.copy_buffer_to_buffer(&a, 0, &b, 0, bytes);
            let index = self.queue.submit(Some(encoder.finish()));
            self.device
                .poll(wgpu::PollType::Wait {
                    submission_index: Some(index),
                    timeout: None,
                })
                .map_err(|e| GpuError::Device {
                    message: e.to_string(),
                })?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        times.remove(0);
        Ok(times)
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
}

type MapState = Arc<Mutex<Option<core::result::Result<(), wgpu::BufferAsyncError>>>>;

/// The pending outputs of one submission: `.await` it (it drives the device with non-blocking
/// polls, yielding to the executor in between) or call [`Readback::wait`] to block.
pub(crate) struct Readback<'a> {
    ctx: &'a GpuContext,
    staging: Option<(u64, wgpu::Buffer)>,
    ranges: Vec<core::ops::Range<u64>>,
    total: u64,
    index: wgpu::SubmissionIndex,
    state: MapState,
}

impl Readback<'_> {
    /// Blocks until the GPU is done, then returns the outputs.
    pub(crate) fn wait(mut self) -> Result<Vec<Vec<u8>>> {
        self.ctx
            .device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(self.index.clone()),
                timeout: None,
            })
            .map_err(|e| GpuError::Device {
                message: e.to_string(),
            })?;
        pollster::block_on(&mut self)
    }

    fn finish(&mut self) -> Result<Vec<Vec<u8>>> {
        let Some((bucket, staging)) = self.staging.take() else {
            return Err(GpuError::Device {
                message: "readback polled after completion".into(),
            });
        };
        let out = {
            let view = if self.total > 0 {
                Some(
                    staging
                        .get_mapped_range(0..self.total)
                        .map_err(|e| GpuError::Device {
                            message: e.to_string(),
                        })?,
                )
            } else {
                None
            };
            self.ranges
                .iter()
                .map(|r| {
                    view.as_ref()
                        .map(|v| v[r.start as usize..r.end as usize].to_vec())
                        .unwrap_or_default()
                })
                .collect()
        };
        if self.total > 0 {
            staging.unmap();
        }
        self.ctx.give(STAGING, bucket, staging);
        Ok(out)
    }
}

impl Future for Readback<'_> {
    type Output = Result<Vec<Vec<u8>>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let done = this.state.lock().unwrap_or_else(|p| p.into_inner()).take();
        match done {
            Some(Ok(())) => Poll::Ready(this.finish()),
            Some(Err(e)) => Poll::Ready(Err(GpuError::Device {
                message: e.to_string(),
            })),
            None => {
                if let Err(e) = this.ctx.device.poll(wgpu::PollType::Poll) {
                    return Poll::Ready(Err(GpuError::Device {
                        message: e.to_string(),
                    }));
                }
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }
}
