"""The ``torchtsp`` command line."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .config import PRESETS, get_preset


def cmd_train(args: argparse.Namespace) -> int:
    from .train.single import train_single  # imported here so `torchtsp --help` stays fast

    start = time.perf_counter()
    losses = train_single(
        get_preset(args.preset), args.steps, args.batch_size, args.seq_len, args.lr, args.seed, data=args.data
    )
    print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f} ({len(losses)} steps, {time.perf_counter() - start:.1f}s)")
    return 0


def cmd_not_implemented(args: argparse.Namespace) -> int:
    print(f"torchtsp {args.command}: not implemented yet", file=sys.stderr)
    return 2


def cmd_convert(args: argparse.Namespace) -> int:
    try:
        from .hf import convert_checkpoint
    except ImportError as e:
        raise OSError(f"convert is unavailable: {e}") from e
    kind = convert_checkpoint(args.src, args.dst, to=args.to, overwrite=args.force)
    print(f"wrote {kind} checkpoint to {args.dst}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchtsp", description="Folded Tensor and Sequence Parallelism for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train a model on a text corpus (single process for now)")
    train.add_argument("--preset", default="tiny", choices=list(PRESETS), help="model shape (default: tiny)")
    train.add_argument("--steps", type=int, default=40, help="optimizer steps (default: 40)")
    train.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: 8)")
    train.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    train.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    train.add_argument("--seed", type=int, default=0, help="seed for init and data order (default: 0)")
    train.add_argument("--data", metavar="PATH", help="text file or folder (default: the Python standard library)")
    train.set_defaults(func=cmd_train)

    for name, help in [
        ("bench", "measure step time and memory of parallel schemes"),
        ("plan", "choose a parallel layout for a model and cluster"),
        ("generate", "generate text from a checkpoint"),
    ]:
        sub.add_parser(name, help=help).set_defaults(func=cmd_not_implemented)

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
    except (ValueError, OSError) as e:  # OSError includes FileNotFoundError
        if os.environ.get("TORCHTSP_DEBUG") == "1":
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"torchtsp: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
