"""The prefill-policy quality harness on synthetic activations: each chunk after the first is shown as the
engine shows it, with every key so far, and a policy that reads every visible key scores as dense."""

import attrs
import torch
from nanovllm.quality.metrics import compare_key_masks
from nanovllm.quality.prefill import layer_metrics, prefill_chunks, results_table


@attrs.define
class Layer:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layer_id: int = 2
    scale: float = 0.25


def layer(tokens: int = 300) -> Layer:
    gen = torch.Generator().manual_seed(0)
    return Layer(*(torch.randn(tokens, h, 16, generator=gen) for h in (4, 2, 2)))


def test_chunks_after_the_first_see_every_key_so_far():
    lay = layer()
    seen = []
    for start, end, q, ctx in prefill_chunks(lay, 128, kv_block_size=16):
        seen.append((start, end))
        assert torch.equal(q, lay.q[start:end]) and ctx.layer_id == 2 and ctx.is_prefill
        assert int(ctx.meta.context_lens[0]) == end and int(ctx.meta.cu_seqlens_q[1]) == end - start
        keys = ctx.k_cache[ctx.meta.block_tables[0].long()].flatten(0, 1)[:end]
        assert torch.equal(keys, lay.k[:end])
    assert seen == [(128, 256), (256, 300)]


def test_a_policy_reading_every_visible_key_scores_as_dense():
    def every_key(policy, q, ctx, positions, dense):
        keys = dense.visible()[:, None, :].expand_as(dense.probs)
        return compare_key_masks(dense, keys), 1.0

    metrics = layer_metrics(None, layer(), 128, rows_per_chunk=8, kv_block_size=16, measure=every_key)
    assert metrics["policy"]["mass_recall"] > 1 - 1e-9 and metrics["policy"]["output_error"] < 1e-9
    assert metrics["policy"]["density"] > 1 - 1e-9 and metrics["policy_density"] == 1.0
    assert metrics["random"]["mass_recall"] > 1 - 1e-9  # as many keys as the policy: all of them


def test_results_table_has_a_row_per_setting_under_the_named_density():
    mean = {"density": 0.25, "mass_recall": 0.9, "topk_recall": 0.8, "output_error": 0.05}
    row = {"policy": "p:x=1", "policy_density": 0.3, "ppl_vs_dense": 1.01234,
           "mean": {"policy": mean, "oracle": {"mass_recall": 0.95}, "random": {"mass_recall": 0.2}}}
    lines = results_table([row, {**row, "policy": "p:x=2"}], "block density")
    assert lines[0].startswith("| policy | density | block density | mass recall | oracle | random |")
    assert len(lines) == 4 and lines[1].count("|---") == 9
    assert lines[2] == "| `p:x=1` | 0.250 | 0.300 | 0.900 | 0.950 | 0.200 | 0.800 | 0.050 | 1.0123 |"
