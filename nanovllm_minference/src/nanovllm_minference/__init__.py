"""nanovllm-minference: MInference (NeurIPS 2024) sparse prefill for nanovllm.

Select it with ``LLM(..., sparse_policy="minference")``. Importing this package loads no torch: the
policy and its kernels load only when the policy is selected.
"""

__version__ = "0.1.0"
