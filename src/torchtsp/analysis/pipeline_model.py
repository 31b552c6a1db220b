"""Analytic model of pipeline stages around TSP ([pp, dp, tsp] mesh): per-stage memory, the bubble, the
stage-boundary traffic, and where each mesh axis lands on a multi-node machine.

Pure Python (no torch), like the rest of ``torchtsp.analysis``. docs/analysis.md ("Pipeline stages") derives
each term. The per-stage memory reuses the TSP walk of ``memory_model`` on one stage (L/pp layers, one
microbatch of B/(dp·M) rows per replica) and adds what a schedule keeps alive at once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import ModelConfig
from ..layout import Layout
from ..schemes import stages_per_rank
from .comm_model import predict_comm
from .memory_model import FP32, param_elements, predict_memory


def pipeline_bubble(pp: int, microbatches: int, schedule: str = "1f1b") -> float:
    """Fraction of a step each rank idles: (pp-1)/(M+pp-1) for GPipe and 1F1B (same bubble, 1F1B holds fewer
    microbatches' activations); (pp-1)/(v·M+pp-1) with v stages per rank for the interleaved schedule."""
    v = stages_per_rank(schedule)
    return (pp - 1) / (v * microbatches + pp - 1)


def in_flight(stage: int, pp: int, microbatches: int, schedule: str) -> int:
    """Microbatches whose activations pp rank ``stage`` holds at once: all M under GPipe; under 1F1B the
    warm-up depth, pp - stage (the first stage the most). Interleaved: the same depth per rank, counted
    once per local stage by the caller."""
    return microbatches if schedule == "gpipe" else min(microbatches, pp - stage)


@dataclass(frozen=True)
class StageMemory:
    stage: int
    layers: tuple[tuple[int, int], ...]  # [first, last) layers of each local stage
    params: int  # bytes of parameters + gradients + optimizer state this rank holds
    activations: int  # saved activations of the microbatches in flight
    total: int  # predicted peak of live bytes
    in_flight: int


@dataclass(frozen=True)
class PipelinePlan:
    pp: int
    dp: int
    tsp: int
    microbatches: int
    schedule: str
    bubble: float
    stages: list[StageMemory]
    boundary_bytes: int  # one microbatch's token shard [B/(dp M), S/D, h] crossing one stage boundary
    p2p_bytes_per_rank: int  # received per step by the busiest rank (an interior stage: forward and backward)
    tsp_bytes_per_rank: int  # TSP traffic per step of the busiest stage
    dp_bytes_per_rank: int  # gradient sums over dp per step (the largest stage)

    def to_dict(self) -> dict:
        return asdict(self)


def predict_pipeline(cfg: ModelConfig, batch: int, seq_len: int, *, pp: int, dp: int = 1, tsp: int = 1,
                     microbatches: int | None = None, schedule: str = "1f1b", dtype_bytes: int = 2,
                     recompute: bool = False, foreach: bool = True, zero: int = 0) -> PipelinePlan:
    """Per-stage peak memory, bubble and traffic of ``pp`` TSP stages (B = ``batch`` global rows); ``zero``: the
    distributed optimizer over dp, as ``predict_memory`` takes it (3, FSDP2, only without a pipeline, as train)."""
    if zero == 3 and pp > 1:
        raise ValueError("--zero 3 (FSDP2) with --pp is not supported; use --zero 2 with --pp")
    # The one resolution train, bench, generate and serve use (layout.py): pipeline, model and batch checks.
    layout = Layout.of_degrees("tsp", cfg, batch, seq_len, dp=dp, tsp=tsp, pp=pp, microbatches=microbatches,
                               schedule=schedule)
    M = layout.microbatches if pp > 1 else microbatches or 1  # one stage: microbatches are gradient accumulation
    v = stages_per_rank(schedule)
    n_stages = pp * v
    per = cfg.n_layers // n_stages
    stage_cfg = cfg.stage(range(per))  # one stage as a model of its own (the first stage's layer types)
    mb_rows = batch // M  # global rows of one microbatch (each replica gets 1/dp of them)
    e = dtype_bytes
    # One stage, one microbatch, as a model of `per` layers (with the embedding and head, taken off below where
    # a stage lacks them): the walk of one microbatch's backward.
    one = predict_memory("tsp", stage_cfg, mb_rows, seq_len, dp=dp, tsp=tsp, dtype_bytes=e, optimizer="adamw",
                         recompute=recompute, foreach=foreach, zero=zero)
    parts = param_elements("tsp", stage_cfg, tsp=tsp)
    opt_per = 2 * FP32 + (FP32 if e < FP32 else 0)
    per_param = 2 * e + opt_per  # weight, gradient, AdamW moments (and master)
    stages = []
    for r in range(pp):
        local = [s for s in range(n_stages) if s % pp == r]
        # A stage without the embedding or the head does not hold their vocabulary shards.
        missing = sum((parts["embedding"] if s > 0 else 0) + (parts["head"] + cfg.dim if s < n_stages - 1 else 0)
                      for s in local)
        held = v * (one.params + one.grads + one.optimizer) - missing * per_param
        k = in_flight(r, pp, M, schedule) * v
        acts = k * one.activations
        # The first backward runs with k microbatches' activations saved and no gradient yet; every later one
        # with the stage's gradients all alive (accumulated), but one microbatch fewer in flight at most. The
        # walk of one microbatch adds gradients as it goes: adding them whole on top is an upper bound.
        first = one.total + (k - 1) * one.activations
        later = one.total + (min(k, M * v - 1) - 1) * one.activations + v * one.grads if M * v > 1 else 0
        # The library's receive buffers, one per microbatch and reused every step: a stage's input (and the
        # gradient autograd leaves on it) unless it is the first, its output's gradient unless it is the last.
        boundary_one = (mb_rows // dp) * (seq_len // tsp) * cfg.dim * e
        buffers = sum(M * boundary_one * (2 * (s > 0) + (s < n_stages - 1)) for s in local)
        total = max(first, later) + buffers + (v - 1) * (one.params + one.grads + one.optimizer) \
            - missing * per_param
        layers = tuple((s * per, s * per + per) for s in local)
        stages.append(StageMemory(stage=r, layers=layers, params=held, activations=acts, total=total, in_flight=k))
    boundary = (mb_rows // dp) * (seq_len // tsp) * cfg.dim * e
    # Shards a rank receives per microbatch: each local stage's input (but the first's) and its output's
    # gradient (but the last's); the busiest rank sets the pace.
    busiest = max(sum((s > 0) + (s < n_stages - 1) for s in range(n_stages) if s % pp == r) for r in range(pp))
    # One replica's microbatch (B/(dp M) rows) through one stage, counted with the embedding and head rings: an
    # upper bound for the stages that hold neither.
    comm = predict_comm("tsp", stage_cfg, mb_rows // dp, seq_len, tsp=tsp, dtype_bytes=e, recompute=recompute)
    n_local = sum(parts.values())
    # Over dp: the float32 gradient all-reduce (--zero 0), or its reduce-scatter and the weights' all-gathers in the
    # model dtype (one after the step for --zero 1/2; FSDP2's before forward and again before backward).
    dp_bytes = 2 * (dp - 1) * v * n_local * FP32 // dp
    if zero and dp > 1:
        dp_bytes = (dp - 1) * v * n_local * (FP32 + (2 if zero == 3 else 1) * e) // dp
    return PipelinePlan(pp=pp, dp=dp, tsp=tsp, microbatches=M, schedule=schedule,
                        bubble=pipeline_bubble(pp, M, schedule), stages=stages, boundary_bytes=boundary,
                        p2p_bytes_per_rank=M * busiest * boundary,
                        tsp_bytes_per_rank=v * M * comm.total,
                        dp_bytes_per_rank=dp_bytes if dp > 1 else 0)


# ---------------------------------------------------------------- nodes


def axis_nodes(pp: int, dp: int, tsp: int, gpus_per_node: int) -> dict[str, int]:
    """How many nodes one group of each mesh axis spans, with ranks numbered along [pp, dp, tsp] (tsp
    innermost) and nodes holding ``gpus_per_node`` consecutive ranks (torchrun's --node-rank order)."""
    strides = {"tsp": 1, "dp": tsp, "pp": tsp * dp}
    sizes = {"pp": pp, "dp": dp, "tsp": tsp}
    return {axis: len({(strides[axis] * i) // gpus_per_node for i in range(sizes[axis])}) for axis in sizes}


def placement(pp: int, dp: int, tsp: int, gpus_per_node: int, nodes: int, plan: PipelinePlan | None,
              inter_node_gbps: float) -> dict:
    """Which axis crosses the slow inter-node link, and what it costs per step.

    ``inter_node_gbps``: the bandwidth of one node's link to the others (Gbit/s), shared by its GPUs. An axis
    whose groups span several nodes sends its traffic over it: pp the stage-boundary shards (every GPU of
    a node at a boundary sends them), dp the gradient sums (counted whole: a ring over nodes sends them
    all across), tsp its weights, K/V and gradients (every layer: TSP belongs inside a node).
    """
    if pp * dp * tsp != gpus_per_node * nodes:
        raise ValueError(f"pp={pp} x dp={dp} x tsp={tsp} = {pp * dp * tsp} ranks, but {nodes} nodes of "
                         f"{gpus_per_node} GPUs have {gpus_per_node * nodes}")
    spans = axis_nodes(pp, dp, tsp, gpus_per_node)
    volume = {"pp": plan.p2p_bytes_per_rank if plan else 0, "dp": plan.dp_bytes_per_rank if plan else 0,
              "tsp": plan.tsp_bytes_per_rank if plan else 0}
    link = inter_node_gbps * 1e9 / 8  # bytes/s per node
    out = {}
    for axis in ("tsp", "dp", "pp"):
        crosses = spans[axis] > 1
        # Each GPU of a node sends its share across: the node's link carries gpus_per_node x the per-GPU volume.
        seconds = gpus_per_node * volume[axis] / link if crosses and link > 0 else 0.0
        out[axis] = {"nodes_spanned": spans[axis], "crosses_nodes": crosses, "bytes_per_gpu": volume[axis],
                     "seconds_per_step": seconds}
    return out
