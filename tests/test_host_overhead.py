"""``benchmarks/host_overhead.py`` on tiny chunks: its steps, the split of each step around the forward, and
the two profiles, which must not mix."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load():
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("benchmark_host_overhead", BENCHMARKS / "host_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_steps_split_around_the_forward_and_profiles_stay_apart(capsys):
    bench = load()
    small, big = bench.main(["--chunk", "32", "--small-chunk", "16", "--chunks", "3", "--window", "16",
                             "--repeats", "1", "--profile", "--top", "400"])
    for row, chunk in ((small, 16), (big, 32)):
        assert row["chunk"] == chunk
        assert row["steps"] == row["profiled"] == 3  # one step a chunk; the read-back step runs no forward
        assert 0 < row["forward_us"] < row["step_us"] and row["outside_us"] > 0
        inside = {where.rsplit(" ", 1)[-1]: calls for where, calls, _, _ in
                  bench.profile_rows(row["inside"], row["profiled"] * bench.LAYERS, 400)}
        outside = {where.rsplit(" ", 1)[-1] for where, *_ in bench.profile_rows(row["outside"], 3, 400)}
        assert inside["_prefill"] == 1  # every layer's attention, once a layer, and only inside
        assert "_prefill" not in outside and "schedule" in outside and "schedule" not in inside
        assert row["ops"]["linear"] == 4  # qkv, o, gate_up, down: a layer's projections
    assert "| 32 | 3 |" in capsys.readouterr().out
