#!/usr/bin/env bash
# A/B of two tms-bench builds in one run on the same machine, alternating, so that host
# variance (fresh memory, huge pages) hits both alike: the way to tell a regression from noise.
#
#   scripts/gpu/ab_bench.sh OLD/tms-bench NEW/tms-bench [ROUNDS] [-- tms-bench args]
#
# Build OLD where Rust is (a worktree at the older commit, cargo build --release -p tms --bin
# tms-bench) and carry both binaries. Default arguments: 16GiB 512 --no-limits --no-plain
# --backend mmap (the first pause into fresh host memory, and the retained cycles). Prints the
# rows of each run, then each row's median per build.
set -uo pipefail
[ $# -ge 2 ] || { sed -n '2,11p' "$0"; exit 2; }
A=$1 B=$2
shift 2
ROUNDS=2
if [ $# -gt 0 ] && [ "$1" != "--" ]; then ROUNDS=$1; shift; fi
[ "${1:-}" = "--" ] && shift
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(16GiB 512 --no-limits --no-plain --backend mmap)
out=$(mktemp)
for r in $(seq 1 "$ROUNDS"); do
  for v in A B; do
    bin=$A; [ $v = B ] && bin=$B
    echo "== round $r, $v ($bin)"
    "$bin" "${ARGS[@]}" 2>&1 | awk -v v=$v '/^[a-z][^ ].*(pause|resume)/{print; print v "\t" $0 >> "'"$out"'"}'
  done
done
echo
echo "MEDIAN SECONDS PER ROW (A = $A, B = $B)"
python3 - "$out" <<'PY'
import re, statistics, sys, collections
rows = collections.defaultdict(lambda: {"A": [], "B": []})
for line in open(sys.argv[1]):
    v, rest = line.rstrip("\n").split("\t", 1)
    m = re.match(r"(.*?)\s{2,}\S+ \S+\s+([0-9.]+)\s", rest)
    if m:
        rows[m.group(1).strip()][v].append(float(m.group(2)))
for name, d in rows.items():
    a = statistics.median(d["A"]) if d["A"] else float("nan")
    b = statistics.median(d["B"]) if d["B"] else float("nan")
    print(f"{name:<56} A {a:8.4f} s   B {b:8.4f} s   B/A {b / a if a else float('nan'):.2f}")
PY
rm -f "$out"
