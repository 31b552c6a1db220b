"""``torchtsp bench --mode serve``: a load benchmark in ``vllm bench serve``'s conventions, against our server.

For each scheme of ``--schemes``, one after another on the same ranks: start ``torchtsp serve`` on the model
(``--hf DIR`` or ``--preset``), wait for ``/health``, send one untimed warm-up request, then the requests of
each rate, and stop the server. The requests are
seeded random token-id prompts of ``--input-len`` (or the prompts of a ``--dataset`` jsonl), each asking for
``--output-len`` tokens with ``ignore_eos`` so that every scheme generates the same number; they arrive as a
Poisson process of ``--request-rate`` per second (``inf``: all at once), optionally capped at
``--max-concurrency`` in flight. Each request streams; from its chunks' arrival times:

- TTFT: first token - sent; E2EL: last token - sent; ITL: the gaps between chunks;
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request (vLLM's definition);

reported as mean, p50 and p99, with request and output-token throughput over the run's duration and goodput
(requests per second that meet every ``--goodput`` SLO). Every request's raw times are kept in the JSON, so each
figure can be recomputed from them.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..schemes import SCHEMES

SERVE_START_S = 300.0  # loading a model on every rank and starting its process group, on a loaded CPU host
REQUEST_TIMEOUT_S = 600.0  # one request's whole stream; a slower one is a failed request
PERCENTILES = (50, 99)


@dataclass
class RequestResult:
    sent: float  # seconds since the run's start
    ok: bool = False
    error: str = ""
    chunk_times: list[float] = field(default_factory=list)  # each streamed text chunk's arrival, since `sent`
    output_tokens: int = 0  # the server's usage count
    prompt_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.chunk_times[0]

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1]

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 0.5, "tpot": 0.05} (SLOs in milliseconds, as vLLM's flag)."""
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput {item!r}: name one of ttft, tpot, e2el, as NAME:MILLISECONDS")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not (math.isfinite(ms) and ms > 0):
            raise ValueError(f"--goodput {item!r}: the SLO must be a positive number of milliseconds")
        slos[name] = ms / 1000
    return slos


def make_prompts(args, vocab: int) -> list[tuple[list[int] | str, int]]:
    """(prompt, output length) per request: a jsonl's {"prompt": text or ids, "output_len"?} lines, or seeded
    random ids (never 0, which many tokenizers reserve)."""
    if args.dataset:
        path = Path(args.dataset)
        if not path.is_file():
            raise FileNotFoundError(f"--dataset {path} does not exist")
        prompts = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompts.append((row["prompt"], int(row.get("output_len", args.output_len))))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--dataset {path}:{number}: expected {{\"prompt\": ..., \"output_len\"?: N}} "
                                 f"({e})") from None
        return prompts[:args.num_prompts]
    rng = random.Random(args.seed)
    return [([rng.randrange(1, vocab) for _ in range(args.input_len)], args.output_len)
            for _ in range(args.num_prompts)]


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process of ``rate`` per second."""
    if math.isinf(rate):
        return [0.0] * count
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(count):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def _one_request(client, url: str, model: str, prompt, output_len: int, sent: float,
                       gate: asyncio.Semaphore) -> RequestResult:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with gate:
        result = RequestResult(sent=sent)
        start = time.perf_counter()
        try:
            async with client.stream("POST", url + "/v1/completions", json=body,
                                     timeout=REQUEST_TIMEOUT_S) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return result
                async for line in response.aiter_lines():
                    _read_event(line, result, time.perf_counter() - start)
            result.ok = bool(result.chunk_times) and result.output_tokens > 0 and not result.error
        except (httpx.HTTPError, OSError) as e:
            result.error = f"{type(e).__name__}: {e}"
        return result


def _read_event(line: str, result: RequestResult, now: float) -> None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    event = json.loads(line[6:])
    if "error" in event:
        result.error = str(event["error"].get("message", event["error"]))[:200]
    if any(choice.get("text") for choice in event.get("choices") or []):
        result.chunk_times.append(now)
    if event.get("usage"):
        result.output_tokens = event["usage"]["completion_tokens"]
        result.prompt_tokens = event["usage"]["prompt_tokens"]


async def _send_all(url: str, model: str, prompts, rate: float, concurrency: int | None, seed: int):
    import httpx

    times = arrival_times(len(prompts), rate, seed)
    gate = asyncio.Semaphore(concurrency or len(prompts))
    limits = httpx.Limits(max_connections=len(prompts) + 1)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.perf_counter()

        async def at(t, prompt, n):
            await asyncio.sleep(max(0.0, t - (time.perf_counter() - start)))
            return await _one_request(client, url, model, prompt, n, time.perf_counter() - start, gate)

        results = await asyncio.gather(*(at(t, p, n) for t, (p, n) in zip(times, prompts)))
        return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile by linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    k = (len(ordered) - 1) * q / 100
    low, high = math.floor(k), math.ceil(k)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    """The run's figures from its requests' raw times (seconds)."""
    done = [r for r in results if r.ok]
    series = {"ttft": [r.ttft for r in done], "tpot": [r.tpot for r in done if r.tpot is not None],
              "itl": [x for r in done for x in r.itls], "e2el": [r.e2el for r in done]}
    summary = {"completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
               "output_tokens": sum(r.output_tokens for r in done),
               "request_throughput": len(done) / duration,
               "output_throughput": sum(r.output_tokens for r in done) / duration}
    for name, values in series.items():  # None where no request gave the figure (strict JSON has no NaN)
        summary[f"mean_{name}_ms"] = 1000 * sum(values) / len(values) if values else None
        for q in PERCENTILES:
            summary[f"p{q}_{name}_ms"] = 1000 * percentile(values, q) if values else None
    if slos:
        good = [r for r in done if all((getattr(r, name) or 0.0) <= limit for name, limit in slos.items())]
        summary["goodput"] = len(good) / duration
    errors = sorted({r.error for r in results if r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model_flags: list[str], scheme: str, nproc: int, port: int, max_len: int, max_batch: int,
                  requests: int, timeout_s: float) -> list[str]:
    """The server's command line. Its queue holds every request of the run: at rate inf they all arrive at once,
    and vLLM's queue, which the benchmark's conventions assume, has no bound (a 429 would count as a failure)."""
    return [sys.executable, "-m", "torchtsp", "serve", *model_flags, "--scheme", scheme, "--nproc", str(nproc),
            "--port", str(port), "--max-model-len", str(max_len), "--max-batch", str(max_batch), "--max-queue",
            str(max(256, max_batch, requests)), "--served-model-name", "bench", "--timeout-s", str(timeout_s)]


class ServerProcess:
    """``torchtsp serve`` for one scheme, as a user starts it, on 127.0.0.1; stopped by SIGTERM on exit."""

    def __init__(self, model_flags: list[str], scheme: str, nproc: int, max_len: int, max_batch: int, log: Path,
                 timeout_s: float, requests: int = 1):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = serve_command(model_flags, scheme, nproc, self.port, max_len, max_batch, requests, timeout_s)
        self.proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def __enter__(self):
        import httpx

        deadline = time.monotonic() + SERVE_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                last = (self.log.read_text().strip().splitlines() or ["(no output)"])[-1]
                raise RuntimeError(f"the server exited with code {self.proc.returncode}: {last}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise TimeoutError(f"the server was not ready within {SERVE_START_S:.0f} s (log: {self.log})")

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _model(args) -> tuple[list[str], int]:
    """The serve flags naming the model, and its vocabulary size (for random prompts)."""
    if args.hf:
        config = Path(args.hf) / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"--hf {args.hf}: no config.json (a Hugging Face checkpoint folder)")
        return ["--hf", str(args.hf)], int(json.loads(config.read_text())["vocab_size"])
    from ..config import get_preset

    preset = args.preset or "tiny"
    return ["--preset", preset, "--seed", str(args.seed)], get_preset(preset).vocab_size


def run_serve_bench(args) -> int:
    """Entry point of ``bench --mode serve``: every scheme, every rate, one report (table, JSON, plot)."""
    slos = parse_goodput(args.goodput)
    for flag in ("input_len", "output_len", "num_prompts", "max_concurrency", "nproc"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    model_flags, vocab = _model(args)
    prompts = make_prompts(args, vocab)
    if not prompts:
        raise ValueError("no prompts: --num-prompts must be >= 1 and --dataset must hold at least one line")
    max_len = max((len(p) if isinstance(p, list) else 4 * len(p)) + n for p, n in prompts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, raw = [], {}
    for scheme in args.schemes:
        if scheme not in SCHEMES.servable():
            rows.extend({"scheme": scheme, "request_rate": _json_rate(rate),
                         "status": f"n/a: serve runs {', '.join(SCHEMES.servable())}"} for rate in args.request_rates)
            continue
        server = ServerProcess(model_flags, scheme, args.nproc or 2, max_len, args.max_concurrency or 16,
                               out / f"serve-{scheme}.log", args.timeout_s, len(prompts))
        try:
            server.__enter__()
        except (RuntimeError, TimeoutError) as e:  # a scheme the server refuses is a row, not the end of the run
            status = "n/a: " + " ".join(str(e).split())[:200]
            rows.extend({"scheme": scheme, "request_rate": _json_rate(rate), "status": status}
                        for rate in args.request_rates)
            continue
        try:
            asyncio.run(_send_all(server.url, "bench", prompts[:1], math.inf, 1, args.seed))  # warm-up, untimed
            for rate in args.request_rates:
                print(f"bench serve: {scheme} at {_rate(rate)} requests/s, {len(prompts)} requests", file=sys.stderr)
                results, duration = asyncio.run(_send_all(server.url, "bench", prompts, rate,
                                                          args.max_concurrency, args.seed))
                rows.append({"scheme": scheme, "request_rate": _json_rate(rate), **summarize(results, duration, slos)})
                raw[f"{scheme}@{_rate(rate)}"] = [asdict(r) for r in results]
        finally:
            server.__exit__()
    result = {"meta": {"model": model_flags, "nproc": args.nproc or 2, "num_prompts": len(prompts),
                       "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
                       "max_concurrency": args.max_concurrency, "goodput_slos_s": slos}, "rows": rows,
              "requests": raw}
    files = write_serve(result, out, plots=args.plots)
    print((out / "serve.md").read_text())
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def _json_rate(rate: float):
    return "inf" if math.isinf(rate) else rate  # strict JSON has no infinity


def _rate(rate) -> str:
    return "inf" if math.isinf(float(rate)) else f"{float(rate):g}"


def _slo_text(slos: dict) -> str:
    return f" Goodput SLOs: {', '.join(f'{k} <= {v * 1e3:g} ms' for k, v in slos.items())}." if slos else ""


def _ms(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def serve_markdown(result: dict) -> str:
    meta = result["meta"]
    slos = meta["goodput_slos_s"]
    lines = [f"# torchtsp bench: serving ({meta['nproc']} ranks, model {' '.join(meta['model'])})", "",
             f"{meta['num_prompts']} requests per cell, {meta['input_len']} prompt tokens, {meta['output_len']} "
             f"output tokens each (ignore_eos, greedy), streamed; schemes one after another on the same ranks. "
             "Times in ms: mean / p50 / p99." + _slo_text(slos),
             "",
             "| scheme | rate (req/s) | done | req/s | output tok/s | TTFT | TPOT | ITL | E2EL |"
             + (" goodput (req/s) |" if slos else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if slos else "")]
    for r in result["rows"]:
        if "status" in r:  # the server refused the scheme or failed
            blanks = " |" * (7 + bool(slos))
            lines.append(f"| {r['scheme']} | {_rate(r['request_rate'])} | {r['status']} |{blanks}")
            continue
        cells = [" / ".join(_ms(r[f"{k}_{n}_ms"]) for k in ("mean", "p50", "p99"))
                 for n in ("ttft", "tpot", "itl", "e2el")]
        done = f"{r['completed']}/{r['completed'] + r['failed']}"
        line = (f"| {r['scheme']} | {_rate(r['request_rate'])} | {done} | {r['request_throughput']:.2f} | "
                f"{r['output_throughput']:,.1f} | {' | '.join(cells)} |")
        lines.append(line + (f" {r['goodput']:.2f} |" if slos else ""))
    return "\n".join(lines) + "\n"


def plot_serve(result: dict, path: Path) -> Path:
    """p50 TTFT and TPOT against the request rate, a line per scheme ("inf" after the largest finite rate)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rates = sorted({float(r["request_rate"]) for r in result["rows"]})
    finite = [x for x in rates if not math.isinf(x)]
    position = {x: (max(finite, default=0.5) * 2 if math.isinf(x) else x) for x in rates}
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, name in zip(axes, ("ttft", "tpot")):
        for i, scheme in enumerate(dict.fromkeys(r["scheme"] for r in result["rows"])):
            rows = [r for r in result["rows"] if r["scheme"] == scheme and "status" not in r]
            if not rows:
                continue
            ax.plot([position[float(r["request_rate"])] for r in rows], [r[f"p50_{name}_ms"] for r in rows],
                    marker="osD^v"[i % 5], label=scheme)
        ax.set_xticks([position[x] for x in rates], [_rate(x) for x in rates])
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(f"p50 {name.upper()} (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def write_serve(result: dict, out: Path, plots: bool = True) -> list[Path]:
    """serve.json, serve.md and (``plots``) serve.png in ``out``."""
    files = [out / "serve.json", out / "serve.md"]
    files[0].write_text(json.dumps(result, indent=2) + "\n")
    files[1].write_text(serve_markdown(result))
    if plots:
        files.append(plot_serve(result, out / "serve.png"))
    return files
