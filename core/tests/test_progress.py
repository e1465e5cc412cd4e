"""Progress on long jobs: bars with an estimate on stderr (only on a terminal unless forced), the line per job
of a benchmark run, and the quality runs' bars reaching their totals."""

from __future__ import annotations

import pytest
from nanovllm import utils


def test_a_forced_bar_shows_count_elapsed_remaining_and_rate_on_stderr(capsys):
    with utils.progress_bar(4, "perplexity full", "tok", enabled=True) as bar:
        bar.update(2)
    captured = capsys.readouterr()
    assert captured.out == ""
    last = captured.err.strip().split("\r")[-1]
    assert last.startswith("perplexity full") and "2/4 [" in last and "<" in last and "tok/s" in last


def test_bars_show_on_a_terminal_unless_tqdm_disable_is_set(capsys, monkeypatch):
    with utils.progress_bar(4, "quiet", "tok") as bar:  # capsys's stderr is no terminal
        bar.update(4)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(utils.sys.stderr, "isatty", lambda: True)
    for value, shown in ((None, True), ("0", True), ("1", False), ("True", False)):
        if value is None:
            monkeypatch.delenv("TQDM_DISABLE", raising=False)
        else:
            monkeypatch.setenv("TQDM_DISABLE", value)
        with utils.progress_bar(4, "bar", "tok") as bar:
            assert bar.disable is not shown, value


def test_the_job_clock_estimates_what_is_left_from_the_mean_job(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(utils.time, "monotonic", lambda: now[0])
    clock = utils.JobClock(4)
    assert clock.status() == "[job 1/4, 00:00 elapsed]"
    now[0] += 60  # the first job took a minute: three are left
    assert clock.status() == "[job 2/4, 01:00 elapsed, about 03:00 left]"
    now[0] += 120  # 90 s a job so far: two left
    assert clock.status() == "[job 3/4, 03:00 elapsed, about 03:00 left]"


@pytest.fixture
def bars(monkeypatch):
    """Every bar the quality modules open, forced on (it counts as shown) and kept for the test."""
    from nanovllm.quality import capture, perplexity

    opened = []

    def recorded(*args, **kwargs):
        opened.append(utils.progress_bar(*args, **{**kwargs, "enabled": True}))
        return opened[-1]

    for module in (capture, perplexity):
        monkeypatch.setattr(module, "progress_bar", recorded)
    return opened


def test_quality_runs_count_every_token_of_their_text(tiny_model, one_thread, bars):
    from nanovllm import LLM
    from nanovllm.quality.capture import capture_activations
    from nanovllm.quality.perplexity import tail_perplexity

    ids = [3 + i % 200 for i in range(150)]
    model = tiny_model("LlamaForCausalLM")
    llm = LLM(model, device="cpu", max_model_len=256, enforce_eager=True, async_scheduling=False,
              max_num_batched_tokens=64)
    capture_activations(llm, ids, [0])
    tail_perplexity("full", ids, 20, model=model, device="cpu", prefill_chunk=64)
    assert [bar.desc for bar in bars] == ["capture (dense prefill)", "perplexity full"]
    for bar in bars:
        assert bar.n == bar.total == len(ids)
