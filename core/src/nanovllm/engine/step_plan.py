"""One step's plan on the host: what every tensor-parallel rank needs to run the same forward pass and the
same logits collectives. Rank 0's model runner makes it from the scheduled sequences
(:meth:`~nanovllm.engine.model_runner.ModelRunner.prepare`) and broadcasts it."""

from __future__ import annotations

import attrs
import numpy as np

from nanovllm.engine.sequence import Sequence


@attrs.define
class PhaseArrays:
    """A :class:`PhaseMetadata` on the host."""

    cu_seqlens_q: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    max_query_len: int
    max_context_len: int


@attrs.define
class GroupArrays:
    """What the layers of a KV cache group after the first read differently in a step (hybrid KV): their
    slots and the block tables of each phase, as :func:`slot_mapping` and :func:`block_tables` make them."""

    slot_mapping: np.ndarray  # [num_tokens] int64
    decode_tables: np.ndarray | None
    prefill_tables: np.ndarray | None


@attrs.define
class StepPlan:
    """One step's inputs on the host: what every tensor-parallel rank needs to run the same forward pass
    and the same logits collectives. Rank 0 makes it from the scheduled sequences and broadcasts it."""

    input_ids: np.ndarray  # [num_tokens] int64; PLACEHOLDER where the token is still on the device
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    num_decode_tokens: int
    decode: PhaseArrays | None
    prefill: PhaseArrays | None
    placeholder_rows: np.ndarray | None  # rows whose token is one sampled last step, not read back...
    placeholder_sources: np.ndarray | None  # ...and its row among last step's sampled tokens
    sample_rows: np.ndarray | None  # hidden-state rows that sample; None: every row, in order
    num_sampling: int
    prompt_logprob_rows: np.ndarray | None  # hidden-state rows followed by a prompt token, if any asked
    allocated_blocks: np.ndarray | None  # blocks handed out since the last step, for the policies to reset
    other_groups: list[GroupArrays] = attrs.Factory(list)  # KV cache groups 1, 2, ... (the fields above: 0)


@attrs.define
class PromptTargets:
    """Rank 0's part of the prompt logprobs of a step: the prompt token each row of
    ``StepPlan.prompt_logprob_rows`` predicts, the spans they belong to, the most top tokens asked."""

    targets: np.ndarray
    spans: list[tuple[Sequence, int, int]]
    k: int


def phase_arrays(seqs: list[Sequence], q_lens: list[int], ctx_lens: list[int]) -> PhaseArrays | None:
    """The phase of ``seqs`` (``None`` when empty): their first KV cache group's block tables padded with -1,
    query and context lengths in tokens."""
    if not seqs:
        return None
    return PhaseArrays(np.cumsum([0, *q_lens], dtype=np.int32), np.asarray(ctx_lens, dtype=np.int32),
                       block_tables(seqs, 0), max(q_lens), max(ctx_lens))


class TableCopy:
    """One KV cache group's block table of a sequence (``source``, a list the block manager keeps) as an int32
    array that steps read without converting the whole list again: a refresh copies the entries appended since
    the last one and those from ``stale_from`` on, which the block manager lowers when it rewrites an entry
    (``Sequence.rewrote_block``). A step's host work then grows with the blocks that changed, not with the
    context times the KV cache groups."""

    __slots__ = ("source", "array", "length", "stale_from")

    def __init__(self, source: list[int]) -> None:
        self.source = source
        self.array = np.empty(max(16, 2 * len(source)), dtype=np.int32)
        self.length = 0
        self.stale_from = 0

    def refresh(self) -> np.ndarray:
        """The table as it is now (a view, valid until the next refresh)."""
        table, n = self.source, len(self.source)
        if n == self.length == self.stale_from:  # most decode steps: nothing changed
            return self.array[:n]
        start = min(self.stale_from, self.length, n)
        if n > len(self.array):
            grown = np.empty(2 * n, dtype=np.int32)
            grown[:start] = self.array[:start]
            self.array = grown
        self.array[start:n] = table[start:]
        self.length, self.stale_from = n, n
        return self.array[:n]


def table_array(seq: Sequence, group: int) -> np.ndarray:
    """KV cache group ``group``'s block table of ``seq`` as int32, through its ``TableCopy`` (made again when
    the block manager has given the sequence a new list)."""
    copies = seq.table_copies
    if len(copies) != len(seq.block_tables):
        copies[:] = [None] * len(seq.block_tables)
    copy = copies[group]
    if copy is None or copy.source is not seq.block_tables[group]:
        copy = copies[group] = TableCopy(seq.block_tables[group])
    return copy.refresh()


def block_tables(seqs: list[Sequence], group: int, offset: int = 0) -> np.ndarray | None:
    """``[num_seqs, width]`` int32: KV cache group ``group``'s block table of each of ``seqs``, less
    ``offset`` (where its pool's ids start, ``KVStore.block_offset``), padded with -1 (``None`` without
    sequences)."""
    if not seqs:
        return None
    own = [table_array(s, group) for s in seqs]
    width = max(map(len, own))
    if all(len(table) == width for table in own):
        tables = np.stack(own)
    else:
        tables = np.full((len(seqs), width), -1, dtype=np.int32)
        for i, table in enumerate(own):
            tables[i, : len(table)] = table
    if offset:
        tables[tables >= 0] -= offset
    return tables


def slot_mapping(
    decodes: list[Sequence], prefills: list[Sequence], block_size: int, group: int, offset: int = 0
) -> np.ndarray:
    """``[num_tokens]`` int64: the cache slot of each token of a step (decodes' one token each, then the
    prefill chunks) in KV cache group ``group``'s blocks, their ids less ``offset``."""
    bs = block_size
    parts = [np.asarray([s.block_tables[group][p // bs] * bs + p % bs
                         for s in decodes for p in [s.num_computed_tokens]], dtype=np.int64)]
    for s in prefills:
        pos = np.arange(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens)
        parts.append(table_array(s, group)[pos // bs].astype(np.int64) * bs + pos % bs)
    slots = np.concatenate(parts)
    if offset:  # every token has a slot: no padding to keep
        slots -= offset * bs
    return slots


def prompt_logprob_targets(scored: list[tuple[Sequence, int]]) -> tuple[np.ndarray | None, PromptTargets | None]:
    """For the sequences that asked for prompt logprobs, each with its first hidden-state row in the step:
    the rows followed by a prompt token, and what they predict (``None, None`` when no row is)."""
    score_rows, targets, spans = [], [], []
    for s, first_row in scored:
        start = s.num_computed_tokens
        n = min(s.num_scheduled_tokens, s.num_prompt_tokens - 1 - start)
        if n > 0:
            score_rows.extend(range(first_row, first_row + n))
            targets.extend(s.token_ids[start + 1 : start + 1 + n])
            spans.append((s, start + 1, n))
    if not spans:
        return None, None
    k = max(s.sampling_params.prompt_logprobs for s, _, _ in spans)
    return np.asarray(score_rows, dtype=np.int64), PromptTargets(np.asarray(targets, dtype=np.int64), spans, k)
