"""Faults a real client meets, against one real 2-rank TSP server (HTTP on 127.0.0.1): a non-streaming client
that leaves, a prompt batch larger than the queue could ever hold, and SIGTERM under load (the last test: it
stops the server). The server's own figures (/metrics) and log are the witnesses; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import pytest

from helpers import tiny_hf_llama
from test_serve import PROMPTS, Server, _alive, _metrics

pytestmark = pytest.mark.multirank

httpx = pytest.importorskip("httpx")

MAX_BATCH, MAX_QUEUE, GRACE_S, CONTEXT = 8, 12, 4.0, 1024  # a burst of MAX_BATCH fits the queue
LONG = 1000  # tokens: many seconds of decoding here, far more than any wait below


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("faults") / "tiny-llama"
    tiny_hf_llama(folder, max_position_embeddings=CONTEXT)
    s = Server(folder, tmp_path_factory.mktemp("logs") / "faults.log", "--max-model-len", str(CONTEXT),
               "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE), "--shutdown-grace-s", str(GRACE_S),
               "--timeout-s", "60")
    try:
        s.wait_ready()
        yield s
    finally:
        s.close()


def _wait_for(server, name: str, value: float, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        if m[name] == value or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


@pytest.mark.parametrize("flags,words", [(["--max-queue", "0"], "--max-queue must be >= 1"),
                                         (["--shutdown-grace-s", "-1"], "--shutdown-grace-s must be"),
                                         (["--shutdown-grace-s", "nan"], "--shutdown-grace-s must be")])
def test_a_queue_that_admits_nothing_or_a_bad_grace_is_refused_at_launch(flags, words, capsys):
    """--max-queue 0 would answer every request 429 forever (each one waits in the queue for a step)."""
    from torchtsp.cli import main

    assert main(["serve", "--preset", "tiny", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_a_batch_larger_than_the_queue_is_400_naming_the_limit(server):
    """More prompts than --max-queue can never be queued: 400 (which clients do not retry), not 429."""
    for prompt in (["the cat"] * (MAX_QUEUE + 1), [[5, 6]] * (MAX_QUEUE + 1)):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt" and "--max-queue" in error["message"], error
        assert f"{MAX_QUEUE + 1}" in error["message"] and f"{MAX_QUEUE}" in error["message"], error
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["the cat"] * MAX_QUEUE, "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_QUEUE, r.text


def test_a_non_streaming_request_is_cancelled_when_its_client_leaves(server):
    """The client closes its connection while the answer is generated: the engine stops the request at a step
    boundary (its row is freed) instead of generating all of max_tokens for nobody."""
    before = _metrics(server)
    body = json.dumps({"prompt": PROMPTS[1], "max_tokens": LONG, "temperature": 0, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert _wait_for(server, "torchtsp:num_requests_running", 1)["torchtsp:num_requests_running"] == 1
    left = time.monotonic()
    after = _wait_for(server, "torchtsp:num_requests_running", 0)
    assert after["torchtsp:num_requests_running"] == 0 and time.monotonic() - left < 10
    generated = after["torchtsp:generation_tokens_total"] - before["torchtsp:generation_tokens_total"]
    assert generated < LONG, generated
    assert after["torchtsp:kv_cache_usage_perc"] == 0
    assert after['torchtsp:request_success_total{finished_reason="abort"}'] == \
        before['torchtsp:request_success_total{finished_reason="abort"}'] + 1
    ok = 'torchtsp:http_requests_total{endpoint="/v1/completions",status="200"}'
    assert after.get(ok, 0) == before.get(ok, 0)  # never answered: nobody was there to read it


async def _stream(client, body: dict, log: list) -> dict:
    """One streamed completion, read to its end: its data payloads, when each arrived, and its status."""
    out = {"status": None, "data": [], "times": []}
    try:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["body"] = json.loads(await r.aread())
                out["times"].append(time.monotonic())
                return out
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    out["data"].append(line[6:])
                    out["times"].append(time.monotonic())
    except httpx.HTTPError as e:  # a truncated body: what SIGTERM did before
        out["transport_error"] = repr(e)
    log.append(out)
    return out


def _ending(out: dict) -> str:
    """"complete", "error" or what is wrong with the stream's end."""
    if out.get("transport_error") or out["status"] != 200:
        return f"broken: {out}"
    data = out["data"]
    if len(data) < 2 or data[-1] != "[DONE]":
        return f"no [DONE]: {data[-3:]}"
    last = json.loads(data[-2])
    if "error" in last:
        return "error"
    if last["choices"] and last["choices"][0]["finish_reason"] in ("stop", "length"):
        return "complete"
    return f"neither: {data[-3:]}"


def test_sigterm_under_load_drains_the_queue_then_ends_running_streams_and_exits_cleanly(server):
    """8 streams run and more wait when SIGTERM comes: the waiting ones fail at once (an SSE error event then
    [DONE], or 503 JSON), nothing new is admitted, the running ones go on for the grace period and then end with
    an error event and [DONE]; the process exits 0 with no traceback in its log."""
    family = server.descendants()
    body = {"prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    queued_n = 5

    async def run():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as c:
            running_log, queued_log = [], []
            running = [asyncio.ensure_future(_stream(c, body, running_log)) for _ in range(MAX_BATCH)]
            await asyncio.to_thread(_wait_for, server, "torchtsp:num_requests_running", MAX_BATCH)
            queued = [asyncio.ensure_future(_stream(c, body, queued_log)) for _ in range(queued_n)]
            plain = asyncio.ensure_future(c.post("/v1/completions", json=body))
            m = await asyncio.to_thread(_wait_for, server, "torchtsp:num_requests_waiting", queued_n + 1)
            figures = (m["torchtsp:num_requests_running"], m["torchtsp:num_requests_waiting"])
            assert figures == (MAX_BATCH, queued_n + 1), (figures, [o["data"][-2:] for o in running_log])
            server.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            await asyncio.sleep(0.5)
            try:  # nothing new is admitted: the port is closed, or 503
                late = (await httpx.AsyncClient(base_url=server.url, timeout=10).post(
                    "/v1/completions", json={"prompt": "the", "max_tokens": 1})).status_code
            except httpx.HTTPError:
                late = "refused"
            results = await asyncio.wait_for(asyncio.gather(*running, *queued, plain), 60)
            return sent, late, results[:MAX_BATCH], results[MAX_BATCH:-1], results[-1]

    sent, late, running, queued, plain = asyncio.run(run())
    assert late in ("refused", 503), late
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "server_shutdown", plain.text
    for out in queued:  # never admitted: no token, and the error comes at once rather than after the grace
        assert _ending(out) == "error" and len(out["data"]) == 2, out
        assert out["times"][-1] - sent < GRACE_S - 1, (out["times"][-1] - sent, out["data"])
        assert json.loads(out["data"][0])["error"]["code"] == "server_shutdown", out
    for out in running:  # kept going for the grace period, then an error event (or done on a fast machine)
        ending = _ending(out)
        assert ending in ("complete", "error"), ending
        if ending == "error":
            assert out["times"][-1] - sent > GRACE_S - 1, out["times"][-1] - sent
            assert sum(t > sent + 1 for t in out["times"]) > 1, "the stream was not decoded during the grace"
    assert server.proc.wait(30) == 0
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in family if _alive(p)]
    log = server.log.read_text()
    assert "Traceback" not in log and "Event loop is closed" not in log and "Exception" not in log, log[-3000:]
