"""Options of the ``xattn`` policy; selection-string keys are checked against these fields."""

from __future__ import annotations

import attrs

HEAD_REDUCTIONS = ("mean", "max", "union", "majority", "global_majority", "none")
ORACLES = ("mass", "counts")


def _int_at_least(minimum: int):
    def check(_inst, attribute, value) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{attribute.name} must be an int >= {minimum}, got {value!r}")

    return check


def _power_of_two(minimum: int, maximum: int):
    def check(_inst, attribute, value) -> None:
        ok = isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum
        if not ok or value & (value - 1):
            raise ValueError(f"{attribute.name} must be a power of two from {minimum} to {maximum}, got {value!r}")

    return check


def _fraction(allow_none: bool):
    def check(_inst, attribute, value) -> None:
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"{attribute.name} must be a fraction in (0, 1], got {value!r}")

    return check


def _bool(_inst, attribute, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be true or false, got {value!r}")


def _head_reduce(_inst, attribute, value) -> None:
    if value not in HEAD_REDUCTIONS:
        raise ValueError(f"{attribute.name} must be one of {', '.join(map(repr, HEAD_REDUCTIONS))}, got {value!r}")


def _oracle(_inst, attribute, value) -> None:
    if value is not None and value not in ORACLES:
        choices = ", ".join(map(repr, ORACLES))
        raise ValueError(f"{attribute.name} must be null or one of {choices}, got {value!r}")


def _path_or_none(_inst, attribute, value) -> None:
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError(f"{attribute.name} must be the path of a JSON file of per-layer, per-head thresholds, "
                         f"got {value!r}")


@attrs.define(frozen=True)
class XAttentionConfig:
    """- ``threshold``: each query-block row keeps the fewest key blocks whose estimated attention mass
      reaches this fraction of the row's (1.0 keeps every block: exactly dense).
    - ``ratio``: instead of the threshold, keep this fraction of each row's causal blocks, best first
      (the paper's "ratio" ablation; a fixed density, for speed measurements).
    - ``stride``: the antidiagonal stride S (it divides ``block_size``: both are powers of two); the
      estimate costs about 1/S of q.k^T per pass.
    - ``block_size``: the tokens of a block (query and key); a multiple of the KV cache block size.
    - ``keep_sink`` / ``keep_recent``: always keep key block 0 / the diagonal block (they count within
      the threshold). ``recent_blocks``: with ``keep_recent``, the blocks ending at the diagonal kept
      (1: the diagonal alone, the paper's; 2 adds the block before, the local context of a block's first
      rows).
    - ``dense_last_rows``: the last query-block rows of each sequence's chunk that read every causal
      block (1: the block holding the last query; 0: none), whatever ``estimate_chunk`` does. A row's score sums its block's queries, so a few late queries that attend far
      back, such as a question at the prompt's end whose answer is the first sampled token, weigh too
      little in their row to pass the threshold; these rows cost one row of dense work per chunk.
    - ``head_reduce``: how the query heads of a GQA group share one selection per KV head: ``mean`` of
      their block scores (the default), ``max``, the ``union`` or the
      ``majority`` of their own selections; ``global_majority`` keeps what most of all the layer's
      heads select, for every head (the seed fork's vote, for comparison); ``none`` selects per query
      head.
    - ``estimate_chunk``: query tokens scored per estimate launch, which bounds the scores' memory.
    - ``threshold_path``: a JSON list (layers) of lists (query heads) of thresholds; a reduction over a
      group uses the largest threshold of its heads.
    - ``skip_layers``: the first layers run dense.
    - ``dense_below``: chunks whose sequences all hold fewer tokens than this run dense.
    - ``oracle``: an evaluation mode (:mod:`nanovllm_xattn.oracle`) that computes every query's full
      attention scores, slowly: ``"mass"`` selects by the exact block masses instead of the estimate,
      ``"counts"`` keeps as many blocks per row as the estimate's selection, those with the most true mass.
    """

    threshold: float = attrs.field(default=0.9, validator=_fraction(False))
    ratio: float | None = attrs.field(default=None, validator=_fraction(True))
    stride: int = attrs.field(default=8, validator=_power_of_two(2, 64))
    block_size: int = attrs.field(default=128, validator=_power_of_two(64, 512))
    keep_sink: bool = attrs.field(default=True, validator=_bool)
    keep_recent: bool = attrs.field(default=True, validator=_bool)
    recent_blocks: int = attrs.field(default=1, validator=_int_at_least(1))
    dense_last_rows: int = attrs.field(default=1, validator=_int_at_least(0))
    head_reduce: str = attrs.field(default="mean", validator=_head_reduce)
    estimate_chunk: int = attrs.field(default=16384, validator=_int_at_least(1))
    threshold_path: str | None = attrs.field(default=None, validator=_path_or_none)
    skip_layers: int = attrs.field(default=0, validator=_int_at_least(0))
    dense_below: int = attrs.field(default=16384, validator=_int_at_least(0))
    oracle: str | None = attrs.field(default=None, validator=_oracle)
