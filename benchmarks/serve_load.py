"""Load test of ``torchtsp serve``: the async ``openai`` client at several concurrencies over a fixed prompt set.

For each scheme a server is started on local ranks (``--preset`` random weights, byte tokenizer), warmed up,
then for each concurrency C the same REQUESTS streamed completions (greedy, exactly MAX_TOKENS new tokens:
``ignore_eos``) run with at most C in flight. Reported per (scheme, C): median time to first token (request
sent -> first streamed text), median time per output token after the first, and output tokens per second
of the whole run (wall clock). The speedup column is output tok/s at C over output tok/s at C = 1.

    PYTHONPATH=src python benchmarks/serve_load.py --schemes tsp tp sp --nproc 4 \
        --out benchmarks/results/cpu-4ranks/serve_load.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def prompt_set(n: int) -> list[str]:
    """n prompts of 8 to 8 + 7·(n-1) words: a fixed, varied set."""
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(8 + 7 * (i % 8))) for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(scheme: str, nproc: int, preset: str, max_batch: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "torchtsp", "serve", "--preset", preset, "--scheme", scheme, "--nproc", str(nproc),
           "--port", str(port), "--max-batch", str(max_batch), "--max-model-len", "512"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{scheme}: the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{scheme}: the server did not become ready within 300 s")


async def one(client, model: str, prompt: str, max_tokens: int) -> tuple[float, float | None, int]:
    """(time to first token, time per output token after it, completion tokens) of one streamed request."""
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            first = first or now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    ttft = (first or time.perf_counter()) - t0
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return ttft, tpot, tokens


async def level(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600) as client:
        async def gated(p):
            async with gate:
                return await one(client, model, p, max_tokens)
        await one(client, model, prompts[0], 4)  # warm
        t0 = time.perf_counter()
        results = await asyncio.gather(*(gated(p) for p in prompts))
        wall = time.perf_counter() - t0
    tpots = [r[1] for r in results if r[1] is not None]
    return {"ttft_s": statistics.median(r[0] for r in results), "tpot_s": statistics.median(tpots) if tpots else 0.0,
            "tok_s": sum(r[2] for r in results) / wall, "wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="+", default=["tsp", "tp", "sp"])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", help="also write the table (markdown) here")
    parser.add_argument("--logs", default="/tmp", help="folder for the servers' logs")
    args = parser.parse_args()
    prompts = prompt_set(args.requests)
    rows = []
    for scheme in args.schemes:
        log = Path(args.logs) / f"serve_{scheme}.log"
        proc, url = start(scheme, args.nproc, args.preset, max(args.concurrency), log)
        try:
            base = None
            for c in args.concurrency:
                r = asyncio.run(level(url, args.preset, prompts, c, args.max_tokens))
                base = base or r["tok_s"]
                rows.append((scheme, c, r, r["tok_s"] / base))
                print(f"{scheme} D={args.nproc} C={c}: TTFT {r['ttft_s'] * 1e3:.0f} ms, "
                      f"TPOT {r['tpot_s'] * 1e3:.1f} ms, {r['tok_s']:.1f} output tok/s ({r['wall_s']:.1f} s)",
                      flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    lines = [f"`torchtsp serve --preset {args.preset} --nproc {args.nproc}`, {args.requests} streamed greedy requests "
             f"of {args.max_tokens} new tokens per level, prompts of 8..57 words (byte tokens).", "",
             "| scheme | concurrency | TTFT median (ms) | TPOT median (ms) | output tok/s | speedup vs C=1 |",
             "|---|---|---|---|---|---|"]
    for scheme, c, r, speedup in rows:
        lines.append(f"| {scheme} | {c} | {r['ttft_s'] * 1e3:.0f} | {r['tpot_s'] * 1e3:.1f} | {r['tok_s']:.1f} | "
                     f"{speedup:.2f}x |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
