"""Regions, graph captures and ``disable()`` blocks of the implementation
(:class:`~.saver._TorchMemorySaverImpl`): the library's per-thread flags and, where torch is in
use, which ``MemPool`` serves the allocations: one per region key (:class:`_PoolMap`, the
``_mem_pools`` integrations reach), routed to per thread (:class:`_Routing`)."""

from __future__ import annotations

import contextlib
import functools
import re
import sys
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional

from .arguments import (
    _check_backup,
    _check_chunk_size,
    _check_disk,
    _check_tag,
    _enc,
    _require_torch,
    _torch_if_cuda,
    resolve_cpu_backup_backend,
)
from .binary_wrapper import BinaryWrapper
from .errors import InvalidArgumentError, TorchMemorySaverError
from .hooks import HookUtilBase

if TYPE_CHECKING:  # pragma: no cover
    import torch

# The library's message for an allocation whose size is not a multiple of its region's chunk size.
_CHUNK_MISFIT = re.compile(r"chunk size (\d+) bytes: the size \((\d+) bytes\) must be a multiple of it")


class _Routing:
    """Which pools this process's threads route allocations to, through ``use_mem_pool``.

    PyTorch (2.11) asserts, and so ends the process, when a ``MemPool`` is destroyed while any
    thread routes to a pool or captures a graph: the pool's destructor frees its cache, which
    needs that nothing be under way. So a route's end hands its pool to ``retired`` rather than
    dropping it: ``disable()``'s own pool, whose end gives its cache back, and a region's pool,
    whose last reference the route holds where ``_mem_pools`` dropped it meanwhile; and a pool
    map hands over what ``del``, ``pop``, ``[] =``, ``clear``, ``popitem``, ``update`` and
    ``|=`` drop from it. Retired pools are let go only when no route or capture of this package
    is active in any thread (with the last route or capture to end), and no route or capture
    starts in another thread until they have gone. A sibling lives as long as the pool it was
    made for (``siblings`` is keyed weakly by that pool, and a route to a sibling holds that
    pool), so it goes then too.

    The captures counted are this package's (``cuda_graph``) and, from its first route or pool
    on, every one that PyTorch's ``CUDAGraph`` begins, whatever code and thread begins it
    (``torch.cuda.graph``, ``make_graphed_callables``, torch.compile's cudagraphs): its methods
    that begin and end a capture are wrapped on the class (``_count_captures``), a capture
    counts once in ``graphs`` from before it begins to after an end of it returns (not one
    that raised: PyTorch may hold it as under way for good, and retired pools then wait).
    This thread's own capture is seen anyway (its stream captures). Not seen in other threads:
    a capture begun before the package's first route or pool, or through
    ``torch._C._CUDAGraph`` itself, and a route that other code starts there
    (``torch.cuda.use_mem_pool``; ``_cuda_beginAllocateCurrentStreamToPool``, as torch.compile's
    cudagraph trees do). ``use_mem_pool`` is left unwrapped: Dynamo recognizes it by identity,
    and the package's own routes call it under a route's lock, where no wait may come.

    Meanwhile a ``disable()`` block takes a retired pool of an earlier one of its device
    (``spare``) rather than making its own: while one thread keeps a region open for ever (a
    serving thread), the blocks of another would otherwise each leave a pool, with its cache,
    till that region's end. So the retired ``disable()`` pools are at most as many as such
    blocks open at once on the device.
    """

    def __init__(self) -> None:
        # Reentrant: a garbage collection may come at any bytecode inside a block that holds it
        # and finalize a region or capture left unexited, whose end takes it again in this thread.
        self.lock = threading.RLock()
        # Signalled when a destruction of retired pools ends (``destroying`` back to None).
        self.done = threading.Condition(self.lock)
        self.active = 0
        # id(pool) -> pool: one entry per pool, however many routes to it ended meanwhile.
        self.retired: dict = {}
        # device -> the retired pools of disable() blocks made on it (also in ``retired``), for
        # the next such block there. Only those: any other pool may be routed to or held
        # elsewhere (a region's, a kept disable() pool), or have another allocator.
        self.spare: dict = {}
        # The thread destroying retired pools, which it does after letting go of the lock (a
        # pool's end can run Python code that routes again): others wait to route till it ends.
        self.destroying: Optional[int] = None
        # PyTorch lets one thread at a time route to a pool ("beginAllocateToPool: already
        # recording to mempool_id"), so a region entered by a second thread while the first is
        # inside it gets a sibling pool of the same kind. busy: id(pool) -> the thread routing
        # to it; siblings: the pool -> its siblings, held weakly, so that a dropped pool (and
        # its siblings) still goes; by id(pool) -> (the pool, its siblings) for a pool that
        # cannot be weakly referenced.
        self.busy: dict = {}
        self.siblings: Any = weakref.WeakKeyDictionary()
        self.pinned_siblings: dict = {}
        # id(graph) -> graph: the captures of PyTorch's CUDAGraph under way, counted in
        # ``active`` (see _count_captures). Held, so that an id is not reused meanwhile.
        self.graphs: dict = {}

    def _siblings_of(self, pool: Any) -> list:
        try:
            return self.siblings.setdefault(pool, [])
        except TypeError:  # not weakly referenceable (or not hashable)
            return self.pinned_siblings.setdefault(id(pool), (pool, []))[1]

    def claim(self, pool: Any, make: Any) -> Any:
        """A pool of ``pool``'s kind that no other thread routes to now (``pool`` itself when
        free; else a sibling, made with ``make()`` where all are busy), marked as this
        thread's."""
        me = threading.get_ident()
        with self.lock:
            if self.busy.get(id(pool), me) == me or make is None:
                self.busy[id(pool)] = me
                return pool
            sibs = self._siblings_of(pool)
            for sib in sibs:
                if self.busy.get(id(sib), me) == me:
                    self.busy[id(sib)] = me
                    return sib
        sib = make()
        with self.lock:
            sibs.append(sib)
            self.busy[id(sib)] = me
        return sib

    def release(self, pool: Any) -> None:
        with self.lock:
            self.busy.pop(id(pool), None)

    def _wait_for_destruction(self) -> None:
        """Wait (the lock held) while another thread destroys retired pools."""
        me = threading.get_ident()
        while self.destroying not in (None, me):
            self.done.wait()

    def enter(self) -> None:
        with self.lock:
            self._wait_for_destruction()
            self.active += 1

    def leave(self, torch: Any) -> None:
        with self.lock:
            self.active -= 1
        self.collect(torch)

    def begin_capture(self, graph: Any) -> bool:
        """Count ``graph``'s capture as active (as ``enter``), unless it is counted already
        (a wrapper of ours under another, a second ``capture_begin``); whether this call
        counted it."""
        with self.lock:
            self._wait_for_destruction()
            if id(graph) in self.graphs:
                return False
            self.graphs[id(graph)] = graph
            self.active += 1
        return True

    def end_capture(self, graph: Any, torch: Any) -> None:
        """Uncount ``graph``'s capture where counted (so once, however many ends it goes
        through), and collect (as ``leave``)."""
        with self.lock:
            if self.graphs.pop(id(graph), None) is None:
                return
            self.active -= 1
        self.collect(torch)

    def retire_pools(self, pools: list) -> None:
        """Take ``pools``, dropped from a pool map, into ``retired`` (see ``retire``): where
        the map held their last references, they go only when no route or capture is active.
        A pool lives only once torch is imported, hence ``sys.modules``."""
        torch = sys.modules.get("torch")
        if not pools or torch is None:
            return
        _count_captures(torch)
        with self.lock:
            for p in pools:
                self.retired[id(p)] = p
        self.collect(torch)

    def retire(self, route: Any, torch: Any, spare: Any = None) -> None:
        """Take ``route``'s pool, maybe its last reference, into ``retired`` (so that it is
        destroyed only by ``collect``, while no route or capture is active), and collect.
        ``spare``: the device of a ``disable()`` block's own pool, which the next such block
        there may take while it waits (see ``take_spare``)."""
        with self.lock:
            self.retired[id(route.pool)] = route.pool
            if spare is not None:
                self.spare.setdefault(spare, []).append(route.pool)
            route.pool = None
        self.collect(torch)

    def take_spare(self, device: Any) -> Any:
        """A retired ``disable()`` pool of ``device``, no longer retired (the caller holds it
        alone), or None. One being destroyed is no longer there: ``collect`` took it."""
        with self.lock:
            pools = self.spare.get(device)
            if not pools:
                return None
            pool = pools.pop()
            if not pools:
                del self.spare[device]
            del self.retired[id(pool)]
            return pool

    @staticmethod
    def _capture_under_way(torch: Any) -> bool:
        """Whether this thread's stream captures. Asked only where CUDA is initialized: before,
        no capture can be under way, and asking would raise (no usable device: a CPU build, no
        driver, a forked child) or initialize CUDA, where a pool map merely drops an entry
        (an integration's own stand-in pool, say)."""
        initialized = getattr(torch.cuda, "is_initialized", None)
        if initialized is not None and not initialized():
            return False
        return bool(torch.cuda.is_current_stream_capturing())

    def collect(self, torch: Any) -> None:
        me = threading.get_ident()
        # Till nothing is left: a pool's end may route again and retire that route's pool (a
        # disable() block's own) while the destruction is under way, which the nested collect
        # leaves to this one; waiting for some later route's end instead could keep it for ever.
        while True:
            with self.lock:
                self._wait_for_destruction()
                if self.destroying == me:  # from a pool's end: the destruction under way goes on
                    return
                if self.active or not self.retired or self._capture_under_way(torch):
                    return
                dead, self.retired = self.retired, {}
                self.spare = {}
                self.destroying = me
            try:
                del dead  # the last references of pools no one else holds: each gives its cached blocks back
            finally:
                with self.lock:
                    self.destroying = None
                    self.done.notify_all()


_routing = _Routing()

# Our wrappers of CUDAGraph's methods, to know one under an integration's (see _count_captures).
_capture_wrappers: Any = weakref.WeakSet()
# Reentrant: a garbage collection inside may end a block whose end routes again.
_capture_wrappers_lock = threading.RLock()


def _ours(method: Any) -> bool:
    """Whether ``method`` is one of our wrappers, or wraps one (``functools.wraps``)."""
    seen = set()
    while method is not None and id(method) not in seen:
        try:
            if method in _capture_wrappers:
                return True
        except TypeError:  # not hashable: none of ours
            pass
        seen.add(id(method))
        method = getattr(method, "__wrapped__", None)
    return False


def _counting_begin(begin: Any, torch: Any) -> Any:
    @functools.wraps(begin)
    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Counted before PyTorch begins, so that no pool is destroyed from then on.
        counted = _routing.begin_capture(self)
        try:
            return begin(self, *args, **kwargs)
        except BaseException:
            if counted:  # no capture began
                _routing.end_capture(self, torch)
            raise

    return capture_begin


def _counting_end(end: Any, torch: Any) -> Any:
    @functools.wraps(end)
    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Uncounted once PyTorch's end returned. An end that raised may leave the capture in
        # the allocator's list for good (an invalidated capture: cudaStreamEndCapture fails
        # before the allocator hears of the end), where destroying a pool ends the process:
        # it stays counted, retired pools waiting, till an end of this graph returns.
        out = end(self, *args, **kwargs)
        _routing.end_capture(self, torch)
        return out

    return capture_end


# The methods that begin and end a capture: capture_end_pre ends it where PyTorch has one
# (capture_end calls it; torch.cuda.graph calls it alone where it fails after capture_begin).
_CAPTURE_METHODS = (
    ("capture_end_pre", _counting_end),
    ("capture_end", _counting_end),
    ("capture_begin", _counting_begin),  # last: never a count that no end takes off
)


def _count_captures(torch: Any) -> None:
    """Count each graph capture that PyTorch's ``CUDAGraph`` begins, whatever code begins it
    (``torch.cuda.graph``, ``make_graphed_callables``, torch.compile's cudagraphs), in
    ``_routing.active`` till it ends: the methods that begin and end one are wrapped on the
    class. Called where the package routes or handles a pool (where torch is in use), not at
    its import; a method someone patched is wrapped as it is, and wrapped again only where
    someone replaced our wrapper by something that does not wrap it."""
    graph_class = getattr(getattr(torch, "cuda", None), "CUDAGraph", None)
    if graph_class is None:
        return
    with _capture_wrappers_lock:
        for name, wrap in _CAPTURE_METHODS:
            method = getattr(graph_class, name, None)
            if method is None or _ours(method):
                continue
            wrapper = wrap(method, torch)
            try:
                setattr(graph_class, name, wrapper)
            except (AttributeError, TypeError):  # a class that cannot be patched: as before
                return
            _capture_wrappers.add(wrapper)


def _may_capture(torch: Any) -> bool:
    """Whether this thread's stream may capture a graph now (True where asking fails)."""
    try:
        return _Routing._capture_under_way(torch)
    except Exception:  # unknown: the answer that never shares a pool with a graph
        return True


class _Route:
    """One pool this thread's allocations are routed to, and the ``use_mem_pool`` context that
    does it while the route is the innermost one (None while a nested route suspends it)."""

    def __init__(self, pool: Any, make: Any = None, spare: Any = None) -> None:
        self.pool = pool
        self.make = make
        # The device of a disable() block's own pool, which a later such block may take once
        # retired (``_Routing.take_spare``); None where it may not.
        self.spare = spare
        self.ctx: Any = None
        self.using: Any = None
        # The device routed on: the current one at the first start. A restart (after a nested
        # block suspended the route) may come under another current device (``with
        # torch.cuda.device(1): with cuda_graph(...)``), and ``use_mem_pool`` routes the current
        # device's allocations unless told which.
        self.device: Any = None
        # Set once taken off its stack (_unlink); start and stop hold ``lock``.
        self.ended = False
        self.lock = threading.RLock()

    def _note_capture(self, torch: Any) -> None:
        """A pool a graph capture may allocate from holds the graph's memory while the graph
        lives (its replays write there), so an eager block must never take it: no spare."""
        if self.spare is not None and _may_capture(torch):
            self.spare = None

    def start(self, torch: Any) -> None:
        if self.ctx is not None:  # routing already (see _restart_top)
            return
        self._note_capture(torch)
        # Counted as routing before PyTorch routes, so that no pool is destroyed meanwhile;
        # before the route's lock, as this may wait for a destruction that ends this block.
        _routing.enter()
        try:
            with self.lock:
                # Ended by a collection in another thread since this thread read it off its
                # stack (see _unlink): its pool is retired, maybe taken by another block.
                ended = self.ended
                if not ended:
                    self._route(torch)
        except BaseException:
            _routing.leave(torch)
            raise
        if ended:
            _routing.leave(torch)
        elif self.ended:  # ended meanwhile by a collection in this thread, which found it idle
            self.stop(torch)

    def _route(self, torch: Any) -> None:
        using = _routing.claim(self.pool, self.make)
        try:
            current = torch.cuda.current_device()
            if self.device is None:
                self.device = current
            if current == self.device:  # the call as ever, for what wraps or stands in for it
                ctx = torch.cuda.use_mem_pool(using)
            else:
                ctx = torch.cuda.use_mem_pool(using, device=self.device)
            ctx.__enter__()
        except BaseException:
            _routing.release(using)
            raise
        self.ctx, self.using = ctx, using

    def stop(self, torch: Any) -> None:
        # Under the route's lock: a start in this route's thread that read it off the stack
        # before a collection in another thread ended it either sees it ended or is ended here.
        # leave() after the lock, also where PyTorch raised: it may wait for a destruction under
        # way in the route's own thread, whose next step may be to stop this route.
        routed = False
        try:
            with self.lock:
                ctx, self.ctx = self.ctx, None
                using, self.using = self.using, None
                routed = ctx is not None
                if not routed:
                    return
                try:
                    self._note_capture(torch)  # also a capture begun inside the block
                    ctx.__exit__(None, None, None)
                finally:
                    _routing.release(using)
        finally:
            if routed:
                _routing.leave(torch)


def _route_stack(local: threading.local) -> list:
    """This thread's route stack (routes and captures, innermost last)."""
    stack = getattr(local, "routes", None)
    if stack is None:
        stack = local.routes = []
    return stack


# Guards the route stacks' changes: a block left unexited may be ended by a garbage collection
# in another thread, which takes its entry off the stack of the thread that entered it (see
# _unlink). Reentrant: a collection may come inside and end a block of this very thread.
_stacks_lock = threading.RLock()


def _push(local: threading.local, torch: Any, top: Any) -> list:
    """Put ``top`` (a route, or a capture's place) on this thread's route stack: the one on top
    now is suspended and ``top`` started, or, where ``top`` cannot start, the suspended one
    restarted and the error raised. Returns the stack, for ``_unlink`` at the block's end."""
    stack = _route_stack(local)
    # Till the one on top stays suspended: a collection while it stops may end it (a block left
    # unexited) and restart the one below it (see _restart_top).
    suspended = None
    while True:
        with _stacks_lock:
            outer = stack[-1] if stack else None
        if outer is None or outer is suspended:
            break
        outer.stop(torch)
        suspended = outer
    try:
        top.start(torch)
    except BaseException:
        _restart_top(local, stack, torch)
        raise
    with _stacks_lock:
        stack.append(top)
        below = stack[-2] if len(stack) > 1 else None
    if below is not None:
        below.stop(torch)  # one a collection restarted since; does nothing where suspended
    return stack


def _unlink(local: threading.local, stack: list, top: Any) -> bool:
    """Take ``top`` off ``stack``, where ``_push`` put it, in whatever thread its block ends (a
    garbage collection may end a block left unexited in another thread; that thread's stack,
    routes and captures are not its to change). Returns whether the entry below is to restart
    once ``top`` has ended (``_restart_top``): where ``top`` was on top of this thread's stack.
    Not where ``top`` was under another entry (suspended: that entry's end restarts what is
    below it), nor where the stack is another thread's: a route starts for the thread that
    starts it, so the entry below stays suspended till a block of its own thread ends above it."""
    with _stacks_lock:
        top.ended = True
        if stack and stack[-1] is top:
            stack.pop()
            return _route_stack(local) is stack
        for i, entry in enumerate(stack):  # by identity: an entry is on a stack once at most
            if entry is top:
                del stack[i]
                break
        return False


def _restart_top(local: threading.local, stack: list, torch: Any) -> None:
    """Restart what is on top of this thread's ``stack`` now. Read only now, not at the
    ``_unlink`` before: a collection that comes meanwhile (while the ended route stops, say)
    may end the entry that was below, unexited, and restart the one below that itself; so the
    entry on top may be running already (``_Route.start`` then does nothing)."""
    while True:
        with _stacks_lock:
            top = stack[-1] if stack and _route_stack(local) is stack else None
        if top is None:
            return
        top.start(torch)
        if not top.ended:
            return
        # Ended meanwhile, in another thread (off the stack now): the one below it, then.


class _Capture:
    """A graph capture's place on a thread's route stack: it routes nothing (the capture's
    pool is PyTorch's to route), so suspending and restarting it does nothing."""

    ended = False  # set by _unlink

    def start(self, torch: Any) -> None:
        pass

    def stop(self, torch: Any) -> None:
        pass


class _Routed:
    """The block of ``_Regions._routed``. A class, not a ``@contextmanager``, which keeps its
    arguments (the pool) till the end of its ``with`` statement, after the route's end has
    retired the pool: where ``_mem_pools`` dropped the pool meanwhile, its last reference
    would go there, outside ``_routing``'s control."""

    def __init__(self, local: threading.local, torch: Any, pool: Any, make: Any) -> None:
        self.local, self.torch, self.pool, self.make = local, torch, pool, make
        self.route: Optional[_Route] = None
        # The route stack the route was pushed onto (the entering thread's).
        self.stack: Optional[list] = None

    def __enter__(self) -> None:
        torch = self.torch
        _count_captures(torch)
        pool, self.pool = self.pool, None  # the route holds it from now on, and alone
        spare = None
        if pool is None:
            # A MemPool is made on the current device (its destructor releases it there). In a
            # capture a new one, as ever: a graph's memory never shares a pool with eager blocks.
            spare = torch.cuda.current_device()
            if not _may_capture(torch):
                pool = _routing.take_spare(spare)
            if pool is None:
                pool = torch.cuda.MemPool()
        route = _Route(pool, self.make, spare)
        del pool
        try:
            stack = _push(self.local, torch, route)
        except BaseException:
            _routing.retire(route, torch)
            raise
        self.route, self.stack = route, stack

    def __exit__(self, *exc: Any) -> None:
        torch = self.torch
        route, self.route = self.route, None
        stack, self.stack = self.stack, None
        restart = _unlink(self.local, stack, route)
        # In another thread too: PyTorch ends a route by its pool, whatever thread ends it.
        try:
            route.stop(torch)
        except BaseException:
            _routing.retire(route, torch)  # not for reuse: PyTorch may not have ended its route
            raise
        _routing.retire(route, torch, route.spare)
        if restart:
            _restart_top(self.local, stack, torch)


class _PoolMap(dict):
    """Region (or graph) pools by ``(tag, enable_cpu_backup, enable_disk_backup, backend,
    device)``, plus the chunk size where chunked; ``backend`` is ``""`` without a CPU backup, as
    the existing library keys it. A key of the shape an earlier version of the existing library
    used names every pool it covers, for the callers written against it: ``(tag,
    enable_cpu_backup)`` (0.0.9), ``(tag, enable_cpu_backup, device)`` and ``(tag,
    enable_cpu_backup, enable_disk_backup, device)``. ``in``, ``get``, ``[]``, ``[] =``, ``pop``
    and ``del`` take them: ``pop`` and ``del`` drop every pool covered (so the next region of the
    tag gets a new pool, never a cached block of the old one); ``[] =`` puts the pool given in
    place of every pool covered (the tag's next region allocates from it, and the old pool can
    go), and is kept under the key as given where it covers none; ``get``, ``[]`` and ``pop``
    give the pool where one is covered, a list of them where several are."""

    # Which places of a full key each earlier shape holds, by its length.
    _OLDER_SHAPES = {2: (0, 1), 3: (0, 1, 4), 4: (0, 1, 2, 4)}

    def _covered(self, key: Any) -> Optional[list]:
        """The full keys an earlier-shaped ``key`` covers; None for any other key (a full one,
        or one held as it is)."""
        places = self._OLDER_SHAPES.get(len(key)) if isinstance(key, tuple) else None
        if places is None or dict.__contains__(self, key):
            return None
        return [k for k in list(dict.keys(self)) if len(k) >= 5 and tuple(k[i] for i in places) == key]

    @staticmethod
    def _one_or_all(pools: list) -> Any:
        return pools[0] if len(pools) == 1 else pools

    def __contains__(self, key: Any) -> bool:
        covered = self._covered(key)
        return dict.__contains__(self, key) if covered is None else bool(covered)

    def __getitem__(self, key: Any) -> Any:
        covered = self._covered(key)
        if not covered:  # None: a key as it is; []: an earlier shape that covers nothing
            return dict.__getitem__(self, key)
        return self._one_or_all([dict.__getitem__(self, k) for k in covered])

    def __setitem__(self, key: Any, value: Any) -> None:
        replaced = []
        for k in self._covered(key) or [key]:
            old = dict.get(self, k)
            if old is not None and old is not value:
                replaced.append(old)
            dict.__setitem__(self, k, value)
        _routing.retire_pools(replaced)

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __delitem__(self, key: Any) -> None:
        self.pop(key)

    _NO_DEFAULT = object()

    def pop(self, key: Any, default: Any = _NO_DEFAULT) -> Any:
        covered = self._covered(key)
        if not covered:
            if default is not self._NO_DEFAULT and not dict.__contains__(self, key):
                return default
            covered = [key]
        pools = [dict.pop(self, k) for k in covered]
        _routing.retire_pools(pools)
        return self._one_or_all(pools)

    def clear(self) -> None:
        pools = list(dict.values(self))
        dict.clear(self)
        _routing.retire_pools(pools)

    def popitem(self) -> tuple:
        item = dict.popitem(self)
        _routing.retire_pools([item[1]])
        return item

    def update(self, *args: Any, **kwargs: Any) -> None:
        # Key by key through [] =, so that earlier-shaped keys cover and replaced pools retire.
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def __ior__(self, other: Any) -> "_PoolMap":
        self.update(other)
        return self


class _Regions:
    """Regions, graph captures, ``disable()`` and ``_with_region_config`` of
    :class:`~.saver._TorchMemorySaverImpl`, which holds the state declared here."""

    _hook_util: HookUtilBase
    _lock: threading.RLock
    _local: threading.local
    _mem_pools: _PoolMap
    _graph_pools: _PoolMap
    _kept_disable_pools: Dict[int, Any]
    hook_mode: str
    _library: Callable[[], BinaryWrapper]

    @contextlib.contextmanager
    def _with_region_config(
        self,
        tag: str = "default",
        enable_cpu_backup: Any = False,
        cpu_backup_backend: Optional[str] = None,
        enable_disk_backup: Any = False,
    ) -> Iterator[None]:
        """This thread's allocations are pauseable with these settings inside, with no pool
        routing (the existing library's internal context, which its callers use to free tensors
        under a tag)."""
        tag = _check_tag(tag)
        enable_cpu_backup = bool(enable_cpu_backup)
        backend = _check_backup(enable_cpu_backup, cpu_backup_backend)
        disk = _check_disk(enable_cpu_backup, enable_disk_backup)
        lib = self._library()
        with self._flags(lib, True, tag, enable_cpu_backup, backend, disk):
            yield


    @contextlib.contextmanager
    def _flags(
        self,
        lib: BinaryWrapper,
        enabled: bool,
        tag: Optional[str],
        backup: bool,
        backend: Optional[str],
        disk: bool = False,
        chunk: int = 0,
    ):
        lib.check(lib.tms_region_enter(int(enabled), _enc(tag), int(backup), _enc(backend)))
        try:
            if disk:
                lib.check(lib.tms_set_enable_disk_backup(1))
            if chunk:
                lib.check(lib.tms_set_chunk_size(chunk))  # names the granularity where it does not fit
            yield
        finally:
            lib.check(lib.tms_region_exit())

    @contextlib.contextmanager
    def _chunk_misfits(self, lib: BinaryWrapper, chunk: int) -> Iterator[None]:
        """Inside a region with a chunk size: an error PyTorch raised for an allocation the
        library refused because its size is not a multiple of the chunk size (torch's
        OutOfMemoryError in torch mode, its CUDA error in preload mode) becomes our
        :class:`InvalidArgumentError` with the library's message, chained from torch's. Only
        when this thread's last library error is that refusal, recorded inside this block (the
        thread's error count moved) and for this chunk size; any other exception passes through
        unchanged."""
        if not chunk:
            yield
            return
        before = lib.tms_error_count()
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, TorchMemorySaverError):
                raise
            msg = lib.last_error()
            m = _CHUNK_MISFIT.search(msg)
            if lib.tms_error_count() == before or m is None or int(m.group(1)) != chunk:
                raise
            raise InvalidArgumentError(
                f"{msg} (inside a region with chunk_size={chunk}, allocate only tensors whose size in bytes "
                "is a multiple of it)",
                3,
            ) from e

    def _pool(
        self, kind: str, tag: str, cpu: bool, disk: bool, backend: Optional[str], device: int, chunk: int = 0
    ) -> Any:
        """The MemPool of a region (``kind="region"``, in ``_mem_pools``) or a graph capture (in
        ``_graph_pools``) for (tag, CPU backup, disk backup, resolved backend, device, chunk
        size), made on first use, so that cached blocks never cross backup settings or chunk
        layouts. Its allocator is the hook mode's: libtms.so in torch mode; PyTorch's own
        (cudaMalloc, which the preloaded library serves while the region's flags are on) in
        preload mode."""
        import torch

        resolved = resolve_cpu_backup_backend(cpu, backend) or ""  # "" without a CPU backup, as upstream keys it
        key = (tag, cpu, disk, resolved, device) + ((chunk,) if chunk else ())
        pools = self._mem_pools if kind == "region" else self._graph_pools
        with self._lock:
            pool = pools.get(key)
            if pool is None:
                pool = self._new_pool(torch)
                pools[key] = pool
            return pool

    def _own_pool(self, pool: Any) -> bool:
        """Whether ``pool`` (a ``MemPool`` or its ``id``) is one of the region or graph pools."""
        with self._lock:
            for p in (*dict.values(self._mem_pools), *dict.values(self._graph_pools)):
                if pool is p or pool == getattr(p, "id", None):
                    return True
        return False

    def _new_pool(self, torch: Any) -> Any:
        """A MemPool whose allocator is the hook mode's."""
        _count_captures(torch)
        allocator = self._hook_util.get_allocator()
        if allocator is None:
            return torch.cuda.MemPool()
        # A hook written to return the ``CUDAPluggableAllocator`` itself works too.
        raw = getattr(allocator, "allocator", None)
        return torch.cuda.MemPool(raw() if callable(raw) else allocator)

    def _routed(self, torch: Any, pool: Any = None, make: Any = None) -> "_Routed":
        """Route this thread's allocations to ``pool`` inside the block. Routes nest: the
        innermost one wins, the enclosing one is suspended meanwhile and restarted after (so
        which pool serves does not depend on how PyTorch orders nested ``use_mem_pool``).
        ``pool=None``: a pool of PyTorch's own allocator for this block alone, dropped on exit
        before the enclosing route restarts, so that its cache can go back to the device; one
        such pool retired and not yet destroyed (another thread routes) serves the next such
        block on its device instead of a new one (``_Routing.take_spare``).
        ``make()`` makes a sibling of ``pool`` for a thread that finds ``pool`` routed to by
        another thread (PyTorch routes one thread at a time to a pool). On exit the pool goes
        to ``_routing.retire`` (see ``_Routing``): a caller keeps no reference of its own past
        the block, or the pool's end may come with that one, while another thread routes."""
        return _Routed(self._local, torch, pool, make)

    @contextlib.contextmanager
    def region(
        self,
        tag: str = "default",
        enable_cpu_backup: Any = False,
        enable_disk_backup: Any = False,
        cpu_backup_backend: Optional[str] = None,
        *,
        chunk_size: Any = 0,
    ) -> Iterator[None]:
        """See ``TorchMemorySaver.region``."""
        tag = _check_tag(tag)
        enable_cpu_backup = bool(enable_cpu_backup)
        backend = _check_backup(enable_cpu_backup, cpu_backup_backend)
        disk = _check_disk(enable_cpu_backup, enable_disk_backup)
        chunk = _check_chunk_size(chunk_size)
        lib = self._library()
        torch = _torch_if_cuda() if self.hook_mode == "preload" else _require_torch()
        if torch is None:
            # Preload mode without torch (C extensions calling cudaMalloc): the flags suffice.
            with self._flags(lib, True, tag, enable_cpu_backup, backend, disk, chunk), self._chunk_misfits(lib, chunk):
                yield
            return
        # Each region's tensors live in a pool of their own, so PyTorch never hands a pauseable
        # block to a tensor made outside the region, nor a plain cached block to one inside it,
        # nor a block of one chunk layout to another. The pool is taken once the flags are on,
        # and the route holds it alone from there: nothing between may raise and end it here,
        # where the map dropped it meanwhile, under another thread's route (see _routed). The
        # device is asked before, as ever (it may initialize CUDA, which the flags need not see).
        device = torch.cuda.current_device()
        with self._flags(lib, True, tag, enable_cpu_backup, backend, disk, chunk):
            pool = self._pool("region", tag, enable_cpu_backup, disk, backend, device, chunk)
            routed = self._routed(torch, pool, lambda: self._new_pool(torch))
            del pool
            with routed, self._chunk_misfits(lib, chunk):
                yield

    @contextlib.contextmanager
    def disable(self, dispose_mem_pool_after_use: bool = True) -> Iterator[None]:
        """See ``TorchMemorySaver.disable``. ``dispose_mem_pool_after_use=False`` (the existing
        library's keyword) keeps the block's pool, with what it cached, for the next such
        block on the device instead of dropping it on exit."""
        lib = self._library()
        torch = _torch_if_cuda()
        if torch is None:
            with self._flags(lib, False, None, False, None):
                yield
            return
        # A pool of its own with PyTorch's own allocator: plain cudaMalloc (the library's flags
        # are off, so a preloaded libtms.so passes it through), never a cached pauseable block
        # of the enclosing region's pool or, under TMS_INIT_ENABLE=1, of the default pool.
        # On exit the pool is dropped: PyTorch then gives its cached free blocks back to the
        # device (on torch 2.11 at once), while blocks of tensors still alive stay theirs. While
        # a route or capture is under way anywhere it waits, and serves the next such block of
        # the device meanwhile (see _Routing).
        kept = None
        if not dispose_mem_pool_after_use:
            device = torch.cuda.current_device()
            with self._lock:
                kept = self._kept_disable_pools.get(device)
                if kept is None:
                    kept = self._kept_disable_pools[device] = torch.cuda.MemPool()
        routed = self._routed(torch, kept, torch.cuda.MemPool if kept is not None else None)
        del kept  # the route's alone (see _routed)
        with self._flags(lib, False, None, False, None):
            with routed:
                yield

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph: "torch.cuda.CUDAGraph",
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
        tag: str = "default",
        enable_cpu_backup: Any = False,
        cpu_backup_backend: Optional[str] = None,
        enable_disk_backup: Any = False,
        chunk_size: Any = 0,
    ) -> Iterator[None]:
        """See ``TorchMemorySaver.cuda_graph``."""
        import torch

        _count_captures(torch)
        tag = _check_tag(tag)
        enable_cpu_backup = bool(enable_cpu_backup)
        backend = _check_backup(enable_cpu_backup, cpu_backup_backend)
        disk = _check_disk(enable_cpu_backup, enable_disk_backup)
        chunk = _check_chunk_size(chunk_size)
        lib = self._library()
        if self.hook_mode == "torch" and pool is None:
            device = torch.cuda.current_device()
            pool = self._pool("graph", tag, enable_cpu_backup, disk, backend, device, chunk).id
        elif self.hook_mode == "torch" and not self._own_pool(pool):
            warnings.warn(
                f"torch mode: the pool given to cuda_graph(tag={tag!r}) is not one of "
                "torch_memory_saver's, so the graph's memory comes from PyTorch's own allocator and "
                "is not pauseable; pass pool=None (the tag's graph pool is made) or a region's pool",
                stacklevel=3,
            )
        with self._flags(lib, True, tag, enable_cpu_backup, backend, disk, chunk):
            _routing.enter()  # a capture: no pool may be destroyed meanwhile (see _Routing)
            try:
                with self._capturing(torch), self._chunk_misfits(lib, chunk), torch.cuda.graph(
                    cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode
                ):
                    yield
            finally:
                _routing.leave(torch)

    @contextlib.contextmanager
    def _capturing(self, torch: Any) -> Iterator[None]:
        """Suspend this thread's route (an enclosing region's) for a graph capture. PyTorch
        serves an allocation from the first pool routed to whose filter takes it, and a
        region's route (``use_mem_pool``) takes every allocation of its thread, the capture's
        too: inside ``region()`` the capture would allocate from the region's pool, not the
        graph's private one. Cached blocks of the region (its tag) could then serve the graph,
        and blocks the graph frees while capturing would go back to the region's pool, where a
        later allocation of the region on the capture's stream could get one the graph still
        replays into. A route a region opens inside the capture nests as usual, and the
        capture's place on the stack restarts nothing."""
        place = _Capture()  # its own: _unlink finds it by identity
        stack = _push(self._local, torch, place)
        try:
            yield
        finally:
            if _unlink(self._local, stack, place):
                _restart_top(self._local, stack, torch)
