"""Options of the ``quest`` policy; selection-string keys are checked against these fields."""

from __future__ import annotations

import attrs

GROUP_REDUCTIONS = ("max", "sum", "mass")
DEFAULT_RESCORE = 3  # with pages of one KV block, when ``rescore`` is unset
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
    """Options of the ``quest`` decode policy (selection string keys of the same names).

    - ``token_budget`` (default 2048): history tokens each KV head attends to per decode step; the policy
      keeps ``token_budget // page_size`` pages, and at least one page's worth is required. A budget that
      covers a step's whole block table runs that step dense, with exactly dense results.
    - ``skip_layers`` (default 2, the paper's): the first layers stay dense.
    - ``group_reduction`` (default ``mass``): how the query heads of a GQA group combine into the score of
      their shared KV head's pages. ``mass``: each query head's softmax of its bounds times the attention
      scale over the history pages (an estimate of the share of its attention each page holds), summed
      over the group, so every head counts for one whole attention distribution whatever the scale of its
      logits; ``max`` (the paper's): a page's largest bound among the heads (it matters if it matters to
      any head); ``sum``: the sum of the heads' bounds. With one query head per KV head all three rank
      alike.
    - ``keep_sink`` (default true): always keep the first page (the attention sink), for one ranked page
      less.
    - ``recent_pages`` (default 8, 128 tokens at pages of 16): the newest pages always kept (1: the page
      being written alone, the paper's). They count against the budget, and never more of them are kept
      than the budget holds besides the sink.
    - ``page_size`` (default: one KV block, 16 tokens with the engine's default blocks, the paper's page):
      tokens of a Quest page, a multiple of the KV block size. The policy keeps one min/max per page and
      KV head, scores and ranks pages, and attends to the selected pages' blocks. A page of ``n`` blocks
      reads ``n`` times fewer metadata bytes and ranks ``n`` times fewer candidates, for a coarser
      selection. A page's bounds are kept at its first block; when the prefix cache shares that block
      between sequences whose later blocks differ, the bounds cover the keys of all of them: still an
      upper bound for each, only looser.
    - ``bound_size`` (tokens under one min/max pair): a size below the page keeps ``page_size /
      bound_size`` bounds a page, each over that many of its tokens, and a page scores the largest of
      them: a tighter upper bound, for as many times the metadata that scoring reads. Selection, top-K
      and attention stay at whole pages. It needs pages of one KV block. Default: half a page of one block
      when the bounds are float8 (two float8 bounds take the bytes of one 16-bit bound), else the page.
    - ``metadata_dtype`` (default ``auto``): the bounds' dtype. ``auto``: float8 e4m3 where Triton has it
      (CUDA GPUs of compute capability 8.9 or newer, and the CPU path), else the KV cache's dtype;
      ``kv``: the KV cache's dtype (the paper's); ``fp8``: float8, refused at start on GPUs without it.
      Float8 minima round down and maxima up, so the bound still holds, only looser; a bound with a key
      channel past the format's range (+-448) is unbounded and its page always kept.
    - ``rescore``: above 1 the bound nominates ``rescore`` times the budget's pages and their keys rank
      them for the budget: with ``max`` and ``sum``, each head's largest ``q . k`` of the page's keys (the
      bound taken over one key), combined as above; with ``mass``, each head's exact attention share among
      the nominees (the softmax of its keys' scaled ``q . k``), summed over the group. 1: off (the paper's
      selection, by the bound alone). It reads ``rescore x token_budget`` keys per KV head besides the
      bounds (with KV offload only those keys cross PCIe) and needs pages of one KV block. Default (unset):
      3 with pages of one KV block, 1 with larger pages and with ``oracle``.
    - ``oracle`` (default false): an evaluation mode, slow, for quality measurements only: pages rank by
      their exact attention mass for the step's query (:func:`nanovllm_quest.reference.page_masses`,
      every history key read) instead of the bound, which tells what the bound costs from what the budget
      costs. Decode then runs eagerly (no CUDA graphs).
    """

    token_budget: int = attrs.field(default=2048, validator=_int_at_least(1))
    skip_layers: int = attrs.field(default=2, validator=_int_at_least(0))
    group_reduction: str = attrs.field(default="mass", validator=_one_of(GROUP_REDUCTIONS))
    keep_sink: bool = attrs.field(default=True, validator=_bool)
    recent_pages: int = attrs.field(default=8, validator=_int_at_least(1))
    page_size: int | None = attrs.field(default=None, validator=attrs.validators.optional(_int_at_least(1)))
    bound_size: int | None = attrs.field(default=None, validator=attrs.validators.optional(_int_at_least(1)))
    metadata_dtype: str = attrs.field(default="auto", validator=_one_of(METADATA_DTYPES))
    rescore: int | None = attrs.field(default=None, validator=attrs.validators.optional(_int_at_least(1)))
    oracle: bool = attrs.field(default=False, validator=_bool)

    def __attrs_post_init__(self) -> None:
        if self.oracle and (self.rescore or 1) > 1:
            raise ValueError("oracle=true ranks every page by its exact attention mass, so rescore has "
                             "nothing to refine; use one of them")

    def rescore_factor(self, page_size: int, block_size: int) -> int:
        """The ``rescore`` in effect with pages of ``page_size`` tokens and KV blocks of ``block_size``: the
        option, or when unset :data:`DEFAULT_RESCORE` with pages of one block (1 with larger pages and with
        ``oracle``)."""
        if self.rescore is not None:
            return self.rescore
        return DEFAULT_RESCORE if page_size == block_size and not self.oracle else 1
