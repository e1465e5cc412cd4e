"""Scripts written for vLLM, with only the import changed (``vllm_scripts/``), run as they are, as
``__main__`` in a fresh Python process: the model is a hub ID found offline in a Hugging Face cache built here
(through ``HF_HOME``, or through ``download_dir=`` where the script passes one)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

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
    hf_home, download_dir = root / "hf-home", root / "shared-cache"
    hub_cache_entry(hf_home / "hub", HUB_ID, model)
    hub_cache_entry(download_dir, HUB_ID, model)
    return hf_home, download_dir


# one Python process runs every script as ``__main__`` (importing torch and transformers once keeps this fast)
RUNNER = """
import json, runpy, sys, traceback
results = {}
for path in sys.argv[2:]:
    try:
        runpy.run_path(path, run_name="__main__")
        results[path] = None
    except BaseException:
        results[path] = traceback.format_exc()
with open(sys.argv[1], "w") as f:
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
        [sys.executable, "-c", RUNNER, str(results), *map(str, SCRIPTS)],
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
    assert stdout.count("Generated text:") >= 3 + 1 + 2 + 1  # basic, chat, prompts, engine_args
