"""The ``torchtsp`` command line."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time

from .argtypes import length
from .errors import Interrupted, RankFailedError
from .kv_layouts import KV_LAYOUT_HELP, KV_LAYOUTS
from .layout import Layout
from .presets import PRESETS
from .recompute import POLICIES
from .runenv import launched_by_torchrun
from .schemes import AXES, INFERENCE_SCHEDULES, PIPELINE_SCHEDULES, SCHEMES, inference_schemes
from .timeouts import COLLECTIVE_TIMEOUT_S

# Why a collective gives up, quoted by every command whose ranks communicate.
COLLECTIVE_TIMEOUT_HELP = (f"seconds a collective waits for the other ranks before the run fails: that long means a "
                           f"rank hung or died; the slowest correct wait is a checkpoint write or a first step on "
                           f"another rank (default: {COLLECTIVE_TIMEOUT_S:g})")


def cmd_train(args: argparse.Namespace) -> int:
    # Imported here so that `torchtsp --help` stays fast.
    from .distributed import comm
    from .distributed.launch import watch_parent
    from .train.config import FIELDS, build_config
    from .train.trainer import check_before_launch, finished_resume_step, format_summary, run_training

    cfg = build_config(args.config, **{k: v for k, v in vars(args).items() if k in FIELDS})
    done = finished_resume_step(cfg)
    if done is not None:  # no rank needs to start for a run that has finished
        if os.environ.get("RANK", "0") == "0":
            print(f"torchtsp: nothing left to do: {cfg.resume} is at step {done} of {cfg.steps} (give --steps N "
                  f"above {done} to train further)")
        return 0
    if launched_by_torchrun():
        watch_parent()  # a rank whose torchrun agent was killed exits instead of training on alone
        try:
            summary = run_training(cfg)
            show = comm.global_rank() == 0
        finally:
            comm.destroy_process_group()
    else:
        # A mesh the scheme cannot use, a model or batch it cannot split, a bad dataset: refused here, before any
        # rank starts, by the resolution each rank makes again (ranks skip the data scans).
        layout, data = check_before_launch(cfg, cfg.nproc)
        for notice in data.notices:
            print(f"torchtsp: {notice}", file=sys.stderr)
        summary = run_training(cfg, True) if layout.world == 1 else _launch(cfg, layout.world)
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

    def forward(pool):
        # Ranks ignore signals until their trainer listens: sending again until they stop loses none.
        if stop:
            pool.signal_ranks(stop["signum"])

    # Listening before the ranks start: a signal while they start up is one to pass on, not one to lose.
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with WorkerPool(nproc, timeout_s=cfg.timeout_s, device_type=None,
                        preload=[run_training.__module__]) as pool:
            return pool.run(run_training, cfg, True, timeout_s=float("inf"), on_wait=lambda: forward(pool))[0]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def add_train_arguments(train: argparse.ArgumentParser) -> None:
    """Every flag defaults to None: unset flags leave the TOML file's value or the built-in default."""
    add = train.add_argument
    add("--config", metavar="TOML", help="settings file (flags override it)")
    add("--preset", choices=list(PRESETS), help="model shape (default: tiny)")
    add("--init-from-hf", metavar="DIR", help="start from a Hugging Face checkpoint: Llama, Mistral, Qwen2/2.5, "
        "Qwen3, Phi-3, Gemma 3 (text), Qwen2-MoE or Mixtral")
    add("--scheme", choices=list(SCHEMES), help="parallel scheme (default: tsp)")
    for axis in AXES:  # the registry's mesh axes
        add(f"--{axis}", type=int, help=f"{axis} degree of the mesh")
    add("--pp", type=int, help="pipeline stages (outermost mesh axis; tsp, tp or sp inside): contiguous layer "
        "ranges, the embedding in the first, the head and loss in the last (default: 1)")
    add("--microbatches", type=int, help="microbatches per replica and step with --pp (default: the number of "
        "stages)")
    add("--schedule", choices=list(PIPELINE_SCHEDULES), help="pipeline schedule with --pp (default: 1f1b)")
    add("--nproc", type=int, help="local ranks to spawn when not under torchrun, one GPU each on a CUDA host "
        "(default: product of degrees)")
    add("--batch-size", type=int, help="global batch in sequences (default: 8)")
    add("--seq-len", type=length, help="tokens per sequence; 32k = 32768 (default: 256)")
    add("--steps", type=int, help="optimizer steps (default: 100)")
    add("--lr", type=float, help="peak learning rate, warmup then cosine (default: 3e-3)")
    add("--warmup-steps", type=int, help="linear warmup steps (default: steps/10)")
    add("--skip-nonfinite", type=int, metavar="N",
        help="skip up to N steps whose loss or gradient norm is not finite (default: 0, the first one stops the run)")
    add("--data", metavar="DATA", help="a Megatron dataset PREFIX (.bin/.idx), a .npy of ids, .jsonl/.parquet/text "
        "files or a folder (tokenized on the fly), or a blend \"0.7 A 0.3 B\" (default: the Python standard "
        "library)")
    add("--tokenizer", metavar="DIR", help="folder of the model's tokenizer.json (default: the --init-from-hf "
        "folder's; presets: bytes)")
    add("--vocab-size", type=int, metavar="N", help="a preset's vocabulary (default: the --tokenizer's size rounded "
        "up to a multiple of 128, else the preset's own); a checkpoint's is its own")
    add("--eval-data", metavar="DATA", help="evaluation dataset, same forms as --data")
    add("--eval-every", type=int, metavar="N", help="evaluate every N steps (default: only at the end)")
    add("--eval-batches", type=int, metavar="K", help="batches per evaluation (default: the whole eval set, at most "
        "50)")
    add("--grad-accum", type=int, metavar="N", help="split the global batch into N micro-batches, one optimizer step "
        "(default: 1)")
    add("--tensorboard", action="store_true", default=None, help="also write TensorBoard scalars to OUT/tensorboard")
    add("--profile-steps", metavar="A:B", help="torch.profiler trace of steps A..B per rank, OUT/profile/rankR.json")
    add("--out", metavar="DIR", help="run folder: metrics.jsonl and checkpoints/ (default: the --resume run "
        "folder, else a new runs/<UTC time>-<scheme>, which runs/latest then points at)")
    add("--overwrite", action="store_true", default=None, help="replace the run already in --out")
    add("--checkpoint-every", type=int, help="save every N steps (default: only at the end)")
    add("--keep-last", type=int, metavar="N", help="keep only the newest N checkpoints (default: all)")
    add("--resume", metavar="PATH", help="continue from a run folder's latest checkpoint or a checkpoint folder, "
        "with every setting the run was trained with (flags given override them, and are reported)")
    add("--reset-data", action="store_true", default=None, help="with --resume: read the data from its start (for "
        "a run continued on other data; without it, a dataset other than the run's is refused)")
    add("--dtype", choices=["float32", "bfloat16"], help="bfloat16: bf16 compute, fp32 master weights")
    add("--recompute", nargs="?", const="full", choices=POLICIES, help="activations recomputed in backward: full "
        "(each layer's forward again), selective (the MLP's elementwise hidden state, no collective again) or none "
        "(default); a bare --recompute is full")
    add("--no-recompute", dest="recompute", action="store_const", const="none", help="the same as --recompute none")
    add("--compile", action=argparse.BooleanOptionalAction, help="torch.compile each block's math (norms, RoPE, "
        "the MLP's elementwise part; a dp block whole), collectives left eager; the first step compiles "
        "(default: off)")
    add("--zero", type=int, metavar="{0,1,2,3}", help="distributed optimizer over dp: 1 shards AdamW state and fp32 "
        "masters 1/dp, 2 also the gradients, 3 also the weights (FSDP2) (default: 2 when dp > 1; 0: replicated)")
    add("--reshard-after-forward", action=argparse.BooleanOptionalAction, help="with --zero 3: free the gathered "
        "weights after forward and gather them again for backward (default: on; off trades memory for bytes)")
    add("--cpu-offload", action="store_true", default=None, help="with --zero 3: keep sharded weights, gradients "
        "and AdamW state in host memory (GPU runs)")
    add("--zero-bucket-mb", type=float, metavar="MB", help="float32 gradient bucket of one reduce-scatter with "
        "--zero, all dp rows together (default: 32)")
    add("--document-mask", action=argparse.BooleanOptionalAction,
        help="packed samples: attend within documents only, positions restart at each (a document ends after "
             "its EOS, whose target is ignored; a chat dataset's documents are its conversations); default: on "
             "for chat datasets, off otherwise")
    add("--max-conversation-tokens", type=length, metavar="N", help="chat datasets: skip conversations longer "
        "than N tokens, and say how many (default: none skipped; those longer than --seq-len are split into "
        "row-sized pieces)")
    add("--seed", type=int, help="seed for init and data order (default: 0)")
    add("--sample-tokens", type=length, help="tokens the trained model writes after the prompt \"def \" when "
        "training ends, sampled at temperature 0.8 among the 40 likeliest (seeded by --seed) (default: 64; 0: none)")
    add("--timeout-s", type=float, help=COLLECTIVE_TIMEOUT_HELP)
    add("--mem-every", type=int, metavar="N", help="also measure the peak live memory every N steps, each such "
        "step 2-3x slower (default: 0, only the first two steps, which hold the run's peak)")


def add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    add = gen.add_argument
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face Llama checkpoint (text through its tokenizer.json)")
    source.add_argument("--checkpoint", metavar="RUN", help="a training run folder or one of its step folders "
                        "(text through the run's own tokenizer)")
    source.add_argument("--preset", choices=list(PRESETS), help="random weights of a preset shape (default: tiny)")
    add("--tokenizer", metavar="DIR", help="folder of the tokenizer.json to use (default: the model's own)")
    add("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeat for a batch)")
    add("--prompt-ids", metavar="IDS", help='token ids, e.g. "1,2,3;4,5" (";" separates the prompts of a batch)')
    add("--max-new-tokens", type=length, default=32, help="new tokens per prompt at most (default: 32)")
    add("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    add("--top-k", type=int, help="sample among the k most likely tokens")
    add("--top-p", type=float, help="sample in the nucleus of probability p")
    add("--seed", type=int, default=0, help="sampling seed (and the init seed of --preset); default 0")
    add("--stop-token-ids", metavar="IDS", help='ids that end a sequence, e.g. "2,13" (besides the model\'s EOS)')
    add("--scheme", choices=inference_schemes(), default="tsp", help="parallel scheme (default: tsp)")
    for axis in AXES:  # the registry's mesh axes
        add(f"--{axis}", type=int, help=f"{axis} degree (the scheme's axis; default: every rank)")
    add("--nproc", type=int, help="local CPU ranks to spawn when not under torchrun (default: the degree, or 1)")
    add("--schedule", choices=INFERENCE_SCHEDULES, default="auto",
        help="tsp: weights move or activations move; auto picks per phase by tokens in flight (default)")
    add("--prefill-chunk", type=length, help="prefill at most this many tokens per prompt at a time (bounds memory)")
    add("--kv-layout", choices=KV_LAYOUTS, default="auto", help=KV_LAYOUT_HELP)
    add("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype (default: float32)")
    add("--json", action="store_true", help="print one JSON object (tokens, text, timings, memory) as the last line")
    add("--timeout-s", type=float, default=COLLECTIVE_TIMEOUT_S, help=COLLECTIVE_TIMEOUT_HELP)


def cmd_generate(args: argparse.Namespace) -> int:
    from .generate_job import (
        GenerateJob,
        check_kv_layout,
        model_config_and_tokenizer,
        parse_ids,
        parse_prompt_ids,
        print_json,
        run_generate,
    )
    from .infer.api import check_request

    source, location = next(((s, v) for s in ("hf", "checkpoint", "preset") if (v := getattr(args, s))),
                            ("preset", "tiny"))
    cfg, tokenizer, eos = model_config_and_tokenizer(source, location, args.tokenizer)
    if args.tokenizer and tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"--tokenizer {args.tokenizer} has {tokenizer.vocab_size} ids but the model's vocabulary "
                         f"(--{source} {location}) has {cfg.vocab_size}; give the model's own tokenizer")
    if args.prompt and tokenizer is None:
        raise ValueError("this model has no tokenizer (no tokenizer.json, or the tokenizers library is missing); "
                         "give --prompt-ids")
    prompts = [tokenizer.encode(text) for text in args.prompt]
    prompts += parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else []
    if not prompts:
        raise ValueError("no prompt: give --prompt TEXT or --prompt-ids IDS")
    check_request(cfg, prompts, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.prefill_chunk)
    stop_token_ids = parse_ids(args.stop_token_ids, "--stop-token-ids")
    _check_generate_flags(args, cfg, stop_token_ids)
    flags = {axis: getattr(args, axis) for axis in AXES}
    if launched_by_torchrun():
        from .distributed import comm

        world = comm.world_size()
    else:
        world = args.nproc  # None: the product of the degrees given
    layout = Layout.resolve(args.scheme, world, **flags, cfg=cfg)  # before any rank starts
    world, degrees = layout.world, layout.sizes
    check_kv_layout(args.kv_layout, cfg, args.scheme, degrees)
    job = GenerateJob(source=source, location=location, prompts=prompts, max_new_tokens=args.max_new_tokens,
                      scheme=args.scheme, degrees=degrees, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, seed=args.seed, stop_token_ids=stop_token_ids, eos_token_id=eos,
                      schedule=args.schedule, prefill_chunk=args.prefill_chunk, kv_layout=args.kv_layout,
                      dtype=args.dtype, stream=not args.json, timeout_s=args.timeout_s, tokenizer=args.tokenizer)
    if launched_by_torchrun():
        from .distributed import comm

        try:
            summary = run_generate(job)
            show = comm.global_rank() == 0
        finally:
            comm.destroy_process_group()
    elif world == 1:
        summary, show = run_generate(job), True
    else:
        from .distributed.launch import WorkerPool

        with WorkerPool(world, timeout_s=args.timeout_s, preload=[run_generate.__module__]) as pool:
            summary, show = pool.run(run_generate, job)[0], True
    if args.json and show:
        print_json(summary)
    return 0


def _check_generate_flags(args: argparse.Namespace, cfg, stop_token_ids: list[int]) -> None:
    """The launch and sampling flags of ``generate``, by the rules ``train`` applies, before any rank starts."""
    from .infer.sampling import check_sampling

    check_sampling(args.temperature, args.top_k, args.top_p)
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        raise ValueError(f"--timeout-s must be a finite number > 0, got {args.timeout_s}")
    outside = [t for t in stop_token_ids if not 0 <= t < cfg.vocab_size]
    if outside:
        raise ValueError(f"--stop-token-ids: token id {outside[0]} is outside the vocabulary [0, {cfg.vocab_size})")


def cmd_prepare_data(args: argparse.Namespace) -> int:
    from .data.prepare import cmd_prepare_data as run

    return run(args)


def cmd_plan(args: argparse.Namespace) -> int:
    from .analysis.plan import run_plan

    return run_plan(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.run import run_bench

    return run_bench(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve.server import cmd_serve as run

    return run(args)


def cmd_convert(args: argparse.Namespace) -> int:
    try:
        from .convert import convert_checkpoint
    except ImportError as e:
        raise OSError(f"convert is unavailable: {e}") from e
    kind = convert_checkpoint(args.src, args.dst, to=args.to, overwrite=args.overwrite)
    print(f"wrote {kind} checkpoint to {args.dst}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="torchtsp", description="Folded Tensor and Sequence Parallelism for PyTorch.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train a model with TSP (or a baseline scheme) on local ranks or torchrun")
    add_train_arguments(train)
    train.set_defaults(func=cmd_train)

    from .analysis.plan import add_plan_arguments  # torch-free
    from .data.prepare import add_prepare_arguments  # torch-free

    prepare = sub.add_parser("prepare-data", help="tokenize text into a Megatron indexed dataset (.bin/.idx/.json)")
    add_prepare_arguments(prepare)
    prepare.set_defaults(func=cmd_prepare_data)
    from .bench.args import add_bench_arguments  # torch-free

    bench = sub.add_parser("bench", help="measure memory, step time and traffic of every scheme side by side")
    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    plan = sub.add_parser("plan", help="predict per-GPU memory and traffic of every layout, offline")
    add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)

    generate = sub.add_parser("generate", help="generate text with TSP (or a baseline scheme), local ranks or torchrun")
    add_generate_arguments(generate)
    generate.set_defaults(func=cmd_generate)

    from .serve.args import add_serve_arguments  # torch-free

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming) with "
                           "continuous batching, local ranks or torchrun")
    add_serve_arguments(serve, PRESETS, INFERENCE_SCHEDULES)
    serve.set_defaults(func=cmd_serve)

    convert = sub.add_parser("convert", help="convert checkpoints between torchtsp and Hugging Face formats")
    convert.add_argument("src", help="checkpoint to read")
    convert.add_argument("dst", help="where to write the converted checkpoint")
    convert.add_argument("--to", choices=["hf", "torchtsp"], help="target format (default: the other one)")
    convert.add_argument("--overwrite", action="store_true", help="replace the checkpoint files already in dst")
    # The flag's former name, as train --overwrite is named: still read, no longer shown.
    convert.add_argument("--force", dest="overwrite", action="store_true", help=argparse.SUPPRESS)
    convert.set_defaults(func=cmd_convert)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchtsp")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


class _Parser(argparse.ArgumentParser):
    """Bad flags are one line, like every other error (argparse would print the whole usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _out_of_memory(e: BaseException) -> bool:
    """Whether the evidence is memory: an allocator's error, here or raised on a rank. A rank that died says
    only how it died (a SIGKILL may be the kernel's OOM killer or a kill from outside), so it is not evidence."""
    text = e.traceback if isinstance(e, RankFailedError) else str(e)
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "out of memory" in text \
        or "can't allocate memory" in text


# The module each command's ranks run: imported by the fork server the launcher starts first (``_start_ranks_early``).
RANK_MODULES = {"train": "torchtsp.train.trainer", "generate": "torchtsp.generate_job",
                "serve": "torchtsp.serve.worker", "bench": "torchtsp.bench.run"}


def _start_ranks_early(args: argparse.Namespace) -> None:
    """Start the fork server local ranks come from now, when the flags alone say that this command starts several
    (bench: unless --nproc 1): its imports then run beside the launcher's own instead of after them. Otherwise the
    launcher starts it when it starts ranks, if it does."""
    if args.command not in RANK_MODULES or launched_by_torchrun():
        return
    nproc = getattr(args, "nproc", None) or (4 if args.command == "bench" else 1)
    if nproc > 1 or any((getattr(args, axis, None) or 1) > 1 for axis in AXES):
        from .rank_server import start_rank_server

        start_rank_server([RANK_MODULES[args.command]])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _start_ranks_early(args)
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
            message = (f"out of memory: {message[:300]}; lower --batch-size or --seq-len, pass --recompute "
                       f"(selective or full), or spread the model over more ranks")
        print(f"torchtsp: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
