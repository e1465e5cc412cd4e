"""nanovllm-window: an example third-party sparse policy for nanovllm.

Select it with ``LLM(..., sparse_policy="window:sink_blocks=1,recent_blocks=4")``. This package
imports nothing heavy: the policy (and torch) load only when the policy is selected.
"""

__version__ = "0.1.0"
