"""Routing allocations to a region's pool from several threads at once, with a stand-in for
torch that enforces what PyTorch does: one thread at a time may route to a pool
("beginAllocateToPool: already recording to mempool_id"). A region entered by a second thread
while the first is inside it must get a sibling pool of the same kind, not PyTorch's error
(seen on an H200 with real threads before the fix). A pool is never destroyed while a thread
routes (PyTorch asserts, ending the process), and a disable() block reuses an earlier one's
retired pool, never one a graph allocated from or whose route failed to end."""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest

from torch_memory_saver import saver
from torch_memory_saver import routing as routes

from _routing_helpers import (
    FakeTorch,
    _after_each_route,
    _impl_over,
    _own_routing,
    _pools_telling_their_end,
    _thread_in_region,
    _torch_without_a_device,
)


def test_threads_in_the_same_region_get_pools_of_their_own():
    impl = saver._TorchMemorySaverImpl("torch")
    torch = FakeTorch()
    pool = object()
    inside = threading.Barrier(4)
    used, errors = [], []

    def one():
        try:
            with impl._routed(torch, pool, torch.new_pool):
                with torch.lock:
                    used.append(next(p for p, t in torch.recording.items() if t == threading.get_ident()))
                inside.wait(timeout=10)  # all four inside at once
        except Exception as e:  # collected: a failure of any thread fails the test
            errors.append(repr(e))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(used)) == 4 and id(pool) in used, used
    assert torch.made == 3
    # Once they have left, the pool and its siblings are free again: four more threads reuse
    # them and make none.
    used.clear()
    inside = threading.Barrier(4)
    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(used)) == 4 and torch.made == 3, (errors, used, torch.made)
    assert not routes._routing.busy, routes._routing.busy


def test_one_thread_nests_routes_to_the_same_pool():
    impl = saver._TorchMemorySaverImpl("torch")
    torch = FakeTorch()
    pool = object()
    with impl._routed(torch, pool, torch.new_pool):
        with impl._routed(torch, pool, torch.new_pool):
            assert list(torch.recording) == [id(pool)]
        assert list(torch.recording) == [id(pool)]
    assert torch.made == 0 and not torch.recording


def test_a_dropped_pool_that_needed_a_sibling_goes_with_its_siblings(monkeypatch):
    """``_mem_pools.pop(key)`` drops a region's pool (saver.py: "Popping one drops it"), also
    one that two threads were inside at once (which made it a sibling): nothing of this package
    may keep the pool, or its sibling, alive after that."""
    import gc
    import weakref

    class Pool:  # a MemPool stand-in that can be weakly referenced, as torch.cuda.MemPool can
        pass

    torch = FakeTorch()
    impl = saver._TorchMemorySaverImpl("torch")
    refs = []

    def new_pool(_torch):
        p = Pool()
        refs.append(weakref.ref(p))
        return p

    monkeypatch.setattr(impl, "_new_pool", new_pool)
    key = ("kv", False, False, "", 0)  # as impl._pool keys the region pool of tag "kv"
    impl._mem_pools[key] = new_pool(torch)
    both = threading.Barrier(2)
    errors = []

    def one():
        try:
            pool = impl._mem_pools[key]
            with impl._routed(torch, pool, lambda: impl._new_pool(torch)):
                both.wait(timeout=10)  # both threads inside at once: one gets a sibling
        except Exception as e:  # collected: a failure of any thread fails the test
            errors.append(repr(e))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(refs) == 2, refs  # the region's pool and one sibling
    impl._mem_pools.pop(("kv", False))  # the existing library's key: drops the tag's pool
    gc.collect()
    assert [r() for r in refs] == [None, None], "a dropped pool (or its sibling) is still referenced"


def test_a_disable_pool_is_never_destroyed_while_another_thread_routes(monkeypatch):
    """``disable()``'s pool of its own (``_routed(torch, None)``) may be destroyed only while no
    thread routes (PyTorch asserts, ending the process, otherwise: see ``_Routing``). Thread A
    leaves its block, its pool is retired while no one routes; thread B then enters a region
    before A has finished leaving: A's pool must not be destroyed under B's route."""
    torch = FakeTorch()
    impl = saver._TorchMemorySaverImpl("torch")
    destroyed_while_routing = _pools_telling_their_end(torch)
    b_inside, b_may_leave = threading.Event(), threading.Event()
    real_collect = routes._routing.collect
    fired = []

    def collect(t):
        retiring = bool(routes._routing.retired)  # A's pool was just retired (not a route's end)
        real_collect(t)
        if threading.current_thread() is main and retiring and not fired:
            fired.append(1)
            b.start()  # B routes while A is between retiring its pool and leaving the block
            assert b_inside.wait(timeout=10)

    main = threading.current_thread()
    errors = []

    def other():
        try:
            with impl._routed(torch, object(), torch.new_pool):
                b_inside.set()
                b_may_leave.wait(timeout=10)
        except Exception as e:  # collected: a failure fails the test
            errors.append(repr(e))

    b = threading.Thread(target=other)
    monkeypatch.setattr(routes._routing, "collect", collect)
    with impl._routed(torch, None):
        pass
    b_may_leave.set()
    b.join()
    assert fired and not errors, (fired, errors)
    assert not destroyed_while_routing, "disable()'s pool was destroyed while another thread routed"


def test_a_pool_is_never_destroyed_while_a_thread_is_starting_its_route():
    """A thread routes from the moment PyTorch's ``use_mem_pool`` is entered; it must count as
    routing from then on (``_Routing.active``), or a ``disable()`` pool retired meanwhile in
    another thread is destroyed under its route (PyTorch asserts, ending the process)."""
    torch = FakeTorch()
    impl = saver._TorchMemorySaverImpl("torch")
    destroyed_while_routing = _pools_telling_their_end(torch)
    real_use = torch.cuda.use_mem_pool
    b_routing, b_may_go_on = threading.Event(), threading.Event()
    region_pool = object()

    @contextlib.contextmanager
    def use_mem_pool(pool):
        with real_use(pool):
            if pool is region_pool:
                b_routing.set()  # B routes to the region's pool now...
                b_may_go_on.wait(timeout=10)  # ...and is held here, at the start of its route
            yield

    torch.cuda.use_mem_pool = staticmethod(use_mem_pool)
    errors = []

    def other():
        try:
            with impl._routed(torch, region_pool, torch.new_pool):
                pass
        except Exception as e:  # collected: a failure fails the test
            errors.append(repr(e))

    b = threading.Thread(target=other)
    with impl._routed(torch, None):  # A: a disable() block
        b.start()
        assert b_routing.wait(timeout=10)
    b_may_go_on.set()
    b.join()
    assert not errors, errors
    assert not destroyed_while_routing, "disable()'s pool was destroyed while another thread routed"


def _past_early_while_a_pool_dies(torch, a, b):
    """Run ``a`` in a thread A, whose destruction of a pool made from now on is held until
    thread B, started once it began, has had 0.5 s to get past what ``b(past)`` waits for
    (setting ``past`` then). Returns whether B got there while A's pool was being destroyed;
    B must get there in the end, without error."""
    dying, may_die = threading.Event(), threading.Event()

    class Slow(torch.cuda.MemPool):
        def __del__(self):
            dying.set()
            may_die.wait(timeout=10)
            super().__del__()

    torch.cuda.MemPool = staticmethod(Slow)
    past, errors = threading.Event(), []

    def in_b():
        try:
            b(past)
        except Exception as e:  # collected: a failure fails the test
            errors.append(repr(e))

    ta, tb = threading.Thread(target=a), threading.Thread(target=in_b)
    ta.start()
    assert dying.wait(timeout=10)
    tb.start()
    early = past.wait(timeout=0.5)
    may_die.set()
    ta.join()
    tb.join()
    assert past.is_set() and not errors, errors
    return early


def test_no_route_starts_while_a_retired_pool_is_destroyed():
    """``collect`` destroys retired pools after letting go of its lock (a pool's end may run
    code that routes again); a thread entering a region meanwhile must wait for the end, or
    PyTorch sees a pool destroyed under its route (and asserts, ending the process)."""
    torch = FakeTorch()
    impl = saver._TorchMemorySaverImpl("torch")
    destroyed_while_routing = _pools_telling_their_end(torch)

    def disable_block():  # A: leaving it destroys its own pool, slowly
        with impl._routed(torch, None):
            pass

    def region(routed):  # B: enters a region while A's pool is being destroyed
        with impl._routed(torch, object(), torch.new_pool):
            routed.set()

    routed_early = _past_early_while_a_pool_dies(torch, disable_block, region)
    assert not routed_early, "B routed while A's pool was being destroyed"
    assert not destroyed_while_routing
    assert routes._routing.destroying is None and not routes._routing.active


@pytest.mark.parametrize("drop", ["del", "pop", "replace"])
@pytest.mark.parametrize("inside", [1, 2])
def test_a_dropped_region_pool_is_never_destroyed_while_another_thread_routes(monkeypatch, drop, inside):
    """A region's pool dropped from ``_mem_pools`` (``del``, ``pop`` or ``[] =``, which
    ``_PoolMap`` documents) while threads are inside the region is kept alive by their routes
    alone; the last of them to leave must not destroy it, nor the sibling made for a second
    thread inside (``inside=2``), while another thread routes to another region's pool (PyTorch
    asserts, ending the process: see ``_Routing``). Once no thread routes, they go."""
    import gc
    import weakref

    torch = FakeTorch()
    destroyed_while_routing = _pools_telling_their_end(torch)
    torch.cuda.current_device = staticmethod(lambda: 0)
    impl = _impl_over(monkeypatch, torch, "torch")
    made = []

    def new_pool(_torch):
        p = torch.cuda.MemPool()
        made.append(weakref.ref(p))
        return p

    monkeypatch.setattr(impl, "_new_pool", new_pool)
    all_inside = threading.Barrier(inside + 2)  # the dropped region's threads, B and this one
    kv_may_leave, b_may_leave = threading.Event(), threading.Event()
    errors = []

    def in_region(tag, may_leave):
        try:
            with impl.region(tag):
                all_inside.wait(timeout=10)
                assert may_leave.wait(timeout=10)
        except Exception as e:  # collected: a failure of any thread fails the test
            errors.append(repr(e))

    kv = [threading.Thread(target=in_region, args=("kv", kv_may_leave)) for _ in range(inside)]
    b = threading.Thread(target=in_region, args=("other", b_may_leave))
    for t in (*kv, b):
        t.start()
    all_inside.wait(timeout=10)
    assert len(made) == inside + 1, made  # kv's pool (and its sibling), other's pool
    other = weakref.ref(impl._mem_pools[("other", False)])
    kv_pools = [r for r in made if r() is not other()]  # kv's pool, and its sibling
    if drop == "del":
        del impl._mem_pools[("kv", False)]  # the existing library's key: drops the tag's pool
    elif drop == "pop":
        impl._mem_pools.pop(("kv", False))
    else:
        impl._mem_pools[("kv", False)] = object()  # the tag's next region allocates from this one
    kv_may_leave.set()  # the kv threads leave while B still routes to other's pool
    for t in kv:
        t.join()
    b_may_leave.set()
    b.join()
    assert not errors, errors
    assert not destroyed_while_routing, "a dropped region pool was destroyed while another thread routed"
    gc.collect()
    assert [r() for r in kv_pools] == [None] * inside, "the dropped pool (or its sibling) is still referenced"
    assert other() is not None  # other's pool, still in _mem_pools


def test_nothing_keeps_a_dropped_region_pool_past_its_routes_end(monkeypatch):
    """The route's end hands a region's pool to ``_routing.retire``, and ``collect`` lets it go
    at once where no thread routes: no other reference of this package may outlive that (the
    region's own, or its ``with`` statement's), or where ``_mem_pools`` dropped the pool, it is
    destroyed with that one, after a thread B may have started routing (PyTorch asserts, ending
    the process). Thread A leaves the region whose pool it dropped; B enters another region
    after A's route has ended, while A's region is still leaving (its flags)."""
    import gc
    import weakref

    torch = FakeTorch()
    destroyed_while_routing = _pools_telling_their_end(torch)
    torch.cuda.current_device = staticmethod(lambda: 0)
    b_inside, b_may_leave = threading.Event(), threading.Event()
    errors = []

    @contextlib.contextmanager
    def flags(lib, enabled, tag, *rest):
        yield
        if tag == "kv":  # A's route has ended; its region has not yet
            b.start()
            assert b_inside.wait(timeout=10)

    impl = _impl_over(monkeypatch, torch, "torch", flags)
    monkeypatch.setattr(impl, "_new_pool", lambda _torch: torch.cuda.MemPool())

    b = _thread_in_region(impl, "other", b_inside, b_may_leave, errors)
    with impl.region("kv"):
        kv = weakref.ref(impl._mem_pools[("kv", False)])
        del impl._mem_pools[("kv", False)]  # A's route holds the pool alone now
    b_may_leave.set()
    b.join()
    assert not errors, errors
    assert not destroyed_while_routing, "a dropped region pool was destroyed while another thread routed"
    gc.collect()
    assert kv() is None, "the dropped pool is still referenced"


@pytest.mark.parametrize("drop", ["del", "pop", "replace", "clear", "popitem", "update", "ior"])
def test_a_pool_dropped_from_the_map_is_never_destroyed_while_another_thread_routes(monkeypatch, drop):
    """A region's pool that no thread routes to, dropped from ``_mem_pools`` (``del``, ``pop``,
    ``[] =``, ``clear``) while thread B routes to another region's pool: the map held its last
    reference, and its destruction under B's route would end the process (see ``_Routing``).
    It goes once B has left."""
    import gc
    import weakref

    torch = FakeTorch()
    destroyed_while_routing = _pools_telling_their_end(torch)
    torch.cuda.current_device = staticmethod(lambda: 0)
    impl = _impl_over(monkeypatch, torch, "torch")
    monkeypatch.setattr(impl, "_new_pool", lambda _torch: torch.cuda.MemPool())
    with impl.region("kv"):
        pass
    kv = weakref.ref(impl._mem_pools[("kv", False)])
    b_inside, b_may_leave = threading.Event(), threading.Event()
    errors = []

    t = _thread_in_region(impl, "other", b_inside, b_may_leave, errors)
    t.start()
    assert b_inside.wait(timeout=10)
    if drop == "del":
        del impl._mem_pools[("kv", False)]
    elif drop == "pop":
        impl._mem_pools.pop(("kv", False))  # the caller drops what it was given at once
    elif drop == "replace":
        impl._mem_pools[("kv", False)] = torch.cuda.MemPool()
    elif drop == "popitem":
        while kv() in impl._mem_pools.values():
            impl._mem_pools.popitem()
    elif drop in ("update", "ior"):
        full = next(k for k in dict.keys(impl._mem_pools) if k[0] == "kv")
        if drop == "update":
            impl._mem_pools.update({full: torch.cuda.MemPool()})
        else:
            impl._mem_pools |= {full: torch.cuda.MemPool()}
    else:
        impl._mem_pools.clear()
    gc.collect()
    assert not destroyed_while_routing, "a pool dropped from the map was destroyed while another thread routed"
    assert kv() is not None
    b_may_leave.set()
    t.join()
    assert not errors, errors
    gc.collect()
    assert kv() is None, "the dropped pool outlived every route"
    assert not destroyed_while_routing


def test_a_pool_retired_while_retired_pools_are_destroyed_goes_too():
    """``collect`` destroys retired pools outside its lock, and a pool's end may run Python code
    that routes again (``_Routing``): a ``disable()`` block there retires its own pool while the
    destruction is under way, which ``collect`` leaves to the destruction. That pool must go
    with it once no route is active, not wait in ``retired`` (with its cached blocks) for some
    later route's end anywhere in the process, which may never come."""
    import gc

    torch = FakeTorch()
    impl = saver._TorchMemorySaverImpl("torch")
    destroyed_while_routing = _pools_telling_their_end(torch)
    Pool = torch.cuda.MemPool
    plain, made = _tracked(Pool)

    class Reentrant(Pool):
        def __del__(self):
            torch.cuda.MemPool = staticmethod(plain)
            with impl._routed(torch, None):  # a disable() block, run by this pool's end
                pass
            super().__del__()

    torch.cuda.MemPool = staticmethod(Reentrant)
    with impl._routed(torch, None):  # a disable() block: leaving it destroys its pool
        pass
    gc.collect()
    assert len(made) == 1, made  # the inner block ran, with a pool of its own
    assert made[0]() is None and not routes._routing.retired, (
        "the pool retired during the destruction was kept past it",
        routes._routing.retired,
    )
    assert not destroyed_while_routing
    assert routes._routing.destroying is None and not routes._routing.active


@pytest.mark.parametrize("torch_kind", ["stand-in", "real"])
@pytest.mark.parametrize("drop", ["del", "pop", "replace", "clear"])
def test_dropping_a_pool_from_the_map_needs_no_device(monkeypatch, drop, torch_kind):
    """``_mem_pools`` is a dict integrations read and patch (see ``_PoolMap``), also where torch
    is imported but CUDA is not initialized (their CPU tests, a process that has not touched
    the device yet): dropping an entry there must not ask CUDA whether a capture is under way
    (it raises, or initializes CUDA). No capture can be under way before CUDA is initialized."""
    import sys

    if torch_kind == "real":
        torch = pytest.importorskip("torch")
        if torch.cuda.is_initialized():
            pytest.skip("CUDA is initialized in this process")
    else:
        torch = _torch_without_a_device()
        monkeypatch.setitem(sys.modules, "torch", torch)
    impl = saver._TorchMemorySaverImpl("torch")
    key = ("kv", False, False, "", 0)
    impl._mem_pools[key] = object()
    if drop == "del":
        del impl._mem_pools[("kv", False)]
    elif drop == "pop":
        impl._mem_pools.pop(key)
    elif drop == "replace":
        impl._mem_pools[key] = object()
    else:
        impl._mem_pools.clear()
    assert not routes._routing.retired


def test_a_region_whose_flags_fail_leaves_no_pool_to_end_under_another_route(monkeypatch):
    """A region whose flags fail (the library refuses them) must hold no pool when it raises:
    where the map dropped that pool meanwhile and ``collect`` let the map's reference go (no
    thread routed then), the region's own reference would be the last, and its end would come
    with the error, while thread B routes (PyTorch asserts, ending the process)."""
    torch = FakeTorch()
    destroyed_while_routing = _pools_telling_their_end(torch)
    torch.cuda.current_device = staticmethod(lambda: 0)
    b_inside, b_may_leave = threading.Event(), threading.Event()
    errors, refuse = [], []

    @contextlib.contextmanager
    def flags(lib, enabled, tag, *rest):
        if refuse and tag == "kv":
            impl._mem_pools.clear()  # another thread drops the pool; no one routes: it is let go
            b.start()
            assert b_inside.wait(timeout=10)
            raise RuntimeError("the library refused the region's flags")
        yield

    impl = _impl_over(monkeypatch, torch, "torch", flags)
    monkeypatch.setattr(impl, "_new_pool", lambda _torch: torch.cuda.MemPool())
    b = _thread_in_region(impl, "other", b_inside, b_may_leave, errors)
    with impl.region("kv"):  # the pool is made, and kept in the map
        pass
    refuse.append(True)
    with pytest.raises(RuntimeError, match="refused the region's flags"):
        with impl.region("kv"):
            pass
    b_may_leave.set()
    b.join()
    assert not errors, errors
    assert not destroyed_while_routing, "a dropped region pool was destroyed while another thread routed"


def test_disable_blocks_under_another_threads_region_reuse_their_retired_pools(monkeypatch):
    """A ``disable()`` block's pool is retired on exit, and destroyed only once no route or
    capture is under way anywhere (``_Routing``). While one thread keeps a region open (a
    serving thread), every ``disable()`` block another thread ran kept a pool of its own, with
    its cached device memory, till the region's end: growth without bound. A block now takes
    a retired pool of an earlier ``disable()`` block of its device instead of making one, so
    the retired pools are at most as many as blocks open at once, and all go once nothing is
    under way. Never a region's pool, a pool of another device, nor the kept pool of
    ``dispose_mem_pool_after_use=False``, and never one destroyed under a route."""
    torch = FakeTorch()
    impl, routing, destroyed_while_routing, made = _watched(monkeypatch, torch)
    monkeypatch.setattr(impl, "_new_pool", lambda _torch: torch.cuda.MemPool())
    inside, may_leave, errors = threading.Event(), threading.Event(), []
    a = _thread_in_region(impl, "serving", inside, may_leave, errors)
    a.start()
    try:
        assert inside.wait(timeout=10)
        region_pool = made[0]()
        me = threading.get_ident()

        def routed_to():
            with torch.lock:
                return next(p for p, t in torch.recording.items() if t == me)

        served = set()
        for _ in range(100):
            with impl.disable():
                served.add(routed_to())
        assert len(served) == 1 and len(made) == 2, (len(served), len(made))
        assert len(routing.retired) <= 1, f"{len(routing.retired)} retired pools after 100 blocks"
        with impl.disable():  # blocks open at once: one pool each
            outer = routed_to()
            with impl.disable():
                assert routed_to() != outer
        assert len(made) == 3 and len(routing.retired) == 2, (len(made), len(routing.retired))
        with impl.disable(dispose_mem_pool_after_use=False):
            kept = routed_to()
        with impl.disable():
            assert routed_to() not in (kept, id(region_pool)), "a kept or region pool was taken"
        torch.device = 1  # with torch.cuda.device(1): a pool of device 0 would not do
        with impl.disable():
            assert torch.devices[routed_to()] == 1
            on_one = routed_to()
        assert len(made) == 5, len(made)  # device 1's own
        with impl.disable():
            assert routed_to() == on_one
        torch.device = 0
    finally:
        may_leave.set()
        a.join()
    assert not errors, errors
    gc.collect()
    alive = [r() for r in made if r() is not None]
    assert alive == [region_pool, impl._kept_disable_pools[0]], alive
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})
    assert not destroyed_while_routing


def test_a_disable_pool_a_graph_allocated_from_is_never_reused(monkeypatch):
    """A ``disable()`` block inside a graph capture routes the capture's allocations to its
    pool, whose blocks the graph replays into while it lives: a later block taking that pool
    would hand them to eager tensors. Nor does a block in a capture take an eager block's pool:
    both make a pool of their own, as before."""
    torch = FakeTorch()
    capturing = []

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        capturing.append(True)
        try:
            yield
        finally:
            capturing.pop()

    torch.cuda.graph = staticmethod(graph)
    torch.cuda.is_current_stream_capturing = staticmethod(lambda: bool(capturing))
    impl = _impl_over(monkeypatch, torch, "preload")
    routing = _own_routing(monkeypatch, torch)
    me = threading.get_ident()

    def routed_to():
        with torch.lock:
            return next(p for p, t in torch.recording.items() if t == me)

    inside, may_leave, errors = threading.Event(), threading.Event(), []
    a = _thread_in_region(impl, "serving", inside, may_leave, errors)
    a.start()
    try:
        assert inside.wait(timeout=10)
        with impl.disable():
            eager = routed_to()
        with impl.cuda_graph("G", tag="graph"):
            with impl.disable():
                captured = routed_to()
        with impl.disable():
            after = routed_to()
            with impl.disable():  # the eager pool is taken: the graph's would be next
                nested = routed_to()
    finally:
        may_leave.set()
        a.join()
    assert not errors, errors
    assert captured != eager, "a block in a capture took an eager block's pool"
    assert after == eager, "not the eager block's pool taken first"
    assert nested not in (eager, captured), "the pool a graph allocated from was reused"
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})


def test_a_disable_pool_whose_route_failed_to_end_is_not_reused(monkeypatch):
    """Where PyTorch raised ending a ``disable()`` block's route, the pool's state is unknown
    (it may still be routed to): the error reaches the caller, and the next block makes a pool
    of its own rather than take that one."""
    torch = FakeTorch()
    fail = []

    def fail_once(pool):
        if fail:
            fail.clear()
            raise RuntimeError("endAllocateToPool failed")

    _after_each_route(torch, fail_once)
    impl = _impl_over(monkeypatch, torch, "preload")
    routing = _own_routing(monkeypatch, torch)
    inside, may_leave, errors = threading.Event(), threading.Event(), []
    a = _thread_in_region(impl, "serving", inside, may_leave, errors)
    a.start()
    try:
        assert inside.wait(timeout=10)
        with pytest.raises(RuntimeError, match="endAllocateToPool failed"):
            with impl.disable():
                failed = [p for p, t in torch.recording.items() if t == threading.get_ident()][0]
                fail.append(True)
        with impl.disable():
            assert failed not in torch.recording, "the pool whose route failed to end was reused"
    finally:
        may_leave.set()
        a.join()
    assert not errors, errors
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})


@contextlib.contextmanager
def _another_thread_capturing(torch, how):
    """Thread A captures a graph as other code does, not through this package: with
    ``CUDAGraph.capture_begin``/``capture_end`` called by hand (``how="by hand"``) or with
    ``torch.cuda.graph`` (sglang, vLLM, torch.compile's cudagraphs). The capture is under way
    inside the block, and ended (A joined) after it."""
    began, may_end, errors = threading.Event(), threading.Event(), []

    def capture():
        try:
            g = torch.cuda.CUDAGraph()
            if how == "by hand":
                g.capture_begin()
                began.set()
                assert may_end.wait(timeout=10)
                g.capture_end()
            else:
                with torch.cuda.graph(g):
                    began.set()
                    assert may_end.wait(timeout=10)
        except Exception as e:  # collected: a failure fails the test
            errors.append(repr(e))
            began.set()

    a = threading.Thread(target=capture)
    a.start()
    try:
        assert began.wait(timeout=10)
        yield
    finally:
        may_end.set()
        a.join(timeout=10)
    assert not a.is_alive() and not errors, errors


def _watched(monkeypatch, torch, mode="torch"):
    """An implementation of hook mode ``mode`` over ``torch`` with a routing state of its own;
    returns it, that state, the list of pools destroyed while a route or capture was under way
    (``_pools_telling_their_end``) and the weak references to the pools made from now on."""
    impl = _impl_over(monkeypatch, torch, mode)
    routing = _own_routing(monkeypatch, torch)
    destroyed_while_routing = _pools_telling_their_end(torch)
    return impl, routing, destroyed_while_routing, _tracking_pools(torch)


def _tracked(Pool):
    """A maker of ``Pool``s that records a weak reference to each, and the list of them."""
    import weakref

    made = []

    def make():
        p = Pool()
        made.append(weakref.ref(p))
        return p

    return make, made


def _tracking_pools(torch):
    """Make ``torch.cuda.MemPool`` record a weak reference to each pool it makes, in the list
    returned (after ``_pools_telling_their_end``, to keep its stand-in)."""
    make, made = _tracked(torch.cuda.MemPool)
    torch.cuda.MemPool = staticmethod(make)
    return made


@pytest.mark.parametrize("how", ["by hand", "torch.cuda.graph"])
@pytest.mark.parametrize("block", ["disable", "region"])
def test_a_pool_is_never_destroyed_while_another_thread_captures_without_us(monkeypatch, how, block):
    """PyTorch asserts, ending the process, when a ``MemPool`` is destroyed while any thread
    captures a graph, also one that other code captures with ``torch.cuda.graph`` rather than
    through this package. Thread A does so and holds its capture open; this thread's
    ``disable()`` block (or region whose pool the map dropped) retires its pool meanwhile. It
    was destroyed at once: no route or capture of the package's was active. It must go only
    once A's capture has ended, and then go (not wait for some later route's end)."""
    torch = FakeTorch()
    impl, routing, destroyed_while_routing, made = _watched(monkeypatch, torch)
    monkeypatch.setattr(impl, "_new_pool", lambda _torch: torch.cuda.MemPool())
    with impl.disable():  # the package in use before A's capture (a model loaded in a region, say)
        pass
    made.clear()
    with _another_thread_capturing(torch, how):
        if block == "disable":
            with impl.disable():
                pass
        else:
            with impl.region("kv"):
                del impl._mem_pools[("kv", False)]  # the route holds the pool alone now
        assert not destroyed_while_routing, "a pool was destroyed while another thread captured"
        assert len(made) == 1 and made[0]() is not None
    assert made[0]() is None, "the pool retired during the capture outlived it"
    assert (routing.active, routing.retired, routing.graphs) == (0, {}, {})
    assert not destroyed_while_routing and not torch.capturing


def test_no_capture_begins_while_a_retired_pool_is_destroyed(monkeypatch):
    """As a route waits (``test_no_route_starts_while_a_retired_pool_is_destroyed``), a graph
    capture other code begins while thread A destroys retired pools (outside the routing lock)
    waits for the end of the destruction, or PyTorch sees a pool destroyed under it."""
    torch = FakeTorch()
    impl = _impl_over(monkeypatch, torch, "torch")
    routing = _own_routing(monkeypatch, torch)
    destroyed_while_routing = _pools_telling_their_end(torch)
    with impl.disable():  # the package in use before
        pass

    def disable_block():  # A: leaving it destroys its own pool, slowly
        with impl.disable():
            pass

    def capture(began):  # B: begins a capture of its own while A's pool is being destroyed
        g = torch.cuda.CUDAGraph()
        g.capture_begin()
        began.set()
        g.capture_end()

    began_early = _past_early_while_a_pool_dies(torch, disable_block, capture)
    assert not began_early, "B began its capture while A's pool was being destroyed"
    assert not destroyed_while_routing
    assert (routing.active, routing.retired, routing.graphs) == (0, {}, {})
    assert routing.destroying is None


def _failing(torch, name):
    """Make ``torch.cuda.CUDAGraph``'s method ``name`` raise, before it does anything, while the
    list returned is not empty: as PyTorch's end of an invalidated capture does, whose
    ``cudaStreamEndCapture`` fails before the allocator hears of the end (the fake keeps the
    capture under way). Set before the package's first route, which wraps what it finds."""
    cls = torch.cuda.CUDAGraph
    real = getattr(cls, name)
    fail = []

    def method(self, *args, **kwargs):
        if fail:
            raise RuntimeError(f"{name} failed")
        return real(self, *args, **kwargs)

    setattr(cls, name, method)
    return fail


def test_a_capture_whose_begin_raises_is_not_counted(monkeypatch):
    """A ``capture_begin`` that raises began no capture: it must not stay counted as one, or
    no retired pool would ever be destroyed again (each ``disable()`` block's pool, say)."""
    torch = FakeTorch()
    fail = _failing(torch, "capture_begin")
    impl, routing, destroyed_while_routing, made = _watched(monkeypatch, torch)
    with impl.disable():  # the package in use: the wrapper is in place
        pass
    fail.append(True)
    with pytest.raises(RuntimeError, match="capture_begin failed"):
        torch.cuda.CUDAGraph().capture_begin()
    assert (routing.active, routing.graphs) == (0, {})
    with impl.disable():
        pass
    assert [r() for r in made] == [None, None], "a disable() pool outlived its block"
    assert routing.retired == {} and not destroyed_while_routing


@pytest.mark.parametrize("name", ["capture_end", "capture_end_pre"])
def test_a_capture_whose_end_raises_stays_counted_till_an_end_returns(monkeypatch, name):
    """A capture whose end raises (an invalidated capture) may still be under way for PyTorch's
    allocator, for good: destroying a pool then would end the process. So it stays counted, a
    pool retired meanwhile waits, and both go once an end of the graph returns (a retry). Newer
    PyTorch ends a capture in ``capture_end_pre`` (which ``capture_end`` calls), and calls it
    alone where ``torch.cuda.graph`` fails after the capture began: so does this test."""
    torch = FakeTorch()
    if name == "capture_end_pre":
        Graph = torch.cuda.CUDAGraph
        real_end = Graph.capture_end

        def capture_end(self):
            self.capture_end_pre()

        Graph.capture_end_pre, Graph.capture_end = real_end, capture_end
    fail = _failing(torch, name)
    impl, routing, destroyed_while_routing, made = _watched(monkeypatch, torch)
    with impl.disable():
        pass
    g = torch.cuda.CUDAGraph()
    g.capture_begin()
    assert (routing.active, list(routing.graphs.values())) == (1, [g])
    fail.append(True)
    end = getattr(g, name)
    with pytest.raises(RuntimeError, match=f"{name} failed"):
        end()
    assert (routing.active, list(routing.graphs.values())) == (1, [g])
    with impl.disable():
        pass
    assert made[0]() is None and made[1]() is not None, "a pool went while a capture was held"
    assert len(routing.retired) == 1
    fail.clear()
    end()
    assert (routing.active, routing.graphs, routing.retired) == (0, {}, {})
    assert made[1]() is None
    with pytest.raises(RuntimeError, match="no capture under way"):
        end()
    assert (routing.active, routing.graphs) == (0, {})
    assert not destroyed_while_routing


def test_the_packages_own_captures_are_counted_in_balance(monkeypatch):
    """``cuda_graph`` counts its capture itself and captures through ``torch.cuda.graph``,
    whose ``capture_begin`` counts it again: both end with it, also where its body raises, so
    retired pools go once it has ended. Meanwhile another thread's ``disable()`` pool stays."""
    torch = FakeTorch()
    impl, routing, destroyed_while_routing, made = _watched(monkeypatch, torch, "preload")

    def disable_block():
        with impl.disable():
            pass

    for raises in (False, True):
        made.clear()
        with contextlib.suppress(ZeroDivisionError):
            with impl.cuda_graph(torch.cuda.CUDAGraph()):
                t = threading.Thread(target=disable_block)
                t.start()
                t.join()
                assert len(made) == 1 and made[0]() is not None
                if raises:
                    1 / 0
        assert (routing.active, routing.graphs, routing.retired) == (0, {}, {})
        assert made[0]() is None
    assert not destroyed_while_routing and not torch.capturing


def test_captures_are_counted_from_the_packages_first_route_by_one_wrapper(monkeypatch):
    """The wrapper of ``CUDAGraph``'s methods is put in place the first time the package routes
    (not when it is imported or its implementation is made), once, however many blocks come."""
    torch = FakeTorch()
    Graph = torch.cuda.CUDAGraph
    originals = {name: Graph.__dict__[name] for name in ("capture_begin", "capture_end")}
    impl = _impl_over(monkeypatch, torch, "torch")
    routing = _own_routing(monkeypatch, torch)
    monkeypatch.setattr(impl, "_new_pool", lambda _torch: torch.cuda.MemPool())
    assert {name: Graph.__dict__[name] for name in originals} == originals
    for _ in range(3):
        with impl.disable():
            pass
        with impl.region("kv"):
            pass
    for name, original in originals.items():
        wrapper = Graph.__dict__[name]
        assert wrapper is not original and wrapper.__wrapped__ is original, name
    assert not hasattr(Graph, "capture_end_pre"), "a method PyTorch's class does not have was added"
    g = Graph()
    g.capture_begin()
    assert routing.active == 1
    g.capture_end()
    assert (routing.active, routing.graphs) == (0, {})


@pytest.mark.parametrize("when", ["before", "after, wrapping", "after, replacing"])
def test_captures_are_counted_whoever_else_patches_capture_begin(monkeypatch, when):
    """Integrations patch torch too. One that patched ``capture_begin`` before the package's
    first route is wrapped, and runs; one that wraps the package's wrapper later (with
    ``functools.wraps``) is not wrapped again; one that replaces it later with its own call of
    PyTorch's method is wrapped at the package's next route. Each capture counts once, and
    nothing raises."""
    import functools

    torch = FakeTorch()
    Graph = torch.cuda.CUDAGraph
    original = Graph.capture_begin
    calls = []

    def theirs(inner):
        @functools.wraps(inner)
        def capture_begin(self, *args, **kwargs):
            calls.append(1)
            return inner(self, *args, **kwargs)

        return capture_begin

    if when == "before":
        Graph.capture_begin = theirs(original)
    impl = _impl_over(monkeypatch, torch, "torch")
    routing = _own_routing(monkeypatch, torch)
    with impl.disable():
        pass
    if when == "after, wrapping":
        Graph.capture_begin = theirs(Graph.capture_begin)
    elif when == "after, replacing":
        Graph.capture_begin = lambda self, *a, **kw: (calls.append(1), original(self, *a, **kw))[1]
    with impl.disable():
        pass
    wrapper = Graph.__dict__["capture_begin"]
    with impl.disable():
        pass
    assert Graph.__dict__["capture_begin"] is wrapper, "wrapped again"
    g = Graph()
    g.capture_begin()
    assert (routing.active, calls) == (1, [1])
    g.capture_end()
    assert (routing.active, routing.graphs) == (0, {})


def test_importing_the_package_leaves_pytorchs_graphs_alone():
    """Importing the package (and reading its facade) patches nothing of torch's: the wrapper
    of ``CUDAGraph``'s methods comes with the first route, where torch is in use."""
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("torch")
    code = textwrap.dedent(
        """
        import torch
        names = ("capture_begin", "capture_end", "capture_end_pre")
        before = {n: torch.cuda.CUDAGraph.__dict__.get(n) for n in names}
        import torch_memory_saver
        from torch_memory_saver import torch_memory_saver as tms
        tms.hook_mode
        after = {n: torch.cuda.CUDAGraph.__dict__.get(n) for n in names}
        assert before == after, (before, after)
        assert all(not hasattr(m, "__wrapped__") for m in after.values() if m is not None)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
