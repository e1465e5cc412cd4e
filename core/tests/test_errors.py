"""Bad input: every mistake gets a clear error naming the problem and the fix, raised at the API
boundary before any work, and the engine stays usable afterwards with nothing left in the scheduler."""

from __future__ import annotations

import json
import shutil

import attrs
import pytest
import torch
from nanovllm import SamplingParams
from nanovllm.plugins import PluginError, PluginInfo, get_plugins
from nanovllm.selection import SelectionError

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
GOOD_PROMPTS = [[5, 6, 7, 8, 9], "tok40 tok41 tok42"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llm(model):
    from nanovllm import LLM

    return LLM(model, kv_cache_memory=1 << 24, device="cpu", max_model_len=32, block_size=4)


@pytest.fixture(scope="module")
def reference(llm):
    return [o.token_ids for o in llm.generate(GOOD_PROMPTS, GREEDY, use_tqdm=False)]


def assert_clean_and_usable(llm, reference) -> None:
    """Nothing from a failed call lingers, every block is free, and a valid call still works."""
    sched = llm.scheduler
    assert not sched.waiting and not sched.running
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks
    assert [o.token_ids for o in llm.generate(GOOD_PROMPTS, GREEDY, use_tqdm=False)] == reference


def make_llm(model, **kw):
    from nanovllm import LLM

    kw.setdefault("kv_cache_memory", 1 << 24)
    kw.setdefault("device", "cpu")
    return LLM(model, **kw)


# -- plugin selection: checked before the model directory is even read -----------------------------


@pytest.mark.parametrize(
    "option, value, error, words",
    [
        ("sparse_policy", "nope", PluginError, ["unknown sparse policy 'nope'", "Installed: ", "nanovllm plugins"]),
        ("sparse_policy", "ful", PluginError, ["Did you mean 'full'?"]),
        ("attention_backend", "nope", PluginError, ["unknown attention backend 'nope'", "torch", "nanovllm plugins"]),
        ("sparse_policy", "full:", SelectionError, ["no options after it", "write e.g."]),
        ("sparse_policy", "full:x", SelectionError, ["'x' is not 'key=value'", "write e.g."]),
        ("sparse_policy", ":x=1", SelectionError, ["no name", "write e.g."]),
        ("sparse_policy", "full:x=1,x=2", SelectionError, ["given twice"]),
        ("sparse_policy", "full:x=1", SelectionError, ["unknown option 'x'", "Accepted"]),
        ("attention_backend", "torch:x=1", SelectionError, ["takes no options", "x"]),
        ("attention_backend", "auto:x=1", SelectionError, ["'auto' takes no options"]),
        ("sparse_policy", {"topk": 8}, SelectionError, ["a dict selection has a 'name' key, or the keys 'prefill'"]),
        ("sparse_policy", {"name": "full", "topk": 8}, SelectionError, ["unknown option 'topk'"]),
        ("sparse_policy", 5, ValueError, ["sparse_policy must be a selection string"]),
    ],
)
def test_bad_selection_fails_before_loading(tmp_path, option, value, error, words):
    from nanovllm import LLM

    missing = tmp_path / "not-a-model"  # the selection error comes first: nothing is read or loaded
    with pytest.raises(error) as info:
        LLM(str(missing), **{option: value})
    for word in words:
        assert word in str(info.value)


def test_a_plugin_that_failed_to_load_reports_its_error(monkeypatch, tmp_path):
    from nanovllm import LLM
    from nanovllm import plugins as plugins_module

    real = get_plugins()
    error = "ImportError: no module named 'x'"
    broken = PluginInfo(
        "brokenpolicy", "nanovllm-brokenpolicy", "0.1.0", "nanovllm_brokenpolicy", error=error
    )
    fake = attrs.evolve(real, plugins=[*real.plugins, broken])
    monkeypatch.setattr(plugins_module, "_plugins", fake)
    with pytest.raises(PluginError, match="failed to load: ImportError: no module named 'x'") as info:
        LLM(str(tmp_path), sparse_policy="brokenpolicy:topk=4")
    assert "nanovllm-brokenpolicy" in str(info.value)


# -- engine options -------------------------------------------------------------------------------


def test_unknown_keyword_is_an_error_not_dropped(model):
    with pytest.raises(TypeError, match="unknown engine option") as info:
        make_llm(model, max_num_seq=4)
    assert "max_num_seq" in str(info.value) and "max_num_seqs" in str(info.value)  # lists the accepted ones


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(max_num_seqs=0), "max_num_seqs must be a positive int"),
        (dict(block_size=True), "block_size must be a positive int"),
        (dict(dtype="float8"), "dtype must be one of"),
        (dict(device="tpu"), "device must be one of"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in (0, 1]"),
        (dict(max_model_len=100_000), "exceeds the model's max_position_embeddings"),
        (dict(kv_cache_memory=1000), "raise kv_cache_memory or lower max_model_len"),
        (dict(tensor_parallel_size=3), "tensor_parallel_size=3 must divide the model's num_attention_heads"),
        (dict(hf_overrides={"max_position_embedding": 64}), "which LlamaConfig does not have"),
        (dict(hf_overrides=[("max_position_embeddings", 64)]), "must map config.json field names to values"),
        (dict(hf_overrides="max_position_embeddings=64"), "expected a JSON object"),
    ],
)
def test_bad_engine_options(model, kw, words):
    with pytest.raises(ValueError) as info:
        make_llm(model, **kw)
    assert words in str(info.value)


def test_hf_overrides_replace_config_fields_before_the_engine_is_built(model):
    """The tiny model's 512 positions, raised: the longer max_model_len is accepted, and the RoPE table
    the model builds from the config is as long."""
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=512"):
        make_llm(model, max_model_len=1024)
    llm = make_llm(model, max_model_len=1024, hf_overrides='{"max_position_embeddings": 1024}')
    assert llm.hf_config.max_position_embeddings == 1024
    rotary = next(m for m in llm.runner.model.modules() if type(m).__name__ == "RotaryEmbedding")
    assert rotary.cos_sin.shape[0] == 1024


# -- SamplingParams ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=1.0), "max_tokens"),
        (dict(stop=5), "stop"),
        (dict(stop=[""]), "stop"),
        (dict(stop=["ok", 3]), "stop"),
        (dict(stop_token_ids=7), "stop_token_ids"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=["a"]), "stop_token_ids"),
        (dict(seed="42"), "seed"),
        (dict(seed=1.5), "seed"),
        (dict(seed=False), "seed"),
        (dict(seed=2**64), "seed"),  # torch.Generator.manual_seed would fail inside a step
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=2.0), "logprobs"),
        (dict(logprobs=True), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(prompt_logprobs="5"), "prompt_logprobs"),
    ],
)
def test_invalid_sampling_params(kw, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kw)
    message = str(info.value)
    assert message.startswith(field) and "got" in message  # names the field, the rule and the value


def test_valid_sampling_params_edges():
    p = SamplingParams(temperature=0, top_p=1, top_k=-1, max_tokens=1, stop="x", stop_token_ids=(3,), seed=0)
    assert p.greedy and p.stop == ["x"] and p.stop_token_ids == [3]
    assert SamplingParams(top_k=1, top_p=1e-9, seed=-5).stop == []
    assert SamplingParams(logprobs=0, prompt_logprobs=0).logprobs == 0
    with pytest.raises(TypeError):
        SamplingParams(max_new_tokens=3)  # unknown field


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63)])
def test_extreme_seeds_run(llm, reference, seed):
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=seed)
    assert len(llm.generate(GOOD_PROMPTS, params, use_tqdm=False)[0].token_ids) == 3
    assert_clean_and_usable(llm, reference)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_more_logprobs_than_max_logprobs_is_refused_before_queueing(llm, reference, field):
    before = llm._next_request
    too_many = SamplingParams(temperature=0, max_tokens=2, **{field: 21})
    with pytest.raises(ValueError) as info:
        llm.generate(GOOD_PROMPTS, [GREEDY, too_many], use_tqdm=False)
    message = str(info.value)
    assert f"request 1 asks for {field}=21, more than max_logprobs=20" in message
    assert "LLM(..., max_logprobs=21)" in message  # the fix
    with pytest.raises(ValueError, match="max_logprobs=20"):
        llm.add_request(GOOD_PROMPTS[0], too_many)
    assert llm._next_request == before
    assert_clean_and_usable(llm, reference)
    ok = SamplingParams(temperature=0, max_tokens=2, **{field: 20})
    assert len(llm.generate(GOOD_PROMPTS[0], ok, use_tqdm=False)[0].token_ids) == 2


def test_max_logprobs_minus_one_allows_the_whole_vocabulary(model):
    llm = make_llm(model, max_logprobs=-1)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, logprobs=256), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == 256
    with pytest.raises(ValueError, match="more than the vocabulary's 256 tokens"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, prompt_logprobs=257), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs must be an int >= 0, or -1"):
        make_llm(model, max_logprobs=-2)


# -- prompts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts, error, words",
    [
        ("", ValueError, "prompt 0 is empty"),
        ([[]], ValueError, "prompt 0 is empty"),
        ("   ", ValueError, "prompt 0 is empty"),
        ([{"prompt_token_ids": []}], ValueError, "prompt 0 is empty"),
        ([{"text": "tok3"}], ValueError, "needs 'prompt' or 'prompt_token_ids'"),
        ([], ValueError, "non-empty list"),
        (None, ValueError, "non-empty list"),
        ([[5] * 32], ValueError, "max_model_len is 32"),
        ([[5] * 40], ValueError, "Shorten the prompt or raise max_model_len"),
        ([[5, -1]], ValueError, "outside the vocabulary [0, 256): [-1]"),
        ([[5, 256]], ValueError, "outside the vocabulary [0, 256): [256]"),
        ([[5, 10**12]], ValueError, "outside the vocabulary"),
        ([[5.0, 6.0]], TypeError, "must be a string, a list of token ids or a dict"),
        ([[True, 5]], TypeError, "must be a string, a list of token ids or a dict"),
        ([5, "tok3"], TypeError, "prompt 0 must be"),
        (["tok3", torch.tensor([3, 4])], TypeError, "prompt 1 must be"),
    ],
)
def test_bad_prompts(llm, reference, prompts, error, words):
    with pytest.raises(error) as info:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert words in str(info.value)
    assert_clean_and_usable(llm, reference)


def test_longest_prompt_that_fits(llm, reference):
    out = llm.generate([[5] * 31], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"  # max_model_len reached
    assert_clean_and_usable(llm, reference)


def test_one_bad_prompt_queues_nothing_from_the_batch(llm, reference):
    before = llm._next_request
    with pytest.raises(ValueError, match="prompt 2 has token id"):
        llm.generate(["tok3 tok4", [5, 6], [7, 999], "tok9"], GREEDY, use_tqdm=False)
    assert llm._next_request == before
    assert_clean_and_usable(llm, reference)


def test_sampling_params_must_match_the_prompts(llm, reference):
    with pytest.raises(ValueError, match="got 3 sampling_params for 2 prompts"):
        llm.generate(GOOD_PROMPTS, [GREEDY] * 3, use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams"):
        llm.generate(GOOD_PROMPTS, [GREEDY, {"temperature": 0}], use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams"):
        llm.generate(GOOD_PROMPTS, {"temperature": 0}, use_tqdm=False)
    assert_clean_and_usable(llm, reference)


def test_chat_needs_a_template_and_well_formed_messages(llm, reference):
    with pytest.raises(ValueError, match="no chat template; use generate"):
        llm.chat([{"role": "user", "content": "tok3"}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="conversation"):
        llm.chat([], GREEDY, use_tqdm=False)
    assert_clean_and_usable(llm, reference)


@pytest.mark.parametrize("fail_at", [0, 3])  # the first step, or one with a step in flight
def test_steps_that_keep_failing_end_every_request_with_an_error(llm, reference, monkeypatch, fail_at):
    """Each request is tried alone, fails there too, and ends with what it had made and the error."""
    launch, calls = llm.runner.launch, []

    def boom(seqs, *rest):
        calls.append(1)
        if len(calls) > fail_at:
            raise RuntimeError("device lost")
        return launch(seqs, *rest)

    monkeypatch.setattr(llm.runner, "launch", boom)
    outputs = llm.generate(GOOD_PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    for out, ref in zip(outputs, reference, strict=True):
        assert out.finished and out.finish_reason == "error"
        assert out.outputs[0].error == "RuntimeError: device lost"
        assert out.token_ids == ref[: len(out.token_ids)]
    assert_clean_and_usable(llm, reference)


@pytest.mark.parametrize("fail_at", [0, 3])
def test_a_failing_schedule_leaves_the_engine_usable(llm, reference, monkeypatch, fail_at):
    schedule, calls = llm.scheduler.schedule, []

    def boom():
        calls.append(1)
        if len(calls) > fail_at:
            raise KeyboardInterrupt
        return schedule()

    monkeypatch.setattr(llm.scheduler, "schedule", boom)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(GOOD_PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_clean_and_usable(llm, reference)


def test_an_interrupted_admission_frees_the_blocks_it_took(llm, reference, monkeypatch):
    """Interrupted after a waiting sequence got its blocks but before it left the queue."""
    bm = llm.scheduler.block_manager
    allocate = bm.allocate

    def interrupted(seq, hits, num_tokens):
        allocate(seq, hits, num_tokens)
        assert seq in llm.scheduler.waiting and seq.block_table
        raise KeyboardInterrupt

    monkeypatch.setattr(bm, "allocate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(GOOD_PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_clean_and_usable(llm, reference)


def test_generate_interrupted_between_steps_drops_only_its_own_requests(llm, reference, monkeypatch):
    other = llm.add_request(GOOD_PROMPTS[1], GREEDY)  # queued through the step API, before generate
    step, calls = llm.step, []

    def interrupted_after_step():
        finished = step()
        calls.append(1)
        if len(calls) == 3:  # a step is in flight, with tokens for the interrupted requests
            raise KeyboardInterrupt
        return finished

    monkeypatch.setattr(llm.llm_engine, "step", interrupted_after_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([GOOD_PROMPTS[0], [9, 8, 7, 6]], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert [s.request_id for s in llm.scheduler.running] == [other.request_id]
    while llm.scheduler.has_unfinished():  # the other request keeps going
        llm.step()
    assert other.completion_token_ids == reference[1] and other.finish_reason == "length"
    assert_clean_and_usable(llm, reference)


def test_abort_request_frees_waiting_and_running_requests(model, reference):
    from nanovllm.engine.sequence import PLACEHOLDER

    llm = make_llm(model, max_model_len=32, block_size=4, max_num_seqs=2)
    bm = llm.scheduler.block_manager
    keep = llm.add_request(GOOD_PROMPTS[0], GREEDY)
    running = llm.add_request(GOOD_PROMPTS[1], GREEDY)
    waiting = llm.add_request([9, 8, 7, 6], GREEDY)
    llm.step()
    llm.step()
    assert running.status.name == "RUNNING" and running.token_ids[-1] == PLACEHOLDER  # a step in flight
    assert waiting.status.name == "WAITING"
    llm.abort_request(running.request_id)
    llm.abort_request([waiting.request_id, "no-such-request"])
    for seq in (running, waiting):
        assert seq.is_finished and seq.finish_reason == "abort" and not seq.block_table
        assert PLACEHOLDER not in seq.token_ids
    tokens = list(running.token_ids)
    while llm.scheduler.has_unfinished():
        llm.step()
    assert running.token_ids == tokens  # the token its step in flight sampled was discarded
    assert keep.completion_token_ids == reference[0]
    assert bm.num_free_blocks == bm.num_usable_blocks
    out = llm.generate(GOOD_PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in out] == reference


# -- model directories ------------------------------------------------------------------------------


def copy_model(model, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(model, target)
    return target


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_model_directory(tmp_path):
    with pytest.raises(ValueError, match="is not a directory, nor a hub ID"):
        make_llm(str(tmp_path / "nowhere"))


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ValueError, match="has no config.json; nanovllm loads Hugging Face-format"):
        make_llm(str(tmp_path))


@pytest.mark.parametrize("text, words", [("{not json", "not valid JSON"), ("[1, 2]", "must hold a JSON")])
def test_malformed_config_json(model, tmp_path, text, words):
    path = copy_model(model, tmp_path)
    (path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=words):
        make_llm(str(path))


def test_missing_weights(model, tmp_path):
    path = copy_model(model, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"has no \*.safetensors weight files"):
        make_llm(str(path))


def test_incomplete_weights(model, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_model(model, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    dropped = next(k for k in tensors if "layers.1.mlp" in k)
    del tensors[dropped]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks weights for"):
        make_llm(str(path))


def test_missing_tokenizer(model, tmp_path):
    path = copy_model(model, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        make_llm(str(path))


@pytest.mark.parametrize("architectures, named", [(["MambaForCausalLM"], "MambaForCausalLM"), ([], "(none")])
def test_architecture_no_plugin_provides(model, tmp_path, architectures, named):
    path = copy_model(model, tmp_path)
    edit_config(path, architectures=architectures)
    with pytest.raises(ValueError, match="no installed plugin provides architecture") as info:
        make_llm(str(path))
    message = str(info.value)
    assert named in message
    assert "Installed: " in message and "LlamaForCausalLM" in message and "pip install" in message
