"""Elastic (chunked) allocations on a real GPU, in both hook modes: a KV-cache-like buffer of
32 GiB in 512 chunks of 64 MiB, with and without a CPU backup. Half of its chunks are paused
while a CUDA graph that reads only the other half keeps replaying, and another process uses
the memory they gave back (the device is filled first, so it fits only thanks to the pause);
the chunks then come back with their contents (with the backup) and the graph replays again.
Also: an allocation that does not fit the chunk size fails with our InvalidArgumentError."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("no CUDA device", allow_module_level=True)

from test_gpu import MODES, run  # noqa: E402

KV = """
import subprocess
BACKUP = {backup}
CHUNK = 64 << 20
N = 512
HALF = N // 2
TOTAL = N * CHUNK  # 32 GiB
torch.cuda.empty_cache()

# An allocation that is not a multiple of the chunk size: PyTorch's error becomes ours.
try:
    with tms.region(tag="misfit", chunk_size=CHUNK):
        torch.empty(CHUNK + (2 << 20), dtype=torch.uint8, device="cuda")
    raise SystemExit("an allocation that is not a multiple of the chunk size was made")
except tms_pkg.InvalidArgumentError as e:
    msg = str(e)
    assert str(CHUNK) in msg and str(CHUNK + (2 << 20)) in msg, msg
    assert isinstance(e.__cause__, RuntimeError), repr(e.__cause__)
    print("misfit:", type(e.__cause__).__name__, "->", msg[:200])

with tms.region(tag="kv", chunk_size=CHUNK, enable_cpu_backup=BACKUP):
    kv = torch.empty(TOTAL, dtype=torch.uint8, device="cuda")
assert tms.get_num_chunks("kv") == N == tms.get_num_chunks(kv)
assert tms.get_chunk_layout("kv") == [(i * CHUNK, CHUNK) for i in range(N)] == tms.get_chunk_layout(kv)
assert tms.get_chunk_states("kv") == [True] * N

# Chunk i holds the int32 value i + 1 throughout (a kernel writes it).
rows = kv.view(torch.int32).view(N, CHUNK // 4)
vals = torch.arange(1, N + 1, dtype=torch.int32, device="cuda")
rows.copy_(vals[:, None].expand(N, CHUNK // 4))

# A graph that reads only the first half of the chunks, into a tensor outside the region.
out = torch.zeros(HALF, dtype=torch.int64, device="cuda")
expected = vals[:HALF].to(torch.int64) * (CHUNK // 4)
first = rows[:HALF]
def step():
    out.copy_(first.sum(dim=1, dtype=torch.int64))
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    step()
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    step()
out.zero_()
g.replay()
torch.cuda.synchronize()
assert torch.equal(out, expected), "replay before the pause"

# Fill the device but 2 GiB (ordinary memory), so the other process fits only thanks to the pause.
filler = torch.empty(free() - 2 * GIB, dtype=torch.uint8, device="cuda")
f0 = free()
assert f0 < 12 * GIB, f0 / GIB
t0 = time.perf_counter()
if BACKUP:
    tms.pause_chunks("kv", range(HALF, N))
else:
    tms.pause_chunks(kv, range(HALF, N))
t_pause = time.perf_counter() - t0
gained = free() - f0
assert 0.99 * (TOTAL // 2) <= gained <= TOTAL // 2 + (512 << 20), gained / GIB
assert tms.get_chunk_states("kv") == [True] * HALF + [False] * HALF == tms.get_chunk_states(kv)
st = next(t for t in tms.stats()["tags"] if t["tag"] == "kv")
assert st["partial_allocations"] == 1 and st["bytes_paused"] == TOTAL // 2 and st["bytes_active"] == TOTAL // 2, st
if BACKUP:
    assert st["host_backup_bytes"] >= TOTAL // 2, st
summary = tms.summary()
print(summary)
assert "partial" in summary

# Another process takes 12 GiB of what the paused chunks gave back, writes it, and exits.
other_env = {{k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith(("TMS_", "TEST_"))}}
other = subprocess.run(
    [sys.executable, "-c",
     "import torch\\n"
     "x = torch.empty(12 << 30, dtype=torch.uint8, device='cuda')\\n"
     "x.fill_(7)\\n"
     "assert int(x[:: 1 << 20].sum()) == 7 * len(x[:: 1 << 20])\\n"
     "print('OTHER', torch.cuda.mem_get_info()[0])\\n"],
    env=other_env, capture_output=True, text=True, timeout=180,
)
assert other.returncode == 0 and "OTHER" in other.stdout, other.stdout + other.stderr[-3000:]
print("other process done;", other.stdout.strip())

# The graph replays while the second half is paused (it never touches it).
out.zero_()
g.replay()
torch.cuda.synchronize()
assert torch.equal(out, expected), "replay with the second half paused"

del filler
torch.cuda.empty_cache()
t0 = time.perf_counter()
if BACKUP:
    tms.resume_chunks("kv", range(HALF, N))
else:
    assert tms.resume_range(kv, HALF * CHUNK, TOTAL) == range(HALF, N)
t_resume = time.perf_counter() - t0
assert tms.get_chunk_states(kv) == [True] * N
mn, mx = rows.amin(dim=1), rows.amax(dim=1)
if BACKUP:
    assert torch.equal(mn, vals) and torch.equal(mx, vals), "every chunk back with its contents"
else:
    assert torch.equal(mn[:HALF], vals[:HALF]) and torch.equal(mx[:HALF], vals[:HALF]), "the first half untouched"
    rows[HALF:].fill_(-1)  # the resumed chunks are usable memory
    assert int(rows[HALF:].amax()) == -1 == int(rows[HALF:].amin())
st = next(t for t in tms.stats()["tags"] if t["tag"] == "kv")
assert st["partial_allocations"] == 0 and st["bytes_active"] == TOTAL, st
out.zero_()
g.replay()
torch.cuda.synchronize()
assert torch.equal(out, expected), "replay after the resume"
print(f"pause {{t_pause:.3f}} s, resume {{t_resume:.3f}} s of 16 GiB (backup={{BACKUP}})")
print("OK")
"""


@pytest.mark.parametrize("backup", [True, False], ids=["cpu-backup", "no-backup"])
@pytest.mark.parametrize("mode", MODES)
def test_kv_cache_chunks_pause_while_a_graph_replays(mode, backup):
    r = run(KV.format(backup=backup), mode, timeout=300)
    assert "OK" in r.stdout, r.stdout
