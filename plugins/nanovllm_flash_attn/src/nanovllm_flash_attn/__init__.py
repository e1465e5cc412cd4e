"""nanovllm-flash-attn: the ``flash_attn`` attention backend, FlashAttention-4 (the CuTe DSL kernels of the
``flash-attn-4`` wheel) where it has the path, the ``triton`` backend's kernels where it has not.

Importing this package imports nothing heavy; the backend (:mod:`nanovllm_flash_attn.backend`) imports
torch when selected and FA4 when an engine builds it."""
