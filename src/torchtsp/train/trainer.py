"""The training loop every rank runs: a ``dp x (scheme)`` mesh, AdamW on local shards, checkpoints.

The mesh degrees, and whether the model and batch split over them, come from the scheme registry
(``torchtsp.schemes``) before any communication. ``parallelize`` applies data parallelism over the
scheme, so the loss is the global mean over all tokens, exactly as on one device.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import get_preset
from ..distributed import comm
from ..distributed.comm import AxisComm, Traffic
from ..distributed.mesh import init_mesh, mesh_device
from ..layout import Layout
from ..memory import measure_peak
from ..model import Transformer
from ..parallel import parallelize, pipeline_parallelize
from ..schemes import AXES, PIPELINE_AXIS, get_scheme
from . import checkpoint
from .config import TrainConfig
from .data import ByteTokenizer, TokenWindows, load_corpus
from .optim import MasterWeights, build_adamw, global_grad_norm, warmup_cosine

try:
    import fcntl
except ImportError:  # not on Windows: run folders are not locked there
    fcntl = None

LOCK = ".lock"


def _finite_or_none(value: float) -> float | None:
    """JSON has no NaN or infinity: metrics.jsonl writes them as null."""
    return value if math.isfinite(value) else None



def model_config_and_weights(cfg: TrainConfig):
    """The model's config, and where its weights come from: a Hugging Face checkpoint read slice by slice, or
    (``None``) the seeded initial values."""
    if cfg.init_from_hf:
        from ..hf import open_hf_weights

        model_cfg, weights = open_hf_weights(cfg.init_from_hf)
    else:
        model_cfg, weights = get_preset(cfg.preset), None
    if cfg.seq_len > model_cfg.max_seq_len:
        model_cfg = model_cfg.replace(max_seq_len=cfg.seq_len)
    if model_cfg.vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(f"the model's vocab_size={model_cfg.vocab_size} is smaller than the byte tokenizer's "
                         f"{ByteTokenizer.vocab_size}")
    return model_cfg, weights


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.model_cfg, weights = model_config_and_weights(cfg)
        # Pipeline stages wrap the scheme from outside: the scheme's degrees split one stage's ranks. Every
        # check of degrees, model and batch against each other, before any communication.
        self.layout = Layout.resolve(cfg.scheme, comm.world_size(), dp=cfg.dp, tsp=cfg.tsp, tp=cfg.tp, sp=cfg.sp,
                                     pp=cfg.pp, microbatches=cfg.microbatches, schedule=cfg.schedule,
                                     recompute=cfg.recompute or None, cfg=self.model_cfg, batch=cfg.batch_size,
                                     seq_len=cfg.seq_len)
        self.pp, self.degrees, self.microbatches = self.layout.pp, self.layout.sizes, self.layout.microbatches
        self.mesh = init_mesh(self.layout, timeout_s=cfg.timeout_s)  # creates the process group
        self.rank = comm.global_rank()
        self.device = mesh_device(self.mesh)  # the model and every batch live there

        torch.manual_seed(cfg.seed)
        # Built on the meta device: each rank materialises only its own shards (of the seeded initial values, or
        # read from the checkpoint), never the whole model.
        model = Transformer(self.model_cfg, device="meta")
        if self.pp > 1:
            self.model = pipeline_parallelize(model, self.mesh, microbatches=self.microbatches, schedule=cfg.schedule,
                                              recompute=cfg.recompute, timeout_s=cfg.timeout_s, weights=weights)
        else:
            self.model = parallelize(model, self.mesh, self.layout, timeout_s=cfg.timeout_s, weights=weights)
        self.comms = self.model.comms()

        params = dict(self.model.named_parameters())
        self.master = MasterWeights(list(params.values())) if cfg.dtype == "bfloat16" else None
        trained = self.master.masters if self.master else list(params.values())
        self.named_trained = list(zip(params, trained))
        refs = {name: [ref for ref, *_ in self.model.reference_parts(name, p)] for name, p in params.items()}
        self.optimizer = build_adamw(((refs[n], p) for n, p in self.named_trained), cfg.lr, cfg.weight_decay)
        self.windows = TokenWindows(load_corpus(cfg.data), cfg.batch_size, cfg.seq_len, cfg.seed)
        self.out = Path(cfg.out)
        self.start_step = 0
        self.stop_requested = False

    # -- one step -----------------------------------------------------------

    def train_step(self, step: int) -> tuple[float, float]:
        tokens, labels = (t.to(self.device) for t in self.windows.inputs_and_labels(step))
        # The global batch: the model takes its replica's rows; gradients are summed over dp replicas (and a
        # pipeline's microbatches) by the time it returns.
        loss = self.model.forward_backward(tokens, labels)
        if self.master:
            self.master.grads_to_masters()
        norm = self.clip_gradients()
        global_loss = loss.item()  # already the mean over every token of every replica
        if not (math.isfinite(global_loss) and math.isfinite(norm)):  # never let a non-finite step reach the weights
            self.optimizer.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)
            return global_loss, norm
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * warmup_cosine(step, self.cfg.steps, self.cfg.warmup, self.cfg.min_lr_ratio)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        if self.master:
            self.master.masters_to_params()
        return global_loss, norm

    def clip_gradients(self) -> float:
        pieces = ((piece, dims) for name, p in self.named_trained
                  for _, piece, dims in self.model.reference_parts(name, p.grad))
        norm = global_grad_norm(pieces, self.comms)
        if self.pp > 1:  # each stage's norm covers its own parameters: sum the squares over stages
            norm = self.comms[PIPELINE_AXIS].all_reduce(norm.pow(2), label="grad_norm").sqrt()
        if self.cfg.grad_clip > 0:
            scale = torch.clamp(self.cfg.grad_clip / (norm + 1e-6), max=1.0)
            for _, p in self.named_trained:
                p.grad.mul_(scale)
        return norm.item()

    # -- checkpoints --------------------------------------------------------

    def state(self, step: int) -> dict:
        # A pipeline stage's tensors are DTensors over its own ranks (the mesh without pp): stages hold
        # different reference names, so a checkpoint looks the same whatever the split.
        mesh = self.mesh[AXES] if self.pp > 1 else self.mesh
        return checkpoint.training_state(self.model, self.optimizer, self.named_trained, mesh, step)

    def save(self, step: int) -> Path:
        state = self.state(step)
        # Skipped steps keep non-finite values out of the weights; this check makes sure no checkpoint holds any.
        local = [t.to_local() if hasattr(t, "to_local") else t for t in state.values() if isinstance(t, torch.Tensor)]
        bad = torch.stack([~torch.isfinite(t).all() for t in local if t.is_floating_point()]).any().float()
        if AxisComm.world(self.cfg.timeout_s).all_reduce(bad, label="finite").item() > 0:
            raise ValueError(f"step {step}: the weights or optimizer state hold non-finite values; "
                             f"refusing to publish them as a checkpoint")
        meta = {"model": self.model_cfg.to_dict(), "step": step, "scheme": self.cfg.scheme,
                "mesh": self.mesh_degrees, "train": self.cfg.to_dict()}
        return checkpoint.save(self.out, state, meta, keep_last=self.cfg.keep_last)

    def resume(self, path: str) -> None:
        ckpt = checkpoint.resolve(path)
        meta = checkpoint.read_meta(ckpt)
        checkpoint.check_model_matches(meta, self.model_cfg, ckpt)
        checkpoint.verify(ckpt, meta, AxisComm.world(self.cfg.timeout_s), self.device)
        state = self.state(0)
        checkpoint.load(ckpt, state)
        checkpoint.restore_optimizer_steps(self.optimizer, state)
        if self.master:
            self.master.masters_to_params()
        self.start_step = state["train/step"]

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
                shutil.rmtree(self.out / "checkpoints", ignore_errors=True)
        except BaseException:
            lock.close()
            raise
        return lock

    def _open_metrics(self):
        """metrics.jsonl: a fresh run starts it anew; a resumed run keeps the steps up to its checkpoint.

        The checkpoint is the truth: lines past its step are cut, and damaged lines (a crash mid-write) dropped.
        """
        path = self.out / "metrics.jsonl"
        kept, damaged = [], 0
        if self.cfg.resume and path.exists():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                    if record["step"] <= self.start_step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    damaged += bool(line.strip())
        if damaged:
            tqdm.write(f"torchtsp: dropped {damaged} damaged line(s) of {path}", file=sys.stderr)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
        return path.open("a")

    # -- the loop -----------------------------------------------------------

    def _request_stop(self, signum, frame):
        if self.rank == 0 and not self.stop_requested:
            tqdm.write("torchtsp: stopping after this step and saving a checkpoint", file=sys.stderr)
        self.stop_requested = self.stop_requested or signum

    def run(self) -> dict:
        cfg = self.cfg
        world = AxisComm.world(cfg.timeout_s)
        lock, problem = None, None
        if self.rank == 0:
            try:
                lock = self._claim_run_folder()
            except (ValueError, OSError) as e:
                problem = e
        # Every rank learns whether rank 0 could take the folder; only rank 0 raises, with the reason.
        refused = world.all_reduce(torch.tensor(float(problem is not None), device=self.device), label="out").item()
        if problem is not None:
            raise problem
        if refused:
            return {"status": "aborted", "out": str(self.out)}
        handlers = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        log, bar = None, None
        losses, times, peak, status = [], [], None, "done"
        try:
            if cfg.resume:
                self.resume(cfg.resume)
            log = self._open_metrics() if self.rank == 0 else None
            bar = tqdm(total=cfg.steps, initial=self.start_step, desc=f"train {cfg.scheme}", unit="step",
                       dynamic_ncols=True, disable=self.rank != 0)
            tokens_per_step = cfg.batch_size * cfg.seq_len
            step = saved = self.start_step
            skipped = 0
            while True:
                flag = torch.tensor(float(bool(self.stop_requested)), device=self.device)
                stop = world.all_reduce(flag, label="stop").item() > 0
                if stop or step >= cfg.steps:
                    break
                has_state = step > self.start_step or cfg.steps - step == 1  # optimizer state exists (or last step)
                measure = has_state and (peak is None or (cfg.mem_every and (step + 1) % cfg.mem_every == 0))
                start = time.perf_counter()
                with Traffic(self.comms) as traffic:
                    if measure:  # live-tensor peak of a whole step once optimizer state exists
                        (loss, norm), local_peak = measure_peak(functools.partial(self.train_step, step), self.model,
                                                                self.optimizer)
                        step_peak = world.all_gather(torch.tensor(float(local_peak), device=self.device)).max().item()
                        peak = max(peak or 0, step_peak)
                    else:
                        loss, norm = self.train_step(step)
                elapsed = time.perf_counter() - start
                step += 1
                losses.append(loss)
                times.append(elapsed)
                finite = math.isfinite(loss) and math.isfinite(norm)
                record = {"step": step, "loss": _finite_or_none(loss), "grad_norm": _finite_or_none(norm),
                          "lr": self.optimizer.param_groups[0]["lr"], "step_time_s": elapsed,
                          "tokens_per_s": tokens_per_step / elapsed,
                          "bytes_recv_rank0": traffic.recv, **self.model.router_metrics()}
                if measure:
                    record["peak_mem_bytes"] = step_peak
                if not finite:
                    record["skipped"] = "non-finite"
                if log:
                    try:
                        log.write(json.dumps(record) + "\n")
                        log.flush()
                    except OSError as e:
                        raise checkpoint.disk_error(e, self.out) from None
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / elapsed:,.0f}",
                                mem=f"{peak / 2**20:.1f}MiB" if peak else "-")
                if not finite:
                    skipped += 1
                    if skipped > cfg.skip_nonfinite:
                        budget = f"{skipped - 1} skipped already, --skip-nonfinite {cfg.skip_nonfinite}" \
                            if cfg.skip_nonfinite else "pass --skip-nonfinite N to skip up to N such steps"
                        raise ValueError(f"step {step}: non-finite loss ({loss}) or gradient norm ({norm}); the step "
                                         f"was not applied and no checkpoint was written; lower --lr ({budget})")
                    if self.rank == 0:
                        tqdm.write(f"torchtsp: step {step} skipped: non-finite loss ({loss}) or gradient norm "
                                   f"({norm}); {skipped}/{cfg.skip_nonfinite} of the budget used", file=sys.stderr)
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
            if bar is not None:
                bar.close()
            if log:
                log.close()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            if lock is not None:
                lock.close()
        summary = self.summary(losses, times, peak, status)
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
                "peak_mem_bytes": peak, "scheme": self.cfg.scheme, "mesh": self.mesh_degrees, "out": str(self.out)}

    @property
    def mesh_degrees(self) -> dict[str, int]:
        """Every mesh degree, pp first when there is a pipeline."""
        return {PIPELINE_AXIS: self.pp, **self.degrees} if self.pp > 1 else dict(self.degrees)

    def sample(self) -> str | None:
        """A continuation of the prompt by the parallel model itself (``torchtsp.infer.generate``: seeded sampling,
        temperature 0.8, top-k 40); the weights are never gathered. Every replica of a dp run generates the same
        tokens on its own model axis."""
        from ..infer import generate
        from ..parallel.dp import DataParallel

        model = self.model
        if self.pp > 1:
            return None  # generate runs a scheme's model on one stage's ranks, not pipeline stages
        if isinstance(model, DataParallel) and model.scheme != "dp":
            model = model.module  # the replicas hold the same weights: each samples alone
        if get_scheme(model.scheme).inference is None:
            return None  # generate does not run this scheme (tp_sp, torch_tp)
        tokenizer = ByteTokenizer()
        prompt = tokenizer.encode(self.cfg.prompt) or [tokenizer.eot_id]
        with torch.no_grad():
            result = generate(model.eval(), [prompt], self.cfg.sample_tokens, temperature=0.8, top_k=40,
                              seed=self.cfg.seed, stop_token_ids=[tokenizer.eot_id])
        model.train()
        return tokenizer.decode(result.new_tokens[0])


def run_training(cfg: TrainConfig) -> dict:
    """Entry point on every rank (spawned locally or launched by torchrun)."""
    return Trainer(cfg).run()


def format_summary(summary: dict) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in summary["mesh"].items() if v > 1) or "1 rank"
    peak = summary["peak_mem_bytes"]
    rows = [
        ("scheme / mesh", f"{summary['scheme']} / {mesh}"),
        ("steps", f"{summary['steps_run']} run, at step {summary['last_step']} ({summary['status']})"),
        ("loss", f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}" if summary["losses"] else "-"),
        ("median step", f"{summary['median_step_s'] * 1000:.0f} ms"),
        ("tokens/s", f"{summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else "-"),
        ("peak live memory / rank", f"{peak / 2**20:.1f} MiB" if peak else "-"),
        ("output", summary["out"]),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"  {k:<{width}}  {v}" for k, v in rows]
    if summary.get("sample") is not None:
        lines.append(f"  {'sample':<{width}}  {summary['sample']!r}")
    return "\n".join(["summary", *lines])
