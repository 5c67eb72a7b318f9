"""A captured CUDA graph survives pause/resume of its own memory and of the weights it reads.

An MLP (1024 -> 4096 -> 4096 -> 1024, float32, random init) has its weights in a region
(tag "weights", CPU backup); its forward is captured with torch_memory_saver.cuda_graph(g,
tag="graph") after the usual warm-up on a side stream, with a static input and output. Then,
5 times: pause("graph") and pause("weights") give their memory back, resume both, replay.
Checks: the memory released, same addresses, the replay on the first input is bit-identical to
the one before any pause, and on a new input it matches the eager forward of the same model and
of a reference copy of the weights in ordinary memory (allclose, atol 1e-5, TF32 off).

    python examples/cuda_graph.py [--hook-mode {preload,torch}]
"""

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
from _common import check, free_bytes, gib  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from torch_memory_saver import torch_memory_saver  # noqa: E402

IN, HIDDEN, OUT, BATCH = 1024, 4096, 1024, 2048
ITERATIONS = 5
ATOL = 1e-5


def make_input(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(BATCH, IN, generator=g)


def main() -> None:
    _common.setup(__doc__)
    _common.disable_tf32()

    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    cpu_model.eval()
    ref_model = copy.deepcopy(cpu_model).cuda()  # ordinary memory: the reference never pauses

    # The weights, pauseable with a CPU backup.
    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        model = copy.deepcopy(cpu_model).cuda()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    st = _common.tag_stats("weights")
    check("the weights are pauseable", st is not None and st["bytes_active"] >= weight_bytes,
          f"{gib(weight_bytes)} of parameters, tag 'weights' holds {gib(st['bytes_active']) if st else None}")

    static_x = torch.empty(BATCH, IN, device="cuda")  # outside any region: survives every pause
    static_x.copy_(make_input(0))

    # Warm-up on a side stream (the torch.cuda.graph recipe), outside any region: this also
    # creates that stream's cuBLAS workspace in ordinary memory. Capturing on the same stream
    # keeps the workspace out of the graph's (pauseable) pool: the workspace is cached per
    # stream and outlives the graph, so it must not be paused with it.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # torch.cuda.graph does this too; do it first so the measure is the graph's

    free_before = free_bytes()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch_memory_saver.cuda_graph(graph, stream=side, tag="graph"):
        static_y = model(static_x)
    free_after = free_bytes()
    graph_taken = free_before - free_after
    st = _common.tag_stats("graph")
    graph_bytes = st["bytes_active"] if st else 0
    print(f"capture took {gib(graph_taken)} of device memory; tag 'graph' holds {gib(graph_bytes)} pauseable")
    check("the graph's memory is pauseable", graph_bytes > 0, f"tag 'graph': {st}")

    graph.replay()
    first_out = static_y.clone()
    with torch.no_grad():
        eager = model(static_x)
        ref = ref_model(static_x)
    check("replay matches the eager forward before any pause",
          torch.allclose(first_out, eager, atol=ATOL) and torch.allclose(first_out, ref, atol=ATOL),
          f"max |diff| {(first_out - ref).abs().max().item():.2e}")
    del eager, ref

    ptrs = [p.data_ptr() for p in model.parameters()] + [static_y.data_ptr(), static_x.data_ptr()]
    for it in range(1, ITERATIONS + 1):
        lb = f"[{it}/{ITERATIONS}]"
        f0 = free_bytes()
        torch_memory_saver.pause("graph")
        f1 = free_bytes()
        torch_memory_saver.pause("weights")
        f2 = free_bytes()
        check(f"{lb} pause('graph') released the graph's memory", f1 - f0 >= 0.9 * graph_bytes and f1 > f0,
              f"+{gib(f1 - f0)} (graph pool {gib(graph_bytes)}, capture took {gib(graph_taken)})")
        check(f"{lb} pause('weights') released the weights' memory", f2 - f1 >= 0.9 * weight_bytes,
              f"+{gib(f2 - f1)} (parameters {gib(weight_bytes)})")

        torch_memory_saver.resume("weights")
        torch_memory_saver.resume("graph")
        f3 = free_bytes()
        check(f"{lb} resume took it back", f2 - f3 >= 0.9 * (weight_bytes + graph_bytes), f"-{gib(f2 - f3)}")
        check(f"{lb} same addresses", [p.data_ptr() for p in model.parameters()] + [static_y.data_ptr(), static_x.data_ptr()] == ptrs)

        # The first input again: the very same graph on the restored weights gives the very same bits.
        static_x.copy_(make_input(0))
        graph.replay()
        check(f"{lb} replay on the first input is bit-identical to the one before any pause", torch.equal(static_y, first_out))

        # A new input, copied into the static input.
        static_x.copy_(make_input(it))
        graph.replay()
        out = static_y.clone()
        with torch.no_grad():
            eager = model(static_x)
            ref = ref_model(static_x)
        check(f"{lb} replay on a new input matches the eager forward (same weights, and reference copy)",
              torch.allclose(out, eager, atol=ATOL) and torch.allclose(out, ref, atol=ATOL),
              f"max |diff| vs eager {(out - eager).abs().max().item():.2e}, vs reference {(out - ref).abs().max().item():.2e}")
        del out, eager, ref

    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    check("the weights are bit-identical to the reference copy after all pauses", same)

    print()
    print(torch_memory_saver.summary())
    _common.finish()


if __name__ == "__main__":
    main()
