#!/usr/bin/env bash
# Run tms-bench's backup scenarios under several copy settings in one session, so that what a
# setting buys is read against the same machine's limits (measured once, in the first run).
#   bash scripts/gpu/bench_variants.sh [TOTAL] [COUNT] [extra tms-bench args...]
# Variants: TMS_BENCH_VARIANTS, one per line, each a list of VAR=value settings and tms-bench
# --options (an empty line: the defaults).
# Full tables go to $OUT (or a temporary folder); the rows that matter are printed last.
set -u
BIN=${TMS_BIN_DIR:-target/release}
total=${1:-16GiB}
count=${2:-512}
shift $(($# > 2 ? 2 : $#))
out=${OUT:-$(mktemp -d)}
variants=${TMS_BENCH_VARIANTS:-"
--settle 500
TMS_STREAMING_STORES=1
TMS_STAGING_SLOT=1MiB
TMS_COPY_THREADS=32
TMS_STREAMING_STORES=1 --settle 500"}
run() { # name, env..., -- args...
  local name=$1
  shift
  echo "== $name"
  env TMS_BACKEND=${TMS_BACKEND:-cuda} "$@" >"$out/$name.txt" 2>&1
  echo "   exit status $?"
}
run limits "$BIN/tms-bench" "$total" "$count" --no-plain --no-chunks --backend pinned "$@"
i=0
while IFS= read -r v; do
  i=$((i + 1))
  vars=() opts=()
  for w in $v; do
    case $w in
      *=*) vars+=("$w") ;;
      *) opts+=("$w") ;;
    esac
  done
  run "variant$i" "${vars[@]}" "$BIN/tms-bench" "$total" "$count" --no-limits --no-plain \
    --no-chunks --backend pinned "$@" "${opts[@]}"
  echo "   (${v:-defaults})"
done <<<"$variants"
echo
echo "== limits"
grep -E "parallel fill|populate|page-lock|copy H2D from pinned|copy D2H to pinned|fill sweep|threads\)" \
  "$out/limits.txt" | head -30
for f in "$out"/limits.txt "$out"/variant*.txt; do
  echo
  echo "== $(basename "$f" .txt)"
  grep -E "^tms-bench on" "$f" | sed 's/^tms-bench on the [a-z]* driver: //'
  grep -E "^\S.*(without retention|first pause|resume #[23]|pause #[23])|^  release|PROBLEM|bench OK" "$f"
done
