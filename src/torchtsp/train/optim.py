"""Optimizer pieces shared by the single-device reference loop and the parallel trainer."""

from __future__ import annotations

import math

import torch

from ..distributed.comm import AxisComm
from ..host import on_host
from ..memory import live_bytes


def warmup_cosine(step: int, steps: int, warmup: int, min_ratio: float = 0.1) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = steps - 1 - warmup
    progress = 1.0 if decay_steps <= 0 else (step - warmup) / decay_steps
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def is_norm_weight(reference_name: str) -> bool:
    return reference_name.endswith("norm.weight")


def build_adamw(named_params, lr: float, weight_decay: float, foreach: bool | None = None) -> torch.optim.AdamW:
    """AdamW over the given (name, parameter) pairs; norm weights get no weight decay.

    ``named_params`` yields (reference names of the parameter, parameter): a sharded parameter may
    hold pieces of several reference parameters; it is a norm only if all of them are. ``foreach``: torch's
    multi-tensor step (True), its per-tensor loop (False), or torch's choice for the parameters' device (None:
    multi-tensor on CUDA, the loop on CPU). The multi-tensor step holds sqrt(v) of every parameter at once, so
    a trace standing for a CUDA rank on CPU tensors asks for it (``torchtsp.trace``).
    """
    decay, no_decay = [], []
    for names, p in named_params:
        (no_decay if all(is_norm_weight(n) for n in names) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95), foreach=foreach)


def norm_weight(shard_dims: dict, sizes: dict[str, int]) -> float:
    """How much one rank's copy of a gradient piece counts in the global norm.

    ``shard_dims``: {mesh axis: dim} the piece is sharded over (``reference_parts``'s third item); an entry
    ``{axis: (dim, chunks)}`` says only ``chunks`` distinct slices exist over the axis's ``sizes[axis]`` ranks
    (a KV-head copy when n_kv < D), so each rank's copy weighs chunks/size and the sum over the axis counts
    each slice once. Replicated pieces (no entry) are counted as they are: every rank holds the same values.
    """
    weight = 1.0
    for axis, dim in shard_dims.items():
        if isinstance(dim, tuple):
            weight *= dim[1] / sizes[axis]
    return weight


def norm_key(shard_dims: dict) -> tuple[str, ...]:
    """The mesh axes a piece's squares are summed over: those it is sharded over, in a fixed order."""
    return tuple(sorted(shard_dims))


def local_squares(pieces, sizes: dict[str, int]) -> dict[tuple[str, ...], torch.Tensor]:
    """This rank's share of the squared gradient norm, by ``norm_key``: ``pieces`` yields (piece of a gradient,
    {mesh axis: dim} it is sharded over), each piece's squares weighed by ``norm_weight``."""
    squares: dict[tuple[str, ...], torch.Tensor] = {}
    for piece, shard_dims in pieces:
        square = piece.float().pow(2).sum() * norm_weight(shard_dims, sizes)
        key = norm_key(shard_dims)
        squares[key] = squares[key] + square if key in squares else square
    return squares


def global_grad_norm(squares: dict[tuple[str, ...], torch.Tensor], all_reduce, over=()) -> torch.Tensor:
    """L2 norm of the whole model's gradient, each element counted once, from every rank's ``squares``.

    ``squares``: this rank's weighed sums of squares by the mesh axes their pieces are sharded over
    (``local_squares``, or ZeRO's owned chunks). Each sum is added up over its own axes; replicated sums are
    already whole. ``over``: axes whose ranks hold disjoint parts of everything (ZeRO's dp chunks, pipeline
    stages): the total is added up over them too. ``all_reduce(tensor, axis)`` sums a tensor over one mesh
    axis (``AxisComm.all_reduce``; tests sum simulated ranks): the only communication.
    """
    total = None
    for axes in sorted(squares):
        sq = torch.as_tensor(squares[axes], dtype=torch.float32)
        for axis in axes:
            sq = all_reduce(sq, axis)
        total = sq if total is None else total + sq
    total = torch.zeros(()) if total is None else total
    for axis in over:
        total = all_reduce(total, axis)
    return total.sqrt()


MAX_NORM_RUNS = 64  # runs of equally weighted elements a chunk's norm terms list before keeping weights


def owned_norm_terms(model, name: str, shape, lo: int, hi: int, sizes: dict[str, int], device) -> list:
    """How elements [lo, hi) of the flattened local parameter ``name`` (a data-parallel rank's chunk of it: ZeRO's
    owned chunk, FSDP's shard) enter the global norm: (mesh axes they are sharded over, start, end, weight,
    per-element weights or None), relative to ``lo``; the weight 1 for an element counted as it is, chunks/size
    for a slice several ranks hold, 0 for padding no reference tensor has (``norm_weight``). Packed shards lay
    their pieces out one after another, so a few runs of [start, end) cover them; a layout with more runs keeps
    per-element weights (on ``device``). The layout is host bookkeeping from shapes and the mesh, computed on host
    tensors (``host.on_host``), so a fake-tensor trace (``torchtsp.trace``) reads it as a real run does."""
    with on_host():
        weight, group = torch.zeros(shape), torch.full(shape, -1, dtype=torch.int16)
        keys: list[tuple] = []
        # The same pieces, in the same order, of two tensors shaped like the parameter: weights, and key ids.
        for (_, w, dims), (_, g, _) in zip(model.reference_parts(name, weight), model.reference_parts(name, group)):
            key = norm_key(dims)
            if key not in keys:
                keys.append(key)
            w.fill_(norm_weight(dims, sizes))
            g.fill_(keys.index(key))
        owned_w, owned_g = weight.view(-1)[lo:hi], group.view(-1)[lo:hi]
        if owned_w.numel() == 0:
            return []
        edges = ((owned_w[1:] != owned_w[:-1]) | (owned_g[1:] != owned_g[:-1])).nonzero().view(-1) + 1
        bounds = [0, *edges.tolist(), owned_w.numel()]
        if len(bounds) <= MAX_NORM_RUNS:
            return [(keys[int(owned_g[a])], a, b, float(owned_w[a]), None) for a, b in zip(bounds, bounds[1:])
                    if owned_g[a] >= 0 and owned_w[a] != 0]
        per_element = [torch.where(owned_g == i, owned_w, 0.0) for i in range(len(keys))]
    # On the step's device: the per-element weights are read in every step's norm (fake tensors in a trace).
    return [(key, 0, owned_w.numel(), 1.0, w.to(device)) for key, w in zip(keys, per_element)]


def owned_squares(chunks, device) -> dict[tuple[str, ...], torch.Tensor]:
    """``local_squares`` of data-parallel chunks: ``chunks`` yields (a flat float32 gradient chunk, its
    ``owned_norm_terms``). A rank that owns no element still takes part in the sums, with a zero on ``device``."""
    squares: dict[tuple[str, ...], torch.Tensor] = {(): torch.zeros((), device=device)}
    for g, terms in chunks:
        for key, start, end, factor, weights in terms:
            part = g[start:end].pow(2)
            sq = part.sum() * factor if weights is None else (part * weights).sum()
            squares[key] = squares[key] + sq if key in squares else sq
    return squares


def comms_reduce(comms: dict[str, AxisComm]):
    """``global_grad_norm``'s ``all_reduce`` over a model's comms."""
    return lambda tensor, axis: comms[axis].all_reduce(tensor, label="grad_norm")


def clip_grads_(grads, norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place so their global ``norm`` becomes at most ``max_norm`` (0: no clipping), as
    ``torch.nn.utils.clip_grad_norm_`` does (the same 1e-6)."""
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale)


class MasterWeights:
    """bf16 parameters for compute and communication; fp32 master copies own the optimizer.

    ``grads_to_masters`` before clipping and the optimizer step, ``masters_to_params`` after it.
    """

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
        for p in params:
            p.data = p.data.to(torch.bfloat16)

    def grads_to_masters(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def masters_to_params(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.copy_(m)


class AdamWSteps:
    """What the trainer's optimizers share around torch's AdamW (``self.optimizer``): its groups, what a step's
    peak-memory measure counts of the tensors that exist before it (the moments), and a step at a learning rate."""

    measuring, measured_grad_bytes = False, 0  # measuring: record the gradients' bytes at their fullest

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def tracked(self) -> list:
        return [self.optimizer]

    def adamw_step(self, lr: float | None) -> None:
        """AdamW at learning rate ``lr`` (if given)."""
        for group in self.param_groups if lr is not None else ():
            group["lr"] = lr
        self.optimizer.step()


class ReplicatedAdamW(AdamWSteps):
    """AdamW on whole local tensors (``--zero 0``): every data-parallel replica updates its own copy alike, its
    gradients summed by the model's own all-reduce. ``master_weights``: bfloat16 parameters with float32
    masters (``MasterWeights``); ``foreach``: ``build_adamw``'s. One interface with ``train/zero.py``'s
    ``ZeroOptimizer``: ``wait_for_weights``, ``reduce``, ``clip``, ``step``, ``discard``, ``state_dict`` /
    ``load_state_dict``, ``bytes``."""

    grad_sum = None  # the model keeps its own gradient sum over replicas

    def __init__(self, model, lr: float, weight_decay: float, *, master_weights: bool = False,
                 foreach: bool | None = None):
        self.model, self.comms = model, model.comms()
        params = dict(model.named_parameters())
        self.master = MasterWeights(list(params.values())) if master_weights else None
        trained = self.master.masters if self.master else list(params.values())
        self.named = list(zip(params, trained))
        refs = {name: [ref for ref, *_ in model.reference_parts(name, p)] for name, p in params.items()}
        self.optimizer = build_adamw(((refs[n], p) for n, p in self.named), lr, weight_decay, foreach)

    def wait_for_weights(self) -> None:
        """Every weight is whole and current after ``step``: nothing to wait for."""

    def reduce(self) -> None:
        """The model summed the gradients over replicas in backward; the masters take them."""
        if self.master:
            self.master.grads_to_masters()

    def clip(self, max_norm: float) -> float:
        """Scale the gradients to a global norm of at most ``max_norm`` (0: no clipping); returns the norm."""
        return self.clip_on_device(max_norm).item()

    def clip_on_device(self, max_norm: float) -> torch.Tensor:
        """``clip``, the norm left a tensor where it was computed: no host read (a fake-tensor trace has no value
        to read, and a caller that needs no number need not wait for one)."""
        pieces = ((piece, dims) for name, p in self.named
                  for _, piece, dims in self.model.reference_parts(name, p.grad))
        squares = local_squares(pieces, {axis: comm.size for axis, comm in self.comms.items()})
        # Each pipeline stage's squares cover its own parameters: they are summed over the stages.
        norm = global_grad_norm(squares, comms_reduce(self.comms), over=("pp",) if "pp" in self.comms else ())
        clip_grads_((p.grad for _, p in self.named), norm, max_norm)
        return norm

    def step(self, lr: float | None = None) -> None:
        """AdamW at learning rate ``lr`` (if given), then the gradients are dropped and bf16 weights refreshed."""
        if self.measuring:  # the gradients at their fullest: reduced, before the update
            self.measured_grad_bytes = live_bytes([p.grad for p in self.model.parameters()] +
                                                  [p.grad for _, p in self.named])
        self.adamw_step(lr)
        self.discard()
        if self.master:
            self.master.masters_to_params()

    def discard(self) -> None:
        """Drop this step's gradients (after the update, or instead of it for a non-finite step)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def bytes(self) -> dict[str, int]:
        """Live bytes on this rank: gradients at their fullest in the last measured step, optimizer state (AdamW
        moments and float32 masters) now."""
        moments = [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return {"grad_bytes": self.measured_grad_bytes,
                "optimizer_bytes": live_bytes(moments + (self.master.masters if self.master else []))}

    def state_dict(self) -> tuple[list, torch.optim.Optimizer]:
        """(name, tensor AdamW updates) pairs and the optimizer holding their moments, for
        ``checkpoint.training_state``, which loads into them in place."""
        return self.named, self.optimizer

    def load_state_dict(self, view, state: dict) -> None:
        """After ``checkpoint.load`` filled ``view`` (``state_dict``'s) and ``state``."""
        from .checkpoint import restore_optimizer_steps

        restore_optimizer_steps(view[1], state)
        if self.master:
            self.master.masters_to_params()
