"""``usage.prompt_tokens_details.cached_tokens`` over real HTTP with the official ``openai`` client, on one-rank
servers of a random tiny Hugging Face Llama with prefix caching on and off (both started once for the module):
the prompt's tokens the prefix cache held when rank 0 first scheduled the request (0 the first time a prompt is
seen; whole blocks of it the second time), in completions and chat, whole and streamed
(``stream_options.include_usage``)."""

from __future__ import annotations

import secrets

import pytest

pytestmark = pytest.mark.multirank

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

BLOCK_SIZE = 16  # the server's --block-size: a cached prefix is whole blocks of it
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One server with prefix caching and one without, started together (they load in parallel). One rank each:
    what is counted is rank 0's scheduler's (the prefix cache's hit when it first scheduled the request)."""
    from helpers import tiny_hf_llama
    from test_serve import KEY, Server

    folder = tmp_path_factory.mktemp("usage") / "tiny-llama"
    tiny_hf_llama(folder, chat_template=TEMPLATE, max_position_embeddings=512)
    logs = tmp_path_factory.mktemp("logs")
    started = {caching: Server(folder, logs / f"usage-{caching}.log", "--api-key", KEY, "--max-model-len", "512",
                               "--block-size", str(BLOCK_SIZE),
                               "--enable-prefix-caching" if caching else "--no-enable-prefix-caching", ranks=1)
               for caching in (True, False)}
    try:
        for server in started.values():
            server.wait_ready()
        yield {caching: openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
               for caching, server in started.items()}
    finally:
        for server in started.values():
            server.close()


@pytest.fixture(params=[True, False], ids=["prefix-caching", "no-prefix-caching"])
def served(request, servers):
    return request.param, servers[request.param]


def _long_text() -> str:
    """A text no earlier request began with (so nothing of it is cached), of well over a few blocks of tokens."""
    return secrets.token_hex(8) + " " + " ".join(["the cat sat on the mat"] * 20)


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def _check_second(caching: bool, usage) -> None:
    if caching:
        assert 0 < _cached(usage) < usage.prompt_tokens and _cached(usage) % BLOCK_SIZE == 0, usage
    else:
        assert _cached(usage) == 0, usage


def test_completions_report_the_prompt_tokens_the_prefix_cache_held(served):
    caching, client = served
    prompt = _long_text()
    first = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 4 * BLOCK_SIZE and _cached(first.usage) == 0, first.usage
    second = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2, temperature=0)
    _check_second(caching, second.usage)
    chunks = list(client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    _check_second(caching, chunks[-1].usage)


def test_chat_reports_the_prompt_tokens_the_prefix_cache_held_streamed_and_not(served):
    caching, client = served
    messages = [{"role": "user", "content": _long_text()}]
    first = list(client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2, stream=True,
                                                stream_options={"include_usage": True}))
    assert _cached(first[-1].usage) == 0, first[-1].usage
    second = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2)
    _check_second(caching, second.usage)
