"""NCCL's communicators as the tag ``"nccl"``: the two settings, and handing the library the
communicators it cannot see being made (PyTorch's process groups in torch mode, where PyTorch
loaded NCCL before the library; communicators the program made through a handle of its own).

``pause("nccl")`` suspends every live communicator the library knows (NCCL 2.29.7 or newer:
``ncclCommSuspend``), ``resume("nccl")`` resumes them; before each pause or resume of that tag
or of every tag, and before ``stats()``, the communicators of PyTorch's process groups
(``ProcessGroupNCCL._comm_ptr()``, PyTorch 2.8 or newer) and those given to
:meth:`_Nccl.add_nccl_communicators` are handed over (``tms_nccl_adopt``), replacing those
handed over before."""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any, Callable, Iterable, Optional

from .arguments import _U64_MAX
from .binary_wrapper import BinaryWrapper
from .errors import InvalidArgumentError

NCCL_TAG = "nccl"
_POLICIES = ("keep", "refuse")


def process_group_communicators() -> list:
    """The NCCL communicators (``ncclComm_t`` values) of the live process groups of
    ``torch.distributed``, on the current CUDA device, each once; none where torch.distributed
    is not imported or not initialized (nothing is imported for this), or PyTorch does not
    expose them. A process group whose communicator is not made yet gives none."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return []
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return []
        import torch

        c10d = dist.distributed_c10d
        world = getattr(c10d, "_world", None)
        groups = list(getattr(world, "pg_map", None) or getattr(c10d, "_pg_map", None) or {})
        device = torch.device("cuda", torch.cuda.current_device())
    except Exception:  # noqa: BLE001 - no process groups to hand over, whatever the reason
        return []
    found: list = []
    for pg in groups:
        try:
            ptr = getattr(pg._get_backend(device), "_comm_ptr", None)
            comm = int(ptr()) if callable(ptr) else 0
        except Exception:  # noqa: BLE001 - a group of another backend, or none made yet
            continue
        if comm and comm not in found:
            found.append(comm)
    return found


class _Nccl:
    """NCCL's part of :class:`~.saver._TorchMemorySaverImpl`, which gives the library."""

    _library: Callable[[], BinaryWrapper]
    # Communicators added by the program, and whether the library holds any handed over.
    _nccl_extra: list
    _nccl_handed: bool
    # Held while those change and over each hand-over (reading the list, then handing it
    # over): a hand-over of another thread's pause would otherwise hand over, after
    # remove_nccl_communicators returned, a communicator it read before.
    _nccl_lock: threading.RLock

    @property
    def nccl_in_all_tags(self) -> bool:
        """Whether ``pause()`` and ``resume()`` of every tag include NCCL's communicators (off
        by default, or as ``TMS_NCCL_IN_ALL`` says): the program must not use a suspended
        communicator, so it asks for this itself."""
        lib = self._library()
        v = ctypes.c_int(0)
        lib.check(lib.tms_nccl_get_in_all(ctypes.byref(v)))
        return bool(v.value)

    @nccl_in_all_tags.setter
    def nccl_in_all_tags(self, on: Any) -> None:
        lib = self._library()
        lib.check(lib.tms_nccl_set_in_all(int(bool(on))))

    @property
    def nccl_registered_buffers(self) -> str:
        """What a pause does with an allocation holding a buffer NCCL registered
        (``ncclCommRegister``, ``ncclCommWindowRegister``): ``"keep"`` (the default, or as
        ``TMS_NCCL_REGISTERED`` says) leaves it mapped until deregistered; ``"refuse"`` makes
        the pause raise :class:`InvalidStateError` naming the buffer, before it changes
        anything."""
        lib = self._library()
        return lib.call_string(lib.tms_nccl_get_registered)

    @nccl_registered_buffers.setter
    def nccl_registered_buffers(self, policy: str) -> None:
        if policy not in _POLICIES:
            raise InvalidArgumentError(f"nccl_registered_buffers must be 'keep' or 'refuse', not {policy!r}")
        lib = self._library()
        lib.check(lib.tms_nccl_set_registered(policy.encode("ascii")))

    def add_nccl_communicators(self, comms: Iterable[Any]) -> None:
        """Hand over NCCL communicators the library cannot see being made (``ncclComm_t``
        values as ints, or objects with a ``comm`` or ``_comm_ptr`` giving one): made through a
        handle of NCCL the program opened itself, as pynccl wrappers do. Each must stay alive
        while handed over; :meth:`remove_nccl_communicators` takes them back."""
        values = [_comm_value(c) for c in comms]
        with self._nccl_lock:
            added = []
            for v in values:
                if v not in self._nccl_extra and v not in added:
                    added.append(v)
            self._nccl_extra.extend(added)
            try:
                self._hand_over_nccl(NCCL_TAG)
            except BaseException:
                # Refused (a value that points at no memory, say): none of them is kept.
                self._nccl_extra[:] = [c for c in self._nccl_extra if c not in added]
                raise

    def remove_nccl_communicators(self, comms: Optional[Iterable[Any]] = None) -> None:
        """Take back communicators given to :meth:`add_nccl_communicators` (all if None): do it
        before destroying them. Once it returns, no pause, resume or ``stats()`` of another
        thread hands them over again."""
        gone = None if comms is None else {_comm_value(c) for c in comms}
        with self._nccl_lock:
            if gone is None:
                self._nccl_extra.clear()
            else:
                self._nccl_extra[:] = [c for c in self._nccl_extra if c not in gone]
            self._hand_over_nccl(NCCL_TAG)

    def _hand_over_nccl(self, tag: Optional[str]) -> None:
        """Before a pause or resume of ``tag`` (every tag if None) or a ``stats()``: hand the
        library the communicators of the process groups and those added."""
        if tag not in (None, NCCL_TAG):
            return
        with self._nccl_lock:
            comms = process_group_communicators()
            comms += [c for c in self._nccl_extra if c not in comms]
            if not comms and not self._nccl_handed:
                return
            lib = self._library()
            arr = (ctypes.c_uint64 * len(comms))(*comms) if comms else None
            lib.check(lib.tms_nccl_adopt(arr, len(comms)))
            self._nccl_handed = bool(comms)


def _comm_value(c: Any) -> int:
    """An ``ncclComm_t`` as an int, from an int or an object holding one."""
    for attr in ("_comm_ptr", "comm"):
        v = getattr(c, attr, None)
        if v is not None:
            c = v() if callable(v) else v
            break
    if isinstance(c, ctypes.c_void_p):
        c = c.value
    if isinstance(c, bool) or not isinstance(c, int) or not 0 < c <= _U64_MAX:
        raise InvalidArgumentError(f"an NCCL communicator must be a non-zero pointer value, not {c!r}")
    return c
