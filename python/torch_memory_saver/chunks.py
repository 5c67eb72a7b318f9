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
from .errors import (
    InternalError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    TorchMemorySaverError,
    error_for_status,
)

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
                lib.check_op(fn(_enc(tag), (ctypes.c_size_t * len(idx))(*idx), len(idx)))
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
            lib.check_op(lib.tms_chunks_at(addr, int(pause), (ctypes.c_uint64 * len(idx))(*idx), len(idx)))
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
            lib.check_op(lib.tms_range(addr + start, end - start, int(pause), ctypes.byref(first), ctypes.byref(count)))
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

    def _query(self, what: str, fill: Callable[[int], list], count: Callable[[], int]) -> list:
        """A chunk query's entries, one per chunk of the allocation as one call found it.
        ``fill(room)`` asks the library with room for ``room`` chunks (raising where the call
        fails, too little room among others); ``count()`` reads the chunk count now (0 where
        there is no allocation to ask about; raising where there is none that can be).

        Each call finds the allocation as it is then: another thread may free it and make one
        with more chunks (at the same address, or under the same tag) before the next call, so a
        count read by one call cannot size the next. The first call has some room; one that
        fails is asked again with room for the chunks there are now, a bounded number of times."""
        room = _CHUNK_ROOM
        last: Optional[TorchMemorySaverError] = None
        for _ in range(_CHUNK_TRIES):
            try:
                return fill(room)
            except TorchMemorySaverError as e:
                last = e
            n = count()
            if not n:
                return []
            room = max(room, n)
        raise InvalidStateError(
            f"{what}: the chunked allocation had more chunks at each of {_CHUNK_TRIES} tries than the try "
            f"before had room for (another thread keeps freeing it and making a larger one); last: {last}"
        )

    def get_chunk_states(self, tag_or_tensor: Any = None, *, tag: Any = None) -> list:
        """See ``TorchMemorySaver.get_chunk_states``."""
        tag_or_tensor = chunk_target("get_chunk_states", tag_or_tensor, tag)
        if isinstance(tag_or_tensor, str):
            name = _enc(_check_tag(tag_or_tensor))
            lib = self._library()

            def by_tag(room: int) -> list:
                out = _state_room(room)
                if not lib.tms_get_chunk_states(name, out, room):
                    raise self._tag_failure(lib, name)
                return _states(out)

            return self._query(f"get_chunk_states({tag_or_tensor!r})", by_tag, lambda: self._tag_count(lib, name))
        addr = _address(tag_or_tensor)
        lib = self._library()

        def by_address(room: int) -> list:
            out = _state_room(room)
            lib.check(lib.tms_chunk_states_at(addr, out, room))
            return _states(out)

        return self._query(f"get_chunk_states({addr:#x})", by_address, lambda: self._chunks_of(lib, addr)[2])

    def get_chunk_layout(self, tag_or_tensor: Any = None, *, tag: Any = None) -> list:
        """See ``TorchMemorySaver.get_chunk_layout``."""
        tag_or_tensor = chunk_target("get_chunk_layout", tag_or_tensor, tag)
        if isinstance(tag_or_tensor, str):
            name = _enc(_check_tag(tag_or_tensor))
            lib = self._library()

            def by_tag(room: int) -> list:
                # Sizes left 0 past the chunks the library wrote: a chunk is never empty.
                offsets, sizes = (ctypes.c_size_t * room)(), (ctypes.c_size_t * room)()
                lib.check(lib.tms_get_chunk_layout(name, offsets, sizes, room))
                got = sizes[:]
                n = got.index(0) if 0 in got else room
                return list(zip(offsets[:n], got[:n]))

            return self._query(f"get_chunk_layout({tag_or_tensor!r})", by_tag, lambda: self._tag_count(lib, name))
        # One call: the chunk size and count of one allocation.
        addr = _address(tag_or_tensor)
        _, chunk, n = self._chunks_of(self._library(), addr)
        return [(i * chunk, chunk) for i in range(n)]


# The room, in chunks, of a chunk query's first call (enough for most allocations, which then
# take one call), and how many calls it makes at most (see _Chunks._query).
_CHUNK_ROOM = 1024
_CHUNK_TRIES = 8
# A state entry the library has not written: it writes 1 or 0 for each chunk the allocation has,
# and nothing past them.
_UNWRITTEN = 2


def _state_room(room: int) -> Any:
    out = (ctypes.c_uint8 * room)()
    ctypes.memset(out, _UNWRITTEN, room)
    return out


def _states(out: Any) -> list:
    """The states the library wrote into ``out`` (from :func:`_state_room`)."""
    raw = bytes(out)
    n = raw.find(_UNWRITTEN)
    return [bool(v) for v in raw[: len(raw) if n < 0 else n]]
