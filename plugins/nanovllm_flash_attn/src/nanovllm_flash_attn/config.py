"""The options of ``attention_backend="flash_attn:key=value"`` (attrs only: loading it imports no torch)."""

from __future__ import annotations

import attrs

DECODE_CHOICES = ("auto", "fa4", "triton")


@attrs.define(frozen=True)
class FlashAttnConfig:
    """``decode``: which kernel runs paged decode.

    - ``"auto"`` (default): FA4 when its pages load by TMA (blocks of 128 at head dims up to 128) and the
      batch's ``num_seqs * num_kv_heads`` query tiles fill every SM of the GPU several times over, else the
      Triton backend's split-KV decode (:func:`nanovllm_flash_attn.dispatch.decode_on_fa4` says why). FA4
      has no split-KV on SM 9.x, so a small batch over a long context would leave most SMs idle.
    - ``"fa4"``: FA4 at every batch size; ``"triton"``: the Triton backend's decode at every batch size.
    """

    decode: str = attrs.field(default="auto", validator=attrs.validators.in_(DECODE_CHOICES))
