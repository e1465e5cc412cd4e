"""Scripts written for vLLM, with only the import changed (``vllm_scripts/``), run as they are, as
``__main__`` in a fresh Python process: the model is a hub ID found offline in a Hugging Face cache built here
(through ``HF_HOME``, or through ``download_dir=`` where the script passes one). And the vLLM pieces such
scripts build their command lines with: ``EngineArgs`` and ``FlexibleArgumentParser``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from nanovllm.plugins import get_plugins
from nanovllm.testing import hub_cache_entry

SCRIPTS = sorted((Path(__file__).parent / "vllm_scripts").glob("*.py"))
HUB_ID = "tiny-org/tiny-chat-llama"
# Qwen3's enable_thinking switch, in the tiny tokenizer's words (tokN)
TEMPLATE = (
    "{%- for m in messages %}{{ 'tok3' if m.role == 'user' else 'tok4' }} {{ m.content }} tok5 {% endfor %}"
    "{%- if add_generation_prompt %}tok6 {% if enable_thinking is defined and not enable_thinking %}"
    "tok7 tok7 {% endif %}{% endif %}"
)
# the model's sampling defaults, which get_default_sampling_params() gives the scripts
GENERATION_CONFIG = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 24}
# command lines of the scripts that parse one (flags spelled with dashes and with underscores)
ARGV = {
    "chat": ["--temperature", "0", "--max_model_len", "256"],
    "generate": ["--model", HUB_ID, "--max_tokens", "8", "--temperature=0.5", "--top-p", "0.9", "--top_k", "5",
                 "--seed", "1", "--enforce-eager"],
}


@pytest.fixture(scope="module")
def caches(tiny_model, tmp_path_factory):
    """``(HF_HOME, download_dir)``: two hub caches, each holding the tiny model with a chat template as HUB_ID."""
    from transformers import AutoTokenizer

    if "LlamaForCausalLM" not in get_plugins().registry.model_families:
        pytest.skip("needs the nanovllm-llama plugin")
    root = tmp_path_factory.mktemp("vllm-scripts")
    model = root / "model"
    shutil.copytree(tiny_model(), model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, **GENERATION_CONFIG}))
    hf_home, download_dir = root / "hf-home", root / "shared-cache"
    hub_cache_entry(hf_home / "hub", HUB_ID, model)
    hub_cache_entry(download_dir, HUB_ID, model)
    return hf_home, download_dir


# one Python process runs every script as ``__main__`` (importing torch and transformers once keeps this fast)
RUNNER = """
import json, runpy, sys, traceback
results, out, scripts = {}, sys.argv[1], json.loads(sys.argv[2])
for path, argv in scripts:
    sys.argv = [path, *argv]
    try:
        runpy.run_path(path, run_name="__main__")
        results[path] = None
    except BaseException:
        results[path] = traceback.format_exc()
with open(out, "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def script_results(caches, tmp_path_factory):
    """Each script's traceback, or None where it ran through; and the process's output."""
    hf_home, download_dir = caches
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", MODEL=HUB_ID, DOWNLOAD_DIR=str(download_dir),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    results = tmp_path_factory.mktemp("results") / "results.json"
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(results), json.dumps([(str(s), ARGV.get(s.stem, [])) for s in SCRIPTS])],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0 and results.is_file(), (proc.stdout + proc.stderr)[-4000:]
    return json.loads(results.read_text()), proc.stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_only_the_import_differs_from_vllm(script):
    """Every line naming nanovllm is an import, and its comment gives the vLLM line it replaces."""
    lines = [line for line in script.read_text().splitlines() if "nanovllm" in line]
    assert lines
    for line in lines:
        code, _, comment = line.partition("#")
        assert re.fullmatch(r"from nanovllm(\.\w+)? import [\w, ]+", code.strip()), line
        assert comment.strip() == "vLLM: " + code.strip().replace("nanovllm", "vllm"), line


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_script_runs(script, script_results):
    tracebacks, _ = script_results
    assert str(script) in tracebacks
    assert tracebacks[str(script)] is None, tracebacks[str(script)]


def test_every_script_printed_its_answers(script_results):
    _, stdout = script_results
    assert stdout.count("Generated text:") >= 3 + 3 + 1 + 3 + 2  # basic, chat, engine_args, generate, prompts


# -- the pieces of the scripts' command lines ----------------------------------------------------------------


def test_flexible_argument_parser_takes_underscores_and_dashes():
    from nanovllm.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--chat-template-path")
    parser.add_argument("prompt")
    args = parser.parse_args(["--max_tokens=8", "--chat_template_path", "a_b.jinja", "--", "--not_a_flag"])
    assert (args.max_tokens, args.chat_template_path, args.prompt) == (8, "a_b.jinja", "--not_a_flag")
    with pytest.raises(SystemExit):
        parser.parse_args(["--max_tokens", "8", "--no_such_flag", "x"])


@pytest.mark.parametrize("in_group", [False, True])
def test_engine_args_flags_become_llm_keyword_arguments(in_group):
    """``EngineArgs.add_cli_args`` on a parser or an argument group: ``vars(args)`` holds the flags given and
    ``--model`` (its default from ``set_defaults``); ``from_cli_args`` and ``asdict`` give every option."""
    from nanovllm import EngineArgs
    from nanovllm.config import EngineConfig
    from nanovllm.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    target = parser.add_argument_group("Engine arguments") if in_group else parser
    assert EngineArgs.add_cli_args(target) is target
    target.set_defaults(model="some/model")
    parser.add_argument("--max-tokens", type=int)
    args = parser.parse_args(["--max_model_len", "128", "--enforce-eager", "--no-enable-prefix-caching",
                              "--dtype", "half", "--max-tokens", "3"])
    given = vars(args)
    assert given.pop("max_tokens") == 3
    assert given == {"model": "some/model", "max_model_len": 128, "enforce_eager": True,
                     "enable_prefix_caching": False, "dtype": "half"}
    engine_args = EngineArgs.from_cli_args(args)
    every = dataclasses.asdict(engine_args)
    assert list(every) == [f.name for f in attrs.fields(EngineConfig)]
    assert every["max_model_len"] == 128 and every["max_num_seqs"] == EngineConfig().max_num_seqs
    config = EngineConfig.from_kwargs(every.pop("model"), every)  # what LLM(**asdict(engine_args)) builds
    assert (config.model, config.dtype, config.enable_prefix_caching) == ("some/model", "float16", False)


def test_engine_args_without_model_keep_the_built_in_model():
    from nanovllm import EngineArgs
    from nanovllm.utils import FlexibleArgumentParser

    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args([])
    assert vars(args) == {} and EngineArgs.from_cli_args(args).model is None
    with pytest.raises(SystemExit):
        EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--device", "tpu"])
