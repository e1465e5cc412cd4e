"""Model loading: from the options to a model on the device.

:func:`resolve_config` finds the model (a directory, a packaged model, a preset or a hub ID), its tokenizer,
its config and architecture, and settles the length limit, device and dtype, once, into a
:class:`~nanovllm.config.ResolvedConfig`. :func:`select_parts` resolves what the options select from the
installed plugins (model class, sparse policies, attention backend, observers); every process does that itself.
:func:`build_model` makes the model on the device and loads its weights."""

from __future__ import annotations

import copy
import inspect
import json
import logging
import math
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from nanovllm.config import EngineConfig, ModelConfig, ResolvedConfig
from nanovllm.default_model import is_packaged_model, packaged_model_dir
from nanovllm.engine.loader import ModelDirectoryError, load_tensors, load_weights, read_config_json
from nanovllm.hub import is_hub_id, resolve_hub_id
from nanovllm.layers.attention import Attention
from nanovllm.plugins import PluginError, PluginSet, load_registered
from nanovllm.policy import PolicyHooks
from nanovllm.presets import is_preset, preset_dir
from nanovllm.selection import (
    BackendChoice,
    PolicyPlan,
    resolve_attention_backend,
    resolve_observer,
    resolve_policies,
)

_log = logging.getLogger(__name__)


def names_hub_model(model: str | None) -> bool:
    """``model`` is looked up on the hub: not the built-in model, a preset or an existing directory."""
    if is_packaged_model(model) or is_preset(model) or Path(model).expanduser().is_dir():
        return False
    return is_hub_id(model)


def resolve_model_path(model: str | None, revision: str | None = None, download_dir: str | None = None) -> Path:
    """A local directory, the built-in model or another packaged one (``"gemma-3-270m"``), a preset, or a
    hub ID looked up in (or downloaded to) the Hugging Face cache (``download_dir``, default
    ``HF_HUB_CACHE``) at ``revision``."""
    hub = names_hub_model(model)
    if revision is not None and not hub:
        raise ValueError(f"revision={revision!r} applies to hub model IDs only; model {model!r} is not one, "
                         "so leave revision unset")
    if is_packaged_model(model):
        return packaged_model_dir(model)
    if is_preset(model):
        return preset_dir(model)
    if hub:
        return resolve_hub_id(model, revision, download_dir)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelDirectoryError(
            f"model {model!r} is not a directory, nor a hub ID like 'Qwen/Qwen3-0.6B'. nanovllm loads Hugging "
            "Face-format directories and hub models; leave model unset for the built-in SmolLM2-135M-Instruct"
        )
    return path


def resolve_tokenizer_path(options: EngineConfig, model_path: Path) -> Path:
    """``tokenizer=`` (a directory or hub ID, at ``tokenizer_revision``), else the model's directory."""
    if options.tokenizer is None:
        if options.tokenizer_revision is not None:
            raise ValueError("tokenizer_revision applies to tokenizer=; without it use revision=")
        return model_path
    path = Path(options.tokenizer).expanduser()
    if path.is_dir():
        if options.tokenizer_revision is not None:
            raise ValueError(f"tokenizer_revision applies to hub IDs; tokenizer {options.tokenizer!r} is a directory")
        return path
    if not is_hub_id(options.tokenizer):
        raise ModelDirectoryError(f"tokenizer {options.tokenizer!r} is neither a directory nor a hub ID")
    return resolve_hub_id(options.tokenizer, options.tokenizer_revision, options.download_dir)


def load_tokenizer(path: Path):
    """The Hugging Face tokenizer in ``path``; one shipped as code with the checkpoint fails: it is never run."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as exc:
        raise ModelDirectoryError(
            f"cannot load a tokenizer from {str(path)!r}: {exc}; pass tokenizer= (a directory or hub ID of one "
            "transformers can load), or skip_tokenizer_init=True to run on token ids only"
        ) from exc


def find_architecture(path: Path, plugins: PluginSet) -> str:
    """The first ``architectures`` name in ``path``'s config.json that an installed plugin provides."""
    raw = read_config_json(path)
    families = plugins.registry.model_families
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in families), None)
    if arch is None and raw.get("auto_map"):
        raise ModelDirectoryError(
            f"{str(path)!r} needs the model code shipped with its checkpoint (auto_map in config.json, "
            f"architecture {', '.join(archs) or '(none)'}); nanovllm never runs checkpoint code, with or without "
            f"trust_remote_code. It runs the architectures its plugins provide: {', '.join(sorted(families)) or 'none'}"
        )
    if arch is None:
        raise ModelDirectoryError(
            f"no installed plugin provides architecture {', '.join(archs) or '(none in config.json)'}. "
            f"Installed: {', '.join(sorted(families)) or 'none'} (e.g. pip install nanovllm-qwen3)"
        )
    return arch


def override_config(hf_config: Any, overrides: dict[str, Any] | None) -> None:
    """Replace fields of a model's config (``hf_overrides``); a name the config lacks is an error, since
    setting it would change nothing."""
    for name, value in (overrides or {}).items():
        if not hasattr(hf_config, name):
            raise ValueError(f"hf_overrides names {name!r}, which {type(hf_config).__name__} does not have; "
                             "use a field name from the model's config.json")
        setattr(hf_config, name, value)


def load_hf_config(path: Path, overrides: dict[str, Any] | None) -> Any:
    """transformers' config of the model in ``path``, with ``overrides`` applied."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as exc:
        raise ModelDirectoryError(f"config.json in {str(path)!r} cannot be read: {exc}") from exc
    override_config(hf_config, overrides)
    return hf_config


def resolve_max_model_len(wanted: int | None, hf_config: Any) -> int:
    """``wanted``, at most the model's ``max_position_embeddings``; unset: that limit, else 4096."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if wanted is None:
        return limit or 4096
    if limit is not None and wanted > limit:
        raise ValueError(f"max_model_len={wanted} exceeds the model's max_position_embeddings={limit}")
    return wanted


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but PyTorch sees no CUDA device; use device='cpu'")
    return torch.device(device)


def resolve_dtype(dtype: str, hf_config: Any, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return torch.float32
    model_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(model_dtype, str):
        model_dtype = getattr(torch, model_dtype, None)
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def resolve_config(options: EngineConfig, plugins: PluginSet, observers: Sequence[object] = ()) -> ResolvedConfig:
    """Find the model and settle every derived option; the checks that need the model run here."""
    model_path = resolve_model_path(options.model, options.revision, options.download_dir)
    tokenizer_path = resolve_tokenizer_path(options, model_path)
    if options.download_dir is not None and not (
        names_hub_model(options.model) or (options.tokenizer is not None and names_hub_model(options.tokenizer))
    ):
        raise ValueError(f"download_dir={options.download_dir!r} is where hub models are cached; neither the "
                         "model nor the tokenizer is a hub ID, so leave it unset")
    architecture = find_architecture(model_path, plugins)
    hf_config = load_hf_config(model_path, options.hf_overrides)
    max_model_len = resolve_max_model_len(options.max_model_len, hf_config)
    if not options.enable_chunked_prefill and options.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens={options.max_num_batched_tokens} is below max_model_len={max_model_len}; "
            "with enable_chunked_prefill=False a whole prompt must fit one step"
        )
    device = resolve_device(options.device)
    dtype = str(resolve_dtype(options.dtype, hf_config, device)).removeprefix("torch.")
    return ResolvedConfig(
        **{**attrs.asdict(options, recurse=False), "max_model_len": max_model_len, "device": device.type,
           "dtype": dtype},
        model_config=ModelConfig(model_path, tokenizer_path, hf_config, architecture),
        observers=tuple(observers),
    )


def eos_token_ids(tokenizer: Any, config: ResolvedConfig) -> set[int]:
    """Every end-of-sequence id the tokenizer, the model's config and its generation_config.json name."""
    ids: set[int] = set()
    sources = [getattr(tokenizer, "eos_token_id", None), getattr(config.hf_config, "eos_token_id", None)]
    gen_file = config.model_config.path / "generation_config.json"
    if gen_file.is_file():
        sources.append(json.loads(gen_file.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids


@attrs.frozen
class EngineParts:
    """What the options select from the installed plugins: the sparse policies, the attention backend and
    the observers (objects)."""

    plugins: PluginSet
    policy_plan: PolicyPlan
    backend_choice: BackendChoice
    observers: tuple[object, ...]


def select_parts(options: EngineConfig, plugins: PluginSet, observers: Sequence[object] = ()) -> EngineParts:
    """Resolve the selections of ``options`` and the ``observers`` (objects, or selection strings of
    registered ones) against ``plugins``: a bad name or option fails here, before any file is read."""
    parts = EngineParts(
        plugins, resolve_policies(options.sparse_policy, plugins),
        resolve_attention_backend(options.attention_backend, plugins),
        tuple(resolve_observer(o, plugins) for o in observers),
    )
    check_kv_cache_dtype(options, parts)
    return parts


def check_kv_cache_dtype(options: EngineConfig, parts: EngineParts) -> None:
    """Raise ValueError, naming the fix, when a selected policy or backend, or KV offload, cannot keep its
    keys and values as ``options.kv_cache_dtype``."""
    kv_cache_dtype = options.kv_cache_dtype
    if kv_cache_dtype == "auto":
        return
    plan = parts.policy_plan
    for selected in {id(plan.prefill): plan.prefill, id(plan.decode): plan.decode}.values():
        supported = getattr(selected.cls, "supported_kv_cache_dtypes", ("auto",))
        if kv_cache_dtype not in supported:
            raise ValueError(
                f"sparse policy {selected.selection.name!r} does not read a kv_cache_dtype={kv_cache_dtype!r} "
                f"cache (it supports {', '.join(map(repr, supported))}): use kv_cache_dtype='auto', or "
                "sparse_policy='full'"
            )
    info = parts.backend_choice.info
    if info is not None and kv_cache_dtype not in info.kv_cache_dtypes:
        raise ValueError(
            f"attention backend {info.name!r} does not read a kv_cache_dtype={kv_cache_dtype!r} cache (it "
            f"supports {', '.join(map(repr, info.kv_cache_dtypes))}): use kv_cache_dtype='auto', or "
            "attention_backend='auto' to pick one that does"
        )
    if options.kv_offloading_size is not None:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported with KV offload (kv_offloading_size): the host "
            "pool keeps the model's dtype; use kv_cache_dtype='auto', or leave kv_offloading_size unset"
        )


class RandomTensor:
    """A checkpoint tensor of random weights that exists only where it is read: ``shape`` as a tensor's, and
    ``tensor[index]`` makes just the indexed part, on ``device`` in ``dtype``. Each element is a fixed
    function of the tensor's name and the element's position (a counter-based hash), so the shards of any
    number of ranks are slices of one model, and no rank ever holds more than its own shard of a tensor.
    Norm weights are one, other weights uniform in ``[-scale, scale)``."""

    CHUNK = 1 << 24  # elements made at once: bounds the int64 scratch of the hash (128 MiB)
    # splitmix64's constants as signed 64-bit integers (torch's int64 products wrap around)
    GOLDEN, MIX1, MIX2 = -7046029254386353131, -4658895280553007687, -7723592293110705685

    def __init__(self, name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                 scale: float = 1e-3) -> None:
        self.name, self.shape, self.dtype, self.device, self.scale = name, torch.Size(shape), dtype, device, scale
        self.seed = (zlib.crc32(name.encode()) & 0x7FFFFFFF) << 32  # the same in every process

    def __getitem__(self, index) -> torch.Tensor:
        ranges = self._ranges(index)
        out = torch.empty([len(r) for r in ranges], dtype=self.dtype, device=self.device)
        if "norm" in self.name:
            return out.fill_(1.0)
        flat = out.view(-1) if out.dim() else out.view(1)
        strides = [math.prod(self.shape[d + 1 :]) for d in range(len(self.shape))]
        row_len = math.prod(len(r) for r in ranges[1:])
        rows = max(1, self.CHUNK // max(1, row_len))
        first = ranges[0] if ranges else range(1)
        for start in range(0, len(first), rows):  # a chunk of rows along the first dimension at a time
            position = torch.zeros((), dtype=torch.int64, device=self.device)
            for d, r in enumerate(ranges):
                r = r[start : start + rows] if d == 0 else r
                axis = torch.arange(r.start, r.stop, dtype=torch.int64, device=self.device) * strides[d]
                position = position.unsqueeze(-1) + axis
            chunk = flat[start * row_len : (start + rows) * row_len]
            chunk.copy_(self._uniform(position.view(-1)))
        return out

    def _ranges(self, index) -> list[range]:
        """The element positions ``index`` selects per dimension: ``...`` or a tuple of contiguous slices
        (what the weight loaders index with)."""
        if index is Ellipsis:
            index = ()
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > len(self.shape) or not all(isinstance(i, slice) and i.step in (None, 1) for i in index):
            raise TypeError(f"random weights take contiguous slices, not {index!r}")
        full = [slice(None)] * (len(self.shape) - len(index))
        return [range(*s.indices(n)) for s, n in zip((*index, *full), self.shape, strict=True)]

    def _uniform(self, position: torch.Tensor) -> torch.Tensor:
        x = (position + self.seed).mul_(self.GOLDEN)
        x.bitwise_xor_(x >> 30).mul_(self.MIX1)
        x.bitwise_xor_(x >> 27).mul_(self.MIX2)
        x.bitwise_xor_(x >> 31)
        unit = ((x >> 39) & 0xFFFFFF).to(torch.float32).mul_(2.0**-24)  # 24 random bits: [0, 1)
        return unit.mul_(2 * self.scale).sub_(self.scale)


def random_checkpoint(hf_config: Any, architecture: str, dtype: torch.dtype, device: torch.device
                      ) -> list[tuple[str, str, RandomTensor]]:
    """The tensors a checkpoint of the model would hold (transformers' model of ``architecture`` built on the
    meta device gives their names and full shapes, allocating nothing), each a :class:`RandomTensor`."""
    import transformers

    model_cls = getattr(transformers, architecture, None)
    if model_cls is None:
        raise ValueError(f"load_format='dummy' takes the checkpoint's tensor names and shapes from transformers, "
                         f"which has no model class {architecture!r}; load real weights instead")
    with torch.device("meta"):
        reference = model_cls(copy.deepcopy(hf_config))  # a copy: transformers may set fields of its config
    return [(name, "random weights", RandomTensor(name, param.shape, dtype, device))
            for name, param in reference.named_parameters()]


def build_model(config: ResolvedConfig, plugins: PluginSet) -> torch.nn.Module:
    """The model of the plugin that provides ``config``'s architecture, in ``config.dtype`` on
    ``config.device``, its weights loaded (random with ``load_format="dummy"``: :class:`RandomTensor`), in
    eval mode. Each tensor-parallel rank makes only its own shard of each weight, on its device."""
    architecture = config.model_config.architecture
    family = plugins.registry.model_families[architecture]
    model_cls = load_registered(family.target, family.dist, f"model family {architecture!r}")
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, config.dtype))
    try:
        with torch.device(config.device):
            model = model_cls(config.hf_config)
    finally:
        torch.set_default_dtype(default_dtype)
    if config.load_format == "dummy":
        checkpoint = random_checkpoint(config.hf_config, architecture, getattr(torch, config.dtype),
                                       torch.device(config.device))
        load_tensors(model, checkpoint, "the random checkpoint")
    else:
        load_weights(model, config.model_config.path)
    return model.eval()


# -- what the model's attention layers run with ----------------------------------------------------------

AUTO_BACKENDS = ("triton", "torch")  # auto's order where no measurement ranks the backends (the CPU, new GPUs)
BACKEND_OPERATIONS = ("store_kv", "prefill", "decode", "attend_blocks", "attend_chunk")


@attrs.frozen
class BackendNeeds:
    """What the model and the engine need of an attention backend."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    windowed: bool = False  # the model has sliding-window layers: prefill and decode take a window
    kv_cache_dtype: str = "auto"  # the engine option: the backend must read and write that cache

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def takes_window(cls: type) -> bool:
    """Whether backend class ``cls``'s prefill and decode take a sliding ``window``."""
    return all("window" in inspect.signature(op).parameters for op in (cls.prefill, cls.decode))


def missing_features(cls: type, needs: BackendNeeds) -> list[str]:
    """What backend class ``cls`` lacks that the engine may call for: a window for a windowed model, and
    every operation (sparse policies and KV offload call ``attend_blocks`` and ``attend_chunk``)."""
    from nanovllm.attention.backend import AttentionBackend

    missing = []
    if needs.windowed and not takes_window(cls):
        missing.append("a sliding window, which this model's sliding-window layers need")
    absent = [op for op in BACKEND_OPERATIONS if getattr(cls, op) is getattr(AttentionBackend, op)]
    if absent:
        missing.append(f"{', '.join(absent)} (sparse policies and KV offload call them)")
    return missing


def auto_order(device: torch.device) -> tuple[tuple[str, ...], str]:
    """The backends ``auto`` tries on ``device``, in order, and the device's family: for a family in
    :data:`~nanovllm.engine.backend_table.MEASURED`, its backends by the number of measured shapes where
    they were among the fastest, then :data:`AUTO_BACKENDS`; for any other device, :data:`AUTO_BACKENDS`."""
    from nanovllm.engine.backend_table import MEASURED, device_family

    family = device_family(*torch.cuda.get_device_capability(device)) if device.type == "cuda" else device.type
    ranked = MEASURED[family].ranking() if family in MEASURED else ()
    return ranked + tuple(n for n in AUTO_BACKENDS if n not in ranked), family


def usable_backends(plugins: PluginSet, needs: BackendNeeds) -> tuple[list[tuple[str, type]], list[str]]:
    """The backends of :func:`auto_order` that are installed, run on this device, dtype and head size and
    lack nothing of :func:`missing_features`, in ``auto``'s order (on a CUDA device those that capture decode
    in CUDA graphs first), and why each of the others was passed over."""
    table = plugins.registry.attention_backends
    usable: list[tuple[str, type]] = []
    passed: list[str] = []
    for name in auto_order(needs.device)[0]:
        info = table.get(name)
        reason = "not installed" if info is None else info.supports(needs.device.type, needs.dtype_name,
                                                                    needs.head_dim, needs.kv_cache_dtype)
        if reason is None:
            try:
                cls = BackendChoice(info).load()
            except PluginError as exc:
                reason = str(exc)
            else:
                missing = missing_features(cls, needs)
                reason = f"lacks {'; '.join(missing)}" if missing else None
        if reason is None:
            usable.append((name, cls))
        else:
            passed.append(f"{name}: {reason}")
    if needs.device.type == "cuda":  # eager decode only where nothing captures
        usable.sort(key=lambda entry: not entry[1].supports_cuda_graphs)
    return usable, passed


def make_auto_backend(plugins: PluginSet, needs: BackendNeeds):
    """The first of :func:`usable_backends` that can be made (a backend whose kernels fail to import is passed
    over too); logs which, why, and the backends passed over."""
    from nanovllm.engine.backend_table import MEASURED

    usable, passed = usable_backends(plugins, needs)
    for name, cls in usable:
        try:
            backend = cls(None)
        except ImportError as exc:
            passed.append(f"{name}: {exc}")
            continue
        family = auto_order(needs.device)[1]
        measured = MEASURED.get(family)
        why = (f"among the fastest in {measured.wins(name)} of the {len(measured.fastest)} shapes measured on "
               f"{family} ({measured.results})" if measured else
               f"nothing measured on {family}, so the first usable of {', '.join(AUTO_BACKENDS)}")
        _log.info("attention_backend='auto' chose %r: %s%s", name, why,
                  f"; passed over {'; '.join(passed)}" if passed else "")
        return backend
    raise ValueError(
        f"attention_backend='auto' found no usable backend for device {needs.device.type}, dtype "
        f"{needs.dtype_name}, head size {needs.head_dim}: {'; '.join(passed)}. Install one that runs there, "
        "or name one with attention_backend="
    )


def make_backend(choice: BackendChoice, plugins: PluginSet, device: torch.device, dtype: torch.dtype,
                 head_dim: int, windowed: bool, kv_cache_dtype: str = "auto"):
    """The attention backend ``choice`` names (``auto``: :func:`make_auto_backend`), checked against the
    model; ``windowed``: the model has sliding-window layers, which need a backend whose prefill and decode
    take a window."""
    needs = BackendNeeds(device, dtype, head_dim, windowed, kv_cache_dtype)
    if choice.info is None:
        return make_auto_backend(plugins, needs)
    reason = choice.info.supports(device.type, needs.dtype_name, head_dim, kv_cache_dtype)
    if reason is not None:
        raise ValueError(f"attention backend {choice.info.name!r} cannot run this model: {reason}")
    cls = choice.load()
    if windowed and not takes_window(cls):
        raise ValueError(
            f"attention backend {choice.info.name!r} takes no sliding window (its prefill and decode have "
            "no window argument), and this model has sliding-window layers: choose "
            "attention_backend='torch' or 'triton'"
        )
    return cls(choice.config)


def bind_attention(layers: Sequence[Attention], parts: EngineParts, device: torch.device,
                   dtype: torch.dtype, kv_cache_dtype: str = "auto") -> tuple[Any, PolicyHooks]:
    """Make the attention backend and the policies' hooks (one policy object when prefill and decode select
    the same) and bind both to every attention layer; returns them."""
    windowed = any(layer.sliding_window is not None for layer in layers)
    backend = make_backend(parts.backend_choice, parts.plugins, device, dtype, layers[0].head_dim, windowed,
                           kv_cache_dtype)
    plan = parts.policy_plan
    prefill = plan.prefill.cls(plan.prefill.config)
    decode = prefill if plan.decode is plan.prefill else plan.decode.cls(plan.decode.config)
    hooks = PolicyHooks(prefill, decode, parts.observers)
    for layer in layers:
        layer.bind(backend, hooks)
    return backend, hooks
