"""The package's ctypes bindings are tms.h's declarations (preload/include/tms.h, generated from
the library's exports): every function in ``_SIGNATURES`` is declared there with the result and
argument types it is bound with, every other name of the library the package calls is declared,
and ``Progress`` is ``tms_progress`` field for field, ``Changed`` ``tms_changed``."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

import torch_memory_saver
from torch_memory_saver import binary_wrapper

HEADER = Path(__file__).resolve().parents[2] / "preload" / "include" / "tms.h"

# C types as ctypes binds them. Aliases of one width (size_t and uint64_t on 64-bit Linux) are
# one ctypes type, as they are one type to the ABI.
SCALARS = {
    "void": None,
    "bool": ctypes.c_bool,
    "char": ctypes.c_char,
    "int": ctypes.c_int,
    "double": ctypes.c_double,
    "size_t": ctypes.c_size_t,
    "ssize_t": ctypes.c_ssize_t,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
    "uint8_t": ctypes.c_uint8,
    "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64,
    "tms_progress": binary_wrapper.Progress,
    "tms_changed": binary_wrapper.Changed,
}


def ctype(c: str):
    """The ctypes type of the C type ``c`` (``const`` and ``struct`` dropped)."""
    words = [w for w in c.replace("*", " * ").split() if w not in ("const", "struct")]
    stars = words.count("*")
    base = " ".join(w for w in words if w != "*")
    if base == "char" and stars >= 1:  # a string, or a buffer a string is written into
        base, stars = "char*", stars - 1
        t = ctypes.c_char_p
    elif base == "void" and stars >= 1:
        stars -= 1
        t = ctypes.c_void_p
    else:
        t = SCALARS[base]
    for _ in range(stars):
        t = ctypes.POINTER(t)
    return t


def header_text() -> str:
    if not HEADER.is_file():
        pytest.skip("needs the source tree's tms.h")
    return HEADER.read_text(encoding="utf-8")


def declarations(text: str) -> dict:
    """Each function tms.h declares: name -> (result type, [argument types]), as C text."""
    code = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    code = re.sub(r"^\s*#.*$", " ", code, flags=re.M)
    code = re.sub(r"typedef\s+struct\s+\w+\s*\{.*?\}\s*\w+\s*;", " ", code, flags=re.S)
    code = code.replace('extern "C" {', " ").replace("}", " ")
    found = {}
    for decl in code.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        m = re.fullmatch(r"(.*?)\b(\w+)\((.*)\)", decl)
        assert m, f"tms.h: cannot read the declaration {decl!r}"
        result, name, args = m.groups()
        params = [] if args.strip() == "void" else [re.sub(r"\w+$", "", a).strip() for a in args.split(",")]
        found[name] = (result.strip(), params)
    return found


def struct_fields(text: str, name: str) -> list:
    """``[(field, C type)]`` of ``typedef struct name {...}`` in tms.h (``char x[32]`` as
    ``("x", "char[32]")``)."""
    m = re.search(r"typedef\s+struct\s+" + name + r"\s*\{(.*?)\}\s*" + name + r"\s*;", text, flags=re.S)
    assert m, f"tms.h has no struct {name}"
    body = re.sub(r"/\*.*?\*/", " ", m.group(1), flags=re.S)
    fields = []
    for f in body.split(";"):
        f = " ".join(f.split())
        if f:
            fm = re.fullmatch(r"(.+?)\s*\b(\w+)(\[\d+\])?", f)
            assert fm, f"tms.h: cannot read the field {f!r} of {name}"
            fields.append((fm.group(2), fm.group(1) + (fm.group(3) or "")))
    return fields


def test_the_header_is_read_whole():
    decls = declarations(header_text())
    assert len(decls) >= 60 and "tms_pause" in decls and "cudaMalloc" in decls
    assert decls["tms_resume_nonblocking"] == (
        "int",
        ["const char *", "int", "uint64_t", "const uint64_t *", "uint64_t", "uint64_t *"],
    )
    assert ctype("const void **") is ctypes.POINTER(ctypes.c_void_p)
    assert ctype("struct tms_progress *") is ctypes.POINTER(binary_wrapper.Progress)


def test_every_binding_has_the_declared_types():
    decls = declarations(header_text())
    wrong = []
    for name, (restype, argtypes) in binary_wrapper._SIGNATURES.items():
        if name not in decls:
            wrong.append(f"{name}: not declared in tms.h")
            continue
        result, params = decls[name]
        if restype is not ctype(result):
            wrong.append(f"{name}: returns {result}, bound as {restype}")
        if len(argtypes) != len(params):
            wrong.append(f"{name}: takes {len(params)} arguments ({', '.join(params)}), bound with {len(argtypes)}")
            continue
        for i, (bound, c) in enumerate(zip(argtypes, params)):
            want = ctype(c)
            # The existing library's bool arguments travel as an int of 0 or 1 (binary_wrapper.py
            # binds them so; the library reads them as int).
            if bound is not want and not (c == "bool" and bound is ctypes.c_int):
                wrong.append(f"{name}: argument {i} is {c}, bound as {bound}")
    assert not wrong, "\n".join(wrong)


def test_every_library_name_the_package_calls_is_declared():
    decls = declarations(header_text())
    package = Path(torch_memory_saver.__file__).resolve().parent
    used = set(binary_wrapper._SIGNATURES)
    for src in package.rglob("*.py"):
        text = src.read_text(encoding="utf-8")
        # By name ("tms_torch_malloc" for PyTorch's allocator) or through the handle (cdll.tms_...).
        used.update(re.findall(r"""["'](tms_[a-z0-9_]+)["']""", text))
        used.update(re.findall(r"\bcdll\.(tms_[a-z0-9_]+)", text))
    assert {"tms_torch_malloc", "tms_build_info", "tms_affected_devices"} <= used
    assert sorted(used - set(decls)) == []


@pytest.mark.parametrize(
    "name, bound, size", [("tms_progress", binary_wrapper.Progress, 88), ("tms_changed", binary_wrapper.Changed, 32)]
)
def test_the_structs_are_the_header_structs(name, bound, size):
    fields = struct_fields(header_text(), name)
    bound_fields = [(n, t) for n, t in bound._fields_]
    assert [n for n, _ in fields] == [n for n, _ in bound_fields]
    for (field, c), (_, t) in zip(fields, bound_fields):
        m = re.fullmatch(r"(\w+)\[(\d+)\]", c)
        want = SCALARS[m.group(1)] * int(m.group(2)) if m else SCALARS[c]
        assert t is want or (m and t._type_ is want._type_ and t._length_ == want._length_), (field, c, t)
    assert ctypes.sizeof(bound) == size
