"""The options of ``attention_backend="flash_attn:key=value"`` (attrs only: loading it imports no torch)."""

from __future__ import annotations

import attrs

DECODE_CHOICES = ("auto", "fa4", "triton")


@attrs.define(frozen=True)
class FlashAttnConfig:
    """``decode``: which kernel runs paged decode.

    - ``"auto"`` (default): the Triton backend's split-KV decode, except with a soft-cap, which only FA4
      applies. FA4 has no split-KV on SM 9.x: a small batch over a long context leaves most SMs idle, and
      at full batches the peer table (``nanovllm bench kernels``) still has it behind the Triton kernel.
    - ``"fa4"``: FA4 at every batch size; ``"triton"``: the Triton backend's decode (a soft-capped call
      still runs FA4).
    """

    decode: str = attrs.field(default="auto", validator=attrs.validators.in_(DECODE_CHOICES))
