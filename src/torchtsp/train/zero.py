"""A distributed optimizer over the ``dp`` axis (ZeRO-1 and ZeRO-2, in the style of Megatron's), around any scheme.

Forward and backward are the scheme's own and untouched; only what happens to gradients and weights between two
forwards changes. Each local parameter (a TSP shard, a TP slice, a whole replicated tensor) is cut along its first
dim into ``dp`` chunks of ceil(rows / dp) rows (the last ones padded, or empty when there are fewer rows than
ranks). Data-parallel rank r owns chunk r of every local parameter: it keeps the AdamW moments and, under bf16,
the float32 master of that chunk only, so optimizer state per rank is 1/(dp·D) of the model's.

A step:

1. Backward. As autograd finishes a parameter's gradient (a post-accumulate hook), it is copied in float32 into its
   bucket: a [dp, width] buffer whose row r holds chunk r of each of the bucket's parameters, side by side; the
   parameter's ``.grad`` is dropped. When a bucket is full it is reduce-scattered over dp at once, so the
   reductions overlap the rest of backward. Buckets go out in bucket order; the first backward pass forms them
   in the order its gradients arrive (the same on every rank: the same graph), and later passes keep it, so
   the first step holds no more gradient than later ones. At the end of the backward pass (an autograd
   callback) the remaining transfers are waited for and each owned chunk of the sum is added, in the
   parameter's dtype, to this rank's owned gradient. Every backward pass is reduced on its own: with
   ``--grad-accum`` each micro-batch is reduced as it ends, exactly as ``--zero 0``'s all-reduce does.
   A pipeline's schedule runs a backward pass per microbatch: its gradients stay in ``.grad`` until the
   schedule ends, and are reduced then (``over_pass``), again as ``--zero 0`` sums them.
2. ZeRO-1 keeps every bucket's buffer from step to step (the full local gradient, in float32, stays allocated);
   ZeRO-2 allocates a bucket's buffer when its first gradient arrives and frees it once its reduce-scatter is
   done, with at most ``IN_FLIGHT`` buckets in flight: gradients outside the owned chunks live only that long.
3. The global gradient norm from the owned chunks: squares summed over dp (the chunks partition each shard) and
   over the model axes the way ``optim.global_grad_norm`` does (a replicated parameter counted once, a KV-head
   copy by its share, a vocabulary shard's padding rows not at all); clipping and the non-finite check as before.
4. AdamW on the owned chunks (elementwise, so each element gets exactly the update ``--zero 0`` gives it), then the
   updated chunks are all-gathered over dp, bucket by bucket, each as soon as its bucket's update is done; the
   gathers are waited for (``wait_for_weights``) before anything reads a weight again: the next forward (and
   with it TSP's cross-layer prefetch), an evaluation, a checkpoint, a sample.

Where the float operations differ from ``--zero 0``: a reduce-scatter sums the replicas' float32 gradients in rank
order, gloo's all-reduce in its ring's order (identical at dp = 2, where a + b = b + a; at most dp - 1 float32
roundings apart otherwise); the norm's squares are summed in another grouping. AdamW itself is elementwise and
the gradients are rounded to the parameter's dtype exactly as ``--zero 0`` rounds them.

Bytes per rank and step on the dp axis (n_p: elements of local parameter p, padded to dp whole chunks):
reduce-scatter (dp - 1)/dp · Σ n_p · 4 per backward pass, all-gather (dp - 1)/dp · Σ n_p · (parameter bytes):
in float32, ``--zero 0``'s all-reduce of 2 (dp - 1)/dp · Σ n_p · 4, plus the padding.

Checkpoints stay ``--zero 0``'s: ``gathered_state`` all-gathers the full local shards of masters and moments for
the save (reference names through DCP), ``load_gathered`` keeps this rank's chunks of what DCP loaded, so a run
resumes at any dp, D or ``--zero``. The full moments live only while a checkpoint is written or read.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from ..distributed.comm import AxisComm, Pending
from ..sizes import ZERO_IN_FLIGHT
from .optim import (
    build_adamw,
    clip_grads_,
    comms_reduce,
    global_grad_norm,
    owned_norm_terms,
    owned_squares,
)

DEFAULT_BUCKET_MB = 32.0
IN_FLIGHT = ZERO_IN_FLIGHT  # ZeRO-2: reduce-scatters in flight before the oldest is waited for (and its buffer freed)


# ---------------------------------------------------------------- the per-rank arithmetic, without collectives
# (pure functions of the tensors; the optimizer below calls them around its reduce-scatter and all-gather)


def chunk_elements(shape: tuple[int, ...] | torch.Size, dp: int) -> int:
    """Elements per dp chunk of a parameter of ``shape``: ceil(rows / dp) whole rows (dim 0; a scalar is a row)."""
    rows = shape[0] if len(shape) else 1
    numel = math.prod(shape)
    per_row = numel // max(rows, 1)
    return -(-rows // dp) * per_row


def owned_span(numel: int, chunk: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of the flattened parameter dp rank ``rank`` owns: chunk ``rank``, cut at the end (the last ranks'
    chunks padded, or empty when there are fewer rows than ranks)."""
    return min(rank * chunk, numel), min((rank + 1) * chunk, numel)


def split_chunks(flat: torch.Tensor, chunk: int, dp: int):
    """(full chunks [k, chunk], the last partial one or None) of ``flat``'s elements as dp chunks (views)."""
    k = min(flat.numel() // chunk, dp)
    rest = flat[k * chunk:]
    return flat[:k * chunk].view(k, chunk), (rest if rest.numel() else None)


def fill_rows(rows: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``rows`` [dp, chunk] (a bucket's columns of one parameter), chunk r into row r; the
    padding past the parameter's end is left as it is (zeros in a fresh buffer)."""
    full, rest = split_chunks(flat, rows.shape[1], rows.shape[0])
    rows[:len(full)].copy_(full)
    if rest is not None:
        rows[len(full), :rest.numel()].copy_(rest)


def accumulate(owned: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """The owned gradient after one more reduced pass (a micro-batch) adds ``part``: the sum over passes, as
    ``--zero 0`` sums ``.grad`` across micro-batches."""
    return part if owned is None else owned.add_(part)


@dataclass(eq=False)
class _Slot:
    """One local parameter: the span of its flattened elements this rank owns, its place in a bucket."""

    name: str
    param: torch.nn.Parameter
    chunk: int  # elements per dp chunk (whole rows)
    lo: int  # this rank's owned elements: [lo, hi) of the flattened parameter
    hi: int
    bucket: int = 0
    offset: int = 0  # where the parameter's chunks start in its bucket's rows
    grad: torch.Tensor | None = None  # the owned chunk of the summed gradient, in the parameter's dtype
    master: torch.nn.Parameter | None = None  # what AdamW updates: the owned chunk in float32
    norm_terms: list = field(default_factory=list)  # how the owned elements enter the norm (``_norm_terms``)

    @property
    def numel(self) -> int:
        return self.param.numel()

    def chunks_of(self, flat: torch.Tensor, dp: int):
        """(full rows [k, chunk], the last partial row or None) of ``flat``'s elements, as dp chunks."""
        return split_chunks(flat, self.chunk, dp)


@dataclass(eq=False)
class _Bucket:
    slots: list
    width: int  # elements of one row: the bucket's dp chunks of each of its parameters
    buffer: torch.Tensor | None = None  # [dp, width] float32 gradients
    arrived: int = 0
    pending: Pending | None = None


class ZeroOptimizer:
    """AdamW over the owned dp chunks of ``model``'s parameters, with gradients reduce-scattered and weights
    all-gathered over ``model.comms()["dp"]``. ``level``: 1 or 2 (above). ``master_weights``: keep float32
    masters of the owned chunks and the parameters in bfloat16 (mixed precision); else the parameters are
    float32 and AdamW updates their owned chunks in place. ``foreach``: ``build_adamw``'s, for each bucket's AdamW.

    The model sums its gradients with this optimizer's reduce-scatter once it is given it,
    ``model.sum_gradients_with(opt.grad_sum)``: in backward through gradient hooks, or, for a pipeline, as each
    schedule ends. Use, as ``optim.ReplicatedAdamW``: ``wait_for_weights()`` before a forward;
    ``model.forward_backward(...)``; ``reduce()``; ``clip(max_norm)``; ``step(lr)``. ``param_groups``: those of
    the AdamW optimizers over the chunks (one per bucket)."""

    def __init__(self, model, level: int, lr: float, weight_decay: float, *, master_weights: bool = False,
                 bucket_mb: float = DEFAULT_BUCKET_MB, poison: bool = False, foreach: bool | None = None):
        if level not in (1, 2):
            raise ValueError(f"ZeroOptimizer level must be 1 or 2, got {level!r}")
        self.model, self.level, self.comms = model, level, model.comms()
        self.dp: AxisComm = self.comms["dp"]
        self.sizes = {axis: comm.size for axis, comm in self.comms.items()}
        self.overlap = False  # reducing in backward: the model called ``in_backward`` (its gradient-sum strategy)
        self._after_passes = False  # the model reduces whole passes (``over_pass``): ``reduce`` has nothing left
        self.poison = poison  # tests: non-owned weights are NaN until their gather lands
        self.foreach = foreach  # AdamW's multi-tensor step within each bucket or not (``build_adamw``)
        self.measuring = False  # record the live gradient bytes at each bucket's issue (``grad_peak``)
        self.grad_peak = 0
        self.measured_grad_bytes = 0  # ``step``'s record while ``measuring``
        self.issued_early = 0  # reduce-scatters issued while backward had gradients left to compute (a count)
        dp, r = self.dp.size, self.dp.rank
        self.slots: list[_Slot] = []
        for name, p in model.named_parameters():
            if not p.is_contiguous():
                raise ValueError(f"ZeroOptimizer needs contiguous parameters; {name} is not")
            chunk = chunk_elements(p.shape, dp)
            self.slots.append(_Slot(name, p, chunk, *owned_span(p.numel(), chunk, r)))
        for slot in self.slots:
            slot.norm_terms = self._norm_terms(slot)
            owned = slot.param.detach().view(-1)[slot.lo:slot.hi]
            slot.master = torch.nn.Parameter(owned.float().clone() if master_weights else owned)
            if master_weights:
                slot.param.data = slot.param.data.to(torch.bfloat16)
        self.master_weights = master_weights
        self._refs = {s.name: [ref for ref, *_ in model.reference_parts(s.name, s.param)] for s in self.slots}
        self._lr, self._weight_decay, self._bucket_bytes = lr, weight_decay, int(bucket_mb * 2**20)
        self._layout(list(reversed(self.slots)))  # backward produces the last layers' gradients first
        self._arrivals: list[_Slot] | None = None  # the first backward pass's arrival order (``in_backward``)
        self._gathers: list[tuple[_Bucket, Pending]] = []
        self._issued = 0  # buckets issued in this backward pass (they go out in bucket order)
        self._in_pass = False

    # -- the model's gradient-sum strategy (as parallel/dp.py's ``AllReduceGrads``) -----------------

    @property
    def grad_sum(self) -> ZeroOptimizer:
        """What the model sums its gradients over dp with (``model.sum_gradients_with``): this optimizer's
        reduce-scatter, in place of the model's all-reduce."""
        return self

    def in_backward(self, params) -> list:
        """Reduce in backward: a hook per parameter copies its gradient into its bucket as autograd finishes it;
        the first pass records the order gradients arrive in (``_follow_arrivals``). Returns the hooks' handles."""
        by_param = {slot.param: slot for slot in self.slots}
        self.overlap, self._arrivals = True, []
        return [p.register_post_accumulate_grad_hook(self._grad_ready(by_param[p])) for p in params]

    @contextlib.contextmanager
    def over_pass(self, params):
        """Reduce the gradients of a whole pass (a pipeline schedule's microbatches) as it ends: a micro-batch of
        accumulation is reduced on its own, as --zero 0 sums it."""
        self._after_passes = True
        yield
        self._reduce_now()

    # -- layout -----------------------------------------------------------------------

    def _layout(self, order: list[_Slot]) -> None:
        """Buckets of about ``bucket_bytes`` (float32, all dp rows) of the parameters in ``order``, and one AdamW
        per bucket (a bucket's weights can be sent while the next bucket's are updated); moments already made
        (a loaded checkpoint) move with their chunks."""
        old = getattr(self, "optimizers", [])
        states = {m: st for opt in old for m, st in opt.state.items()}
        lr = old[0].param_groups[0]["lr"] if old else self._lr  # a learning rate already set is kept
        self.buckets = self._make_buckets(order, self._bucket_bytes)
        self.optimizers = [build_adamw(((self._refs[s.name], s.master) for s in b.slots), lr,
                                       self._weight_decay, self.foreach) for b in self.buckets]
        for slot in self.slots:
            if slot.master in states:
                self._state(slot).update(states[slot.master])
        if self.level == 1:
            for bucket in self.buckets:
                bucket.buffer = torch.zeros(self.dp.size, bucket.width, device=bucket.slots[0].param.device)

    def _make_buckets(self, order: list[_Slot], bucket_bytes: int) -> list[_Bucket]:
        buckets, current, width = [], [], 0
        for slot in order:
            if current and (width + slot.chunk) * self.dp.size * 4 > bucket_bytes:
                buckets.append(_Bucket(current, width))
                current, width = [], 0
            slot.bucket, slot.offset = len(buckets), width
            current.append(slot)
            width += slot.chunk
        if current:
            buckets.append(_Bucket(current, width))
        return buckets

    def _norm_terms(self, slot: _Slot) -> list:
        """How the owned elements enter the global norm (``optim.owned_norm_terms``)."""
        return owned_norm_terms(self.model, slot.name, slot.param.shape, slot.lo, slot.hi, self.sizes,
                                slot.param.device)

    # -- gradients ----------------------------------------------------------------------

    def _grad_ready(self, slot: _Slot):
        def hook(param: torch.nn.Parameter) -> None:
            if not self._in_pass:  # the first gradient of a backward pass: reduce the rest when it ends
                self._in_pass = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_pass)
                if self._arrivals is not None:
                    self.buckets, self._open, self._open_width = [], [], 0
            if self._arrivals is not None:
                self._arrive_first(slot)
                return
            self._take(slot)
            bucket = self.buckets[slot.bucket]
            if bucket.arrived == len(bucket.slots):
                self._issue_ready()
                if self._issued < len(self.buckets):  # sent while backward still computes later buckets
                    self.issued_early += 1
        return hook

    def _arrive_first(self, slot: _Slot, early: bool = True) -> None:
        """The first backward pass: buckets are formed in the order gradients arrive, each issued as soon as the
        next gradient would overflow it, so this pass holds no more than later ones. A static order (reverse
        registration) would hold the whole gradient where a scheme sums some gradients in one node at the end
        of backward (TSP's norm weights): every bucket would wait for them. Every rank runs the same graph, so
        every rank forms the same buckets (``_follow_arrivals`` relies on this too)."""
        if self._open and (self._open_width + slot.chunk) * self.dp.size * 4 > self._bucket_bytes:
            self._close_open(early)
        slot.bucket, slot.offset = len(self.buckets), self._open_width
        self._open.append(slot)
        self._open_width += slot.chunk
        self._arrivals.append(slot)

    def _close_open(self, early: bool) -> None:
        """Issue the first pass's bucket being formed: its gradients copied in, their ``.grad`` dropped."""
        self.buckets.append(_Bucket(self._open, self._open_width))
        for slot in self._open:
            self._take(slot)
        self._open, self._open_width = [], 0
        self._issue_ready()
        self.issued_early += early

    def _take(self, slot: _Slot) -> None:
        """Copy the parameter's gradient into its bucket (float32, as dp chunks) and drop ``.grad``."""
        grad, bucket = slot.param.grad, self.buckets[slot.bucket]
        slot.param.grad = None
        if bucket.buffer is None:  # ZeRO-2: allocated per pass, zero where chunks are padded
            bucket.buffer = torch.zeros(self.dp.size, bucket.width, device=slot.param.device)
        rows = bucket.buffer[:, slot.offset:slot.offset + slot.chunk]
        if grad is None:  # no gradient this pass: zeros (a kept ZeRO-1 buffer holds the last pass's)
            rows.zero_()
        else:
            fill_rows(rows, grad.detach().reshape(-1))
        bucket.arrived += 1

    def _issue_ready(self) -> None:
        """Issue, in bucket order, every bucket whose gradients are all in (the same order on every rank)."""
        while self._issued < len(self.buckets) and self.buckets[self._issued].arrived == len(
                self.buckets[self._issued].slots):
            self._issue(self.buckets[self._issued])

    def _issue(self, bucket: _Bucket) -> None:
        if bucket.buffer is None:
            bucket.buffer = torch.zeros(self.dp.size, bucket.width, device=bucket.slots[0].param.device)
        bucket.pending = self.dp.reduce_scatter(bucket.buffer, async_op=True, label="zero.grad")
        self._issued += 1
        if self.measuring:
            self.grad_peak = max(self.grad_peak, self._live_grad_bytes())
        if self.level == 2 and self._issued > IN_FLIGHT:
            self._finish(self.buckets[self._issued - 1 - IN_FLIGHT])

    def _finish(self, bucket: _Bucket) -> None:
        """Wait for ``bucket``'s reduce-scatter and add its owned chunks to the owned gradients."""
        if bucket.pending is None:
            return
        total = bucket.pending.wait()
        bucket.pending, bucket.arrived = None, 0
        for slot in bucket.slots:
            part = total[slot.offset:slot.offset + slot.hi - slot.lo].to(slot.param.dtype)
            slot.grad = accumulate(slot.grad, part)
        if self.level == 2:
            bucket.buffer = None

    def _end_of_pass(self) -> None:
        """After a backward pass: reduce the buckets still unissued (a parameter without a gradient adds zeros),
        wait for every transfer, and start the next pass afresh."""
        if self._arrivals is not None and self._in_pass:  # the first pass: close its buckets, then the rest
            arrived = set(self._arrivals)
            for slot in self.slots:
                if slot not in arrived:
                    self._arrive_first(slot, early=False)
            if self._open:
                self._close_open(early=False)
        for bucket in self.buckets[self._issued:]:
            self._issue(bucket)
        for bucket in self.buckets:
            self._finish(bucket)
        self._issued, self._in_pass = 0, False
        if self._arrivals is not None:
            self._follow_arrivals()

    def _follow_arrivals(self) -> None:
        """After the first backward pass: later passes keep its buckets, in the order its gradients arrived (its
        moments, if a checkpoint was loaded, move with their chunks)."""
        order, self._arrivals = list(dict.fromkeys(self._arrivals)), None
        self._layout(order)

    def reduce(self) -> None:
        """After the step's backward: with hooks or after a pipeline's passes, nothing is left to do (each pass was
        reduced as it ended); else (no strategy given to the model) reduce ``.grad`` of every parameter now."""
        if self.overlap:
            if self._in_pass:  # a backward that ran outside autograd's engine callbacks (never in practice)
                self._end_of_pass()
            return
        if not self._after_passes:
            self._reduce_now()

    reduce_gradients = reduce

    def _reduce_now(self) -> None:
        """Reduce-scatter the ``.grad`` every parameter holds now, bucket by bucket."""
        for bucket in self.buckets:  # one bucket's float32 buffer at a time under ZeRO-2
            for slot in bucket.slots:
                self._take(slot)
            self._issue_ready()
        self._end_of_pass()

    def _live_grad_bytes(self) -> int:
        from ..memory import live_bytes

        tensors = [s.grad for s in self.slots if s.grad is not None]
        tensors += [s.param.grad for s in self.slots if s.param.grad is not None]
        tensors += [b.buffer for b in self.buckets if b.buffer is not None]
        return live_bytes(tensors)

    def grad_bytes(self) -> int:
        """Live gradient bytes now (owned chunks, their float32 copies for the masters, kept buffers)."""
        extra = [s.master.grad for s in self.slots if s.master.grad is not None]
        from ..memory import live_bytes

        tensors = [s.grad for s in self.slots if s.grad is not None] + extra
        tensors += [b.buffer for b in self.buckets if b.buffer is not None]
        return live_bytes(tensors)

    # -- norm, clipping, step ---------------------------------------------------------------

    def _master_grads(self) -> None:
        for slot in self.slots:
            g = slot.grad if slot.grad is not None else torch.zeros_like(slot.master, dtype=slot.param.dtype)
            slot.master.grad = g.float() if self.master_weights else g

    def local_squares(self) -> dict[tuple[str, ...], torch.Tensor]:
        """This rank's share of the squared gradient norm from its owned chunks (``optim.local_squares``'s
        form: weighed sums of squares by the model axes their pieces are sharded over)."""
        self._master_grads()
        return owned_squares(((slot.master.grad, slot.norm_terms) for slot in self.slots), self.slots[0].param.device)

    def clip(self, max_norm: float) -> float:
        """Scale the gradients to a global norm of at most ``max_norm`` (0: no clipping); returns the norm."""
        return self.clip_on_device(max_norm).item()

    def clip_on_device(self, max_norm: float) -> torch.Tensor:
        """``clip``, the norm left a tensor where it was computed (no host read: see ``ReplicatedAdamW``'s). The norm
        is optim.global_grad_norm's, each element once (see the module docstring): the owned chunks partition every
        shard, so the squares are summed over dp too (and over pipeline stages)."""
        over = ("dp", "pp") if "pp" in self.comms else ("dp",)
        norm = global_grad_norm(self.local_squares(), comms_reduce(self.comms), over)
        clip_grads_((slot.master.grad for slot in self.slots), norm, max_norm)
        return norm

    clip_ = clip

    @property
    def param_groups(self) -> list[dict]:
        """Every bucket's AdamW groups (set the learning rate on each)."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def _state(self, slot: _Slot) -> dict:
        return self.optimizers[slot.bucket].state[slot.master]

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        """AdamW on the owned chunks (at learning rate ``lr``, if given), bucket by bucket, each bucket's all-gather
        of its updated chunks issued as soon as its update is done (waited for by ``wait_for_weights``); the
        gradients are dropped. While ``measuring``, the live gradient bytes before the update are recorded."""
        if self.measuring:
            self.measured_grad_bytes, self.grad_peak = max(self.grad_peak, self.grad_bytes()), 0
        for group in self.param_groups if lr is not None else ():
            group["lr"] = lr
        for bucket, optimizer in zip(self.buckets, self.optimizers):
            optimizer.step()
            self._gather(bucket)
        self.zero_grad()

    def discard(self) -> None:
        """Drop this step's gradients without an update (a non-finite step)."""
        self.zero_grad()

    def _gather(self, bucket: _Bucket) -> None:
        dtype = bucket.slots[0].param.dtype
        send = torch.zeros(bucket.width, dtype=dtype, device=bucket.slots[0].param.device)
        for slot in bucket.slots:
            flat = slot.param.data.view(-1)
            if self.master_weights:
                flat[slot.lo:slot.hi].copy_(slot.master)  # rounded to bf16 as --zero 0 rounds its params
            send[slot.offset:slot.offset + slot.hi - slot.lo].copy_(flat[slot.lo:slot.hi])
            if self.poison:
                flat[:slot.lo].fill_(float("nan"))
                flat[slot.hi:].fill_(float("nan"))
        self._gathers.append((bucket, self.dp.all_gather(send, async_op=True, label="zero.weights")))

    @torch.no_grad()
    def wait_for_weights(self) -> None:
        """Finish the all-gathers of updated weights: every parameter holds its full value again."""
        for bucket, pending in self._gathers:
            rows = pending.wait()
            for slot in bucket.slots:
                full, rest = slot.chunks_of(slot.param.data.view(-1), self.dp.size)
                full.copy_(rows[:len(full), slot.offset:slot.offset + slot.chunk])
                if rest is not None:
                    rest.copy_(rows[len(full), slot.offset:slot.offset + rest.numel()])
        self._gathers = []

    def zero_grad(self, set_to_none: bool = True) -> None:  # gradients are always dropped, never zeroed
        for slot in self.slots:
            slot.grad = slot.master.grad = slot.param.grad = None

    def optimizer_bytes(self) -> int:
        """Live bytes of the AdamW moments and the float32 masters (under mixed precision) on this rank."""
        from ..memory import live_bytes

        tensors = [t for opt in self.optimizers for state in opt.state.values() for t in state.values()
                   if torch.is_tensor(t)]
        return live_bytes(tensors + ([s.master for s in self.slots] if self.master_weights else []))

    def bytes(self) -> dict[str, int]:
        """Live bytes on this rank: gradients at their fullest in the last measured step, optimizer state now."""
        return {"grad_bytes": self.measured_grad_bytes, "optimizer_bytes": self.optimizer_bytes()}

    @property
    def tracked(self) -> list:
        """What a step's peak-memory measure counts of the tensors that exist before it: the moments."""
        return list(self.optimizers)

    # -- checkpoints ------------------------------------------------------------------

    def _full(self, slot: _Slot, owned: torch.Tensor, label: str) -> torch.Tensor:
        """The whole local parameter's tensor from every dp rank's owned chunk of it."""
        send = owned.new_zeros(slot.chunk)
        send[:owned.numel()].copy_(owned)
        rows = self.dp.all_gather(send, label=label)
        return rows.reshape(-1)[:slot.numel].view(slot.param.shape)

    @torch.no_grad()
    def gathered_state(self) -> tuple[list, _GatheredState]:
        """(name, full tensor AdamW updates) pairs and their full moments, for ``checkpoint.training_state``."""
        self.wait_for_weights()
        named, state = [], _GatheredState()
        for slot in self.slots:
            full = self._full(slot, slot.master.detach(), "zero.checkpoint") if self.master_weights else slot.param
            moments = self._state(slot)
            state.state[full] = {key: self._full(slot, moments[key], "zero.checkpoint") for key in
                                 ("exp_avg", "exp_avg_sq") if key in moments}
            if "step" in moments:
                state.state[full]["step"] = moments["step"].clone()
            named.append((slot.name, full))
        return named, state

    @torch.no_grad()
    def load_gathered(self, named: list, state: _GatheredState) -> None:
        """Keep this rank's chunks of the full tensors a checkpoint was loaded into (``gathered_state``'s)."""
        for slot, (_, full) in zip(self.slots, named):
            flat = full.detach().reshape(-1)
            if self.master_weights:
                slot.master.copy_(flat[slot.lo:slot.hi])
                slot.param.data.copy_(full)
            moments = state.state[full]
            self.optimizers[slot.bucket].state[slot.master] = {
                "step": moments["step"].clone(),
                **{key: moments[key].reshape(-1)[slot.lo:slot.hi].clone() for key in ("exp_avg", "exp_avg_sq")}}

    def state_dict(self) -> tuple[list, _GatheredState]:
        """(name, full tensor) pairs and their moments, for ``checkpoint.training_state``: the full local shards
        of masters and moments, gathered for this save or load only (``gathered_state``)."""
        return self.gathered_state()

    def load_state_dict(self, view: tuple[list, _GatheredState], state: dict) -> None:
        """After ``checkpoint.load`` filled ``view`` (``state_dict``'s) and ``state``: keep this rank's chunks."""
        from .checkpoint import restore_optimizer_steps

        named, gathered = view
        restore_optimizer_steps(gathered, state)
        self.load_gathered(named, gathered)


class _GatheredState:
    """What ``checkpoint.training_state`` reads of an optimizer: ``state[tensor]`` -> its moments."""

    def __init__(self):
        self.state: dict = {}
