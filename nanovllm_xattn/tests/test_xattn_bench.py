"""The benchmark's bookkeeping (CPU): kernel rows get their target bound, TTFT rows their speedup over
``full`` at the same context, and the table shows both."""

from nanovllm_xattn import bench

ENV = {"device": "test", "date": "today", "commit": "abc", "torch": "2.11"}


def test_ratios_and_table():
    results = [
        {"benchmark": "kernel", "context": 1024, "stride": 8, "selection": "ratio=0.2", "density": 0.2,
         "dense_ms": 10.0, "dense_paged_ms": 12.0, "sparse_ms": 3.0, "ratio": 0.3, "ratio_paged": 0.25,
         "estimate_ms": 1.0, "estimate_share": 0.1, "select_share": 0.01},
        {"benchmark": "ttft", "context": 1024, "policy": "full", "ttft_s": 4.0},
        {"benchmark": "ttft", "context": 1024, "policy": "xattn:ratio=0.2", "ttft_s": 2.0},
        {"benchmark": "ttft", "context": 2048, "policy": "xattn:ratio=0.2", "error": "exit 1"},
    ]
    rows = bench.with_ratios(results)
    assert abs(rows[0]["bound"] - 0.25) < 1e-12
    assert rows[2]["speedup"] == 2.0 and "speedup" not in rows[1] and "speedup" not in rows[3]
    table = bench.markdown({"environment": ENV, "results": rows}, "t")
    assert "| 1024 | -, random tokens | xattn:ratio=0.2 | 2.000 | 2.00x |" in table
    assert "exit 1" in table and "| 0.250 |" in table


def test_jobs_cover_every_policy_at_every_context():
    jobs = bench.jobs([1024], [2048, 4096], [0.2], 8, ttft_rounds=2)
    assert jobs[0] == {"kind": "kernel", "contexts": [1024], "densities": [0.2], "stride": 8}
    assert [(j["context"], j["policy"], j["rounds"]) for j in jobs[1:]] == [
        (c, p, 2) for c in (2048, 4096) for p in bench.TTFT_POLICIES]
