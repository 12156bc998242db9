#!/usr/bin/env bash
# device-check.sh — grpo-wgpu on a machine with a real GPU, in one go (< 8 minutes on 16 cores):
#   1. builds and runs the GPU test suite with GRPO_REQUIRE_GPU=1 (no adapter = failure) and more
#      proptest cases than CI (GRPO_GPU_CASES, default 256);
#   2. runs the wgpu benchmark rows (grpo-wgpu/examples/bench.rs, grpo-bench's JSON format, roofline
#      = a device buffer copy timed in the same run). It is built with the test profile
#      (opt-level 1), reusing step 1's wgpu build: the timed work is on the GPU, the host only
#      records and submits, and a second (release) wgpu build would cost minutes.
# Output: $OUT_DIR/tests.log, $OUT_DIR/bench.jsonl (one JSON object per line) and
# $OUT_DIR/summary.jsonl (adapter, test result, timings). OUT_DIR defaults to $OUT (the device
# tool's output folder) or target/device-check.
#
# Usage: scripts/device-check.sh            (from the repository root)
# Environment: WGPU_BACKEND (unset: wgpu picks; set `vulkan` to force Vulkan), GRPO_GPU_CASES,
#              BENCH_ROWS (512), BENCH_VOCAB (151936), BENCH_ITERS (20), CARGO_FLAGS (e.g. --offline).
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
# shellcheck disable=SC2086
timeout 330 cargo test $CARGO_FLAGS -p grpo-tests \
    --test wgpu_shaders --test wgpu_vocab --test wgpu_advantage --test wgpu_loss \
    -- --nocapture >"$OUT_DIR/tests.log" 2>&1 || status=$?
t1=$(date +%s)
adapter=$(grep -m1 -o 'adapter "[^"]*"' "$OUT_DIR/tests.log" | sed 's/adapter "//; s/"$//' || true)
passed=$(grep -c '^test .* ok$' "$OUT_DIR/tests.log" || true)
failed=$(grep -c '^test .* FAILED$' "$OUT_DIR/tests.log" || true)
if [[ "$adapter" == *llvmpipe* || "$adapter" == *lavapipe* ]]; then
    echo "device-check: WARNING: the adapter is a software rasteriser ($adapter), not the GPU" >&2
fi

bench_status=0
# shellcheck disable=SC2086
timeout $((450 - (t1 - t0) > 60 ? 450 - (t1 - t0) : 60)) \
    cargo run $CARGO_FLAGS --profile test -p grpo-wgpu --example bench -- \
    --rows "${BENCH_ROWS:-512}" --vocab "${BENCH_VOCAB:-151936}" --iters "${BENCH_ITERS:-20}" \
    >"$OUT_DIR/bench.jsonl" 2>"$OUT_DIR/bench.log" || bench_status=$?
t2=$(date +%s)

printf '{"check":"grpo-wgpu","adapter":"%s","cases":%s,"tests_passed":%s,"tests_failed":%s,"tests_status":%s,"tests_s":%s,"bench_status":%s,"bench_s":%s,"bench_rows":%s}\n' \
    "${adapter//\"/\'}" "$GRPO_GPU_CASES" "${passed:-0}" "${failed:-0}" "$status" "$((t1 - t0))" \
    "$bench_status" "$((t2 - t1))" "$(wc -l <"$OUT_DIR/bench.jsonl")" | tee "$OUT_DIR/summary.jsonl"
cat "$OUT_DIR/bench.jsonl"
if [[ $status -ne 0 ]]; then
    grep -E 'panicked|FAILED|Reason' "$OUT_DIR/tests.log" | head -40 >&2 || true
fi
exit $((status != 0 || bench_status != 0))
