# Sourced by the GPU check scripts (from the repository root): PASS/FAIL lines and their count,
# and need_artefacts, which checks the artefacts under test ($BIN/libtms.so as LIB, $BIN/tmsctl
# as CTL) for the scripts that use them.
BIN=${TMS_BIN_DIR:-target/release}
export PYTHONUNBUFFERED=1

pass=0
fail=0
ok() { echo "PASS $1"; pass=$((pass + 1)); }
bad() { echo "FAIL $1${2:+: $2}"; fail=$((fail + 1)); }
finish() {
  echo
  echo "$pass passed, $fail failed"
  [ "$fail" -eq 0 ] && exit 0
  exit 1
}

need_artefacts() {
  LIB=$(readlink -f "$BIN/libtms.so" 2>/dev/null || true)
  CTL=$(readlink -f "$BIN/tmsctl" 2>/dev/null || true)
  if [ -z "$LIB" ] || [ ! -f "$LIB" ] || [ -z "$CTL" ] || [ ! -x "$CTL" ]; then
    bad artefacts "need $BIN/libtms.so and $BIN/tmsctl (cargo build --release, then bring them along)"
    finish
  fi
}
