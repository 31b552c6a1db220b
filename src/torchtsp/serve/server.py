"""``torchtsp serve``: checks before any rank starts, the ranks, the HTTP server, and a clean stop.

The launcher (this process) resolves the model source, tokenizer, chat template and mesh like ``generate``
and refuses bad flags in one line. It then starts the ranks (``WorkerPool``, which owns them: they exit if
this process dies) running ``worker.run_serve_rank`` in a background thread, and serves HTTP in the main
thread. SIGINT or SIGTERM: uvicorn stops accepting, waiting requests fail at once (503, or an SSE error event),
running ones may finish for ``--shutdown-grace-s``, then the engine is told to stop (those still running end
with an error event), the answers are written, the ranks leave their loop and the pool is closed.
A rank that dies or hangs fails the pool's job: /health turns 503 and in-flight requests fail at once.
Under torchrun every rank runs this command; rank 0 serves HTTP with its engine loop in a thread.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from ..schemes import AXES, SCHEMES

STOP_WAIT_S = 10.0  # after the grace: how long the ranks have to leave their loop, and the answers to be written


def require_extra() -> None:
    missing = []
    for module in ("fastapi", "uvicorn", "pydantic", "jinja2", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise OSError(f"torchtsp serve needs the serve extra ({', '.join(missing)} missing): "
                      f"pip install 'torchtsp[serve]'")


def _check_flags(args, cfg) -> int:
    """The launch flags, refused in one line before any rank starts; returns max_model_len."""
    from .tools import PARSERS, check_parser

    check_parser(args.tool_call_parser, args.reasoning_parser)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser NAME ({', '.join(PARSERS)})")
    servable = SCHEMES.servable()  # a scheme whose replicas split the batch's rows is not continuous batching yet
    if args.scheme not in servable:
        raise ValueError(f"serve runs the {', '.join(servable)} schemes, not {args.scheme!r} (data-parallel "
                         f"replicas decode separate rows; run several servers behind a load balancer instead)")
    # --max-queue 0: every request waits in the queue for a step; --prefill-chunk: None is "no cap"
    for flag in ("max_num_seqs", "max_queue", "max_num_batched_tokens", "block_size", "prefill_chunk"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.kv_cache_mb is not None and not (math.isfinite(args.kv_cache_mb) and args.kv_cache_mb > 0):
        raise ValueError(f"--kv-cache-mb must be a finite number of MiB > 0, got {args.kv_cache_mb}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        raise ValueError(f"--timeout-s must be a finite number > 0, got {args.timeout_s}")
    if not (math.isfinite(args.shutdown_grace_s) and args.shutdown_grace_s >= 0):
        raise ValueError(f"--shutdown-grace-s must be a finite number >= 0, got {args.shutdown_grace_s}")
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    limit, longest = args.max_model_len or cfg.max_seq_len, cfg.max_length  # None: the RoPE has no bound
    if limit < 2 or longest is not None and limit > longest:
        top = f"[2, {longest}] (the model's {'max_seq_len' if longest == cfg.max_seq_len else 'RoPE context'})" \
            if longest is not None else ">= 2"
        raise ValueError(f"--max-model-len must be in {top}, got {limit}")
    return limit


def _chat_template(args, tokenizer):
    from ..data.tokenizers import read_chat_template
    from .template import ChatTemplate

    if args.chat_template is not None:
        path = Path(args.chat_template)
        if not path.is_file():
            raise FileNotFoundError(f"--chat-template {path}: no such file")
        source = path.read_text()
    else:
        try:
            source = read_chat_template(tokenizer)
        except ValueError as e:
            raise ValueError(f"{e} or give --chat-template FILE") from None
    if not source:
        return None
    tok = getattr(tokenizer, "tokenizer", None)
    name = lambda i: tok.id_to_token(i) if tok is not None and i is not None else None
    return ChatTemplate(source, name(getattr(tokenizer, "bos_id", None)), name(getattr(tokenizer, "eos_id", None)))


def _model_name(args, source: str, location: str) -> str:
    if args.served_model_name:
        return args.served_model_name
    return location if source == "preset" else Path(location).resolve().name


@dataclass
class _Launch:
    """What the checks before any rank resolved."""

    load: object  # the GenerateJob every rank loads
    settings: dict
    cfg: object
    tokenizer: object
    template: object
    layout: object
    name: str
    api_key: str | None
    max_model_len: int
    torchrun: bool
    kv_layout: str = "sequence"  # the KV-cache layout the engine decodes with (kv_layouts.py)
    reasoning: object = None  # the checked --reasoning-parser (reasoning.ReasoningParser)


def cmd_serve(args) -> int:
    require_extra()
    launch = _prepare(args)
    if launch.torchrun and int(os.environ.get("RANK", 0)) != 0:
        return _serve_rank_only(launch.load, launch.settings)
    try:
        return _serve(args, launch)
    finally:
        if launch.template is not None:
            launch.template.close()


def _prepare(args) -> _Launch:
    """Flags, model source, tokenizer, chat template and mesh, refused in one line before any rank starts."""
    from ..generate_job import GenerateJob, check_kv_layout, model_config_and_tokenizer
    from ..layout import Layout
    from ..runenv import launched_by_torchrun
    from .reasoning import reasoning_parser

    source, location = next(((s, v) for s in ("hf", "checkpoint", "preset") if (v := getattr(args, s))),
                            ("preset", "tiny"))
    cfg, tokenizer, eos = model_config_and_tokenizer(source, location, args.tokenizer)
    max_model_len = _check_flags(args, cfg)
    template = _chat_template(args, tokenizer)
    reasoning = reasoning_parser(args.reasoning_parser, getattr(template, "source", None), tokenizer)
    api_key = args.api_key or os.environ.get("TORCHTSP_API_KEY") or None
    flags = {axis: getattr(args, axis) for axis in AXES if axis != "dp"}  # serve has no --dp
    torchrun = launched_by_torchrun()
    world = int(os.environ.get("WORLD_SIZE", 1)) if torchrun else args.nproc
    layout = Layout.resolve(args.scheme, world, **flags, cfg=cfg)
    kv_layout = check_kv_layout(args.kv_layout, cfg, args.scheme, layout.sizes)
    load = GenerateJob(source=source, location=location, prompts=[], max_new_tokens=1, scheme=args.scheme,
                       degrees=layout.sizes, seed=args.seed, dtype=args.dtype, timeout_s=args.timeout_s,
                       tokenizer=args.tokenizer)
    settings = dict(max_num_seqs=args.max_num_seqs, max_model_len=max_model_len, kv_cache_mb=args.kv_cache_mb,
                    block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                    enable_prefix_caching=args.enable_prefix_caching, prefill_chunk=args.prefill_chunk,
                    schedule=args.schedule, eos_token_id=eos, kv_layout=args.kv_layout)
    return _Launch(load, settings, cfg, tokenizer, template, layout, _model_name(args, source, location), api_key,
                   max_model_len, torchrun, kv_layout, reasoning)


def _serve(args, launch: _Launch) -> int:
    """Rank 0 (or the launcher): the engine in a thread, HTTP in this one, until a signal or the engine fails."""
    from .app import create_app
    from .client import EngineClient
    from .metrics import Metrics
    from .service import ServerState
    from .worker import ServeJob

    client = EngineClient(heartbeat_timeout_s=args.timeout_s + 5)
    job = ServeJob(load=launch.load, address=client.address, authkey=client.authkey, **launch.settings)
    metrics = Metrics(launch.name)
    client.on_step = metrics.on_step
    client.on_ready = lambda info: _on_ready(metrics, info)
    state = ServerState(client=client, tokenizer=launch.tokenizer, template=launch.template, model_name=launch.name,
                        max_model_len=launch.max_model_len, vocab_size=launch.cfg.vocab_size,
                        eos_token_id=launch.settings["eos_token_id"], api_key=launch.api_key,
                        max_queue=args.max_queue, metrics=metrics, tool_call_parser=args.tool_call_parser,
                        reasoning=launch.reasoning)
    engine = _Engine(job, client, launch.layout.world, args.timeout_s, launch.torchrun)
    engine.thread.start()
    world = launch.layout.world
    print(f"torchtsp: serving {launch.name!r} ({args.scheme}, {world} rank{'s' * (world > 1)}, KV cache by "
          f"{launch.kv_layout}) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    app = create_app(state)
    try:
        signum = _run_http(app, args.host, args.port, engine.failed,
                           _Shutdown(app.state.service, client, args.shutdown_grace_s))
    finally:
        failed = engine.failed.is_set()
        engine.stop()
    if failed:  # a rank died or hung: the streams in flight got their error; exit as train does
        print(f"torchtsp: error: {client.error}", file=sys.stderr, flush=True)
        return 2
    if signum:
        print(f"torchtsp: stopped by {signal.Signals(signum).name}", file=sys.stderr)
    return 0


def _on_ready(metrics, info: dict) -> None:
    metrics.on_ready(info)
    print(ready_line(info), file=sys.stderr, flush=True)


def ready_line(info: dict) -> str:
    """The start-up line of the ready engine: what its KV cache holds. A block id covers ``block_tokens`` tokens:
    ``block_size`` on each of the ranks that share a sequence's tokens (the sequence and grouped layouts)."""
    size, tokens = info["block_size"], info["block_tokens"]
    shared = f" ({size} per rank)" if tokens != size else ""
    # A hybrid model's block groups (serve/blocks.py) share the blocks; a sliding group keeps each sequence's window
    # only, so the capacity is the longest sequence the pool holds alone.
    groups = info.get("kv_groups", [])
    windows = sorted({g["window"] for g in groups if g["window"] is not None})
    shared_by = "" if not windows else (f" shared by {len(groups)} block groups, sliding window "
                                        f"{', '.join(map(str, windows))}: a sequence's longest alone")
    return (f"torchtsp: KV cache {info['kv_capacity_tokens']} tokens ({info['num_blocks']} blocks of {tokens} "
            f"tokens{shared}{shared_by}, {info['kv_cache_bytes_per_rank'] / 2**20:.1f} MiB per rank, layout "
            f"{info['kv_layout']})")


class _Engine:
    """The ranks, run from a thread: a WorkerPool of local ranks, or this rank's own loop under torchrun. A
    failure fails the client (every request in flight) and sets ``failed``, which stops the HTTP server."""

    def __init__(self, job, client, world: int, timeout_s: float, torchrun: bool):
        self.job, self.client, self.torchrun = job, client, torchrun
        self.failed = threading.Event()
        self.error: BaseException | None = None
        self.pool = None
        if not torchrun:
            from ..distributed.launch import WorkerPool

            self.pool = WorkerPool(world, timeout_s=timeout_s, device_type=None, preload=["torchtsp.serve.worker"])
        self.thread = threading.Thread(target=self._run, name="torchtsp-serve-ranks", daemon=True)

    def _run(self) -> None:
        from .worker import run_serve_rank

        try:
            if self.pool is None:
                run_serve_rank(self.job)
            else:
                self.pool.run(run_serve_rank, self.job, timeout_s=float("inf"))
        except BaseException as e:  # noqa: BLE001 - reported through the requests, /health and the exit status
            message = getattr(e, "summary", None) or " ".join(str(e).split())[:500] or type(e).__name__
            self.error = e
            self.client.fail(message)
            self.failed.set()

    def stop(self) -> None:
        loading = self.client.state == "loading"  # nothing to finish: the ranks are stopped at once
        self.client.stop()
        self.thread.join(0 if loading else STOP_WAIT_S)
        if self.pool is not None:
            self.pool.close(force=self.thread.is_alive() or self.error is not None)
        else:
            from ..distributed import comm

            comm.destroy_process_group()


class _Shutdown:
    """What SIGTERM does before uvicorn waits for the connections: drain the queue at once, and stop the engine
    when the grace ends, so that the requests still running end with their error event rather than being cut
    by uvicorn's own timeout."""

    def __init__(self, service, client, grace_s: float):
        self.service, self.client, self.grace_s = service, client, grace_s

    def begin(self):
        import asyncio

        self.service.drain()
        return asyncio.get_running_loop().call_later(self.grace_s, self.client.stop)


def _run_http(app, host: str, port: int, stop: threading.Event, shutdown: _Shutdown) -> int | None:
    """Serve until SIGINT / SIGTERM or ``stop``; returns the signal that stopped it (None otherwise)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def on_tick(self, counter: int) -> bool:
            return stop.is_set() or await super().on_tick(counter)

        async def shutdown(self, sockets=None) -> None:
            grace_end = shutdown.begin()
            try:
                await super().shutdown(sockets)
            finally:
                grace_end.cancel()

    received: list[int] = []
    # uvicorn re-raises the signal that stopped it once it is done: record it instead, so the engine and the
    # ranks are stopped here rather than the process being killed half-way.
    previous = {sig: signal.signal(sig, lambda s, f: received.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=shutdown.grace_s + STOP_WAIT_S)
    server = Server(config)
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind
        raise OSError(f"could not serve on {host}:{port} (the port is in use, or not an address of this host)") \
            from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started and not received and not stop.is_set():
        raise OSError(f"could not serve on {host}:{port} (the port is in use, or not an address of this host)")
    return received[0] if received else None


def _serve_rank_only(load, settings) -> int:
    """torchrun, ranks other than 0: engine steps until rank 0's plan says stop (or rank 0 is gone)."""
    from ..distributed import comm
    from ..distributed.launch import watch_parent
    from .worker import ServeJob, run_serve_rank

    watch_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when to stop; its plan tells this rank
        signal.signal(sig, signal.SIG_IGN)
    try:
        run_serve_rank(ServeJob(load=load, address=(), authkey=b"", **settings))
    finally:
        comm.destroy_process_group()
    return 0
