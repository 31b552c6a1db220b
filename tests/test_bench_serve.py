"""``torchtsp bench --mode serve``: its figures recomputed from the raw request times by independent arithmetic,
and one real run against a 2-rank server."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from torchtsp.bench.serve import RequestResult, arrival_times, parse_goodput, percentile, serve_command, summarize


def test_arrivals_are_a_seeded_poisson_process():
    times = arrival_times(4000, 8.0, seed=3)
    gaps = np.diff(times)
    assert times == arrival_times(4000, 8.0, seed=3) and times != arrival_times(4000, 8.0, seed=4)
    # Exponential gaps of mean 1/8 s: the sample mean of 3999 lies within 5 standard errors (0.125/sqrt(3999)).
    assert abs(gaps.mean() - 0.125) < 5 * 0.125 / math.sqrt(len(gaps))
    assert abs(gaps.std() - 0.125) < 0.01  # an exponential's deviation equals its mean
    assert arrival_times(5, math.inf, seed=0) == [0.0] * 5


def test_percentiles_interpolate_as_numpy_does():
    values = [5.0, 1.0, 9.0, 3.0, 7.5, 2.25]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_summary_follows_vllms_definitions():
    # Request a: 4 tokens in 4 chunks; b: 3 tokens, the first two in one chunk; c failed.
    a = RequestResult(sent=0.0, ok=True, chunk_times=[0.2, 0.3, 0.45, 0.5], output_tokens=4)
    b = RequestResult(sent=0.1, ok=True, chunk_times=[0.4, 1.0], output_tokens=3)
    c = RequestResult(sent=0.2, error="HTTP 500")
    s = summarize([a, b, c], duration=2.0, slos={"ttft": 0.3, "tpot": 0.2})
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 1, 7)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.5
    assert s["mean_ttft_ms"] == pytest.approx(300.0)
    # TPOT = (E2EL - TTFT) / (tokens - 1): a (0.5 - 0.2) / 3 = 0.1 s, b (1.0 - 0.4) / 2 = 0.3 s.
    assert s["mean_tpot_ms"] == pytest.approx(200.0)
    assert s["p50_itl_ms"] == pytest.approx(1000 * np.percentile([0.1, 0.15, 0.05, 0.6], 50))
    assert s["p99_e2el_ms"] == pytest.approx(1000 * np.percentile([0.5, 1.0], 99))
    assert s["goodput"] == 0.5  # only a meets both SLOs (b's TPOT is 300 ms > 200)


def test_goodput_slos_are_checked():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 0.5, "tpot": 0.05}
    for bad in ("ttfb:5", "ttft:-1", "ttft:x", "ttft"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([bad])


@pytest.mark.multirank
def test_a_real_run_reports_what_its_requests_measured(tmp_path):
    pytest.importorskip("httpx")
    cmd = [sys.executable, "-m", "torchtsp", "bench", "--mode", "serve", "--preset", "tiny", "--schemes", "tsp,dp",
           "--nproc", "2", "--num-prompts", "4", "--input-len", "12", "--output-len", "6", "--request-rates", "inf",
           "--goodput", "ttft:60000", "--out", str(tmp_path), "--no-plots"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "serve.json").read_text())
    tsp, dp = result["rows"]
    assert dp["status"].startswith("n/a: serve runs") and "tsp" in dp["status"]  # a row, and no server started
    requests = [RequestResult(**r) for r in result["requests"]["tsp@inf"]]
    # ignore_eos: every request generates exactly --output-len tokens.
    assert [r.output_tokens for r in requests] == [6] * 4 and all(r.ok for r in requests)
    assert [r.prompt_tokens for r in requests] == [12] * 4
    assert tsp["completed"] == 4 and tsp["output_tokens"] == 24
    assert tsp["output_throughput"] == pytest.approx(24 / tsp["duration_s"])
    assert tsp["mean_ttft_ms"] == pytest.approx(1000 * np.mean([r.chunk_times[0] for r in requests]))
    tpots = [(r.chunk_times[-1] - r.chunk_times[0]) / 5 for r in requests]
    assert tsp["p50_tpot_ms"] == pytest.approx(1000 * np.percentile(tpots, 50))
    assert tsp["goodput"] == pytest.approx(tsp["request_throughput"])  # a 60 s TTFT SLO is met by all
    assert "| tsp | inf | 4/4 |" in (tmp_path / "serve.md").read_text()


def test_the_server_queues_every_request_of_the_run():
    """At rate inf every request arrives at once: a queue shorter than the run would turn the rest into 429s."""
    from torchtsp.cli import build_parser

    command = serve_command(["--preset", "tiny"], "tsp", 2, 8000, 64, 16, 1000, 60.0)
    args = build_parser().parse_args(command[command.index("serve"):])
    assert args.max_queue >= 1000 and args.max_num_seqs == 16 and args.scheme == "tsp"
