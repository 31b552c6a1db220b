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
        model.sum_gradients_with(opt.grad_sum)
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
                opt.clip_on_device(0)  # fills the masters' gradients (0: no clipping, the float ops of --zero 0)
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


# Many narrow layers: the model's gradient is several times ZeRO-2's buckets in flight (a bucket holds at least one
# whole local tensor), so what ZeRO-2 frees shows from the first step on.
DEEP = torchtsp.ModelConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=101, n_layers=6,
                            max_seq_len=64)


def measured_steps(level: int, steps: int = 2, bucket_mb: float = 0.05) -> list[dict]:
    """Each step's live gradient bytes at their fullest and live-tensor peak (``measure_peak``), at dp = 2 x
    tsp = 2 with the distributed optimizer at ``level`` (0: ``ReplicatedAdamW``), through the one interface."""
    from torchtsp.memory import measure_peak
    from torchtsp.train.optim import ReplicatedAdamW

    torch.manual_seed(0)
    mesh = torchtsp.init_mesh(dp=2, tsp=2)
    model = torchtsp.parallelize(torchtsp.Transformer(DEEP, device="meta"), mesh, "tsp")
    opt = (ZeroOptimizer(model, level, LR, WEIGHT_DECAY, bucket_mb=bucket_mb) if level
           else ReplicatedAdamW(model, LR, WEIGHT_DECAY))
    model.sum_gradients_with(opt.grad_sum)
    out = []
    for step in range(steps):
        tokens, labels = batch(DEEP, 4, 32, seed=step)

        def one_step(tokens=tokens, labels=labels):
            opt.wait_for_weights()
            model.forward_backward(tokens, labels)
            opt.reduce()
            opt.clip(1.0)
            opt.step(LR)

        opt.measuring = True
        _, peak = measure_peak(one_step, model, *opt.tracked)
        opt.measuring = False
        out.append({"grad_bytes": opt.bytes()["grad_bytes"], "peak_mem_bytes": peak})
    return out
