"""Chunk calls of the implementation: pause, resume and query the chunks of a chunked
allocation (``region(chunk_size=...)``), by tag, by tensor or by byte range."""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Callable, Iterable, Optional

from .arguments import (
    RANGE_ASKED,
    _address,
    _check_indices,
    _check_tag,
    _enc,
    _int,
    _tensor_bytes,
    chunk_arguments,
    chunk_target,
)
from .binary_wrapper import BinaryWrapper
from .errors import InternalError, InvalidArgumentError, NotFoundError, TorchMemorySaverError, error_for_status

logger = logging.getLogger("torch_memory_saver")


class _Chunks:
    """Chunk calls of :class:`~.saver._TorchMemorySaverImpl`, which gives the library and the
    statistics."""

    _library: Callable[[], BinaryWrapper]
    stats: Callable[[], dict]

    def _chunks(self, target: Any, indices: Any, pause: bool) -> None:
        if isinstance(target, str):
            tag = _check_tag(target)
            idx = _check_indices(indices)
            lib = self._library()
            fn = lib.tms_pause_chunks if pause else lib.tms_resume_chunks
            try:
                lib.check(fn(_enc(tag), (ctypes.c_size_t * len(idx))(*idx), len(idx)))
            except NotFoundError:
                if self._tag_has_allocations(tag):
                    raise
                # The existing library's answer for a tag without any allocation: nothing to do.
                logger.debug("tag %r has no allocation: no chunks to %s", tag, "pause" if pause else "resume")
                return
            what = f"tag {tag!r}"
        else:
            addr = _address(target)
            idx = _check_indices(indices)
            lib = self._library()
            lib.check(lib.tms_chunks_at(addr, int(pause), (ctypes.c_uint64 * len(idx))(*idx), len(idx)))
            what = f"the allocation at {addr:#x}"
        # The library acts on each index once, however often it was given.
        logger.info("%s %d chunks of %s", "paused" if pause else "resumed", len(set(idx)), what)

    def _tag_has_allocations(self, tag: str) -> bool:
        """Whether ``tag`` holds any pauseable allocation now (chunked or not)."""
        return any(t["tag"] == tag and t["allocations"] for t in self.stats()["tags"])

    def pause_chunks(
        self,
        tag_or_tensor: Any = None,
        indices: Optional[Iterable[int]] = None,
        *,
        tag: Any = None,
        chunk_indices: Optional[Iterable[int]] = None,
    ) -> None:
        """See ``TorchMemorySaver.pause_chunks``."""
        target, idx = chunk_arguments("pause_chunks", tag_or_tensor, indices, tag, chunk_indices)
        self._chunks(target, idx, True)

    def resume_chunks(
        self,
        tag_or_tensor: Any = None,
        indices: Optional[Iterable[int]] = None,
        *,
        tag: Any = None,
        chunk_indices: Optional[Iterable[int]] = None,
    ) -> None:
        """See ``TorchMemorySaver.resume_chunks``."""
        target, idx = chunk_arguments("resume_chunks", tag_or_tensor, indices, tag, chunk_indices)
        self._chunks(target, idx, False)

    def _range(self, tensor: Any, start: Any, end: Any, pause: bool) -> range:
        addr = _address(tensor, "a torch.Tensor")
        start, end = _int("start", start), _int("end", end)
        nbytes = _tensor_bytes(tensor)
        if not 0 <= start <= end <= nbytes:
            raise InvalidArgumentError(
                f"byte range [{start}, {end}) is not inside the tensor's {nbytes} bytes "
                f"(0 <= start <= end <= {nbytes})"
            )
        lib = self._library()
        if start == end:
            lib.check(lib.tms_chunks_of(addr, None, None, None))  # still refuses a non-chunked tensor
            return range(0)
        first, count = ctypes.c_uint64(0), ctypes.c_uint64(0)
        try:
            lib.check(lib.tms_range(addr + start, end - start, int(pause), ctypes.byref(first), ctypes.byref(count)))
        except BaseException as e:
            # Written before the library acts (both 0 where it failed first): what a failed
            # pause may have paused part of.
            setattr(e, RANGE_ASKED, range(first.value, first.value + count.value))
            raise
        done = range(first.value, first.value + count.value)
        logger.info("%s chunks %s of the allocation holding %#x", "paused" if pause else "resumed", done, addr)
        return done

    def pause_range(self, tensor: Any, start: int, end: int) -> range:
        """See ``TorchMemorySaver.pause_range``."""
        return self._range(tensor, start, end, True)

    def resume_range(self, tensor: Any, start: int, end: int) -> range:
        """See ``TorchMemorySaver.resume_range``."""
        return self._range(tensor, start, end, False)

    def _tag_failure(self, lib: BinaryWrapper, tag: bytes) -> TorchMemorySaverError:
        """The error of a failed by-tag chunk query that reports no status: its message, and the
        status of the same lookup through ``tms_get_chunk_layout`` (which fails the same way)."""
        msg = lib.last_error()
        status = lib.tms_get_chunk_layout(tag, None, None, 0)
        return error_for_status(status, msg) if status else InternalError(msg or "chunk query failed")

    def _chunks_of(self, lib: BinaryWrapper, addr: int) -> tuple:
        start, chunk, count = ctypes.c_uint64(0), ctypes.c_uint64(0), ctypes.c_uint64(0)
        lib.check(lib.tms_chunks_of(addr, ctypes.byref(start), ctypes.byref(chunk), ctypes.byref(count)))
        return start.value, chunk.value, count.value

    def _tag_count(self, lib: BinaryWrapper, tag: bytes) -> int:
        """The chunk count of the tag's chunked allocation; 0 where the tag has no allocation
        at all (the existing library's answer), an error where it has only unchunked ones."""
        n = lib.tms_get_num_chunks_for_tag(tag)
        if not n:
            err = self._tag_failure(lib, tag)
            if isinstance(err, NotFoundError) and not self._tag_has_allocations(tag.decode("utf-8")):
                return 0
            raise err
        return n

    def get_num_chunks(self, tag_or_tensor: Any = None, *, tag: Any = None) -> int:
        """See ``TorchMemorySaver.get_num_chunks``."""
        tag_or_tensor = chunk_target("get_num_chunks", tag_or_tensor, tag)
        lib = self._library()
        if isinstance(tag_or_tensor, str):
            return self._tag_count(lib, _enc(_check_tag(tag_or_tensor)))
        return self._chunks_of(lib, _address(tag_or_tensor))[2]

    def get_chunk_states(self, tag_or_tensor: Any = None, *, tag: Any = None) -> list:
        """See ``TorchMemorySaver.get_chunk_states``."""
        tag_or_tensor = chunk_target("get_chunk_states", tag_or_tensor, tag)
        if isinstance(tag_or_tensor, str):
            name = _enc(_check_tag(tag_or_tensor))
            lib = self._library()
            n = self._tag_count(lib, name)
            if not n:
                return []
            out = (ctypes.c_uint8 * n)()
            if not lib.tms_get_chunk_states(name, out, n):
                raise self._tag_failure(lib, name)
        else:
            addr = _address(tag_or_tensor)
            lib = self._library()
            n = self._chunks_of(lib, addr)[2]
            out = (ctypes.c_uint8 * n)()
            lib.check(lib.tms_chunk_states_at(addr, out, n))
        return [bool(v) for v in out]

    def get_chunk_layout(self, tag_or_tensor: Any = None, *, tag: Any = None) -> list:
        """See ``TorchMemorySaver.get_chunk_layout``."""
        tag_or_tensor = chunk_target("get_chunk_layout", tag_or_tensor, tag)
        if isinstance(tag_or_tensor, str):
            name = _enc(_check_tag(tag_or_tensor))
            lib = self._library()
            n = self._tag_count(lib, name)
            if not n:
                return []
            offsets, sizes = (ctypes.c_size_t * n)(), (ctypes.c_size_t * n)()
            lib.check(lib.tms_get_chunk_layout(name, offsets, sizes, n))
            return list(zip(offsets, sizes))
        addr = _address(tag_or_tensor)
        _, chunk, n = self._chunks_of(self._library(), addr)
        return [(i * chunk, chunk) for i in range(n)]
