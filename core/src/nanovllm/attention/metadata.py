"""Per-step attention metadata, and the forward context that carries it to the attention layers.

The forward context is module-level state with exactly one writer: the model runner sets it before
each forward pass and clears it after. Attention layers only read it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import torch


@attrs.define(frozen=True, slots=True)
class PhaseMetadata:
    """The sequences of one phase (prefill chunks or decodes) in a step, as device tensors.

    Sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``; after this step its KV
    covers positions ``[0, context_lens[s])``, the last ``q_len`` of them being the new tokens.

    ``query_lens_host`` / ``context_lens_host``: the same lengths as host ints, so that code which needs
    them in Python reads no device value (a host sync on the GPU). The engine gives them with every
    prefill phase; they are ``None`` where no host copy exists, always in metadata a CUDA graph captures
    (a replay brings new lengths the copies would not follow).
    """

    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32, history + new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with -1
    max_query_len: int
    max_context_len: int
    query_lens_host: tuple[int, ...] | None = None  # [num_seqs] new tokens, None: no host copy
    context_lens_host: tuple[int, ...] | None = None  # [num_seqs] history + new tokens, None: no host copy

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def query_lens(self) -> torch.Tensor:
        return self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]

    @property
    def host_lens(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """``(query_lens_host, context_lens_host)``, or None without host copies: the form the policies'
        functions take, each reading the tensors back only when given None."""
        if self.query_lens_host is None or self.context_lens_host is None:
            return None
        return self.query_lens_host, self.context_lens_host


@attrs.define(frozen=True, slots=True)
class StepMetadata:
    """One forward pass: decode tokens come first (one per sequence), then the prefill chunks."""

    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each new token, -1 to skip
    positions: torch.Tensor  # [num_tokens] int64 position of each new token in its sequence
    num_decode_tokens: int
    decode: PhaseMetadata | None
    prefill: PhaseMetadata | None
    # with several KV cache groups (hybrid KV, see nanovllm.kv.groups): the step as the layers of groups 1, 2,
    # ... see it, their own slots and block tables (this object is group 0's); empty with one group
    other_groups: tuple[StepMetadata, ...] = ()

    def of_group(self, group: int) -> StepMetadata:
        """The step as the layers of KV cache group ``group`` see it."""
        return self if group == 0 else self.other_groups[group - 1]


def aligned_rows(rows: int, row_bytes: int) -> int:
    """The fewest rows, at least ``rows``, whose bytes are a multiple of 16: every KV cache group's part of a
    buffer stacked ``[groups, rows, ...]`` then starts 16-byte aligned, as a tensor allocated alone does
    (Triton compiles a kernel again for a pointer that is not)."""
    while rows * row_bytes % 16:
        rows += 1
    return rows


_context: StepMetadata | None = None


def get_forward_context() -> StepMetadata:
    if _context is None:
        raise RuntimeError("attention layers run only inside the model runner's forward pass")
    return _context


@contextmanager
def forward_context(meta: StepMetadata) -> Iterator[None]:
    """Set by the model runner (the only writer) around one forward pass."""
    global _context
    _context = meta
    try:
        yield
    finally:
        _context = None
