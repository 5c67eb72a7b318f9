#!/usr/bin/env bash
# A long pause to disk on a real GPU, watched as a user watches it: an unmodified PyTorch
# program (scripts/gpu/ctl_holder.py) under LD_PRELOAD with TMS_INIT_ENABLE=1 and a disk backup
# holds ${DISK_GIB:-64} GiB; `tmsctl pause --progress` writes it to disk while `tmsctl status`
# is asked in the middle, then `tmsctl resume --progress` reads it back and the program checks
# every byte at the same addresses. Prints the progress lines, the status seen mid-pause, and
# PASS/FAIL lines; ends with "N passed, M failed".
#
#   scripts/gpu/disk_progress.sh
#   TMS_BIN_DIR=dir DISK_GIB=16 DISK_DIR=/var/tmp scripts/gpu/disk_progress.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
GIB=${DISK_GIB:-64}
# shellcheck source=scripts/gpu/checks.sh
. scripts/gpu/checks.sh
need_artefacts

WORK=$(mktemp -d /tmp/tms-disk-progress.XXXXXX)
mkdir -m 700 "$WORK/sockets"
DISK=$(mktemp -d "${DISK_DIR:-/var/tmp}/tms-disk-progress.XXXXXX")
export TMS_SOCKET_DIR="$WORK/sockets"
unset TMS_CONTROL TMS_BACKEND TMS_INIT_ENABLE TMS_INIT_ENABLE_CPU_BACKUP LD_PRELOAD
holder=
cleanup() {
  [ -n "$holder" ] && kill "$holder" 2>/dev/null
  sleep 1
  [ -n "$holder" ] && kill -9 "$holder" 2>/dev/null
  rm -rf "$WORK" "$DISK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

avail=$(df -B1 --output=avail "$DISK" | tail -n 1 | tr -d ' ')
echo "disk folder $DISK: $((avail >> 30)) GiB free; $(nproc) cores; $(free -g | awk '/Mem:/ {print $2}') GiB RAM"
if [ "$avail" -lt $(((GIB + 2) << 30)) ]; then
  bad room "need $((GIB + 2)) GiB free on the disk for $GIB GiB (set DISK_GIB or DISK_DIR)"
  finish
fi

env LD_PRELOAD="$LIB" TMS_INIT_ENABLE=1 TMS_INIT_ENABLE_DISK_BACKUP=1 TMS_DISK_BACKUP_DIR="$DISK" \
  python3 scripts/gpu/ctl_holder.py --gib "$GIB" --dir "$WORK" >"$WORK/holder.log" 2>&1 &
holder=$!
deadline=$((SECONDS + 600))
while [ ! -f "$WORK/ready.json" ] && kill -0 "$holder" 2>/dev/null && [ $SECONDS -lt $deadline ]; do
  sleep 0.5
done
if [ ! -f "$WORK/ready.json" ]; then
  tail -n 20 "$WORK/holder.log"
  bad holder-ready "the PyTorch program did not get ready"
  finish
fi
P=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["pid"])' "$WORK/ready.json")
echo "holder pid $P: $(head -n 1 "$WORK/holder.log")"

# Mid-pause, what `status` says (text and JSON), as a user would ask.
(
  sleep "${STATUS_AFTER:-6}"
  "$CTL" status --pid "$P" >"$WORK/status.txt" 2>&1
  "$CTL" status --pid "$P" --json >"$WORK/status.json" 2>&1
) &
watcher=$!

echo
echo "=== tmsctl pause --pid $P --progress ($GIB GiB to disk)"
t0=$SECONDS
"$CTL" pause --pid "$P" --progress >"$WORK/pause.out" 2>"$WORK/pause.err"
rc=$?
wait "$watcher"
echo "--- stderr ($(wc -l <"$WORK/pause.err") lines), first 5 and last 3:"
head -n 5 "$WORK/pause.err"
echo "..."
tail -n 3 "$WORK/pause.err"
echo "--- stdout:"
cat "$WORK/pause.out"
echo "--- tmsctl status, ${STATUS_AFTER:-6} s into the pause:"
cat "$WORK/status.txt"
echo "--- the same with --json (operations):"
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d.get("operations"), indent=1))' "$WORK/status.json" 2>&1 | head -n 30
took=$((SECONDS - t0))
[ "$rc" -eq 0 ] && ok "pause ($took s)" || bad pause "exit $rc"
# The two looks mid-pause need a pause longer than the look's wait: say so where it was not.
short=""
if [ "$took" -le "${STATUS_AFTER:-6}" ]; then
  short="the pause took $took s, over before the look at ${STATUS_AFTER:-6} s: set a larger DISK_GIB"
fi
n=$(grep -c . "$WORK/pause.err")
if [ "$n" -ge 5 ] && grep -qi "disk" "$WORK/pause.err"; then
  ok "pause progress ($n lines)"
else
  bad "pause progress" "$n lines${short:+; $short}"
fi
if grep -q "in progress" "$WORK/status.txt" && grep -q '"operations"' "$WORK/status.json"; then
  ok "status shows the pause in progress"
else
  bad "status shows the pause in progress" "$short"
fi
if grep -qi "written to disk" "$WORK/pause.out"; then ok "pause says written to disk"; else bad "pause says written to disk"; fi
files=$(find "$DISK" -type f | wc -l)
used=$(du -sb "$DISK" | cut -f1)
echo "disk folder after the pause: $files files, $((used >> 30)) GiB"

echo
echo "=== tmsctl resume --pid $P --progress"
t0=$SECONDS
"$CTL" resume --pid "$P" --progress >"$WORK/resume.out" 2>"$WORK/resume.err"
rc=$?
echo "--- stderr ($(wc -l <"$WORK/resume.err") lines), first 3 and last 3:"
head -n 3 "$WORK/resume.err"
echo "..."
tail -n 3 "$WORK/resume.err"
echo "--- stdout:"
cat "$WORK/resume.out"
[ "$rc" -eq 0 ] && ok "resume ($((SECONDS - t0)) s)" || bad resume "exit $rc"
if grep -qi "read from disk" "$WORK/resume.out"; then ok "resume says read from disk"; else bad "resume says read from disk"; fi

touch "$WORK/go"
wait "$holder"
hrc=$?
holder=
tail -n 3 "$WORK/holder.log"
if [ "$hrc" -eq 0 ] && grep -q "VERIFY OK" "$WORK/holder.log"; then ok "contents at the same addresses"; else bad verify "holder exit $hrc"; fi
finish
