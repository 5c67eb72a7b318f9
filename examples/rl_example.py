"""An RL-style loop with training and inference taking turns on one GPU.

The policy is a small MLP (4 layers, hidden 1024, float32, random init). Two sides, each
pauseable while the other one works:

  inference  tag "infer_weights"  its own copy of the weights (no backup: re-synced from
                                  training after every training step)
             tag "kv_cache"       a KV-cache-like buffer (2 GiB, no backup) that the forward
                                  writes each hidden layer's output into and reads it back from
             tag "infer_graph"    the inference forward, captured as a CUDA graph
  training   tag "train"          weights, gradients and Adam state (CPU backup)

Each step:
  1. inference (training paused): copy a batch into the graph's static input, replay, take the
     outputs and a scalar "reward" (their mean);
  2. pause the inference tags, resume "train", one training step (MSE to a fixed target,
     backward, Adam step);
  3. resume "infer_weights", copy the training weights into it, pause "train", resume
     "kv_cache" and "infer_graph": ready for the next inference phase.

The same loop first runs without any pausing, on a second set of models with the same seeds
and data (the reference). Checks: at every step the rollout outputs and the training loss
match the reference (allclose, rtol 1e-5, TF32 off), the final weights too, and every pause
and resume released or took >= 0.9 of the paused side's bytes (driver-level free memory).

    python examples/rl_example.py [--hook-mode {preload,torch}] [--steps 20] [--kv-gib 2]
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
from _common import GiB, check, free_bytes, gib  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torch_memory_saver import torch_memory_saver  # noqa: E402

INFER_TAGS = ("kv_cache", "infer_graph", "infer_weights")
RTOL = 1e-5
ATOL_OUT = 1e-5  # outputs are O(0.1); graph replay and eager may pick different GEMM kernels


def add_arguments(p) -> None:
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1024, help="training batch")
    p.add_argument("--infer-batch", type=int, default=1024, help="inference batch")
    p.add_argument("--kv-gib", type=float, default=2.0, help="size of the KV-cache-like buffer")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)


class Policy(nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def new_policy(args) -> Policy:
    """A policy on the CPU, with the same random weights on every call."""
    torch.manual_seed(args.seed)
    return Policy(args.hidden, args.layers)


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def infer_forward(policy: Policy, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The policy's forward, where each hidden layer's output goes through the KV-cache-like
    buffer (written, then read back), as a decoder writes and reads its cache. Same result."""
    b, n = x.shape[0], len(policy.layers)
    h = x
    for i, layer in enumerate(policy.layers):
        h = layer(h)
        if i < n - 1:
            h = torch.relu(h)
            slot = kv[i * b : (i + 1) * b]
            slot.copy_(h)
            h = slot
    return h


def build_trainer(args):
    """The training model, its gradients and its Adam state, all allocated here (on this
    thread), so that inside a region all of them are pauseable:
      - gradients are created now (zeros) and kept: backward then accumulates into them in
        place, and zero_grad(set_to_none=False) keeps them. (Gradients created by backward
        itself would be allocated on autograd's device thread, outside the region.)
      - Adam's exp_avg / exp_avg_sq are created by a first step on those zero gradients, which
        changes no weight (the update is 0 / (0 + eps) = 0) but counts as Adam's step 1."""
    model = new_policy(args).cuda()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, foreach=False)
    opt.step()
    return model, opt


def train_step(model, opt, x: torch.Tensor, target: torch.Tensor) -> float:
    opt.zero_grad(set_to_none=False)
    loss = F.mse_loss(model(x), target)
    loss.backward()
    opt.step()
    return loss.item()


@torch.no_grad()
def sync_weights(dst: nn.Module, src: nn.Module) -> None:
    for d, s in zip(dst.parameters(), src.parameters()):
        d.copy_(s)  # in place: the addresses the graph reads stay the same


class Data:
    """Deterministic CPU data: a fixed target, and one inference and one training batch per step."""

    def __init__(self, args) -> None:
        self.args = args
        g = torch.Generator().manual_seed(args.seed + 1)
        self.target = 0.1 * torch.randn(args.batch, args.hidden, generator=g)

    def _randn(self, n: int, salt: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1_000_003 * (self.args.seed + 7) + salt)
        return torch.randn(n, self.args.hidden, generator=g)

    def infer_input(self, step: int) -> torch.Tensor:
        return self._randn(self.args.infer_batch, 2 * step)

    def train_input(self, step: int) -> torch.Tensor:
        return self._randn(self.args.batch, 2 * step + 1)


def run_reference(args, data: Data):
    """The same loop with ordinary memory and nothing paused (eager inference)."""
    model, opt = build_trainer(args)
    infer = new_policy(args).cuda()
    kv = torch.empty(((args.layers - 1) * args.infer_batch, args.hidden), device="cuda")
    target = data.target.cuda()
    sync_weights(infer, model)
    outputs, losses = [], []
    for step in range(args.steps):
        with torch.no_grad():
            outputs.append(infer_forward(infer, data.infer_input(step).cuda(), kv).cpu())
        losses.append(train_step(model, opt, data.train_input(step).cuda(), target))
        sync_weights(infer, model)
    final = [p.detach().cpu() for p in model.parameters()]
    return outputs, losses, final


class MemoryLog:
    """Per kind of transition, (step, bytes changed, bytes expected)."""

    def __init__(self) -> None:
        self.rows = {}

    def add(self, kind: str, step: int, changed: int, expected: int) -> bool:
        self.rows.setdefault(kind, []).append((step, changed, expected))
        return changed >= 0.9 * expected

    def report(self) -> None:
        for kind, rows in self.rows.items():
            bad = [r for r in rows if r[1] < 0.9 * r[2]]
            worst = min(rows, key=lambda r: r[1] / r[2])
            check(
                f"{kind}: >= 0.9 x its bytes at every step",
                not bad,
                f"{len(rows)} times, lowest {gib(worst[1])} of {gib(worst[2])} (step {worst[0]})"
                + (f"; short at steps {[r[0] for r in bad]}" if bad else ""),
            )


def main() -> None:
    args = _common.setup(__doc__, add_arguments)
    _common.disable_tf32()
    data = Data(args)
    kv_rows = int(args.kv_gib * GiB) // (args.hidden * 4)
    if kv_rows < (args.layers - 1) * args.infer_batch:
        sys.exit("--kv-gib too small for --layers/--infer-batch/--hidden")

    print(f"reference run: {args.steps} steps, nothing paused")
    ref_outputs, ref_losses, ref_final = run_reference(args, data)
    torch.cuda.empty_cache()

    # ---- training side: weights, gradients, Adam state
    with torch_memory_saver.region(tag="train", enable_cpu_backup=True):
        model, opt = build_trainer(args)
    train_bytes = 4 * param_bytes(model)  # weights, gradients, exp_avg, exp_avg_sq

    # ---- inference side
    with torch_memory_saver.region(tag="infer_weights"):
        infer = new_policy(args).cuda()
    with torch_memory_saver.region(tag="kv_cache"):
        kv = torch.empty((kv_rows, args.hidden), device="cuda")
    infer_w_bytes = param_bytes(infer)
    kv_bytes = kv.numel() * kv.element_size()
    static_x = torch.zeros(args.infer_batch, args.hidden, device="cuda")  # outside any region
    target = data.target.cuda()
    sync_weights(infer, model)

    # Warm up on a side stream outside any region (its cuBLAS workspace stays ordinary memory),
    # then capture on that same stream.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(3):
            infer_forward(infer, static_x, kv)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch_memory_saver.cuda_graph(graph, stream=side, tag="infer_graph"):
        static_y = infer_forward(infer, static_x, kv)
    st = _common.tag_stats("infer_graph")
    graph_bytes = st["bytes_active"] if st else 0
    infer_rest_bytes = kv_bytes + graph_bytes
    infer_bytes = infer_rest_bytes + infer_w_bytes

    print(f"training side: {gib(train_bytes)} (weights, gradients, Adam state); inference side: weights "
          f"{gib(infer_w_bytes)}, kv_cache {gib(kv_bytes)}, graph {gib(graph_bytes)}")
    for tag, nominal in (("train", train_bytes), ("infer_weights", infer_w_bytes), ("kv_cache", kv_bytes)):
        s = _common.tag_stats(tag)
        check(f"tag {tag!r} holds its tensors' memory", s is not None and s["bytes_active"] >= nominal,
              f"{gib(s['bytes_active']) if s else None} for {gib(nominal)} of tensors")
    check("tag 'infer_graph' holds the graph's memory", graph_bytes > 0, gib(graph_bytes))

    mem = MemoryLog()
    # Start: training sleeps, inference is awake.
    f0 = free_bytes()
    torch_memory_saver.pause("train")
    mem.add("pause('train') released", -1, free_bytes() - f0, train_bytes)

    losses, out_ok, loss_ok = [], [], []
    max_out_diff = 0.0
    print(f"\n{'step':>4} {'loss':>14} {'reference':>14} {'reward':>12}  released: inference / training")
    for step in range(args.steps):
        # (1) inference phase
        static_x.copy_(data.infer_input(step))
        graph.replay()
        reward = static_y.mean().item()
        out = static_y.cpu()
        ok_o = torch.allclose(out, ref_outputs[step], rtol=RTOL, atol=ATOL_OUT)
        max_out_diff = max(max_out_diff, (out - ref_outputs[step]).abs().max().item())
        out_ok.append(ok_o)

        # (2) inference sleeps, training wakes, one training step
        f0 = free_bytes()
        for tag in INFER_TAGS:
            torch_memory_saver.pause(tag)
        f1 = free_bytes()
        torch_memory_saver.resume("train")
        f2 = free_bytes()
        loss = train_step(model, opt, data.train_input(step).cuda(), target)
        losses.append(loss)
        ok_l = math.isclose(loss, ref_losses[step], rel_tol=RTOL)
        loss_ok.append(ok_l)

        # (3) weights to inference: both sides' weights are needed at once, so resume the
        # inference weights (contents undefined: overwritten right away) before training
        # sleeps; then the rest of the inference side wakes for the next step.
        f3 = free_bytes()
        torch_memory_saver.resume("infer_weights")
        f4 = free_bytes()
        sync_weights(infer, model)
        torch_memory_saver.pause("train")
        f5 = free_bytes()
        torch_memory_saver.resume("kv_cache")
        torch_memory_saver.resume("infer_graph")
        f6 = free_bytes()

        mem.add("pausing the inference tags released", step, f1 - f0, infer_bytes)
        mem.add("resume('train') took", step, f1 - f2, train_bytes)
        mem.add("resume('infer_weights') took", step, f3 - f4, infer_w_bytes)
        mem.add("pause('train') released", step, f5 - f4, train_bytes)
        mem.add("resume('kv_cache', 'infer_graph') took", step, f5 - f6, infer_rest_bytes)
        marks = ("" if ok_l else " LOSS MISMATCH") + ("" if ok_o else " OUTPUT MISMATCH")
        print(f"{step:>4} {loss:>14.8e} {ref_losses[step]:>14.8e} {reward:>+12.4e}  "
              f"{gib(f1 - f0)} / {gib(f5 - f4)}{marks}", flush=True)

    print()
    check("the rollout outputs match the reference at every step", all(out_ok),
          f"max |diff| {max_out_diff:.2e}" + ("" if all(out_ok) else f"; bad steps {[i for i, o in enumerate(out_ok) if not o]}"))
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    check("the training losses match the reference at every step", all(loss_ok),
          f"max relative diff {rel:.2e}" + ("" if all(loss_ok) else f"; bad steps {[i for i, o in enumerate(loss_ok) if not o]}"))
    print(f"(training loss {losses[0]:.6e} -> {losses[-1]:.6e} over {args.steps} steps)")
    mem.report()

    torch_memory_saver.resume("train")
    final_ok = all(torch.allclose(p.detach().cpu(), r, rtol=RTOL, atol=1e-6) for p, r in zip(model.parameters(), ref_final))
    check("the final training weights match the reference", final_ok)
    synced = all(torch.equal(a, b) for a, b in zip(infer.parameters(), model.parameters()))
    check("the inference weights equal the training weights", synced)

    print()
    print(torch_memory_saver.summary())
    _common.finish()


if __name__ == "__main__":
    main()
