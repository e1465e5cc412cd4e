"""A generic pre-norm decoder-only transformer (Llama shape) that model plugins specialise.

A family subclasses :class:`SelfAttention` where its attention differs (Qwen3 sets ``q_norm`` and
``k_norm``, Qwen2 ``qkv_bias``) and sets ``attention_cls`` on a :class:`DecoderForCausalLM` subclass; a
family whose layers differ (Gemma's extra norms) sets ``layer_cls``, ``norm_cls`` and ``embed_scaled``.
Read from the config for every family: per-layer sliding windows, RoPE per layer type, the attention
scale (``query_pre_attn_scalar``), the MLP's activation and the final logit soft-cap."""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.distributed import tp_size
from nanovllm.layers import weight_prefetch
from nanovllm.layers.activation import GatedMLP
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import rope_from_config


def layer_type_of(config, layer_id: int) -> str:
    """``"sliding_attention"`` or ``"full_attention"``: the config's ``layer_types`` where it has them
    (transformers 5 writes them for Gemma, Qwen2/3 and Mistral-like configs), else Qwen2's older
    ``use_sliding_window`` / ``max_window_layers``, else sliding wherever ``sliding_window`` is set
    (Mistral)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return layer_types[layer_id]
    if getattr(config, "sliding_window", None) is None:
        return "full_attention"
    if hasattr(config, "use_sliding_window"):
        sliding = config.use_sliding_window and layer_id >= getattr(config, "max_window_layers", 0)
        return "sliding_attention" if sliding else "full_attention"
    return "sliding_attention"


def sliding_window_of(config, layer_id: int) -> int | None:
    """The layer's attention window in tokens (its own included), None for full attention."""
    if layer_type_of(config, layer_id) != "sliding_attention":
        return None
    return getattr(config, "sliding_window", None)


class SelfAttention(nn.Module):
    """Packed QKV projection, RoPE, paged attention, output projection. Under tensor parallelism it returns
    this rank's share of the output: the decoder layer's next RMSNorm sums the shares (``partial=True``),
    fused with its own kernel where it can."""

    qkv_bias: bool | None = None  # biases on q/k/v only (Qwen2); None: ``attention_bias`` on all four
    # a family whose reference leaves ``attn_logit_softcapping`` unused sets this (transformers' Gemma 3)
    ignores_attn_logit_softcapping = False

    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        softcap = getattr(config, "attn_logit_softcapping", None)
        if softcap and not self.ignores_attn_logit_softcapping:
            raise ValueError(
                f"attn_logit_softcapping={softcap} (attention logits soft-capped by tanh, as in Gemma 2) is not "
                "supported: nanovllm's attention backends and sparse policies compute uncapped softmax "
                "attention; set it to null in the model's config.json only if the model was trained without it"
            )
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        bias = getattr(config, "attention_bias", False)
        qkv_bias = bias if self.qkv_bias is None else self.qkv_bias
        self.num_heads = config.num_attention_heads // tp_size()
        self.num_kv_heads = config.num_key_value_heads // tp_size()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads,
            qkv_bias,
        )
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias,
                                        reduce_results=False)
        self.rotary_emb = rope_from_config(config, self.head_dim, layer_type_of(config, layer_id))
        scale = (getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5  # Gemma's scalar
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale, layer_id,
                              sliding_window_of(config, layer_id))
        # per-head RMSNorms of queries and keys before RoPE (Qwen3 sets them); none here
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden, out=self.attn.qkv_out).split([q_size, kv_size, kv_size], dim=-1)
        weight_prefetch.prefetch(self.o_proj.weight, hidden)  # while RoPE and attention run
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        cache = self.attn.cache_slots()  # RoPE writes k and v to the KV cache too, where it can
        q, k = self.rotary_emb(positions, q, k, self.q_norm, self.k_norm, v, cache)
        return self.o_proj(self.attn(q, k, v, kv_written=cache is not None).flatten(1))


def mlp_from_config(config) -> GatedMLP:
    """The gated MLP with the config's activation (``hidden_activation`` for Gemma, else ``hidden_act``);
    each tensor-parallel rank returns its share."""
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    return GatedMLP(config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False),
                    reduce_results=False, activation=activation)


class DecoderLayer(nn.Module):
    # the layer returns its MLP's output as one share per tensor-parallel rank (the next norm sums them)
    returns_partial = True

    def __init__(self, config, layer_id: int, attention_cls: type[SelfAttention]) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_id)
        self.mlp = mlp_from_config(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        """``hidden``: the embeddings (``residual`` None, the first layer) or the previous layer's MLP
        output, one share per tensor-parallel rank; returns this layer's, likewise."""
        weight_prefetch.prefetch(self.self_attn.qkv_proj.weight, hidden)  # while the norm (all-reduce) runs
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual, partial=True)
        hidden = self.self_attn(positions, hidden)
        weight_prefetch.prefetch(self.mlp.gate_up_proj.weight, hidden)  # likewise
        hidden, residual = self.post_attention_layernorm(hidden, residual, partial=True)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(
        self, config, attention_cls: type[SelfAttention], layer_cls: type[nn.Module] = DecoderLayer,
        norm_cls: type[RMSNorm] = RMSNorm, embed_scaled: bool = False,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            layer_cls(config, i, attention_cls) for i in range(config.num_hidden_layers)
        )
        self.norm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.partial = layer_cls.returns_partial
        # Gemma scales the embeddings by sqrt(hidden_size), rounded to the model's dtype (the default dtype
        # while the runner builds the model) as transformers rounds it
        self.embed_scale = None
        if embed_scaled:
            self.embed_scale = torch.tensor(config.hidden_size**0.5).to(torch.get_default_dtype()).item()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        weight_prefetch.join(hidden)
        return self.norm(hidden, residual, partial=self.partial)[0]


class DecoderForCausalLM(nn.Module):
    """The model interface the runner uses: ``forward(input_ids, positions)``, ``compute_logits``, and
    ``packed_modules_mapping`` (checkpoint name -> packed parameter and shard) for the weight loader."""

    attention_cls: type[SelfAttention] = SelfAttention
    layer_cls: type[nn.Module] = DecoderLayer
    norm_cls: type[RMSNorm] = RMSNorm
    embed_scaled = False
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config) -> None:
        super().__init__()
        self.model = DecoderModel(
            config, self.attention_cls, self.layer_cls, self.norm_cls, self.embed_scaled
        )
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.logit_softcap = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The float32 logits of the whole vocabulary; None on tensor-parallel ranks other than 0 (see
        :class:`~nanovllm.layers.embed_head.ParallelLMHead`). With ``final_logit_softcapping`` (Gemma 2)
        the logits are squashed to ``cap * tanh(logits / cap)``."""
        logits = self.lm_head(hidden)
        if logits is not None and self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits
