"""The ``window`` policy: StreamingLLM-style attention to the first ``sink_blocks`` blocks plus the
last ``recent_blocks`` history blocks of every sequence.

Only ``select_blocks`` is overridden: :class:`nanovllm.sparse.SparsePolicy` already attends to the
selected history blocks plus the current chunk (prefill) or over the selected blocks (decode, where
the history includes the new token) and merges the partial results by log-sum-exp. The window thus
applies in decode and to the history before each prefill chunk, never inside a chunk: a prompt
prefilled in one chunk has no history and is attended to densely.
"""

from __future__ import annotations

import torch
from nanovllm.sparse import PolicyContext, SparsePolicy

from nanovllm_window.config import WindowConfig


class WindowPolicy(SparsePolicy):
    """Sink blocks + a sliding window of recent blocks of the history (decode, and prefill chunks after the
    first)."""

    supports_prefill = True
    supports_decode = True
    requires_block_selection = True

    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        config = self.config if self.config is not None else WindowConfig()
        sink, recent = config.sink_blocks, config.recent_blocks
        width = ctx.meta.block_tables.shape[1]
        if sink + recent >= width:  # the budget covers every block of every sequence: dense
            return ctx.all_history_blocks()
        n = ctx.num_history_blocks.to(torch.int32)[:, None]  # [S, 1]
        device = n.device
        sinks = torch.arange(sink, dtype=torch.int32, device=device).expand(n.shape[0], sink)
        # The recent window starts after the sinks, so no block is selected twice.
        start = torch.clamp(n - recent, min=sink)
        recents = start + torch.arange(recent, dtype=torch.int32, device=device)
        blocks = torch.cat([sinks, recents], dim=1)  # ascending; invalid entries only at the end
        return torch.where(blocks < n, blocks, torch.full_like(blocks, -1))
