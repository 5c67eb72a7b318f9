"""Shared by the routing tests (test_routing_pools.py, test_routing_stack.py), which import it as
the other tests import conftest's helpers: a stand-in for torch that enforces what PyTorch does,
one thread at a time may route to a pool ("beginAllocateToPool: already recording to
mempool_id"), and the helpers that route with it."""

from __future__ import annotations

import contextlib
import gc
import threading

from torch_memory_saver import regions, saver
from torch_memory_saver import routing as routes


class FakeTorch:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.recording: dict = {}
        # id(graph) -> the thread capturing it, from capture_begin to capture_end (PyTorch's
        # captures_underway: while it is not empty, no pool may be destroyed).
        self.capturing: dict = {}
        self.made = 0
        # The current device (one for the process: the tests set it in one thread), and the
        # device each pool routed to is routed on.
        self.device = 0
        self.devices: dict = {}
        outer = self

        class Cuda:
            @staticmethod
            @contextlib.contextmanager
            def use_mem_pool(pool, device=None):
                with outer.lock:
                    if id(pool) in outer.recording:
                        raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
                    outer.recording[id(pool)] = threading.get_ident()
                    outer.devices[id(pool)] = outer.device if device is None else device
                try:
                    yield
                finally:
                    with outer.lock:
                        del outer.recording[id(pool)]
                        del outer.devices[id(pool)]

            @staticmethod
            def current_device():
                return outer.device

            @staticmethod
            def is_current_stream_capturing():
                with outer.lock:
                    return threading.get_ident() in outer.capturing.values()

            @staticmethod
            def MemPool():
                return object()

            class CUDAGraph:
                def capture_begin(self, pool=None, capture_error_mode="global"):
                    with outer.lock:
                        if id(self) in outer.capturing:
                            raise RuntimeError("capture_begin: this graph is capturing already")
                        outer.capturing[id(self)] = threading.get_ident()

                def capture_end(self):
                    with outer.lock:
                        if outer.capturing.pop(id(self), None) is None:
                            raise RuntimeError("capture_end: no capture under way")

            @staticmethod
            @contextlib.contextmanager
            def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
                # As torch.cuda.graph: its __exit__ ends the capture, also where the body raised.
                cuda_graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
                try:
                    yield
                finally:
                    cuda_graph.capture_end()

        self.cuda = Cuda

    def new_pool(self):
        with self.lock:
            self.made += 1
        return object()


def _impl_over(monkeypatch, torch, mode, flags=None):
    """An implementation of hook mode ``mode`` whose regions and captures route with ``torch``
    (put in ``sys.modules``), without the library: its flags (``flags`` where given, else
    nothing) and chunk checks stand in."""
    import sys

    monkeypatch.setitem(sys.modules, "torch", torch)
    impl = saver._TorchMemorySaverImpl(mode)
    monkeypatch.setattr(impl, "_library", lambda: None)
    monkeypatch.setattr(impl, "_flags", flags or (lambda *a: contextlib.nullcontext()))
    monkeypatch.setattr(impl, "_chunk_misfits", lambda *a: contextlib.nullcontext())
    return impl


def _captures_routing_over(monkeypatch):
    """A fake torch whose graph captures do nothing (so a capture's place on a route stack is
    all there is of it) and a preload-mode implementation routing with it: (torch, impl)."""
    torch = FakeTorch()

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        yield

    torch.cuda.graph = staticmethod(graph)
    impl = _impl_over(monkeypatch, torch, "preload")
    monkeypatch.setattr(regions, "_torch_if_cuda", lambda: torch)
    return torch, impl


def _own_routing(monkeypatch, torch):
    """Route with ``torch`` through a routing state of the test's own (the module's is shared
    by every test): returned, to look into."""
    monkeypatch.setattr(regions, "_torch_if_cuda", lambda: torch)
    routing = routes._Routing()
    monkeypatch.setattr(routes, "_routing", routing)
    return routing


def _leave_unfinished_in_a_cycle(block):
    """Enter ``block()`` inside a generator left unfinished, in a reference cycle: the block is
    ended by whichever garbage collection comes next, in whatever thread makes it."""

    def left_unfinished():
        with block():
            yield

    gen = left_unfinished()
    next(gen)
    loop = [gen]
    loop.append(loop)


def _thread_in_region(impl, tag, inside, may_leave, errors):
    """A thread, not started, that enters ``impl.region(tag)``, sets ``inside`` and stays till
    ``may_leave`` is set; what it raises goes to ``errors`` (a failure fails the test)."""

    def body():
        try:
            with impl.region(tag):
                inside.set()
                assert may_leave.wait(timeout=10)
        except Exception as e:  # collected
            errors.append(repr(e))

    return threading.Thread(target=body)


def _after_each_route(torch, then):
    """Make ``torch.cuda.use_mem_pool`` call ``then(pool)`` once each route to ``pool`` has ended
    (after PyTorch's own exit), in the thread that ends it: what ``then`` raises is PyTorch's
    error ending the route."""
    use_mem_pool = torch.cuda.use_mem_pool

    @contextlib.contextmanager
    def then_after(pool, device=None):
        with use_mem_pool(pool, device):
            yield
        then(pool)

    torch.cuda.use_mem_pool = staticmethod(then_after)


def _pools_telling_their_end(torch):
    """Make ``torch.cuda.MemPool`` a stand-in whose destruction while a thread routes or
    captures a graph (where PyTorch asserts) is recorded in the list returned."""
    destroyed_while_routing = []

    class Pool:
        def __del__(self):
            with torch.lock:
                if torch.recording or torch.capturing:
                    destroyed_while_routing.append({**torch.recording, **torch.capturing})

    torch.cuda.MemPool = staticmethod(Pool)
    return destroyed_while_routing


def _torch_without_a_device():
    """FakeTorch as torch is where CUDA is not initialized and cannot be (no driver, no
    device, a CPU build, a forked child): asking whether the stream captures raises."""
    torch = FakeTorch()

    def is_current_stream_capturing():
        raise RuntimeError("CUDA error: CUDA driver version is insufficient for CUDA runtime version")

    torch.cuda.is_current_stream_capturing = staticmethod(is_current_stream_capturing)
    torch.cuda.is_initialized = staticmethod(lambda: False)
    return torch


def _collect_in_another_thread():
    """A garbage collection in a thread of its own, which must collect something."""
    done = []
    t = threading.Thread(target=lambda: done.append(gc.collect()))
    t.start()
    t.join(timeout=10)
    assert done and done[0] > 0


@contextlib.contextmanager
def _under_a_route_collecting_by_hand(impl, torch, routing, outer):
    """Inside a route of this thread to ``outer``, with garbage collections the test's own
    (automatic ones off); after it, nothing routed, this thread's stack empty and the routing
    state back to rest."""
    gc.disable()
    try:
        with impl._routed(torch, outer, torch.new_pool):
            yield
        assert not torch.recording and not routes._route_stack(impl._local)
    finally:
        gc.enable()
    assert (routing.active, routing.retired, routing.busy) == (0, {}, {})
