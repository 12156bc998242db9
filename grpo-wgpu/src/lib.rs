//! # grpo-wgpu
//!
//! The GPU backend of grpo-kernels: WGSL compute shaders (in the workspace's `shaders/`) run
//! through wgpu on Vulkan, Metal, DX12 or GL, equal to grpo-core within a documented tolerance.
//!
//! Status: **not implemented yet.** This crate exposes no operation; the shaders, the
//! `GpuContext` and the tolerance-checked test suite arrive with the GPU-backend issue. Use
//! grpo-core (or grpo-cpu) meanwhile.
