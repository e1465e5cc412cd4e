"""The kernel tests' interpreter runs started ahead: a test gets the run's own result, and the session's end
kills a run still under way."""

from __future__ import annotations

import time

from nanovllm import testing

CASES = """
import os, time


def test_interp_sees_the_interpreter():
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_interp_second():
    time.sleep(float(os.environ.get("SLEEP", "0")))


def test_not_selected():
    raise AssertionError("only the keyword's cases run")
"""


def test_a_run_started_ahead_gives_what_a_run_now_gives(tmp_path):
    cases = tmp_path / "test_cases.py"
    cases.write_text(CASES)
    now = testing.run_under_interpreter(cases)
    runs = testing.InterpreterRuns()
    runs.start([cases])
    ahead = runs.take(cases).result()
    assert now[0] == ahead[0] == 0 and now[2] == ahead[2] == 2, (now, ahead)
    assert runs.take(cases) is None  # taken once
    runs.stop()


def test_stopping_kills_the_run_under_way(tmp_path, monkeypatch):
    cases = tmp_path / "test_cases.py"
    cases.write_text(CASES)
    monkeypatch.setenv("SLEEP", "60")
    runs = testing.InterpreterRuns()
    runs.start([cases, tmp_path / "test_never.py"])
    deadline = time.monotonic() + 30
    while not runs.processes and time.monotonic() < deadline:
        time.sleep(0.05)
    (process,) = runs.processes
    queued = runs.futures[((tmp_path / "test_never.py").resolve(), "interp")]
    start = time.monotonic()
    runs.stop()
    process.wait(timeout=10)
    assert time.monotonic() - start < 10 and process.returncode != 0
    assert queued.cancelled()  # never begun
