# gdb -batch -x scripts/paths/trace.py --args BINARY [ARGS]   with env TRACE_ENTRY (a function as `nm -C` names it),
# TRACE_ROOT (source root), TRACE_OUT (output file).
# Records, on the thread that runs the entry function and while it runs, every entry into a
# function whose source lies under TRACE_ROOT, as the stack of such functions above it.
import gdb, os, subprocess, json

ROOT = os.environ["TRACE_ROOT"]
ENTRY = os.environ["TRACE_ENTRY"]
OUT = os.environ["TRACE_OUT"]
binary = gdb.current_progspace().filename

syms = subprocess.run(["nm", "-C", "--defined-only", binary], capture_output=True, text=True).stdout
state = {"active": False, "thread": None, "entry_frame": None}
hits = []
fileof = {}

def func_file(frame):
    sal = frame.find_sal()
    if sal.symtab is None:
        return None
    try:
        fn = frame.function()
    except RuntimeError:
        fn = None
    if fn is not None and fn.symtab is not None:
        path = fn.symtab.fullname()
    else:
        path = sal.symtab.fullname()
    return path

class Hit(gdb.Breakpoint):
    def stop(self):
        if not state["active"]:
            return False
        if gdb.selected_thread().num != state["thread"]:
            return False
        stack = []
        f = gdb.newest_frame()
        while f is not None:
            name = f.name()
            path = func_file(f)
            if path and path.startswith(ROOT):
                stack.append((name, os.path.relpath(path, ROOT)))
            if name == ENTRY:
                break
            f = f.older()
        stack.reverse()
        hits.append(stack)
        return False

class Entry(gdb.Breakpoint):
    def stop(self):
        if state["thread"] is None:
            state["active"] = True
            state["thread"] = gdb.selected_thread().num
            Done(gdb.newest_frame(), internal=True)
        return False

class Done(gdb.FinishBreakpoint):
    def stop(self):
        state["active"] = False
        with open(OUT, "w") as o:
            json.dump(hits, o)
        return False
    def out_of_scope(self):
        state["active"] = False

gdb.execute("set pagination off")
gdb.execute("set breakpoint pending on")
gdb.execute("set print thread-events off")
gdb.execute("starti", to_string=True)
base = None
for line in syms.splitlines():
    parts = line.split(" ", 2)
    if len(parts) == 3 and parts[2] == "main":
        base = int(str(gdb.parse_and_eval("(long)&main")), 0) - int(parts[0], 16)
        break
n = 0
entry_set = False
for line in syms.splitlines():
    parts = line.split(" ", 2)
    if len(parts) < 3 or parts[1] not in ("t", "T"):
        continue
    addr = int(parts[0], 16) + base
    name = parts[2]
    if "drop_in_place" in name:
        continue
    sal = gdb.find_pc_line(addr)
    if sal.symtab is None:
        continue
    path = sal.symtab.fullname()
    if name == ENTRY and not entry_set:
        Entry("*0x%x" % addr, internal=True)
        entry_set = True
        continue
    if not path.startswith(ROOT):
        continue
    Hit("*0x%x" % addr, internal=True)
    n += 1
gdb.write("breakpoints: %d\n" % n)
gdb.execute("continue")
