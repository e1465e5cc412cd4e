"""One step's plan on the host: what every tensor-parallel rank needs to run the same forward pass and the
same logits collectives. Rank 0's model runner makes it from the scheduled sequences
(:meth:`~nanovllm.engine.model_runner.ModelRunner.prepare`) and broadcasts it."""

from __future__ import annotations

import attrs
import numpy as np

from nanovllm.engine.sequence import Sequence


@attrs.define
class PhaseArrays:
    """A :class:`PhaseMetadata` on the host, for every KV cache group."""

    cu_seqlens_q: np.ndarray
    context_lens: np.ndarray
    group_tables: np.ndarray  # [groups, num_seqs, width] int32, padded with -1 (see group_tables)
    max_query_len: int
    max_context_len: int

    @property
    def block_tables(self) -> np.ndarray:
        """The first KV cache group's ``[num_seqs, width]``."""
        return self.group_tables[0]


@attrs.define
class StepPlan:
    """One step's inputs on the host: what every tensor-parallel rank needs to run the same forward pass
    and the same logits collectives. Rank 0 makes it from the scheduled sequences and broadcasts it."""

    input_ids: np.ndarray  # [num_tokens] int64; PLACEHOLDER where the token is still on the device
    positions: np.ndarray  # [num_tokens] int64
    group_slots: np.ndarray  # [groups, num_tokens] int64: each KV cache group's slots (see group_slots)
    num_decode_tokens: int
    decode: PhaseArrays | None
    prefill: PhaseArrays | None
    placeholder_rows: np.ndarray | None  # rows whose token is one sampled last step, not read back...
    placeholder_sources: np.ndarray | None  # ...and its row among last step's sampled tokens
    sample_rows: np.ndarray | None  # hidden-state rows that sample; None: every row, in order
    num_sampling: int
    prompt_logprob_rows: np.ndarray | None  # hidden-state rows followed by a prompt token, if any asked
    allocated_blocks: np.ndarray | None  # blocks handed out since the last step, for the policies to reset
    # every row's token is the one last step sampled in the same row (no placeholder rows then)
    inputs_last_sampled: bool = False

    @property
    def slot_mapping(self) -> np.ndarray:
        """The first KV cache group's slots."""
        return self.group_slots[0]


@attrs.define
class PromptTargets:
    """Rank 0's part of the prompt logprobs of a step: the prompt token each row of
    ``StepPlan.prompt_logprob_rows`` predicts, the spans they belong to, the most top tokens asked."""

    targets: np.ndarray
    spans: list[tuple[Sequence, int, int]]
    k: int


def phase_arrays(q_lens: list[int], ctx_lens: list[int], tables: np.ndarray | None) -> PhaseArrays | None:
    """The phase of the sequences of ``tables`` (their :func:`group_tables`; ``None`` when there are none):
    query and context lengths in tokens."""
    if tables is None:
        return None
    return PhaseArrays(np.cumsum([0, *q_lens], dtype=np.int32), np.asarray(ctx_lens, dtype=np.int32), tables,
                       max(q_lens), max(ctx_lens))


class TableCopy:
    """A sequence's block tables (``source``: ``Sequence.block_tables``, one list per KV cache group) as
    one int32 array ``[groups, capacity]``, -1 past each table's end, that steps read without converting
    the lists again: a refresh copies only the entries the block manager changed since the last one (appended, or
    rewritten in place), which it reports through ``Sequence.changed_blocks``. A step's host work then grows
    with the sequences and the blocks that changed, not with the context times the KV cache groups."""

    __slots__ = ("source", "array", "lengths", "stale_from", "rewritten")

    def __init__(self, source: list[list[int]]) -> None:
        self.source = source
        self.array = np.full((len(source), 16), -1, dtype=np.int32)
        self.lengths = [0] * len(source)
        self.stale_from: list[int] | None = [0] * len(source)  # per group; None: nothing changed
        self.rewritten: list[tuple[int, int, int]] = []  # (group, start, stop): ranges within the copy

    def changed(self, group: int, start: int, stop: int | None = None) -> None:
        """Entries ``start`` to ``stop - 1`` of group ``group``'s table changed (``None``: to its end)."""
        if stop is not None and stop <= self.lengths[group]:  # rewritten in place: copy just those
            self.rewritten.append((group, start, stop))
            return
        if self.stale_from is None:
            self.stale_from = list(self.lengths)
        self.stale_from[group] = min(self.stale_from[group], start)

    def refresh(self, width: int = 0) -> np.ndarray:
        """The tables as they are now, at least ``width`` entries wide (valid until the next refresh)."""
        width = max(width, *map(len, self.source)) if self.stale_from is not None else width
        if width > self.array.shape[1]:
            grown = np.full((len(self.source), 2 * width), -1, dtype=np.int32)
            grown[:, : self.array.shape[1]] = self.array
            self.array = grown
        if self.stale_from is not None:
            for g, (table, start) in enumerate(zip(self.source, self.stale_from, strict=True)):
                start = min(start, self.lengths[g], len(table))
                self.array[g, start : len(table)] = table[start:]
                self.array[g, len(table) : self.lengths[g]] = -1
                self.lengths[g] = len(table)
            self.stale_from = None
        for g, start, stop in self.rewritten:
            self.array[g, start:stop] = self.source[g][start:stop]
        self.rewritten.clear()
        return self.array

    @property
    def width(self) -> int:
        return max(self.lengths)


def table_copy(seq: Sequence) -> TableCopy:
    """``seq``'s ``TableCopy``, made again when the block manager has given the sequence new tables."""
    copy = seq.table_copy
    if copy is None or copy.source is not seq.block_tables:
        copy = seq.table_copy = TableCopy(seq.block_tables)
    copy.refresh()
    return copy


def group_tables(seqs: list[Sequence], offsets: list[int]) -> np.ndarray | None:
    """``[groups, num_seqs, width]`` int32: each KV cache group's block table of each of ``seqs``, less the
    group's offset (``offsets[g]``: where its pool's ids start, ``KVStore.block_offset``), padded with -1
    (``None`` without sequences)."""
    if not seqs:
        return None
    copies = [table_copy(s) for s in seqs]
    width = max(c.width for c in copies)
    tables = np.stack([c.refresh(width)[:, :width] for c in copies], axis=1)
    if any(offsets):
        np.subtract(tables, np.asarray(offsets, dtype=np.int32)[:, None, None], out=tables, where=tables >= 0)
    return tables


def group_slots(decodes: list[Sequence], decode_tables: np.ndarray | None, prefills: list[Sequence],
                block_size: int, offsets: list[int]) -> np.ndarray:
    """``[groups, num_tokens]`` int64: each KV cache group's cache slot of each token of a step (decodes' one
    token each, then the prefill chunks), its block ids less ``offsets[g]``; ``decode_tables``: the decodes'
    :func:`group_tables` (less the offsets already)."""
    bs = block_size
    shift = np.asarray(offsets, dtype=np.int64)[:, None, None] * bs
    out = np.empty((len(offsets), len(decodes) + sum(s.num_scheduled_tokens for s in prefills)), dtype=np.int64)
    if decodes:
        pos = np.asarray([s.num_computed_tokens for s in decodes], dtype=np.int64)
        rows = decode_tables[:, np.arange(len(decodes)), pos // bs]
        out[:, : len(decodes)] = rows.astype(np.int64) * bs + pos % bs
    in_block = np.arange(bs)
    column = len(decodes)
    for s in prefills:
        # block by block: a chunk's slots are whole runs of each block's, cut to the chunk's tokens
        start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
        first = start // bs
        blocks = table_copy(s).array[:, first : -(-end // bs), None].astype(np.int64) * bs - shift
        slots = (blocks + in_block).reshape(len(offsets), -1)
        out[:, column : column + end - start] = slots[:, start - first * bs : end - first * bs]
        column += end - start
    return out


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
