"""nanovllm-xattn: XAttention (ICML 2025) block-sparse prefill for nanovllm.

Select it with ``LLM(..., sparse_policy="xattn:threshold=0.9")``. Importing this package loads no torch:
the policy and its kernels load only when the policy is selected.
"""

__version__ = "0.1.0"
