"""Engine configuration, with vLLM's names. Values are checked here, at the API boundary.

:class:`EngineConfig` holds the options as given; :class:`ResolvedConfig` is the same options with what
start-up derives from them (the model's directory and config, the length limit, the device and dtype),
made once by the engine and handed down to the model runner and every tensor-parallel rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs


def _positive_int(name: str):
    def check(_inst, _attr, value) -> None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")

    return check


def _max_logprobs(_inst, _attr, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise ValueError(
            f"max_logprobs must be an int >= 0, or -1 for no limit but the vocabulary, got {value!r}"
        )


def _one_of(name: str, choices: tuple[str, ...]):
    def check(_inst, _attr, value) -> None:
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")

    return check


def _fraction(_inst, _attr, value) -> None:
    if not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {value!r}")


def _gib(name: str, minimum: float = 0.0):
    def check(_inst, _attr, value) -> None:
        if value is None:
            return
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= minimum:
            raise ValueError(f"{name} is a size in GiB, a number > {minimum}, got {value!r}")

    return check


def _selection(_inst, attr, value) -> None:
    if not isinstance(value, (str, dict)):
        raise ValueError(f"{attr.name} must be a selection string like 'name:key=value' or a dict, got {value!r}")


def _json_object(value: Any) -> Any:
    """A dict as ``LLM(...)`` takes it, or a JSON object as a command-line flag gives it."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"expected a JSON object such as '{{\"max_position_embeddings\": 131072}}', got "
                         f"{value!r:.80} ({exc})") from None


def _field_values(_inst, attr, value) -> None:
    if value is not None and (not isinstance(value, dict) or not all(isinstance(k, str) for k in value)):
        raise ValueError(f"{attr.name} must map config.json field names to values, e.g. "
                         f"{{'max_position_embeddings': 131072}}, got {value!r:.80}")


DTYPES = ("auto", "float32", "float16", "bfloat16")
# vLLM's other spellings of the same dtypes
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def _canonical_dtype(value: Any) -> Any:
    """``"half"`` -> ``"float16"``, ``torch.bfloat16`` -> ``"bfloat16"`` (checked by name, so torch is not imported)."""
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        value = str(value).removeprefix("torch.")
    return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value


# the KV cache's element type: "auto" keeps the model's dtype; the 8-bit floats halve the cache's bytes
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's spelling


def _optional_str(_inst, attr, value) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{attr.name} must be a non-empty string or None, got {value!r}")


def _bool(_inst, attr, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{attr.name} must be True or False, got {value!r}")


@attrs.define(kw_only=True)
class EngineConfig:
    """Everything ``LLM(model, **config)`` accepts. ``None`` means: derive it from the model or device."""

    model: str | None = None
    # a different tokenizer (directory or hub ID; default: the model's), and hub revisions of both
    tokenizer: str | None = attrs.field(default=None, validator=_optional_str)
    revision: str | None = attrs.field(default=None, validator=_optional_str)
    tokenizer_revision: str | None = attrs.field(default=None, validator=_optional_str)
    # the Hugging Face cache folder hub IDs are looked up in and downloaded to (default: HF_HUB_CACHE)
    download_dir: str | None = attrs.field(default=None, validator=_optional_str)
    # accepted for vLLM scripts; code shipped with a checkpoint never runs either way
    trust_remote_code: bool = attrs.field(default=False, validator=_bool)
    dtype: str = attrs.field(
        default="auto", converter=_canonical_dtype,
        validator=_one_of("dtype", (*DTYPES, *DTYPE_ALIASES)),
    )
    max_model_len: int | None = attrs.field(default=None, validator=_positive_int("max_model_len"))
    # fields of the model's config.json replaced before anything is built, e.g. {"max_position_embeddings":
    # 131072} to run a model past the length it was trained for
    hf_overrides: dict[str, Any] | None = attrs.field(default=None, converter=_json_object,
                                                       validator=_field_values)
    max_num_seqs: int = attrs.field(default=256, validator=_positive_int("max_num_seqs"))
    max_num_batched_tokens: int = attrs.field(default=8192, validator=_positive_int("max_num_batched_tokens"))
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=_fraction)
    # bytes of KV cache (default: 2 GiB on the CPU, what gpu_memory_utilization leaves on CUDA; with
    # kv_offloading_size, of a hybrid model's sliding-window layers, which stay on the device). On the CPU a
    # block's pages become resident when it is first written; the prefix cache keeps finished requests' blocks
    # until the cache is full, so with it on the process grows towards this size, and stays there
    kv_cache_memory: int | None = attrs.field(default=None, validator=_positive_int("kv_cache_memory"))
    block_size: int = attrs.field(default=16, validator=_positive_int("block_size"))
    # "fp8" / "fp8_e4m3" or "fp8_e5m2": keys and values stored as 8-bit floats (vLLM's option), twice the
    # tokens in the same memory and half the bytes for decode to read; values beyond the format's largest
    # finite one are stored as that one (no scaling). Needs a backend and a sparse policy that read it (the
    # built-in torch and triton backends, the full policy); "auto": the model's dtype
    kv_cache_dtype: str = attrs.field(
        default="auto", converter=lambda v: KV_CACHE_DTYPE_ALIASES.get(v, v) if isinstance(v, str) else v,
        validator=_one_of("kv_cache_dtype", (*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES)),
    )
    enable_prefix_caching: bool = True
    # keep every token of every layer (one KV cache group), as models without sliding windows do; by default a
    # sliding-window layer keeps only the blocks its window reaches (vLLM's hybrid KV cache manager)
    disable_hybrid_kv_cache_manager: bool = attrs.field(default=False, validator=_bool)
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    # steps of max_num_batched_tokens tokens, or up to an eighth fewer (padded: a long prompt's chunks, its
    # last one, full batches of prompts) replay the forward between attention calls as CUDA graphs, attention
    # running eagerly between them (vLLM's piecewise mode); one GPU, no KV offload; costs about one such
    # step's activations of GPU memory
    piecewise_cuda_graphs: bool = attrs.field(default=True, validator=_bool)
    # schedule and launch step N+1 before reading step N's tokens back, so host work overlaps the GPU
    async_scheduling: bool = True
    # matmuls of at most 16 tokens (decode steps) in the linear layers and the LM head run nanovllm's Triton
    # GEMV kernel (nanovllm.layers.gemv), which streams the weights near HBM bandwidth, instead of cuBLAS
    enable_triton_gemv: bool = attrs.field(default=True, validator=_bool)
    # KV offload: every layer's KV cache lives in a pinned host pool of this many GiB, and attention streams
    # what each layer reads through a ring of GPU load slots (``kv_offloading_buffer_size`` GiB in all).
    # vLLM's option of this name sizes a host tier for prefix reuse; here it is where attention reads KV from.
    kv_offloading_size: float | None = attrs.field(default=None, validator=_gib("kv_offloading_size"))
    kv_offloading_buffer_size: float = attrs.field(default=1.5, validator=_gib("kv_offloading_buffer_size"))
    # decode selections keep the head blocks they loaded in that buffer, one region per layer, and the next
    # step loads only those it lacks (when every layer's selection of the batch fits; nanovllm.kv.offload)
    kv_offloading_reuse_selections: bool = True
    tensor_parallel_size: int = attrs.field(default=1, validator=_positive_int("tensor_parallel_size"))
    # "mp": the engine spawns its ranks; "external_launcher": every rank is a process torchrun started
    distributed_executor_backend: str = attrs.field(
        default="mp", validator=_one_of("distributed_executor_backend", ("mp", "external_launcher")),
    )
    device: str = attrs.field(default="auto", validator=_one_of("device", ("auto", "cpu", "cuda")))
    seed: int = 0
    load_format: str = attrs.field(default="auto", validator=_one_of("load_format", ("auto", "dummy")))
    skip_tokenizer_init: bool = False
    sparse_policy: str | dict = attrs.field(default="full", validator=_selection)
    attention_backend: str | dict = attrs.field(default="auto", validator=_selection)
    # the most SamplingParams.logprobs / prompt_logprobs a request may ask for (-1: the whole vocabulary)
    max_logprobs: int = attrs.field(default=20, validator=_max_logprobs)

    @classmethod
    def from_kwargs(cls, model: str | None, kwargs: dict[str, Any]) -> EngineConfig:
        accepted = [f.name for f in attrs.fields(cls) if f.name != "model"]
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            raise TypeError(
                f"unknown engine option(s): {', '.join(unknown)}. Accepted: {', '.join(accepted)}"
            )
        return cls(model=model, **kwargs)


@attrs.frozen
class ModelConfig:
    """Where the model is and what it is, as start-up found it."""

    path: Path  # the Hugging Face-format directory the weights load from
    tokenizer_path: Path  # the tokenizer's directory (the model's unless ``tokenizer=`` names another)
    hf_config: Any  # transformers' config of the model, ``hf_overrides`` applied
    architecture: str  # the ``architectures`` name of config.json that an installed plugin provides


@attrs.define(kw_only=True)
class ResolvedConfig(EngineConfig):
    """The options with nothing left to derive: ``max_model_len`` is a number of tokens (default: the model's
    ``max_position_embeddings``, else 4096), ``device`` is ``"cpu"`` or ``"cuda"``, ``dtype`` names a torch
    dtype (``"auto"``: float32 on the CPU, else the model's float16 or bfloat16, else bfloat16). Made by
    :func:`nanovllm.engine.model_loading.resolve_config`; the only later change is ``enforce_eager`` when a
    tensor-parallel capture times out."""

    model_config: ModelConfig
    # as the engine was given them: selection strings or objects; each rank resolves them itself
    observers: tuple[object, ...] = ()

    @property
    def hf_config(self) -> Any:
        return self.model_config.hf_config
