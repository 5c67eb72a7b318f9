"""scripts/gpu/bench_ab.py, the GPU suite's A/B of two tms-bench builds, on stand-in benchmarks
that print fixed rows: how it judges, and what it refuses before spending the machine's time."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu" / "bench_ab.py"


def fake_bench(tmp_path: Path, name: str, seconds: list) -> str:
    """A stand-in for tms-bench printing one row, ``seconds[k]`` on its k-th run (counted in a
    file beside it)."""
    path = tmp_path / name
    count = tmp_path / f"{name}.runs"
    path.write_text(
        f"#!{sys.executable}\n"
        "import pathlib\n"
        f"c = pathlib.Path({str(count)!r})\n"
        "k = int(c.read_text()) if c.exists() else 0\n"
        "c.write_text(str(k + 1))\n"
        f"t = {seconds!r}[k]\n"
        "print(f'  pinned-64: first pause (fresh host memory)   {t:.4f} s   {4 / t:.2f} GiB/s')\n"
    )
    path.chmod(0o755)
    return str(path)


def ab(tmp_path: Path, old: list, new: list, rounds: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_AB_")}
    env["TMS_AB_ROUNDS"] = rounds
    return subprocess.run(
        [sys.executable, str(SCRIPT), fake_bench(tmp_path, "old", old), fake_bench(tmp_path, "new", new)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_one_round_is_refused_before_anything_runs(tmp_path):
    # One round has no spread between a side's rounds: every row a little slower by chance
    # would be flagged. Refused, and neither benchmark run.
    for rounds in ("1", "0", "two", ""):
        r = ab(tmp_path, [0.15], [0.16], rounds)
        assert r.returncode == 2, (rounds, r.stdout, r.stderr)
        assert "at least 2" in r.stderr and "one round has none" in r.stderr, r.stderr
        assert not (tmp_path / "old.runs").exists() and not (tmp_path / "new.runs").exists()


def test_a_row_slower_beyond_the_noise_fails_and_one_within_it_passes(tmp_path):
    slower = ab(tmp_path, [0.150, 0.152], [0.190, 0.193], "2")
    assert slower.returncode == 1, slower.stdout
    assert "BENCH A/B FAIL: 2 rounds each; 1 rows slower beyond noise" in slower.stdout, slower.stdout
    for f in tmp_path.glob("*.runs"):
        f.unlink()
    # The new side's best (0.146) is faster; its spread (0.146 to 0.175) is the noise.
    noisy = ab(tmp_path, [0.150, 0.152], [0.175, 0.146], "2")
    assert noisy.returncode == 0, noisy.stdout
    assert "BENCH A/B PASS: 2 rounds each; 0 rows slower beyond noise" in noisy.stdout, noisy.stdout
