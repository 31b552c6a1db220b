"""Pipeline stages around a scheme (TSP, TP, SP), on a [pp, dp, scheme axes] mesh (see docs/design.md,
"Pipeline stages").

The reference model is cut into stage sub-models first: contiguous, equal layer ranges, one per stage (two per
rank for the interleaved schedule), the embedding in the first, the final norm, LM head and loss in the last.
Each is then split with the scheme's class over the mesh without ``pp`` and ``dp`` (``StageWeights`` names its
layers as those of a model of that many layers). Stage s runs on the ranks whose ``pp`` coordinate holds it:
each of its ``dp`` replicas is one group of the scheme's axes, running the scheme on its microbatches (TSP: 1/D
of every weight of the stage's layers and 1/D of the tokens, zigzag layout).

At a stage boundary nothing is gathered: rank p of the scheme's group of one stage sends its own hidden states
(TSP and SP: its token shard [b, S/D, h]; TP: the whole sequence [b, S, h], which every TP rank holds) to rank
p of the next stage, its neighbour along the ``pp`` axis, and the gradient comes back the same way.

The schedule is ``torch.distributed.pipelining``'s (GPipe, 1F1B, interleaved 1F1B). That library
issues its sends and receives itself, which is the one exception to "only comm.py calls
torch.distributed": it runs on a process group made by ``comm.pipeline_group`` (whose timeout bounds
every wait), and ``CountedStage`` hands every batch of its point-to-point ops to
``AxisComm.count_p2p`` before they are issued, so the ``pp`` axis's traffic is counted like any other.

Exactness: every microbatch's loss is its summed NLL divided by the number of targets of the whole
global batch (known before the step), so the sum over microbatches and replicas is the global mean
and the gradients, accumulated over microbatches (``scale_grads=False``) and summed over ``dp`` after
the schedule, are those of the single-device model.
"""

from __future__ import annotations

import functools
import re

import torch
from torch import nn

from ..distributed import comm as comm_lib
from ..distributed.comm import DEFAULT_TIMEOUT_S, AxisComm
from ..distributed.mesh import mesh_device, mesh_sizes
from ..layers import IGNORE_INDEX, Documents, as_documents
from ..layout import Layout
from ..model import Transformer
from ..schemes import PIPELINE_AXIS, SCHEMES, stage_layer_ranges, stages_per_rank
from ..weights import WeightSource
from .api import parallelize
from .base import ParallelTransformer, weight_source
from .dp import AllReduceGrads

# torch.distributed.pipelining imports Dynamo and DTensor (about 1.5 s of CPU): it is imported when a pipeline is
# built, not by every rank that imports this package.
SCHEDULE_CLASS_NAMES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def _schedule_class(name: str):
    import torch.distributed.pipelining as pipelining

    return getattr(pipelining, SCHEDULE_CLASS_NAMES[name])


_LAYER = re.compile(r"^layers\.(\d+)\.")


class StageWeights(WeightSource):
    """The reference weights of layers [start, start + n) (with the embedding, final norm and head), named
    as those of an n-layer model, so a stage is built by ``TSPTransformer`` unchanged."""

    def __init__(self, source: WeightSource, stage_cfg, start: int):
        super().__init__(stage_cfg, source.device, source.dtype)
        self.source, self.start = source, start

    def on(self, device) -> StageWeights:
        return StageWeights(self.source.on(device), self.cfg, self.start)

    def get(self, name: str, dim: int | None = None, parts: int = 1, index: int = 0) -> torch.Tensor:
        return self.source.get(shift_layer(name, self.start), dim, parts, index)


def shift_layer(name: str, offset: int) -> str:
    """``layers.i.rest`` -> ``layers.{i + offset}.rest``; other names unchanged."""
    return _LAYER.sub(lambda m: f"layers.{int(m.group(1)) + offset}.", name)


# The reference parameters only the first stage runs (the embedding) and only the last (final norm and head).
FIRST_ONLY, LAST_ONLY = {"tok_embeddings.weight"}, {"norm.weight", "output.weight"}


class Stage(nn.Module):
    """One pipeline stage: layers ``layers`` of the reference model as a model of its own (``StageWeights``), the
    embedding in the first stage, the final norm, head and loss in the last, split with a scheme's class over
    this rank's mesh (its ``pp`` and ``dp`` axes are the pipeline's, not the stage's).

    ``forward`` takes this rank's share of token ids (first stage) or hidden states and returns hidden states;
    the last stage's head and loss run in ``nll_sum``, the schedule's loss function. A scheme's model runs as a
    stage through its three parts: ``embed``, ``hidden_states`` and ``head_nll_sum_and_count``.
    """

    def __init__(self, scheme_class, options: dict, cfg, mesh, layers: range, first: bool, last: bool,
                 source: WeightSource, timeout_s: float):
        super().__init__()
        self.layers, self.first, self.last = layers, first, last
        stage_cfg = cfg.stage(layers)
        self.model = scheme_class(Transformer(stage_cfg, device="meta"), mesh, timeout_s=timeout_s,
                                  weights=StageWeights(source, stage_cfg, layers.start), **options)
        # A scheme builds the parts every model has: drop those this stage does not run, by what they hold.
        unused = (set() if first else FIRST_ONLY) | (set() if last else LAST_ONLY)
        for name, p in list(self.model.named_parameters()):
            if unused and all(ref in unused for ref, *_ in self.model.reference_parts(name, p)):
                owner, _, attr = name.rpartition(".")
                setattr(self.model.get_submodule(owner), attr, None)

    def forward(self, x: torch.Tensor, document_positions: torch.Tensor | None = None) -> torch.Tensor:
        """``document_positions``: this microbatch's ``Documents.positions`` (packed rows), the schedule's
        keyword argument, which it splits into microbatches like the tokens."""
        if self.first:
            x = self.model.embed(x)
        documents = None if document_positions is None else Documents.from_positions(document_positions)
        return self.model.hidden_states(x, documents=documents)

    def nll_sum(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model.head_nll_sum_and_count(x, labels)[0]

    def reference_parts(self, name: str, local: torch.Tensor):
        return [(shift_layer(ref, self.layers.start), piece, dims)
                for ref, piece, dims in self.model.reference_parts(name, local)]


class _Unhooked(nn.Module):
    """The module a library stage calls: ``stage.forward`` without module hooks. A stage runs once per microbatch
    in a step, which PyTorch's MemTracker (the trainer's peak-memory measure) would take for a second iteration;
    its allocations are still counted, only its per-module breakdown is skipped."""

    def __init__(self, stage: Stage):
        super().__init__()
        self.stage = stage

    def __call__(self, *args, **kwargs):
        return self.stage.forward(*args, **kwargs)


@functools.cache
def counted_stage_class():
    """``CountedStage``: a ``PipelineStage`` whose point-to-point ops are counted on the ``pp`` axis's
    ``AxisComm`` (a class made on first use: its base comes from torch.distributed.pipelining)."""
    from torch.distributed.pipelining import PipelineStage

    class CountedStage(PipelineStage):
        def __init__(self, *args, counter: AxisComm, **kwargs):
            super().__init__(*args, **kwargs)
            self.counter = counter

        def get_fwd_recv_ops(self, fwd_chunk_id):
            return self.counter.count_p2p(super().get_fwd_recv_ops(fwd_chunk_id), ("forward", self.stage_index))

        def get_fwd_send_ops(self, fwd_chunk_id):
            return self.counter.count_p2p(super().get_fwd_send_ops(fwd_chunk_id), ("forward", self.stage_index))

        def get_bwd_recv_ops(self, bwd_chunk_id):
            return self.counter.count_p2p(super().get_bwd_recv_ops(bwd_chunk_id), ("backward", self.stage_index))

        def get_bwd_send_ops(self, bwd_chunk_id):
            return self.counter.count_p2p(super().get_bwd_send_ops(bwd_chunk_id), ("backward", self.stage_index))

    return CountedStage


class Pipeline(ParallelTransformer):
    """A reference ``Transformer`` split into pipeline stages over the ``pp`` mesh axis, each stage a scheme's
    model (TSP, TP, SP) over that scheme's axes, replicated over ``dp``. Build it with ``pipeline_parallelize``.

    ``forward_backward(tokens, labels)`` runs one step of the schedule on the global batch and returns the
    global mean loss (on every rank); ``full_grads()`` and ``full_state_dict()`` hold this rank's stages'
    parameters only, by reference name.
    """

    joint_forward_backward = True

    def __init__(self, model: Transformer, mesh, scheme: str = "tsp", microbatches: int | None = None,
                 schedule: str = "1f1b", recompute: str | bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                 weights: WeightSource | None = None, **options):
        sizes = mesh_sizes(mesh)
        pp = sizes.get(PIPELINE_AXIS, 1)
        if pp < 2:
            raise ValueError("pipeline_parallelize needs a mesh with a pp axis of size >= 2 "
                             "(torchtsp.init_mesh(pp=...)); without one use torchtsp.parallelize")
        cfg = model.cfg
        # The checks that need no batch (microbatches and layers against stages, heads against the scheme's
        # degrees); the batch is checked against the layout as it arrives (``check_inputs``).
        self.layout = Layout.of_mesh(scheme, sizes, cfg, microbatches=microbatches, schedule=schedule,
                                     recompute=recompute, **options)
        if self.layout.option_values.get("sequence_parallel"):
            raise ValueError("pipeline stages pass whole sequences between TP stages: drop sequence_parallel "
                             "with --pp")
        self.scheme = self.layout.scheme  # the instance attribute the base class reads
        super().__init__(cfg, mesh)
        self.microbatches = self.layout.microbatches
        self.schedule_name = schedule
        self.pp = AxisComm(comm_lib.pipeline_group(mesh, timeout_s), PIPELINE_AXIS, timeout_s)
        self.dp = AxisComm.from_mesh(mesh, "dp", timeout_s)
        # The replicas' gradients are summed once per schedule, not per microbatch: ``over_pass``.
        self.grad_sum = AllReduceGrads(self.dp)
        weights = weight_source(model, mesh, weights)  # seeded, the built model's, or the given checkpoint's
        self.device = mesh_device(mesh)
        n_stages = pp * stages_per_rank(schedule)
        ranges = stage_layer_ranges(cfg.n_layers, n_stages)
        # Loop placement (torch's mapping): stage s runs on pp rank s mod pp.
        self.stage_ids = [s for s in range(n_stages) if s % pp == self.pp.rank]
        scheme_class, stage_options = SCHEMES[self.layout.scheme].load("model"), self.layout.option_values
        self.stages = nn.ModuleList(
            Stage(scheme_class, stage_options, cfg, mesh, ranges[s], s == 0, s == n_stages - 1, weights, timeout_s)
            for s in self.stage_ids)
        model.to("meta")  # release the full weights, if any: this rank keeps only its stages' shards
        self.n_stages = n_stages
        self.has_first, self.has_last = 0 in self.stage_ids, n_stages - 1 in self.stage_ids
        self._schedule, self._shape = None, None  # built by the first step, when the microbatch shape is known

    def _build_schedule(self, rows: int, seq_len: int) -> None:
        """The library's stages and schedule for microbatches of ``rows`` x ``seq_len`` tokens.

        Their shapes are given (static mode): the library's shape inference would run the stages' forward,
        and their TSP transfers, outside the schedule.
        """
        if self._shape == (rows, seq_len):
            return
        self._shape = (rows, seq_len)
        n, h = self._local_tokens(torch.zeros(1, seq_len, dtype=torch.long)).shape[1], self.cfg.dim
        dtype = next(self.parameters()).dtype
        tokens = torch.empty(rows, n, dtype=torch.long, device="meta")
        hidden = torch.empty(rows, n, h, dtype=dtype, device="meta", requires_grad=True)
        pipe = [counted_stage_class()(_Unhooked(stage), s, self.n_stages, self.device,
                                      input_args=tokens if stage.first else hidden, output_args=hidden,
                                      group=self.pp.group, counter=self.pp)
                for s, stage in zip(self.stage_ids, self.stages)]
        last = self.stages[-1] if self.has_last else None
        # Every rank's schedule needs a loss function to run backward at all; only the last stage's is called.
        loss_fn = (lambda x, labels: last.nll_sum(x, labels) / self._count) if last is not None else _no_loss
        klass = _schedule_class(self.schedule_name)
        # Sums, not means, over microbatches: the loss function already divides by the global target count.
        if self.schedule_name == "interleaved_1f1b":
            self._schedule = klass(pipe, self.microbatches, loss_fn=loss_fn, scale_grads=False)
        else:
            self._schedule = klass(pipe[0], self.microbatches, loss_fn=loss_fn, scale_grads=False)

    # -- the step -------------------------------------------------------------

    def comms(self):
        # Each local stage has its own comms on the same groups (interleaved: two): all are counted.
        later = {f"{axis}.stage{s}": comm for s, stage in zip(self.stage_ids[1:], self.stages[1:])
                 for axis, comm in stage.model.comms().items()}
        return {**self.stages[0].model.comms(), **later, "dp": self.dp, PIPELINE_AXIS: self.pp}

    def _local_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """The scheme's share of ``rows`` on this rank (TSP, SP: a zigzag shard; TP: every token)."""
        return self.stages[0].model.shard_batch(rows)

    def shard_batch(self, tokens: torch.Tensor) -> torch.Tensor:
        """This replica's B/dp rows, then the scheme's share of them (TSP: a zigzag shard [B/dp, S/D])."""
        return self._local_tokens(tokens.chunk(self.dp.size, dim=0)[self.dp.rank])

    def forward_backward(self, tokens: torch.Tensor, labels: torch.Tensor, document_ids=None,
                         target_count: torch.Tensor | None = None) -> torch.Tensor:
        """One pipelined forward and backward of the global batch: gradients accumulate into ``.grad`` (summed
        over microbatches and replicas); returns the global mean loss (detached, the same on every rank).
        ``document_ids``: packed rows, as ``ParallelTransformer.loss`` takes them. ``target_count``: divide the
        summed NLL by this instead of the batch's own target count (the batch is a part of a larger one)."""
        self.check_inputs(tokens, labels)
        documents = as_documents(document_ids, tokens.shape)
        # Every stage of every rank gets its microbatch's document positions (a keyword of the schedule).
        extra = {} if documents is None else {
            "document_positions": documents.positions.chunk(self.dp.size, dim=0)[self.dp.rank]}
        B = tokens.shape[0]
        self._build_schedule(B // (self.dp.size * self.microbatches), tokens.shape[1])
        self._count = (target_count if target_count is not None else
                       (labels != IGNORE_INDEX).sum().to(torch.float32).clamp_min(1)).to(self.device)
        args = (self.shard_batch(tokens),) if self.has_first else ()
        target = self.shard_batch(labels) if self.has_last else None
        losses: list = []
        with self.grad_sum.over_pass(self.parameters()):
            self._schedule.step(*args, target=target, losses=losses if self.has_last else None,
                                return_outputs=False, **extra)
        local = torch.stack(losses).sum().detach() if self.has_last else torch.zeros((), device=self.device)
        # Each replica's losses are its share of the global mean; only the last stage holds them.
        return self.pp.all_reduce(self.dp.all_reduce(local.float().clone(), label="loss"), label="loss")

    def sum_gradients_with(self, strategy) -> None:
        """Sum the gradients of each schedule over the replicas with ``strategy`` (``AllReduceGrads`` by default;
        a distributed optimizer's reduce-scatter); None keeps the one in use."""
        if strategy is not None:
            self.grad_sum = strategy

    def loss(self, tokens, labels, document_ids=None):
        raise ValueError("a pipeline runs forward and backward together: call forward_backward(tokens, labels)")

    def loss_terms(self, tokens, labels, documents=None):
        raise ValueError("a pipeline runs forward and backward together: call forward_backward(tokens, labels)")

    # -- names ----------------------------------------------------------------

    def reference_parts(self, name, local):
        index, _, rest = name.removeprefix("stages.").partition(".")
        return self.stages[int(index)].reference_parts(rest.removeprefix("model."), local)

    def _full(self, pick):
        out = {}
        for stage in self.stages:
            out.update({shift_layer(k, stage.layers.start): v for k, v in stage.model._full(pick).items()})
        return out


def _no_loss(x, labels):  # never called: only the last stage computes the loss
    raise AssertionError("loss on a stage that is not the last")


def pipeline_parallelize(model: Transformer, mesh, scheme: str = "tsp", *, microbatches: int | None = None,
                         schedule: str = "1f1b", recompute: str | bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                         weights: WeightSource | None = None, **options) -> Pipeline:
    """Split ``model`` into ``pp`` pipeline stages (the mesh's ``pp`` axis), each a ``scheme`` model (tsp, tp
    or sp) on that scheme's axes, replicated over ``dp``. ``microbatches`` defaults to the number of stages;
    ``schedule`` is ``gpipe``, ``1f1b`` or ``interleaved_1f1b``. Bad splits are refused before any
    communication. ``options``: the scheme's other options (``sequence_parallel``, refused for now)."""
    if not isinstance(model, Transformer):
        raise TypeError(f"pipeline_parallelize expects a torchtsp Transformer, got {type(model).__name__}")
    return Pipeline(model, mesh, scheme, microbatches, schedule, recompute, timeout_s, weights, **options)


def parallelize_layout(model: Transformer, mesh, layout: Layout, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                       weights: WeightSource | None = None) -> ParallelTransformer:
    """``parallelize(model, mesh, layout)``, or for a layout with pp > 1 its pipeline stages, each a model of the
    layout's scheme: one call builds the model of any layout ``init_mesh(layout)`` built the mesh of."""
    if layout.pp == 1:
        return parallelize(model, mesh, layout, timeout_s=timeout_s, weights=weights)
    return pipeline_parallelize(model, mesh, layout.scheme, microbatches=layout.microbatches,
                                schedule=layout.schedule, timeout_s=timeout_s, weights=weights,
                                **layout.option_values)


PipelineTSP = Pipeline  # its name when stages were TSP only
