#!/usr/bin/env bash
# The engine's harness tests on a real GPU (no Rust needed here): every test executable in DIR
# (default ${TMS_ENGINE_TESTS:-target/engine-tests}, made by scripts/engine-test-bins where Rust
# is) run with TMS_TEST_DRIVER=cuda, so each engine_test body runs on the CUDA driver (one test
# at a time per executable) and the tests that need the simulated device's hooks say they are
# skipped. Device memory is checked as cuMemGetInfo reports it, within TMS_TEST_CUDA_SLACK bytes
# (default 2 MiB) of what the engine's registry implies.
#
# Prints each executable's output, a PASS/FAIL line per executable, and ends with "N passed,
# M failed"; exits non-zero on any failure. An executable that finds no usable CUDA driver ends
# with status 2 and says why, and the others are not run.
#
#   scripts/gpu/engine_tests.sh [DIR]
#   TMS_TEST_CUDA_SLACK=4MiB scripts/gpu/engine_tests.sh    # more room for the driver's own memory
#   ENGINE_TEST_ARGS="--skip progress" scripts/gpu/engine_tests.sh   # passed to each executable
#   ENGINE_TEST_TIMEOUT=600 scripts/gpu/engine_tests.sh   # seconds per executable (default 300)
set -uo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/gpu/checks.sh
. scripts/gpu/checks.sh
DIR=${1:-${TMS_ENGINE_TESTS:-target/engine-tests}}

mapfile -t bins < <(find "$DIR" -maxdepth 1 -type f -perm -u+x 2>/dev/null | sort)
if [ ${#bins[@]} -eq 0 ]; then
  bad engine "no test executables in $DIR (build them with scripts/engine-test-bins where Rust is, and bring the folder along)"
  finish
fi

export TMS_TEST_DRIVER=cuda
for exe in "${bins[@]}"; do
  name=$(basename "$exe")
  echo
  echo "== $name"
  log=$(mktemp)
  # shellcheck disable=SC2086 # a list of arguments
  # A hang (a bug) fails its executable, not the whole suite's time.
  timeout -k 10 "${ENGINE_TEST_TIMEOUT:-300}" "$exe" ${ENGINE_TEST_ARGS:-} 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "$name: still running after ${ENGINE_TEST_TIMEOUT:-300} s: stopped"
  result=$(grep -E '^test result:' "$log" | tail -n 1)
  rm -f "$log"
  case $rc in
    0) ok "engine $name (${result#test result: })" ;;
    2)
      # The others would say the same.
      bad "engine $name" "the CUDA driver could not be used (see above); the other executables were not run"
      break
      ;;
    *) bad "engine $name" "exit status $rc${result:+, ${result#test result: }}" ;;
  esac
done
finish
