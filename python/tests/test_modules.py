"""The package's modules as integrations see them, whatever file the code lives in: every name
docs/python-api.md says they reach for, from the module it names; the patches they make reach
the code that reads them; and no file of the package imports one that, directly or through
others, imports it back."""

from __future__ import annotations

import ast
import importlib
import sys
import types
from pathlib import Path

import pytest

import torch_memory_saver as tms_pkg
from torch_memory_saver import entrypoint
from torch_memory_saver.hooks import mode_torch
from torch_memory_saver.hooks.base import HookUtilBase

# Module (relative to the package; "" is the package) -> the names docs/python-api.md ("What
# integrations reach into", and the distributed section) documents there.
DOCUMENTED = {
    "": [*tms_pkg.__all__, "entrypoint", "binary_wrapper", "hooks", "utils", "testing_utils", "distributed"],
    "entrypoint": ["TorchMemorySaver", "_TorchMemorySaverImpl", "_TAG_DEFAULT", "CpuBackupBackend", "HookMode",
                   "HookUtilBase", "BinaryWrapper", "register_hook_mode", "_HOOK_MODE_REGISTRY",
                   "_HookModeRegistration", "is_xpu"],
    "binary_wrapper": ["BinaryWrapper"],
    "hooks": ["HookUtilBase", "HookMode", "base", "mode_preload", "mode_torch"],
    "hooks.base": ["HookUtilBase", "HookMode"],
    "hooks.mode_preload": ["configure_subprocess", "HookUtilModePreload"],
    "hooks.mode_torch": ["HookUtilModeTorch"],
    "utils": ["get_binary_path_from_package", "change_env", "is_xpu"],
    "testing_utils": ["is_xpu", "get_device", "empty_cache", "get_and_print_gpu_memory"],
    "distributed": ["pause", "resume", "pause_chunks", "resume_chunks", "pause_range", "resume_range", "Outcome",
                    "RankOutcome", "DistributedError"],
}

# Attributes of the facade and of its implementation that integrations read, call or replace.
FACADE = ["_impl_ctor_kwargs", "_impl", "_ensure_initialized", "_uses_preload", "_cpu_backup_backend", "hook_mode"]
IMPL = ["_binary_wrapper", "_mem_pools", "_graph_pools", "_with_region_config", "_affected_devices", "_hook_util",
        "_hook_mode", "_is_xpu", "_device_module", "keep_resident", "region", "cuda_graph", "disable", "pause",
        "resume", "get_cpu_backup", "pause_chunks", "resume_chunks", "get_num_chunks", "get_chunk_states",
        "get_chunk_layout", "stats", "summary"]


@pytest.mark.parametrize("module", sorted(DOCUMENTED))
def test_every_documented_name_from_its_documented_module(module):
    mod = importlib.import_module("torch_memory_saver" + (f".{module}" if module else ""))
    missing = [name for name in DOCUMENTED[module] if not hasattr(mod, name)]
    assert not missing, f"{mod.__name__} lacks {missing}"


def test_the_facade_and_its_implementation_keep_the_attributes_integrations_reach():
    saver = entrypoint.TorchMemorySaver()
    assert [a for a in FACADE if not hasattr(saver, a)] == []
    impl = entrypoint._TorchMemorySaverImpl(hook_mode="torch")
    # Looked up on the class first, so that no property runs (``_binary_wrapper`` loads the library).
    assert [a for a in IMPL if not hasattr(type(impl), a) and not hasattr(impl, a)] == []
    assert type(impl._mem_pools).__name__ == "_PoolMap" and isinstance(impl._mem_pools, dict)


def test_a_patch_of_entrypoint_is_xpu_reaches_the_implementation(monkeypatch):
    saver = entrypoint.TorchMemorySaver()
    impl = entrypoint._TorchMemorySaverImpl(hook_mode="torch")
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(version=types.SimpleNamespace(hip=None, cuda="12.9")))
    monkeypatch.setattr(entrypoint, "is_xpu", lambda: True)
    assert impl._is_xpu is True
    with pytest.raises(ValueError, match="'mmap' is not supported on XPU"):
        saver._cpu_backup_backend(True, "mmap")
    with pytest.raises(ValueError, match="not supported on XPU"):
        with saver.region(enable_cpu_backup=True, cpu_backup_backend="pinned"):
            pass
    monkeypatch.setattr(entrypoint, "is_xpu", lambda: False)
    assert impl._is_xpu is False and saver._cpu_backup_backend(True, "mmap") == "mmap"


def test_distributed_acts_on_the_instance_the_package_holds_at_the_call(monkeypatch):
    from torch_memory_saver import distributed

    assert distributed._saver() is tms_pkg.torch_memory_saver
    other = entrypoint.TorchMemorySaver()
    monkeypatch.setattr(tms_pkg, "torch_memory_saver", other)
    assert distributed._saver() is other


def test_a_patch_of_a_mode_class_reaches_hook_util_base_create(monkeypatch):
    class Mine(mode_torch.HookUtilModeTorch):
        pass

    assert type(HookUtilBase.create("torch")) is mode_torch.HookUtilModeTorch
    monkeypatch.setattr(mode_torch, "HookUtilModeTorch", Mine)
    assert type(HookUtilBase.create("torch")) is Mine
    assert type(entrypoint._TorchMemorySaverImpl(hook_mode="torch")._hook_util) is Mine
    with pytest.raises(ValueError, match="hook_mode must be one of"):
        HookUtilBase.create("gms")


def _imports(path: Path, root: Path) -> set:
    """The package's files that ``path`` imports, anywhere in it (inside functions too)."""
    package = path.parent.relative_to(root.parent).parts  # ("torch_memory_saver", ...)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            parts = base + tuple(node.module.split(".") if node.module else ())
            # ``from .m import y`` imports m, and y where y is a module; ``from . import y`` imports
            # y where it is a module, else the package (a name its __init__ defines).
            names = [parts + (a.name,) for a in node.names]
            is_module = [root.parent.joinpath(*n).with_suffix(".py").is_file()
                         or root.parent.joinpath(*n, "__init__.py").is_file() for n in names]
            targets = [n for n, m in zip(names, is_module) if m]
            if node.module or not all(is_module):
                targets.append(parts)
        elif isinstance(node, ast.Import):
            targets = [tuple(a.name.split(".")) for a in node.names]
        else:
            continue
        for t in targets:
            if t[:1] != (root.name,):
                continue
            f = root.parent.joinpath(*t)
            for candidate in (f.with_suffix(".py"), f / "__init__.py"):
                if candidate.is_file() and candidate != path:
                    found.add(candidate)
    return found


def test_no_import_circle_among_the_files_of_the_package():
    root = Path(tms_pkg.__file__).parent
    graph = {p: _imports(p, root) for p in sorted(root.rglob("*.py"))}
    assert len(graph) > 10 and root / "saver.py" in graph[root / "entrypoint.py"]
    circles = []
    state: dict = {}  # file -> 1 while on the path, 2 once done

    def visit(p: Path, path: list) -> None:
        state[p] = 1
        for q in sorted(graph.get(p, ())):
            if state.get(q) == 1:
                circles.append(" -> ".join(str(f.relative_to(root)) for f in path[path.index(q):] + [p, q]))
            elif q not in state:
                visit(q, path + [p])
        state[p] = 2

    for p in graph:
        if p not in state:
            visit(p, [])
    assert not circles, circles
