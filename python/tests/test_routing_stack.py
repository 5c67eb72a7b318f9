"""A thread's route stack, with the stand-in for torch of _routing_helpers.py: a nested block (a
region, disable(), a graph capture) suspends the route below it and restarts it after, on its
own device; a block left unexited (a generator never finished) and ended by a garbage
collection, in its thread or another, undoes only its own entry, and whatever ends after it
restarts what is on top of the stack then."""

from __future__ import annotations

import contextlib
import gc
import sys
import threading

import pytest

from torch_memory_saver import routing as routes

from _routing_helpers import (
    FakeTorch,
    _after_each_route,
    _captures_routing_over,
    _collect_in_another_thread,
    _impl_over,
    _leave_unfinished_in_a_cycle,
    _own_routing,
    _under_a_route_collecting_by_hand,
)


def test_a_graph_captured_inside_a_region_is_not_routed_to_the_regions_pool(monkeypatch):
    """PyTorch serves an allocation from the first pool routed to that takes it, and a region's
    route takes every allocation of its thread: a capture inside ``region()`` must suspend the
    region's route, or the graph's memory is the region's (its tag, and a pool whose freed
    blocks later tensors reuse while the graph replays them). A region opened inside the capture
    routes as usual and, on leaving, restarts nothing; the region's route is back after."""

    torch = FakeTorch()
    seen = []

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        seen.append(("capture", dict(torch.recording)))
        yield

    torch.cuda.graph = staticmethod(graph)
    impl = _impl_over(monkeypatch, torch, "preload")
    region_pool, inner_pool = object(), object()
    with impl._routed(torch, region_pool, torch.new_pool):
        with impl.cuda_graph("G", tag="graph"):
            seen.append(("in capture", dict(torch.recording)))
            with impl._routed(torch, inner_pool, torch.new_pool):
                seen.append(("inner region", dict(torch.recording)))
            seen.append(("after inner", dict(torch.recording)))
        seen.append(("after capture", dict(torch.recording)))
    me = threading.get_ident()
    assert seen == [
        ("capture", {}),
        ("in capture", {}),
        ("inner region", {id(inner_pool): me}),
        ("after inner", {}),
        ("after capture", {id(region_pool): me}),
    ], seen
    assert not torch.recording and not routes._routing.active


@pytest.mark.parametrize("inner", ["cuda_graph", "disable", "region"])
def test_a_suspended_route_restarts_on_its_own_device(monkeypatch, inner):
    """A route suspended by a nested block (a capture, ``disable()``, another region) restarts
    after it; PyTorch's ``use_mem_pool`` routes the current device's allocations. A nested
    block on another device (``with torch.cuda.device(1): with cuda_graph(...)``) must not move
    the enclosing region's route there: the region's tensors made on its device after the
    block would come from the default pool (not pauseable in torch mode), and the other
    device's would come from the region's pool (one of another device's key)."""

    torch, impl = _captures_routing_over(monkeypatch)
    region_pool = object()
    seen = []
    with impl._routed(torch, region_pool, torch.new_pool):
        torch.device = 1  # with torch.cuda.device(1):
        if inner == "cuda_graph":
            block = impl.cuda_graph("G", tag="graph")
        elif inner == "disable":
            block = impl.disable()
        else:
            block = impl._routed(torch, object(), torch.new_pool)
        with block:
            pass
        seen.append(dict(torch.devices))  # still on device 1
        torch.device = 0  # the device block's end
        seen.append(dict(torch.devices))
    assert seen == [{id(region_pool): 0}] * 2, seen
    assert not torch.recording and not routes._routing.active


@pytest.mark.parametrize("block", ["region", "disable"])
def test_a_block_left_unexited_and_collected_inside_a_routing_step_ends_there(monkeypatch, block):
    """A region (or disable()) entered and dropped without its exit, in a reference cycle, is
    ended by a garbage collection, which may come at any bytecode, so inside a step of
    ``_routing`` that holds its lock: the block's end takes that lock again, in the same
    thread. With a plain lock that thread hung for ever. The collection is made inside the
    lock here; the block's end must then have run whole."""
    torch = FakeTorch()
    impl = _impl_over(monkeypatch, torch, "preload")
    routing = _own_routing(monkeypatch, torch)
    ended, errors = threading.Event(), []

    def body():
        try:
            cm = impl.region("left") if block == "region" else impl.disable()
            cm.__enter__()
            assert len(torch.recording) == 1 and routing.active == 1
            loop = [cm]
            loop.append(loop)
            del cm, loop
            with routing.lock:  # a step of the package's, where a collection may come
                assert gc.collect() > 0
            ended.set()
        except Exception as e:  # collected: a failure fails the test
            errors.append(repr(e))

    t = threading.Thread(target=body, daemon=True)  # hung, it must not keep pytest from ending
    t.start()
    t.join(timeout=10)
    assert ended.is_set(), f"the block's end hung inside the routing lock (errors: {errors})"
    assert not errors, errors
    assert not torch.recording, "the route of the collected block still routes"
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})


@pytest.mark.parametrize("block", ["region", "disable", "cuda_graph"])
def test_a_block_collected_in_another_thread_undoes_only_its_own_enter(monkeypatch, block):
    """A region (or disable(), or a capture) entered in thread A inside a generator that is
    never finished, in a reference cycle, is ended by a garbage collection in whatever thread
    makes it: here thread B, inside a route of its own. The block's end must undo what its enter
    did, on A's route stack: end its own route, and leave B's stack and routing alone. Before,
    it popped B's route off B's stack and restarted A's enclosing route in B (routing B's
    allocations to A's pool), and B's own end then found B's stack empty."""
    torch, impl = _captures_routing_over(monkeypatch)
    routing = routes._Routing()
    monkeypatch.setattr(routes, "_routing", routing)
    a_pool, b_pool = object(), object()
    left, collected = threading.Event(), threading.Event()
    seen, errors = {}, []

    def enter_and_leave_unfinished():
        with impl.region("left") if block == "region" else (
            impl.disable() if block == "disable" else impl.cuda_graph("G", tag="graph")
        ):
            yield

    def a():
        try:
            with impl._routed(torch, a_pool, torch.new_pool):  # A's enclosing route
                gen = enter_and_leave_unfinished()
                next(gen)
                loop = [gen]
                loop.append(loop)
                del gen, loop
                left.set()
                assert collected.wait(timeout=10)
                seen["a_stack"] = len(routes._route_stack(impl._local))
        except Exception as e:  # collected: a failure fails the test
            errors.append(f"A: {e!r}")

    def b():
        try:
            with impl._routed(torch, b_pool, torch.new_pool):
                assert left.wait(timeout=10)
                assert gc.collect() > 0  # ends A's block, here in B
                with torch.lock:
                    seen["recording"] = dict(torch.recording)
                seen["b_stack"] = len(routes._route_stack(impl._local))
                collected.set()
        except Exception as e:  # collected: a failure fails the test
            errors.append(f"B: {e!r}")
        finally:
            collected.set()

    gc.disable()  # the collection is B's, not one that happens to come in A
    try:
        ta, tb = threading.Thread(target=a), threading.Thread(target=b)
        ta.start()
        tb.start()
        ta.join(timeout=20)
        tb.join(timeout=20)
    finally:
        gc.enable()
    assert not errors, errors
    b_ident = tb.ident
    assert seen["recording"] == {id(b_pool): b_ident}, "B's routing changed, or A's block routes"
    assert (seen["a_stack"], seen["b_stack"]) == (1, 1), seen
    assert not torch.recording
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})


def test_a_block_collected_under_a_later_block_of_its_thread_leaves_the_stack_whole(monkeypatch):
    """A region left unexited (a generator never finished) and ended by a garbage collection
    inside a later block of the same thread: it was suspended under that block, so its end
    restarts nothing and takes only its own entry off the stack; the later block's end then
    restarts the route below the ended region. Before, the region's end popped the later
    block's entry and restarted the enclosing route beside the later one's."""
    torch = FakeTorch()
    impl = _impl_over(monkeypatch, torch, "preload")
    routing = _own_routing(monkeypatch, torch)
    outer, later = object(), object()
    me = threading.get_ident()

    with _under_a_route_collecting_by_hand(impl, torch, routing, outer):
        _leave_unfinished_in_a_cycle(lambda: impl.region("left"))
        with impl._routed(torch, later, torch.new_pool):
            assert gc.collect() > 0  # ends the region, under the later route
            assert torch.recording == {id(later): me}
            assert len(routes._route_stack(impl._local)) == 2
        assert torch.recording == {id(outer): me}, "not the route below the region"


@pytest.mark.parametrize("where", ["same thread", "another thread"])
def test_a_block_collected_while_the_block_above_it_ends_leaves_the_right_route(monkeypatch, where):
    """A region left unexited (a generator never finished) under a later block of its thread,
    ended by a garbage collection that comes while the later block ends, after that block took
    its entry off the stack and before it restarted the entry below (here: inside the later
    route's ``use_mem_pool`` exit). The later block must then restart what is on top of the
    stack now, the route below the ended region, once. Before, it restarted the ended region's
    route, whose pool was already retired (PyTorch raises for a None pool; the fake routes to
    it), beside the enclosing route the collection had restarted in this thread, or left the
    enclosing route suspended where the collection came in another thread."""
    torch = FakeTorch()
    impl = _impl_over(monkeypatch, torch, "preload")
    routing = _own_routing(monkeypatch, torch)
    outer, later = object(), object()
    me = threading.get_ident()
    collect_at_end = []

    def collect():
        if where == "same thread":
            assert gc.collect() > 0
            return
        _collect_in_another_thread()

    def collect_at_end_of(pool):
        if pool is later and collect_at_end:
            collect_at_end.clear()
            collect()

    _after_each_route(torch, collect_at_end_of)

    with _under_a_route_collecting_by_hand(impl, torch, routing, outer):
        _leave_unfinished_in_a_cycle(lambda: impl.region("left"))
        with impl._routed(torch, later, torch.new_pool):
            collect_at_end.append(True)
        assert not collect_at_end, "the collection did not come"
        assert torch.recording == {id(outer): me}, "not the route below the region alone"
        assert len(routes._route_stack(impl._local)) == 1


def test_a_block_collected_while_a_block_entered_above_it_suspends_it_leaves_one_route(monkeypatch):
    """A region left unexited (a generator never finished), ended by a garbage collection that
    comes while a later block of its thread suspends its route on entering (here: inside that
    route's ``use_mem_pool`` exit). The collection restarts the route below the region; the
    later block must suspend that one too, so that its own route alone serves inside it.
    Before, it suspended only the region's route, and the enclosing route, routed to first,
    took the later block's allocations (PyTorch serves from the first pool routed to)."""
    torch = FakeTorch()
    impl = _impl_over(monkeypatch, torch, "preload")
    routing = _own_routing(monkeypatch, torch)
    outer, later = object(), object()
    me = threading.get_ident()
    collect_at_end = []

    def collect_at_end_of(pool):
        if collect_at_end:
            collect_at_end.clear()
            assert gc.collect() > 0

    _after_each_route(torch, collect_at_end_of)

    with _under_a_route_collecting_by_hand(impl, torch, routing, outer):
        _leave_unfinished_in_a_cycle(lambda: impl.region("left"))
        collect_at_end.append(True)  # at the region route's suspension
        with impl._routed(torch, later, torch.new_pool):
            assert not collect_at_end, "the collection did not come"
            assert torch.recording == {id(later): me}, "not the later block's route alone"
        assert torch.recording == {id(outer): me}
        assert len(routes._route_stack(impl._local)) == 1


def test_a_block_collected_in_another_thread_while_its_thread_restarts_it_stays_ended(monkeypatch):
    """Thread A ends a later block and restarts the route below it: a disable() block left
    unexited (a generator never finished). A garbage collection in thread B ends that block
    meanwhile, after A read it off its stack and before A's start routes (here: while A asks
    whether its stream captures). A must not start the ended block's route: its pool is retired
    by then (PyTorch raises for a None pool; the fake routes to it, and the count of routes
    never comes back to 0, so no retired pool is destroyed again), or about to be, and then
    taken by a later disable() block while A routes to it. A restarts what is below it instead."""
    torch = FakeTorch()
    impl = _impl_over(monkeypatch, torch, "preload")
    routing = _own_routing(monkeypatch, torch)
    outer, later = object(), object()
    me = threading.get_ident()
    collect_when_asked = []

    def is_current_stream_capturing():
        # Not in collect(), under the routing lock: at the restart's own question.
        if collect_when_asked and threading.get_ident() == me and not routing.lock._is_owned():
            collect_when_asked.clear()
            _collect_in_another_thread()
        return False

    torch.cuda.is_current_stream_capturing = staticmethod(is_current_stream_capturing)

    with _under_a_route_collecting_by_hand(impl, torch, routing, outer):
        _leave_unfinished_in_a_cycle(impl.disable)  # whose route asks at its start
        with impl._routed(torch, later, torch.new_pool):
            pass
        # The block is on top again, suspended; the next restart asks first.
        with impl._routed(torch, later, torch.new_pool):
            collect_when_asked.append(True)
        assert not collect_when_asked, "the collection did not come"
        assert torch.recording == {id(outer): me}, "not the route below the block alone"
        assert len(routes._route_stack(impl._local)) == 1


def test_a_block_whose_route_fails_to_end_in_another_thread_does_not_hang_its_own(monkeypatch):
    """A disable() block left unexited (a generator never finished) in thread A, ended by a
    garbage collection in thread B, where PyTorch raises ending its route. B's leave() then
    waits while A destroys retired pools; A, inside that destruction (a pool's end that routes
    again), had read the block off its stack before and stops its route. B held the route's
    lock while it waited, so A's stop waited for B, and B for A: both hung for ever. B's
    leave() now comes after the route's lock, as it does where the route ended well."""
    torch = FakeTorch()
    impl = _impl_over(monkeypatch, torch, "preload")
    routing = _own_routing(monkeypatch, torch)
    b_waits = threading.Event()
    done = routing.done

    class Waits:  # the routing's condition, telling when a thread waits for a destruction
        def wait(self):
            b_waits.set()
            done.wait()

        def notify_all(self):
            done.notify_all()

    monkeypatch.setattr(routing, "done", Waits())
    fail = []

    def fail_once(pool):
        if pool in fail:
            fail.clear()
            raise RuntimeError("endAllocateToPool failed")

    _after_each_route(torch, fail_once)
    # The error ends B's collection of the block, where Python reports it and goes on.
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(repr(u.exc_value)))

    class HookedLock:  # a route's lock, running ``hook`` before A first takes it
        def __init__(self, lock, hook):
            self.lock, self.hook = lock, hook

        def __enter__(self):
            if self.hook is not None and threading.current_thread() is a:
                hook, self.hook = self.hook, None
                hook()
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    b = threading.Thread(target=gc.collect, daemon=True)  # ends A's block

    def routing_again():  # in A, inside its destruction of a retired pool
        _leave_unfinished_in_a_cycle(impl.disable)
        route = routes._route_stack(impl._local)[-1]
        fail.append(route.pool)

        def collect_in_b():  # A has read the route off its stack, to suspend it
            b.start()
            assert b_waits.wait(timeout=10), "B does not wait for A's destruction"

        route.lock = HookedLock(route.lock, collect_in_b)
        with impl._routed(torch, object(), torch.new_pool):
            pass

    Pool = torch.cuda.MemPool

    class RoutesAgain:
        def __del__(self):
            torch.cuda.MemPool = staticmethod(Pool)
            routing_again()

    torch.cuda.MemPool = staticmethod(RoutesAgain)
    ended, errors = threading.Event(), []

    def in_a():
        try:
            with impl._routed(torch, None):  # a disable() block: its end destroys its pool
                pass
            ended.set()
        except Exception as e:  # collected: a failure fails the test
            errors.append(repr(e))

    a = threading.Thread(target=in_a, daemon=True)  # hung, it must not keep pytest from ending
    gc.disable()  # the collection is B's
    try:
        a.start()
        a.join(timeout=10)
        if ended.is_set():
            b.join(timeout=10)
    finally:
        gc.enable()
    assert ended.is_set() and not b.is_alive(), f"A or B hung (errors: {errors})"
    assert not errors and not fail, (errors, fail)
    assert unraisable == ["RuntimeError('endAllocateToPool failed')"], unraisable
    assert not torch.recording
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})
