"""``torchtsp serve``: checks before any rank starts, the ranks, the HTTP server, and a clean stop.

The launcher (this process) resolves the model source, tokenizer, chat template and mesh like ``generate``
and refuses bad flags in one line. It then starts the ranks (``WorkerPool``, which owns them: they exit if
this process dies) running ``worker.run_serve_rank`` in a background thread, and serves HTTP in the main
thread. SIGINT or SIGTERM: uvicorn stops accepting, lets in-flight requests finish for ``GRACE_S``, then the
engine is told to stop (requests still running fail), the ranks leave their loop and the pool is closed.
A rank that dies or hangs fails the pool's job: /health turns 503 and in-flight requests fail at once.
Under torchrun every rank runs this command; rank 0 serves HTTP with its engine loop in a thread.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from pathlib import Path

from ..schemes import AXES, SCHEMES

GRACE_S = 10.0  # SIGTERM: how long in-flight requests may still finish
STOP_WAIT_S = 10.0  # then how long the ranks have to leave their loop before they are killed


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
    servable = SCHEMES.servable()  # a scheme whose replicas split the batch's rows is not continuous batching yet
    if args.scheme not in servable:
        raise ValueError(f"serve runs the {', '.join(servable)} schemes, not {args.scheme!r} (data-parallel "
                         f"replicas decode separate rows; run several servers behind a load balancer instead)")
    for flag in ("max_batch", "max_queue", "prefill_chunk"):
        value = getattr(args, flag)
        if value < (0 if flag == "max_queue" else 1):
            raise ValueError(f"--{flag.replace('_', '-')} must be >= {0 if flag == 'max_queue' else 1}, got {value}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        raise ValueError(f"--timeout-s must be a finite number > 0, got {args.timeout_s}")
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    limit = args.max_model_len or cfg.max_seq_len
    if not 2 <= limit <= cfg.max_seq_len:
        raise ValueError(f"--max-model-len must be in [2, {cfg.max_seq_len}] (the model's max_seq_len), got {limit}")
    return limit


def _chat_template(args, tokenizer):
    from .text import ChatTemplate

    source = None
    if args.chat_template is not None:
        path = Path(args.chat_template)
        if not path.is_file():
            raise FileNotFoundError(f"--chat-template {path}: no such file")
        source = path.read_text()
    elif tokenizer is not None:
        source = getattr(tokenizer, "chat_template", None)
        if isinstance(source, list):  # several named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not source:
        return None
    tok = getattr(tokenizer, "tokenizer", None)
    name = lambda i: tok.id_to_token(i) if tok is not None and i is not None else None
    return ChatTemplate(source, name(getattr(tokenizer, "bos_id", None)), name(getattr(tokenizer, "eos_id", None)))


def _model_name(args, source: str, location: str) -> str:
    if args.served_model_name:
        return args.served_model_name
    return location if source == "preset" else Path(location).resolve().name


def cmd_serve(args) -> int:
    require_extra()
    from ..generate_job import GenerateJob, model_config_and_tokenizer
    from ..layout import Layout
    from ..runenv import launched_by_torchrun

    source, location = next(((s, v) for s in ("hf", "checkpoint", "preset") if (v := getattr(args, s))),
                            ("preset", "tiny"))
    cfg, tokenizer, eos = model_config_and_tokenizer(source, location, args.tokenizer)
    max_model_len = _check_flags(args, cfg)
    template = _chat_template(args, tokenizer)
    api_key = args.api_key or os.environ.get("TORCHTSP_API_KEY") or None
    flags = {axis: getattr(args, axis) for axis in AXES if axis != "dp"}  # serve has no --dp
    torchrun = launched_by_torchrun()
    world = int(os.environ.get("WORLD_SIZE", 1)) if torchrun else args.nproc
    layout = Layout.resolve(args.scheme, world, **flags, cfg=cfg)
    load = GenerateJob(source=source, location=location, prompts=[], max_new_tokens=1, scheme=args.scheme,
                       degrees=layout.sizes, seed=args.seed, dtype=args.dtype, timeout_s=args.timeout_s,
                       tokenizer=args.tokenizer)
    settings = dict(max_batch=args.max_batch, max_model_len=max_model_len, prefill_chunk=args.prefill_chunk,
                    schedule=args.schedule, eos_token_id=eos)
    if torchrun and int(os.environ.get("RANK", 0)) != 0:
        return _serve_rank_only(load, settings)

    from .app import ServerState, build_app
    from .client import EngineClient
    from .metrics import Metrics
    from .worker import ServeJob, run_serve_rank

    client = EngineClient(heartbeat_timeout_s=args.timeout_s + 5)
    job = ServeJob(load=load, address=client.address, authkey=client.authkey, **settings)
    name = _model_name(args, source, location)
    metrics = Metrics(name)
    client.on_step = metrics.on_step
    state = ServerState(client=client, tokenizer=tokenizer, template=template, model_name=name,
                        max_model_len=max_model_len, vocab_size=cfg.vocab_size, eos_token_id=eos, api_key=api_key,
                        max_queue=args.max_queue, metrics=metrics)
    app = build_app(state)
    outcome: dict = {}

    if torchrun:
        from ..distributed import comm

        def engine():
            try:
                run_serve_rank(job)
            except BaseException as e:  # noqa: BLE001 - reported through /health and the requests
                client.fail(" ".join(str(e).split())[:500] or type(e).__name__)
                outcome["error"] = e
        pool = None
    else:
        from ..distributed.launch import WorkerPool

        pool = WorkerPool(layout.world, timeout_s=args.timeout_s, device_type=None)

        def engine():
            try:
                pool.run(run_serve_rank, job, timeout_s=float("inf"))
            except BaseException as e:  # noqa: BLE001
                message = getattr(e, "summary", None) or " ".join(str(e).split())[:500]
                client.fail(message)
                outcome["error"] = e

    thread = threading.Thread(target=engine, name="torchtsp-serve-ranks", daemon=True)
    thread.start()
    print(f"torchtsp: serving {name!r} ({args.scheme}, {layout.world} rank{'s' * (layout.world > 1)}) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        signum = _run_http(app, args.host, args.port)
    finally:
        loading = client.state == "loading"  # nothing to finish: the ranks are stopped at once
        client.stop()
        thread.join(0 if loading else STOP_WAIT_S)
        if pool is not None:
            pool.close(force=thread.is_alive() or "error" in outcome)
        elif torchrun:
            comm.destroy_process_group()
    if signum:
        print(f"torchtsp: stopped by {signal.Signals(signum).name}", file=sys.stderr)
    return 0


def _run_http(app, host: str, port: int) -> int | None:
    """Serve until SIGINT / SIGTERM; returns the signal that stopped it (None if uvicorn stopped by itself)."""
    import uvicorn

    received: list[int] = []
    # uvicorn re-raises the signal that stopped it once it is done: record it instead, so the engine and the
    # ranks are stopped here rather than the process being killed half-way.
    previous = {sig: signal.signal(sig, lambda s, f: received.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=GRACE_S,
                            lifespan="off")
    server = uvicorn.Server(config)
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind
        raise OSError(f"could not serve on {host}:{port} (the port is in use, or not an address of this host)") \
            from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started and not received:
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
