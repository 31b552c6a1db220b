"""The training loop every rank runs: a ``dp x (scheme)`` mesh, AdamW on local shards, checkpoints.

The mesh degrees, and whether the model and batch split over them, come from the scheme registry
(``torchtsp.schemes``) before any communication. ``parallelize`` applies data parallelism over the
scheme, so the loss is the global mean over all tokens, exactly as on one device.
"""

from __future__ import annotations

import functools
import json
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
from ..memory import measure_peak
from ..model import Transformer
from ..parallel import parallelize
from ..schemes import get_scheme
from . import checkpoint
from .config import TrainConfig
from .data import ByteTokenizer, TokenWindows, load_corpus
from .optim import MasterWeights, build_adamw, global_grad_norm, warmup_cosine


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
        scheme = get_scheme(cfg.scheme)
        self.degrees = scheme.degrees(comm.world_size(), dp=cfg.dp, tsp=cfg.tsp, tp=cfg.tp, sp=cfg.sp)
        self.model_cfg, weights = model_config_and_weights(cfg)
        scheme.validate(self.model_cfg, cfg.batch_size, cfg.seq_len, self.degrees)  # before any communication
        self.mesh = init_mesh(**self.degrees, timeout_s=cfg.timeout_s)  # creates the process group if needed
        self.rank = comm.global_rank()
        self.device = mesh_device(self.mesh)  # the model and every batch live there

        torch.manual_seed(cfg.seed)
        # Built on the meta device: each rank materialises only its own shards (of the seeded initial values, or
        # read from the checkpoint), never the whole model.
        model = Transformer(self.model_cfg, device="meta")
        self.model = parallelize(model, self.mesh, cfg.scheme, timeout_s=cfg.timeout_s,
                                 recompute=cfg.recompute or None, weights=weights)
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
        loss = self.model.loss(tokens, labels)  # the global batch: the model takes its replica's rows
        loss.backward()  # gradients are summed over dp replicas as backward produces them
        if self.master:
            self.master.grads_to_masters()
        norm = self.clip_gradients()
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * warmup_cosine(step, self.cfg.steps, self.cfg.warmup, self.cfg.min_lr_ratio)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        if self.master:
            self.master.masters_to_params()
        return loss.item(), norm

    def clip_gradients(self) -> float:
        pieces = ((piece, dims) for name, p in self.named_trained
                  for _, piece, dims in self.model.reference_parts(name, p.grad))
        norm = global_grad_norm(pieces, self.comms)
        if self.cfg.grad_clip > 0:
            scale = torch.clamp(self.cfg.grad_clip / (norm + 1e-6), max=1.0)
            for _, p in self.named_trained:
                p.grad.mul_(scale)
        return norm.item()

    # -- checkpoints --------------------------------------------------------

    def state(self, step: int) -> dict:
        return checkpoint.training_state(self.model, self.optimizer, self.named_trained, self.mesh, step)

    def save(self, step: int) -> Path:
        meta = {"model": self.model_cfg.to_dict(), "step": step, "scheme": self.cfg.scheme,
                "mesh": self.degrees, "train": self.cfg.to_dict()}
        return checkpoint.save(self.out, self.state(step), meta)

    def resume(self, path: str) -> None:
        ckpt = checkpoint.resolve(path)
        checkpoint.check_model_matches(checkpoint.read_meta(ckpt), self.model_cfg, ckpt)
        state = self.state(0)
        checkpoint.load(ckpt, state)
        checkpoint.restore_optimizer_steps(self.optimizer, state)
        if self.master:
            self.master.masters_to_params()
        self.start_step = state["train/step"]

    # -- the loop -----------------------------------------------------------

    def _request_stop(self, signum, frame):
        if self.rank == 0 and not self.stop_requested:
            tqdm.write("torchtsp: stopping after this step and saving a checkpoint", file=sys.stderr)
        self.stop_requested = True

    def _open_metrics(self):
        """metrics.jsonl: a fresh run starts it anew; a resumed run keeps the steps up to its checkpoint."""
        path = self.out / "metrics.jsonl"
        kept = []
        if self.cfg.resume and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= self.start_step]
        path.write_text("".join(line + "\n" for line in kept))
        return path.open("a")

    def run(self) -> dict:
        cfg = self.cfg
        if cfg.resume:
            self.resume(cfg.resume)
        self.out.mkdir(parents=True, exist_ok=True)
        handlers = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        world = AxisComm.world(cfg.timeout_s)
        log = self._open_metrics() if self.rank == 0 else None
        bar = tqdm(total=cfg.steps, initial=self.start_step, desc=f"train {cfg.scheme}", unit="step",
                   dynamic_ncols=True, disable=self.rank != 0)
        tokens_per_step = cfg.batch_size * cfg.seq_len
        losses, times, peak, status = [], [], None, "done"
        try:
            step = self.start_step
            while step < cfg.steps:
                measure = peak is None and (step > self.start_step or cfg.steps - step == 1)
                start = time.perf_counter()
                with Traffic(self.comms) as traffic:
                    if measure:  # live-tensor peak of a whole step once optimizer state exists
                        (loss, norm), local_peak = measure_peak(functools.partial(self.train_step, step), self.model,
                                                                self.optimizer)
                        peak = world.all_gather(torch.tensor(float(local_peak), device=self.device)).max().item()
                    else:
                        loss, norm = self.train_step(step)
                elapsed = time.perf_counter() - start
                step += 1
                losses.append(loss)
                times.append(elapsed)
                record = {"step": step, "loss": loss, "grad_norm": norm, "lr": self.optimizer.param_groups[0]["lr"],
                          "step_time_s": elapsed, "tokens_per_s": tokens_per_step / elapsed,
                          "bytes_recv_rank0": traffic.recv}
                if measure:
                    record["peak_mem_bytes"] = peak
                if log:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / elapsed:,.0f}",
                                mem=f"{peak / 2**20:.1f}MiB" if peak else "-")
                flag = torch.tensor(float(self.stop_requested), device=self.device)
                stop = world.all_reduce(flag, label="stop").item() > 0
                if stop or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps:
                    where = self.save(step)
                    if stop:
                        status = "interrupted"
                        if self.rank == 0:
                            tqdm.write(f"torchtsp: interrupted at step {step}; checkpoint saved to {where}",
                                       file=sys.stderr)
                        break
        finally:
            bar.close()
            if log:
                log.close()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        summary = self.summary(losses, times, peak, status)
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
                "peak_mem_bytes": peak, "scheme": self.cfg.scheme, "mesh": self.degrees, "out": str(self.out)}

    def sample(self) -> str | None:
        """A continuation of the prompt by the parallel model itself (``torchtsp.infer.generate``: seeded sampling,
        temperature 0.8, top-k 40); the weights are never gathered. Every replica of a dp run generates the same
        tokens on its own model axis."""
        from ..infer import generate
        from ..parallel.dp import DataParallel

        model = self.model
        if isinstance(model, DataParallel) and model.scheme != "dp":
            model = model.module  # the replicas hold the same weights: each samples alone
        if model.scheme not in ("tsp", "tp", "sp", "dp"):
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
