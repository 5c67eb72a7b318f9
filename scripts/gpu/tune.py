#!/usr/bin/env python3
"""Which copy settings reach the limits: `tune.py BIN [VAR=v1,v2 ...] -- [tms-bench ARGS...]`.

Runs the tms-bench executable BIN once per combination of the settings given (environment
variables the library reads, e.g. `TMS_COPY_THREADS=16,24,32 TMS_STAGING_SLOT=4MiB,16MiB`),
each time with the same ARGS (e.g. `16GiB 512 --no-limits --no-plain --no-chunks`, or
`8GiB 64 --no-limits --disk DIR --disk-only`), and prints one table: a row per benchmark row,
a column per combination, the seconds of each, and the fastest combination of each row. An
axis may also be a tms-bench option with values, `--settle=0,500` (an empty value: the option
left out).
`TMS_TUNE_ROUNDS` (default 1) repeats every combination, keeping each row's best. Timings are
reported, never asserted; exits 1 only if a run failed.

    scripts/gpu/tune.py target/release/tms-bench TMS_COPY_THREADS=16,32 -- 16GiB 512 --no-limits
"""
import itertools
import os
import re
import subprocess
import sys
import time

ROW = re.compile(r"^  (\S.*?)\s+([0-9.]+) s\s+([0-9.]+) GiB/s\s*$")


def parse(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        sys.exit(__doc__)
    binary, rest = argv[1], argv[2:]
    if "--" in rest:
        k = rest.index("--")
        grid, args = rest[:k], rest[k + 1:]
    else:
        grid, args = rest, []
    axes = []
    for g in grid:
        name, sep, values = g.partition("=")
        option = re.fullmatch(r"--[a-z][a-z0-9-]*", name)
        if not sep or not values or not (option or re.fullmatch(r"[A-Z_][A-Z0-9_]*", name)):
            sys.exit(f"tune.py: {g!r} is not VAR=v1,v2,... (an environment variable and its "
                     "values) or --option=v1,v2,...")
        vals = values.split(",") if option else [v for v in values.split(",") if v]
        axes.append([(name, v) for v in vals])
    return binary, axes, args


def run(binary, combo, args):
    env = {n: v for n, v in combo.items() if not n.startswith("--")}
    opts = [a for n, v in combo.items() if n.startswith("--") and v for a in (n, v)]
    p = subprocess.run([binary, *args, *opts], capture_output=True, text=True,
                       env={**os.environ, **env})
    rows = {}
    for line in p.stdout.splitlines():
        m = ROW.match(line)
        if m:
            what = m.group(1).strip()
            # A row name printed twice in one run keeps its order.
            n = sum(1 for k in rows if k == what or k.startswith(what + " #"))
            rows[what if n == 0 else f"{what} #{n + 1}"] = float(m.group(2))
    return p.returncode, rows, p.stdout + p.stderr


def main():
    binary, axes, args = parse(sys.argv)
    combos = [dict(c) for c in itertools.product(*axes)] if axes else [{}]
    rounds = int(os.environ.get("TMS_TUNE_ROUNDS", "1"))
    best = [{} for _ in combos]
    failed = []
    for r in range(rounds):
        for k, env in enumerate(combos):
            label = " ".join(f"{n}={v}" for n, v in env.items()) or "(defaults)"
            t0 = time.monotonic()
            rc, rows, text = run(binary, env, args)
            print(f"--- round {r + 1}, {label}: rc {rc}, {len(rows)} rows, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
            # Each run's rows as they come, so that a run cut short still leaves its numbers.
            for what, t in rows.items():
                print(f"    {what[:70]:<70} {t:.4f}", flush=True)
            if rc != 0:
                failed.append(f"{label} (rc {rc})")
                print(text[-3000:])
            for what, t in rows.items():
                best[k][what] = min(t, best[k].get(what, t))
    print()
    for k, env in enumerate(combos):
        print(f"[{k}] " + (" ".join(f"{n}={v}" for n, v in env.items()) or "(defaults)"))
    rows = list(dict.fromkeys(w for b in best for w in b))
    print(f"{'row':<58}" + "".join(f"{'[' + str(k) + '] s':>10}" for k in range(len(combos)))
          + "  fastest")
    for what in rows:
        cells = [b.get(what) for b in best]
        have = [(t, k) for k, t in enumerate(cells) if t is not None]
        fastest = min(have)[1] if have else None
        print(f"{what[:58]:<58}"
              + "".join(f"{t:>10.4f}" if t is not None else f"{'-':>10}" for t in cells)
              + (f"  [{fastest}]" if fastest is not None else ""))
    print()
    print(f"TUNE {'FAIL' if failed else 'DONE'}: {len(combos)} combinations x {rounds} rounds"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
