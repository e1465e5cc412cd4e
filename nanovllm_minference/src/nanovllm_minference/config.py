"""Options of the ``minference`` policy; selection-string keys are checked against these fields."""

from __future__ import annotations

import attrs

PATTERNS = ("vertical_slash", "a_shape", "block_sparse")
SLASH_UNITS = ("diagonal", "tile")


def _int_at_least(minimum: int):
    def check(_inst, attribute, value) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{attribute.name} must be an int >= {minimum}, got {value!r}")

    return check


def _fraction_or_none(_inst, attribute, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{attribute.name} must be a fraction in (0, 1] of the context, or null; got {value!r}")


def _positive_or_none(_inst, attribute, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{attribute.name} must be a share of dense work above 0, e.g. 0.8, or null; "
                         f"got {value!r}")


def _pattern(_inst, attribute, value) -> None:
    if value not in PATTERNS:
        raise ValueError(f"{attribute.name} must be one of {', '.join(map(repr, PATTERNS))}, got {value!r}")


def _slash_unit(_inst, attribute, value) -> None:
    if value not in SLASH_UNITS:
        raise ValueError(f"{attribute.name} must be one of {', '.join(map(repr, SLASH_UNITS))}, got {value!r}")


def _path_or_none(_inst, attribute, value) -> None:
    if value is not None and not (isinstance(value, str) and value):
        raise ValueError(f"{attribute.name} must be the path of a JSON file of per-head patterns, got {value!r}")


@attrs.define(frozen=True)
class MInferenceConfig:
    """- ``pattern``: every head's pattern when ``config_path`` is not given. ``vertical_slash`` (estimated
      per chunk from its last ``last_q`` queries), ``a_shape`` (the first ``n_init`` keys and the last
      ``n_local``), ``block_sparse`` (the ``top_k_blocks`` key tiles of 64 whose mean key scores highest
      against the query tile's mean query).
    - ``last_q``: the queries at the end of each chunk whose attention the vertical-slash estimate reads.
    - ``n_init`` / ``n_local``: A-shape's first keys and nearest keys.
    - ``top_k_blocks``: block-sparse's key tiles of 64 kept per query tile.
    - ``vertical_size`` / ``slash_size``: columns and diagonals each head keeps (MInference's defaults).
    - ``adaptive_budget``: instead, keep this fraction of each sequence's context, 20% as columns and
      80% as diagonals (the seed fork's rule).
    - ``slash_unit``: how the diagonals are chosen. ``tile``: the diagonal bands of one key tile of 64
      whose diagonals score highest (each diagonal weighted by the share of a query tile's rows it leads
      into the band), ``slash_size / 64`` of them, so the kernel reads about ``slash_size`` keys a row.
      ``diagonal`` (MInference's own rule): the ``slash_size`` best diagonals, each read in the one or two
      key tiles it crosses, so scattered diagonals cost up to 128 keys a row each and the work can approach
      dense attention's. Applies to layers whose heads are all vertical-slash.
    - ``num_sink_tokens`` / ``num_recent_diags``: always-kept first columns and nearest diagonals; they
      count within the budgets.
    - ``config_path``: per-layer, per-head patterns in the JSON format of MInference's published model
      configs; a head it omits gets ``vertical_slash`` (1000, 6096).
    - ``skip_layers``: the first layers run dense.
    - ``dense_below``: chunks whose sequences all hold fewer tokens than this run dense, where estimation
      and tiles cost more than they save (the first 16K tokens of a prompt; pass 0 to run the sparse path
      at any length, for quality evaluations on short prompts). Independently, a chunk runs dense when its
      budget alone names more than ``dense_above`` of the keys its rows see.
    - ``dense_above``: a chunk whose index would compute more than this share of dense causal attention
      runs the dense kernel instead (``null``: never). A tile of the sparse kernel costs more than one of
      the dense kernel, so a nearly dense index is faster run dense; a model whose attention is not sparse
      then pays only the estimate.
    """

    pattern: str = attrs.field(default="vertical_slash", validator=_pattern)
    vertical_size: int = attrs.field(default=1000, validator=_int_at_least(1))
    slash_size: int = attrs.field(default=6096, validator=_int_at_least(1))
    adaptive_budget: float | None = attrs.field(default=None, validator=_fraction_or_none)
    slash_unit: str = attrs.field(default="tile", validator=_slash_unit)
    num_sink_tokens: int = attrs.field(default=30, validator=_int_at_least(0))
    num_recent_diags: int = attrs.field(default=100, validator=_int_at_least(1))
    last_q: int = attrs.field(default=64, validator=_int_at_least(1))
    n_init: int = attrs.field(default=128, validator=_int_at_least(0))
    n_local: int = attrs.field(default=3968, validator=_int_at_least(1))
    top_k_blocks: int = attrs.field(default=100, validator=_int_at_least(1))
    config_path: str | None = attrs.field(default=None, validator=_path_or_none)
    skip_layers: int = attrs.field(default=0, validator=_int_at_least(0))
    dense_below: int = attrs.field(default=16384, validator=_int_at_least(0))
    dense_above: float | None = attrs.field(default=0.8, validator=_positive_or_none)
