#!/usr/bin/env bash
# Run an engine test executable on CUDA; if it is still running after SECS seconds, print every
# thread's stack (cuda-gdb: the GPU machine has no gdb) and stop it. For hangs seen on a GPU only.
#   bash scripts/gpu/hang_stacks.sh target/engine-tests/nonblocking 60 [test name filter...]
set -u
bin=$1 secs=$2
shift 2
log=$(mktemp)
TMS_TEST_DRIVER=cuda RUST_BACKTRACE=1 "$bin" --test-threads=1 --nocapture "$@" >"$log" 2>&1 &
pid=$!
for _ in $(seq "$secs"); do
  kill -0 "$pid" 2>/dev/null || break
  sleep 1
done
if kill -0 "$pid" 2>/dev/null; then
  echo "== still running after $secs s; stacks:"
  timeout 120 cuda-gdb -batch -p "$pid" -ex 'set pagination off' -ex 'thread apply all bt 25' 2>&1 |
    grep -v '^\[New LWP\|^warning' | head -400
  kill -9 "$pid"
  rc=124
else
  wait "$pid"
  rc=$?
  echo "== finished (exit status $rc)"
fi
tail -40 "$log"
rm -f "$log"
exit "$rc"
