"""``torchtsp bench --mode serve``: its figures recomputed from the raw request times by independent arithmetic,
and one real run against a 2-rank server."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from torchtsp.bench.serve import (
    MetricsWatch,
    RequestResult,
    arrival_times,
    cache_flags,
    make_prompts,
    parse_goodput,
    percentile,
    read_metrics,
    serve_command,
    summarize,
    warmup_prompt,
)


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
           "--goodput", "ttft:60000", "--kv-cache-mb", "1", "--block-size", "8", "--out", str(tmp_path), "--no-plots"]
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
    # The cache flags reached the server: tiny (2 layers, 4 KV heads of 16) at tsp 2 keeps 2 heads of every token
    # per rank, K and V in float32: 512 bytes a token, so 1 MiB holds 2**20 // (8 * 512) blocks of 8 tokens.
    assert tsp["kv_capacity_tokens"] == 2**20 // (8 * 2 * 2 * 2 * 16 * 4) * 8 == 2048
    assert 1 <= tsp["peak_num_requests_running"] <= 4 and tsp["preemptions"] == 0
    assert tsp["prefix_cache_queries"] == 4 * 12  # the run's prompts, not the warm-up's before it


def test_the_server_queues_every_request_of_the_run():
    """At rate inf every request arrives at once: a queue shorter than the run would turn the rest into 429s."""
    from torchtsp.cli import build_parser

    command = serve_command(["--preset", "tiny"], "tsp", 2, 8000, 64, 16, 1000, 60.0)
    args = build_parser().parse_args(command[command.index("serve"):])
    assert args.max_queue >= 1000 and args.max_num_seqs == 16 and args.scheme == "tsp"


def _bench_args(*flags):
    from torchtsp.cli import build_parser

    return build_parser().parse_args(["bench", "--mode", "serve", *flags])


def _served(bench_flags, max_batch=16):
    """The server's parsed flags for a bench command line (the command the bench starts, read by serve's parser)."""
    from torchtsp.cli import build_parser

    command = serve_command(["--preset", "tiny"], "tsp", 2, 8000, 64, max_batch, 8, 60.0, cache_flags(bench_flags))
    assert "--max-batch" not in command  # the canonical name: --max-batch is only its alias
    return build_parser().parse_args(command[command.index("serve"):])


def test_the_cache_flags_reach_the_server():
    args = _bench_args("--kv-cache-mb", "1.5", "--block-size", "8", "--max-num-batched-tokens", "1k",
                       "--no-enable-prefix-caching", "--max-concurrency", "5")
    served = _served(args, max_batch=args.max_concurrency)
    assert (served.kv_cache_mb, served.block_size, served.max_num_batched_tokens) == (1.5, 8, 1024)
    assert served.enable_prefix_caching is False and served.max_num_seqs == 5
    defaults = _served(_bench_args())  # unset: the server's own defaults, prefix caching on
    assert defaults.enable_prefix_caching is True and defaults.kv_cache_mb is None
    assert (defaults.block_size, defaults.max_num_batched_tokens) == (16, 2048)


def _exposition():
    """A real server's /metrics text: the server's own Metrics, fed as its engine feeds it."""
    from torchtsp.serve.metrics import Metrics

    m = Metrics("bench")
    m.on_ready({"kv_capacity_tokens": 4096})
    m.on_step({"running": 3, "waiting": 5, "kv_usage": 0.25, "num_preemptions": 2, "prefix_queries": 300,
               "prefix_hits": 256})
    m.ttft.observe(0.2)
    m.finished("length")
    return m


def test_the_metrics_reader_reads_a_real_metrics_text():
    text = _exposition().render().decode()
    assert "torchtsp:num_preemptions_total{model_name=\"bench\"} 2.0" in text  # the exposition it reads
    values = read_metrics(text)
    assert values["torchtsp:kv_cache_capacity_tokens"] == 4096
    assert values["torchtsp:num_requests_running"] == 3 and values["torchtsp:num_requests_waiting"] == 5
    assert values["torchtsp:kv_cache_usage_perc"] == 0.25 and values["torchtsp:num_preemptions_total"] == 2
    assert values["torchtsp:prefix_cache_queries_total"] == 300 and values["torchtsp:prefix_cache_hits_total"] == 256
    assert values["torchtsp:time_to_first_token_seconds_count"] == 1
    assert not any("bucket" in name or "request_success" in name for name in values)  # labelled beyond model_name


def test_a_runs_cache_figures_are_what_grew_during_it_and_the_peaks_polled():
    """/metrics served over HTTP while the 'run' changes the gauges: before/after differences and polled peaks."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    m = _exposition()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = m.render()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with MetricsWatch(f"http://127.0.0.1:{server.server_port}") as watch:
            m.on_step({"running": 16, "waiting": 0, "kv_usage": 0.9, "num_preemptions": 5, "prefix_queries": 700,
                       "prefix_hits": 512})
            time.sleep(0.4)  # several polls
            m.on_step({"running": 0, "waiting": 0, "kv_usage": 0.0, "num_preemptions": 5, "prefix_queries": 700,
                       "prefix_hits": 512})
    finally:
        server.shutdown()
    figures = watch.figures()
    assert figures["kv_capacity_tokens"] == 4096
    assert figures["peak_num_requests_running"] == 16 and figures["peak_num_requests_waiting"] == 5
    assert figures["preemptions"] == 3  # 5 - 2 seen before the run
    assert (figures["prefix_cache_queries"], figures["prefix_cache_hits"]) == (400, 256)
    assert figures["prefix_cache_hit_rate"] == 256 / 400


def test_random_prefix_prompts_share_exactly_n_leading_ids():
    import os

    args = _bench_args("--random-prefix-len", "24", "--input-len", "8", "--num-prompts", "16")
    prompts = [p for p, _ in make_prompts(args, 257)]
    assert all(len(p) == 32 and all(1 <= t < 257 for t in p) for p in prompts)
    assert len(os.path.commonprefix(prompts)) == 24  # not 25: the own ids start right after
    assert len({tuple(p[24:]) for p in prompts}) == 16
    plain = [p for p, _ in make_prompts(_bench_args("--input-len", "8", "--num-prompts", "16"), 257)]
    assert len(os.path.commonprefix(plain)) == 0
    # Another rate's prompts, and the warm-up, share nothing with these: no run finds its prefix cached.
    other = [p for p, _ in make_prompts(args, 257, seed=1)]
    assert len(os.path.commonprefix([prompts[0], other[0]])) == 0 and len(os.path.commonprefix(other)) == 24
    (warm, n), = warmup_prompt(args, 257, make_prompts(args, 257))
    assert len(warm) == 32 and n == args.output_len and len(os.path.commonprefix([warm, prompts[0]])) == 0


def test_a_random_prefix_with_a_dataset_is_refused(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match="--random-prefix-len applies to random prompts"):
        make_prompts(_bench_args("--dataset", str(data), "--random-prefix-len", "4"), 257)


@pytest.mark.parametrize("line,field", [
    (b'{"prompt": 5}', '"prompt"'), (b'{"prompt": null}', '"prompt"'), (b'{"prompt": ""}', '"prompt"'),
    (b'{"prompt": [1, "a"]}', '"prompt"'), (b'{"prompt": [1, 300]}', '"prompt"'), (b'{"prompt": [true]}', '"prompt"'),
    (b'{"prompt": "hi", "output_len": -5}', '"output_len"'), (b'{"prompt": "hi", "output_len": 0}', '"output_len"'),
    (b'{"prompt": "hi", "output_len": "5"}', '"output_len"'), (b'{"prompt": "hi", "output_len": 2.5}', '"output_len"'),
    (b'{"output_len": 5}', "object"), (b"[1, 2]", "object"), (b'{"prompt": "\xff\xfe"}', "UTF-8"),
    (b'{"prompt": ', "JSON"),
])
def test_a_bad_dataset_line_is_one_line_naming_the_file_the_line_and_the_field(tmp_path, capsys, line, field):
    """Exit 2 before any server starts (the dataset is read first), with one line of error: the file, the line
    number (a good line comes first) and the field."""
    from torchtsp.cli import main

    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"prompt": "fine", "output_len": 3}\n\n' + line + b"\n")
    assert main(["bench", "--mode", "serve", "--dataset", str(data), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--dataset {data}:3: " in err and field in err, err
    assert not (tmp_path / "out").exists()  # nothing ran
