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


class BatchTables:
    """The block tables of the sequences that steps run, one row per sequence: an int32 array ``[groups, rows,
    width]``, -1 past each table's end. A step's tables are then one gather of its sequences' rows, and a row
    is written only where the block manager changed its sequence's lists (:class:`TableCopy`). A sequence
    holds its row from its first step until the block manager frees its blocks (``Sequence.drop_tables``);
    rows and width grow as needed."""

    def __init__(self, num_groups: int) -> None:
        self.array = np.full((num_groups, 16, 16), -1, dtype=np.int32)
        self.free_rows = list(range(15, -1, -1))

    def take_row(self) -> int:
        """A free row (cleared), the rows doubled when none is left."""
        if not self.free_rows:
            rows = self.array.shape[1]
            self._resize(2 * rows, self.array.shape[2])
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self.free_rows.pop()

    def give_back(self, row: int) -> None:
        """Row ``row`` is free again (cleared)."""
        self.array[:, row] = -1
        self.free_rows.append(row)

    def fit(self, width: int) -> None:
        """Make room for tables of ``width`` entries."""
        have = self.array.shape[2]
        if width > have:
            self._resize(self.array.shape[1], max(width, 2 * have))

    def _resize(self, rows: int, width: int) -> None:
        """Grow the array to ``rows`` x ``width``, keeping what it holds; the new entries are -1."""
        groups, old_rows, old_width = self.array.shape
        grown = np.full((groups, rows, width), -1, dtype=np.int32)
        grown[:, :old_rows, :old_width] = self.array
        self.array = grown


class TableCopy:
    """A sequence's block tables (``source``: ``Sequence.block_tables``, one list per KV cache group) in its row
    of a :class:`BatchTables`, which steps read without converting the lists again: a refresh copies only the
    entries the block manager changed since the last one (appended, or rewritten in place), which it reports
    through ``Sequence.changed_blocks``. A step's host work then grows with the sequences and the blocks that
    changed, not with the context times the KV cache groups."""

    __slots__ = ("source", "batch", "row", "lengths", "width", "stale_from", "rewritten")

    def __init__(self, source: list[list[int]], batch: BatchTables) -> None:
        self.source, self.batch = source, batch
        self.row = batch.take_row()
        self.lengths = [0] * len(source)
        self.width = 0  # the longest table's entries
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

    def refresh(self) -> None:
        """Bring the row up to the tables as they are now."""
        if self.stale_from is not None:
            self.batch.fit(max(map(len, self.source), default=0))
            array, row = self.batch.array, self.row
            for g, (table, start) in enumerate(zip(self.source, self.stale_from, strict=True)):
                n, had = len(table), self.lengths[g]
                start = min(start, had, n)
                if start == n - 1:  # a decode step's new block: a scalar store costs a fraction of a slice's
                    array[g, row, start] = table[start]
                elif start < n:
                    array[g, row, start:n] = table[start:]
                if n < had:
                    array[g, row, n:had] = -1
                self.lengths[g] = n
            self.width = max(self.lengths, default=0)
            self.stale_from = None
        for g, start, stop in self.rewritten:
            self.batch.array[g, self.row, start:stop] = self.source[g][start:stop]
        self.rewritten.clear()

    def release(self) -> None:
        """Give the row back (the sequence's tables are gone)."""
        self.batch.give_back(self.row)


def table_copy(seq: Sequence, batch: BatchTables) -> TableCopy:
    """``seq``'s up-to-date ``TableCopy`` in ``batch``, made again when the block manager has given the sequence
    new tables."""
    copy = seq.table_copy
    if copy is None or copy.source is not seq.block_tables:
        if copy is not None:
            copy.release()
        copy = seq.table_copy = TableCopy(seq.block_tables, batch)
    if copy.stale_from is not None or copy.rewritten:
        copy.refresh()
    return copy


def group_tables(seqs: list[Sequence], offsets: list[int], batch: BatchTables) -> np.ndarray | None:
    """``[groups, num_seqs, width]`` int32: each KV cache group's block table of each of ``seqs``, less the
    group's offset (``offsets[g]``: where its pool's ids start, ``KVStore.block_offset``), padded with -1
    (``None`` without sequences), gathered from their rows of ``batch``."""
    if not seqs:
        return None
    rows, width = [], 0
    for s in seqs:
        copy = table_copy(s, batch)
        rows.append(copy.row)
        width = max(width, copy.width)
    tables = batch.array[:, rows, :width]
    if any(offsets):
        np.subtract(tables, np.asarray(offsets, dtype=np.int32)[:, None, None], out=tables, where=tables >= 0)
    return tables


def group_slots(decodes: list[Sequence], decode_tables: np.ndarray | None, prefills: list[Sequence],
                block_size: int, offsets: list[int], batch: BatchTables) -> np.ndarray:
    """``[groups, num_tokens]`` int64: each KV cache group's cache slot of each token of a step (decodes' one
    token each, then the prefill chunks), its block ids less ``offsets[g]``; ``decode_tables``: the decodes'
    :func:`group_tables` (less the offsets already); ``batch``: the prefills' rows."""
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
        row = table_copy(s, batch).row
        blocks = batch.array[:, row, first : -(-end // bs), None].astype(np.int64) * bs - shift
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
