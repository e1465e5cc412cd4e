"""Helpers for tests of the engine and of plugins: tiny random Hugging Face models on disk.

``tiny_model_dir(path, "Qwen3ForCausalLM")`` writes config.json, model.safetensors (random weights
from transformers' own initialisation, seeded) and a word-level tokenizer whose vocabulary is
``tok0 ... tokN``, so text and token-id prompts both work without any download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "Qwen3ForCausalLM": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
}


def _tokenizer(vocab_size: int):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"tok{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="tok0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()

    def special(word: str) -> AddedToken:  # whole words only, or "tok13" would split into "tok1" + "3"
        return AddedToken(word, single_word=True, special=True)

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=special("tok0"), bos_token=special("tok1"), eos_token=special("tok2"),
        pad_token=special("tok0"),
    )


def tiny_model_dir(path: str | Path, architecture: str = "LlamaForCausalLM", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random model of ``architecture`` to ``path`` and return the path."""
    import torch
    import transformers

    path = Path(path)
    settings = {**TINY_CONFIGS[architecture], **overrides}
    model_type = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}[architecture]
    config = transformers.AutoConfig.for_model(model_type, **settings)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).float().eval()
    with torch.no_grad():  # transformers initialises norms to ones; perturb them so parity checks see them
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer(config.vocab_size).save_pretrained(path)
    return path


def hub_cache_entry(cache_dir: str | Path, repo_id: str, model_dir: str | Path, revision: str = "main",
                    commit: str | None = None) -> Path:
    """Put a copy of ``model_dir`` into a Hugging Face hub cache folder (``HF_HUB_CACHE`` layout) as
    ``repo_id`` at ``revision``, the way ``huggingface_hub`` leaves a download; returns the snapshot folder.
    ``commit`` is the snapshot's hash (default: derived from the repo and revision)."""
    import hashlib
    import shutil

    commit = commit or hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot, dirs_exist_ok=True)
    if revision != commit:  # a branch or tag: refs/<revision> names the commit
        (repo / "refs" / revision).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
    return snapshot


def run_under_interpreter(test_file: str | Path, keyword: str = "interp", timeout: int = 900):
    """Run the ``keyword`` cases of ``test_file`` in a fresh pytest process with Triton's interpreter
    switched on (it must be set before anything imports triton). Returns ``(returncode, output tail,
    number of tests passed)``."""
    import os
    import re
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    test_file = Path(test_file).resolve()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W", "ignore",
         str(test_file), "-k", keyword],
        cwd=test_file.parent, env=env, capture_output=True, text=True, timeout=timeout,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    passed = re.search(r"(\d+) passed", tail)
    return proc.returncode, tail, int(passed.group(1)) if passed else 0


def prefill_context(q, k, v, query_len: int, scale: float, block_size: int = 16, layer_id: int = 3, seed: int = 0):
    """``(q_chunk, ctx)``: one sequence of ``T`` tokens (``q [T, H, D]``, ``k``/``v`` ``[T, Hkv, D]``) whose
    last ``query_len`` tokens are a prefill chunk, as a policy sees it: a :class:`~nanovllm.policy.PolicyContext`
    over a paged cache that already holds every key, its blocks in a shuffled order, on the torch backend."""
    import torch

    from nanovllm.attention.metadata import PhaseMetadata
    from nanovllm.attention.torch_backend import TorchBackend
    from nanovllm.policy import PolicyContext

    n = k.shape[0]
    width = -(-n // block_size)
    table = torch.randperm(width, generator=torch.Generator().manual_seed(seed)).int()
    pad = width * block_size - n

    def paged(x):
        cache = torch.zeros(width, block_size, *x.shape[1:], dtype=x.dtype)
        cache[table.long()] = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).view(width, block_size, *x.shape[1:])
        return cache

    meta = PhaseMetadata(torch.tensor([0, query_len], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                         table[None, :], query_len, n)
    chunk = slice(n - query_len, n)
    ctx = PolicyContext(layer_id, True, q[chunk], meta, paged(k), paged(v), scale, TorchBackend(), None, k[chunk],
                        v[chunk], torch.arange(n - query_len, n))
    return q[chunk], ctx
