"""bench/infer.py: per-scheme inference figures on local ranks, and the longest prompt under a budget."""

from torchtsp.bench.infer import format_infer_table, max_context_under, run_infer_bench

MODEL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=192, vocab_size=257)


def runner(pool):
    return lambda fn, cell: pool.run(fn, cell)[0]  # every rank returns the same aggregated row


def test_every_scheme_side_by_side(pools):
    rows = run_infer_bench(MODEL, 2, [32, 64], new_tokens=3, repeats=2, run=runner(pools(2)))
    cells = [(n, s) for n in (32, 64) for s in ("tsp", "tp", "sp", "dp")]
    assert [(r["prompt_len"], r["scheme"]) for r in rows] == cells
    by = {(r["prompt_len"], r["scheme"]): r for r in rows}
    for r in rows:
        assert r["ttft_s"] > 0 and r["tpot_s"] > 0 and r["peak_bytes_per_rank"] > 0 and r["kv_bytes_per_rank"] > 0
    for n in (32, 64):
        # K and V of 2 layers, 4 heads of 16 values, float32, for the n prompt tokens and the 2 tokens written after
        # them (the third is chosen, never written): dp holds all of it, tp 2 of the 4 heads, tsp and sp half the
        # prompt (n divides by 2D) and one of the two later tokens each.
        per_token_head = 2 * 2 * 16 * 4
        assert by[n, "dp"]["kv_bytes_per_rank"] == per_token_head * 4 * (n + 2)
        assert by[n, "tp"]["kv_bytes_per_rank"] == per_token_head * 2 * (n + 2)
        assert by[n, "tsp"]["kv_bytes_per_rank"] == per_token_head * 4 * (n // 2 + 1)
        # Sequence-sharded (tsp, sp) and head-sharded (tp, T <= n_kv) caches: half of dp's replicated one.
        assert by[n, "tsp"]["kv_bytes_per_rank"] == by[n, "sp"]["kv_bytes_per_rank"]
        assert by[n, "tsp"]["kv_bytes_per_rank"] < by[n, "dp"]["kv_bytes_per_rank"]
        assert by[n, "tp"]["kv_bytes_per_rank"] < by[n, "dp"]["kv_bytes_per_rank"]
        # Weights split in two: below the schemes that replicate the model.
        assert by[n, "tsp"]["peak_bytes_per_rank"] < min(by[n, "sp"]["peak_bytes_per_rank"],
                                                         by[n, "dp"]["peak_bytes_per_rank"])
    assert by[64, "tsp"]["kv_bytes_per_rank"] > by[32, "tsp"]["kv_bytes_per_rank"]
    # Timed interleaved: two runs per scheme, the median between their extremes, TSP's ratio to TP per run.
    for r in rows:
        low, high = r["tpot_range_s"]
        assert len(r["tpot_runs_s"]) == len(r["ttft_runs_s"]) == 2 and low <= r["tpot_s"] <= high
        assert min(r["tpot_runs_s"]) == low and max(r["tpot_runs_s"]) == high
    for n in (32, 64):
        ratio = by[n, "tsp"]["tpot_vs_tp"]
        runs = [a / b for a, b in zip(by[n, "tsp"]["tpot_runs_s"], by[n, "tp"]["tpot_runs_s"])]
        assert ratio["runs"] == runs and ratio["min"] <= ratio["median"] <= ratio["max"]
    table = format_infer_table(rows)
    assert table.count("\n") == len(rows) and "tsp" in table


def test_longest_prompt_under_a_budget(pools):
    rows = run_infer_bench(MODEL, 2, [64], new_tokens=2, schemes=("tsp",), run=runner(pools(2)))
    budget = rows[0]["peak_bytes_per_rank"]
    found = max_context_under(MODEL, 2, budget, schemes=("tsp", "dp"), new_tokens=2, start=32, limit=256,
                              run=runner(pools(2)))
    assert found["tsp"] is not None and 64 <= found["tsp"] < 256
    assert found["dp"] is None or found["dp"] < found["tsp"]  # dp holds the whole model and cache


GQA = dict(dim=128, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=384, vocab_size=300)


def test_plan_infer_predicts_the_measured_peak(pools):
    """``plan --mode infer`` (predict_memory, mode="infer") against the peak measured from live tensors, for
    every scheme: GQA, a batch of two, chunked prefill and both TSP schedules forced. 15% is the bound the
    training predictions are held to (tests/test_bench.py); small fixed buffers (RoPE tables, positions,
    masks) that the model leaves out are what remains."""
    cases = [dict(), dict(batch=2), dict(prefill_chunk=64), dict(schedule="weights"), dict(schedule="activations")]
    for options in cases:
        for r in run_infer_bench(GQA, 2, [256], new_tokens=5, run=runner(pools(2)), **options):
            assert abs(r["peak_error_pct"]) <= 15, (options, r["scheme"], r["peak_bytes_per_rank"],
                                                    r["predicted_peak_bytes"])
            assert r["predicted_kv_bytes"] == r["kv_bytes_per_rank"], (options, r["scheme"])
