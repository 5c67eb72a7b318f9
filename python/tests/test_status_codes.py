"""The Python exceptions follow the library's one table of status codes (preload/include/tms.h,
which tests/tests/header.rs checks against the library's own names): every TMS_ERR_* code maps to
its exception, and no code the header lacks is mapped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from torch_memory_saver import errors

HEADER = Path(__file__).resolve().parents[2] / "preload" / "include" / "tms.h"

# The exception each status raises; a new status code must be added here and in errors.py.
EXPECTED = {
    "OUT_OF_MEMORY": errors.OutOfMemoryError,
    "DRIVER": errors.DriverError,
    "INVALID_ARGUMENT": errors.InvalidArgumentError,
    "INVALID_STATE": errors.InvalidStateError,
    "NOT_FOUND": errors.NotFoundError,
    "UNSUPPORTED": errors.UnsupportedError,
    "IO": errors.TorchMemorySaverError,
    "INTERNAL": errors.InternalError,
    "BUFFER_TOO_SMALL": errors.InternalError,  # the package sizes its buffers; a bug if seen
}


def header_codes() -> dict:
    if not HEADER.is_file():
        pytest.skip("needs the source tree's tms.h")
    return {m[1]: int(m[2]) for m in re.finditer(r"^#define TMS_ERR_([A-Z_]+) (\d+)$", HEADER.read_text(), re.M)}


def test_every_status_of_the_header_raises_its_exception():
    codes = header_codes()
    assert set(codes) == set(EXPECTED), f"tms.h has {sorted(codes)}; this table has {sorted(EXPECTED)}"
    for name, code in codes.items():
        e = errors.error_for_status(code, f"status {name}")
        assert type(e) is EXPECTED[name], (name, code, type(e))
        assert e.status == code and str(e) == f"status {name}"
    assert set(errors._BY_STATUS) == set(codes.values()), "errors.py maps a status tms.h lacks"


def test_an_unknown_status_is_still_an_error_of_the_package():
    e = errors.error_for_status(99, "")
    assert type(e) is errors.TorchMemorySaverError and e.status == 99 and "status 99" in str(e)
