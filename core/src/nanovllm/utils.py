"""Small helpers for scripts and long jobs: vLLM's ``FlexibleArgumentParser`` and progress bars with an estimate.

Imports no torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that takes long flags spelled with underscores as with dashes
    (``--max_model_len 512`` is ``--max-model-len 512``), as vLLM's does."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        args = sys.argv[1:] if args is None else list(args)
        end = args.index("--") if "--" in args else len(args)  # after "--" every argument is positional
        return super().parse_known_args([*map(_dashed, args[:end]), *args[end:]], namespace)


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    flag, equals, value = arg.partition("=")
    return flag.replace("_", "-") + equals + value


def progress_bar(total: int | None, desc: str, unit: str = "it", enabled: bool | None = None, **kwargs: Any):
    """A tqdm bar on stderr with the count, elapsed time, rate and estimated time left. ``enabled``: True or
    False to force it; None (the default) shows it only when stderr is a terminal, so logs and pipes stay
    clean (``TQDM_DISABLE=1`` turns every bar off). A bar opened inside another one is removed when done."""
    from tqdm.auto import tqdm

    if enabled is None:  # tqdm reads TQDM_DISABLE only where no disable= is passed, so it is read here
        enabled = sys.stderr.isatty() and os.environ.get("TQDM_DISABLE", "").lower() in ("", "0", "false")
    options = {"file": sys.stderr, "disable": not enabled, "dynamic_ncols": True, "leave": None, **kwargs}
    return tqdm(total=total, desc=desc, unit=unit, **options)


class JobClock:
    """Progress of a run of ``total`` jobs, a line per job: ``[job 3/5, 06:24 elapsed, about 06:24 left]``,
    the estimate from the mean time of the jobs done. For runs whose jobs write bars of their own (each
    in its own process), where one bar over the jobs would be torn by theirs."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.start = total, 0, time.monotonic()

    def status(self) -> str:
        """The status before the next job starts (and counts it)."""
        from tqdm import tqdm

        self.done += 1
        elapsed = time.monotonic() - self.start
        parts = [f"job {self.done}/{self.total}", f"{tqdm.format_interval(elapsed)} elapsed"]
        if self.done > 1:
            left = elapsed / (self.done - 1) * (self.total - self.done + 1)
            parts.append(f"about {tqdm.format_interval(left)} left")
        return "[" + ", ".join(parts) + "]"
