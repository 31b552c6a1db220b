"""``torchtsp serve`` end to end: the official ``openai`` client against 2-rank TSP servers (real processes,
gloo on 127.0.0.1) on a random tiny Hugging Face Llama with a BPE tokenizer trained here.

Three servers start once for the module (they load in parallel): ``server`` serves every request test and
is stopped by SIGTERM under load at the end; ``doomed`` has a rank killed; ``small`` (a small cache) queues and
preempts, then has its fork server killed. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import is_rank, metric_samples, tiny_hf_llama

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

KEY = "test-key"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
# The checkpoint's chat_template.jinja (read before tokenizer_config.json's, as transformers 5 saves it): TEMPLATE
# for every message, and hostile branches for a first message of role "probe".
HOSTILE_TEMPLATE = (
    "{% if messages[0]['role'] == 'probe' %}"
    "{% if messages[0]['content'] == 'loop' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif messages[0]['content'] == 'type' %}{{ messages + 1 }}"
    "{% elif messages[0]['content'] == 'memory' %}{{ 'x' * 10**10 }}"
    "{% elif messages[0]['content'] == 'long' %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}"
    "{% endif %}{% else %}" + TEMPLATE + "{% endif %}")
PROMPTS = ["the cat sat on", "a bird flew over the park and then", "the dog ran", "on a mat the"]
START_S, STOP_S = 180, 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``torchtsp serve`` of ``folder`` on ``ranks`` TSP ranks (1: one rank, for what does not depend on the
    parallel path: the HTTP side, rank 0's scheduler, the tool parser, ... each rank is a process to start and a
    party to every step's collectives)."""

    def __init__(self, folder: Path, log: Path, *extra, ranks: int = 2):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        src = str(Path(__file__).resolve().parents[1] / "src")
        env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "TORCHTSP_DEBUG": "0"}
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torchtsp", "serve", "--hf", str(folder), "--nproc", str(ranks),
             *(["--tsp", str(ranks)] if ranks > 1 else []), "--port", str(self.port), "--served-model-name",
             "tiny-llama", "--max-model-len", "128", *extra],
            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"server not ready in {START_S}s: {self.log.read_text()[-3000:]}")

    def descendants(self) -> list[int]:
        """The server's processes (ranks, multiprocessing's resource tracker), from /proc."""
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    kids = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
                    found += map(int, kids)
                    todo += map(int, kids)
            except OSError:
                pass
        return found

    def ranks(self) -> list[int]:
        return [p for p in self.descendants() if is_rank(p)]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve") / "tiny-llama"
    eos = tiny_hf_llama(folder, chat_template="{{ 'not this one' }}")
    (folder / "chat_template.jinja").write_text(HOSTILE_TEMPLATE)
    return folder, eos


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory):
    folder, _ = checkpoint
    logs = tmp_path_factory.mktemp("logs")
    main = Server(folder, logs / "main.log", "--api-key", KEY, "--max-batch", "16", "--timeout-s", "60")
    doomed = Server(folder, logs / "doomed.log", "--timeout-s", "20", "--max-batch", "1", "--max-queue", "1")
    # The tiny Llama at D = 2 (heads layout): 2 layers x K and V x 1 KV head of 16 floats = 256 bytes per token
    # per rank, so 1/16 MiB is 256 tokens in 64 blocks of 4: an eighth of 16 rows of --max-model-len 128.
    small = Server(folder, logs / "small.log", "--kv-cache-mb", "0.0625", "--block-size", "4", "--max-num-seqs", "16",
                   "--max-num-batched-tokens", "64", "--timeout-s", "60")
    try:
        for s in (main, doomed, small):
            s.wait_ready()
        yield {"main": main, "doomed": doomed, "small": small}
    finally:
        for s in (main, doomed, small):
            s.close()


@pytest.fixture(scope="module")
def server(servers):
    return servers["main"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_greedy(checkpoint):
    folder, eos = checkpoint
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()

    def run(text: str, max_tokens: int) -> str:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    return run


def _post(server, path, body, key=KEY, raw=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body if raw is None else None, content=raw, headers=headers, timeout=60)


def _metrics(server) -> dict:
    """The server's /metrics samples (helpers.metric_samples: every one labelled with the served model's name)."""
    return metric_samples(httpx.get(server.url + "/metrics", timeout=10).text, "tiny-llama")


# ---------------------------------------------------------------- correctness


def test_greedy_completions_equal_hugging_face(client, hf_greedy):
    for prompt in PROMPTS[:3]:
        got = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == hf_greedy(prompt, 12), prompt
        assert got.usage.completion_tokens >= 1 and got.choices[0].finish_reason in ("stop", "length")
    batch = client.completions.create(model="tiny-llama", prompt=PROMPTS[:2], max_tokens=6, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [hf_greedy(p, 6) for p in PROMPTS[:2]]


def test_stream_equals_non_streamed_with_one_usage_chunk(client):
    for seed, temperature in ((None, 0.0), (7, 0.9)):
        whole = client.completions.create(model="tiny-llama", prompt=PROMPTS[1], max_tokens=16,
                                          temperature=temperature, seed=seed)
        chunks = list(client.completions.create(model="tiny-llama", prompt=PROMPTS[1], max_tokens=16,
                                                temperature=temperature, seed=seed, stream=True,
                                                stream_options={"include_usage": True}))
        usage = [c for c in chunks if c.usage is not None]
        assert len(usage) == 1 and usage[0] is chunks[-1] and not usage[0].choices
        assert usage[0].usage.model_dump() == whole.usage.model_dump()
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_chat_equals_completion_of_the_rendered_template(client, checkpoint):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    messages = [{"role": "system", "content": "the park"}, {"role": "user", "content": "the cat sat"}]
    rendered = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(TEMPLATE).render(
        messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    chat = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0)
    plain = client.completions.create(model="tiny-llama", prompt=rendered, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens
    streamed = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == plain.choices[0].text


def test_stop_strings_and_echo(client):
    base = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = text[3:5]
    assert stop, text
    cut = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    echoed = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=16, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + text


def test_sixteen_concurrent_requests_batch(server):
    """Each of 16 requests (prompts of 2..17 words) returns what it returns alone, and together they take well
    under the time of running them one by one: the batch is real."""
    prompts = [" ".join((PROMPTS[i % 4] + " the mat").split()[: 2 + i]) for i in range(16)]

    async def one(c, p):
        r = await c.completions.create(model="tiny-llama", prompt=p, max_tokens=24, temperature=0)
        return r.choices[0].text

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300) as c:
            await one(c, prompts[0])  # warm
            t0 = time.perf_counter()
            alone = [await one(c, p) for p in prompts]
            sequential = time.perf_counter() - t0
            t0 = time.perf_counter()
            together = await asyncio.gather(*(one(c, p) for p in prompts))
            return alone, list(together), sequential, time.perf_counter() - t0

    alone, together, sequential, concurrent = asyncio.run(run())
    assert together == alone
    # 16 sequences per decode step against 16 one-sequence steps: the tiny model's step is mostly fixed cost,
    # so batching gives several times the throughput; half the time leaves room for a busy shared machine.
    assert concurrent < 0.5 * sequential, (concurrent, sequential)


# ---------------------------------------------------------------- errors, keys, disconnects


BAD = [  # (body or raw bytes, status, param)
    (b"{not json", 400, None),
    ({"model": "tiny-llama", "prompt": "the", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": "tiny-llama", "prompt": "the", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny-llama", "prompt": "the", "top_p": 1.5}, 400, "top_p"),
    ({"model": "tiny-llama", "prompt": "the", "top_k": 0}, 400, "top_k"),
    ({"model": "tiny-llama", "prompt": [1, 2, 100000]}, 400, "prompt"),
    ({"model": "tiny-llama", "prompt": "the", "max_tokens": 1000}, 400, "max_tokens"),
    ({"model": "tiny-llama", "prompt": "the", "n": 129}, 400, "n"),
    ({"model": "tiny-llama", "prompt": "the", "logprobs": 21}, 400, "logprobs"),
    ({"model": "tiny-llama", "prompt": ""}, 400, "prompt"),
    ({"model": "other", "prompt": "the"}, 404, "model"),
]


def test_every_error_has_its_status_and_body_and_the_server_stays_up(server, client):
    for body, status, param in BAD:
        raw = body if isinstance(body, bytes) else None
        r = _post(server, "/v1/completions", None if raw else body, raw=raw)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
        if "max_tokens" in str(body) and status == 400 and body.get("max_tokens") == 1000:
            assert "128" in error["message"] and "1000" in error["message"]  # the lengths, in the message
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert client.completions.create(model="tiny-llama", prompt="the", max_tokens=1).choices[0].finish_reason
    r = _post(server, "/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "user", "content": "a"}],
                                                "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0]"
    with pytest.raises(openai.BadRequestError):  # unknown fields are ignored, refused ones are not
        client.completions.create(model="tiny-llama", prompt="the", max_tokens=2, extra_body={"best_of": 3})
    assert client.completions.create(model="tiny-llama", prompt="the", max_tokens=2,
                                     extra_body={"unknown_field": 1}).choices[0].text is not None


HOSTILE_VALUES = [  # (fields added to a good request, the field the 400 names)
    ({"top_k": 2**63}, "top_k"),  # once packed into the int64 step plan: /health 503 until restart
    ({"top_k": 10**6}, "top_k"),  # more than the vocabulary: torch.topk fails on every rank
    ({"seed": 2**64}, "seed"),
    ({"seed": -1}, "seed"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_tokens": -(2**63) - 1}, "max_tokens"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [1] * 100000}, "stop_token_ids"),
    ({"prompt": [2**64, 1]}, "prompt"),
    ({"prompt": [[1, 2], [3, -5]]}, "prompt"),
    ({"temperature": 1e308}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 0}, "n"),
    ({"stream": "yes"}, "stream"),
]


def test_hostile_values_fail_only_their_request(server, client):
    """Every value that would cross to the ranks is bounded before it is queued: a 400 naming the field, and
    the engine, /health and the next request are untouched."""
    for extra, param in HOSTILE_VALUES:
        r = _post(server, "/v1/completions", {"model": "tiny-llama", "prompt": "the", "max_tokens": 2, **extra})
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param, (extra, error)
        assert len(error["message"]) < 300, error  # a 20-digit or 100000-item value is not echoed whole
        if param == "n":
            assert "n > 1" not in error["message"] and "0" in error["message"], error
    nested = b'{"prompt": "the", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    r = _post(server, "/v1/completions", None, raw=nested)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert client.completions.create(model="tiny-llama", prompt="the", max_tokens=2).usage.completion_tokens >= 1


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class HealthPoller:
    """/health polled from a thread while a request runs: (latency, status) of each answer."""

    def __init__(self, server):
        import threading

        self.server, self.answers, self.done = server, [], threading.Event()
        self.thread = threading.Thread(target=self._poll)

    def _poll(self):
        while not self.done.is_set():
            t = time.monotonic()
            status = httpx.get(self.server.url + "/health", timeout=30).status_code
            self.answers.append((time.monotonic() - t, status))
            time.sleep(0.1)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()

    def check(self, at_least: int = 1) -> None:
        assert len(self.answers) >= at_least and all(status == 200 for _, status in self.answers), self.answers
        assert max(t for t, _ in self.answers) < 5.0, self.answers


def test_a_huge_prompt_is_refused_without_tokenizing_it(server):
    """10 MB of text cannot fit 128 tokens: a 400 at once (tokenizing it takes minutes, holding the GIL)."""
    big = "the cat sat on " * 700_000
    with HealthPoller(server) as health:
        t0 = time.monotonic()
        r = _post(server, "/v1/completions", {"prompt": big, "max_tokens": 2})
        chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": big}]})
        took = time.monotonic() - t0
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "characters" in r.json()["error"]["message"] and took < 30, took
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages", chat.text
    health.check()


def test_a_runaway_chat_template_fails_its_request_and_really_stops(server, client):
    """Two nested range(100000) loops: a 400 within a few seconds, /health answering all along, and no process
    left computing it; a template that errors, eats memory or writes too much is a 400 too."""
    t0 = time.monotonic()
    with HealthPoller(server) as health:
        r = _post(server, "/v1/chat/completions", {"messages": [{"role": "probe", "content": "loop"}], "max_tokens": 2})
    health.check(at_least=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "longer than" in r.json()["error"]["message"] and time.monotonic() - t0 < 30
    children = [p for p in server.descendants() if "torchtsp.serve.template" in Path(f"/proc/{p}/cmdline").read_text()]
    before = {p: _cpu_seconds(p) for p in children if _alive(p)}
    time.sleep(1.0)
    assert all(_cpu_seconds(p) - before[p] < 0.3 for p in before if _alive(p)), "a render still runs"
    for content, words in (("type", "TypeError"), ("memory", "characters"), ("long", "characters")):
        r = _post(server, "/v1/chat/completions", {"messages": [{"role": "probe", "content": content}]})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (content, r.text)
    r = _post(server, "/tokenize", {"messages": [{"role": "probe", "content": "type"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "the cat"}],
                                          max_tokens=3, temperature=0)
    assert chat.usage.completion_tokens >= 1


def test_a_partial_body_and_a_template_error_leave_one_line_each_in_the_log(server):
    """A client that leaves half-way through its body, and a template raising TypeError, are not bugs of the
    server: no traceback in its log."""
    before = len(server.log.read_text())
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": \"the")
        time.sleep(0.3)
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "probe", "content": "type"}]})
    assert r.status_code == 400
    time.sleep(1.0)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    log = server.log.read_text()[before:]
    assert "Traceback" not in log and log.count("\n") <= 2, log[-3000:]


def test_api_key(server):
    assert _post(server, "/v1/completions", {"prompt": "the", "max_tokens": 1}, key=None).status_code == 401
    r = _post(server, "/v1/completions", {"prompt": "the", "max_tokens": 1}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert models["data"][0]["id"] == "tiny-llama"
    # The engine's KV-cache layout (2 KV heads on tsp=2: auto's first layout with an engine, heads once it has one).
    from torchtsp.kv_layouts import allowed_kv_layouts

    assert models["data"][0]["kv_layout"] == allowed_kv_layouts(2, 2)[0]


def test_tokenize_and_detokenize(server, checkpoint):
    ids = _post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()["tokens"]
    assert _post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == PROMPTS[0]
    assert _post(server, "/detokenize", {"tokens": [10**6]}).status_code == 400


def test_tokenizer_info_model_card_and_the_completion_default(server, client, checkpoint):
    """What lm-evaluation-harness and the openai client read besides completions, against transformers' own
    tokenizer; a completion without max_tokens generates OpenAI's 16, not the rest of the context."""
    folder, eos = checkpoint
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    headers = {"Authorization": f"Bearer {KEY}"}
    info = httpx.get(server.url + "/tokenizer_info", headers=headers, timeout=10).json()
    assert (info["eos_token_id"], info["eos_token"]) == (eos, reference.eos_token)
    assert (info["bos_token_id"], info["bos_token"]) == (reference.bos_token_id, reference.bos_token)
    assert info["model_max_length"] == 128 and info["vocab_size"] == len(reference)
    assert info["chat_template"] == (folder / "chat_template.jinja").read_text()
    assert client.models.retrieve("tiny-llama").id == "tiny-llama"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another-model")
    plain = client.completions.create(model="tiny-llama", prompt="the", temperature=0, extra_body={"ignore_eos": True})
    assert plain.usage.completion_tokens == 16
    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "the"}],
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 128  # chat: the rest of the context


def test_the_start_up_line_says_the_cache_capacity_that_metrics_shows(server):
    import re

    lines = re.findall(r"torchtsp: KV cache (\d+) tokens \((\d+) blocks of (\d+) tokens.*?, ([\d.]+) MiB per rank, "
                       r"layout (\w+)\)", server.log.read_text())
    assert len(lines) == 1, server.log.read_text()[-3000:]
    tokens, blocks, block_tokens, mib, layout = lines[0]
    from torchtsp.kv_layouts import allowed_kv_layouts

    assert int(tokens) == int(blocks) * int(block_tokens) and float(mib) > 0
    assert layout == allowed_kv_layouts(2, 2)[0]  # auto's, as /v1/models says
    assert _metrics(server)["torchtsp:kv_cache_capacity_tokens"] == int(tokens)


def test_requests_beyond_the_cache_capacity_queue_or_are_preempted_and_each_gets_its_alone_text(servers):
    """16 concurrent requests that need about three times the 256 tokens the small server's cache holds: they are
    admitted by free blocks, the newest preempted when blocks run out and recomputed, and every one returns the
    text it returns alone (greedy and seeded sampling); the cache's capacity and the preemptions are in /metrics."""
    small = servers["small"]
    prompts = [" ".join((PROMPTS[i % 4] + " the mat and the park").split()[: 3 + i % 9]) for i in range(16)]
    sampling = [dict(temperature=0) if i % 3 else dict(temperature=0.9, seed=100 + i) for i in range(16)]

    async def one(c, i):
        r = await c.completions.create(model="tiny-llama", prompt=prompts[i], max_tokens=40, extra_body={
            "ignore_eos": True}, **sampling[i])
        return r.choices[0].text

    async def run():
        async with openai.AsyncOpenAI(base_url=small.url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
            alone = [await one(c, i) for i in range(16)]
            before = _metrics(small)["torchtsp:num_preemptions_total"]
            together = await asyncio.gather(*(one(c, i) for i in range(16)))
            return alone, list(together), before

    alone, together, before = asyncio.run(run())
    assert together == alone
    m = _metrics(small)
    assert m["torchtsp:kv_cache_capacity_tokens"] == 256
    assert m["torchtsp:num_preemptions_total"] > before  # 16 x ~48 tokens against 256: blocks ran out
    assert m["torchtsp:kv_cache_usage_perc"] == 0 and m["torchtsp:num_requests_running"] == 0


def test_disconnect_frees_the_slots_on_every_rank(server, client):
    body = {"model": "tiny-llama", "prompt": PROMPTS[1], "max_tokens": 100, "temperature": 0, "stream": True,
            "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        next(lines), next(lines)
        m = _metrics(server)
        assert m["torchtsp:num_requests_running"] == 1 and m["torchtsp:kv_cache_usage_perc"] > 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = _metrics(server)
        if m["torchtsp:num_requests_running"] == 0:
            break
        time.sleep(0.1)
    assert m["torchtsp:num_requests_running"] == 0 and m["torchtsp:kv_cache_usage_perc"] == 0
    assert client.completions.create(model="tiny-llama", prompt="the", max_tokens=3).usage.completion_tokens >= 1


def test_full_queue_is_429_and_the_server_stays_up(servers):
    """One row and one place in the queue: while A runs B waits, and C is refused; a burst of four cannot all
    pass the queue check before any counts as waiting. A's 100 tokens take a fraction of a second, so on a busy
    machine (or with a fast decode) A may be done before C arrives (C is then served): that attempt is repeated."""
    doomed = servers["doomed"]
    body = {"prompt": PROMPTS[1], "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
    statuses = []
    for _ in range(12):
        with httpx.stream("POST", doomed.url + "/v1/completions", json=body, timeout=60) as a:
            lines = a.iter_lines()  # kept: a dropped line iterator closes the response, and A would be cancelled
            next(line for line in lines if line.startswith("data: "))  # A runs
            with httpx.stream("POST", doomed.url + "/v1/completions", json=body, timeout=60) as b:
                assert b.status_code == 200  # B waits for A's row
                c = httpx.post(doomed.url + "/v1/completions", json={"prompt": "the", "max_tokens": 1}, timeout=60)
                statuses.append(c.status_code)
                if c.status_code == 429:
                    assert c.json()["error"]["code"] == "queue_full", c.text
                    assert httpx.get(doomed.url + "/health", timeout=10).status_code == 200
        deadline = time.monotonic() + 20  # A and B leave at the next step boundaries (B may still be queued)
        busy = ("torchtsp:num_requests_running", "torchtsp:num_requests_waiting")
        while any(_metrics(doomed)[k] for k in busy) and time.monotonic() < deadline:
            time.sleep(0.05)
        if statuses[-1] == 429:
            break
    assert statuses[-1] == 429 and set(statuses) <= {200, 429}, statuses

    async def burst():
        async with httpx.AsyncClient(base_url=doomed.url, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json={**body, "stream": False})
                                          for _ in range(4)))

    answers = [r.status_code for r in asyncio.run(burst())]
    assert answers.count(200) <= 2 and set(answers) == {200, 429}, answers  # one row + one queue place
    r = httpx.post(doomed.url + "/v1/completions", json={"prompt": "the", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# ---------------------------------------------------------------- faults


def test_killed_rank_fails_in_flight_requests_then_the_server_exits_non_zero(servers):
    """A dead rank ends the server as it ends ``train``: the stream in flight gets an error event, then the
    process exits with status 2 and one line naming the rank, instead of answering 503 forever."""
    doomed = servers["doomed"]
    ranks = doomed.ranks()
    assert len(ranks) == 2, ranks

    async def in_flight():
        async with openai.AsyncOpenAI(base_url=doomed.url + "/v1", api_key="none", max_retries=0, timeout=60) as ac:
            stream = await ac.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=120, stream=True,
                                                 temperature=0, extra_body={"ignore_eos": True})
            got = []
            async for chunk in stream:
                if not got:
                    os.kill(ranks[1], signal.SIGKILL)
                got.append(chunk)
            return got

    t0 = time.monotonic()
    with pytest.raises(openai.APIError, match="rank 1 died"):  # the error event mid-stream
        asyncio.run(asyncio.wait_for(in_flight(), 60))
    assert time.monotonic() - t0 < 30
    assert doomed.proc.wait(STOP_S) == 2
    log = doomed.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert [line for line in log.splitlines() if line.startswith("torchtsp: error:") and "rank 1 died" in line], log
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in ranks if _alive(p)]


def test_a_killed_fork_server_ends_the_server_naming_it(servers):
    """The ranks' parent is the fork server, not the serving process: when the fork server is killed, the ranks
    say so (not that their launcher, alive, has gone) and the server exits non-zero within seconds with one line
    naming the fork server, not a rank's placeholder exit code 255. The server is ``small``, whose one test ran
    above (each server has its own fork server: the others are not touched)."""
    server = servers["small"]
    assert server.proc.poll() is None, server.log.read_text()[-3000:]
    ranks = server.ranks()
    assert len(ranks) == 2, ranks
    fork_server = int(Path(f"/proc/{ranks[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert fork_server != server.proc.pid
    assert fork_server not in servers["main"].descendants()
    os.kill(fork_server, signal.SIGKILL)
    assert server.proc.wait(STOP_S) not in (0, None)
    log = server.log.read_text()
    assert f"fork server the ranks were forked from (pid {fork_server}) died" in log, log[-3000:]
    assert f"launcher (pid {server.proc.pid}) has gone" not in log and "code 255" not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_sigterm_under_load_exits_cleanly(server):
    family = server.descendants()
    assert family

    async def load():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            async def one(i):
                try:
                    r = await c.completions.create(model="tiny-llama", prompt=PROMPTS[i % 4], max_tokens=100,
                                                   temperature=0, extra_body={"ignore_eos": True})
                    return r.choices[0].finish_reason
                except openai.APIError as e:
                    return type(e).__name__
            tasks = [asyncio.ensure_future(one(i)) for i in range(8)]
            await asyncio.sleep(1.0)
            server.proc.send_signal(signal.SIGTERM)
            return await asyncio.wait_for(asyncio.gather(*tasks), STOP_S)

    t0 = time.monotonic()
    outcomes = asyncio.run(load())
    assert server.proc.wait(STOP_S) == 0
    assert time.monotonic() - t0 < STOP_S
    assert all(isinstance(o, str) for o in outcomes), outcomes  # every request answered or failed, none hung
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in family if _alive(p)]
    assert "Traceback" not in server.log.read_text(), server.log.read_text()[-2000:]
    json.dumps(outcomes)
