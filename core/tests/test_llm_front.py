"""The ``LLM`` entry point as vLLM scripts use it: hub IDs through the local Hugging Face cache (never the
network here), ``tokenizer=`` / ``revision=`` / ``download_dir=``, dtype aliases, ``trust_remote_code``
(checkpoint code never runs), ``get_tokenizer()``, ``TextPrompt`` / ``TokensPrompt``, and ``chat()`` with
vLLM's options, OpenAI-style content lists and ``output.prompt``."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from nanovllm import SamplingParams, TextPrompt, TokensPrompt
from nanovllm.config import EngineConfig
from nanovllm.engine.model_loading import resolve_model_path
from nanovllm.hub import HubError, is_hub_id
from nanovllm.testing import hub_cache_entry

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# a template in the tiny tokenizer's words (tokN), with a Qwen3-style enable_thinking switch and tools
TEMPLATE = (
    "{%- if tools %}{% for t in tools %}tool:{{ t.function.name }} {% endfor %}{% endif %}"
    "{%- for m in messages %}{{ 'tok3' if m.role == 'user' else 'tok4' }} {{ m.content }} tok5 {% endfor %}"
    "{%- if add_generation_prompt %}tok6 {% if enable_thinking is defined and not enable_thinking %}"
    "tok7 tok7 {% endif %}{% endif %}"
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chat_model(model, tmp_path_factory):
    """The tiny model with a chat template in its tokenizer."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(model, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hub_cache(model, chat_model, tmp_path_factory):
    """A hub cache folder holding the tiny model as 'tiny-org/tiny-llama' (main, and tag v1 = the chat model)."""
    cache = tmp_path_factory.mktemp("hub")
    hub_cache_entry(cache, "tiny-org/tiny-llama", model)
    hub_cache_entry(cache, "tiny-org/tiny-llama", chat_model, revision="v1")
    hub_cache_entry(cache, "tiny-org/chat-tokenizer", chat_model)
    return str(cache)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test here may reach the network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def make_llm(model, **kw):
    from nanovllm import LLM

    return LLM(model, **{"kv_cache_memory": 1 << 24, "device": "cpu", "max_model_len": 64, **kw})


@pytest.fixture(scope="module")
def llm(chat_model):
    return make_llm(chat_model)


def run(llm, prompts, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_idle(llm) -> None:
    sched = llm.scheduler
    assert not sched.waiting and not sched.running
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks


# -- engine options --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, canonical",
    [("half", "float16"), ("float16", "float16"), ("bfloat16", "bfloat16"), ("float", "float32"),
     ("float32", "float32"), ("auto", "auto"), (torch.float16, "float16"), (torch.bfloat16, "bfloat16")],
)
def test_dtype_aliases(given, canonical):
    assert EngineConfig(dtype=given).dtype == canonical


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(dtype="float8"), ["dtype must be one of", "'half'", "'float'"]),
        (dict(dtype=torch.int8), ["dtype must be one of"]),
        (dict(trust_remote_code="yes"), ["trust_remote_code must be True or False"]),
        (dict(tokenizer=""), ["tokenizer must be a non-empty string"]),
        (dict(revision=3), ["revision must be a non-empty string"]),
    ],
)
def test_bad_front_options(kw, words):
    with pytest.raises(ValueError) as info:
        EngineConfig(**kw)
    for word in words:
        assert word in str(info.value)


def test_dtype_alias_reaches_the_model(model):
    assert make_llm(model, dtype="float").runner.dtype == torch.float32


def test_trust_remote_code_is_accepted_and_runs_no_checkpoint_code(model, tmp_path):
    """A known architecture whose config also names checkpoint code loads with the built-in code only."""
    path = tmp_path / "model"
    shutil.copytree(model, path)
    marker = tmp_path / "checkpoint-code-ran"
    (path / "configuration_custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig"}
    (path / "config.json").write_text(json.dumps(config))
    llm = make_llm(str(path), trust_remote_code=True)
    assert run(llm, [[5, 6, 7]]) == run(make_llm(model), [[5, 6, 7]])
    assert not marker.exists()


@pytest.mark.parametrize("trust", [False, True])
def test_a_model_that_needs_checkpoint_code_is_a_clear_error(model, tmp_path, trust):
    path = tmp_path / "model"
    shutil.copytree(model, path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["CustomForCausalLM"], auto_map={"AutoModelForCausalLM": "modeling.CustomModel"})
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="never runs checkpoint code, with or without trust_remote_code") as info:
        make_llm(str(path), trust_remote_code=trust)
    assert "CustomForCausalLM" in str(info.value) and "LlamaForCausalLM" in str(info.value)


def test_get_tokenizer(llm):
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer
    ids = tokenizer.encode("tok40 tok41", add_special_tokens=False)
    assert ids == [40, 41]
    assert run(llm, ["tok40 tok41"]) == run(llm, [tokenizer.encode("tok40 tok41")])


def test_get_tokenizer_without_one_is_an_error(model):
    with pytest.raises(ValueError, match="skip_tokenizer_init=True"):
        make_llm(model, skip_tokenizer_init=True).get_tokenizer()


def test_tokenizer_from_another_directory(model, chat_model):
    llm = make_llm(model, tokenizer=chat_model)
    assert llm.get_tokenizer().chat_template == TEMPLATE
    assert llm.model_path != llm.tokenizer_path
    with pytest.raises(ValueError, match="tokenizer_revision applies to hub IDs"):
        make_llm(model, tokenizer=chat_model, tokenizer_revision="v1")
    with pytest.raises(ValueError, match="tokenizer_revision applies to tokenizer="):
        make_llm(model, tokenizer_revision="v1")


# -- hub IDs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, hub",
    [("Qwen/Qwen3-0.6B", True), ("gpt2", True), ("/abs/path", False), ("./rel", False), ("~/m", False),
     ("a/b/c", False), ("bad name/x", False)],
)
def test_is_hub_id(name, hub):
    assert is_hub_id(name) is hub


def test_hub_id_from_the_cache_offline(model, hub_cache):
    snapshot = resolve_model_path("tiny-org/tiny-llama", download_dir=hub_cache)
    assert snapshot.parent.parent.name == "models--tiny-org--tiny-llama"
    assert (snapshot / "config.json").read_bytes() == (resolve_model_path(model) / "config.json").read_bytes()
    tagged = resolve_model_path("tiny-org/tiny-llama", revision="v1", download_dir=hub_cache)
    assert tagged != snapshot and (tagged / "chat_template.jinja").is_file()
    by_commit = resolve_model_path("tiny-org/tiny-llama", revision=tagged.name, download_dir=hub_cache)
    assert by_commit == tagged


def test_llm_from_a_hub_id_generates_as_from_its_directory(model, hub_cache):
    from_hub = make_llm("tiny-org/tiny-llama", download_dir=hub_cache)
    assert run(from_hub, [[5, 6, 7], "tok9 tok10"]) == run(make_llm(model), [[5, 6, 7], "tok9 tok10"])
    assert from_hub.get_tokenizer().chat_template is None
    tagged = make_llm("tiny-org/tiny-llama", revision="v1", download_dir=hub_cache)
    assert tagged.get_tokenizer().chat_template == TEMPLATE  # the v1 snapshot's tokenizer


def test_tokenizer_as_a_hub_id(model, hub_cache):
    llm = make_llm(model, tokenizer="tiny-org/chat-tokenizer", download_dir=hub_cache)
    assert llm.get_tokenizer().chat_template == TEMPLATE


@pytest.mark.parametrize(
    "model_id, kw, words",
    [
        ("tiny-org/absent", {}, ["'tiny-org/absent' is not in", "HF_HUB_OFFLINE", "hf download tiny-org/absent"]),
        ("tiny-org/tiny-llama", dict(revision="v9"), ["revision 'v9' of 'tiny-org/tiny-llama' is not in"]),
    ],
)
def test_hub_id_missing_from_the_cache_offline(hub_cache, model_id, kw, words):
    with pytest.raises(HubError) as info:
        make_llm(model_id, download_dir=hub_cache, **kw)
    for word in words:
        assert word in str(info.value)


def test_hub_options_with_a_local_directory_are_an_error(model, tmp_path):
    with pytest.raises(ValueError, match="revision='main' applies to hub model IDs only"):
        make_llm(model, revision="main")
    with pytest.raises(ValueError, match="download_dir=.* neither the model nor the tokenizer is a hub ID"):
        make_llm(model, download_dir=str(tmp_path))


def test_online_the_snapshot_is_downloaded_without_code_or_pickles(monkeypatch, tmp_path, model):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(model)

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert str(resolve_model_path("Qwen/Qwen3-0.6B", revision="abc", download_dir=str(tmp_path))) == model
    ((repo_id, kw),) = calls
    assert repo_id == "Qwen/Qwen3-0.6B" and kw["revision"] == "abc" and kw["cache_dir"] == str(tmp_path)
    assert kw["local_files_only"] is False
    patterns = kw["allow_patterns"]
    assert "*.safetensors" in patterns and "*.json" in patterns
    assert not any(p.endswith((".py", ".bin", ".pt", ".pth")) for p in patterns)


# -- prompt types ----------------------------------------------------------------------------------


def test_text_and_tokens_prompts(llm):
    reference = run(llm, ["tok9 tok10 tok11", [5, 6, 7]])
    assert run(llm, [TextPrompt(prompt="tok9 tok10 tok11"), TokensPrompt(prompt_token_ids=[5, 6, 7])]) == reference
    out = llm.generate(TextPrompt(prompt="tok9 tok10 tok11"), GREEDY, use_tqdm=False)[0]
    assert out.prompt == "tok9 tok10 tok11" and out.token_ids == reference[0]


@pytest.mark.parametrize(
    "prompt, words",
    [
        ({"prompt": "tok3", "multi_modal_data": {"image": None}}, "'multi_modal_data', which is not supported"),
        ({"prompt_token_ids": [3], "cache_salt": "x"}, "'cache_salt', which is not supported"),
        ({"prompt": "tok3", "prompt_token_ids": [3]}, "exactly one of them"),
        ({"promt": "tok3"}, "unknown key 'promt'"),
    ],
)
def test_bad_prompt_dicts(llm, prompt, words):
    with pytest.raises(ValueError, match=words):
        llm.generate([[5, 6], prompt], GREEDY, use_tqdm=False)
    assert_idle(llm)


# -- chat ------------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "tok40 tok41"}]


def test_chat_sets_the_rendered_prompt(llm):
    out = llm.chat(USER, GREEDY, use_tqdm=False)[0]
    assert out.prompt == "tok3 tok40 tok41 tok5 tok6 "
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    assert out.token_ids == run(llm, [out.prompt_token_ids])[0]


def test_chat_template_kwargs_reach_the_template(llm):
    out = llm.chat(USER, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    assert out.prompt == "tok3 tok40 tok41 tok5 tok6 tok7 tok7 "


def test_unused_chat_template_kwargs_warn(llm):
    with pytest.warns(UserWarning, match="does not use chat_template_kwargs 'reasoning_effort'"):
        llm.chat(USER, GREEDY, use_tqdm=False, chat_template_kwargs={"reasoning_effort": "high"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        llm.chat(USER, GREEDY, use_tqdm=False, chat_template_kwargs={"enable_thinking": True})


def test_content_lists_equal_string_content(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "tok40"}, {"type": "text", "text": "tok41"}]}]
    (as_list,), (as_string,) = llm.chat(parts, GREEDY, use_tqdm=False), llm.chat(
        [{"role": "user", "content": "tok40\ntok41"}], GREEDY, use_tqdm=False
    )
    assert as_list.prompt == as_string.prompt and as_list.token_ids == as_string.token_ids


def test_openai_content_format_for_templates_that_loop_over_parts(llm):
    looping = "{% for m in messages %}{% for p in m.content %}{{ p.text }} {% endfor %}{% endfor %}tok6"
    parts = [{"role": "user", "content": [{"type": "text", "text": "tok40"}, {"type": "text", "text": "tok41"}]}]
    out = llm.chat(parts, GREEDY, use_tqdm=False, chat_template=looping)[0]
    assert out.prompt == "tok40 tok41 tok6"
    as_string = [{"role": "user", "content": "tok40"}]  # becomes one text part
    assert llm.chat(as_string, GREEDY, use_tqdm=False, chat_template=looping)[0].prompt == "tok40 tok6"
    forced = llm.chat(parts, GREEDY, use_tqdm=False, chat_template=TEMPLATE, chat_template_content_format="openai")
    assert "'type'" in forced[0].prompt  # the template printed the list it was given


def test_openai_content_format_on_a_template_that_reads_strings_names_the_fix(llm):
    """As in SmolLM2's template: the content is joined to strings, which a list of parts cannot be."""
    joins = "{% for m in messages %}{{ 'tok3 ' + m['content'] + ' tok5 ' }}{% endfor %}tok6"
    with pytest.raises(ValueError, match="reads each message's content as a string.*pass 'string'"):
        llm.chat(USER, GREEDY, use_tqdm=False, chat_template=joins, chat_template_content_format="openai")
    assert_idle(llm)
    for content_format in ("auto", "string"):
        out = llm.chat(USER, GREEDY, use_tqdm=False, chat_template=joins, chat_template_content_format=content_format)
        assert out[0].prompt == "tok3 tok40 tok41 tok5 tok6"
    with pytest.raises(ValueError, match="the chat template failed: .*no_such_filter"):  # other failures as they are
        llm.chat(USER, GREEDY, use_tqdm=False, chat_template="{{ messages | no_such_filter }}",
                 chat_template_content_format="openai")


def test_chat_template_argument_text_and_file(model, tmp_path):
    plain = make_llm(model)  # its tokenizer has no template
    with pytest.raises(ValueError, match="no chat template; use generate"):
        plain.chat(USER, GREEDY, use_tqdm=False)
    from_text = plain.chat(USER, GREEDY, use_tqdm=False, chat_template=TEMPLATE)[0]
    file = tmp_path / "template.jinja"
    file.write_text(TEMPLATE)
    from_file = plain.chat(USER, GREEDY, use_tqdm=False, chat_template=str(file))[0]
    assert from_text.prompt == from_file.prompt == "tok3 tok40 tok41 tok5 tok6 "
    assert_idle(plain)


def test_add_generation_prompt_and_continue_final_message(llm):
    partial = [*USER, {"role": "assistant", "content": "tok50 tok51"}]
    no_prompt = llm.chat(USER, GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    assert no_prompt.prompt == "tok3 tok40 tok41 tok5 "
    continued = llm.chat(partial, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert continued.prompt == "tok3 tok40 tok41 tok5 tok4 tok50 tok51"
    assert continued.prompt_token_ids[-2:] == [50, 51]


def test_tools_reach_the_template(llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = llm.chat(USER, GREEDY, use_tqdm=False, tools=tools)[0]
    assert out.prompt.startswith("tool:get_weather tok3")


def test_a_batch_of_conversations_with_one_prompt_each(llm):
    conversations = [USER, [{"role": "user", "content": "tok60"}]]
    outs = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["tok3 tok40 tok41 tok5 tok6 ", "tok3 tok60 tok5 tok6 "]


@pytest.mark.parametrize(
    "messages, kw, words",
    [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
         "content part 0 is 'image_url'; nanovllm runs text-only models"),
        ([{"role": "user", "content": [{"type": "text"}]}], {}, "needs a string 'text'"),
        ([{"role": "user", "content": 5}], {}, "content must be a string or a list"),
        ([{"role": "user"}], {}, "has no 'content'"),
        ([{"content": "tok3"}], {}, "string role"),
        (USER, dict(continue_final_message=True), "pass add_generation_prompt=False"),
        (USER, dict(chat_template_kwargs={"tokenize": True}), "'tokenize', which is no template variable"),
        (USER, dict(chat_template_kwargs={"tools": []}), "pass it as chat()'s own argument tools="),
        (USER, dict(chat_template_content_format="xml"), "chat_template_content_format must be one of"),
        (USER, dict(chat_template="no/such/template.jinja"), "neither a Jinja template"),
        (USER, dict(chat_template="{% if %}"), "the chat template failed"),
        (USER, dict(tools={"name": "x"}), "tools must be a list"),
        ([USER, [{"role": "user", "content": [{"type": "input_audio"}]}]], {}, "conversation 1, message 0"),
    ],
)
def test_chat_errors(llm, messages, kw, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        llm.chat(messages, GREEDY, use_tqdm=False, **kw)
    assert_idle(llm)


def test_lora_and_multimodal_arguments_are_accepted_as_none_and_refused_otherwise(llm):
    assert llm.chat(USER, GREEDY, False, None, mm_processor_kwargs=None)[0].outputs[0].token_ids
    assert llm.generate("tok3", GREEDY, False, None)[0].outputs[0].token_ids
    for call, kw, words in ((llm.chat, dict(lora_request=object()), "lora_request=.* nanovllm has no LoRA support"),
                            (llm.generate, dict(lora_request="adapter"), "lora_request='adapter' is not supported"),
                            (llm.chat, dict(mm_processor_kwargs={"fps": 1}), "nanovllm has no multimodal support")):
        with pytest.raises(ValueError, match=words):
            call(USER if call == llm.chat else "tok3", GREEDY, use_tqdm=False, **kw)
    assert_idle(llm)


# -- vLLM's LLM methods: llm_engine, get_default_sampling_params ---------------------------------------------


def test_llm_engine_is_the_engine_with_the_step_api(llm):
    from nanovllm.engine.llm_engine import LLMEngine

    engine = llm.llm_engine
    assert isinstance(engine, LLMEngine) and engine.get_tokenizer() is llm.get_tokenizer()
    want = run(llm, ["tok3 tok40"])[0]
    engine.add_request("kept", "tok3 tok40", GREEDY)
    engine.add_request("dropped", "tok3 tok41", SamplingParams(max_tokens=30, ignore_eos=True))
    engine.abort_request("dropped")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    assert list(finished) == ["kept"] and finished["kept"].outputs[0].token_ids == want
    assert_idle(llm)


def test_llm_holds_its_engine_and_start_up_resolves_the_options_once(model):
    from nanovllm import LLM
    from nanovllm.config import ResolvedConfig
    from nanovllm.engine.llm_engine import LLMEngine

    llm = make_llm(model, max_model_len=None, dtype="auto")
    engine = llm.llm_engine
    assert not isinstance(llm, LLMEngine) and isinstance(engine, LLMEngine) and not isinstance(engine, LLM)
    config = engine.config
    # the options with nothing left to derive: the model's length limit, the CPU's dtype, a concrete device
    assert isinstance(config, ResolvedConfig) and config.device == "cpu" and config.dtype == "float32"
    assert config.max_model_len == engine.hf_config.max_position_embeddings == engine.max_model_len
    assert config.model_config.path == engine.model_path and config.model_config.architecture == "LlamaForCausalLM"
    # handed down as one object: the runner runs with the engine's
    assert engine.runner.config is config
    assert engine.runner.dtype == torch.float32 and engine.runner.max_model_len == config.max_model_len
    # the engine's attributes read through the LLM, as when it was its own engine
    assert llm.runner is engine.runner and llm.config is config


def test_default_sampling_params_come_from_generation_config(model, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(model, path)
    config = json.loads((path / "generation_config.json").read_text())
    defaults = {"temperature": 0.3, "top_p": 0.8, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1}
    (path / "generation_config.json").write_text(json.dumps(
        {**config, **defaults, "max_new_tokens": 9, "do_sample": True, "num_beams": 1}))
    llm = make_llm(str(path))
    params = llm.get_default_sampling_params()
    assert params == SamplingParams(**defaults, max_tokens=9)
    params.max_tokens = 2  # as vLLM scripts do: each call gives a new object
    assert llm.get_default_sampling_params().max_tokens == 9
    (path / "generation_config.json").write_text(json.dumps({**config, "top_k": "many"}))
    with pytest.raises(ValueError, match="generation_config.json.*not valid SamplingParams"):
        llm.get_default_sampling_params()
    (path / "generation_config.json").unlink()
    assert llm.get_default_sampling_params() == SamplingParams()
