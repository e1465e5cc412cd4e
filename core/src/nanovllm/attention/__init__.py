"""Attention backends and the per-step metadata they read."""

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.metadata import PhaseMetadata, StepMetadata

__all__ = ["AttentionBackend", "PhaseMetadata", "StepMetadata"]
