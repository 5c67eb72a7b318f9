#!/usr/bin/env python3
"""A/B of two tms-bench builds in one run: `bench_ab.py OLD_BIN NEW_BIN [ARGS...]`.

Runs OLD and NEW alternately (`TMS_AB_ROUNDS` rounds each, default 2, at least 2: A B A B, so
that drift of the machine hits both alike) with the same arguments, parses every row the
benchmark prints (`  <what> <seconds> s <rate> GiB/s`), and prints per row the best time of each
side, the ratio, and the noise: the larger spread between a side's own rounds. A row is flagged
SLOWER when NEW's best is slower than OLD's best by more than that noise plus 3%. Exits 1 if a
run failed or a row is flagged; with `TMS_AB_REPORT_ONLY=1` (a measurement, where NEW may cost
more by design) only if a run failed; 2, running nothing, where TMS_AB_ROUNDS is under 2.
Timings are reported, never asserted elsewhere.
"""
import os
import re
import subprocess
import sys
import time

ROW = re.compile(r"^  (\S.*?)\s+([0-9.]+) s\s+([0-9.]+) GiB/s\s*$")


def run(binary, args):
    p = subprocess.run([binary, *args], capture_output=True, text=True)
    rows = {}
    for line in p.stdout.splitlines():
        m = ROW.match(line)
        if m:
            rows.setdefault(m.group(1).strip(), []).append(float(m.group(2)))
    return p.returncode, rows, p.stdout + p.stderr


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    old, new, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    given = os.environ.get("TMS_AB_ROUNDS", "2")
    rounds = int(given) if given.strip().isdigit() else 0
    if rounds < 2:
        # Refused before anything runs: one round has no spread to tell noise by, so every row
        # a little slower by chance would be flagged, and the machine's time spent for nothing.
        print(f"bench_ab.py: TMS_AB_ROUNDS={given!r}: needs a whole number, at least 2 (the noise "
              "is the spread between a side's own rounds; one round has none)", file=sys.stderr)
        sys.exit(2)
    times = {"old": {}, "new": {}}
    failed = []
    for r in range(rounds):
        for side, binary in (("old", old), ("new", new)):
            t0 = time.monotonic()
            rc, rows, text = run(binary, args)
            print(f"--- round {r + 1} {side}: rc {rc}, {len(rows)} rows, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
            # Each run's rows as they come, so that a run cut short still leaves its numbers.
            for what, ts in rows.items():
                print(f"    {what[:70]:<70} " + " ".join(f"{t:.4f}" for t in ts), flush=True)
            if rc != 0:
                failed.append(f"{side} round {r + 1} rc {rc}")
                print(text[-3000:])
            for what, ts in rows.items():
                # A row name printed twice in one run (per backend) keeps its order.
                for k, t in enumerate(ts):
                    key = what if k == 0 else f"{what} #{k + 1}"
                    times[side].setdefault(key, []).append(t)
    print()
    print(f"{'row':<60} {'old s':>9} {'new s':>9} {'new/old':>8} {'noise':>7}")
    slower = []
    for what, olds in times["old"].items():
        news = times["new"].get(what)
        if not news:
            print(f"{what:<60} {min(olds):>9.4f} {'-':>9}")
            continue
        o, n = min(olds), min(news)
        noise = max((max(v) - min(v)) / min(v) if min(v) > 0 else 0 for v in (olds, news))
        ratio = n / o if o > 0 else 1.0
        flag = ""
        # Rows under 5 ms are timer noise whatever the spread.
        if n > 0.005 and ratio > 1 + noise + 0.03:
            flag = "  SLOWER"
            slower.append(what)
        print(f"{what:<60} {o:>9.4f} {n:>9.4f} {ratio:>8.3f} {noise:>6.1%}{flag}")
    for what in times["new"]:
        if what not in times["old"]:
            print(f"{what:<60} {'-':>9} {min(times['new'][what]):>9.4f}")
    print()
    report_only = os.environ.get("TMS_AB_REPORT_ONLY") == "1"
    verdict = "PASS" if not failed and (report_only or not slower) else "FAIL"
    print(f"BENCH A/B {verdict}: {rounds} rounds each; {len(slower)} rows slower beyond noise"
          + (f" ({'; '.join(slower)})" if slower else "")
          + (f"; failed runs: {', '.join(failed)}" if failed else ""))
    sys.exit(0 if verdict == "PASS" else 1)


if __name__ == "__main__":
    main()
