"""Count a trace recorded by trace.py (a JSON list of stacks, outermost first, each
[function, file]) as a reader follows the path: each named function once, the first time it is
entered, in the order entered; closures (read with the function that holds them) and derived
impls (eq, default, clone, fmt: never read) left out; the path ends at the driver (nothing
below the first frame in src/driver/). Consecutive functions in one file are one stay.
changes of file = stays - 1; returns = stays - files. What-ifs, before anyone moves code (each
repeatable): `--as FILE=INTO` counts FILE's functions as INTO's (a merge of files); `--move
NAME=INTO` counts the functions whose name ends with NAME as INTO's (a function moved);
`--inline NAME` leaves those functions out (read as part of their caller, as if inlined).
  python3 scripts/paths/count.py [-v] [--under NAME] [--as FILE=INTO]... [--move NAME=INTO]...
      [--inline NAME]... TRACE.json ..."""
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

def run(path, show=False, under=None, only=None, merged=None, moved=(), inlined=()):
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
        seq.append((n, f))
    stays = []
    for n, f in seq:
        if stays and stays[-1][0] == f:
            stays[-1][1].append(n)
        else:
            stays.append((f, [n]))
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
    merged, moved, inlined = {}, [], []
    for i, a in enumerate(args[:-1]):
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
        run(p, show, under, only, merged, moved, inlined)
