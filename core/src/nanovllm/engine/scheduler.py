"""Continuous batching under a per-step token budget (vLLM v1 style).

Every step hands each scheduled sequence a number of tokens to compute: one for a decode, a chunk
for a prompt. Running sequences go first, in arrival order, so decodes and prefill chunks share a
step; then waiting sequences are admitted while budget, ``max_num_seqs`` and free blocks allow.
When blocks run out, the most recently admitted running sequence is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later.

A sequence moves between the queues so that it is in one of them (for a moment in both) whenever it
holds blocks: an interrupted step can then always find and free them (``abort_all``).
"""

from __future__ import annotations

import time
from collections import deque

from nanovllm.config import EngineConfig
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int | None = None) -> None:
        self.max_model_len = max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_finished = 0  # sequences finished so far: a caller waiting for some looks only when it moves

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """Pick this step's sequences and set ``num_scheduled_tokens`` on each."""
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.reached_length(self.max_model_len):  # its last token is still on the GPU; it finishes then
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.append_slots(seq, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                seq.num_scheduled_tokens = num_new
                scheduled.append(seq)
                budget -= num_new
                i += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            source = seq.prefix_source  # a sibling (n > 1) computing the shared prompt: wait to share it
            if source is not None and source.status == SequenceStatus.RUNNING and (
                source.num_computed_tokens < source.num_prompt_tokens
            ):
                break
            # a cached prefix has no logits, so a request that wants prompt logprobs computes it again
            wants_logits = seq.sampling_params.prompt_logprobs is not None
            hits = [] if wants_logits else self.block_manager.find_cached_prefix(seq)
            remaining = seq.num_tokens - len(hits) * self.block_manager.block_size
            num_new = min(remaining, budget)
            if num_new < remaining and not self.enable_chunked_prefill:
                break
            if not self.block_manager.can_allocate(seq, hits, seq.num_tokens - remaining + num_new):
                if not self.running:
                    raise RuntimeError(
                        f"the KV cache ({self.block_manager.num_free_blocks} free blocks of "
                        f"{self.block_manager.block_size} tokens) cannot hold one sequence of "
                        f"{seq.num_tokens} tokens; raise gpu_memory_utilization / kv_cache_memory "
                        "or lower max_model_len"
                    )
                break
            self.block_manager.allocate(seq, hits, seq.num_tokens - remaining + num_new)
            seq.status = SequenceStatus.RUNNING
            seq.num_scheduled_tokens = num_new
            self.running.append(seq)
            self.waiting.popleft()
            scheduled.append(seq)
            budget -= num_new
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        """Preempt the last running sequence."""
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.running.pop()
        self.num_preemptions += 1

    def advance(self, scheduled: list[Sequence]) -> None:
        """Account for a finished step: the scheduled tokens are now in the cache."""
        for seq in scheduled:
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.commit_full_blocks(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Running, or waiting (after a preemption while its last token was still on the GPU, or never
        admitted when aborted)."""
        (self.running if seq.status == SequenceStatus.RUNNING else self.waiting).remove(seq)
        self._release(seq, reason)

    def abort(self, seq: Sequence) -> None:
        """Finish a waiting or running sequence with reason "abort"."""
        self.finish(seq, "abort")

    def abort_all(self) -> None:
        """Drop every request (after an error or interrupt in a step), returning all blocks, those of a
        sequence interrupted in the middle of admission or preemption included."""
        for seq in {id(s): s for s in (*self.running, *self.waiting)}.values():
            self._release(seq, "abort")
        self.running.clear()
        self.waiting.clear()

    def _release(self, seq: Sequence, reason: str) -> None:
        if seq.token_ids[-1] == PLACEHOLDER:  # sampled by a step in flight, never read back: discarded
            seq.token_ids.pop()
        seq.status = SequenceStatus.FINISHED
        self.num_finished += 1
        seq.finish_reason = reason
        seq.finished_time = time.time()
        self.block_manager.free(seq)
