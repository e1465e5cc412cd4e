"""nanovllm-quest: Quest (ICML 2024) query-aware sparse decode for nanovllm.

Select it with ``LLM(..., sparse_policy="quest:token_budget=2048")``. Importing this package loads no
torch: the policy and its kernels load only when the policy is selected.
"""

__version__ = "0.1.0"
