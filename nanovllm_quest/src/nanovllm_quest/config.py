"""Options of the ``quest`` policy; selection-string keys are checked against these fields."""

from __future__ import annotations

import attrs

GROUP_REDUCTIONS = ("max", "sum", "mass")
METADATA_DTYPES = ("auto", "kv", "fp8")


def _int_at_least(minimum: int):
    def check(_inst, attribute, value) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{attribute.name} must be an int >= {minimum}, got {value!r}")

    return check


def _one_of(choices: tuple[str, ...]):
    def check(_inst, attribute, value) -> None:
        if value not in choices:
            raise ValueError(f"{attribute.name} must be one of {', '.join(map(repr, choices))}, got {value!r}")

    return check


def _bool(_inst, attribute, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be true or false, got {value!r}")


@attrs.define(frozen=True)
class QuestConfig:
    """- ``token_budget``: history tokens each KV head attends to per decode step; the policy keeps
      ``token_budget // page_size`` pages (at least one page's worth is required).
    - ``skip_layers``: the first layers stay dense (the paper's 2: their attention is not sparse).
    - ``group_reduction``: how the bounds of a GQA group's query heads combine into the score of their
      shared KV head: ``max`` (a page matters if it matters to any head of the group), ``sum``, or
      ``mass``: each query head's softmax of its scaled bounds over the history pages, an estimate of the
      share of its attention each page holds, summed over the group, so every head counts for one whole
      attention distribution whatever the scale of its logits. With ``rescore``, ``max`` and ``sum`` rank
      the nominees by their keys' largest ``q . k``; ``mass`` by each head's exact attention share among
      the nominees (the softmax of its keys' scaled ``q . k``), summed over the group.
    - ``keep_sink``: always keep the first page (the attention sink) besides the newest one. On by
      default: on SmolLM2 it lowered Quest's perplexity at every budget measured (budget 1024: +3.9% of
      dense against +8.5% without it; 2048: +1.6% against +2.5%), for one ranked page less.
    - ``recent_pages``: the newest pages always kept (1: the page being written alone, the paper's). The
      recent past is where much of a decode query's attention goes, and the bound ranks it no better than
      any other page. Pages kept this way count against the budget, and never more of them than the
      budget holds besides the sink. Default 8 (128 tokens at pages of 16): on SmolLM2 it lowered the
      perplexity of the last 2,048 tokens at every budget measured, on two texts
      (:file:`benchmarks/results/README.md`).
    - ``page_size``: tokens of a Quest page, a multiple of the KV block size (default: one KV block, 16
      tokens with the engine's default blocks, the paper's page). The policy keeps one
      min/max per page and KV head, scores and ranks pages, and attends to the selected pages' blocks.
      Pages larger than a block read ``page_size / block_size`` times fewer metadata bytes and rank as
      many times fewer candidates, for a coarser selection. A page's bounds are kept at its first
      block; when the prefix cache shares that block between sequences whose later blocks differ, the
      bounds cover the keys of all of them: still an upper bound for each, only looser.
    - ``bound_size``: tokens under one min/max pair. A size below the page keeps ``page_size / bound_size``
      bounds a page, each over that many of its tokens, and a page scores the largest of them: a tighter
      upper bound, so a better ranking, for as many times the metadata that scoring reads. Selection,
      top-K and attention stay at whole pages. It needs pages of one KV block. Unset: half a page of one
      block when the bounds are float8 (two float8 bounds are as many bytes as the paper's one 16-bit
      bound), else the page (the paper's bound).
    - ``metadata_dtype``: ``auto`` (default) keeps the bounds in float8 e4m3 where Triton has it (CUDA GPUs
      of compute capability 8.9 or newer, and the CPU path), else in the KV cache's dtype; ``kv``: the KV
      cache's dtype (the paper's); ``fp8``: float8, refused at start on GPUs without it. Float8 minima round
      down and maxima up, so the bound still holds, only looser; a bound with a key channel past the
      format's range (+-448) is unbounded and its page always kept.

      So by default, on an H100, a page of 16 is scored by float8 bounds over its two halves. On an H100
      (llama-3.1-8b preset, budget 2048) that decodes within 0-4% of the paper's bfloat16 page bound: 1.54x
      dense at 128K batch 1 and 1.86x at 8 x 32K, against 1.54-1.57x and 1.86-1.93x. On SmolLM2 at budget 1024 it lowered the perplexity of the
      last 2,048 tokens from +2.6% of dense to +1.8% on the documentation text, and from +2.9% to +2.1% on
      the GPL-3 (:file:`benchmarks/results/README.md`). ``metadata_dtype=kv`` gives the paper's bound.
    - ``rescore``: the bound nominates ``rescore`` times the budget's pages, and the largest exact ``q . k``
      of each nominee's keys ranks them for the budget (1, the default: off, the paper's selection). It
      reads the nominees' keys, ``rescore x token_budget`` keys per KV head, besides the bounds; it needs
      pages of one KV block (with KV offload, only the nominees' keys cross PCIe). Where a text repeats
      itself, many pages have near-identical bounds that rank them alike, and the keys tell them apart
      (:file:`benchmarks/results/README.md`).
    - ``oracle``: an evaluation mode, slow, for quality measurements only: pages rank by their exact
      attention mass for the step's query (:func:`nanovllm_quest.reference.page_masses`, every history
      key read) instead of the bound, which tells what the bound costs from what the budget costs.
      Decode then runs eagerly (no CUDA graphs).
    """

    token_budget: int = attrs.field(default=2048, validator=_int_at_least(1))
    skip_layers: int = attrs.field(default=2, validator=_int_at_least(0))
    group_reduction: str = attrs.field(default="max", validator=_one_of(GROUP_REDUCTIONS))
    keep_sink: bool = attrs.field(default=True, validator=_bool)
    recent_pages: int = attrs.field(default=8, validator=_int_at_least(1))
    page_size: int | None = attrs.field(default=None, validator=attrs.validators.optional(_int_at_least(1)))
    bound_size: int | None = attrs.field(default=None, validator=attrs.validators.optional(_int_at_least(1)))
    metadata_dtype: str = attrs.field(default="auto", validator=_one_of(METADATA_DTYPES))
    rescore: int = attrs.field(default=1, validator=_int_at_least(1))
    oracle: bool = attrs.field(default=False, validator=_bool)

    def __attrs_post_init__(self) -> None:
        if self.oracle and self.rescore > 1:
            raise ValueError("oracle=true ranks every page by its exact attention mass, so rescore has "
                             "nothing to refine; use one of them")
