#!/usr/bin/env bash
# device-check.sh — grpo-wgpu on a machine with a real GPU, in one go (< 8 minutes on 16 cores):
#   1. builds, once and with the test profile (opt-level 1), the GPU test suite and the
#      grpo-bench binary (target/debug/grpo-bench): one wgpu build serves both — the timed work
#      is on the GPU, the host only records and submits, and a second (release) wgpu build would
#      cost minutes;
#   2. runs the GPU test suite with GRPO_REQUIRE_GPU=1 (no adapter = failure) and more proptest
#      cases than CI (GRPO_GPU_CASES, default 256);
#   3. runs `target/debug/grpo-bench wgpu` (grpo-bench's JSON format; kernels on device-resident
#      data, roofline = a device buffer copy timed interleaved in the same run; defaults
#      2048 × 151936 logits and 8 M loss tokens on a GPU, small shapes on a software adapter).
# Output: $OUT_DIR/tests.log (build and test output), $OUT_DIR/build.jsonl (cargo's messages),
# $OUT_DIR/bench.jsonl (one JSON object per line), $OUT_DIR/bench.log (the benchmark's stderr)
# and $OUT_DIR/summary.jsonl (adapter, test result, timings). OUT_DIR defaults to $OUT (the device tool's output folder) or
# target/device-check.
#
# Usage: scripts/device-check.sh            (from the repository root)
# Environment: WGPU_BACKEND (unset: wgpu picks; set `vulkan` to force Vulkan), GRPO_GPU_CASES,
#              BENCH_ARGS (extra `grpo-bench wgpu` arguments, e.g. "--rows 512 --iters 20"),
#              CARGO_FLAGS (e.g. --offline).
set -euo pipefail

cd "$(dirname "$0")/.."
OUT_DIR="${OUT_DIR:-${OUT:-target/device-check}}"
mkdir -p "$OUT_DIR"
export GRPO_REQUIRE_GPU=1
export GRPO_GPU_CASES="${GRPO_GPU_CASES:-256}"
# Mesa/winit probe a Wayland runtime dir and print an error without one; harmless, but noisy.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
CARGO_FLAGS="${CARGO_FLAGS:-}"
t0=$(date +%s)

status=0
gpu_tests=(wgpu_shaders wgpu_vocab wgpu_advantage wgpu_reduce wgpu_loss wgpu_masks)
# One cargo invocation builds the bench binary and the GPU test targets with one feature
# resolution (a separate `cargo test -p grpo-tests` resolves `half`'s features differently and
# would rebuild naga and wgpu); the test executables it reports are then run directly.
# shellcheck disable=SC2086
timeout 240 cargo build $CARGO_FLAGS --profile test --message-format=json-render-diagnostics \
    -p grpo-bench -p grpo-tests --bin grpo-bench "${gpu_tests[@]/#/--test=}" \
    >"$OUT_DIR/build.jsonl" 2>"$OUT_DIR/tests.log" || status=$?
if [[ $status -eq 0 ]]; then
    for t in "${gpu_tests[@]}"; do
        exe=$(grep -o "\"executable\":\"[^\"]*/deps/${t}-[^\"]*\"" "$OUT_DIR/build.jsonl" |
            tail -n 1 | sed 's/^"executable":"//; s/"$//')
        if [[ -z "$exe" ]]; then
            echo "device-check: no executable for $t" >>"$OUT_DIR/tests.log"
            status=1
            continue
        fi
        # As `cargo test` runs them: from the package root; build and tests share 390 s.
        left=$((t0 + 390 - $(date +%s)))
        (cd tests && timeout $((left > 10 ? left : 10)) "$exe" --nocapture) \
            >>"$OUT_DIR/tests.log" 2>&1 || status=$?
    done
fi
t1=$(date +%s)
adapter=$(grep -m1 -o 'adapter "[^"]*"' "$OUT_DIR/tests.log" | sed 's/adapter "//; s/"$//' || true)
passed=$(grep -c '^test .* ok$' "$OUT_DIR/tests.log" || true)
failed=$(grep -c '^test .* FAILED$' "$OUT_DIR/tests.log" || true)
if [[ "$adapter" == *llvmpipe* || "$adapter" == *lavapipe* ]]; then
    echo "device-check: WARNING: the adapter is a software rasteriser ($adapter), not the GPU" >&2
fi

bench_status=0
# The binary built in step 1 (test profile), not a `cargo run` (which could rebuild).
if [[ -x target/debug/grpo-bench ]]; then
    # shellcheck disable=SC2086
    timeout $((450 - (t1 - t0) > 60 ? 450 - (t1 - t0) : 60)) \
        target/debug/grpo-bench wgpu ${BENCH_ARGS:-} \
        >"$OUT_DIR/bench.jsonl" 2>"$OUT_DIR/bench.log" || bench_status=$?
else
    echo "device-check: target/debug/grpo-bench was not built" >"$OUT_DIR/bench.log"
    : >"$OUT_DIR/bench.jsonl"
    bench_status=1
fi
t2=$(date +%s)

printf '{"check":"grpo-wgpu","adapter":"%s","cases":%s,"tests_passed":%s,"tests_failed":%s,"tests_status":%s,"tests_s":%s,"bench_status":%s,"bench_s":%s,"bench_rows":%s}\n' \
    "${adapter//\"/\'}" "$GRPO_GPU_CASES" "${passed:-0}" "${failed:-0}" "$status" "$((t1 - t0))" \
    "$bench_status" "$((t2 - t1))" "$(wc -l <"$OUT_DIR/bench.jsonl")" | tee "$OUT_DIR/summary.jsonl"
cat "$OUT_DIR/bench.jsonl"
if [[ $status -ne 0 ]]; then
    grep -E 'panicked|FAILED|Reason' "$OUT_DIR/tests.log" | head -40 >&2 || true
fi
exit $((status != 0 || bench_status != 0))
