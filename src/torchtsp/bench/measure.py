"""What ``torchtsp bench`` runs on every rank: build a scheme, count its traffic, measure its peak, time it.

One *cell* is one (scheme, sequence length). On every rank of the world a cell

1. builds the model (same seed everywhere), applies the scheme on its mesh and an AdamW over the rank's
   parameters;
2. runs one step (forward + backward + AdamW) whose forward, and separately the whole step, are counted on
   every axis of ``model.comms()`` (``comm.Traffic``); then ``warmup - 1`` more untimed steps;
3. measures the live-tensor peak of one whole step, optimizer state present (``measure_peak`` tracking the
   model and the optimizer);
4. times ``steps`` steps, each started after a barrier.

The ranks' numbers are gathered over the world, so every rank returns the same aggregate: peak = max over
ranks, step time = max over ranks per step. A task runs the cells of ONE mesh (one scheme): the mesh and its
process groups are built once per task, since creating subgroups is a collective and costs seconds.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field

import torch

from .. import compiled
from ..config import ModelConfig
from ..distributed import comm
from ..distributed.comm import AxisComm, Traffic
from ..distributed.mesh import init_mesh, mesh_device
from ..layers import Documents
from ..memory import measure_peak
from ..model import Transformer
from ..parallel import parallelize
from ..schemes import get_scheme
from ..timeouts import BENCH_CELL_TIMEOUT_S
from ..train.optim import build_adamw
from ..train.zero import ZeroOptimizer

LR, WEIGHT_DECAY = 1e-4, 0.1  # the values do not matter: the bench measures, it does not train


@dataclass(frozen=True)
class CellSpec:
    """One (scheme, sequence length) on every rank; picklable for the worker pool."""

    scheme: str
    degrees: dict
    cfg: ModelConfig
    batch: int
    seq_len: int
    warmup: int
    steps: int
    options: dict = field(default_factory=dict)
    mode: str = "sweep"  # "sweep": count, measure, time; "memory": measure the peak only
    seed: int = 0
    timeout_s: float = BENCH_CELL_TIMEOUT_S
    documents: int = 0  # packed rows of documents of this mean length (0: one sequence per row)
    zero: int = 0  # the distributed optimizer's level over dp (train/zero.py; effective when dp > 1)
    compile: bool = False  # torch.compile each block's math (torchtsp.compiled); the warm-up steps compile

    @property
    def label(self) -> str:
        return self.scheme + (f" documents={self.documents}" if self.documents else "")

    @property
    def counted(self) -> bool:
        """Whether our comm layer sees this scheme's traffic (torch_tp runs PyTorch's own collectives)."""
        return self.mode == "sweep" and get_scheme(self.scheme).traffic is not None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the bench's own timing; library code never synchronizes


def packed_document_ids(batch: int, seq_len: int, mean_len: int, seed: int) -> torch.Tensor:
    """[batch, seq_len] document ids of rows packed with documents of exponentially distributed lengths (mean
    ``mean_len``, at least 1 token), seeded; the last document of a row is cut at the row's end."""
    g = torch.Generator().manual_seed(seed + 7919)
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq_len:
            lengths.append(max(1, round(float(torch.empty(1).exponential_(1 / mean_len, generator=g)))))
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq_len])
    return torch.stack(rows)


def _add_by_op(a: dict, b: dict) -> dict:
    out = {axis: dict(ops) for axis, ops in a.items()}
    for axis, ops in b.items():
        for op, n in ops.items():
            out.setdefault(axis, {})[op] = out.get(axis, {}).get(op, 0) + n
    return out


class _Built:
    """One scheme's model, AdamW and global batch on this rank; ``step()`` is forward + backward + AdamW."""

    def __init__(self, spec: CellSpec, mesh):
        self.device = mesh_device(mesh)
        compiled.enable(spec.compile, self.device.type)  # this process's switch: a worker runs cells of both
        torch.manual_seed(spec.seed)
        self.model = parallelize(Transformer(spec.cfg, device="meta"), mesh, spec.scheme, timeout_s=spec.timeout_s,
                                 **spec.options)
        g = torch.Generator().manual_seed(spec.seed)
        shape = (spec.batch, spec.seq_len)
        self.tokens = torch.randint(0, spec.cfg.vocab_size, shape, generator=g).to(self.device)
        self.labels = torch.randint(0, spec.cfg.vocab_size, shape, generator=g).to(self.device)
        self.model.shard_batch(self.tokens)  # indivisible sequence or batch: a ValueError here, before any collective
        self.documents = (Documents.from_ids(packed_document_ids(*shape, spec.documents, spec.seed))
                          if spec.documents else None)
        self.params = dict(self.model.named_parameters())
        dp = self.model.comms().get("dp")
        self.zero = (ZeroOptimizer(self.model, spec.zero, LR, WEIGHT_DECAY)
                     if spec.zero and dp is not None and dp.size > 1 else None)
        if self.zero:
            self.model.sum_gradients_with(self.zero.grad_sum)
            self.optimizer, self.tracked = self.zero, (self.model, *self.zero.optimizers)
        else:
            refs = {name: [ref for ref, *_ in self.model.reference_parts(name, p)] for name, p in self.params.items()}
            self.optimizer = build_adamw(((refs[n], p) for n, p in self.params.items()), LR, WEIGHT_DECAY)
            self.tracked = (self.model, self.optimizer)

    def update(self) -> None:
        """AdamW after a backward; with ZeRO the gradients' reduce-scatter, the owned chunks' update and the
        weights' all-gather, waited for (so a step's bytes and time include it)."""
        if self.zero:
            self.zero.reduce_gradients()
            self.zero.step()
            self.zero.zero_grad()
            self.zero.wait_for_weights()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> torch.Tensor:
        loss = self.model.loss(self.tokens, self.labels, self.documents)
        loss.backward()
        self.update()
        return loss.detach()

    def timed_step(self) -> tuple[float, float]:
        """One step started after a barrier (so every rank starts together): (its wall time on this rank, the
        seconds this rank was blocked waiting on transfers of the model's axes: exposed communication)."""
        _sync(self.device)
        comm.barrier()
        with Traffic(self.model.comms()) as traffic:
            start = time.perf_counter()
            self.step()
            _sync(self.device)
            elapsed = time.perf_counter() - start
        return elapsed, sum(s.wait_s for s in traffic.stats.values())


def _build(spec: CellSpec, mesh) -> _Built | str:
    """The built cell, or why the scheme refuses it (every rank refuses alike, before communicating)."""
    gc.collect()  # the previous cell's model and optimizer (reference cycles) go before this one is built
    try:
        return _Built(spec, mesh)
    except ValueError as e:
        return " ".join(str(e).split())


def _cell(spec: CellSpec, mesh) -> dict:
    """One cell on this rank; the aggregate over all ranks (identical on every rank), or ``{"error": why}``."""
    built = _build(spec, mesh)
    if isinstance(built, str):
        return {"error": built}
    model, step = built.model, built.step
    comms = model.comms()
    fwd_by_op = step_by_op = {}
    fwd_bytes = step_bytes = fwd_routed = step_routed = -1
    times: list[float] = []
    if spec.mode == "sweep":
        with Traffic(comms) as forward:
            loss = model.loss(built.tokens, built.labels, built.documents)
        with Traffic(comms) as rest:
            loss.backward()
            built.update()
        fwd_bytes, step_bytes = forward.recv, forward.recv + rest.recv
        fwd_by_op, step_by_op = forward.by_op, _add_by_op(forward.by_op, rest.by_op)
        # A mixture of experts' all-to-alls move what routing sends: kept apart from the deterministic bytes.
        fwd_routed, step_routed = (sum(ops.get("all_to_all", 0) for ops in by_op.values())
                                   for by_op in (fwd_by_op, step_by_op))
        for _ in range(spec.warmup - 1):
            step()
    elif built.zero:  # optimizer state: one whole step (its gradients go through the reduce-scatter)
        step()
    else:  # optimizer state without a forward/backward: one AdamW step on zero gradients
        for p in built.params.values():
            p.grad = torch.zeros_like(p)
        built.update()
    loss, peak = measure_peak(step, *built.tracked)
    waited = 0.0
    if spec.mode == "sweep":
        timed = [built.timed_step() for _ in range(spec.steps)]
        times, waited = [t for t, _ in timed], sum(w for _, w in timed)

    world = AxisComm.world(spec.timeout_s)  # a separate comm: not counted with the model's axes
    exposed = waited / sum(times) if times else 0.0
    # Which rank's bytes predict_comm must count (-1 below: None), and whether full layers' K/V move point to point.
    traffic = model.traffic_args()
    seq_rank, point_to_point = traffic.get("seq_rank"), traffic.get("point_to_point", False)
    local = torch.tensor([peak, fwd_bytes, step_bytes, loss.item(), exposed, fwd_routed, step_routed,
                          -1 if seq_rank is None else seq_rank, float(point_to_point), *times], dtype=torch.float64,
                         device=built.device)
    rows = world.all_gather(local).cpu().tolist()
    step_times = [max(r[9 + i] for r in rows) for i in range(len(times))]
    return {
        "error": None,
        "peak_bytes_per_rank": [int(r[0]) for r in rows],
        "forward_bytes_per_rank": [int(r[1]) for r in rows] if spec.counted else None,
        "step_bytes_per_rank": [int(r[2]) for r in rows] if spec.counted else None,
        "routed_forward_bytes_per_rank": [int(r[5]) for r in rows] if spec.counted else None,
        "routed_step_bytes_per_rank": [int(r[6]) for r in rows] if spec.counted else None,
        "seq_rank_per_rank": [None if r[7] < 0 else int(r[7]) for r in rows],
        "kv_point_to_point": any(r[8] for r in rows),
        "loss": rows[0][3],
        "step_times_s": step_times,
        # Fraction of its timed steps each rank spent blocked on transfers; the largest over ranks.
        "exposed_comm_fraction": max(r[4] for r in rows) if spec.counted else None,
        "forward_bytes_by_op_rank0": fwd_by_op if comm.global_rank() == 0 else None,
        "step_bytes_by_op_rank0": step_by_op if comm.global_rank() == 0 else None,
    }


def cells_on_rank(specs: list[CellSpec]) -> list[dict]:
    """Every cell of ``specs`` (all on one mesh) on this rank, in order; see ``_cell``."""
    mesh = init_mesh(**specs[0].degrees, timeout_s=specs[0].timeout_s)
    return [_cell(spec, mesh) for spec in specs]


def longest_on_rank(specs: list[CellSpec], budget_bytes: int) -> list[dict]:
    """Memory-mode cells of one scheme at growing sequence lengths, stopping after the first whose measured
    per-rank peak exceeds ``budget_bytes`` or that the scheme refuses (every rank stops at the same cell)."""
    mesh = init_mesh(**specs[0].degrees, timeout_s=specs[0].timeout_s)
    results = []
    for spec in specs:
        results.append(_cell(spec, mesh))
        if results[-1]["error"] or max(results[-1]["peak_bytes_per_rank"]) > budget_bytes:
            break
    return results


def paired_on_rank(specs: list[CellSpec], peaks: bool = False) -> dict:
    """Time several cells' steps interleaved (A B, B A, A B, ...) on the same ranks and batch, so that a
    background load that comes and goes hits them alike; returns per cell (``spec.label``) the step times
    (slowest rank per step) and their median, and with ``peaks`` the live-tensor peak of one step (largest over
    ranks). Each cell gets ``spec.warmup`` untimed steps first. All specs share one mesh.
    """
    mesh = init_mesh(**specs[0].degrees, timeout_s=specs[0].timeout_s)
    built = [_build(spec, mesh) for spec in specs]
    if any(isinstance(b, str) for b in built):
        return {"error": next(b for b in built if isinstance(b, str))}
    for b, spec in zip(built, specs):
        for _ in range(spec.warmup):
            b.step()
    peak = [measure_peak(b.step, *b.tracked)[1] if peaks else 0 for b in built]
    steps = specs[0].steps
    times = [[0.0] * steps for _ in specs]
    for i in range(steps):
        order = list(range(len(specs)))
        for k in order if i % 2 == 0 else reversed(order):
            times[k][i] = built[k].timed_step()[0]
    device = built[0].device
    rows = AxisComm.world(specs[0].timeout_s).all_gather(
        torch.tensor([t for per in times for t in per] + peak, dtype=torch.float64, device=device)).cpu().tolist()
    out = {"error": None}
    for k, spec in enumerate(specs):
        per_step = [max(r[k * steps + i] for r in rows) for i in range(steps)]
        out[spec.label] = {"step_times_s": per_step, "median_step_s": statistics.median(per_step)}
        if peaks:
            out[spec.label]["peak_bytes"] = int(max(r[len(specs) * steps + k] for r in rows))
    return out
