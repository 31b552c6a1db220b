"""What the ranks of tests/test_zero.py run (importable by spawned ranks): the distributed optimizer through its
Python API on a dp x tsp mesh, against plain AdamW on the same model."""

import torch

import torchtsp
from helpers import batch
from torchtsp.distributed.comm import Traffic
from torchtsp.train.optim import build_adamw
from torchtsp.train.zero import ZeroOptimizer

LR, WEIGHT_DECAY = 3e-3, 0.1


def api_run(level: int, steps: int = 3, poison: bool = False, bucket_mb: float = 0.05, dp: int = 2,
            tsp: int = 2) -> dict:
    """``steps`` AdamW steps of the tiny model (no clipping) with the distributed optimizer at ``level`` (0: plain
    AdamW over the local shards, as ``--zero 0``); the losses, the bytes each dp operation moved on this rank in
    the last step, every local parameter's shape, and how many buckets went out during backward."""
    cfg = torchtsp.get_preset("tiny")
    torch.manual_seed(0)
    mesh = torchtsp.init_mesh(dp=dp, tsp=tsp)
    model = torchtsp.parallelize(torchtsp.Transformer(cfg, device="meta"), mesh, "tsp")
    if level:
        opt = ZeroOptimizer(model, level, LR, WEIGHT_DECAY, bucket_mb=bucket_mb, poison=poison)
    else:
        refs = {n: [ref for ref, *_ in model.reference_parts(n, p)] for n, p in model.named_parameters()}
        opt = build_adamw(((refs[n], p) for n, p in model.named_parameters()), LR, WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        tokens, labels = batch(cfg, 4, 32, seed=step)
        with Traffic(model.comms()) as traffic:
            if level:
                opt.wait_for_weights()
            losses.append(model.forward_backward(tokens, labels).item())
            if level:
                opt.reduce_gradients()
                opt.grad_norm()  # fills the masters' gradients (no clipping: the float ops of --zero 0)
            opt.step()
            if level:
                opt.wait_for_weights()
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    return {"losses": losses, "dp_bytes": traffic.stats["dp"].bytes_recv, "dp_sent": traffic.stats["dp"].bytes_sent,
            "shapes": [tuple(p.shape) for p in model.parameters()], "dtypes": [p.element_size() for p in
                                                                              model.parameters()],
            "issued_early": opt.issued_early if level else None,
            "buckets": len(opt.buckets) if level else None}


def train_with_a_poisoned_step(cfg, poisoned: int) -> dict:
    """A trainer whose loss is NaN at step ``poisoned`` (0-based) only: a transient fault."""
    from torchtsp.train.trainer import Trainer

    trainer = Trainer(cfg)
    loss, step_fn, current = trainer.model.loss, trainer.train_step, {}
    trainer.model.loss = lambda *args: loss(*args) * (float("nan") if current["step"] == poisoned else 1.0)

    def train_step(step):
        current["step"] = step
        return step_fn(step)

    trainer.train_step = train_step
    return trainer.run()
