"""Helpers shared by the examples: choosing the hook mode (re-executing the script under
LD_PRELOAD when preload mode needs it), measuring free device memory, and PASS/FAIL bookkeeping.

Every example starts with ``_common.setup()`` and ends with ``_common.finish()``:

    python examples/simple.py                    # preload mode (re-executes itself under LD_PRELOAD)
    python examples/simple.py --hook-mode torch  # torch mode (a torch.cuda.MemPool per tag)
    TMS_HOOK_MODE=torch python examples/simple.py
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    import torch_memory_saver as _tms_pkg
except ImportError:  # running from a checkout without installing: use its python/ folder
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
    import torch_memory_saver as _tms_pkg

from torch_memory_saver import configure_subprocess, torch_memory_saver


def _needs_torch() -> None:
    """The examples need PyTorch with CUDA. Without it, ``--help`` still shows what the example
    does and how to run it, and anything else stops with one line saying what is missing
    (rather than a traceback from ``import torch``)."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        script = os.path.basename(sys.argv[0]) or "this example"
        if {"-h", "--help"} & set(sys.argv[1:]):
            main = sys.modules.get("__main__")
            print((getattr(main, "__doc__", None) or "").strip())
            print(
                f"\nusage: python examples/{script} [--hook-mode {{preload,torch}}] [options]\n"
                "  --hook-mode  how libtms.so gets at the allocations: LD_PRELOAD (preload, the default) "
                "or a torch.cuda.MemPool per tag (torch)\n"
                "\n(PyTorch is not installed here: running the example needs PyTorch with CUDA, "
                "torch.cuda.MemPool and torch.cuda.use_mem_pool (tested with 2.11), and a GPU; its "
                "--help then lists every option.)"
            )
            sys.exit(0)
        sys.exit(f"{script} needs PyTorch with CUDA (torch.cuda.MemPool; tested with 2.11) and a CUDA GPU: {e}")


_needs_torch()

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

HOOK_MODES = ("preload", "torch")
_REEXEC_MARK = "TMS_EXAMPLE_REEXECUTED"

_passed = 0
_failed: list = []


def setup(description=None, add_arguments=None) -> argparse.Namespace:
    """Parse ``--hook-mode {preload,torch}`` (default: ``$TMS_HOOK_MODE``, else "preload") and
    whatever ``add_arguments(parser)`` adds, set ``torch_memory_saver.hook_mode``, and in preload
    mode make sure libtms.so is preloaded: if it is not, re-execute this same script with
    libtms.so first in ``LD_PRELOAD`` (so ``python examples/x.py`` just works). Then initialise
    CUDA (outside any region) and print what is in use. Returns the parsed arguments."""
    default = os.environ.get("TMS_HOOK_MODE") or "preload"
    if default not in HOOK_MODES:
        sys.exit(f"TMS_HOOK_MODE must be one of {HOOK_MODES}, not {default!r}")
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--hook-mode",
        choices=HOOK_MODES,
        default=default,
        help="how libtms.so gets at the allocations: LD_PRELOAD (preload) or a torch.cuda.MemPool "
        "per tag (torch); default $TMS_HOOK_MODE, else preload",
    )
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()

    torch_memory_saver.hook_mode = args.hook_mode
    if args.hook_mode == "preload" and not torch_memory_saver.available:
        if os.environ.get(_REEXEC_MARK) == "1":
            sys.exit(
                "hook mode 'preload': libtms.so is still not loaded after re-executing with "
                f"LD_PRELOAD={os.environ.get('LD_PRELOAD')!r}; is that file a libtms.so build?"
            )
        try:
            with configure_subprocess():
                env = dict(os.environ)
                env[_REEXEC_MARK] = "1"
                print(f"[examples] re-executing under LD_PRELOAD={env['LD_PRELOAD']}", flush=True)
                sys.stderr.flush()
                os.execve(sys.executable, [sys.executable, *sys.argv], env)
        except _tms_pkg.LibraryNotFoundError as e:
            sys.exit(f"hook mode 'preload' needs libtms.so: {e}")
    if args.hook_mode == "torch" and not torch_memory_saver.available:
        sys.exit("hook mode 'torch' needs libtms.so: build it (cargo build --release) or set TMS_LIBRARY_PATH")

    import torch

    if not torch.cuda.is_available():
        sys.exit("these examples need a CUDA GPU (torch.cuda.is_available() is False)")
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()  # creates the context, outside any region
    if args.hook_mode == "preload":
        lib = os.environ.get("LD_PRELOAD", "").split(":")[0]
    else:
        lib = _tms_pkg.get_binary_path()
    backend = torch_memory_saver.stats()["backend"]
    print(
        f"[examples] hook mode {args.hook_mode}, libtms {lib} ({backend} driver), torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), {torch.cuda.get_device_name()}: {free / GiB:.2f} of {total / GiB:.2f} GiB free",
        flush=True,
    )
    if backend != "cuda":
        print(f"[examples] warning: libtms runs on the {backend!r} driver (TMS_BACKEND?), not on the GPU", flush=True)
    return args


def free_bytes() -> int:
    """Free device memory as the driver reports it, after the device finished its work."""
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def free_gib() -> float:
    """``free_bytes()`` in GiB."""
    return free_bytes() / GiB


def gib(n: float) -> str:
    """A byte count as 'x.xxx GiB'."""
    return f"{n / GiB:.3f} GiB"


def check(name: str, ok, detail: str = "") -> bool:
    """Print ``PASS name: detail`` or ``FAIL name: detail`` and record the result."""
    global _passed
    ok = bool(ok)
    print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f": {detail}" if detail else ""), flush=True)
    if ok:
        _passed += 1
    else:
        _failed.append(name)
    return ok


def finish() -> None:
    """Print the tally ("OK" first when everything passed) and exit, 1 if any check failed."""
    if _failed:
        print("failed checks:")
        for name in _failed:
            print(f"  - {name}")
    else:
        print("OK")
    print(f"{_passed} passed, {len(_failed)} failed", flush=True)
    sys.exit(1 if _failed else 0)


def tag_stats(tag: str):
    """``torch_memory_saver.stats()``'s entry for ``tag``, or None where the tag has none."""
    return next((t for t in torch_memory_saver.stats()["tags"] if t["tag"] == tag), None)


def disable_tf32() -> None:
    """Full float32 matmuls (no TF32), so results can be compared with tight tolerances."""
    import torch

    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9: the new API (do not mix it with the old)
        matmul.fp32_precision = "ieee"
    else:
        matmul.allow_tf32 = False
