"""Three independent tags, paused and resumed in several orders.

    weights      2 x 256 MiB float32   CPU backup in pinned memory
    kv_cache     2 x 256 MiB uint8     no backup (contents undefined after resume: rewritten)
    activations  256 + 128 MiB bf16    CPU backup in pageable (mmap) memory

After every pause/resume: the device's free memory changed by exactly the memory of the tags
that changed state (nothing for a no-op: pausing a paused tag, resuming an active one), stats()
shows each tag in the expected state, every tensor keeps its address, and every active tensor
whose contents are defined (backed-up tags always; kv_cache until its next pause) still holds
them. A resumed kv_cache is refilled with new random data.

    python examples/multi_tags.py [--hook-mode {preload,torch}]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
from _common import MiB, check, free_bytes, gib  # noqa: E402

import torch  # noqa: E402

from torch_memory_saver import torch_memory_saver  # noqa: E402

# tag -> (region arguments, [(shape, dtype), ...]). Every tensor is a multiple of 2 MiB and
# larger than 10 MiB, so PyTorch gives each a segment of exactly its size: the device memory
# of a tag is exactly that of its tensors.
TAGS = {
    "weights": (
        dict(enable_cpu_backup=True),
        [((64 << 20,), torch.float32), ((8192, 8192), torch.float32)],
    ),
    "kv_cache": (
        dict(),
        [((256 << 20,), torch.uint8), ((2, 128 << 20), torch.uint8)],
    ),
    "activations": (
        dict(enable_cpu_backup=True, cpu_backup_backend="mmap"),
        [((128 << 20,), torch.bfloat16), ((4096, 16384), torch.bfloat16)],
    ),
}

# Device memory of the tags changes by exactly their (2 MiB-aligned) sizes; allow a little for
# the driver's own bookkeeping.
SLACK = 16 * MiB


def fill_random(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point:
        t.normal_()
    else:
        t.random_(0, 256)


class World:
    def __init__(self) -> None:
        torch.manual_seed(0)
        torch.cuda.empty_cache()  # not needed (regions have pools of their own); clean numbers
        self.tensors = {}
        for tag, (kwargs, specs) in TAGS.items():
            with torch_memory_saver.region(tag=tag, **kwargs):
                ts = [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in specs]
            for t in ts:
                fill_random(t)  # in place: no allocation
            self.tensors[tag] = ts
        self.nbytes = {tag: sum(t.numel() * t.element_size() for t in ts) for tag, ts in self.tensors.items()}
        self.backup = {tag: TAGS[tag][0].get("enable_cpu_backup", False) for tag in TAGS}
        self.ptrs = {tag: [t.data_ptr() for t in ts] for tag, ts in self.tensors.items()}
        self.refs = {tag: [t.cpu() for t in ts] for tag, ts in self.tensors.items()}
        self.active = {tag: True for tag in TAGS}
        self.defined = {tag: True for tag in TAGS}  # the contents are known (refs hold them)
        self.step = 0

    def op(self, kind: str, tag=None) -> None:
        """Pause or resume ``tag`` (every tag if None) and check the world afterwards."""
        self.step += 1
        label = f"{self.step:2d}: {kind}({'' if tag is None else repr(tag)})"
        tags = list(TAGS) if tag is None else [tag]
        if kind == "pause":
            changing = [t for t in tags if self.active[t]]
        else:
            changing = [t for t in tags if not self.active[t]]
        expected = sum(self.nbytes[t] for t in changing)

        f0 = free_bytes()
        getattr(torch_memory_saver, kind)(tag)
        f1 = free_bytes()
        change = f1 - f0 if kind == "pause" else f0 - f1  # > 0: released (pause), taken (resume)
        for t in changing:
            self.active[t] = kind == "resume"
            if kind == "pause" and not self.backup[t]:
                self.defined[t] = False
        what = "released" if kind == "pause" else "taken"
        state = ", ".join(f"{t}={'active' if self.active[t] else 'paused'}" for t in TAGS)
        print(f"--- {label}: {state}")
        check(
            f"{label} device memory {what} = that of {changing or 'nothing (no-op)'}",
            abs(change - expected) <= max(SLACK, 0.01 * expected),
            f"{what} {gib(change)}, expected {gib(expected)}",
        )

        stats_ok, detail = True, []
        for t in TAGS:
            st = _common.tag_stats(t)
            n = len(self.tensors[t])
            want_paused = 0 if self.active[t] else st["allocations"] if st else 0
            ok = st is not None and st["allocations"] >= n and st["paused_allocations"] == want_paused
            if self.active[t]:
                ok = ok and st["bytes_active"] >= self.nbytes[t]
            else:
                ok = ok and st["bytes_active"] == 0 and st["bytes_paused"] >= self.nbytes[t]
            stats_ok &= ok
            if st is not None:
                detail.append(f"{t}: {st['paused_allocations']}/{st['allocations']} paused")
        check(f"{label} stats() agree", stats_ok, ", ".join(detail))

        same = all(x.data_ptr() == p for t in TAGS for x, p in zip(self.tensors[t], self.ptrs[t]))
        check(f"{label} every tensor kept its address", same)

        for t in TAGS:
            if kind == "resume" and t in changing and not self.backup[t]:
                # No backup: undefined contents. Write new ones (this also shows it is usable).
                for x in self.tensors[t]:
                    fill_random(x)
                self.refs[t] = [x.cpu() for x in self.tensors[t]]
                self.defined[t] = True
        verified = [t for t in TAGS if self.active[t] and self.defined[t]]
        good = all(torch.equal(x.cpu(), r) for t in verified for x, r in zip(self.tensors[t], self.refs[t]))
        check(f"{label} contents intact", good, f"checked {verified}")


def main() -> None:
    _common.setup(__doc__)
    w = World()
    for tag in TAGS:
        print(f"{tag:<12} {len(w.tensors[tag])} tensors, {gib(w.nbytes[tag])}, backup: "
              f"{TAGS[tag][0].get('cpu_backup_backend', 'pinned') if w.backup[tag] else 'none'}")

    print("\n== interleaved: pause a, pause b, resume a, pause c, resume c, resume b")
    w.op("pause", "weights")
    w.op("pause", "kv_cache")
    w.op("resume", "weights")
    w.op("pause", "activations")
    w.op("resume", "activations")
    w.op("resume", "kv_cache")

    print("\n== everything at once, then back one by one")
    w.op("pause")
    w.op("resume", "kv_cache")
    w.op("resume", "activations")
    w.op("resume", "weights")

    print("\n== pausing a paused tag does nothing")
    w.op("pause", "activations")
    w.op("pause", "activations")
    w.op("resume", "activations")

    print("\n== resuming an active tag does nothing")
    w.op("resume", "weights")
    w.op("resume")

    print("\n== pause(None) with one tag already paused; resume(None)")
    w.op("pause", "kv_cache")
    w.op("pause")
    w.op("pause")
    w.op("resume")

    print()
    print(torch_memory_saver.summary())
    _common.finish()


if __name__ == "__main__":
    main()
