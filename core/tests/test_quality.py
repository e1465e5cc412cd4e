"""The attention-quality harness: planted truths, selection metrics, the corpus finder, the evaluator.

Quality numbers come from the real built-in model only (``nanovllm bench quality``); here planted
structure and tiny random models check the plumbing and the invariants.
"""

from __future__ import annotations

import pytest
import torch
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.hookspecs import hookimpl
from nanovllm.kv import KVWrite
from nanovllm.plugins import get_plugins, reload_plugins
from nanovllm.policy import PolicyContext
from nanovllm.quality import corpus, planted
from nanovllm.quality.capture import Capture, LayerActivations
from nanovllm.quality.evaluate import decode_positions, evaluate_policy, mean_over_layers
from nanovllm.quality.metrics import (
    compare_key_masks,
    compare_selection,
    dense_attention,
    key_mask_quality,
    oracle_selection,
    random_selection,
    selection_quality,
)
from nanovllm.sparse import SparsePolicy

ALL_POSITIONS = None  # every query position of a planted case


def dense_of(case: planted.PlantedAttention, positions=ALL_POSITIONS):
    positions = torch.arange(case.num_tokens) if positions is None else torch.as_tensor(positions)
    return dense_attention(case.q[positions], case.k, case.v, positions, case.scale)


def all_blocks(dense, block_size: int) -> torch.Tensor:
    """Every block up to the last one any query sees, as a shared selection (future blocks included)."""
    width = -(-dense.num_keys // block_size)
    return torch.arange(width, dtype=torch.int32).expand(dense.probs.shape[0], width)


# -- planted structure ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(planted.GENERATORS))
def test_planted_truth_dominates_dense_attention(name):
    case = planted.GENERATORS[name]()
    group = case.q.shape[1] // case.num_kv_heads
    assert case.q.shape == (512, 4, 64) and case.k.shape == case.v.shape == (512, 2, 64)
    future = ~torch.ones(512, 512, dtype=torch.bool).tril()
    assert not (case.truth & future[:, None, :]).any(), "truth is causal"
    probs = dense_of(case).probs
    truth = case.truth.repeat_interleave(group, dim=1)
    rows = truth.any(-1)
    rows[:256] = False  # the second half: long histories, where sparsity matters
    assert rows.float().mean() > 0.1
    mass = (probs * truth).sum(-1)[rows]
    density = (truth.sum(-1) / torch.arange(1, 513)[:, None])[rows]
    least = 0.8 if name != "needles" else 0.75
    assert mass.mean() > least, f"{name}: truth holds {mass.mean():.3f} of the mass"
    assert density.mean() < 0.15, f"{name}: truth covers {density.mean():.3f} of the keys"


def test_needle_is_the_top_key_despite_distractors():
    case = planted.needles()
    probs = dense_of(case).probs.view(512, 2, 2, 512)
    for g in range(2):
        needle = int(case.truth[-1, g].nonzero())
        later = probs[needle:, g]
        assert (later.argmax(-1) == needle).float().mean() > 0.95
        distractor_like = (later > 0.01).sum(-1).float().mean()
        assert distractor_like >= 4, "the near misses take visible mass too"


def test_planted_cases_are_seeded_and_per_head():
    a, b, c = (planted.vertical_columns(seed=s) for s in (1, 1, 2))
    assert torch.equal(a.q, b.q) and torch.equal(a.truth, b.truth)
    assert not torch.equal(a.truth, c.truth)
    for case in (a, planted.needles(), planted.block_clusters()):
        assert not torch.equal(case.truth[-1, 0], case.truth[-1, 1]), f"{case.name}: heads share their truth"


def test_true_blocks_follow_the_true_keys():
    case = planted.block_clusters(num_tokens=200, block_size=16)
    blocks = case.true_blocks()
    assert blocks.shape == (200, 2, 13)
    last = case.truth[-1]
    for g in range(2):
        expected = {int(s) // 16 for s in last[g].nonzero()}
        assert set(blocks[-1, g].nonzero().flatten().tolist()) == expected and len(expected) == 3


# -- metrics ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("per_head", [False, True])
def test_full_selection_is_exact(per_head):
    case = planted.slash_diagonals(num_tokens=160)
    dense = dense_of(case)
    sel = all_blocks(dense, 16)
    if per_head:
        sel = sel[:, None, :].expand(-1, 2, -1)
    q = selection_quality(dense, sel, 16, policy_output=dense.output)
    assert q.mass_recall.dtype == q.topk_recall.dtype == q.density.dtype == torch.float64
    assert (q.mass_recall - 1).abs().max() < 1e-12
    assert torch.equal(q.topk_recall, torch.ones_like(q.topk_recall))
    assert q.output_error.max() < 1e-12 and q.policy_output_error.max() < 1e-12
    assert torch.equal(q.density, torch.ones_like(q.density))
    assert q.num_blocks.tolist() == [[t // 16 + 1] * 2 for t in range(160)], "future blocks do not count"


def test_empty_selection():
    dense = dense_of(planted.sink_columns(num_tokens=64))
    q = selection_quality(dense, torch.full((64, 3), -1, dtype=torch.int32), 16)
    assert q.mass_recall.max() == 0 and q.topk_recall.max() == 0 and q.density.max() == 0
    assert torch.equal(q.output_error, torch.ones_like(q.output_error))


def test_shared_and_per_head_forms_agree():
    case = planted.needles(num_tokens=256)
    dense = dense_of(case, range(96, 256, 16))
    shared = torch.tensor([[0, 3, 5, -1]] * 10, dtype=torch.int32)
    a = selection_quality(dense, shared, 16)
    b = selection_quality(dense, shared[:, None, :].expand(-1, 2, -1), 16)
    for field in ("mass_recall", "topk_recall", "output_error", "density", "num_blocks"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    per_head = torch.tensor([[[0, 3, -1], [5, -1, -1]]] * 10, dtype=torch.int32)
    c = selection_quality(dense, per_head, 16)
    assert c.num_blocks[:, 0].tolist() == [2] * 10 and c.num_blocks[:, 1].tolist() == [1] * 10
    assert (c.mass_recall <= a.mass_recall + 1e-12).all(), "each head's blocks are among the shared ones"
    assert (c.density[:, 1] < a.density[:, 1]).all()


def test_selection_form_errors_name_the_fix():
    dense = dense_of(planted.sink_columns(num_tokens=64))
    with pytest.raises(ValueError, match=r"expected \[64, k\] \(all heads\) or \[64, 2, k\]"):
        selection_quality(dense, torch.zeros(64, 3, 2, dtype=torch.int32), 16)
    with pytest.raises(TypeError, match="integer block indices"):
        selection_quality(dense, torch.zeros(64, 2), 16)
    with pytest.raises(ValueError, match="below -1"):
        selection_quality(dense, torch.full((64, 2), -2, dtype=torch.int32), 16)


@pytest.mark.parametrize("name", list(planted.GENERATORS))
def test_oracle_beats_random_and_any_selection_of_its_size(name):
    case = planted.GENERATORS[name](num_tokens=384)
    dense = dense_of(case, range(159, 384, 32))
    counts = torch.full((8, 2), 3)
    oracle = selection_quality(dense, oracle_selection(dense, counts, 16), 16)
    assert oracle.num_blocks.tolist() == counts.tolist()
    group_mass = oracle.mass_recall.view(8, 2, 2).mean(-1)
    for seed in range(5):
        rand = selection_quality(dense, random_selection(dense, counts, 16, seed), 16)
        assert rand.num_blocks.tolist() == counts.tolist()
        assert (group_mass >= rand.mass_recall.view(8, 2, 2).mean(-1) - 1e-12).all()
    assert oracle.mass_recall.mean() > rand.mass_recall.mean() + 0.2


def test_oracle_finds_each_heads_needle_with_one_block():
    case = planted.needles(num_tokens=512)
    positions = range(511, 512)
    dense = dense_of(case, positions)
    sel = oracle_selection(dense, torch.ones(1, 2, dtype=torch.long), 16)
    truth = case.true_blocks()[511]
    assert [truth[g, int(sel[0, g, 0])] for g in range(2)] == [True, True]
    result = compare_selection(dense, torch.tensor([[0]], dtype=torch.int32), 16)
    assert result["oracle"].mass_recall.mean() > 0.6 > result["policy"].mass_recall.mean()
    assert result["oracle"].density.tolist() == result["policy"].density.tolist()


def test_key_masks_full_is_exact_and_the_oracle_bounds_any_mask_of_its_size():
    case = planted.vertical_columns(num_tokens=256)
    dense = dense_of(case, range(63, 256, 16))
    everything = torch.ones_like(dense.probs, dtype=torch.bool)
    full = key_mask_quality(dense, everything)
    assert torch.allclose(full.mass_recall, torch.ones_like(full.mass_recall))
    assert float(full.output_error.max()) < 1e-12 and float(full.density.min()) == 1.0
    # a pattern of the 8 oldest keys: the oracle at the same count holds at least its mass, random less
    keys = torch.arange(256)
    oldest = (keys < 8).expand_as(dense.probs).clone()
    result = compare_key_masks(dense, oldest, seed=1)
    for which in ("policy", "oracle", "random"):
        assert result[which].num_blocks.tolist() == [[8] * 4] * len(dense.positions)
        assert result[which].summary()["keys"] == 8
    assert (result["oracle"].mass_recall >= result["policy"].mass_recall - 1e-12).all()
    assert result["oracle"].mass_recall.mean() > result["random"].mass_recall.mean()
    with pytest.raises(ValueError, match=r"\[Q, H, T\]"):
        key_mask_quality(dense, oldest[:, :2])


def test_selections_are_ascending_and_padded():
    dense = dense_of(planted.local_band(num_tokens=200), range(15, 200, 16))
    counts = torch.randint(0, 5, (12, 2), generator=torch.Generator().manual_seed(0))
    for sel in (oracle_selection(dense, counts, 16), random_selection(dense, counts, 16, seed=3)):
        assert sel.dtype == torch.int32
        for row, n in zip(sel.reshape(-1, sel.shape[-1]).tolist(), counts.flatten().tolist(), strict=True):
            valid = [b for b in row if b >= 0]
            assert row == valid + [-1] * (len(row) - n) and valid == sorted(set(valid)) and len(valid) == n


# -- corpus -------------------------------------------------------------------------------------------------


class WordTokenizer:
    def encode(self, text: str) -> list[str]:
        return text.split()


def installed_gpl3() -> corpus.CorpusText:
    found = next(corpus.candidates(), None)
    if found is None or "General Public License" not in found.name:
        pytest.skip("no copy of the GPL-3 text on this machine")
    return found


def test_gpl3_is_found_and_is_the_published_text():
    text = installed_gpl3()
    assert text.sha256 == corpus.GPL3_SHA256
    assert text.text.startswith("GNU GENERAL PUBLIC LICENSE\nVersion 3, 29 June 2007\n")
    ids, chosen = corpus.corpus_tokens(WordTokenizer(), 4000)
    assert len(ids) == 4000 and chosen.text == text.text


def test_gpl3_inside_another_file_is_the_same_text(tmp_path):
    text = installed_gpl3().text
    wrapped = tmp_path / "LICENSE.txt"
    body = "\n".join("    " + line for line in text.splitlines())
    wrapped.write_text("Bundled license of some library.\n\n" + body + "\n\nName: another library\n")
    altered = tmp_path / "COPYING"
    altered.write_text(text.replace("Everyone is permitted", "No one is permitted"))
    first = next(corpus.candidates([altered, wrapped]))
    assert first.source == str(wrapped) and first.text == text
    assert corpus.gpl3_text(altered.read_text()) is None


def test_longest_file_is_the_fallback_and_too_short_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "_pydoc_topics", lambda: None)
    short, long = tmp_path / "NOTICE", tmp_path / "LICENSE"
    short.write_text("word " * 50)
    long.write_text("other " * 300)
    ids, chosen = corpus.corpus_tokens(WordTokenizer(), 200, [short, long])
    assert chosen.source == str(long) and ids == ["other"] * 200
    with pytest.raises(FileNotFoundError, match=r"no text of 400 tokens.*\(300 tokens\).*Ask for fewer"):
        corpus.corpus_tokens(WordTokenizer(), 400, [short, long])


def test_joined_texts_follow_each_other_once_and_too_few_is_a_clear_error(tmp_path, monkeypatch):
    topics = corpus.CorpusText("topics", "pydoc", "topic " * 100)
    monkeypatch.setattr(corpus, "_pydoc_topics", lambda: topics)
    short, long = tmp_path / "NOTICE", tmp_path / "LICENSE"
    short.write_text("word " * 50)
    long.write_text("other " * 300)
    ids, used = corpus.joined_corpus_tokens(WordTokenizer(), 250, [short, long])
    assert ids == ["topic"] * 100 + ["other"] * 150
    assert [t.name for t in used] == ["topics", "longest license or notice file"]
    ids, used = corpus.joined_corpus_tokens(WordTokenizer(), 60, [short, long])
    assert ids == ["topic"] * 60 and len(used) == 1  # the first text alone, when it is long enough
    # the longest file is the same text as the topics: counted once
    same = corpus.CorpusText("topics", "pydoc", long.read_text())
    monkeypatch.setattr(corpus, "_pydoc_topics", lambda: same)
    with pytest.raises(FileNotFoundError, match=r"hold 300 tokens together, fewer than 400: topics at"):
        corpus.joined_corpus_tokens(WordTokenizer(), 400, [short, long])


def test_a_named_text_file_is_read_alone_and_its_errors_name_the_fix(tmp_path):
    mine = tmp_path / "essay.txt"
    mine.write_text("mine " * 30)
    ids, chosen = corpus.corpus_tokens(WordTokenizer(), 20, text_file=mine)
    assert ids == ["mine"] * 20 and chosen.source == str(mine) and chosen.name == "the file essay.txt"
    with pytest.raises(FileNotFoundError, match=r"no text of 40 tokens.*essay.txt \(30 tokens\)"):
        corpus.corpus_tokens(WordTokenizer(), 40, text_file=mine)
    with pytest.raises(FileNotFoundError, match=r"'.*absent.txt' does not exist; name a UTF-8 text file"):
        corpus.corpus_tokens(WordTokenizer(), 20, text_file=tmp_path / "absent.txt")


def test_python_documentation_is_the_long_candidate():
    texts = list(corpus.candidates([]))
    if not texts:
        pytest.skip("this Python has no pydoc_data")
    [docs] = texts
    assert "documentation topics" in docs.name and len(docs.text) > 200_000


# -- the evaluator, on planted activations --------------------------------------------------------------


class EdgeBlocks(SparsePolicy):
    """First and last history block of every sequence (shared form)."""

    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        last = ctx.num_history_blocks.to(torch.int32)[:, None] - 1
        first = torch.zeros_like(last).masked_fill(last < 0, -1)  # no history (a first chunk): nothing
        return torch.cat([first, torch.where(last > 0, last, -1)], dim=1)


class Recorder(SparsePolicy):
    """Keeps each layer's key sum per block from the hooks; selects every block once it has seen them."""

    requires_block_selection = True

    last: Recorder | None = None

    def initialize(self, num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device) -> None:
        Recorder.last = self
        self.calls: list[str] = []
        self.sums = torch.full((num_layers, num_blocks, num_kv_heads, head_dim), float("nan"))

    def on_blocks_allocated(self, block_ids: torch.Tensor) -> None:
        self.calls.append(f"allocated {len(block_ids)}")
        self.sums[:, block_ids] = 0.0

    def on_kv_write(self, write: KVWrite) -> None:
        self.calls.append(f"write {write.layer_id} {write.key.shape[0]}")
        self.sums[write.layer_id].index_add_(0, write.block_ids, write.key.float())

    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        self.calls.append(f"select {ctx.layer_id}")
        assert not self.sums[ctx.layer_id].isnan().any()
        return ctx.all_history_blocks()

    def compute_chunked_decode(self, q, ctx: PolicyContext) -> torch.Tensor:
        assert ctx.selected_blocks is not None, "the evaluator hands over the selection as the engine does"
        return super().compute_chunked_decode(q, ctx)


class Broken(SparsePolicy):
    def select_blocks(self, ctx: PolicyContext) -> torch.Tensor:
        raise RuntimeError("this policy cannot select")


class TestPlugin:
    @hookimpl
    def register_sparse_policies(self, registry) -> None:
        registry.add_sparse_policy("edge_blocks", f"{__name__}:EdgeBlocks")
        registry.add_sparse_policy("recorder", f"{__name__}:Recorder")
        registry.add_sparse_policy("broken", f"{__name__}:Broken")


@pytest.fixture
def test_policies():
    get_plugins().register(TestPlugin(), "quality-tests")
    yield
    reload_plugins()


def planted_capture(num_tokens: int = 256) -> Capture:
    cases = [planted.needles(num_tokens, seed=1), planted.local_band(num_tokens, seed=2)]
    layers = [LayerActivations(i * 3, c.q, c.k, c.v, c.scale) for i, c in enumerate(cases)]
    return Capture(list(range(num_tokens)), layers, 4, 16, torch.float32, torch.device("cpu"), TorchBackend())


def test_decode_positions_are_block_ends_past_the_first_quarter():
    pos = decode_positions(4096, 32, 16)
    assert len(pos) == 32 and pos == sorted(set(pos)) and pos[-1] == 4095 and pos[0] > 1024
    assert all((p + 1) % 16 == 0 for p in pos)
    assert decode_positions(100, 32, 16) == [31, 47, 63, 79, 95]


def test_full_policy_is_exact_on_captured_activations(test_policies):
    layers = evaluate_policy("full", planted_capture(), decode_positions(256, 8, 16))
    assert [x["layer"] for x in layers] == [0, 3]
    for x in layers:
        assert x["policy"]["mass_recall"] == pytest.approx(1) and x["policy"]["density"] == 1
        assert x["policy"]["policy_output_error"] < 1e-3  # float32 (logits in the thousands) against float64
        selection_only = {k: v for k, v in x["policy"].items() if k != "policy_output_error"}
        assert x["oracle"] == x["random"] == selection_only


def test_a_policys_own_output_matches_its_selection(test_policies):
    capture = planted_capture()
    layers = evaluate_policy("edge_blocks", capture, decode_positions(256, 8, 16))
    for x in layers:
        p = x["policy"]
        assert p["blocks"] == 2 and p["policy_output_error"] == pytest.approx(p["output_error"], abs=1e-4)
        assert x["oracle"]["mass_recall"] >= p["mass_recall"] and x["oracle"]["blocks"] == 2
    band = layers[1]  # the local band sits in the last block: edge blocks hold most of its mass
    assert band["policy"]["mass_recall"] > 0.4 > band["random"]["mass_recall"]
    mean = mean_over_layers(layers)
    densities = [x["policy"]["density"] for x in layers]
    assert mean["policy"]["density"] == pytest.approx(sum(densities) / 2)


def test_metadata_policies_see_allocation_and_every_key_before_selecting(test_policies):
    capture = planted_capture(200)
    evaluate_policy("recorder", capture, [63, 127, 191])
    policy = Recorder.last
    assert policy.calls == ["allocated 13", "write 0 200", "select 0", "write 3 200", "select 3"]
    k = capture.layers[1].k
    expected = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, 8)).view(13, 16, 2, 64).sum(1)
    assert torch.allclose(policy.sums[3], expected, atol=1e-4)


def test_a_prefill_only_policy_is_refused(test_policies, monkeypatch):
    monkeypatch.setattr(EdgeBlocks, "supports_decode", False)
    with pytest.raises(ValueError, match="runs only prefill"):
        evaluate_policy("edge_blocks", planted_capture(), [255])


# -- capture and the bench job on a tiny random model (plumbing only: no quality is claimed) ----------------


def test_capture_reproduces_the_engines_attention(tiny_model, one_thread):
    from nanovllm import LLM
    from nanovllm.quality.capture import capture_activations

    llm = LLM(tiny_model("LlamaForCausalLM"), device="cpu", max_model_len=256, enforce_eager=True,
              async_scheduling=False, max_num_batched_tokens=64)
    module = llm.runner.attention_layers[1]
    outputs = []
    handle = module.register_forward_hook(lambda _m, _args, out: outputs.append(out.detach().clone()))
    ids = [3 + i % 200 for i in range(200)]
    capture = capture_activations(llm, ids, [1])
    handle.remove()
    [layer] = capture.layers
    assert layer.q.shape == (200, 4, 16) and layer.k.shape == layer.v.shape == (200, 2, 16)
    assert capture.num_layers == 2 and capture.backend is llm.runner.backend
    positions = [0, 63, 64, 150, 199]  # chunk edges included: the capture joins the four prefill chunks
    dense = dense_attention(layer.q[positions], layer.k, layer.v, positions, layer.scale)
    assert torch.allclose(dense.output.float(), torch.cat(outputs)[positions], atol=1e-5)
    with pytest.raises(RuntimeError, match="fresh engine"):  # the prompt's blocks are now prefix-cache hits
        capture_activations(llm, ids, [1])
    with pytest.raises(ValueError, match=r"layers \[5\] do not exist"):
        capture_activations(llm, ids, [5])


def test_bench_quality_job_writes_results(tiny_model, tmp_path):
    import json

    from nanovllm import bench
    from nanovllm.cli import main as cli_main

    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    args = ["bench", "quality", "--model", tiny_model("LlamaForCausalLM"), "--tokens", "200",
            "--queries", "4", "--device", "cpu", "--out", str(tmp_path), "--name", "t", "--ppl-tail", "40",
            "--text", str(text), "--dtype", "float32"]
    assert cli_main(args) == 0
    payload = json.loads((tmp_path / "t.json").read_text())
    assert payload["settings"]["benchmark"] == "quality" and payload["settings"]["policies"] == ["full"]
    assert payload["settings"]["text_file"] == str(text) and payload["settings"]["dtype"] == "float32"
    [row] = payload["results"]
    assert row["text"]["source"] == str(text) and row["dtype"] == "float32"
    assert row["policy"] == "full" and row["tokens"] == 200 and row["layers"] == [0, 1]
    assert row["positions"] == decode_positions(200, 4, 16) and row["device"] == "cpu"
    assert row["text"]["sha256"] and row["text"]["source"]
    assert [x["layer"] for x in row["per_layer"]] == [0, 1]
    assert row["mean"]["policy"]["mass_recall"] == pytest.approx(1) and row["mean"]["policy"]["density"] == 1
    seq = row["sequence"]
    assert seq["ppl_tail_tokens"] == 40 and seq["ppl_vs_dense"] == 1 and seq["decode_density"] is None
    assert 1 < seq["perplexity"] < 10_000  # a random tiny model: a real, finite perplexity
    md = (tmp_path / "t.md").read_text()
    assert "| full | mean | 1.000 |" in md and "| perplexity |" in md

    row["sequence"]["perplexity"] = 12.5  # whole-sequence metrics become columns of the table
    (tmp_path / "t.json").write_text(json.dumps(payload))
    bench.render(tmp_path / "t.json")
    md = (tmp_path / "t.md").read_text()
    assert md.count("12.500") == 1


def test_bench_quality_refuses_an_unknown_policy_before_running(capsys):
    from nanovllm.cli import main as cli_main

    assert cli_main(["bench", "quality", "--policy", "no_such_policy"]) == 2
    assert "unknown sparse policy 'no_such_policy'" in capsys.readouterr().err


def test_a_failing_policy_leaves_the_others_rows(tiny_model, one_thread, test_policies):
    from nanovllm.bench import quality

    rows = quality.run(["broken", "edge_blocks"], model=tiny_model("LlamaForCausalLM"), tokens=160, queries=3,
                       device="cpu", ppl_tail=40)
    assert rows[0]["policy"] == "broken" and rows[0]["error"] == "RuntimeError: this policy cannot select"
    assert rows[1]["policy"] == "edge_blocks" and rows[1]["mean"]["policy"]["blocks"] == 2
    seq = rows[1]["sequence"]  # the tail went one token per step through its decode selection
    assert seq["ppl_tail_step"] == 1 and 0 < seq["decode_density"] < 1 and seq["ppl_vs_dense"] != 1
    payload = {"environment": {"device": "cpu", "date": "-", "commit": "-", "torch": "-"},
               "settings": {"benchmark": "quality"}, "results": rows}
    md = quality.markdown(payload, "t")
    assert "| edge_blocks | mean |" in md and "failed: broken: RuntimeError: this policy cannot select" in md


def test_a_per_head_metadata_policy_on_planted_needles():
    """The Quest-style test policy (per-KV-head selection from key min/max kept by on_kv_write)."""
    from quest_style import Plugin

    get_plugins().register(Plugin(), "quest-style")
    try:
        layers = evaluate_policy("quest_style:budget_blocks=2", planted_capture(), [191, 223, 255])
    finally:
        reload_plugins()
    needles = layers[0]
    p, oracle, rand = needles["policy"], needles["oracle"], needles["random"]
    assert p["blocks"] == oracle["blocks"] == rand["blocks"] == 2
    assert p["policy_output_error"] == pytest.approx(p["output_error"], abs=1e-4)
    assert oracle["mass_recall"] >= p["mass_recall"] > rand["mass_recall"] + 0.3


def test_a_phase_pair_is_measured_through_its_decode_policy(test_policies):
    from nanovllm.quality.evaluate import make_policy

    assert type(make_policy("prefill=full;decode=edge_blocks")).__name__ == "EdgeBlocks"
    assert type(make_policy({"decode": "edge_blocks"})).__name__ == "EdgeBlocks"


@pytest.mark.gpu
def test_bench_quality_runs_on_cuda(tiny_model, test_policies):
    """The harness on CUDA: capture, attention metrics and perplexity through the engine (triton backend,
    the tail one token per step through a decode selection). Plumbing on a tiny random model."""
    from nanovllm.bench import quality

    model = tiny_model("LlamaForCausalLM", hidden_size=128, intermediate_size=256)  # head size 32
    rows = quality.run(["full", "edge_blocks"], model=model, tokens=320, queries=4, device="cuda",
                       ppl_tail=48)
    assert [r["policy"] for r in rows] == ["full", "edge_blocks"] and all("error" not in r for r in rows)
    assert rows[0]["device"].startswith("cuda") and rows[0]["attention_backend"] == "triton"
    assert rows[0]["mean"]["policy"]["mass_recall"] == pytest.approx(1)
    assert rows[1]["mean"]["policy"]["density"] < 1 and rows[1]["sequence"]["ppl_tail_step"] == 1
    assert 0 < rows[1]["sequence"]["decode_density"] < 1 and rows[0]["sequence"]["ppl_vs_dense"] == 1


def test_bench_quality_refuses_a_missing_text_file_before_it_starts(tmp_path, capsys):
    from nanovllm.cli import main as cli_main

    assert cli_main(["bench", "quality", "--text", str(tmp_path / "absent.txt"), "--out", str(tmp_path)]) == 2
    assert "absent.txt' does not exist; name a UTF-8 text file" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no job ran, no results file
