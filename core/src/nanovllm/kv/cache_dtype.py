"""The KV cache's element type (the ``kv_cache_dtype`` engine option), and the one cast that writes into it.

``"auto"`` keeps the model's dtype. The 8-bit floats (``"fp8_e4m3"``, largest finite value 448, and
``"fp8_e5m2"``, 57344) store each key and value as it is, without a scale; a value beyond the format's
largest finite one is stored as that one. Attention reads every key and value as the cache holds it, a
prefill chunk's own too (:func:`as_stored`), widened back to the model's dtype."""

from __future__ import annotations

import torch

CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
EIGHT_BIT_FLOATS = frozenset(CACHE_DTYPES.values())  # tested with ``in``: no call on the eager step's path


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache for option ``kv_cache_dtype`` (``"auto"``: ``model_dtype``)."""
    return model_dtype if kv_cache_dtype == "auto" else CACHE_DTYPES[kv_cache_dtype]


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a KV cache of ``dtype`` stores it: to an 8-bit float, saturated at its largest finite
    value (as the Triton kernels' stores are), rounded to nearest even."""
    if dtype in EIGHT_BIT_FLOATS:
        limit = torch.finfo(dtype).max
        x = x.float().clamp(-limit, limit)
    return x.to(dtype)


def as_stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded as a cache of ``dtype`` holds it, in ``x``'s own dtype."""
    return to_cache(x, dtype).to(x.dtype)
