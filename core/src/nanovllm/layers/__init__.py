"""Building blocks for model plugins: tensor-parallel linears, embeddings, norms, RoPE, attention."""

from nanovllm.layers.activation import GatedActivation, GatedMLP, GeluTanhAndMul, SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import GemmaRMSNorm, RMSNorm
from nanovllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from nanovllm.layers.rotary_embedding import RotaryEmbedding, rope_from_config

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "GatedActivation",
    "GatedMLP",
    "GeluTanhAndMul",
    "GemmaRMSNorm",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "default_weight_loader",
    "rope_from_config",
]
