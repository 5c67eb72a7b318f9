"""The class of the process-wide instance, ``torch_memory_saver.torch_memory_saver``.

:class:`TorchMemorySaver` is a thin facade: before first use it holds ``_impl_ctor_kwargs``
(``hook_mode`` is stored there) and ``_impl = None``; :meth:`TorchMemorySaver._ensure_initialized`
builds ``_impl`` (a :class:`_TorchMemorySaverImpl`) from them and drops ``_impl_ctor_kwargs``;
every public method calls ``self._ensure_initialized()`` then the method of the same name on
``self._impl``. So an integration that installs its own ``_impl`` (or patches
``_ensure_initialized``) takes over every call, and the keywords passed on are only those the
caller gave beyond the long-standing ones.

:func:`register_hook_mode` is the public way to do the same: a named factory of the ``_impl``,
selected by setting ``hook_mode`` to its name.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Literal, NamedTuple, Optional, Union

from .arguments import chunk_arguments, chunk_target, resolve_cpu_backup_backend, set_xpu_check
from .binary_wrapper import BinaryWrapper
from .errors import InvalidArgumentError, InvalidStateError
from .hooks.base import HOOK_MODES, HookMode, HookUtilBase
from .saver import _TorchMemorySaverImpl
from .utils import is_xpu

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["TorchMemorySaver", "_TorchMemorySaverImpl", "register_hook_mode"]

# Names of the existing library's module that integrations import from here. ``is_xpu`` is
# looked up here at call time, so patching ``entrypoint.is_xpu`` changes what regions check.
_TAG_DEFAULT = "default"
CpuBackupBackend = Literal["pinned", "mmap"]
_EXPORTED = (BinaryWrapper, HookMode, HookUtilBase, is_xpu)


def _is_xpu_now() -> bool:
    """This module's ``is_xpu``, looked up at each call: what backup arguments are checked
    against (installed below in ``arguments``, which cannot import this module)."""
    return bool(is_xpu())


set_xpu_check(_is_xpu_now)

_init_lock = threading.RLock()


class _HookModeRegistration(NamedTuple):
    """A hook mode: what builds the facade's ``_impl``, and whether the library must be in
    ``LD_PRELOAD`` (of this process and of children ``configure_subprocess()`` starts)."""

    factory: Callable[[], Any]
    uses_preload: bool


_HOOK_MODE_REGISTRY: Dict[str, _HookModeRegistration] = {}


def register_hook_mode(name: str, factory: Callable[[], Any], *, uses_preload: bool = True) -> None:
    """Register hook mode ``name``: setting ``torch_memory_saver.hook_mode = name`` before first
    use makes the first use call ``factory()`` (once, with no arguments) and use what it returns
    as the facade's ``_impl``, to which every public method goes (``region``, ``cuda_graph``,
    ``pause`` and ``resume``, and any other the caller uses). This is how an allocator of its own
    (an out-of-process memory service, say) takes over ``region``/``pause``/``resume``.

    ``uses_preload=False`` says the mode does not need libtms.so in ``LD_PRELOAD``:
    ``configure_subprocess()`` then leaves the environment of children alone, and
    ``torch_memory_saver._uses_preload()`` is False. Registrations are process-wide and not
    inherited by spawned processes: register in every process before first use. ``"preload"``
    and ``"torch"`` are registered already (both with ``uses_preload=True``).

    Raises ``ValueError`` (:class:`InvalidArgumentError`) for a name registered already or an
    empty one, ``TypeError`` for a name that is not a str or a factory that is not callable."""
    if not isinstance(name, str):
        raise TypeError(f"hook mode name must be a str, not {type(name).__name__}")
    if not name:
        raise InvalidArgumentError("hook mode name must not be empty")
    if not callable(factory):
        raise TypeError(f"factory of hook mode {name!r} must be callable (it makes the implementation), "
                        f"not {type(factory).__name__}")
    with _init_lock:
        if name in _HOOK_MODE_REGISTRY:
            raise InvalidArgumentError(f"hook mode {name!r} is already registered")
        _HOOK_MODE_REGISTRY[name] = _HookModeRegistration(factory=factory, uses_preload=bool(uses_preload))


def _mode_registration(mode: Any) -> _HookModeRegistration:
    """The registration of ``mode``; :class:`InvalidArgumentError` (a ``ValueError`` and a
    ``RuntimeError``, as callers of either expect) naming the registered ones otherwise."""
    reg = _HOOK_MODE_REGISTRY.get(mode) if isinstance(mode, str) else None
    if reg is None:
        raise InvalidArgumentError(
            f"hook_mode must be one of the registered modes {tuple(_HOOK_MODE_REGISTRY)}, not {mode!r}: "
            "call torch_memory_saver.register_hook_mode(name, factory) in this process before first use"
        )
    return reg


for _mode in HOOK_MODES:
    register_hook_mode(_mode, lambda _mode=_mode: _TorchMemorySaverImpl(hook_mode=_mode), uses_preload=True)


def _given(**kwargs: Any) -> dict:
    """The optional keywords the caller actually set (None = not given), so that an installed
    ``_impl`` without them is still called the way it expects."""
    return {k: v for k, v in kwargs.items() if v is not None}


class TorchMemorySaver:
    """Pauseable GPU memory for PyTorch.

    Tensors allocated inside :meth:`region` (or captured by :meth:`cuda_graph`) can give their
    device memory back with :meth:`pause` and get it back with :meth:`resume`, at the same
    addresses, so tensors, pointers and CUDA graphs stay valid. With ``enable_cpu_backup=True``
    the contents survive; without it they are undefined after resume.

    Use the process-wide instance ``torch_memory_saver.torch_memory_saver``.
    """

    def __init__(self) -> None:
        self._impl_ctor_kwargs: dict = {}
        self._impl: Any = None
        # (mode, a reference to the impl) where a registered mode's factory built ``_impl``: the
        # mode of an ``_impl`` that may not know its own name, while ``_impl`` is still that one.
        # Weak where it can be, so that an integration's reset (``_impl = None``) drops the impl.
        self._built: Optional[tuple] = None

    def __getstate__(self) -> dict:
        # A weak reference does not pickle: a saver sent to another process (before first use,
        # as spawned workers get it) carries the mode set, or an _impl that tells its own.
        state = dict(self.__dict__)
        state["_built"] = None
        return state

    def _ensure_initialized(self) -> None:
        """Build ``_impl`` if there is none yet: the factory of the hook mode set (``"preload"``
        when none is), as registered with :func:`register_hook_mode`. An unregistered mode
        raises :class:`InvalidArgumentError` (a ``ValueError``) here. Cheap for the builtin
        modes: the library is loaded by the first call that needs it."""
        if self._impl is not None:
            return
        with _init_lock:
            if self._impl is not None:
                return
            mode = self._selected_mode()
            impl = _mode_registration(mode).factory()
            if impl is None:
                raise TypeError(f"the factory of hook mode {mode!r} returned None, not an implementation")
            self._impl = impl
            try:
                self._built = (mode, weakref.ref(impl))
            except TypeError:
                self._built = (mode, lambda: impl)
            try:
                del self._impl_ctor_kwargs
            except AttributeError:
                pass

    def _built_by_registry(self) -> bool:
        """Whether ``_impl`` is the one a registered mode's factory built."""
        built = getattr(self, "_built", None)
        return built is not None and self._impl is not None and built[1]() is self._impl

    def _selected_mode(self) -> str:
        """The hook mode's name: the registered mode whose factory built ``_impl`` (for a
        builtin one, that of our ``_impl``, which can still switch between them before use),
        else that of our ``_impl``, else an installed ``_impl``'s own ``hook_mode``, else the one
        set (``"preload"`` if none). A mode registered under a name of its own keeps that name
        (and its ``uses_preload``) when its factory gives our implementation."""
        impl = self._impl
        if self._built_by_registry() and (
            self._built[0] not in HOOK_MODES or not isinstance(impl, _TorchMemorySaverImpl)
        ):
            return self._built[0]
        if isinstance(impl, _TorchMemorySaverImpl):
            return impl.hook_mode
        mode = getattr(impl, "hook_mode", None) if impl is not None else None
        if isinstance(mode, str) and mode:
            return mode
        mode = (getattr(self, "_impl_ctor_kwargs", None) or {}).get("hook_mode")
        return "preload" if mode is None else mode

    def _uses_preload(self) -> bool:
        """Whether the hook mode in use (or set, before first use) needs libtms.so in
        ``LD_PRELOAD``: True for ``"preload"`` and ``"torch"`` (torch mode loads the library
        itself, but children keep the preload, as before modes could be registered), else as
        :func:`register_hook_mode` was told. An unregistered mode raises
        :class:`InvalidArgumentError`."""
        return _mode_registration(self._selected_mode()).uses_preload

    # ---------------------------------------------------------------- configuration

    @property
    def hook_mode(self) -> str:
        """``"preload"`` (libtms.so in ``LD_PRELOAD``; the default), ``"torch"`` (a
        ``torch.cuda.MemPool`` per tag whose allocator is libtms.so), or a mode registered with
        :func:`register_hook_mode`. Set it before first use; a name no registration knows is
        kept and refused at first use (integrations that patch ``_ensure_initialized`` read
        names of their own from ``_impl_ctor_kwargs``), or at once where the saver is built
        already (reading :attr:`available` builds it). Changing it once in use raises
        :class:`InvalidStateError`."""
        return self._selected_mode()

    @hook_mode.setter
    def hook_mode(self, mode: str) -> None:
        with _init_lock:
            impl = self._impl
            if impl is None:
                if not hasattr(self, "_impl_ctor_kwargs"):
                    self._impl_ctor_kwargs = {}
                self._impl_ctor_kwargs["hook_mode"] = mode
            elif isinstance(self.__dict__.get("_impl_ctor_kwargs"), dict):
                # Put back by an integration after _impl was built (axrl does, to pin preload
                # mode against Megatron's import-time ``hook_mode = "torch"``): the mode goes
                # there, as in the existing library, and the _impl built keeps its own.
                self._impl_ctor_kwargs["hook_mode"] = mode
            elif mode == self._selected_mode():
                return
            elif isinstance(impl, _TorchMemorySaverImpl):
                _mode_registration(mode)  # refuses a mode no registration knows, naming those that are
                if mode in HOOK_MODES:
                    impl.hook_mode = mode
                    if self._built_by_registry():
                        # Switched from a mode registered under a name of its own: now this one.
                        self._built = (mode, self._built[1])
                elif impl._in_use():
                    raise InvalidStateError(
                        f"hook_mode is already {impl.hook_mode!r} and in use; set it to {mode!r} before the "
                        "first region or pause"
                    )
                else:
                    # Built but never used (``available`` was read, say): the registered mode's
                    # factory builds the implementation at first use instead.
                    self._impl, self._built = None, None
                    self._impl_ctor_kwargs = {"hook_mode": mode}
            elif self._built_by_registry():
                raise InvalidStateError(
                    f"hook_mode is already {self._built[0]!r} and in use; set it to {mode!r} before first use"
                )
            # An integration's own _impl decides its mode itself.

    @property
    def enabled(self) -> bool:
        """True, with no side effect (nothing is initialised or loaded), as in the existing
        library. Whether the library can work in this process is :attr:`available`."""
        return True

    @property
    def available(self) -> bool:
        """True when the package can work in this process in the current hook mode: in preload
        mode, libtms.so is in ``LD_PRELOAD``; in torch mode, the library file is found. False
        means regions, pauses, resumes and ``stats()`` would raise
        :class:`LibraryNotFoundError` (which says how to fix it). Loads nothing."""
        self._ensure_initialized()
        return bool(getattr(self._impl, "available", True))

    def _cpu_backup_backend(self, enable_cpu_backup: bool, cpu_backup_backend: Optional[str]) -> Optional[str]:
        """The host memory a region with these arguments backs up to: the given backend, else
        ``TMS_INIT_CPU_BACKUP_BACKEND``, else ``"pinned"``; None without a CPU backup. Raises
        ``ValueError`` (:class:`InvalidArgumentError`) for a backend without
        ``enable_cpu_backup``, an unknown one, or ``"mmap"`` on XPU."""
        return resolve_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend)

    @property
    def retain_cpu_backup(self) -> bool:
        """Keep host backups across resume, so the next pause reuses them instead of allocating
        host memory again. Consulted at resume; setting it to False frees nothing at once.
        Without it, a resume gives the host memory back: pageable (``"mmap"``) backups before
        it returns, page-locked ones right after, on a thread of its own (slower to unregister;
        the next pause or resume waits for that)."""
        self._ensure_initialized()
        return self._impl.retain_cpu_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, on: bool) -> None:
        self._ensure_initialized()
        self._impl.retain_cpu_backup = on

    @property
    def memory_margin_bytes(self) -> int:
        """A pauseable allocation that would leave fewer bytes free on the device fails with out
        of memory (so PyTorch frees its cache and retries). 0 turns it off."""
        self._ensure_initialized()
        return self._impl.memory_margin_bytes

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, n: int) -> None:
        self._ensure_initialized()
        self._impl.memory_margin_bytes = n

    @property
    def nccl_in_all_tags(self) -> bool:
        """Whether :meth:`pause` and :meth:`resume` of every tag also suspend and resume NCCL's
        communicators (the tag ``"nccl"``). Off by default (``TMS_NCCL_IN_ALL=1`` turns it on):
        the program must not use a suspended communicator, so it asks for this itself."""
        self._ensure_initialized()
        return self._impl.nccl_in_all_tags

    @nccl_in_all_tags.setter
    def nccl_in_all_tags(self, on: bool) -> None:
        self._ensure_initialized()
        self._impl.nccl_in_all_tags = on

    @property
    def nccl_registered_buffers(self) -> str:
        """What a pause does with an allocation holding a buffer NCCL registered
        (``ncclCommRegister``, ``ncclCommWindowRegister``; new memory at the same address would
        leave NCCL on the old one): ``"keep"`` (the default, or ``TMS_NCCL_REGISTERED``) leaves
        it mapped until it is deregistered; ``"refuse"`` makes the pause raise
        :class:`InvalidStateError` naming the buffer, before it changes anything."""
        self._ensure_initialized()
        return self._impl.nccl_registered_buffers

    @nccl_registered_buffers.setter
    def nccl_registered_buffers(self, policy: str) -> None:
        self._ensure_initialized()
        self._impl.nccl_registered_buffers = policy

    def add_nccl_communicators(self, comms: "Iterable[Any]") -> None:
        """Hand over NCCL communicators the library cannot see being made: those of a handle of
        NCCL the program opened itself (pynccl wrappers). ``ncclComm_t`` values as ints, or
        objects with a ``comm`` attribute or ``_comm_ptr()`` giving one. PyTorch's process groups
        are handed over without this. Each must stay alive while handed over."""
        self._ensure_initialized()
        self._impl.add_nccl_communicators(comms)

    def remove_nccl_communicators(self, comms: "Optional[Iterable[Any]]" = None) -> None:
        """Take back communicators given to :meth:`add_nccl_communicators` (all if None), before
        destroying them. Once it returns, no pause, resume or ``stats()`` of another thread hands
        them over again."""
        self._ensure_initialized()
        self._impl.remove_nccl_communicators(comms)

    # ---------------------------------------------------------------- regions

    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: Optional[bool] = None,
        cpu_backup_backend: Optional[str] = None,
        *,
        chunk_size: Optional[int] = None,
    ) -> contextlib.AbstractContextManager:
        """Tensors allocated inside are pauseable under ``tag``.

        They come from a ``torch.cuda.MemPool`` of the region's own (one per tag, backup setting,
        backend, chunk size and device), so cached blocks never move between pauseable and
        ordinary tensors, nor between chunk layouts.

        ``enable_cpu_backup`` (any truthy value) keeps their contents across pause in host
        memory: ``cpu_backup_backend="pinned"`` (the default, or ``TMS_INIT_CPU_BACKUP_BACKEND``)
        is page-locked once retained (``retain_cpu_backup``; a background thread does it after
        the pause), so later cycles copy at link speed; ``"mmap"`` stays pageable, so the kernel
        can take it back. Both are filled and read through small page-locked staging buffers
        where they are not page-locked.

        ``enable_disk_backup=True`` keeps them instead in files of their own in the disk backup
        directory (``set_disk_backup_dir``, ``TMS_DISK_BACKUP_DIR``, else the system's temporary
        directory), written and read at the disk's speed; files are reused across pauses and
        removed when the tensor's memory is freed, at exit and on SIGTERM/SIGINT (where the
        process left their default action). A CPU and a disk backup are
        mutually exclusive.

        The positional order is the existing library's (``tag``, ``enable_cpu_backup``,
        ``enable_disk_backup``, ``cpu_backup_backend``); ``chunk_size`` is keyword-only. Bad
        backup arguments raise :class:`InvalidArgumentError` (a ``ValueError``) in the existing
        library's words: a backend that ``requires enable_cpu_backup``, any backend ``not
        supported on XPU``. ``"mmap"`` works on ROCm too (the existing library refuses it there).

        ``chunk_size=N`` (bytes; 0 or None, the default: not chunked) makes each allocation an
        elastic one: one reserved address range backed by independent physical chunks of ``N``
        bytes, which :meth:`pause_chunks`, :meth:`pause_range` and their ``resume_`` twins give
        back and take again one by one, with the region's backup; :meth:`pause` and
        :meth:`resume` still act on whole allocations. ``N`` must be a positive multiple of the
        device's allocation granularity (2 MiB on current GPUs), else
        :class:`InvalidArgumentError` naming it and the granularity. Every allocation inside
        must be a multiple of ``N`` bytes as PyTorch asks for it (which rounds requests of 10 MiB
        and more up to 2 MiB, and serves smaller ones from 2 or 20 MiB blocks): allocate just the
        chunked buffer inside, e.g. ``torch.empty(k * N, dtype=torch.uint8, device="cuda")``.
        Any other size fails with :class:`InvalidArgumentError` naming both sizes (PyTorch's
        error is its ``__cause__``). Nested regions do not inherit the chunk size.
        """
        self._ensure_initialized()
        return self._impl.region(
            tag=tag,
            enable_cpu_backup=enable_cpu_backup,
            **_given(
                cpu_backup_backend=cpu_backup_backend, enable_disk_backup=enable_disk_backup, chunk_size=chunk_size
            ),
        )

    def disable(self) -> contextlib.AbstractContextManager:
        """Allocations inside are ordinary ``cudaMalloc`` memory that no pause touches, even
        inside a region or under ``TMS_INIT_ENABLE=1``: they come from a pool of their own,
        never from a cached pauseable block. On exit, what freed tensors of the block left
        cached goes back to the device (while another thread's region or a graph capture,
        this package's or one ``torch.cuda.CUDAGraph`` began, is under way, once none is;
        meanwhile the next block on the device reuses it); tensors still alive stay valid
        across every later pause and can be shared with other processes through CUDA IPC
        (``torch.multiprocessing``), while their region's tags are paused too."""
        self._ensure_initialized()
        return self._impl.disable()

    def cuda_graph(
        self,
        cuda_graph: "torch.cuda.CUDAGraph",
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
        tag: str = "default",
        enable_cpu_backup: bool = False,
        cpu_backup_backend: Optional[str] = None,
        enable_disk_backup: Optional[bool] = None,
        chunk_size: Optional[int] = None,
    ) -> contextlib.AbstractContextManager:
        """Like ``torch.cuda.graph(...)``, but the graph's own memory (its intermediate tensors)
        is pauseable under ``tag``; the graph replays correctly after resume. Works in both hook
        modes; in torch mode leave ``pool`` None (the tag's graph pool is made) or pass one of
        this package's pools, since from a pool of PyTorch's own allocator the graph's memory is
        not pauseable (a warning says so). The backup and ``chunk_size`` arguments are those of
        :meth:`region`."""
        self._ensure_initialized()
        return self._impl.cuda_graph(
            cuda_graph=cuda_graph,
            pool=pool,
            stream=stream,
            capture_error_mode=capture_error_mode,
            tag=tag,
            enable_cpu_backup=enable_cpu_backup,
            **_given(
                cpu_backup_backend=cpu_backup_backend, enable_disk_backup=enable_disk_backup, chunk_size=chunk_size
            ),
        )

    def set_disk_backup_dir(self, path: "Optional[str | os.PathLike]") -> None:
        """Put the files of disk backups made from now on in ``path`` (None for the default,
        ``TMS_DISK_BACKUP_DIR`` or else the system's temporary directory). The directory is made
        now if it is missing (mode 0700 for what is made; a path that cannot be a directory
        raises ``InvalidArgumentError``). A relative path is taken against the current directory
        now, so a later ``os.chdir`` does not move the files. The folder is found again by its
        path at each new file: one wiped and made again (or not) is used, and a folder wiped
        while paused loses nothing, as the process holds its files open. Where other users can
        write to it (``/tmp``), the files go in its subfolder ``tms-backups-<uid>`` (mode 0700).
        Files left there by processes that died are removed at first use (and by ``tmsctl
        clean``); a directory in RAM (tmpfs) works but takes host memory, and is logged as
        such."""
        self._ensure_initialized()
        return self._impl.set_disk_backup_dir(path)

    # ---------------------------------------------------------------- residency

    def keep_resident(self, tensor: "torch.Tensor") -> int:
        """Keep the whole allocation holding ``tensor`` (a view of it does) mapped, at the same
        physical memory, across every later :meth:`pause` and :meth:`resume` until it is freed:
        what NCCL user-buffer registration (and CUDA graphs that captured it) need. Returns the
        allocation's size in bytes, the same for any view and when called again; 0 for an empty
        tensor or one outside every pauseable allocation. A paused (or partly paused) allocation
        is refused with :class:`InvalidStateError` ("keep_resident requires an active
        allocation"). Its memory still counts as the tag's, but a pause no longer gives it
        back, and no backup is taken of it."""
        self._ensure_initialized()
        return self._impl.keep_resident(tensor)

    def export_memory(self, tensor: "Union[torch.Tensor, int]") -> "list[tuple[int, int, int]]":
        """Export the device memory of the active allocation holding ``tensor`` (a tensor or a
        device address) for another process to import: one ``(offset, length, fd)`` per
        physical segment, ``fd`` a POSIX file descriptor the caller owns (send it with
        ``socket.send_fds``; the importer calls ``cuMemImportFromShareableHandle`` and maps
        it). Only for memory made while ``TMS_SHAREABLE=1`` (else :class:`DriverError` naming
        the setting); a paused allocation is refused. An importer keeps the memory alive: a
        pause gives it back only once every importer has released its import, and a resume maps
        new memory that earlier exports do not reach (export again). The allocation is exported
        as it is at one moment; where another thread keeps replacing it with a larger one, it
        is refused after a few tries (:class:`InvalidStateError`), nothing exported."""
        self._ensure_initialized()
        return self._impl.export_memory(tensor)

    # ---------------------------------------------------------------- pause / resume

    def pause(
        self,
        tag: Optional[str] = None,
        save_chunk_state: Optional[bool] = None,
        *,
        progress: Optional[Callable[[int, int, str], Any]] = None,
    ) -> None:
        """Give back the device memory of ``tag`` (every tag if None or ``""``), backing up
        contents where the region asked for it. Pausing what is paused does nothing; the
        paused chunks of a chunked allocation stay as they are, the active ones are paused.

        ``save_chunk_state=True`` first records which allocations of the tag, and which chunks
        of chunked ones, are active, for ``resume(tag, restore_chunk_state=True)``.

        ``progress(done, total, phase)``, if given, is called from a helper thread about every
        half second while the pause runs: bytes copied to backups so far and in all, and what it
        does (``"writing_to_disk"``, ``"copying_to_host"``, ``"synchronizing"``, ...; ``"waiting"``
        while another pause or resume runs first); then once more with ``(total, total, "done")``
        when it has succeeded, ``total`` the bytes it copied (its true total, however short the
        pause). Calls come one at a time, ``"done"`` last. A callback should return promptly;
        one that blocks does not hold the pause up (the pause returns, and ``"done"`` follows
        from the helper thread once the callback returns). Whatever it raises, ``KeyboardInterrupt``
        and ``SystemExit`` included, is logged, it is not called again, and the pause's outcome
        stands. A pause that lasts more than 2 s is also logged at INFO every 5 s (the
        ``torch_memory_saver`` logger).

        ``pause("nccl")`` suspends every NCCL communicator of the process instead (NCCL 2.29.7
        or newer; all or none; every rank of each must do so too); every tag includes them
        only with :attr:`nccl_in_all_tags`. An allocation holding a buffer NCCL registered
        stays mapped, or the pause is refused (:attr:`nccl_registered_buffers`)."""
        self._ensure_initialized()
        return self._impl.pause(tag=tag, **_given(save_chunk_state=save_chunk_state, progress=progress))

    def resume(
        self,
        tag: Optional[str] = None,
        restore_chunk_state: Optional[bool] = None,
        *,
        progress: Optional[Callable[[int, int, str], Any]] = None,
        non_blocking: Optional[bool] = None,
        order: "Optional[Iterable[torch.Tensor]]" = None,
        verify: Optional[bool] = None,
    ) -> None:
        """Take device memory back for ``tag`` (every tag if None or ``""``), at the same
        addresses, and restore backups. On out of memory raises :class:`OutOfMemoryError` and
        the tag stays paused with its backups: free memory and call again.

        Every paused allocation and chunk of the tag is resumed, unless
        ``restore_chunk_state=True``: then only the allocations and chunks that were active when
        ``pause(tag, save_chunk_state=True)`` ran (all of an allocation with nothing recorded).

        ``progress(done, total, phase)`` as for :meth:`pause` (phases ``"reading_from_disk"``,
        ``"copying_to_device"``, ``"mapping"``, ...); a resume that lasts more than 2 s is
        logged at INFO every 5 s.

        ``non_blocking=True`` returns as soon as the memory is mapped, while the contents are
        still being copied back: work then queued on the current CUDA stream runs after the
        restore (the stream waits on the GPU; the host does not), so Python, kernel launches and
        other set-up overlap the copies. ``order=[tensors]`` restores the allocations holding
        them first, in that order (the rest after). Use :meth:`wait` for one tensor, another
        stream or the host. An error before the return (out of memory, ...) is raised here and
        leaves the tag paused, as for a blocking resume; a failure after it leaves the tag
        paused with its backups (nothing is lost: resume again) and its memory held: every
        :meth:`wait` for it raises the error until the tag is paused (which gives the memory
        back) or resumed, and if none did, that pause or resume raises it once it has acted
        (``stats()`` shows ``failed_restore``). Work on other streams is not ordered: make them
        :meth:`wait`. Not with ``restore_chunk_state`` or ``progress``.

        ``resume("nccl")`` resumes NCCL's communicators (before any memory, when every tag
        includes them: :attr:`nccl_in_all_tags`).

        ``verify=True`` checks what came back whatever the tag's setting (:meth:`set_checks`):
        the restored memory is digested on the device and compared with the CPU backups; where
        it differs, :class:`DriverError` names the allocation and the bytes, and the tag stays
        paused with its backups (nothing is lost: resume again). Memory restored from a disk
        backup raises :class:`UnsupportedError` before anything is mapped (a file's chunks are
        checked against their checksums as they are read). ``True`` or ``False`` only; not with
        ``non_blocking``."""
        self._ensure_initialized()
        return self._impl.resume(
            tag=tag,
            **_given(
                restore_chunk_state=restore_chunk_state,
                progress=progress,
                non_blocking=non_blocking,
                order=order,
                # False is the default (an installed _impl without the keyword still works);
                # anything else but True is passed on and refused there.
                verify=None if verify is False else verify,
            ),
        )

    def set_checks(
        self,
        tag: Optional[str] = None,
        *,
        skip_unchanged: Optional[bool] = None,
        verify: Optional[bool] = None,
    ) -> None:
        """What pauses and resumes of ``tag`` check with digests of the memory taken on the
        device (``tag=None``: every tag without a setting of its own; at start
        ``TMS_SKIP_UNCHANGED`` and ``TMS_VERIFY_RESUME``, both off). Each argument left out
        keeps its value.

        ``skip_unchanged=True``: a pause of memory whose CPU backup was retained
        (:attr:`retain_cpu_backup`) copies only the pieces (2 MiB on current GPUs) that changed
        since that backup took them, for parts of a model that stay frozen between pauses.
        ``verify=True``: a resume digests what it restored and fails where it differs from the
        backup, as ``resume(verify=True)`` does. A 128-bit digest per piece, keyed per process:
        a changed piece is taken for unchanged only by a collision of both 64-bit halves
        (docs/design.md). On a device that cannot digest (ROCm for now) everything is copied
        and nothing checked."""
        self._ensure_initialized()
        self._impl.set_checks(tag, skip_unchanged=skip_unchanged, verify=verify)

    def get_checks(self, tag: Optional[str] = None) -> dict:
        """What pauses and resumes of ``tag`` (None: the default) check:
        ``{"skip_unchanged": bool, "verify": bool}``."""
        self._ensure_initialized()
        return self._impl.get_checks(tag)

    def wait(
        self,
        tensor: "Optional[torch.Tensor]" = None,
        *,
        stream: "Union[torch.cuda.Stream, bool, None]" = None,
        timeout: Optional[float] = None,
    ) -> bool:
        """Wait for what ``resume(..., non_blocking=True)`` is restoring into the allocation
        holding ``tensor`` (a tensor or a device address; every allocation, if None).

        With ``stream`` (a ``torch.cuda.Stream``, or True for the current one) nothing blocks:
        that stream's later work runs once the data landed; returns True. Without it, blocks
        the calling thread until the data landed (True) or ``timeout`` seconds passed (False).
        Returns at once when nothing is being restored. A resume that failed after it returned
        left its allocations unrestored (paused, memory held): a wait for any of them raises
        its error, every time, until they are paused, resumed or freed; one that failed after
        everything landed is raised once, by the next wait for everything (docs/semantics.md)."""
        self._ensure_initialized()
        return self._impl.wait(tensor, **_given(stream=stream, timeout=timeout))

    # ---------------------------------------------------------------- chunked allocations

    def pause_chunks(
        self,
        tag_or_tensor: "Union[str, torch.Tensor, None]" = None,
        indices: Optional[Iterable[int]] = None,
        *,
        tag: "Union[str, torch.Tensor, None]" = None,
        chunk_indices: Optional[Iterable[int]] = None,
    ) -> None:
        """Pause chunks ``indices`` (any iterable of ints >= 0, counted from the start of the
        allocation) of a chunked allocation (see ``region(chunk_size=...)``): back each one up
        where the region asked for a backup, then give its device memory back. Chunks already
        paused are skipped, so chunk calls and :meth:`pause`/:meth:`resume` compose in any order.

        ``tag_or_tensor`` is a tag with exactly one chunked allocation (else an error naming
        them), or a tensor: the chunked allocation holding ``tensor.data_ptr()`` (a view of it
        does; indices still count chunks of the whole allocation). An index past the last chunk
        raises :class:`InvalidArgumentError` and pauses nothing. A tag without any allocation
        has no chunks to pause: nothing happens, as in the existing library (a tag whose
        allocations are all unchunked raises :class:`NotFoundError`).

        The existing library's keywords work too: ``pause_chunks(tag="kv", chunk_indices=[0])``
        (one name per argument, else ``TypeError``).

        A paused chunk must not be touched: a kernel reading or writing it faults like any
        paused memory, with an illegal-address CUDA error that poisons the CUDA context (every
        later CUDA call of the process fails). Keeping kernels and CUDA graphs off paused chunks
        is the caller's job."""
        target, idx = chunk_arguments("pause_chunks", tag_or_tensor, indices, tag, chunk_indices)
        self._ensure_initialized()
        return self._impl.pause_chunks(target, idx)

    def resume_chunks(
        self,
        tag_or_tensor: "Union[str, torch.Tensor, None]" = None,
        indices: Optional[Iterable[int]] = None,
        *,
        tag: "Union[str, torch.Tensor, None]" = None,
        chunk_indices: Optional[Iterable[int]] = None,
    ) -> None:
        """Resume chunks ``indices`` of a chunked allocation (arguments as :meth:`pause_chunks`,
        ``tag=`` and ``chunk_indices=`` included) at the same addresses, restoring their backups
        (without one their contents are undefined). Chunks already active are skipped; a tag
        without any allocation does nothing. On out of memory raises
        :class:`OutOfMemoryError` naming the chunks, and every chunk it was to resume stays
        paused with its backup: free memory and call again."""
        target, idx = chunk_arguments("resume_chunks", tag_or_tensor, indices, tag, chunk_indices)
        self._ensure_initialized()
        return self._impl.resume_chunks(target, idx)

    def pause_range(self, tensor: "torch.Tensor", start: int, end: int) -> range:
        """Pause the chunks lying wholly inside bytes ``[start, end)`` of ``tensor`` (offsets
        from ``tensor.data_ptr()``; ``0 <= start <= end <=`` the tensor's size in bytes, and
        ``tensor`` contiguous, else :class:`InvalidArgumentError`). The range is rounded
        *inward* to whole chunks: a chunk only partly inside it stays active, so bytes of the
        range may stay mapped but no byte outside it is paused. Returns the chunk indices acted
        on (of the allocation holding ``tensor``), ``range(first, first + count)``, empty when
        no whole chunk lies inside. As with :meth:`pause_chunks`, a kernel touching a paused
        chunk faults (an illegal-address CUDA error that poisons the context)."""
        self._ensure_initialized()
        return self._impl.pause_range(tensor, start, end)

    def resume_range(self, tensor: "torch.Tensor", start: int, end: int) -> range:
        """Resume the chunks lying wholly inside bytes ``[start, end)`` of ``tensor``, rounded
        inward as :meth:`pause_range` does (so the same arguments resume what it paused).
        Returns the chunk indices acted on, ``range(first, first + count)``."""
        self._ensure_initialized()
        return self._impl.resume_range(tensor, start, end)

    def get_num_chunks(
        self, tag_or_tensor: "Union[str, torch.Tensor, None]" = None, *, tag: "Union[str, torch.Tensor, None]" = None
    ) -> int:
        """The number of chunks of a chunked allocation (a tag with exactly one, or the
        allocation holding a tensor; ``tag=`` names either, as in the existing library). 0 for a
        tag without any allocation, as there; a tag whose allocations are all unchunked raises
        :class:`NotFoundError`, a non-chunked tensor :class:`InvalidArgumentError`."""
        target = chunk_target("get_num_chunks", tag_or_tensor, tag)
        self._ensure_initialized()
        return self._impl.get_num_chunks(target)

    def get_chunk_states(
        self, tag_or_tensor: "Union[str, torch.Tensor, None]" = None, *, tag: "Union[str, torch.Tensor, None]" = None
    ) -> "list[bool]":
        """Each chunk's state of a chunked allocation (as :meth:`get_num_chunks`; ``[]`` for a
        tag without any allocation), in order: True while it is active (mapped), False while it
        is paused. The states are those of the allocation as one call found it; where another
        thread keeps replacing it with a larger one, it is refused after a few tries
        (:class:`InvalidStateError`)."""
        target = chunk_target("get_chunk_states", tag_or_tensor, tag)
        self._ensure_initialized()
        return self._impl.get_chunk_states(target)

    def get_chunk_layout(
        self, tag_or_tensor: "Union[str, torch.Tensor, None]" = None, *, tag: "Union[str, torch.Tensor, None]" = None
    ) -> "list[tuple[int, int]]":
        """Each chunk of a chunked allocation (as :meth:`get_num_chunks`; ``[]`` for a tag
        without any allocation) as ``(offset, size)`` in bytes, the offset from the start of the
        allocation (for a tensor, the allocation holding it, which may start before
        ``tensor.data_ptr()``). Of the allocation as one call found it, as
        :meth:`get_chunk_states`."""
        target = chunk_target("get_chunk_layout", tag_or_tensor, tag)
        self._ensure_initialized()
        return self._impl.get_chunk_layout(target)

    # ---------------------------------------------------------------- backups and stats

    def get_cpu_backup(self, x: "torch.Tensor", zero_copy: bool = False) -> "Optional[torch.Tensor]":
        """The host backup of ``x`` as a CPU tensor of the same dtype and shape (a copy, or with
        ``zero_copy=True`` a view of the backup itself, which stays mapped and unchanged while
        the view lives), or None where there is none (no backup enabled, the allocation active
        with its backup released, or no library in this process) and where ``x`` does not lie inside one pauseable
        allocation or is empty, as the existing library answers. ``x`` must be contiguous. With
        ``retain_cpu_backup`` on, a ``zero_copy`` view of a pinned backup is page-locked memory:
        the call waits for the background page-locking of that backup to finish."""
        self._ensure_initialized()
        if zero_copy:
            return self._impl.get_cpu_backup(x, zero_copy=True)
        return self._impl.get_cpu_backup(x)

    def stats(self) -> dict:
        """Per-tag statistics: allocations (``active_allocations``, ``paused_allocations``, and
        ``partial_allocations``: chunked ones with some chunks paused, or one a failed pause
        could not make whole again), bytes active/paused (chunk by chunk), host backup bytes
        (and how many of them are page-locked), and the last pause/resume (seconds, bytes,
        GiB/s, and the part of a resume spent releasing host memory). While a non-blocking
        resume restores: ``restoring_allocations`` and ``bytes_restoring`` (held, neither active
        nor paused); after one failed once it returned: ``failed_restore`` (its error) and
        ``bytes_unrestored`` (memory still held until a pause or resume of the tag; also what
        the undo of another failed call could not unmap). ``newest_allocation``: the serial of
        the tag's newest allocation (the process's allocations are numbered 1, 2, ...), which,
        with ``allocations``, tells whether the program made one in the tag between two calls,
        even in place of a freed one of its size. Once the
        process has NCCL communicators, the tag ``"nccl"`` counts them as its allocations,
        NCCL's memory as its bytes, and ``nccl`` holds NCCL's own numbers (``version``,
        ``unsupported``, ``communicators``, ``suspended``, ``suspendable_bytes``,
        ``suspended_bytes``, ``persistent_bytes``, ``total_bytes``, ``registered_buffers``,
        ``in_all_tags``, ``registered_policy``). Statistics that another thread keeps making
        larger (new tags, say) between the library's answers are asked for again a few times,
        then refused (:class:`InvalidStateError`)."""
        self._ensure_initialized()
        return self._impl.stats()

    def summary(self) -> str:
        """The statistics as a readable table (with a ``partial`` column while some chunked
        allocation has chunks of both states)."""
        self._ensure_initialized()
        return self._impl.summary()
