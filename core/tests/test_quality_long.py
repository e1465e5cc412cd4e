"""Long-context quality tasks: the pass-key prompt builder and its scoring, the perplexity inputs, and the
benchmark script end to end on the tiny random model (engine and transformers, trial by trial)."""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path

import pytest

from nanovllm.quality import long_context as lc
from nanovllm.quality import passkey as pk

ROOT = Path(__file__).resolve().parents[2]


class WordTokenizer:
    """Words and punctuation as tokens, ids given in order of first sight; BOS is id 1."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {"<bos>": 1}
        self.words = {1: "<bos>"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [1] if add_special_tokens else []
        for word in re.findall(r"\w+|[^\w\s]|\n", text):
            if word not in self.vocab:
                self.vocab[word] = len(self.vocab) + 1
                self.words[self.vocab[word]] = word
            ids.append(self.vocab[word])
        return ids

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.words[i] for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.words[i] for i in ids if not (skip_special_tokens and i == 1))


@pytest.fixture
def tok() -> WordTokenizer:
    return WordTokenizer()


@pytest.mark.parametrize("length", [100, 257, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_prompt_is_exact_in_tokens_with_the_key_at_its_depth(tok, length, depth):
    filler = pk.classic_filler_ids(tok, length)
    p = pk.build_prompt(tok, filler, length, depth, "12345")
    ids = p.token_ids
    assert len(ids) == p.length == length
    assert ids[0] == 1 and 1 not in ids[1:]  # BOS once, first
    needle = tok.encode(pk.KEY_LINE.format(key="12345"), add_special_tokens=False)
    assert ids[p.key_position : p.key_position + len(needle)] == needle
    question = tok.encode(pk.QUESTION, add_special_tokens=False)
    assert ids[-len(question):] == question
    head = 1 + len(tok.encode(pk.INSTRUCTION, add_special_tokens=False))
    budget = length - head - len(needle) - len(question)
    cut = p.key_position - head
    assert abs(cut - depth * budget) <= 11  # the classic filler ends a sentence every 5 tokens at most
    assert cut == 0 or tok.words[ids[p.key_position - 1]] == "."  # the key starts after a sentence
    assert ids[head : p.key_position] + ids[p.key_position + len(needle) : -len(question)] == filler[:budget]


def test_key_moves_with_depth_and_keys_are_seeded(tok):
    filler = pk.classic_filler_ids(tok, 2000)
    positions = [pk.build_prompt(tok, filler, 2000, d, "11111").key_position for d in pk.DEFAULT_DEPTHS]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    keys = [pk.key_for(7, "classic", 2048, d, t) for d in pk.DEFAULT_DEPTHS for t in range(2)]
    assert keys == [pk.key_for(7, "classic", 2048, d, t) for d in pk.DEFAULT_DEPTHS for t in range(2)]
    assert all(len(k) == 5 and k.isdigit() for k in keys) and len(set(keys)) > 12
    assert keys != [pk.key_for(8, "classic", 2048, d, t) for d in pk.DEFAULT_DEPTHS for t in range(2)]


def test_cut_falls_between_tokens_where_no_sentence_ends(tok):
    words = tok.encode(" ".join(f"w{i}" for i in range(3000)), add_special_tokens=False)
    p = pk.build_prompt(tok, words, 1500, 0.5, "22222")
    head = 1 + len(tok.encode(pk.INSTRUCTION, add_special_tokens=False))
    needle = len(tok.encode(pk.KEY_LINE.format(key="22222"), add_special_tokens=False))
    question = len(tok.encode(pk.QUESTION, add_special_tokens=False))
    assert p.key_position - head == round(0.5 * (1500 - head - needle - question))


def test_prompts_cover_every_filler_length_depth_and_trial(tok):
    fillers = {"classic": pk.classic_filler_ids(tok, 600), "natural": tok.encode("A b. " * 400, False)}
    prompts = pk.build_prompts(tok, fillers, [300, 600], [0.25, 0.75], trials_per_depth=3, seed=1)
    assert len(prompts) == 2 * 2 * 2 * 3
    assert {(p.filler, p.length, p.depth, p.trial) for p in prompts} == {
        (f, n, d, t) for f in fillers for n in (300, 600) for d in (0.25, 0.75) for t in range(3)}
    assert all(len(p.token_ids) == p.length for p in prompts)


def test_bad_prompt_requests_are_refused(tok):
    filler = pk.classic_filler_ids(tok, 100)
    with pytest.raises(ValueError, match="no room for filler"):
        pk.build_prompt(tok, filler, 40, 0.5, "12345")
    with pytest.raises(ValueError, match="fewer than"):
        pk.build_prompt(tok, filler[:10], 500, 0.5, "12345")
    with pytest.raises(ValueError, match="depth"):
        pk.build_prompt(tok, filler, 200, 1.5, "12345")


def test_scoring_is_an_exact_match_of_the_first_number():
    assert pk.is_hit(" 12345. Remember it.", "12345")
    assert pk.is_hit("12345", "12345")
    assert not pk.is_hit(" 1234", "12345")
    assert not pk.is_hit(" 123456", "12345")
    assert not pk.is_hit(" 54321 or 12345", "12345")
    assert not pk.is_hit(" the key", "12345")
    trials = [{"filler": "classic", "length": 8, "hit": h} for h in (True, False, True)]
    trials.append({"filler": "natural", "length": 8, "hit": False})
    assert pk.accuracy_table(trials) == {"classic": {8: [2, 3]}, "natural": {8: [0, 1]}}


def test_perplexity_inputs_share_their_final_window(tok):
    text = list(range(100, 1100))
    inputs = lc.perplexity_inputs(tok, [128, 256, 1000], text)
    assert {n: len(ids) for n, ids in inputs.items()} == {128: 128, 256: 256, 1000: 1000}
    assert all(ids[0] == 1 for ids in inputs.values())
    assert inputs[128][1:] == inputs[256][-127:] == inputs[1000][-127:] == text[872:999]


@pytest.mark.parametrize("length,heads", [(32768, 4), (16384, 4), (8192, 32), (2048, 4), (512, 8)])
def test_transformers_batches_keep_eager_scores_near_16_gib(length, heads):
    batch = lc.hf_batch(length, heads)
    per_prompt = 12 * heads * length * length  # bytes: the scores and their float32 softmax
    assert batch >= 1
    assert batch == 1 or batch * per_prompt <= 16 << 30 < (batch + 1) * per_prompt


def test_full_attention_layers_read_layer_types():
    assert lc.full_attention_layers({"num_hidden_layers": 3}) == [0, 1, 2]
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    assert lc.full_attention_layers({"num_hidden_layers": 12, "layer_types": kinds * 2}) == [5, 11]


def _script():
    spec = importlib.util.spec_from_file_location("long_context_quality", ROOT / "benchmarks" /
                                                  "long_context_quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_end_to_end_on_the_tiny_model(tmp_path, tiny_model, one_thread):
    """Every task, dense and Quest in the engine next to transformers, on prompts as long as the model's
    max_position_embeddings (the answers go past it, as in transformers); a failing selection is recorded."""
    from nanovllm.plugins import get_plugins

    registry = get_plugins().registry
    if "quest" not in registry.sparse_policies or "LlamaForCausalLM" not in registry.model_families:
        pytest.skip("needs the nanovllm-quest and nanovllm-llama plugins")
    model = tiny_model("LlamaForCausalLM", max_position_embeddings=256)

    rng = random.Random(0)
    text = tmp_path / "text.txt"  # words of the tiny vocabulary, so the natural filler is not all unknown
    text.write_text(" ".join(f"tok{rng.randrange(3, 256)}" for _ in range(2000)))
    quest = "quest:token_budget=64,skip_layers=0"
    rc = _script().main([
        "--model", str(model), "--lengths", "128,256", "--depths", "0.2,0.8", "--trials-per-depth", "1",
        "--policies", f"full;{quest};quest:token_budget=0", "--tail-tokens", "32",
        "--attention-queries", "16",
        "--text-file", str(text), "--prefill-chunk", "128", "--device", "cpu", "--out", str(tmp_path),
        "--name", "tiny",
    ])
    assert rc == 1  # the bad selection failed
    result = json.loads((tmp_path / "tiny.json").read_text())
    assert "partial" not in result  # the checkpoints written after each phase were replaced by the whole
    assert (tmp_path / "tiny.md").is_file()
    assert {"passkey full", f"passkey {quest}", "passkey transformers", "perplexity full",
            "attention capture", f"attention {quest}"} <= {p["name"] for p in result["phases"] if p["ok"]}
    assert "token_budget" in result["errors"]["passkey quest:token_budget=0"]
    trials = result["passkey"]["trials"]
    assert len(trials) == 2 * 2 * 2
    for t in trials:
        assert t["answers"]["full"] == t["answers"]["transformers"]  # greedy, float32: token for token
        assert set(t["answers"]) == {"full", quest, "transformers"}
    assert result["passkey"]["differences"]["full vs transformers"] == []
    ppl = result["perplexity"]
    for length in ("128", "256"):
        assert ppl["full"][length]["perplexity"] == pytest.approx(ppl["transformers"][length]["perplexity"],
                                                                  rel=1e-3)
    assert ppl["full"]["128"]["perplexity"] != ppl["full"]["256"]["perplexity"]  # more context, another score
    assert ppl[quest]["256"]["decode_density"] < 1.0  # Quest chose among the blocks while scoring the tail
    att = result["attention"][quest]
    for form in ("per_head", "gqa_shared"):
        summary = att[form]["summary"]
        assert 0 < summary["mass_recall"] <= 1 and 0 < summary["density"] < 1
        assert summary["gap"] == pytest.approx(summary["oracle_mass_recall"] - summary["mass_recall"])
    # per query head the oracle, at the same budget, keeps at least the mass the policy keeps on every head
    for layer in att["per_head"]["layers"]:
        heads = zip(layer["per_head"]["policy"]["mass_recall"], layer["per_head"]["oracle"]["mass_recall"],
                    strict=True)
        assert all(o >= p - 1e-9 for p, o in heads)
    assert "skipped" in result["attention"]["full"]


def test_a_run_whose_every_phase_fails_still_reports(tmp_path, model, one_thread):
    """Results are checkpointed after each phase, and a run with no answer still writes its tables."""
    saved = []
    settings = lc.LongContextSettings(model=model, lengths=[128], depths=[0.5], trials_per_depth=1,
                                      policies=["nosuchpolicy"], tasks=["passkey"], hf=False, device="cpu")
    result = lc.run(settings, checkpoint=lambda r: saved.append(json.loads(json.dumps(r, default=str))))
    assert list(result["errors"]) == ["passkey nosuchpolicy"]
    assert "nosuchpolicy" in result["errors"]["passkey nosuchpolicy"]
    assert len(saved) == 1 and saved[0]["phases"][0]["ok"] is False
    paths = lc.write_results(result, tmp_path, "failed")
    assert "error in passkey nosuchpolicy" in paths[1].read_text()
