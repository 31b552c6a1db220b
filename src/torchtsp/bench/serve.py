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

The server's paged cache is read from its ``/metrics`` before and after each run, and polled during it: the
cache's capacity in tokens, the most requests running at once, the preemptions and the prefix cache's hit rate
(tokens) of the run. The server's ``--max-model-len`` is the run's longest request unless given. Each rate
sends its own seeded prompts (the warm-up yet others): the prefix cache, on by default, would otherwise serve a
rate's prompts from the blocks the rate before left. ``--dataset`` prompts are the same at every rate, so give
one rate per run, or ``--no-enable-prefix-caching``, to keep rates apart.
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
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..schemes import SCHEMES

SERVE_START_S = 300.0  # loading a model on every rank and starting its process group, on a loaded CPU host
REQUEST_TIMEOUT_S = 600.0  # one request's whole stream; a slower one is a failed request
PERCENTILES = (50, 99)
METRICS_POLL_S = 0.05  # /metrics during a run: a running batch lasts many engine steps, each well over this
PREFIX = "torchtsp:"


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


def make_prompts(args, vocab: int, seed: int | str | None = None) -> list[tuple[list[int] | str, int]]:
    """(prompt, output length) per request: a jsonl's {"prompt": text or ids, "output_len"?} lines, or random ids
    (never 0, which many tokenizers reserve) seeded by ``seed`` (default ``args.seed``): ``--random-prefix-len``
    ids shared by every prompt, then ``--input-len`` of its own."""
    if args.dataset:
        if args.random_prefix_len:
            raise ValueError("--random-prefix-len applies to random prompts: drop it, or --dataset")
        path = Path(args.dataset)
        if not path.is_file():
            raise FileNotFoundError(f"--dataset {path} does not exist")
        prompts = []
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            if line.strip():
                prompts.append(_dataset_row(line, f"--dataset {path}:{number}", args.output_len, vocab))
        return prompts[:args.num_prompts]
    rng = random.Random(args.seed if seed is None else seed)
    prefix = [rng.randrange(1, vocab) for _ in range(args.random_prefix_len)]
    return [(prefix + [rng.randrange(1, vocab) for _ in range(args.input_len)], args.output_len)
            for _ in range(args.num_prompts)]


def _dataset_row(line: bytes, where: str, output_len: int, vocab: int) -> tuple[list[int] | str, int]:
    """One jsonl line as (prompt, output length), every value checked here (ValueError naming the file, the line
    and the field) so that a bad line stops the run before any server starts, not midway through it."""
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 ({e.reason} at byte {e.start}); save the file as UTF-8") from None
    except ValueError as e:
        raise ValueError(f"{where}: not JSON ({e}); each line is {{\"prompt\": ..., \"output_len\"?: N}}") from None
    if not isinstance(row, dict) or "prompt" not in row:
        raise ValueError(f"{where}: expected an object {{\"prompt\": ..., \"output_len\"?: N}}, got "
                         f"{json.dumps(row)[:60]}")
    prompt, n = row["prompt"], row.get("output_len", output_len)
    ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                           for t in prompt)
    if not prompt or not (isinstance(prompt, str) or ids):
        raise ValueError(f"{where}: \"prompt\" must be a non-empty string or list of token ids in [0, {vocab}), "
                         f"got {json.dumps(prompt)[:60]}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{where}: \"output_len\" must be an integer >= 1, got {json.dumps(n)[:60]}")
    return prompt, n


def warmup_prompt(args, vocab: int, prompts) -> list:
    """The untimed first request: as long as the run's first, sharing no prefix with any run's prompts (random
    ids of their own seed), so that no run starts with its prefix already cached."""
    if args.dataset:
        return prompts[:1]
    ids = random.Random(f"{args.seed}/warm-up")
    return [([ids.randrange(1, vocab) for _ in prompts[0][0]], prompts[0][1])]


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
                  requests: int, timeout_s: float, cache_flags: list[str] = ()) -> list[str]:
    """The server's command line. Its queue holds every request of the run: at rate inf they all arrive at once,
    and vLLM's queue, which the benchmark's conventions assume, has no bound (a 429 would count as a failure)."""
    return [sys.executable, "-m", "torchtsp", "serve", *model_flags, "--scheme", scheme, "--nproc", str(nproc),
            "--port", str(port), "--max-model-len", str(max_len), "--max-num-seqs", str(max_batch), "--max-queue",
            str(max(256, max_batch, requests)), "--served-model-name", "bench", "--timeout-s", str(timeout_s),
            *cache_flags]


def cache_flags(args) -> list[str]:
    """The bench's paged-cache flags, as the server reads them; those not given keep the server's defaults."""
    flags = []
    for name in ("kv_cache_mb", "block_size", "max_num_batched_tokens"):
        value = getattr(args, name, None)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), f"{value:g}" if isinstance(value, float) else str(value)]
    return flags + ["--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching"]


def read_metrics(text: str) -> dict[str, float]:
    """The ``torchtsp:`` samples of a /metrics text by name, those labelled by ``model_name`` alone (one model per
    server; a histogram's buckets and request_success's reasons are left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name.startswith(PREFIX) and set(sample.labels) == {"model_name"}}


PEAKS = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


def cache_figures(before: dict, after: dict, peaks: dict) -> dict:
    """One run's paged-cache figures from /metrics read before and after it and the gauges' peaks during it."""
    def grown(name):
        return after.get(PREFIX + name, 0.0) - before.get(PREFIX + name, 0.0)

    queries, hits = grown("prefix_cache_queries_total"), grown("prefix_cache_hits_total")
    capacity = after.get(PREFIX + "kv_cache_capacity_tokens")
    return {"kv_capacity_tokens": None if capacity is None else int(capacity),
            **{f"peak_{name}": peaks.get(name) for name in PEAKS},
            "preemptions": int(grown("num_preemptions_total")), "prefix_cache_queries": int(queries),
            "prefix_cache_hits": int(hits), "prefix_cache_hit_rate": hits / queries if queries else None}


class MetricsWatch:
    """The server's /metrics before and after a run, and every ``METRICS_POLL_S`` during it from a thread, for the
    peaks of its gauges (a request's whole life can fall between the before and the after)."""

    def __init__(self, url: str):
        self.url = url + "/metrics"
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="bench-metrics", daemon=True)

    def _read(self, client) -> dict[str, float]:
        values = read_metrics(client.get(self.url, timeout=10).text)
        for name in PEAKS:
            if PREFIX + name in values:
                self.peaks[name] = max(self.peaks.get(name, -math.inf), values[PREFIX + name])
        return values

    def _poll(self) -> None:
        import httpx

        with httpx.Client() as client:
            while not self._stop.wait(METRICS_POLL_S):
                try:
                    self._read(client)
                except httpx.HTTPError:  # a busy server answers the next poll; before and after are not skipped
                    pass

    def __enter__(self):
        import httpx

        with httpx.Client() as client:
            self.before = self._read(client)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        import httpx

        self._stop.set()
        self._thread.join()
        with httpx.Client() as client:
            self.after = self._read(client)

    def figures(self) -> dict:
        return cache_figures(self.before, self.after, self.peaks)


class ServerProcess:
    """``torchtsp serve`` for one scheme, as a user starts it, on 127.0.0.1; stopped by SIGTERM on exit."""

    def __init__(self, model_flags: list[str], scheme: str, nproc: int, max_len: int, max_batch: int, log: Path,
                 timeout_s: float, requests: int = 1, cache: list[str] = ()):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = serve_command(model_flags, scheme, nproc, self.port, max_len, max_batch, requests, timeout_s,
                                cache)
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
    from ..presets import get_preset

    preset = args.preset or "tiny"
    return ["--preset", preset, "--seed", str(args.seed)], get_preset(preset).vocab_size


def run_serve_bench(args) -> int:
    """Entry point of ``bench --mode serve``: every scheme, every rate, one report (table, JSON, plot)."""
    slos = parse_goodput(args.goodput)
    for flag in ("input_len", "output_len", "num_prompts", "max_concurrency", "nproc", "block_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    model_flags, vocab = _model(args)
    # One prompt set per rate (see the module's docstring); every set has the same lengths.
    prompt_sets = [make_prompts(args, vocab, args.seed + i) for i in range(len(args.request_rates))]
    prompts = prompt_sets[0]
    if not prompts:
        raise ValueError("no prompts: --num-prompts must be >= 1 and --dataset must hold at least one line")
    max_len = max((len(p) if isinstance(p, list) else 4 * len(p)) + n for p, n in prompts)
    if args.max_model_len is not None:  # a server sized for longer requests than this run's (its cache is not)
        if args.max_model_len < max_len:
            raise ValueError(f"--max-model-len {args.max_model_len} is shorter than the run's longest request "
                             f"({max_len} tokens, prompt + output): raise it, or drop it")
        max_len = args.max_model_len
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, raw = [], {}
    for scheme in args.schemes:
        if scheme not in SCHEMES.servable():
            rows.extend({"scheme": scheme, "request_rate": _json_rate(rate),
                         "status": f"n/a: serve runs {', '.join(SCHEMES.servable())}"} for rate in args.request_rates)
            continue
        server = ServerProcess(model_flags, scheme, args.nproc or 2, max_len, args.max_concurrency or 16,
                               out / f"serve-{scheme}.log", args.timeout_s, len(prompts), cache_flags(args))
        try:
            server.__enter__()
        except (RuntimeError, TimeoutError) as e:  # a scheme the server refuses is a row, not the end of the run
            status = "n/a: " + " ".join(str(e).split())[:200]
            rows.extend({"scheme": scheme, "request_rate": _json_rate(rate), "status": status}
                        for rate in args.request_rates)
            continue
        try:
            rows += _run_rates(server, scheme, args, prompt_sets, warmup_prompt(args, vocab, prompts), slos, raw)
        finally:
            server.__exit__()
    meta = {"model": model_flags, "nproc": args.nproc or 2, "num_prompts": len(prompts),
            "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
            "max_concurrency": args.max_concurrency, "goodput_slos_s": slos,
            "random_prefix_len": 0 if args.dataset else args.random_prefix_len,
            "server_flags": ["--max-model-len", str(max_len), "--max-num-seqs", str(args.max_concurrency or 16),
                             *cache_flags(args)]}
    files = write_serve({"meta": meta, "rows": rows, "requests": raw}, out, plots=args.plots)
    print((out / "serve.md").read_text())
    print("wrote " + ", ".join(str(f) for f in files))
    return 0


def _run_rates(server, scheme: str, args, prompt_sets, warmup, slos: dict, raw: dict) -> list[dict]:
    """Every rate's run against one started server: a row each, with the cache's figures from its /metrics."""
    asyncio.run(_send_all(server.url, "bench", warmup, math.inf, 1, args.seed))  # untimed
    rows = []
    for rate, prompts in zip(args.request_rates, prompt_sets):
        print(f"bench serve: {scheme} at {_rate(rate)} requests/s, {len(prompts)} requests", file=sys.stderr)
        with MetricsWatch(server.url) as watch:
            results, duration = asyncio.run(_send_all(server.url, "bench", prompts, rate,
                                                      args.max_concurrency, args.seed))
        rows.append({"scheme": scheme, "request_rate": _json_rate(rate), **summarize(results, duration, slos),
                     **watch.figures()})
        raw[f"{scheme}@{_rate(rate)}"] = [asdict(r) for r in results]
    return rows


def _json_rate(rate: float):
    return "inf" if math.isinf(rate) else rate  # strict JSON has no infinity


def _rate(rate) -> str:
    return "inf" if math.isinf(float(rate)) else f"{float(rate):g}"


def _slo_text(slos: dict) -> str:
    return f" Goodput SLOs: {', '.join(f'{k} <= {v * 1e3:g} ms' for k, v in slos.items())}." if slos else ""


def _ms(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _cache_cells(r: dict) -> str:
    """KV cache capacity, peak running, preemptions and prefix hit rate (hits / queries, tokens) of a row."""
    def count(key):
        return "-" if r.get(key) is None else f"{r[key]:g}"

    rate = r.get("prefix_cache_hit_rate")
    hits = "-" if rate is None else f"{100 * rate:.0f}% ({r['prefix_cache_hits']}/{r['prefix_cache_queries']})"
    return " | ".join((count("kv_capacity_tokens"), count("peak_num_requests_running"), count("preemptions"), hits))


def serve_markdown(result: dict) -> str:
    meta = result["meta"]
    slos = meta["goodput_slos_s"]
    prefix = meta.get("random_prefix_len") or 0
    shared = f" ({prefix} of them shared by every prompt)" if prefix else ""
    server = f" Server flags: `{' '.join(meta['server_flags'])}`." if meta.get("server_flags") else ""
    lines = [f"# torchtsp bench: serving ({meta['nproc']} ranks, model {' '.join(meta['model'])})", "",
             f"{meta['num_prompts']} requests per cell, {prefix + meta['input_len']} prompt tokens{shared}, "
             f"{meta['output_len']} output tokens each (ignore_eos, greedy), streamed; schemes one after another on "
             "the same ranks. Times in ms: mean / p50 / p99. KV cache: the server's capacity in tokens; peak "
             "running: the most requests running at once (/metrics, polled); preemptions and prefix-cache hits "
             "(tokens) during the run." + server + _slo_text(slos),
             "",
             "| scheme | rate (req/s) | done | KV cache (tokens) | peak running | preemptions | prefix hits | req/s | "
             "output tok/s | TTFT | TPOT | ITL | E2EL |" + (" goodput (req/s) |" if slos else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if slos else "")]
    for r in result["rows"]:
        if "status" in r:  # the server refused the scheme or failed
            blanks = " |" * (11 + bool(slos))
            lines.append(f"| {r['scheme']} | {_rate(r['request_rate'])} | {r['status']} |{blanks}")
            continue
        cells = [" / ".join(_ms(r[f"{k}_{n}_ms"]) for k in ("mean", "p50", "p99"))
                 for n in ("ttft", "tpot", "itl", "e2el")]
        done = f"{r['completed']}/{r['completed'] + r['failed']}"
        line = (f"| {r['scheme']} | {_rate(r['request_rate'])} | {done} | {_cache_cells(r)} | "
                f"{r['request_throughput']:.2f} | {r['output_throughput']:,.1f} | {' | '.join(cells)} |")
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
