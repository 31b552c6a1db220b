"""Hostile input to the server, without HTTP or ranks: every value bounded before it is queued, rank 0's
second check, the completion service driven directly, chat templates that run away, and the startup
errors of a crafted tokenizer folder. (test_serve.py sends the same probes to a real 2-rank server.)"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("jinja2")

from torchtsp.data.tokenizers import ByteTokenizer  # noqa: E402
from torchtsp.serve.metrics import Metrics  # noqa: E402
from torchtsp.serve.plan import Admission, Sampling, StepPlan, encode  # noqa: E402
from torchtsp.serve.protocol import APIError, CompletionRequest, parse  # noqa: E402
from torchtsp.serve.service import CompletionService, ServerState  # noqa: E402
from torchtsp.serve.template import ChatTemplate  # noqa: E402

VOCAB = 257  # the byte tokenizer's


def _refusal(raw: dict | bytes) -> APIError:
    """The APIError a completion body gets from the checks that run before anything is queued."""
    service = CompletionService(_state(_FakeClient()))
    body = json.dumps(raw).encode() if isinstance(raw, dict) else raw
    with pytest.raises(APIError) as e:
        asyncio.run(service.completion_choices(parse(CompletionRequest, body)))
    return e.value


@pytest.mark.parametrize("extra,param", [
    ({"top_k": 2**63}, "top_k"), ({"top_k": VOCAB + 1}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"seed": 2**63}, "seed"), ({"seed": -1}, "seed"),
    ({"max_tokens": 2**63}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"), ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"stop_token_ids": [1] * 1000}, "stop_token_ids"),
    ({"prompt": [1, -1]}, "prompt"), ({"prompt": [[1], [2**63]]}, "prompt"), ({"prompt": ["a"] * 1000}, "prompt"),
    ({"temperature": 2.5}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"n": 0}, "n"), ({"stream": "yes"}, "stream"), ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
])
def test_every_value_that_crosses_to_the_ranks_is_bounded(extra, param):
    e = _refusal({"prompt": "hi", "max_tokens": 2, **extra})
    assert e.status == 400 and e.param == param and len(e.message) < 300, (e.param, e.message)


def test_a_field_named_like_a_type_is_named_and_n_zero_is_not_called_n_above_one():
    assert _refusal({"prompt": "hi", "stream": "yes"}).message.startswith("stream:")
    message = _refusal({"prompt": "hi", "n": 0}).message
    assert "n > 1" not in message and "got 0" in message


@pytest.mark.parametrize("raw", [b"[" * 100000, b'{"prompt": "a", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}",
                                 b'{"prompt": "a", "x": ' + b'{"a":' * 50000 + b"1" + b"}" * 50000 + b"}"])
def test_deeply_nested_bodies_are_400_not_recursion_errors(raw):
    e = _refusal(raw)
    assert e.status == 400 and e.code == "invalid_json", e.message


# ---------------------------------------------------------------- rank 0's second check


@pytest.mark.parametrize("sampling,prompt", [
    (Sampling(1.0, 2**63, None, 0), [1, 2]),  # the probe that took a server down: int64 overflow in the plan
    (Sampling(1.0, VOCAB + 5, None, 0), [1, 2]),  # torch.topk would fail on every rank
    (Sampling(1.0, None, None, 2**64), [1, 2]),
    (Sampling(float("nan"), None, None, 0), [1, 2]),
    (Sampling(1.0, None, 1.5, 0), [1, 2]),
    (Sampling(), [1, VOCAB]),
    (Sampling(), []),
])
def test_rank_0_refuses_a_request_that_would_break_the_step_alone(sampling, prompt):
    bad, good = Admission(1, prompt, 2, sampling), Admission(2, [3, 4], 2, Sampling())
    from test_serve_batch import _model, serving

    _, scheduler, http = serving(_model())  # the real serving core; its model's vocabulary is smaller than VOCAB
    for message in (("submit", bad), ("submit", good), ("submit", "not an admission")):
        http.send(message)
    scheduler.receive(0)
    plan = scheduler.plan(0)
    assert [a.request_id for a in plan.admit] == [2]
    assert (1, "rejected") in scheduler.dropped and len(scheduler.dropped) == 2
    encode(plan)  # the plan that is broadcast packs


def test_the_unchecked_plan_would_have_failed_to_pack():
    """Why the second check exists: the int64 payload cannot hold the probe's top_k."""
    with pytest.raises((ValueError, RuntimeError, OverflowError), match="Overflow"):
        encode(StepPlan(0, [Admission(1, [1], 2, Sampling(1.0, 2**63, None, 0))]))


# ---------------------------------------------------------------- the service without HTTP


class _Stream:
    def __init__(self, events):
        self.events = list(events)

    async def next(self):
        return self.events.pop(0)


class _FakeClient:
    """The engine as the service sees it: each request answers the bytes of "ok" then "length"; ``info``: its ready
    message (the cache's capacity)."""

    state, error, waiting, healthy = "ready", None, 0, True

    def __init__(self, info: dict | None = None):
        self.info, self.submitted = info or {}, []

    def submit(self, prompt, max_tokens, sampling, stop_token_ids, ignore_eos=False, **options):
        self.submitted.append((prompt, max_tokens, sampling))
        return _Stream([("token", ord("o")), ("token", ord("k")), ("finished", "length")])

    def cancel(self, stream):
        pass


def _state(client, template=None):
    return ServerState(client=client, tokenizer=ByteTokenizer(), template=template, model_name="m", max_model_len=64,
                       vocab_size=VOCAB, eos_token_id=256, api_key=None, max_queue=8, metrics=Metrics("m"))


def test_the_service_answers_without_http():
    client = _FakeClient()
    service = CompletionService(_state(client))

    async def run():
        body = parse(CompletionRequest, b'{"prompt": "hi", "max_tokens": 2, "top_k": 5, "seed": 3}')
        choices = await service.completion_choices(body)
        answer = await service.complete(choices, service.submit(choices), False, _never)
        chunks = [c async for c in service.stream(choices, service.submit(choices), False, True, _never)]
        return answer, chunks

    answer, chunks = asyncio.run(run())
    assert client.submitted[0][:2] == ([104, 105], 2) and client.submitted[0][2] == Sampling(1.0, 5, None, 3)
    assert answer["choices"][0]["text"] == "ok" and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                               "prompt_tokens_details": {"cached_tokens": 0}}
    events = [json.loads(c[6:]) for c in chunks if c != "data: [DONE]\n\n"]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "ok"
    assert events[-1]["usage"]["completion_tokens"] == 2 and chunks[-1] == "data: [DONE]\n\n"


async def _never():
    return False


def test_a_request_refused_by_rank_0_fails_alone():
    client = _FakeClient()
    client.submit = lambda *a, **k: _Stream([("finished", "rejected")])
    service = CompletionService(_state(client))

    async def run():
        choices = await service.completion_choices(parse(CompletionRequest, b'{"prompt": "hi", "max_tokens": 2}'))
        return await service.complete(choices, service.submit(choices), False, _never)

    with pytest.raises(APIError) as e:
        asyncio.run(run())
    assert e.value.status == 500 and "still up" in e.value.message


@pytest.mark.parametrize("ending,status,param", [
    ("bad_grammar", 400, "guided_regex"),  # the ranks refused its grammar: the field that asked for it is named
    ("grammar_timeout", 400, "guided_regex"),  # it did not compile on the ranks in time
])
def test_a_request_the_ranks_end_early_fails_alone_naming_its_field(ending, status, param):
    pytest.importorskip("xgrammar")
    client = _FakeClient()
    client.submit = lambda *a, **k: _Stream([("finished", ending)])
    service = CompletionService(_state(client))

    async def run():
        body = b'{"prompt": "hi", "max_tokens": 2, "guided_regex": "[a-z]+"}'
        choices = await service.completion_choices(parse(CompletionRequest, body))
        return await service.complete(choices, service.submit(choices), False, _never)

    with pytest.raises(APIError) as e:
        asyncio.run(run())
    assert e.value.status == status and e.value.param == param, e.value


class _CountingTokenizer(ByteTokenizer):
    def __init__(self):
        self.texts = []

    def encode_batch(self, texts):
        self.texts += texts
        return super().encode_batch(texts)


def test_a_text_too_long_for_any_context_is_refused_before_tokenizing():
    """64 tokens of context, and a tokenizer without a vocabulary to read (taken as at most 4 characters a
    token): past 2 * 64 * 4 + 1024 = 1536 characters a text can never fit, so 10,000 are not tokenized."""
    state = _state(_FakeClient())
    state.tokenizer = tokenizer = _CountingTokenizer()
    service = CompletionService(state)
    body = parse(CompletionRequest, json.dumps({"prompt": "a" * 10_000, "max_tokens": 2}).encode())
    with pytest.raises(APIError) as e:
        asyncio.run(service.completion_choices(body))
    assert e.value.param == "prompt" and "10000 characters" in e.value.message and tokenizer.texts == []
    body = parse(CompletionRequest, json.dumps({"prompt": "a" * 1000, "max_tokens": 2}).encode())
    with pytest.raises(APIError, match="context length is 64"):  # tokenized, then refused by its count
        asyncio.run(service.completion_choices(body))
    assert tokenizer.texts == ["a" * 1000]


# ---------------------------------------------------------------- chat templates

RUNAWAY = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_a_runaway_template_is_stopped_and_the_next_render_works():
    template = ChatTemplate("{% if messages[0]['content'] == 'loop' %}" + RUNAWAY + "{% else %}"
                            "{{ messages[0]['content'] }}{% endif %}", timeout_s=1.0, processes=1)
    try:
        template.render([{"role": "user", "content": "warm"}])  # the child's start is not the render's time
        child = template._idle.queue[0].proc
        t0 = time.monotonic()
        with pytest.raises(APIError) as e:
            template.render([{"role": "user", "content": "loop"}])
        assert e.value.status == 400 and e.value.param == "messages" and "longer than 1 s" in e.value.message
        assert time.monotonic() - t0 < 10
        assert child.poll() is not None  # killed: the loops really stopped
        assert template.render([{"role": "user", "content": "next"}]) == "next"
    finally:
        template.close()


@pytest.mark.parametrize("source,words", [
    ("{{ messages + 1 }}", "TypeError"),
    ("{{ 'x' * 10**10 }}", "characters"),  # would be folded into a constant when compiling, unbounded
    ("{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}", "characters"),
    ("{{ 'x'|center(10**11) }}", "memory"),
    ("{{ 2 ** 100000 }}", "exponent"),
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
])
def test_a_failing_template_is_a_400_naming_why(source, words):
    template = ChatTemplate(source, timeout_s=20.0, processes=1)
    try:
        with pytest.raises(APIError) as e:
            template.render([{"role": "user", "content": "a"}])
        assert e.value.status == 400 and words in e.value.message and "\n" not in e.value.message, e.value.message
    finally:
        template.close()


def test_a_template_that_does_not_parse_is_refused_at_once():
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% for %}")


def test_rendering_runs_off_the_event_loop():
    """While a slow render runs, the event loop keeps turning (what /health needs)."""
    template = ChatTemplate(RUNAWAY, timeout_s=1.5, processes=1)

    async def run():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        with pytest.raises(APIError):
            await template.render_async([{"role": "user", "content": "a"}])
        ticker.cancel()
        return ticks

    try:
        assert asyncio.run(run()) >= 10
    finally:
        template.close()


def _deep_arrays(depth: int) -> dict:
    """A JSON schema of ``depth`` nested arrays: xgrammar's compile time grows with the square of the depth."""
    schema = {"type": "array", "items": {}}
    inner = schema
    for _ in range(depth):
        inner["items"] = inner = {"type": "array", "items": {}}
    return schema


def test_grammar_checks_neither_starve_tokenization_nor_outlive_their_deadline():
    """A probe: 8 concurrent requests with deep guided_json schemas (each takes seconds to compile) made /tokenize
    "hello" wait 9-30 s, sharing the loop's default thread pool. Grammars compile on a bounded pool of their own
    with a deadline: tokenizing meanwhile takes well under a second, and each slow grammar fails alone, a 400
    naming guided_json, once its deadline has passed."""
    pytest.importorskip("xgrammar")
    service = CompletionService(_state(_FakeClient()))
    service.grammar_check.deadline_s = 0.3  # the schema below takes about 2 s here
    hostile = json.dumps({"prompt": "hi", "max_tokens": 2, "guided_json": json.dumps(_deep_arrays(150))}).encode()

    async def run():
        checks = [asyncio.ensure_future(service.completion_choices(parse(CompletionRequest, hostile)))
                  for _ in range(8)]
        await asyncio.sleep(0.1)  # the checks are compiling
        t0 = time.monotonic()
        ids = await service.encode("hello")
        took = time.monotonic() - t0
        return ids, took, await asyncio.gather(*checks, return_exceptions=True)

    try:
        ids, took, outcomes = asyncio.run(run())
    finally:
        service.grammar_check.close()
    assert ids == list(b"hello") and took < 1.0, took
    assert all(isinstance(e, APIError) and e.status == 400 and e.param == "guided_json" and "within" in e.message
               for e in outcomes), outcomes


# ---------------------------------------------------------------- the tokenizer folder's template


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    from helpers import tiny_hf_llama

    folder = tmp_path_factory.mktemp("hostile") / "model"
    tiny_hf_llama(folder)
    return folder


@pytest.mark.parametrize("value,words", [
    (["not a dict"], "item 0"),
    ([{"name": "default", "template": "x"}, 5], "item 1"),
    ([{"name": "default"}], "item 0"),
    (5, "must be a string"),
])
def test_a_malformed_chat_template_is_one_line_at_startup(hf_folder, value, words, capsys):
    from torchtsp.cli import main

    config_path = hf_folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": value}))
    assert main(["serve", "--hf", str(hf_folder), "--nproc", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchtsp: error:") and err.count("\n") == 1, err
    assert "tokenizer_config.json" in err and words in err, err


def test_chat_template_jinja_is_read_before_tokenizer_config(hf_folder):
    from torchtsp.data.tokenizers import HFTokenizer, read_chat_template

    config_path = hf_folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": [{"name": "default", "template": "old"}]}))
    assert read_chat_template(HFTokenizer(hf_folder)) == "old"
    (hf_folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    try:
        assert read_chat_template(HFTokenizer(hf_folder)) == "{{ messages[0]['content'] }}!"
    finally:
        (hf_folder / "chat_template.jinja").unlink()


# ---------------------------------------------------------------- the routes over a stand-in engine


def test_the_routes_run_over_a_stand_in_engine_and_refuse_an_oversized_body():
    from fastapi.testclient import TestClient

    from torchtsp.serve.app import MAX_BODY_BYTES, create_app

    with TestClient(create_app(_state(_FakeClient()))) as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok", r.text
        r = http.post("/v1/completions", content=b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}')
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text[:300]
        r = http.post("/v1/completions", json={"prompt": "hi", "top_k": 2**63})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
        assert http.get("/health").status_code == 200
