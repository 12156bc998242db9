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
# Usage (from the repository root):
#   scripts/device-check.sh                  build, then run the suite and the benchmark
#   scripts/device-check.sh --pack DIR       build only, and copy the stripped executables into
#                                            DIR (wgpu_* and grpo-bench, about 55 MB; 7 MB as
#                                            tar.xz): for a GPU machine without a Rust toolchain
#                                            or network, built on a machine of the same
#                                            architecture and an older or equal glibc
#   scripts/device-check.sh --prebuilt DIR   no build: run the suite and the benchmark from DIR's
#                                            executables (the repository must still be there:
#                                            the tests run from tests/, as cargo runs them)
# Environment: WGPU_BACKEND (unset: wgpu picks; set `vulkan` to force Vulkan), GRPO_GPU_CASES,
#              SUITE_TIMEOUT (seconds one test executable may run, default 120; a suite that
#              hangs is killed and counted as failed), RUST_TEST_THREADS=1 (one test at a time,
#              so the log names a hanging test), BENCH_ARGS (extra `grpo-bench wgpu`
#              arguments, e.g. "--rows 512 --iters 20"),
#              CARGO_FLAGS (e.g. --offline).
set -euo pipefail

mode=build
dir=
case "${1:-}" in
"") ;;
--pack | --prebuilt)
    [[ $# -eq 2 ]] || { echo "device-check: $1 needs one directory argument" >&2; exit 2; }
    mode=${1#--}
    dir=$(realpath -m "$2")
    ;;
*)
    echo "device-check: unknown argument ${1@Q} (expected --pack DIR or --prebuilt DIR)" >&2
    exit 2
    ;;
esac

cd "$(dirname "$0")/.."
OUT_DIR="${OUT_DIR:-${OUT:-target/device-check}}"
mkdir -p "$OUT_DIR"
export GRPO_REQUIRE_GPU=1
export GRPO_GPU_CASES="${GRPO_GPU_CASES:-256}"
# Mesa/winit probe a Wayland runtime dir and print an error without one; harmless, but noisy.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
CARGO_FLAGS="${CARGO_FLAGS:-}"
SUITE_TIMEOUT="${SUITE_TIMEOUT:-120}"
t0=$(date +%s)

status=0
gpu_tests=(wgpu_shaders wgpu_vocab wgpu_vocab_saved wgpu_advantage wgpu_reduce wgpu_loss wgpu_masks)
bench=target/debug/grpo-bench
if [[ $mode != prebuilt ]]; then
    # One cargo invocation builds the bench binary and the GPU test targets with one feature
    # resolution (a separate `cargo test -p grpo-tests` resolves `half`'s features differently
    # and would rebuild naga and wgpu); the test executables it reports are then run directly.
    # shellcheck disable=SC2086
    timeout 240 cargo build $CARGO_FLAGS --profile test --message-format=json-render-diagnostics \
        -p grpo-bench -p grpo-tests --bin grpo-bench "${gpu_tests[@]/#/--test=}" \
        >"$OUT_DIR/build.jsonl" 2>"$OUT_DIR/tests.log" || status=$?
fi
# The executable of GPU test `$1`: the newest cargo reported, or DIR/$1.
test_exe() {
    if [[ $mode == prebuilt ]]; then
        [[ -x "$dir/$1" ]] && echo "$dir/$1"
    else
        grep -o "\"executable\":\"[^\"]*/deps/${1}-[^\"]*\"" "$OUT_DIR/build.jsonl" |
            tail -n 1 | sed 's/^"executable":"//; s/"$//'
    fi
}
if [[ $mode == pack ]]; then
    [[ $status -eq 0 ]] || { cat "$OUT_DIR/tests.log" >&2; exit 1; }
    mkdir -p "$dir"
    for t in "${gpu_tests[@]}"; do
        strip -o "$dir/$t" "$(test_exe "$t")"
    done
    strip -o "$dir/grpo-bench" "$bench"
    echo "device-check: packed ${gpu_tests[*]} grpo-bench into $dir ($(du -sh "$dir" | cut -f1))"
    exit 0
fi
if [[ $mode == prebuilt ]]; then
    bench="$dir/grpo-bench"
    : >"$OUT_DIR/tests.log"
fi
if [[ $status -eq 0 ]]; then
    for t in "${gpu_tests[@]}"; do
        exe=$(test_exe "$t" || true)
        if [[ -z "$exe" ]]; then
            echo "device-check: no executable for $t" >>"$OUT_DIR/tests.log"
            status=1
            continue
        fi
        # As `cargo test` runs them: from the package root; build and tests share 390 s, and
        # one suite gets at most SUITE_TIMEOUT s (a hung suite must not starve the rest and the
        # benchmark).
        left=$((t0 + 390 - $(date +%s)))
        left=$((left < SUITE_TIMEOUT ? left : SUITE_TIMEOUT))
        echo "device-check: $t" >>"$OUT_DIR/tests.log"
        (cd tests && timeout $((left > 10 ? left : 10)) "$exe" --nocapture) \
            >>"$OUT_DIR/tests.log" 2>&1 || {
            status=$?
            echo "device-check: $t exited with $status (124: killed at its time limit)" \
                >>"$OUT_DIR/tests.log"
        }
    done
fi
t1=$(date +%s)
adapter=$(grep -m1 -o 'adapter "[^"]*"' "$OUT_DIR/tests.log" | sed 's/adapter "//; s/"$//' || true)
# From libtest's summary lines (a test's own output can split its "test … ok" line).
passed=$(sed -n 's/^test result: .* \([0-9]*\) passed; .*/\1/p' "$OUT_DIR/tests.log" |
    awk '{ n += $1 } END { print n + 0 }')
failed=$(sed -n 's/^test result: .* \([0-9]*\) failed; .*/\1/p' "$OUT_DIR/tests.log" |
    awk '{ n += $1 } END { print n + 0 }')
if [[ "$adapter" == *llvmpipe* || "$adapter" == *lavapipe* ]]; then
    echo "device-check: WARNING: the adapter is a software rasteriser ($adapter), not the GPU" >&2
fi

bench_status=0
# The binary built in step 1 (test profile) or packed, not a `cargo run` (which could rebuild).
if [[ -x "$bench" ]]; then
    # shellcheck disable=SC2086
    timeout $((450 - (t1 - t0) > 60 ? 450 - (t1 - t0) : 60)) \
        "$bench" wgpu ${BENCH_ARGS:-} \
        >"$OUT_DIR/bench.jsonl" 2>"$OUT_DIR/bench.log" || bench_status=$?
else
    echo "device-check: $bench was not built" >"$OUT_DIR/bench.log"
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
