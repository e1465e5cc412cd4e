"""What the benchmark scripts share: each job in its own Python process, and the results files.

A script's ``main`` lists its jobs and calls :func:`run_jobs`, which runs ``python SCRIPT --job JOB`` for each
(one engine's GPU memory never shrinks the next one's KV cache), then writes ``NAME.json`` and ``NAME.md``
after every job, so that a run cut short keeps what it measured, and ``NAME.png`` at the end. Not a script.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nanovllm.bench import environment, run_job_in_subprocess
from nanovllm.utils import JobClock


def jobs_of_kinds(jobs: list[dict], kinds: list[str] | None) -> list[dict]:
    """The jobs whose kind is one of ``kinds`` (all when None, as for ``--only`` left out); a kind also
    brings the jobs it names before a hyphen (``offload`` brings ``offload-copy``)."""
    return [job for job in jobs if not kinds or job["kind"].partition("-")[0] in kinds]


def run_jobs(jobs: list[dict], script: str, out: Path, name: str, settings: dict[str, Any],
             finish: Callable[[list[dict]], list[dict]], markdown: Callable[[dict, str], str],
             chart: Callable[[dict, Path], None]) -> int:
    """Each job through ``python SCRIPT --job JOB``; ``finish`` adds what needs several jobs' rows (ratios)
    before every write. Returns 1 if a job failed, else 0."""
    env, results, payload = environment(), [], {}
    out.mkdir(parents=True, exist_ok=True)
    clock = JobClock(len(jobs))
    for job in jobs:
        print(f"== {clock.status()} {job}", file=sys.stderr, flush=True)
        results += run_job_in_subprocess(job, (script, "--job"))
        payload = {"environment": env, "settings": settings, "results": finish(results)}
        (out / f"{name}.json").write_text(json.dumps(payload, indent=1))
        (out / f"{name}.md").write_text(markdown(payload, name))
    if payload:
        try:
            chart(payload, out / f"{name}.png")
        except ImportError:
            print("matplotlib is not installed: no chart", file=sys.stderr)
        print((out / f"{name}.md").read_text())
    return 1 if any("error" in r for r in results) else 0


def job_main(run_job: Callable[[dict], list[dict]], job: str) -> int:
    """The ``--job JOB`` branch of a script: run one job here, its rows as JSON on the last line of stdout."""
    rows = run_job(json.loads(job))
    sys.stdout.flush()
    print(json.dumps(rows), flush=True)
    return 0
