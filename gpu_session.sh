#!/usr/bin/env bash
# One device session: benches, then the full GPU suite. Logs in /tmp/tmsrun.
L=/tmp/tmsrun; mkdir -p $L
cd "$(dirname "$0")"
{
  echo "### chunks bench"; target/release/tms-bench 16GiB 512 --chunks-only
} > $L/chunks.log 2>&1
{
  scripts/gpu/ab_bench.sh target/oldbench/tms-bench target/release/tms-bench 4
  for v in target/oldbench/tms-bench target/release/tms-bench; do
    echo "### debug round $v"
    TMS_LOG=tms=debug $v 16GiB 512 --no-limits --no-plain --backend mmap 2>&1 | grep -E "pipeline|paused|resumed|first pause|^  " | head -80
  done
} > $L/ab.log 2>&1
OUT=$L/suite scripts/gpu-test > $L/suite.log 2>&1
touch $L/DONE
