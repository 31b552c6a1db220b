"""The HTTP side of the paged cache, without ranks: the flags of ``torchtsp serve``, the /metrics figures in
vLLM's names (fed through the real channel from a stand-in rank 0), the start-up line, and the 400 of a request
that outgrows the whole KV cache. The exposed text is read back with prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import time
from multiprocessing.connection import Client

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")


from helpers import metric_samples  # noqa: E402
from test_serve_hostile import _FakeClient, _Stream  # noqa: E402  (the engine as the service sees it)
from torchtsp.cli import build_parser, main  # noqa: E402
from torchtsp.data.tokenizers import ByteTokenizer  # noqa: E402
from torchtsp.serve.client import EngineClient  # noqa: E402
from torchtsp.serve.metrics import Metrics  # noqa: E402
from torchtsp.serve.service import CompletionService, ServerState  # noqa: E402

VOCAB = 257  # the byte tokenizer's
READY = {"world": 2, "engine": "tsp", "kv_layout": "sequence", "num_blocks": 1024, "block_size": 16,
         "block_tokens": 16, "kv_capacity_tokens": 16384, "kv_cache_bytes_per_rank": 64 << 20, "max_model_len": 2048}


def _step(**figures) -> dict:
    body = {"tokens": [], "finished": [], "admitted": [], "logprobs": [], "prompt_logprobs": [], "running": 0,
            "waiting": 0, "kv_usage": 0.0, "num_preemptions": 0, "prefix_queries": 0, "prefix_hits": 0,
            "step_s": 0.01}
    return {**body, **figures}


def _samples(metrics: Metrics) -> dict:
    """name{labels} -> value of every exposed sample; each must carry model_name="m"."""
    return metric_samples(metrics.render().decode(), "m")


# ---------------------------------------------------------------- /metrics


EXPOSED = {  # vLLM's names (prefix torchtsp:), as a Prometheus server scrapes them
    "torchtsp:num_requests_running", "torchtsp:num_requests_waiting", "torchtsp:kv_cache_usage_perc",
    "torchtsp:kv_cache_capacity_tokens", "torchtsp:num_preemptions_total", "torchtsp:prefix_cache_queries_total",
    "torchtsp:prefix_cache_hits_total", "torchtsp:prompt_tokens_total", "torchtsp:generation_tokens_total",
    "torchtsp:engine_steps_total", "torchtsp:engine_healthy",
    *(f'torchtsp:request_success_total{{finished_reason="{r}"}}' for r in ("stop", "length", "abort")),
    *(f"torchtsp:{h}_seconds_{part}" for h in ("time_to_first_token", "inter_token_latency",
                                                "e2e_request_latency", "request_time_per_output_token")
      for part in ("count", "sum")),
}


def test_the_rank_figures_reach_metrics_under_vllms_names_through_the_channel(capsys):
    """A stand-in rank 0 sends the ready message and step bodies over the real authenticated connection; the
    server's wiring (server._on_ready, Metrics.on_step) turns them into figures: gauges as sent, counters fed from
    the worker's cumulative figures grow by what grew (0, 3, 3, 7 preemptions are 7, not 13)."""
    from torchtsp.serve.server import _on_ready

    metrics, client = Metrics("m"), EngineClient(heartbeat_timeout_s=30)
    client.on_step, client.on_ready = metrics.on_step, lambda info: _on_ready(metrics, info)
    cumulative = [(0, 0, 0), (3, 32, 16), (3, 32, 16), (7, 96, 48)]  # preemptions, prefix queries, prefix hits
    with Client(client.address, authkey=client.authkey) as rank0:
        rank0.send(("ready", READY))
        for i, (pre, queries, hits) in enumerate(cumulative):
            rank0.send(("step", _step(running=i + 1, waiting=5 - i, kv_usage=0.25 * i, num_preemptions=pre,
                                      prefix_queries=queries, prefix_hits=hits)))
        deadline = time.monotonic() + 10
        while _samples(metrics).get("torchtsp:engine_steps_total") != 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    got = _samples(metrics)
    assert EXPOSED <= set(got), EXPOSED - set(got)
    assert not [k for k in got if k.endswith("_total_total")]
    assert got["torchtsp:engine_steps_total"] == 4
    assert (got["torchtsp:num_requests_running"], got["torchtsp:num_requests_waiting"]) == (4, 2)
    assert got["torchtsp:kv_cache_usage_perc"] == 0.75 and got["torchtsp:kv_cache_capacity_tokens"] == 16384
    assert got["torchtsp:num_preemptions_total"] == 7
    assert (got["torchtsp:prefix_cache_queries_total"], got["torchtsp:prefix_cache_hits_total"]) == (96, 48)
    assert capsys.readouterr().err.count("torchtsp: KV cache 16384 tokens") == 1


def test_counters_never_go_down_when_a_cumulative_figure_repeats_or_drops():
    metrics = Metrics("m")
    for pre in (2, 5, 5, 4, 6):  # a lower figure (never sent, but) must not make a Counter go down or double
        metrics.on_step(_step(num_preemptions=pre))
    assert _samples(metrics)["torchtsp:num_preemptions_total"] == 6


@pytest.mark.parametrize("info,line", [
    (READY, "torchtsp: KV cache 16384 tokens (1024 blocks of 16 tokens, 64.0 MiB per rank, layout sequence)"),
    ({**READY, "num_blocks": 100, "block_tokens": 32, "kv_capacity_tokens": 3200,
      "kv_cache_bytes_per_rank": 3 << 19},
     "torchtsp: KV cache 3200 tokens (100 blocks of 32 tokens (16 per rank), 1.5 MiB per rank, layout sequence)"),
    ({**READY, "kv_groups": [{"window": None}] + [{"window": 64}] * 5},
     "torchtsp: KV cache 16384 tokens (1024 blocks of 16 tokens shared by 6 block groups, sliding window 64: a "
     "sequence's longest alone, 64.0 MiB per rank, layout sequence)"),
])
def test_the_start_up_line_says_what_the_cache_holds(info, line):
    from torchtsp.serve.server import ready_line

    assert ready_line(info) == line


# ---------------------------------------------------------------- flags


def _serve_args(*flags):
    return build_parser().parse_args(["serve", *flags])


def test_the_paged_cache_flags_and_their_defaults():
    a = _serve_args()
    assert (a.max_num_seqs, a.max_num_batched_tokens, a.block_size, a.kv_cache_mb) == (16, 2048, 16, None)
    assert a.enable_prefix_caching is True and a.prefill_chunk is None
    assert _serve_args("--max-batch", "3").max_num_seqs == 3  # the alias
    assert _serve_args("--max-num-seqs", "5").max_num_seqs == 5
    assert _serve_args("--no-enable-prefix-caching").enable_prefix_caching is False
    assert _serve_args("--enable-prefix-caching").enable_prefix_caching is True
    a = _serve_args("--kv-cache-mb", "64.5", "--block-size", "32", "--max-num-batched-tokens", "4k",
                    "--prefill-chunk", "1k")
    assert (a.kv_cache_mb, a.block_size, a.max_num_batched_tokens, a.prefill_chunk) == (64.5, 32, 4096, 1024)


def test_the_flags_reach_the_ranks_job():
    from torchtsp.serve.server import _prepare
    from torchtsp.serve.worker import ServeJob

    launch = _prepare(_serve_args("--max-batch", "3", "--kv-cache-mb", "8", "--block-size", "4",
                                  "--max-num-batched-tokens", "64", "--no-enable-prefix-caching"))
    job = ServeJob(load=launch.load, address=(), authkey=b"", **launch.settings)
    assert (job.max_num_seqs, job.kv_cache_mb, job.block_size, job.max_num_batched_tokens) == (3, 8.0, 4, 64)
    assert job.enable_prefix_caching is False and job.prefill_chunk is None
    with pytest.raises(ValueError, match="--prefill-chunk must be >= 1"):  # still checked when given
        _prepare(_serve_args("--prefill-chunk", "0"))


@pytest.mark.parametrize("flags,words", [
    (["--kv-cache-mb", "0"], "--kv-cache-mb must be"), (["--kv-cache-mb", "nan"], "--kv-cache-mb must be"),
    (["--kv-cache-mb", "-4"], "--kv-cache-mb must be"), (["--block-size", "0"], "--block-size must be >= 1"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1"),
    (["--max-batch", "0"], "--max-num-seqs must be >= 1"), (["--max-num-seqs", "-1"], "--max-num-seqs must be"),
])
def test_a_bad_cache_flag_is_a_one_line_error_before_any_rank(flags, words, capsys):
    assert main(["serve", "--preset", "tiny", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchtsp: error:") and err.count("\n") == 1 and words in err, err


# ---------------------------------------------------------------- a request larger than the whole cache


CACHE = 10  # tokens the whole KV cache holds: prompt + max_tokens - 1 must stay within


def _app(info: dict, template=None):
    from torchtsp.serve.app import create_app

    state = ServerState(client=_FakeClient(info), tokenizer=ByteTokenizer(), template=template, model_name="m",
                        max_model_len=64, vocab_size=VOCAB, eos_token_id=256, api_key=None, max_queue=8,
                        metrics=Metrics("m"))
    return create_app(state), state.client


def test_a_request_beyond_the_whole_cache_is_400_naming_the_limit_and_the_flag():
    from fastapi.testclient import TestClient

    app, client = _app({**READY, "kv_capacity_tokens": CACHE})
    with TestClient(app) as http:
        ok = http.post("/v1/completions", json={"prompt": "abcde", "max_tokens": 6})  # 5 + 6 - 1 = 10: fits
        assert ok.status_code == 200 and [r[:2] for r in client.submitted] == [(list(b"abcde"), 6)], ok.text
        for body in ({"prompt": "abcde", "max_tokens": 7}, {"prompt": "abcde", "max_tokens": 7, "n": 2},
                     {"prompt": ["ab", "abcde"], "max_tokens": 7}):
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded", error
            assert f"({CACHE} tokens)" in error["message"] and "--kv-cache-mb" in error["message"], error
            assert "11 tokens of KV cache" in error["message"] and "at most 6" in error["message"], error
        r = http.post("/v1/completions", json={"prompt": "abcdefghijk", "max_tokens": 1})  # the prompt alone
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "--kv-cache-mb" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": "abcde", "max_tokens": 6, "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        assert len(client.submitted) == 3  # nothing refused was queued
    app, client = _app({})  # before the ready message: the context alone limits (the engine still checks)
    with TestClient(app) as http:
        r = http.post("/v1/completions", json={"prompt": "abcde", "max_tokens": 59})
        assert r.status_code == 200 and [r[:2] for r in client.submitted] == [(list(b"abcde"), 59)], r.text


def test_chat_is_refused_too_and_its_default_max_tokens_is_what_the_cache_leaves():
    from fastapi.testclient import TestClient

    from torchtsp.serve.template import ChatTemplate

    template = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    try:
        app, client = _app({**READY, "kv_capacity_tokens": CACHE}, template)
        with TestClient(app) as http:
            messages = [{"role": "user", "content": "abcd"}]
            r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8})
            assert r.status_code == 400 and "--kv-cache-mb" in r.json()["error"]["message"], r.text
            r = http.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 8, "n": 3})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
            r = http.post("/v1/chat/completions", json={"messages": messages})  # the rest of the cache: 10 + 1 - 4
            assert r.status_code == 200 and [r[:2] for r in client.submitted] == [(list(b"abcd"), 7)], r.text
    finally:
        template.close()


# ---------------------------------------------------------------- request figures


async def _never():
    return False


def test_request_figures_success_reasons_and_inter_token_latency():
    """Per request: finished_reason stop / length as the engine says, anything else (here a cancellation) abort;
    one inter-token latency per token after the first; one e2e latency per request; tokens counted."""
    from torchtsp.serve.protocol import CompletionRequest, parse

    client = _FakeClient({})
    state = ServerState(client=client, tokenizer=ByteTokenizer(), template=None, model_name="m", max_model_len=64,
                        vocab_size=VOCAB, eos_token_id=256, api_key=None, max_queue=8, metrics=Metrics("m"))
    service = CompletionService(state)
    endings = [[("token", 111), ("token", 107), ("token", 33), ("finished", "length")],
               [("token", 111), ("finished", "stop")], [("finished", "cancelled")]]

    async def run():
        for events in endings:
            client.submit = lambda *a, _e=events, **k: _Stream(_e)
            choices = await service.completion_choices(parse(CompletionRequest, b'{"prompt": "hi", "max_tokens": 3}'))
            try:
                await service.complete(choices, service.submit(choices), False, _never)
            except Exception:  # noqa: BLE001 - the cancelled one fails its request (503); counted all the same
                pass

    asyncio.run(run())
    got = _samples(state.metrics)
    reasons = {r: got[f'torchtsp:request_success_total{{finished_reason="{r}"}}'] for r in ("stop", "length", "abort")}
    assert reasons == {"stop": 1, "length": 1, "abort": 1}
    assert got["torchtsp:inter_token_latency_seconds_count"] == 2  # 3 tokens: 2 gaps; 1 token: none
    assert got["torchtsp:time_to_first_token_seconds_count"] == 2
    assert got["torchtsp:e2e_request_latency_seconds_count"] == 3
    assert (got["torchtsp:generation_tokens_total"], got["torchtsp:prompt_tokens_total"]) == (4, 6)
