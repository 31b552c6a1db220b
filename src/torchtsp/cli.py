"""The ``torchtsp`` command line."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from .config import PRESETS
from .errors import RankFailedError
from .runenv import launched_by_torchrun
from .schemes import SCHEMES, get_scheme


def cmd_train(args: argparse.Namespace) -> int:
    # Imported here so that `torchtsp --help` stays fast.
    from .distributed import comm
    from .distributed.launch import WorkerPool
    from .train.config import FIELDS, build_config
    from .train.trainer import format_summary, run_training

    cfg = build_config(args.config, **{k: v for k, v in vars(args).items() if k in FIELDS})
    if launched_by_torchrun():
        try:
            summary = run_training(cfg)
            show = comm.global_rank() == 0
        finally:
            comm.destroy_process_group()
    else:
        nproc = cfg.nproc or (cfg.dp or 1) * (cfg.tsp or 1) * (cfg.tp or 1) * (cfg.sp or 1)
        # A mesh the scheme cannot use is refused here, before any rank starts.
        get_scheme(cfg.scheme).degrees(nproc, dp=cfg.dp, tsp=cfg.tsp, tp=cfg.tp, sp=cfg.sp)
        if nproc == 1:
            summary = run_training(cfg)
        else:
            with WorkerPool(nproc, timeout_s=cfg.timeout_s) as pool:
                # Ctrl-C reaches every rank; they finish the step and save. The launcher just waits.
                previous = signal.signal(signal.SIGINT, lambda *_: None)
                try:
                    summary = pool.run(run_training, cfg, timeout_s=float("inf"))[0]
                finally:
                    signal.signal(signal.SIGINT, previous)
        show = True
    if show:
        print(format_summary(summary))
    return 130 if summary["status"] == "interrupted" else 0


def add_train_arguments(train: argparse.ArgumentParser) -> None:
    """Every flag defaults to None: unset flags leave the TOML file's value or the built-in default."""
    add = train.add_argument
    add("--config", metavar="TOML", help="settings file (flags override it)")
    add("--preset", choices=list(PRESETS), help="model shape (default: tiny)")
    add("--init-from-hf", metavar="DIR", help="start from a Hugging Face Llama checkpoint")
    add("--scheme", choices=list(SCHEMES), help="parallel scheme (default: tsp)")
    for axis in ("dp", "tsp", "tp", "sp"):
        add(f"--{axis}", type=int, help=f"{axis} degree of the mesh")
    add("--nproc", type=int, help="local CPU ranks to spawn when not under torchrun (default: product of degrees)")
    add("--batch-size", type=int, help="global batch in sequences (default: 8)")
    add("--seq-len", type=int, help="tokens per sequence (default: 256)")
    add("--steps", type=int, help="optimizer steps (default: 100)")
    add("--lr", type=float, help="peak learning rate, warmup then cosine (default: 3e-3)")
    add("--warmup-steps", type=int, help="linear warmup steps (default: steps/10)")
    add("--data", metavar="PATH", help="text file or folder (default: the Python standard library)")
    add("--out", metavar="DIR", help="run folder: metrics.jsonl and checkpoints/ (default: runs/latest)")
    add("--checkpoint-every", type=int, help="save every N steps (default: only at the end)")
    add("--resume", metavar="PATH", help="continue from a run folder's latest checkpoint or a checkpoint folder")
    add("--dtype", choices=["float32", "bfloat16"], help="bfloat16: bf16 compute, fp32 master weights")
    add("--recompute", action=argparse.BooleanOptionalAction, help="recompute each layer in backward")
    add("--seed", type=int, help="seed for init and data order (default: 0)")
    add("--sample-tokens", type=int, help="greedy tokens generated after training (default: 64; 0: none)")
    add("--timeout-s", type=float, help="collective timeout in seconds (default: 300)")


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
        from .convert import convert_checkpoint
    except ImportError as e:
        raise OSError(f"convert is unavailable: {e}") from e
    kind = convert_checkpoint(args.src, args.dst, to=args.to, overwrite=args.force)
    print(f"wrote {kind} checkpoint to {args.dst}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchtsp", description="Folded Tensor and Sequence Parallelism for PyTorch.")
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("torchtsp: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RankFailedError) as e:  # OSError includes FileNotFoundError
        if os.environ.get("TORCHTSP_DEBUG") == "1":
            raise
        message = e.summary if isinstance(e, RankFailedError) else " ".join(str(e).split()) or type(e).__name__
        print(f"torchtsp: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
