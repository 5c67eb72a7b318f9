"""How this process's threads route allocations to pools (``MemPool``, through
``use_mem_pool``), and when a pool may be destroyed: never while any thread routes or captures
a graph (:class:`_Routing`). Each thread's routes and captures form a stack (:func:`_push`,
:func:`_unlink`), whose top alone routes; :class:`_Routed` is the block of a region or
``disable()`` (``regions.py``)."""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from typing import Any, Optional


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
