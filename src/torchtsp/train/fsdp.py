"""``--zero 3``: FSDP2 (torch's ``fully_shard``) over the ``dp`` axis, around any scheme whose parameters are plain
local tensors (every scheme but torch_tp).

Composition. Each rank's local parameters (a TSP packed shard, a TP slice, a whole replicated norm) are what
``fully_shard`` sees as the module's parameters, sharded along their first dim over the ``dp`` sub-mesh of the run's
mesh: every model-axis coordinate has its own dp group, whose ranks hold the same local shapes. Weights, gradients
and AdamW state are then 1/dp of the local shards, 1/(dp·D) of the model. The schemes' forward and backward are
untouched: FSDP2's unsharded parameters are plain tensors, registered on the modules while a forward or backward
runs, so the schemes read them as before (no ``.to_local()``), and the scheme's own gradient sums over its axes
(TSP's replicated norms: ``ReplicatedGrad``) happen in backward before FSDP2 sees a gradient. The other two
compositions torch offers do not fit a packed shard: a DTensor on the scheme's mesh (``DTensor.from_local``, then
``fully_shard`` on the dp sub-mesh) and ``DataParallelMeshDims`` on the full mesh both need each parameter's
placement on the model axes, and a TSP shard packs pieces of several reference tensors (some replicated, KV-head
copies held by several ranks) that no ``Shard``/``Replicate`` placement describes. The reference names and
placements stay where they are, in ``reference_parts``: checkpoints and the global norm read them.

Units. The scheme's model (``DataParallel.module``) is one FSDP unit whose forward is its ``loss_terms``
(``register_fsdp_forward_method``): the schemes run their layers from one method, reading later layers' weights
early (TSP's cross-layer prefetch, its single gradient sum of every layer's norms), so a unit per layer would free
weights the schedule still reads. TSP's prefetch therefore needs no reconciling: FSDP2's all-gather of the unit
lands before the schedule starts, and the schedule's broadcasts of the next layer's shard overlap as before. The
``dp`` scheme, whose reference blocks are modules called one by one, gets one unit per block as well (torchtitan's
``apply_fsdp``), its weights gathered block by block and, with ``reshard_after_forward``, freed after each block's
forward. A mixture-of-experts block keeps its weights until its backward: its router statistics feed the
load-balancing loss outside the block's output, a path FSDP2's pre-backward hook (on outputs) does not see.

Communication goes through the comm layer: FSDP2's all-gather and reduce-scatter are replaced by the dp
``AxisComm``'s (``set_custom_all_gather`` / ``set_custom_reduce_scatter``), so they have its timeout and its
byte counters. Gradients are summed over dp, never averaged (``set_gradient_divide_factor(1)``): the loss is
already the mean over every replica's tokens. Under bfloat16, ``MixedPrecisionPolicy`` gathers and computes in
bfloat16 and reduces in float32; the sharded parameters are the float32 masters. ``cpu_offload``:
``CPUOffloadPolicy`` keeps the sharded parameters, gradients and optimizer state in host memory (a GPU run).

Checkpoints stay ``--zero 0``'s: ``state_dict`` all-gathers the full local shards of weights and moments for a
save (reference names through DCP), ``load_state_dict`` keeps this rank's shard of what DCP loaded, so a run
resumes at any dp, D or ``--zero``.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ..distributed.comm import AxisComm
from ..memory import live_bytes
from .optim import AdamWSteps, build_adamw, clip_grads_, comms_reduce, global_grad_norm, owned_norm_terms, owned_squares


class _Allocate:
    """FSDP2's communication buffers: plain tensors (its default allocator's)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)


class AxisAllGather(_Allocate, AllGather):
    """FSDP2's all-gather of a unit's shards as the dp ``AxisComm``'s (its timeout, its byte counters). Returns when
    the transfer is done (None: nothing left for FSDP2 to wait for)."""

    def __init__(self, comm: AxisComm):
        self.comm = comm

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.comm.all_gather(input_tensor, out=output_tensor.view(self.comm.size, -1), label="fsdp.weights")


class AxisReduceScatter(_Allocate, ReduceScatter):
    """FSDP2's reduce-scatter of a unit's gradients as the dp ``AxisComm``'s: a sum (the divide factor is 1)."""

    def __init__(self, comm: AxisComm):
        self.comm = comm

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        total = self.comm.reduce_scatter(input_tensor.view(self.comm.size, -1), label="fsdp.grad")
        if total.data_ptr() != output_tensor.data_ptr():
            output_tensor.copy_(total.view_as(output_tensor))


def check_shardable(model) -> None:
    """Refuse, with what to change, a model ``fully_shard`` over dp cannot take here."""
    from ..parallel.dp import DataParallel

    if model.joint_forward_backward:
        raise ValueError("--zero 3 (FSDP2) with --pp is not supported: a pipeline stage runs its forward and backward "
                         "in one schedule; use --zero 2 with --pp")
    if not isinstance(model, DataParallel):
        raise ValueError("--zero 3 (FSDP2) shards over data-parallel replicas: give --dp 2 or more")
    if any(hasattr(p, "placements") for p in model.parameters()):
        raise ValueError(f"--zero 3 (FSDP2): scheme {model.scheme!r} holds DTensor parameters; use --zero 0 or "
                         f"another scheme")


def shard_over_dp(model, dp_mesh, *, reshard_after_forward: bool = True, bfloat16: bool = False,
                  cpu_offload: bool = False) -> list[FSDPModule]:
    """Apply FSDP2 over ``dp_mesh`` (the run's dp sub-mesh) to ``model`` (a ``DataParallel`` of a scheme), in place;
    returns its units, the root last. See the module docstring for the units and the options."""
    check_shardable(model)
    if cpu_offload and dp_mesh.device_type == "cpu":
        raise ValueError("--cpu-offload moves a GPU run's sharded state to host memory; this run is on the CPU "
                         "already: drop --cpu-offload")
    comm = model.dp
    inner = model.module
    options = {"mesh": dp_mesh,
               # Inputs as the scheme gives them: a block's rotary tables stay float32, as under --zero 0.
               "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                 cast_forward_inputs=False)
               if bfloat16 else MixedPrecisionPolicy(cast_forward_inputs=False),
               "offload_policy": CPUOffloadPolicy() if cpu_offload else None}
    options = {k: v for k, v in options.items() if v is not None}
    units = []
    for block in inner.fsdp_blocks():  # a MoE block keeps its weights: its router statistics reach the loss later
        fully_shard(block, reshard_after_forward=reshard_after_forward and not block.moe, **options)
        units.append(block)
    fully_shard(inner, reshard_after_forward=reshard_after_forward, **options)
    units.append(inner)
    replicated = _replicated_axis(inner)
    for unit in units:
        unit.set_custom_all_gather(AxisAllGather(comm))
        unit.set_custom_reduce_scatter(AxisReduceScatter(comm))
        unit.set_gradient_divide_factor(1.0)
        if replicated is not None:
            unit.set_all_reduce_hook(lambda shard: replicated.all_reduce(shard, label="replicated.grad"))
    _forward_through_fsdp(inner)
    return units


def _replicated_axis(inner) -> AxisComm | None:
    """The model axis whose ranks hold whole replicas of every weight and see other tokens (SP), or None. Such a
    scheme sums its gradients over that axis in hooks on its parameters, which FSDP2's own parameters replace:
    FSDP2 sums them instead, after its reduce-scatter over dp (``set_all_reduce_hook``), each rank its dp shard
    only: 1/dp of the bytes the hooks moved."""
    from ..parallel.base import ReplicatedTransformer

    return inner.comm if isinstance(inner, ReplicatedTransformer) else None


def _forward_through_fsdp(inner) -> None:
    """Route ``inner.loss_terms`` (every forward the trainer runs: training, evaluation) through FSDP2's forward
    hooks. A mixture of experts' router probabilities are returned beside the loss terms, so FSDP2 gathers the
    weights again before backward reaches them through the load-balancing loss (its pre-backward hook sits on
    the forward's outputs, and ``RouterStats`` is not a container it looks into)."""
    loss_terms = inner.loss_terms

    def forward(tokens, labels, documents=None):
        terms = loss_terms(tokens, labels, documents)
        return terms, (None if terms.router is None else terms.router.probs)

    inner.fsdp_forward = forward
    register_fsdp_forward_method(inner, "fsdp_forward")
    inner.loss_terms = lambda tokens, labels, documents=None: inner.fsdp_forward(tokens, labels, documents)[0]


class _NoGradSum:
    """The model's gradient-sum strategy under FSDP2: none of its own (FSDP2 reduce-scatters in backward)."""

    def in_backward(self, params) -> list:
        return []

    @contextlib.contextmanager
    def over_pass(self, params):
        yield


def _rows_chunk(p) -> tuple[int, int, int]:
    """(rows of the local parameter, rows of one dp shard: ceil(rows/dp), elements of a row)."""
    shape, dp = p.shape, p.device_mesh.size()
    rows = shape[0] if len(shape) else 1
    return rows, -(-rows // dp), p.numel() // max(rows, 1)


class FSDPAdamW(AdamWSteps):
    """AdamW on the dp shards of a model FSDP2 has sharded (``shard_over_dp``), with ``optim.ReplicatedAdamW``'s
    interface: ``wait_for_weights``, ``reduce``, ``clip``, ``step``, ``discard``, ``state_dict`` /
    ``load_state_dict``, ``bytes``, ``tracked``, ``param_groups``, ``grad_sum``, ``measuring``."""

    grad_sum = _NoGradSum()

    def __init__(self, model, lr: float, weight_decay: float, units: list[FSDPModule] = ()):
        self.model, self.comms, self.units = model, model.comms(), list(units)
        self.dp: AxisComm = self.comms["dp"]
        sizes = {axis: comm.size for axis, comm in self.comms.items()}
        self.named = list(model.named_parameters())
        # Reference names and norm weights from the local shapes: the same functions --zero 0 and 1/2 use.
        self.terms, self.full_shapes = [], []
        for name, p in self.named:
            rows, chunk, per_row = _rows_chunk(p)
            lo = min(self.dp.rank * chunk * per_row, p.numel())
            local = p.to_local()
            self.terms.append(owned_norm_terms(model, name, p.shape, lo, lo + local.numel(), sizes, local.device))
            self.full_shapes.append(p.shape)
        refs = {name: [ref for ref, *_ in model.reference_parts(name, torch.empty(p.shape, device="meta"))]
                for name, p in self.named}
        self.optimizer = build_adamw(((refs[n], p) for n, p in self.named), lr, weight_decay)

    def wait_for_weights(self) -> None:
        """FSDP2 gathers the weights in the forward itself."""

    @contextlib.contextmanager
    def whole_weights(self):
        """Every unit's weights gathered for code that reads them outside a forward (the trainer's sample, through
        the inference engines), and sharded again after it."""
        for unit in self.units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in self.units:
                unit.reshard()

    def reduce(self) -> None:
        """FSDP2 reduce-scattered every backward pass as it ended."""

    def _grads(self):
        return [None if p.grad is None else p.grad.to_local() for _, p in self.named]

    def clip(self, max_norm: float) -> float:
        """The global gradient norm (each element once: the dp shards partition every local shard, so the squares
        are summed over dp too), then clipping to ``max_norm`` (0: none); returns the norm."""
        device = self.named[0][1].to_local().device
        chunks = ((g.reshape(-1).float(), terms) for g, terms in zip(self._grads(), self.terms) if g is not None)
        norm = global_grad_norm(owned_squares(chunks, device), comms_reduce(self.comms), over=("dp",))
        clip_grads_((g for g in self._grads() if g is not None), norm.to(device), max_norm)
        return norm.item()

    def step(self, lr: float | None = None) -> None:
        if self.measuring:
            self.measured_grad_bytes = live_bytes(self._grads())
        self.adamw_step(lr)
        self.discard()

    def discard(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def bytes(self) -> dict[str, int]:
        moments = [t.to_local() if hasattr(t, "to_local") else t for state in self.optimizer.state.values()
                   for t in state.values() if torch.is_tensor(t)]
        return {"grad_bytes": self.measured_grad_bytes, "optimizer_bytes": live_bytes(moments)}

    # -- checkpoints: --zero 0's full local shards, gathered for a save or load only ---------------------------

    def _full(self, sharded, label: str) -> torch.Tensor:
        """The whole local tensor from every dp rank's shard of ``sharded`` (a DTensor shaped like a parameter)."""
        local = sharded.to_local()
        rows, chunk, per_row = _rows_chunk(sharded)
        send = local.new_zeros(chunk * per_row)
        send[:local.numel()].copy_(local.reshape(-1))
        gathered = self.dp.all_gather(send, label=label)
        return gathered.reshape(-1)[:sharded.numel()].view(sharded.shape)

    @torch.no_grad()
    def state_dict(self):
        """(name, full local tensor) pairs and their full moments, for ``checkpoint.training_state``."""
        from .zero import _GatheredState

        named, state = [], _GatheredState()
        for name, p in self.named:
            full = self._full(p, "fsdp.checkpoint")
            moments = self.optimizer.state[p]
            state.state[full] = {key: self._full(moments[key], "fsdp.checkpoint") for key in ("exp_avg", "exp_avg_sq")
                                 if key in moments}
            if "step" in moments:
                state.state[full]["step"] = moments["step"].clone()
            named.append((name, full))
        return named, state

    @torch.no_grad()
    def load_state_dict(self, view, state: dict) -> None:
        """After ``checkpoint.load`` filled ``view`` (``state_dict``'s) and ``state``: keep this rank's shards."""
        from .checkpoint import restore_optimizer_steps

        named, gathered = view
        restore_optimizer_steps(gathered, state)
        for (_, p), (_, full) in zip(self.named, named):
            moments = gathered.state[full]
            self._keep_shard(p, full)
            own = self.optimizer.state[p]
            if "exp_avg" not in own:  # before the first step: AdamW's state, to be filled
                own.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                           exp_avg_sq=torch.zeros_like(p))
            own["step"].copy_(moments["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                self._keep_shard(own[key], moments[key])

    def _keep_shard(self, sharded, full: torch.Tensor) -> None:
        local = sharded.to_local()
        rows, chunk, per_row = _rows_chunk(sharded)
        lo = min(self.dp.rank * chunk * per_row, full.numel())
        local.view(-1).copy_(full.reshape(-1)[lo:lo + local.numel()])
