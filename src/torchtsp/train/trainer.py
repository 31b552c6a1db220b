"""The training loop every rank runs: a ``dp x (scheme)`` mesh, AdamW on local shards, checkpoints.

The mesh degrees, and whether the model and batch split over them, come from the scheme registry
(``torchtsp.schemes``) before any communication. ``parallelize`` applies data parallelism over the
scheme, so the loss is the global mean over all tokens, exactly as on one device. Every rank draws the
same global batch from the data stream (``torchtsp.train.data``), whose position is saved with each
checkpoint; gradient accumulation and evaluation are in ``torchtsp.train.accumulate``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .. import compiled
from ..data.tokenizers import RUN_TOKENIZER_DIR, HFTokenizer, copy_tokenizer_files
from ..distributed import comm
from ..distributed.comm import AxisComm, Traffic
from ..distributed.launch import stop_signals_handled
from ..distributed.mesh import default_device_type, init_mesh, mesh_device
from ..layout import Layout
from ..memory import live_bytes, measure_peak
from ..model import Transformer
from ..parallel.pipeline import parallelize_layout
from ..presets import get_preset
from ..schemes import AXES, PIPELINE_AXIS, get_scheme
from . import checkpoint
from .accumulate import evaluate, forward_backward
from .config import TrainConfig, is_new_run_folder, point_latest_run
from .data import TrainData
from .metrics import MetricsLog, NonFiniteBudget, ProfileWindow, finite_or_none, resident_bytes
from .optim import ReplicatedAdamW, warmup_cosine

try:
    import fcntl
except ImportError:  # not on Windows: run folders are not locked there
    fcntl = None

LOCK = ".lock"
DATA_POSITION = "train/data"  # the data stream's position in the checkpoint state


def model_config_and_weights(cfg: TrainConfig):
    """The model's config, and where its weights come from: a Hugging Face checkpoint read slice by slice, or
    (``None``) the seeded initial values."""
    if cfg.init_from_hf:
        from ..hf import open_hf_weights

        model_cfg, weights = open_hf_weights(cfg.init_from_hf)
    else:
        from .data import preset_vocab_size

        model_cfg, weights = get_preset(cfg.preset), None
        vocab = preset_vocab_size(cfg, model_cfg.vocab_size)
        if vocab != model_cfg.vocab_size:
            model_cfg = model_cfg.replace(vocab_size=vocab)
    if model_cfg.max_length is not None and cfg.seq_len > model_cfg.max_length:
        model_cfg = model_cfg.replace(max_seq_len=cfg.seq_len)  # RoPE tables do not read it (rope.check_params)
    return model_cfg, weights


def check_batch_split(cfg: TrainConfig, degrees: dict[str, int], moe: bool) -> None:
    """Refuse, before any rank starts, a --grad-accum that does not split each replica's rows, and loop options
    a pipeline cannot take."""
    dp = degrees.get("dp") or 1
    per_replica = cfg.batch_size // dp if cfg.batch_size % dp == 0 else None
    if cfg.grad_accum > 1 and (per_replica is None or per_replica % cfg.grad_accum):
        raise ValueError(f"--grad-accum {cfg.grad_accum} does not divide the batch per replica (--batch-size "
                         f"{cfg.batch_size} over dp={dp}); choose a batch size divisible by {dp * cfg.grad_accum}")
    if cfg.pp > 1 and cfg.eval_data:
        raise ValueError("--eval-data with --pp is not supported yet: a pipeline has no forward-only pass")
    if cfg.pp > 1 and cfg.grad_accum > 1 and moe:
        raise ValueError("--grad-accum with --pp on a mixture-of-experts model is not supported; raise "
                         "--microbatches instead")
    if cfg.tensorboard:
        from .metrics import tensorboard_available

        if not tensorboard_available():
            raise OSError("--tensorboard needs the tensorboard package: pip install 'torchtsp[tensorboard]'")


def build_optimizer(model, cfg: TrainConfig, dp: int, mesh=None):
    """The run's optimizer, one interface for all: FSDP2 over dp (``--zero 3``, train/fsdp.py, which shards the
    model over ``mesh``'s dp axis first), the distributed optimizer over dp (``--zero 1/2``, train/zero.py), or
    AdamW on whole local shards; float32 masters of bfloat16 weights in every one."""
    master_weights = cfg.dtype == "bfloat16"
    if cfg.zero_level(dp) == 3:
        from .fsdp import FSDPAdamW, shard_over_dp

        units = shard_over_dp(model, mesh["dp"], reshard_after_forward=cfg.reshard_after_forward,
                              bfloat16=master_weights, cpu_offload=cfg.cpu_offload)
        return FSDPAdamW(model, cfg.lr, cfg.weight_decay, units)
    if cfg.zero_level(dp):
        from .zero import ZeroOptimizer

        return ZeroOptimizer(model, cfg.zero_level(dp), cfg.lr, cfg.weight_decay, master_weights=master_weights,
                             bucket_mb=cfg.zero_bucket_mb)
    return ReplicatedAdamW(model, cfg.lr, cfg.weight_decay, master_weights=master_weights)


def resolve_train_layout(cfg: TrainConfig, model_cfg, world: int) -> Layout:
    """The run's layout through the one resolution every command uses (``Layout.resolve``): degrees, pipeline,
    options, model and batch against each other, and the loop's own splits (``check_batch_split``). The model
    sees one micro-batch of accumulation at a time. The launcher calls it before any rank starts; each rank again."""
    resolve = functools.partial(Layout.resolve, cfg.scheme, world, dp=cfg.dp, tsp=cfg.tsp, tp=cfg.tp, sp=cfg.sp,
                                pp=cfg.pp, microbatches=cfg.microbatches, schedule=cfg.schedule,
                                recompute=None if cfg.recompute == "none" else cfg.recompute, cfg=model_cfg,
                                seq_len=cfg.seq_len)
    check_batch_split(cfg, resolve(batch=cfg.batch_size).sizes, model_cfg.moe)
    return resolve(batch=cfg.batch_size // cfg.grad_accum)


def check_before_launch(cfg: TrainConfig, world: int | None) -> tuple[Layout, TrainData]:
    """Every refusal that needs no rank: the layout (``resolve_train_layout``), the model's shape against its data
    and the loop's options."""
    model_cfg, _ = model_config_and_weights(cfg)
    layout = resolve_train_layout(cfg, model_cfg, world)
    if cfg.compile:
        compiled.check_backend(default_device_type())
    return layout, TrainData(cfg, model_cfg.vocab_size, check=True)


def finished_resume_step(cfg: TrainConfig) -> int | None:
    """The step of the checkpoint ``--resume`` names when the run has nothing left to do (at or past ``--steps``),
    after the checks a resume makes of the model that need no rank (a different model shape is still an error,
    not "nothing to do"); None when there is training left, or without --resume."""
    if not cfg.resume:
        return None
    ckpt = checkpoint.resolve(cfg.resume)
    meta = checkpoint.read_meta(ckpt)
    done = meta.get("step")
    if done is None or done < cfg.steps:
        return None
    checkpoint.check_model_matches(meta, model_config_and_weights(cfg)[0], ckpt)
    return done


class Trainer:
    def __init__(self, cfg: TrainConfig, data_checked: bool = False):
        """``data_checked``: the launcher has already run ``check_before_launch`` (ranks skip the scans)."""
        self.cfg = cfg
        self.model_cfg, weights = model_config_and_weights(cfg)
        # Pipeline stages wrap the scheme from outside: the scheme's degrees split one stage's ranks. Every check,
        # before any communication.
        self.layout = resolve_train_layout(cfg, self.model_cfg, comm.world_size())
        self.degrees = self.layout.sizes
        self.data = TrainData(cfg, self.model_cfg.vocab_size, check=not data_checked)  # before any communication
        if not data_checked and os.environ.get("RANK", "0") == "0":  # under torchrun no launcher said them
            for notice in self.data.notices:
                print(f"torchtsp: {notice}", file=sys.stderr)
        self.mesh = init_mesh(self.layout, timeout_s=cfg.timeout_s)  # creates the process group
        self.rank = comm.global_rank()
        self.device = mesh_device(self.mesh)  # the model and every batch live there
        compiled.enable(cfg.compile, self.device.type)  # before the model: a dp block is compiled as it is built

        torch.manual_seed(cfg.seed)
        # Built on the meta device: each rank materialises only its own shards (of the seeded initial values, or
        # read from the checkpoint), never the whole model.
        # A layout with pp > 1 gives pipeline stages, each a model of the scheme.
        model = Transformer(self.model_cfg, device="meta")
        self.model = parallelize_layout(model, self.mesh, self.layout, timeout_s=cfg.timeout_s, weights=weights)
        self.comms = self.model.comms()

        self.optimizer = build_optimizer(self.model, cfg, self.degrees.get("dp", 1), self.mesh)
        self.model.sum_gradients_with(self.optimizer.grad_sum)  # its reduce-scatter, or the model's all-reduce
        self.out = Path(cfg.out)
        self.start_step = 0
        self.stop_requested = False

    # -- one step -----------------------------------------------------------

    def train_step(self, step: int) -> tuple[float, float]:
        # Document ids stay on the host, where the kernels read which blocks each document keeps.
        tokens, labels, document_ids = self.data.next_train_batch(self.device)
        self.weights_ready()
        # The global batch: the model takes its replica's rows; gradients are summed over dp replicas (and a
        # pipeline's microbatches, and the micro-batches of accumulation) by the time it returns.
        loss = forward_backward(self.model, tokens, labels, self.cfg.grad_accum, document_ids=document_ids)
        self.optimizer.reduce()
        norm = self.optimizer.clip(self.cfg.grad_clip)
        global_loss = loss.item()  # already the mean over every token of every replica
        if not (math.isfinite(global_loss) and math.isfinite(norm)):  # never let a non-finite step reach the weights
            self.optimizer.discard()
            return global_loss, norm
        self.optimizer.step(self.cfg.lr * warmup_cosine(step, self.cfg.steps, self.cfg.warmup, self.cfg.min_lr_ratio))
        return global_loss, norm

    def weights_ready(self) -> None:
        """Before anything reads a weight: the distributed optimizer's all-gathers of updated weights are done."""
        self.optimizer.wait_for_weights()

    def state_bytes(self) -> dict[str, int]:
        """This rank's live bytes of parameters, gradients (as measured in the step) and optimizer state (AdamW
        moments plus fp32 masters)."""
        return {"param_bytes": live_bytes(self.model.parameters()), **self.optimizer.bytes()}

    def eval_loss(self) -> float:
        """Mean NLL over the eval batches, forward only on the parallel model (no weights gathered)."""
        self.weights_ready()
        return evaluate(self.model, self.data.eval_stream(self.device), self.cfg.grad_accum)

    # -- checkpoints --------------------------------------------------------

    def state(self, step: int) -> dict:
        # A pipeline stage's tensors are DTensors over its own ranks (the mesh without pp): stages hold
        # different reference names, so a checkpoint looks the same whatever the split.
        mesh = self.mesh[AXES]  # the whole mesh when it has no pp axis
        # A distributed optimizer gathers the full local shards of masters and moments, for this save or load only.
        self._optimizer_view = named, optimizer = self.optimizer.state_dict()
        state = checkpoint.training_state(self.model, optimizer, named, mesh, step)
        # The data position is global (every rank draws the same batches): it restores under any mesh.
        state[DATA_POSITION] = self.data.train.position()
        return state

    def save(self, step: int) -> Path:
        state = self.state(step)
        # Skipped steps keep non-finite values out of the weights; this check makes sure no checkpoint holds any.
        local = [t.to_local() if hasattr(t, "to_local") else t for t in state.values() if isinstance(t, torch.Tensor)]
        bad = torch.stack([~torch.isfinite(t).all() for t in local if t.is_floating_point()]).any().float()
        if AxisComm.world(self.cfg.timeout_s).all_reduce(bad, label="finite").item() > 0:
            raise ValueError(f"step {step}: the weights or optimizer state hold non-finite values; "
                             f"refusing to publish them as a checkpoint")
        meta = {"model": self.model_cfg.to_dict(), "step": step, "scheme": self.cfg.scheme,
                "mesh": self.mesh_degrees, "train": self.cfg.to_dict(), "data_position": state[DATA_POSITION],
                "tokenizer": self.data.tokenizer.fingerprint}
        self._optimizer_view = None  # the full moments gathered for this save
        return checkpoint.save(self.out, state, meta, keep_last=self.cfg.keep_last)

    def resume(self, path: str) -> None:
        ckpt = checkpoint.resolve(path)
        meta = checkpoint.read_meta(ckpt)
        checkpoint.check_model_matches(meta, self.model_cfg, ckpt)
        checkpoint.check_tokenizer_matches(meta, self.data.tokenizer, ckpt)
        checkpoint.verify(ckpt, meta, AxisComm.world(self.cfg.timeout_s), self.device)
        state = self.state(0)
        if "data_position" not in meta:
            # Written before the data position was saved: batches were drawn at random per step, so no position
            # reproduces them; continue at the samples a step count implies.
            del state[DATA_POSITION]
        checkpoint.load(ckpt, state)
        self.optimizer.load_state_dict(self._optimizer_view, state)
        self._optimizer_view = None
        self.start_step = state["train/step"]
        self.data.train.set_position(state.get(DATA_POSITION) or {"drawn": [self.start_step * self.cfg.batch_size]},
                                     reset=self.cfg.reset_data)

    # -- the run folder -----------------------------------------------------

    def _claim_run_folder(self):
        """Rank 0: lock ``out`` for this run (released when the process ends, however it ends) and refuse to
        mix this run with another one already in it. Returns the open lock file."""
        self.out.mkdir(parents=True, exist_ok=True)
        lock = open(self.out / LOCK, "a+")  # noqa: SIM115 - held open for the whole run
        if fcntl is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                lock.seek(0)
                holder = lock.read().strip() or "?"
                lock.close()
                raise ValueError(f"run folder {self.out} is in use by another run (pid {holder}); wait for it to "
                                 f"end or choose another --out") from None
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()
        try:
            contents = sorted(p.name for p in self.out.iterdir() if p.name != LOCK)
            here = self.cfg.resume and checkpoint.resolve(self.cfg.resume).resolve().is_relative_to(self.out.resolve())
            if contents and not here:
                if not self.cfg.overwrite:
                    raise ValueError(f"--out {self.out} already holds a run ({', '.join(contents[:4])}); pass "
                                     f"--resume {self.out} to continue it, --overwrite to replace it, or choose "
                                     f"another --out")
                (self.out / "metrics.jsonl").unlink(missing_ok=True)
                for folder in ("checkpoints", "tensorboard", "profile", RUN_TOKENIZER_DIR):
                    shutil.rmtree(self.out / folder, ignore_errors=True)
        except BaseException:
            lock.close()
            raise
        if is_new_run_folder(self.out) and (problem := point_latest_run(self.out)):
            print(f"torchtsp: {problem}", file=sys.stderr)
        return lock

    def _claim_or_refuse(self, world: AxisComm):
        """(lock, refused): rank 0 claims the run folder; every rank learns whether it could, and only rank 0
        raises, with the reason."""
        lock, problem = None, None
        if self.rank == 0:
            try:
                lock = self._claim_run_folder()
            except (ValueError, OSError) as e:
                problem = e
        refused = world.all_reduce(torch.tensor(float(problem is not None), device=self.device), label="out").item()
        if problem is not None:
            raise problem
        return lock, refused > 0

    # -- the loop -----------------------------------------------------------

    def _request_stop(self, signum, frame):
        if self.rank == 0 and not self.stop_requested:
            tqdm.write("torchtsp: stopping after this step and saving a checkpoint", file=sys.stderr)
        self.stop_requested = self.stop_requested or signum

    def _stop_agreed(self, world: AxisComm) -> bool:
        """Whether any rank was asked to stop: every rank leaves the loop at the same step boundary."""
        flag = torch.tensor(float(bool(self.stop_requested)), device=self.device)
        return world.all_reduce(flag, label="stop").item() > 0

    def _timed_step(self, step: int, world: AxisComm, measure: bool, count_state: bool = False) -> dict:
        """Run step ``step`` (0-based); its metrics record (1-based step). ``measure``: the live-tensor peak of the
        step; with it, or with ``count_state``, the live bytes of parameters, gradients and optimizer state."""
        start = time.perf_counter()
        count_state = count_state or measure
        self.optimizer.measuring = count_state  # the gradients' live bytes at their fullest
        with Traffic(self.comms) as traffic:
            if measure:  # live-tensor peak of a whole step
                (loss, norm), local_peak = measure_peak(functools.partial(self.train_step, step), self.model,
                                                        *self.optimizer.tracked)
            else:
                loss, norm, local_peak = *self.train_step(step), 0
        self.optimizer.measuring = False
        if count_state:  # each the maximum over ranks
            mine = [float(local_peak), *map(float, self.state_bytes().values())]
            step_peak, *state_bytes = world.all_gather(torch.tensor(mine, device=self.device)).amax(0).tolist()
        elapsed = time.perf_counter() - start
        record = {"step": step + 1, "loss": finite_or_none(loss), "grad_norm": finite_or_none(norm),
                  "lr": self.optimizer.param_groups[0]["lr"], "step_time_s": elapsed,
                  "tokens_per_s": self.cfg.batch_size * self.cfg.seq_len / elapsed,
                  "bytes_recv_rank0": traffic.recv, "epoch": self.data.train.epoch, **self.model.router_metrics()}
        if measure:
            record["peak_mem_bytes"] = step_peak
        if count_state:
            record.update(zip(("param_bytes", "grad_bytes", "optimizer_bytes"), map(int, state_bytes)))
        rss = resident_bytes()
        if rss is not None:
            record["rss_bytes"] = rss  # this rank's resident memory: flat however large the dataset
        if not (math.isfinite(loss) and math.isfinite(norm)):
            record["skipped"] = "non-finite"
        return {**record, "_loss": loss, "_norm": norm}

    def _evaluate_into(self, record: dict) -> None:
        loss = self.eval_loss()
        record["eval_loss"] = finite_or_none(loss)
        record["eval_ppl"] = finite_or_none(math.exp(loss)) if loss < 700 else None
        if self.rank == 0:
            ppl = f"{math.exp(loss):.2f}" if loss < 700 else "inf"
            tqdm.write(f"torchtsp: step {record['step']}: eval loss {loss:.4f}, perplexity {ppl}", file=sys.stderr)

    def run(self) -> dict:
        cfg = self.cfg
        world = AxisComm.world(cfg.timeout_s)
        lock, refused = self._claim_or_refuse(world)
        if refused:
            return {"status": "aborted", "out": str(self.out)}
        if self.rank == 0 and isinstance(self.data.tokenizer, HFTokenizer):
            # The run keeps its tokenizer: convert and generate --checkpoint find it there.
            copy_tokenizer_files(self.data.tokenizer.folder, self.out / RUN_TOKENIZER_DIR)
        log, bar = None, None
        losses, times, peak, status, eval_loss = [], [], None, "done", None
        profile = ProfileWindow(cfg.profile_steps, self.out, self.rank)
        try:
            with stop_signals_handled(self._request_stop):
                if cfg.resume:
                    self.resume(cfg.resume)
                if self.rank == 0:
                    log = MetricsLog(self.out, self.start_step if cfg.resume else None, cfg.tensorboard)
                bar = tqdm(total=cfg.steps, initial=self.start_step, desc=f"train {cfg.scheme}", unit="step",
                           dynamic_ncols=True, disable=self.rank != 0)
                budget = NonFiniteBudget(cfg.skip_nonfinite, announce=self.rank == 0)
                step = saved = self.start_step
                measured_with_state = False
                while True:
                    stop = self._stop_agreed(world)
                    if stop or step >= cfg.steps:
                        break
                    has_state = step > self.start_step or cfg.steps - step == 1  # optimizer state (or last step)
                    # The first step's peak too: it can be the run's highest (a first backward, moments made).
                    measure = step == self.start_step or has_state and (
                        not measured_with_state or (cfg.mem_every and (step + 1) % cfg.mem_every == 0))
                    measured_with_state = measured_with_state or (measure and has_state)
                    profile.before(step + 1)
                    record = self._timed_step(step, world, measure, count_state=step == self.start_step)
                    profile.after(step + 1)
                    loss, norm = record.pop("_loss"), record.pop("_norm")
                    step += 1
                    losses.append(loss)
                    times.append(record["step_time_s"])
                    peak = max(peak or 0, record.get("peak_mem_bytes", 0)) or None
                    if self.data.eval is not None and ((cfg.eval_every and step % cfg.eval_every == 0)
                                                       or step == cfg.steps):
                        self._evaluate_into(record)
                        eval_loss = record["eval_loss"]
                    if log:
                        log.write(record)
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                                    epoch=f"{record['epoch']:.2f}", mem=f"{peak / 2**20:.1f}MiB" if peak else "-",
                                    **({"eval": f"{eval_loss:.3f}"} if eval_loss is not None else {}))
                    if "skipped" in record:
                        budget.charge(step, loss, norm)
                    if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps:
                        self.save(step)
                        saved = step
                if stop:
                    status = "interrupted"
                    where = self.save(step) if step != saved else None
                    if self.rank == 0:
                        what = f"checkpoint saved to {where}" if where else "no new step to save"
                        tqdm.write(f"torchtsp: interrupted at step {step}; {what}", file=sys.stderr)
        finally:
            profile.finish()
            if bar is not None:
                bar.close()
            if log:
                log.close()
            if lock is not None:
                lock.close()
        summary = self.summary(losses, times, peak, status)
        summary["eval_loss"] = eval_loss
        summary["signal"] = int(self.stop_requested) if status == "interrupted" else None
        if status == "done" and cfg.sample_tokens:
            summary["sample"] = self.sample()
        return summary

    def summary(self, losses, times, peak, status) -> dict:
        steady = sorted(times[1:] or times)
        median = steady[len(steady) // 2] if steady else float("nan")
        return {"status": status, "steps_run": len(losses), "last_step": self.start_step + len(losses),
                "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
                "losses": losses, "median_step_s": median,
                "tokens_per_s": self.cfg.batch_size * self.cfg.seq_len / median if steady else None,
                "peak_mem_bytes": peak, "scheme": self.cfg.scheme, "mesh": self.mesh_degrees, "out": str(self.out),
                "epoch": self.data.train.epoch}

    @property
    def mesh_degrees(self) -> dict[str, int]:
        """Every mesh degree, pp first when there is a pipeline."""
        return dict(sorted(self.layout.mesh_degrees().items(), key=lambda axis: axis[0] != PIPELINE_AXIS))

    def sample(self) -> str | None:
        """A continuation of the prompt by the parallel model itself (``torchtsp.infer.generate``: seeded sampling,
        temperature 0.8, top-k 40), in the model's tokenizer; the weights are never gathered. Every replica of a
        dp run generates the same tokens on its own model axis."""
        from ..infer import generate
        from ..parallel.dp import DataParallel

        self.weights_ready()
        # Generation is not what --compile compiles: its shapes change every token (each would compile anew).
        compiled.enable(False)
        model = self.model
        if model.joint_forward_backward:
            return None  # generate runs a scheme's model on one stage's ranks, not pipeline stages
        if isinstance(model, DataParallel) and not get_scheme(model.scheme).rows_over_dp:
            model = model.module  # the replicas hold the same weights: each samples alone
        if get_scheme(model.scheme).inference is None:
            return None  # generate does not run this scheme (its registry entry names no inference engine)
        tokenizer = self.data.tokenizer
        eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        prompt = tokenizer.encode(self.cfg.prompt) or eos
        if not prompt:
            return None
        # FSDP2 (--zero 3) gathers its shards for the engine, which reads the weights outside a forward.
        whole = getattr(self.optimizer, "whole_weights", contextlib.nullcontext)
        with torch.no_grad(), whole():
            result = generate(model.eval(), [prompt], self.cfg.sample_tokens, temperature=0.8, top_k=40,
                              seed=self.cfg.seed, stop_token_ids=eos)
        model.train()
        return tokenizer.decode(result.new_tokens[0])

def run_training(cfg: TrainConfig, data_checked: bool = False) -> dict:
    """Entry point on every rank (spawned locally or launched by torchrun); ``data_checked``: the launcher ran
    ``check_before_launch``."""
    return Trainer(cfg, data_checked=data_checked).run()


def format_summary(summary: dict) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in summary["mesh"].items() if v > 1) or "1 rank"
    peak = summary["peak_mem_bytes"]
    rows = [
        ("scheme / mesh", f"{summary['scheme']} / {mesh}"),
        ("steps", f"{summary['steps_run']} run, at step {summary['last_step']} ({summary['status']})"),
        ("loss", f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}" if summary["losses"] else "-"),
        ("eval loss", f"{summary['eval_loss']:.4f} (perplexity {math.exp(min(summary['eval_loss'], 700)):.2f})"
         if summary.get("eval_loss") is not None else "-"),
        ("epochs", f"{summary['epoch']:.3f}" if summary.get("epoch") is not None else "-"),
        ("median step", f"{summary['median_step_s'] * 1000:.0f} ms" if summary["steps_run"] else "-"),
        ("tokens/s", f"{summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else "-"),
        ("peak live memory / rank", f"{peak / 2**20:.1f} MiB" if peak else "-"),
        ("output", summary["out"]),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"  {k:<{width}}  {v}" for k, v in rows]
    if summary.get("sample") is not None:
        lines.append(f"  {'sample':<{width}}  {summary['sample']!r}")
    return "\n".join(["summary", *lines])
