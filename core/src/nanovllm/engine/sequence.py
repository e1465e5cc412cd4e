"""One request's tokens and progress."""

from __future__ import annotations

import enum
import time
from itertools import count

from nanovllm.sampling_params import SamplingParams

# A token that was sampled on the GPU but not yet read back (async scheduling); at most one per
# sequence, always its last token. The next step takes its value straight from the GPU.
PLACEHOLDER = -1

# Logprobs of one position as read back from the device: token ids, logprobs and ranks, the position's
# own token first, then the top tokens (see nanovllm.layers.sampler.TopLogprobs).
RawLogprobs = tuple[list[int], list[float], list[int]]


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    _ids = count()

    def __init__(
        self, token_ids: list[int], sampling_params: SamplingParams, request_id: str = "", prompt_text: str | None = None
    ) -> None:
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.prompt_text = prompt_text
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        # one block table per KV cache group (empty while it holds no blocks); see ``block_table``
        self.block_tables: list[list[int]] = []
        self.table_copy = None  # their int32 copy for the steps (nanovllm.engine.step_plan.TableCopy)
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full blocks, in order
        self.block_checks: list[int] = []  # their second hashes, where a window group needs them
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache at admission
        self.num_scheduled_tokens = 0  # tokens to compute in the current step
        self.num_committed_blocks = 0  # leading full blocks already offered to the prefix cache
        # the computed tokens at which a window group's window next leaves a block behind (BlockManager)
        self.window_moves_at = 0
        # BlockManager.append_slots has nothing to do while the tokens to cover stay at or below this
        self.slots_ready_until = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # with finish reason "error": the exception, "TypeName: message"
        # after a failed step it was in: the sampling steps it must still pass alone before it runs in a batch
        # again (0: not suspect; see Scheduler.isolate)
        self.solo_steps_left = 0
        self.generator = None  # torch.Generator of a seeded request, made by the runner
        # logits processing (see nanovllm.layers.sampler.LogitsProcessing); the engine fills the token ids
        self.processes_logits = sampling_params.processes_logits
        self.min_tokens_banned: list[int] = []  # EOS and stop token ids, masked before min_tokens
        self.bad_words_token_ids: list[list[int]] = []
        self.penalty_slot = -1  # row of this sequence in the runner's PenaltyCounts
        # the request's completions (n > 1: siblings sampling from the same prompt), this one's index, and
        # the sibling whose prompt blocks it waits for, to take them from the prefix cache
        self.group: list[Sequence] = [self]
        self.index = 0
        self.prefix_source: Sequence | None = None
        self.arrival_time = time.time()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.sample_row = -1  # row of this sequence in the last launched step's sampled tokens
        self.logprobs: list[RawLogprobs] = []  # one per generated token, with SamplingParams(logprobs=k)
        # with SamplingParams(prompt_logprobs=k): one per prompt position, stored by position so that a
        # recompute after preemption overwrites; position 0 stays None (nothing predicts it)
        self.prompt_logprobs: list[RawLogprobs | None] | None = (
            None if sampling_params.prompt_logprobs is None else [None] * len(token_ids)
        )

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_table(self) -> list[int]:
        """The first KV cache group's block table (the full-attention layers' where the model has any, see
        :mod:`nanovllm.kv.groups`; every layer's without windows)."""
        return self.block_tables[0] if self.block_tables else []

    def changed_blocks(self, group: int, start: int, stop: int | None = None) -> None:
        """The block manager changed entries ``start`` to ``stop - 1`` of KV cache group ``group``'s block
        table (``None``: to its end, as when it appends), which the step plan's copy of it must take again."""
        if self.table_copy is not None:
            self.table_copy.changed(group, start, stop)

    def drop_tables(self) -> None:
        """The block manager freed this sequence's blocks: its tables and their copy for the steps are gone."""
        self.block_tables = []
        self.slots_ready_until = 0
        if self.table_copy is not None:
            self.table_copy.release()
            self.table_copy = None

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def samples_this_step(self) -> bool:
        """The scheduled tokens reach the end of the sequence, so a new token is sampled."""
        return self.num_computed_tokens + self.num_scheduled_tokens == self.num_tokens

    def reached_length(self, max_model_len: int | None) -> bool:
        """No further token may be sampled (``max_tokens`` or the context limit is reached)."""
        full = max_model_len is not None and self.num_tokens >= max_model_len
        max_tokens = self.sampling_params.max_tokens
        return full or (max_tokens is not None and self.num_completion_tokens >= max_tokens)

    @property
    def is_decode(self) -> bool:
        """Exactly one token to process this step (vLLM V1's rule): it runs as a decode, a query of
        length one over its history, whether it is a generated token or a one-token prompt chunk."""
        return self.num_scheduled_tokens == 1

    def reset_for_recompute(self) -> None:
        """After preemption: drop the KV, keep the tokens; the whole sequence is prefilled again."""
        self.status = SequenceStatus.WAITING
        self.drop_tables()
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_committed_blocks = 0
