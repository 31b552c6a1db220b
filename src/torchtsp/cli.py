"""The ``torchtsp`` command line."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from .config import PRESETS
from .errors import Interrupted, RankFailedError
from .schemes import SCHEMES


def _launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def cmd_train(args: argparse.Namespace) -> int:
    # Imported here so that `torchtsp --help` stays fast.
    from .distributed import comm
    from .distributed.launch import watch_parent
    from .train.config import FIELDS, build_config
    from .train.trainer import format_summary, run_training

    cfg = build_config(args.config, **{k: v for k, v in vars(args).items() if k in FIELDS})
    if _launched_by_torchrun():
        watch_parent()  # a rank whose torchrun agent was killed exits instead of training on alone
        try:
            summary = run_training(cfg)
            show = comm.global_rank() == 0
        finally:
            comm.destroy_process_group()
    else:
        nproc = cfg.nproc or cfg.dp * (cfg.tsp or 1) * cfg.tp * cfg.sp
        summary = run_training(cfg) if nproc == 1 else _launch(cfg, nproc)
        show = True
    if summary["status"] == "aborted":  # another rank reported why
        return 2
    if show:
        print(format_summary(summary))
    return 128 + summary["signal"] if summary["status"] == "interrupted" else 0


def _launch(cfg, nproc: int) -> dict:
    """Spawn ``nproc`` local ranks and train on them. The launcher owns its ranks: SIGINT or SIGTERM to it (or
    to the whole process group, as Ctrl-C and ``timeout`` send) is passed on to every rank until they stop at a
    step boundary and save; a second signal aborts at once. Ranks exit by themselves if the launcher dies."""
    from .distributed.launch import WorkerPool
    from .train.trainer import run_training

    stop: dict = {}  # the first signal and when it came

    def on_signal(signum, frame):
        if not stop:
            stop.update(signum=signum, at=time.monotonic())
            print("torchtsp: passing the stop on to every rank (signal again to abort without saving)",
                  file=sys.stderr)
        # `timeout` signals the launcher, then its whole process group: a repeat within a second is one request.
        elif time.monotonic() - stop["at"] > 1.0:
            raise Interrupted(signum)

    def forward():
        # Ranks ignore signals until their trainer listens: sending again until they stop loses none.
        if stop:
            pool.signal_ranks(stop["signum"])

    with WorkerPool(nproc, timeout_s=cfg.timeout_s, device_type=None) as pool:
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            summary = pool.run(run_training, cfg, timeout_s=float("inf"), on_wait=forward)[0]
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return summary


def add_train_arguments(train: argparse.ArgumentParser) -> None:
    """Every flag defaults to None: unset flags leave the TOML file's value or the built-in default."""
    add = train.add_argument
    add("--config", metavar="TOML", help="settings file (flags override it)")
    add("--preset", choices=list(PRESETS), help="model shape (default: tiny)")
    add("--init-from-hf", metavar="DIR", help="start from a Hugging Face Llama checkpoint")
    add("--scheme", choices=list(SCHEMES), help="parallel scheme (default: tsp)")
    for axis in ("dp", "tsp", "tp", "sp"):
        add(f"--{axis}", type=int, help=f"{axis} degree of the mesh")
    add("--nproc", type=int, help="local ranks to spawn when not under torchrun, one GPU each on a CUDA host "
        "(default: product of degrees)")
    add("--batch-size", type=int, help="global batch in sequences (default: 8)")
    add("--seq-len", type=int, help="tokens per sequence (default: 256)")
    add("--steps", type=int, help="optimizer steps (default: 100)")
    add("--lr", type=float, help="peak learning rate, warmup then cosine (default: 3e-3)")
    add("--warmup-steps", type=int, help="linear warmup steps (default: steps/10)")
    add("--skip-nonfinite", type=int, metavar="N",
        help="skip up to N steps whose loss or gradient norm is not finite (default: 0, the first one stops the run)")
    add("--data", metavar="PATH", help="text file or folder (default: the Python standard library)")
    add("--out", metavar="DIR", help="run folder: metrics.jsonl and checkpoints/ (default: the --resume run "
        "folder, else runs/latest)")
    add("--overwrite", action="store_true", default=None, help="replace the run already in --out")
    add("--checkpoint-every", type=int, help="save every N steps (default: only at the end)")
    add("--keep-last", type=int, metavar="N", help="keep only the newest N checkpoints (default: all)")
    add("--resume", metavar="PATH", help="continue from a run folder's latest checkpoint or a checkpoint folder")
    add("--dtype", choices=["float32", "bfloat16"], help="bfloat16: bf16 compute, fp32 master weights")
    add("--recompute", action=argparse.BooleanOptionalAction, help="recompute each layer in backward")
    add("--seed", type=int, help="seed for init and data order (default: 0)")
    add("--sample-tokens", type=int, help="greedy tokens generated after training (default: 64; 0: none)")
    add("--timeout-s", type=float, help="collective timeout in seconds (default: 300)")
    add("--mem-every", type=int, metavar="N", help="log the peak live memory every N steps (default: 10)")


def cmd_not_implemented(args: argparse.Namespace) -> int:
    print(f"torchtsp {args.command}: not implemented yet", file=sys.stderr)
    return 2


def cmd_plan(args: argparse.Namespace) -> int:
    from .analysis.plan import run_plan

    return run_plan(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.run import run_bench

    return run_bench(args)


def cmd_convert(args: argparse.Namespace) -> int:
    try:
        from .hf import convert_checkpoint
    except ImportError as e:
        raise OSError(f"convert is unavailable: {e}") from e
    kind = convert_checkpoint(args.src, args.dst, to=args.to, overwrite=args.force)
    print(f"wrote {kind} checkpoint to {args.dst}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="torchtsp", description="Folded Tensor and Sequence Parallelism for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train a model with TSP (or a baseline scheme) on local ranks or torchrun")
    add_train_arguments(train)
    train.set_defaults(func=cmd_train)

    from .analysis.plan import add_plan_arguments  # torch-free
    from .bench.args import add_bench_arguments  # torch-free

    bench = sub.add_parser("bench", help="measure memory, step time and traffic of every scheme side by side")
    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    plan = sub.add_parser("plan", help="predict per-GPU memory and traffic of every layout, offline")
    add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)

    sub.add_parser("generate", help="generate text from a checkpoint (not implemented yet)").set_defaults(
        func=cmd_not_implemented)

    convert = sub.add_parser("convert", help="convert checkpoints between torchtsp and Hugging Face formats")
    convert.add_argument("src", help="checkpoint to read")
    convert.add_argument("dst", help="where to write the converted checkpoint")
    convert.add_argument("--to", choices=["hf", "torchtsp"], help="target format (default: the other one)")
    convert.add_argument("--force", action="store_true", help="overwrite dst if it exists")
    convert.set_defaults(func=cmd_convert)
    return parser


class _Parser(argparse.ArgumentParser):
    """Bad flags are one line, like every other error (argparse would print the whole usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "out of memory" in text \
        or "can't allocate memory" in text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("torchtsp: interrupted", file=sys.stderr)
        return 130
    except Interrupted as e:
        print("torchtsp: aborted; the ranks were stopped without saving", file=sys.stderr)
        return 128 + e.signum
    except (ValueError, OSError, RankFailedError, MemoryError, RuntimeError) as e:  # OSError: FileNotFoundError too
        if os.environ.get("TORCHTSP_DEBUG") == "1" or (isinstance(e, RuntimeError) and not isinstance(
                e, RankFailedError) and not _out_of_memory(e)):
            raise
        message = e.summary if isinstance(e, RankFailedError) else " ".join(str(e).split()) or type(e).__name__
        if _out_of_memory(e):
            message = (f"out of memory: {message[:300]}; lower --batch-size or --seq-len, pass --recompute, "
                       f"or spread the model over more ranks")
        print(f"torchtsp: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
