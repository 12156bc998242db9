// copy.wgsl — the roofline of `grpo-bench wgpu`: memory moved by a shader, as the kernels move
// it. A `copy_buffer_to_buffer` may run far below the bandwidth shaders reach (NVIDIA H200,
// Vulkan: 0.34–0.80 TB/s, against 2.3–3.3 TB/s for this shader and up to 2.95 TB/s read by the
// fused forward), so the benchmark times both copies and takes the faster one as its roofline.
//
// Every invocation copies 16-byte words i, i + S, i + 2S, … (S = invocations in the dispatch):
// 16-byte accesses, coalesced across a workgroup, and a grid of at most one dispatch dimension.

@group(0) @binding(0) var<storage, read> copy_src: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> copy_dst: array<vec4<u32>>;

const COPY_WG: u32 = 256u;

@compute @workgroup_size(256)
fn copy(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(num_workgroups) groups: vec3<u32>) {
    let n = arrayLength(&copy_dst);
    let stride = groups.x * COPY_WG;
    for (var i = gid.x; i < n; i += stride) {
        copy_dst[i] = copy_src[i];
    }
}
