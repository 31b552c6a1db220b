"""``torchtsp serve`` of a hybrid model end to end (issue #44 item 5): a tiny Gemma 3 (sliding-window and global
layers) saved as a Hugging Face folder that transformers loads, served by 2 TSP ranks over real HTTP on 127.0.0.1
with the official ``openai`` client. Prompts longer than the window, in a cache of small blocks: the sliding
layers' old blocks are freed while the requests run (one block group per attention type, serve/blocks.py), and
the greedy text equals transformers' greedy ids decoded.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from helpers import tiny_hf_llama
from test_serve import Server

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

WINDOW = 8
PROMPTS = [[(7 * i + 3 * j + 5) % 300 + 2 for j in range(20 + 4 * i)] for i in range(4)]  # 20-32 tokens > WINDOW
NEW = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tests/helpers.py's BPE tokenizer, and a random tiny Gemma 3 of its vocabulary in its place of the Llama."""
    from test_hybrid import make_hf

    folder = tmp_path_factory.mktemp("serve-hybrid") / "tiny-gemma3"
    eos = tiny_hf_llama(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (folder / name).unlink(missing_ok=True)
    hf = make_hf("gemma3", WINDOW, vocab_size=len(tokenizer), max_position_embeddings=128,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=eos)
    hf.save_pretrained(folder)
    return folder, hf, eos


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    folder, _, _ = checkpoint
    # Blocks of 4 tokens (block_size 4, heads layout: 1 rank per token): the window of 8 spans 3 of them, so a
    # request of 35-47 positions holds 9-12 full blocks and at most 3 sliding ones (4 while a chunk of 8 goes).
    s = Server(folder, tmp_path_factory.mktemp("logs") / "hybrid.log", "--block-size", "4",
               "--max-num-batched-tokens", "8", "--max-num-seqs", "4", "--timeout-s", "60")
    try:
        s.wait_ready()
        yield s
    finally:
        s.close()


def hf_greedy_text(checkpoint, prompt: list[int]) -> str:
    folder, hf, eos = checkpoint
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)


def test_hybrid_greedy_completions_over_http_equal_transformers(server, checkpoint):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    got = client.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=NEW, temperature=0)
    assert got.choices[0].text == hf_greedy_text(checkpoint, PROMPTS[0])

    async def together():  # four at once: their sliding blocks come and go side by side
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(c.completions.create(model="tiny-llama", prompt=p, max_tokens=NEW,
                                                               temperature=0) for p in PROMPTS))

    for prompt, r in zip(PROMPTS, asyncio.run(together())):
        assert r.choices[0].text == hf_greedy_text(checkpoint, prompt)
    assert "sliding window 8:" in server.log.read_text()  # its own block group (the start-up line)
