"""Log-probabilities in serving (issue #37): the chosen tokens' and, on echo, the prompt tokens', exact against
an independent computation.

Engine level: ``BatchRunner`` on the reference engine and on 2-rank TSP (both schedules), TP and SP engines,
against log_softmax of the single-device model's whole-sequence forward. HTTP level: the official ``openai``
client against one 2-rank TSP server (module scoped) on a random tiny Hugging Face Llama, against transformers'
float32 log_softmax of the same checkpoint.
"""

from __future__ import annotations

import copy

import pytest
import torch

import torchtsp
from torchtsp.config import ModelConfig
from torchtsp.serve.plan import Admission, Sampling, StepPlan

TOL = 1e-4

# ---------------------------------------------------------------- engine level

# Request 1: greedy, logprobs and echo, a prompt over two prefill chunks; 2: sampled, logprobs of the raw
# distribution, no echo (a row of the group that does not ask for the prompt); 3: echo with max_tokens 0.
ENGINE_PROMPTS = {1: [5, 17, 3, 99, 42, 8, 8, 61, 2, 77, 100, 13, 4], 2: [9, 1, 33, 70, 5], 3: list(range(20, 31))}
ENGINE_REQUESTS = [Admission(1, ENGINE_PROMPTS[1], 5, Sampling(), logprobs=3, prompt_logprobs=3),
                   Admission(2, ENGINE_PROMPTS[2], 4, Sampling(0.8, 5, None, 11), logprobs=0),
                   Admission(3, ENGINE_PROMPTS[3], 0, Sampling(), prompt_logprobs=2)]


def _model() -> torchtsp.Transformer:
    torch.manual_seed(0)
    # 101 tokens: the last vocabulary slice over 2 ranks has a padding column.
    cfg = ModelConfig(vocab_size=101, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    model = torchtsp.Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)
    return model


def _serve(model, schedule: str = "auto") -> dict:
    """The three requests submitted together to the serving core (test_serve_batch.serving); per request: tokens,
    their logprobs, the prompt logprobs, how it ended."""
    from test_serve_batch import drive, serving

    return drive(*serving(model, max_num_seqs=3, budget=64, prefill_chunk=8, schedule=schedule), ENGINE_REQUESTS,
                 steps=40)


def _on_ranks(scheme: str, schedule: str) -> dict:
    reference = _model()
    model = torchtsp.parallelize(copy.deepcopy(reference), torchtsp.init_mesh(**{scheme: 2}), scheme).eval()
    return _serve(model, schedule)


def _reference_logprobs(ids: list[int]) -> torch.Tensor:
    """log_softmax [S, V] of the single-device model's forward over the whole sequence (no cache, no shards)."""
    with torch.no_grad():
        return torch.log_softmax(_model()(torch.tensor([ids])).double()[0], dim=-1)


def _check_entry(entry, want: torch.Tensor, token: int, n: int) -> None:
    lp, top = entry
    assert abs(lp - want[token].item()) < TOL, (lp, want[token].item())
    order = want.argsort(descending=True, stable=True)[:n]
    assert [t for t, _ in top] == order.tolist(), (top, order)
    assert all(abs(v - want[t].item()) < TOL for t, v in top)


def _check_served(out: dict) -> None:
    for a in ENGINE_REQUESTS:
        got, prompt = out[a.request_id], a.prompt
        assert got["finish"] == "length" and len(got["tokens"]) == a.max_tokens, got
        want = _reference_logprobs(prompt + got["tokens"])
        if a.logprobs is None:
            assert got["logprobs"] == []
        else:  # new token j is predicted by position len(prompt) - 1 + j
            assert len(got["logprobs"]) == a.max_tokens
            for j, (token, entry) in enumerate(zip(got["tokens"], got["logprobs"])):
                _check_entry(entry, want[len(prompt) - 1 + j], token, a.logprobs)
        if a.prompt_logprobs is None:
            assert got["prompt"] is None
        else:  # prompt token t is predicted by position t - 1; the first has none
            assert len(got["prompt"]) == len(prompt) and got["prompt"][0] is None
            for t in range(1, len(prompt)):
                _check_entry(got["prompt"][t], want[t - 1], prompt[t], a.prompt_logprobs)


def test_reference_engine_logprobs_equal_log_softmax_of_the_whole_sequence():
    _check_served(_serve(_model()))


@pytest.mark.parametrize("scheme,schedule", [("tsp", "weights"), ("tsp", "activations"), ("tp", "auto"),
                                             ("sp", "auto")])
def test_parallel_engines_logprobs_equal_log_softmax_of_the_whole_sequence(pools, scheme, schedule):
    for out in pools(2).run(_on_ranks, scheme, schedule):
        _check_served(out)


def test_plan_carries_the_logprob_counts_and_max_tokens_0_needs_echo():
    from torchtsp.serve.plan import admission_problem, decode, encode

    plan = StepPlan(3, [*ENGINE_REQUESTS, Admission(4, [1, 2], 2, Sampling(0.5, None, 0.9, 7), [3], True,
                                                    logprobs=20)])
    assert decode(*encode(plan)) == plan
    assert admission_problem(ENGINE_REQUESTS[2], 101, 48) is None
    no_echo = Admission(5, [1, 2], 0, Sampling())
    assert "max_tokens (0)" in admission_problem(no_echo, 101, 48)
    assert "outside [0, 20]" in admission_problem(Admission(6, [1], 1, Sampling(), logprobs=21), 101, 48)


# ---------------------------------------------------------------- HTTP: the openai client against a 2-rank TSP server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

KEY = "logprobs-key"
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPT = "the cat sat on the mat and"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from helpers import tiny_hf_llama

    folder = tmp_path_factory.mktemp("logprobs") / "tiny-llama"
    eos = tiny_hf_llama(folder, chat_template=TEMPLATE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    return folder, eos, tokenizer, model


@pytest.fixture(scope="module")
def server(hf, tmp_path_factory):
    from test_serve import Server

    s = Server(hf[0], tmp_path_factory.mktemp("logs") / "server.log", "--api-key", KEY, "--timeout-s", "60")
    try:
        s.wait_ready()
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log_softmax [S, V] over the whole sequence."""
    with torch.no_grad():
        return torch.log_softmax(hf[3](torch.tensor([ids])).logits[0].float(), dim=-1)


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    eos = hf[1]
    with torch.no_grad():
        out = hf[3].generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos)
    return out[0, len(prompt):].tolist()


def _text(hf, token: int) -> str:
    return hf[2].decode([token], skip_special_tokens=True)


IDS = {"return_tokens_as_token_ids": True}  # vLLM's extension: tokens named by id (many byte tokens read "\ufffd")


def _check_completion_logprobs(hf, logprobs, ids: list[int], first: int, n: int) -> None:
    """``logprobs`` (completions' shape, tokens named by id) of ids[first:], each against transformers given the
    ids before it: the chosen token's and the top n plus the chosen one; text offsets that count the texts."""
    want = _hf_logprobs(hf, ids)
    assert logprobs.tokens == [f"token_id:{t}" for t in ids[first:]]
    for k, t in enumerate(ids[first:]):
        at = first + k
        if at == 0:
            assert logprobs.token_logprobs[k] is None and logprobs.top_logprobs[k] is None
            continue
        assert abs(logprobs.token_logprobs[k] - want[at - 1, t].item()) < TOL, (k, t)
        best = want[at - 1].argsort(descending=True, stable=True)[:n].tolist()
        top = logprobs.top_logprobs[k]
        assert set(top) == {f"token_id:{b}" for b in [*best, t]}, (top, best)
        for b in [*best, t]:
            assert abs(top[f"token_id:{b}"] - want[at - 1, b].item()) < TOL
    lengths = [len(_text(hf, t)) for t in ids[first:]]
    assert logprobs.text_offset == [sum(lengths[:k]) for k in range(len(lengths))]


def test_completion_logprobs_equal_transformers(client, hf):
    prompt = hf[2](PROMPT, add_special_tokens=False).input_ids
    new = _hf_greedy(hf, prompt, 8)
    got = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=5,
                                    extra_body=IDS).choices[0]
    assert got.text == hf[2].decode(new, skip_special_tokens=True)
    _check_completion_logprobs(hf, got.logprobs, prompt + new, len(prompt), 5)
    named = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0,
                                      logprobs=5).choices[0].logprobs
    assert named.tokens == [_text(hf, t) for t in new] and named.token_logprobs == got.logprobs.token_logprobs
    # Sampled at a high temperature: still the raw model's log_softmax (before temperature) of what was drawn.
    hot = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=6, temperature=1.5, seed=3,
                                    logprobs=0, extra_body=IDS).choices[0]
    drawn = [int(t.split(":")[1]) for t in hot.logprobs.tokens]
    assert hf[2].decode(drawn, skip_special_tokens=True) == hot.text
    _check_completion_logprobs(hf, hot.logprobs, prompt + drawn, len(prompt), 0)


def test_echo_gives_the_prompt_logprobs_as_lm_eval_asks(client, hf):
    """lm-eval's loglikelihood request: token ids, echo, logprobs=1, max_tokens=1; and max_tokens=0."""
    prompt = hf[2](PROMPT, add_special_tokens=False).input_ids
    new = _hf_greedy(hf, prompt, 1)
    got = client.completions.create(model="tiny-llama", prompt=[prompt], max_tokens=1, temperature=0, logprobs=1,
                                    echo=True, extra_body=IDS).choices[0]
    assert got.text == PROMPT + hf[2].decode(new, skip_special_tokens=True)
    _check_completion_logprobs(hf, got.logprobs, prompt + new, 0, 1)
    only = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=0, logprobs=2, echo=True)
    c = only.choices[0]
    assert c.text == PROMPT and only.usage.completion_tokens == 0 and c.finish_reason == "length"
    assert "".join(c.logprobs.tokens) == PROMPT  # an ASCII prompt: each token's text is a piece of it
    assert all(PROMPT[o:o + len(t)] == t for o, t in zip(c.logprobs.text_offset, c.logprobs.tokens))
    by_id = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=0, logprobs=2, echo=True,
                                      extra_body=IDS).choices[0]
    _check_completion_logprobs(hf, by_id.logprobs, prompt, 0, 2)
    plain = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=0, echo=True).choices[0]
    assert plain.text == PROMPT and plain.logprobs is None


def test_chat_logprobs_equal_transformers(client, hf, server):
    messages = [{"role": "user", "content": "the dog ran"}]
    prompt = httpx.post(server.url + "/tokenize", json={"messages": messages},
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()["tokens"]
    new = _hf_greedy(hf, prompt, 6)
    got = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body=IDS).choices[0]
    want = _hf_logprobs(hf, prompt + new)
    content = got.logprobs.content
    assert len(content) == len(new)
    for k, (t, entry) in enumerate(zip(new, content)):
        row = want[len(prompt) - 1 + k]
        assert entry.token == f"token_id:{t}" and entry.bytes == list(_text(hf, t).encode("utf-8"))
        assert abs(entry.logprob - row[t].item()) < TOL
        best = row.argsort(descending=True, stable=True)[:3].tolist()
        assert [e.token for e in entry.top_logprobs] == [f"token_id:{b}" for b in best]
        assert all(abs(e.logprob - row[b].item()) < TOL for e, b in zip(entry.top_logprobs, best))
    named = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True).choices[0].logprobs.content
    assert [e.token for e in named] == [_text(hf, t) for t in new] and all(e.top_logprobs == [] for e in named)
    bare = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2, temperature=0)
    assert bare.choices[0].logprobs is None


def test_streamed_logprobs_equal_the_whole_answer(client):
    kwargs = dict(model="tiny-llama", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    parts = [c.logprobs for c in chunks if c.logprobs is not None]
    # The same tokens; logprobs within float32 rounding (a decoded token's K/V lands on the rank of the server's
    # step count, so the partial attentions merge in another order).
    joined = {name: [x for p in parts for x in getattr(p, name)] for name in ("tokens", "token_logprobs",
                                                                               "top_logprobs", "text_offset")}
    assert joined["tokens"] == whole.tokens and joined["text_offset"] == whole.text_offset
    assert all(abs(a - b) < TOL for a, b in zip(joined["token_logprobs"], whole.token_logprobs, strict=True))
    for got, want in zip(joined["top_logprobs"], whole.top_logprobs, strict=True):
        assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < TOL for k in got)
    echo = [c.choices[0] for c in client.completions.create(**kwargs, echo=True, stream=True) if c.choices]
    assert "".join(c.text for c in echo).startswith(PROMPT) and echo[0].logprobs.token_logprobs[0] is None
    chat = dict(model="tiny-llama", messages=[{"role": "user", "content": "a"}], max_tokens=5, temperature=0,
                logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**chat).choices[0].logprobs.content
    streamed = [e for c in client.chat.completions.create(**chat, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole]
    assert all(abs(a.logprob - b.logprob) < TOL for a, b in zip(streamed, whole, strict=True))


BAD = [  # (path, fields, the field the 400 names, words in the message)
    ("/v1/completions", {"logprobs": 21}, "logprobs", "[0, 20]"),
    ("/v1/completions", {"logprobs": -1}, "logprobs", "[0, 20]"),
    ("/v1/completions", {"logprobs": 2**64}, "logprobs", "[0, 20]"),
    ("/v1/completions", {"logprobs": True}, "logprobs", "[0, 20]"),
    ("/v1/completions", {"logprobs": "3"}, "logprobs", ""),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs", "logprobs=N"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens", "echo"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs", "true or false"),
]


def test_bad_logprob_values_are_400_naming_the_field(server, client):
    for path, fields, param, words in BAD:
        body = {"model": "tiny-llama", "max_tokens": 2, **fields}
        body.update({"prompt": "the"} if "chat" not in path else {"messages": [{"role": "user", "content": "a"}]})
        r = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 400, (fields, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"] and len(error["message"]) < 300, (fields, error)
    assert client.completions.create(model="tiny-llama", prompt="the", max_tokens=1, logprobs=20).choices[0].logprobs


def test_logprob_shapes_keep_the_best_of_tokens_with_one_text_and_count_offsets_across_chunks():
    from torchtsp.serve.formats import LOGPROB_FLOOR, LogprobFormat

    texts = {1: "ab", 2: "\ufffd", 3: "\ufffd", 4: "c"}.__getitem__
    shape = LogprobFormat(texts, chat=False)
    first = shape.shape([(1, None, None), (2, -0.5, [(3, -0.25), (2, -0.5), (4, float("-inf"))])])
    assert first["tokens"] == ["ab", "\ufffd"] and first["token_logprobs"] == [None, -0.5]
    assert first["top_logprobs"] == [None, {"\ufffd": -0.25, "c": LOGPROB_FLOOR}]  # JSON has no -inf
    assert first["text_offset"] == [0, 2]
    second = shape.shape([(4, -1.0, [(1, -0.1)])])  # the next chunk of a stream: offsets go on
    assert second["text_offset"] == [3] and second["top_logprobs"] == [{"ab": -0.1, "c": -1.0}]
    chat = LogprobFormat(texts, chat=True, as_ids=True).shape([(4, -1.0, [(1, -0.1)])])
    assert chat == {"content": [{"token": "token_id:4", "logprob": -1.0, "bytes": [99],
                                 "top_logprobs": [{"token": "token_id:1", "logprob": -0.1, "bytes": [97, 98]}]}]}


class _Stream:
    def __init__(self, events):
        self.events = list(events)

    async def next(self):
        return self.events.pop(0)


class _EchoClient:
    """The engine as the service sees it: the prompt "hi" with logprobs, then "o", "k" with theirs."""

    state, error, waiting, healthy = "ready", None, 0, True

    def __init__(self):
        self.submitted = []

    def submit(self, prompt, max_tokens, sampling, stop_token_ids, ignore_eos=False, **options):
        self.submitted.append((prompt, max_tokens, options))
        return _Stream([("admitted",), ("prompt_logprobs", [None, (-1.0, [(104, -0.5)])]),
                        ("token", ord("o"), (-0.25, [(111, -0.25)])), ("token", ord("k"), (-2.0, [(120, -0.125)])),
                        ("finished", "length")])

    def cancel(self, stream):
        pass


def test_the_service_puts_echo_and_token_logprobs_in_order_whole_and_streamed():
    import asyncio
    import json

    from torchtsp.data.tokenizers import ByteTokenizer
    from torchtsp.serve.metrics import Metrics
    from torchtsp.serve.protocol import CompletionRequest, parse
    from torchtsp.serve.service import CompletionService, ServerState

    client = _EchoClient()
    service = CompletionService(ServerState(client=client, tokenizer=ByteTokenizer(), template=None, model_name="m",
                                            max_model_len=64, vocab_size=257, eos_token_id=256, api_key=None,
                                            max_queue=8, metrics=Metrics("m")))

    async def never():
        return False

    async def run():
        body = parse(CompletionRequest, b'{"prompt": "hi", "max_tokens": 2, "logprobs": 1, "echo": true}')
        choices = await service.completion_choices(body)
        whole = await service.complete(choices, service.submit(choices), False, never)
        chunks = [c async for c in service.stream(choices, service.submit(choices), False, False, never)]
        return whole, [json.loads(c[6:])["choices"][0] for c in chunks[:-1]]

    whole, streamed = asyncio.run(run())
    prompt, max_tokens, options = client.submitted[0]
    assert (prompt, max_tokens) == ([104, 105], 2)
    assert (options["logprobs"], options["prompt_logprobs"]) == (1, 1)
    c = whole["choices"][0]
    assert c["text"] == "hiok"
    assert c["logprobs"] == {"tokens": ["h", "i", "o", "k"], "token_logprobs": [None, -1.0, -0.25, -2.0],
                             "top_logprobs": [None, {"h": -0.5, "i": -1.0}, {"o": -0.25}, {"x": -0.125, "k": -2.0}],
                             "text_offset": [0, 1, 2, 3]}
    assert "".join(s["text"] for s in streamed) == "hiok" and streamed[0]["text"] == "hi"
    assert [t for s in streamed if s["logprobs"] for t in s["logprobs"]["tokens"]] == c["logprobs"]["tokens"]
    assert [o for s in streamed if s["logprobs"] for o in s["logprobs"]["text_offset"]] == [0, 1, 2, 3]
