"""Count a trace recorded by trace.py (a JSON list of stacks, outermost first, each
[function, file]) as a reader follows the path: each named function once, the first time it is
entered, in the order entered; closures (read with the function that holds them) and derived
impls (eq, default, clone, fmt: never read) left out; the path ends at the driver (nothing
below the first frame in src/driver/). Consecutive functions in one file are one stay.
changes of file = stays - 1; returns = stays - files. What-ifs, before anyone moves code (each
repeatable): `--as FILE=INTO` counts FILE's functions as INTO's (a merge of files); `--move
NAME=INTO` counts the functions whose name ends with NAME as INTO's (a function moved);
`--inline NAME` leaves those functions out (read as part of their caller, as if inlined).
A floor under any reordering: `--within FLOW` cuts the path into phases, each call FLOW makes
(what it calls directly, with all that runs under it) one phase, the path before FLOW is
entered and after it returns one phase each; `--phase LABEL=NAME,NAME...` joins the calls FLOW
makes to functions whose names end with those NAMEs into one phase. It prints what the path
would count if every phase entered each of its files once (two phases in a row sharing a file
joined there): what no order of the work inside the phases can beat.
  python3 scripts/paths/count.py [-v] [--under NAME] [--as FILE=INTO]... [--move NAME=INTO]...
      [--inline NAME]... [--within FLOW [--phase LABEL=NAME,...]...] TRACE.json ..."""
import json, sys, re

SKIP = {"eq", "ne", "default", "clone", "fmt", "hash", "partial_cmp", "cmp"}

def strip_generics(n):
    out, depth = [], 0
    for ch in n:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)

def norm(name):
    n = strip_generics(name or "?")
    return re.sub(r"\{closure#\d+\}|\{\{closure\}\}", "{closure}", n)

def short(n):
    return "::".join(n.split("::")[-2:])

def place(n, f, merged, moved):
    for name, into in moved:
        if n.endswith(name):
            return into
    return merged.get(f, f)

def phase_of(st, within, phases):
    """The phase of a function entered with stack `st` (`--within`)."""
    idx = [i for i, (n, f) in enumerate(st) if n.endswith(within)]
    if not idx:
        return "outside"
    callee = next((n for n, f in st[idx[-1] + 1:] if "{closure" not in n), within)
    for label, names in phases:
        if any(callee.endswith(x) for x in names):
            return label
    return callee

def sequence(path, under=None, only=None, merged=None, moved=(), inlined=(), within=None,
             phases=()):
    """The functions of a trace in the order first entered: (name, file, phase)."""
    hits = json.load(open(path))
    merged = merged or {}
    seen, seq = set(), []
    for st in hits:
        st = [(n, place(n, f, merged, moved)) for n, f in ((norm(n), f) for n, f in st)]
        for i, (n, f) in enumerate(st):
            if f.startswith("preload/src/driver/"):
                st = st[: i + 1]
                break
        if under is not None:
            idx = [i for i, (n, f) in enumerate(st) if n.endswith(under)]
            if not idx:
                continue
            st = st[idx[0]:]
        if not st:
            continue
        n, f = st[-1]
        last = n.split("::")[-1]
        if "{closure" in n or last in SKIP or last.startswith("{closure"):
            continue
        if any(n.endswith(i) for i in inlined):
            continue
        if only is not None and not (f.startswith(only) and "/pipeline" not in f):
            continue
        if (n, f) in seen:
            continue
        seen.add((n, f))
        seq.append((n, f, phase_of(st, within, phases) if within else None))
    return seq

def runs(pairs):
    """Consecutive pairs with the same key, as (key, [values]) in order."""
    out = []
    for k, v in pairs:
        if out and out[-1][0] == k:
            out[-1][1].append(v)
        else:
            out.append((k, [v]))
    return out

def floor(path, seq, show):
    """`--within`: the count if each phase entered each of its files once."""
    cut = runs((k, f) for _, f, k in seq)
    stays, prev = 0, set()
    for k, fs in cut:
        files = set(fs)
        stays += len(files) - (1 if prev & files else 0)
        prev = files
        if show:
            print(f"     phase {k[-50:]:50} {len(files):3} files")
    print(f"{path}: {len(cut)} phases; entering each of its files once per phase: "
          f"{stays} stays ({stays - 1} changes of file) at the least")

def run(path, show=False, under=None, only=None, merged=None, moved=(), inlined=(),
        within=None, phases=()):
    seq = sequence(path, under, only, merged, moved, inlined, within, phases)
    if within:
        floor(path, seq, show)
        return
    stays = runs((f, n) for n, f, _ in seq)
    files = []
    for f, _ in stays:
        if f not in files:
            files.append(f)
    if show:
        visited = set()
        for i, (f, ns) in enumerate(stays, 1):
            mark = "VISIT" if f in visited else "     "
            visited.add(f)
            print(f"{i:4} {mark} {f:40} {', '.join(short(n) for n in ns)}")
    print(f"{path}{' under ' + under if under else ''}{' (engine files only)' if only else ''}: {len(seq)} functions, {len(stays)} stays "
          f"({len(stays) - 1} changes of file), {len(files)} files, "
          f"{len(stays) - len(files)} returns to a file already visited")

if __name__ == "__main__":
    args = sys.argv[1:]
    show = "-v" in args
    under = None
    if "--under" in args:
        under = args[args.index("--under") + 1]
    only = "preload/src/engine/" if "--engine" in args else None
    within = args[args.index("--within") + 1] if "--within" in args else None
    merged, moved, inlined, phases = {}, [], [], []
    for i, a in enumerate(args[:-1]):
        if a == "--phase":
            label, sep, names = args[i + 1].partition("=")
            if not sep or not label or not names:
                sys.exit(f"--phase wants LABEL=NAME,NAME..., got {args[i + 1]!r}")
            phases.append((label, [x for x in names.split(",") if x]))
            continue
        if a in ("--as", "--move"):
            f, sep, into = args[i + 1].partition("=")
            if not sep or not f or not into:
                sys.exit(f"{a} wants {'FILE' if a == '--as' else 'NAME'}=INTO, got {args[i + 1]!r}")
            if a == "--as":
                merged[f] = into
            else:
                moved.append((f, into))
        elif a == "--inline":
            inlined.append(args[i + 1])
    paths = [a for i, a in enumerate(args) if a.endswith(".json")]
    for p in paths:
        run(p, show, under, only, merged, moved, inlined, within, phases)
