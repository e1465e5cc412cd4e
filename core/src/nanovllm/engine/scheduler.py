"""Continuous batching under a per-step token budget (vLLM v1 style).

Every step hands each scheduled sequence a number of tokens to compute: one for a decode, a chunk
for a prompt. Running sequences go first, in arrival order, so decodes and prefill chunks share a
step; then waiting sequences are admitted while budget, ``max_num_seqs`` and free blocks allow.
When blocks run out, the most recently admitted running sequence is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later.

A sequence moves between the queues so that it is in one of them (for a moment in both) whenever it
holds blocks: an interrupted step can then always find and free them (``abort_all``).

After a step fails, its sequences are suspects (``isolate``): they give up their KV and, one at a time,
run alone (a step of one sequence, nothing else scheduled) until each has passed ``SOLO_STEPS`` sampling
steps, a recompute's prefill and a decode; then it rejoins the batch. The engine finishes a suspect whose
solo step fails with reason "error", so a request that breaks steps is found and ended, and the others go on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as SequenceABC

from nanovllm.config import EngineConfig
from nanovllm.engine.block_manager import FULL_ATTENTION, BlockManager
from nanovllm.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from nanovllm.kv.groups import KVCacheGroup

SOLO_STEPS = 2  # sampling steps a suspect passes alone: its recompute's prefill, then a decode


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int | None = None,
                 groups: SequenceABC[KVCacheGroup] = FULL_ATTENTION, num_window_blocks: int = 0) -> None:
        """``num_blocks`` of the KV cache shared by its ``groups`` (default: one full-attention group), and
        ``num_window_blocks`` of the window groups' own pool under KV offload (see ``BlockManager``)."""
        self.max_model_len = max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, groups,
                                          num_window_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_finished = 0  # sequences finished so far: a caller waiting for some looks only when it moves
        self.suspects: list[Sequence] = []  # sequences of failed steps, in the order they run alone

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """Pick this step's sequences and set ``num_scheduled_tokens`` on each; while there are suspects, only
        the first of them."""
        if self.suspects:
            return self._schedule_alone(self.suspects[0])
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
            if not self._admit(seq, budget):
                if not self.running:
                    raise self._too_large(seq)
                break
            scheduled.append(seq)
            budget -= seq.num_scheduled_tokens
        return scheduled

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Give waiting ``seq`` its cached prefix and slots for its next chunk, and make it run; False (and no
        change) when the chunk or its blocks do not fit."""
        # a cached prefix has no logits, so a request that wants prompt logprobs computes it again
        wants_logits = seq.sampling_params.prompt_logprobs is not None
        blocks = self.block_manager
        hits = blocks.no_prefix() if wants_logits else blocks.find_cached_prefix(seq)
        remaining = seq.num_tokens - len(hits[0]) * blocks.block_size
        num_new = min(remaining, budget)
        if num_new < remaining and not self.enable_chunked_prefill:
            return False
        if not blocks.can_allocate(seq, hits, seq.num_tokens - remaining + num_new):
            return False
        blocks.allocate(seq, hits, seq.num_tokens - remaining + num_new)
        seq.status = SequenceStatus.RUNNING
        seq.num_scheduled_tokens = num_new
        self.running.append(seq)
        self.waiting.remove(seq)  # the first, unless a suspect
        return True

    def _schedule_alone(self, seq: Sequence) -> list[Sequence]:
        """A step of suspect ``seq`` alone; running sequences give it their blocks (the last admitted first)
        when it needs them. Waiting requests wait."""
        budget = self.max_num_batched_tokens
        if seq.status == SequenceStatus.WAITING:
            while len(self.running) >= self.max_num_seqs or not self._admit(seq, budget):
                self._preempt_another(seq)
            return [seq]
        if seq.reached_length(self.max_model_len):  # its last token is still on the GPU; it finishes then
            return []
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        while not self.block_manager.append_slots(seq, seq.num_computed_tokens + num_new):
            self._preempt_another(seq)
        seq.num_scheduled_tokens = num_new
        return [seq]

    def _preempt_another(self, seq: Sequence) -> None:
        others = [s for s in self.running if s is not seq]
        if not others:
            raise self._too_large(seq)
        self._preempt(others[-1])

    def _too_large(self, seq: Sequence) -> RuntimeError:
        return RuntimeError(
            f"the KV cache ({self.block_manager.num_free_blocks} free blocks of {self.block_manager.block_size} "
            f"tokens) cannot hold one sequence of {seq.num_tokens} tokens; raise gpu_memory_utilization / "
            "kv_cache_memory or lower max_model_len"
        )

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and queue it first, to be recomputed."""
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.running.remove(seq)
        self.num_preemptions += 1

    def isolate(self, seqs: list[Sequence]) -> None:
        """Make ``seqs`` (unfinished sequences of a failed step) suspects: they give up their KV, drop a token
        never read back (a placeholder), wait first in the queue, and then run alone, one at a time, until each
        has passed ``SOLO_STEPS`` sampling steps (``passed``). Their generated tokens are kept."""
        seqs = sorted({id(s): s for s in seqs}.values(), key=lambda s: s.seq_id)  # in the order they came
        for seq in seqs:  # freed while still queued, so that an interrupt finds them (abort_all)
            if seq.token_ids[-1] == PLACEHOLDER:
                seq.token_ids.pop()
            self.block_manager.free(seq)
            seq.reset_for_recompute()
            seq.penalty_slot = -1  # its counts may hold a dropped token: a new slot is filled from its tokens
        ids = {id(s) for s in seqs}
        self.running = [s for s in self.running if id(s) not in ids]
        self.waiting = deque([*seqs, *(s for s in self.waiting if id(s) not in ids)])
        self.suspects += [s for s in seqs if not s.solo_steps_left]
        for seq in seqs:
            seq.solo_steps_left = SOLO_STEPS

    def passed(self, seq: Sequence) -> None:
        """Suspect ``seq`` sampled a token in a step of its own."""
        seq.solo_steps_left -= 1
        if not seq.solo_steps_left:
            self.suspects.remove(seq)

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
        if seq.solo_steps_left:
            self.suspects.remove(seq)
            seq.solo_steps_left = 0
        if seq.token_ids[-1] == PLACEHOLDER:  # sampled by a step in flight, never read back: discarded
            seq.token_ids.pop()
        seq.status = SequenceStatus.FINISHED
        self.num_finished += 1
        seq.finish_reason = reason
        seq.finished_time = time.time()
        self.block_manager.free(seq)
