"""Which attention backend measured fastest, per GPU family, phase and shape: the data that
``attention_backend="auto"`` orders its candidates by (:func:`nanovllm.engine.model_loading.make_backend`).

A family's entries come from one run of the peer table (``nanovllm bench kernels``), each backend measured
through its own ``prefill`` and ``decode``; :attr:`MeasuredFamily.results` names the results file, which
records the device, date, commit and every row. An entry lists the backends within :data:`TIE` of the
fastest at that shape, fastest first (a backend that hands a shape to another backend's kernel ties with
it there). Families without entries (the CPU, GPUs not measured) keep the fallback order.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

TIE = 0.02  # within 2% of the fastest counts as fastest: the noise between runs of one kernel is larger


@attrs.frozen
class MeasuredFamily:
    """One GPU family's measured entries: ``(phase, shape) -> backends fastest first`` and their run."""

    results: str  # the results file in the repository, e.g. "benchmarks/results/h200_kernel_peers.json"
    fastest: Mapping[tuple[str, str], tuple[str, ...]]

    def ranking(self) -> tuple[str, ...]:
        """The backends by the number of shapes where they are among the fastest, most first (ties: the one
        named first in the table)."""
        wins: dict[str, int] = {}
        for names in self.fastest.values():
            for name in names:
                wins[name] = wins.get(name, 0) + 1
        return tuple(sorted(wins, key=lambda name: -wins[name]))

    def wins(self, backend: str) -> int:
        """The number of measured shapes where ``backend`` is among the fastest."""
        return sum(backend in names for names in self.fastest.values())


MEASURED: dict[str, MeasuredFamily] = {
    "sm_90": MeasuredFamily(
        results="benchmarks/results/h200_kernel_peers.json",
        fastest={
            ("prefill", "4K"): ("flash_attn",),
            ("prefill", "1K over 4K, blocks of 16"): ("flash_attn",),
            ("prefill", "1K over 4K, blocks of 128"): ("flash_attn",),
            ("prefill", "16K"): ("flash_attn",),
            ("prefill", "4K over 16K, blocks of 16"): ("flash_attn",),
            ("prefill", "4K over 16K, blocks of 128"): ("flash_attn",),
            ("prefill", "128K"): ("flash_attn",),
            ("prefill", "4K over 128K, blocks of 16"): ("flash_attn",),
            ("prefill", "4K over 128K, blocks of 128"): ("flash_attn",),
            ("decode", "batch 1 at 4K, blocks of 16"): ("triton", "flash_attn"),
            ("decode", "batch 1 at 4K, blocks of 128"): ("flash_attn", "triton"),
            ("decode", "batch 1 at 16K, blocks of 16"): ("flash_attn", "triton"),
            ("decode", "batch 1 at 16K, blocks of 128"): ("triton", "flash_attn"),
            ("decode", "batch 1 at 128K, blocks of 16"): ("triton", "flash_attn"),
            ("decode", "batch 1 at 128K, blocks of 128"): ("triton", "flash_attn"),
            ("decode", "batch 8 at 4K, blocks of 16"): ("flash_attn", "triton"),
            ("decode", "batch 8 at 4K, blocks of 128"): ("flash_attn", "triton"),
            ("decode", "batch 8 at 16K, blocks of 16"): ("flash_attn", "triton"),
            ("decode", "batch 8 at 16K, blocks of 128"): ("flash_attn", "triton"),
            ("decode", "batch 8 at 128K, blocks of 16"): ("triton", "flash_attn"),
            ("decode", "batch 8 at 128K, blocks of 128"): ("triton", "flash_attn"),
            ("decode", "batch 64 at 4K, blocks of 16"): ("flash_attn", "triton"),
            ("decode", "batch 64 at 4K, blocks of 128"): ("triton", "flash_attn"),
            ("decode", "batch 64 at 16K, blocks of 16"): ("triton", "flash_attn"),
            ("decode", "batch 64 at 16K, blocks of 128"): ("triton", "flash_attn"),
            ("decode", "batch 64 at 128K, blocks of 16"): ("triton", "flash_attn"),
            ("decode", "batch 64 at 128K, blocks of 128"): ("flash_attn", "triton"),
        },
    ),
}

def device_family(major: int, minor: int) -> str:
    """The family key of a CUDA device of compute capability ``major.minor``: ``"sm_90"`` for 9.0."""
    return f"sm_{major}{minor}"


def fastest(values: Mapping[str, float]) -> tuple[str, ...]:
    """The backends of ``values`` (name -> speed, higher is faster) within :data:`TIE` of the fastest,
    fastest first: what an entry of :data:`MEASURED` holds."""
    if not values:
        return ()
    best = max(values.values())
    return tuple(sorted((n for n, v in values.items() if v >= (1 - TIE) * best), key=lambda n: -values[n]))
