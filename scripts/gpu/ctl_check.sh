#!/usr/bin/env bash
# tmsctl and the control socket on a real GPU (no Rust needed here). Artefacts in
# ${TMS_BIN_DIR:-target/release}: libtms.so and tmsctl.
#
#  1. `tmsctl demo` on CUDA (explicitly, then with the backend left to auto: it must pick CUDA).
#  2. An unmodified PyTorch program (scripts/gpu/ctl_holder.py) under LD_PRELOAD with
#     TMS_INIT_ENABLE=1 TMS_INIT_ENABLE_CPU_BACKUP=1 allocates ${CTL_CHECK_GIB:-20} GiB of tensors
#     with known contents and waits; `tmsctl pause --pid P` gives the memory back; a second,
#     plain PyTorch process (scripts/gpu/ctl_user.py) allocates more than was free before the
#     pause, writes it and frees it; `tmsctl resume --pid P`; the first program checks that
#     every tensor is intact at the same address.
#
# Prints PASS/FAIL lines and ends with "N passed, M failed"; exits non-zero on any failure.
# Every step has a time limit; children are killed on exit.
#
#   scripts/gpu/ctl_check.sh
#   TMS_BIN_DIR=dir CTL_CHECK_GIB=8 scripts/gpu/ctl_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
GIB=${CTL_CHECK_GIB:-20}
# shellcheck source=scripts/gpu/checks.sh
. scripts/gpu/checks.sh
need_artefacts
ok artefacts

WORK=$(mktemp -d /tmp/tms-ctl-check.XXXXXX)
mkdir -m 700 "$WORK/sockets"
export TMS_SOCKET_DIR="$WORK/sockets"
unset TMS_CONTROL TMS_BACKEND TMS_INIT_ENABLE TMS_INIT_ENABLE_CPU_BACKUP LD_PRELOAD
children=()
cleanup() {
  local p
  for p in "${children[@]}"; do kill "$p" 2>/dev/null; done
  sleep 1
  for p in "${children[@]}"; do kill -9 "$p" 2>/dev/null; done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A field of a JSON document on stdin ('.a.b', numbers as integers).
jget() { python3 -c 'import json,sys
v=json.load(sys.stdin)
for k in sys.argv[1].strip(".").split("."):
    v=v[int(k)] if isinstance(v,list) else v.get(k)
print(v if not isinstance(v,bool) else str(v).lower())' "$1"; }

# "$1" if it is an integer, else 0.
num() { case "$1" in '' | *[!0-9]*) echo 0 ;; *) echo "$1" ;; esac; }

# Sum of a per-tag field of a status document on stdin.
tag_sum() { python3 -c 'import json,sys; print(sum(t[sys.argv[1]] for t in json.load(sys.stdin)["tags"]))' "$1"; }

# --- 0. the machine --------------------------------------------------------------------------
if nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader; then
  ok nvidia-smi
else
  bad nvidia-smi "no usable GPU"
  finish
fi
if timeout 120 python3 -c 'import torch; assert torch.cuda.is_available(); print("torch", torch.__version__)'; then
  ok torch
else
  bad torch "PyTorch with CUDA is needed for the preload check"
fi

# --- 1. tmsctl demo on CUDA ------------------------------------------------------------------
echo
echo "=== tmsctl demo --backend cuda --size 4GiB"
out=$(timeout 600 "$CTL" demo --lib "$LIB" --backend cuda --size 4GiB --timeout 300 2>&1)
rc=$?
echo "$out"
if [ "$rc" -ne 0 ]; then
  bad "demo-cuda" "exit status $rc"
elif grep -q '^driver cuda' <<<"$out" && grep -q '^demo OK' <<<"$out"; then
  ok "demo-cuda"
else
  bad "demo-cuda" "did not report driver cuda and demo OK"
fi

echo
echo "=== tmsctl demo --json (backend auto: must choose CUDA here)"
out=$(timeout 600 "$CTL" demo --lib "$LIB" --size 1GiB --json --timeout 300 2>&1)
rc=$?
echo "$out"
b=$(jget .backend <<<"$out" 2>/dev/null)
g=$(jget .given_back_bytes <<<"$out" 2>/dev/null)
case "$g" in '' | *[!0-9]*) g=0 ;; esac
if [ "$rc" -ne 0 ]; then
  bad "demo-auto-is-cuda" "exit status $rc"
elif [ "$b" = cuda ] && [ "$g" -ge $((900 << 20)) ]; then
  ok "demo-auto-is-cuda (given back $g bytes)"
else
  bad "demo-auto-is-cuda" "backend ${b:-?}, given back $g bytes"
fi

# --- 2. an unmodified PyTorch program, paused from outside ------------------------------------
echo
echo "=== PyTorch under LD_PRELOAD, $GIB GiB, paused and resumed by tmsctl"
probe=$(timeout 120 python3 scripts/gpu/ctl_user.py probe 2>/dev/null | tail -1)
free_start=$(num "$(jget .free <<<"$probe" 2>/dev/null)")
echo "device free at the start: $free_start bytes"
if [ "$free_start" -lt $(((GIB + 8) << 30)) ]; then
  bad "room" "need $((GIB + 8)) GiB free for a $GIB GiB check; set CTL_CHECK_GIB lower"
  finish
fi

env LD_PRELOAD="$LIB" TMS_INIT_ENABLE=1 TMS_INIT_ENABLE_CPU_BACKUP=1 \
  python3 scripts/gpu/ctl_holder.py --gib "$GIB" --dir "$WORK" >"$WORK/holder.log" 2>&1 &
holder_launcher=$!
children+=("$holder_launcher")
holder_tail() { echo "--- holder log (tail)"; tail -n 20 "$WORK/holder.log"; echo "---"; }

deadline=$((SECONDS + 600))
while [ ! -f "$WORK/ready.json" ] && kill -0 "$holder_launcher" 2>/dev/null && [ $SECONDS -lt $deadline ]; do
  sleep 0.5
done
if [ ! -f "$WORK/ready.json" ]; then
  holder_tail
  bad "holder-ready" "the PyTorch program did not get ready"
  finish
fi
P=$(num "$(jget .pid <"$WORK/ready.json")")
children+=("$P")
ok "holder-ready (pid $P)"
# Its socket: <pid>.<pid-namespace>.sock (or <pid>.sock where /proc cannot say the namespace).
SOCK=$(find "$TMS_SOCKET_DIR" -maxdepth 1 -regextype posix-extended -regex ".*/$P(\.[0-9]+)?\.sock" | head -n 1)
[ -S "$SOCK" ] || bad "holder-socket" "no socket of pid $P in $TMS_SOCKET_DIR"

if timeout 60 "$CTL" list | tee "$WORK/list.txt" | grep -Eq "^$P +cuda "; then
  cat "$WORK/list.txt"
  ok "list shows pid $P on cuda"
else
  cat "$WORK/list.txt"
  bad "list" "pid $P on cuda not listed"
fi

s0=$(timeout 60 "$CTL" status --pid "$P" --json)
active0=$(num "$(tag_sum bytes_active <<<"$s0" 2>/dev/null)")
timeout 60 "$CTL" status --pid "$P"
if [ "$active0" -ge $((GIB << 30)) ]; then
  ok "status: $active0 bytes active"
else
  bad "status" "only ${active0:-?} bytes active, expected at least $GIB GiB"
fi

probe=$(timeout 120 python3 scripts/gpu/ctl_user.py probe 2>/dev/null | tail -1)
free_before=$(num "$(jget .free <<<"$probe" 2>/dev/null)")
echo "device free before the pause: $free_before bytes"

t0=$SECONDS
if timeout 900 "$CTL" pause --pid "$P" --timeout 850; then
  ok "pause ($((SECONDS - t0)) s)"
else
  bad "pause" "tmsctl exit status $?"
fi
s1=$(timeout 60 "$CTL" status --pid "$P" --json)
active1=$(tag_sum bytes_active <<<"$s1" 2>/dev/null || echo "?")
paused1=$(num "$(tag_sum bytes_paused <<<"$s1" 2>/dev/null)")
backup1=$(num "$(tag_sum host_backup_bytes <<<"$s1" 2>/dev/null)")
if [ "$active1" = 0 ] && [ "$paused1" = "$active0" ] && [ "$backup1" -ge $((GIB << 30)) ]; then
  ok "status after pause: $paused1 bytes paused, $backup1 bytes of host backup"
else
  bad "status after pause" "active $active1, paused $paused1 (want $active0), host backup $backup1"
fi

need=$((free_before + (GIB << 29)))
if timeout 600 python3 scripts/gpu/ctl_user.py fill --leave-gib 2 --must-exceed "$need"; then
  ok "a second process used the freed memory"
else
  bad "second process" "could not allocate more than $need bytes (free before pause + half the paused size)"
fi

t0=$SECONDS
if timeout 900 "$CTL" resume --pid "$P" --timeout 850; then
  ok "resume ($((SECONDS - t0)) s)"
else
  bad "resume" "tmsctl exit status $?"
fi
s2=$(timeout 60 "$CTL" status --pid "$P" --json)
active2=$(num "$(tag_sum bytes_active <<<"$s2" 2>/dev/null)")
paused2=$(tag_sum bytes_paused <<<"$s2" 2>/dev/null || echo "?")
timeout 60 "$CTL" status --pid "$P"
if [ "$active2" = "$active0" ] && [ "$paused2" = 0 ]; then
  ok "status after resume: $active2 bytes active"
else
  bad "status after resume" "active $active2 (want $active0), paused $paused2"
fi

touch "$WORK/go"
deadline=$((SECONDS + 600))
while kill -0 "$holder_launcher" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.5; done
if kill -0 "$holder_launcher" 2>/dev/null; then
  holder_tail
  bad "holder-verify" "the PyTorch program did not finish"
else
  wait "$holder_launcher"
  rc=$?
  holder_tail
  if [ "$rc" -eq 0 ] && grep -q '^VERIFY OK' "$WORK/holder.log"; then
    ok "tensors intact after resume"
  else
    bad "holder-verify" "exit status $rc"
  fi
fi
if [ -z "$SOCK" ] || [ -e "$SOCK" ]; then
  bad "socket removed at exit" "${SOCK:-the socket} is still there"
else
  ok "socket removed at exit"
fi

finish
