"""Training and generation steps on fake CUDA tensors over the ``fake`` process-group backend, one process
playing ranks of a D = 4 world in turn (see tests/fake_cuda.py). Run by tests/test_fake_cuda.py as

    python tests/fake_cuda_cases.py CASE...     (prints one JSON line: {case: {"problems": [...], ...}})

Each case returns what it found wrong (empty: nothing) plus a few facts for the tests to check. A case
asserts the device, dtype and shape of every output and gradient; which CUDA kernels and collectives ran;
and that the step issued no host-syncing op.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

import fake_cuda
import torchtsp

WORLD = 4
# GQA (8 query heads, 4 KV heads), two layers; S = 32 gives each rank two zigzag chunks of 4 tokens.
DENSE = dict(dim=64, n_heads=8, n_kv_heads=4, ffn_dim=96, vocab_size=101, n_layers=2, max_seq_len=64)
MOE = dict(DENSE, n_experts=4, moe_top_k=2, moe_ffn_dim=48)
B, S = 2, 32
RANKS = (0, WORLD - 1)  # the first and last rank see different key blocks (zigzag_attention's _key_blocks)


class Check:
    """Collects problems instead of stopping at the first."""

    def __init__(self):
        self.problems: list[str] = []

    def that(self, ok: bool, what: str) -> None:
        if not ok:
            self.problems.append(what)

    def tensor(self, name: str, t, shape=None, dtype=None) -> None:
        if not isinstance(t, torch.Tensor):
            self.problems.append(f"{name} is {type(t).__name__}, not a tensor")
            return
        self.that(t.device.type == "cuda", f"{name} on {t.device}, not cuda")
        self.that(isinstance(t, fake_cuda.FakeTensor), f"{name} is a real tensor")
        if dtype is not None:
            self.that(t.dtype == dtype, f"{name} dtype {t.dtype}, expected {dtype}")
        if shape is not None:
            self.that(tuple(t.shape) == tuple(shape), f"{name} shape {tuple(t.shape)}, expected {tuple(shape)}")

    def grads(self, model, dtype) -> int:
        """Every parameter is in ``dtype`` and has a gradient of its own shape, dtype and device; returns how many."""
        n = 0
        for name, p in model.named_parameters():
            self.tensor(f"parameter {name}", p, dtype=dtype)
            if p.grad is None:
                self.problems.append(f"parameter {name} has no gradient")
                continue
            self.tensor(f"gradient of {name}", p.grad, p.shape, p.dtype)
            n += 1
        self.that(n > 0, "no gradients at all")
        return n

    def no_syncs(self, fake) -> None:
        self.that(not fake.syncs, f"host-syncing ops in the step: {fake.syncs}")


def _config(**overrides):
    import torchtsp

    return torchtsp.ModelConfig(**{**DENSE, **overrides})


def _models(cfg, dtype):
    """(a meta-device model, the weights of a seeded CPU reference in ``dtype``), built outside the fake mode:
    ``parallelize`` of the first with the second cuts each rank's shards (for real, on the CPU) and moves them
    to the fake GPU, as it does on a real one."""
    import torchtsp
    from torchtsp.weights import ModelWeights

    torch.manual_seed(0)
    ref = torchtsp.Transformer(cfg).to(dtype)
    return torchtsp.Transformer(cfg, device="meta").to(dtype), ModelWeights(ref)


def _batch(cfg):
    tokens = torch.randint(0, cfg.vocab_size, (B, S), device="cuda")
    return tokens, torch.randint(0, cfg.vocab_size, (B, S), device="cuda")


def training_step(scheme: str, degrees: dict, dtype=torch.float32, recompute=None, moe=False, rank=0, packed=False,
                  **features):
    """One forward + backward of ``scheme`` as rank ``rank``; the step's bytes beside ``predict_comm``. ``packed``:
    rows of documents (their ids read on the host before the step, as the trainer does)."""
    import torchtsp
    from torchtsp.analysis import predict_comm
    from torchtsp.layers import Documents

    check = Check()
    cfg = torchtsp.ModelConfig(**{**(MOE if moe else DENSE), **features})
    fake_cuda.init_world(rank, WORLD)
    mesh = torchtsp.init_mesh(**degrees, device_type="cuda")
    options = {} if recompute is None else {"recompute": recompute}
    shell, weights = _models(cfg, dtype)
    with fake_cuda.FakeCuda() as fake:
        model = torchtsp.parallelize(shell, mesh, scheme, weights=weights, **options)
        tokens, labels = _batch(cfg)
        shard_t, shard_l = model.shard_batch(tokens), model.shard_batch(labels)
        check.tensor("token shard", shard_t, dtype=torch.long)
        # Documents of 5, 1, 13 and 13 tokens in row 0 (across chunk and rank edges), 20 and 12 in row 1.
        lengths = [[5, 1, 13, 13], [20, 12]]
        documents = model.shard_documents(Documents.from_ids(torch.stack(
            [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]))) if packed else None
        fake.reset()
        with torchtsp.distributed.comm.Traffic(model.comms()) as traffic:
            loss = model.loss_on_shard(shard_t, shard_l, documents)
            loss.backward()
        check.tensor("loss", loss, (), torch.float32)
        n_grads = check.grads(model, dtype)
        check.no_syncs(fake)
    for name, comm in model.comms().items():
        check.that(not comm.point_to_point, f"axis {name} took the point-to-point (gloo) path on a fake NCCL group")
    expected = predict_comm(scheme, cfg, B, S, dtype_bytes=dtype.itemsize, recompute=bool(recompute),
                            seq_rank=model.traffic_seq_rank(), **degrees).total
    check.that(traffic.recv == expected, f"received {traffic.recv} bytes, the analytic model says {expected}")
    return {"problems": check.problems, "ops": {str(k): v for k, v in fake.ops.items()}, "grads": n_grads,
            "syncs": fake.syncs, "n_ops": sum(fake.ops.values()),
            "bytes": traffic.recv, "predicted": expected}


def tsp_attention(dtype_name: str, recompute: bool, packed: bool = False):
    """TSP at D = 4 on ranks 0 and 3, GQA; bf16 must run flash, fp32 the memory-efficient kernel, both ways;
    ``packed``: with a document mask (the fused kernels on each document's blocks)."""
    dtype = getattr(torch, dtype_name)
    kernel = "flash" if dtype == torch.bfloat16 else "efficient"
    out = {"problems": [], "ops": {}}
    for rank in RANKS:
        r = training_step("tsp", {"tsp": WORLD}, dtype, recompute=recompute, rank=rank, packed=packed)
        out["problems"] += [f"rank {rank}: {p}" for p in r["problems"]]
        ops = r["ops"]
        fwd = sum(n for op, n in ops.items() if f"_scaled_dot_product_{kernel}_attention.default" in op)
        bwd = sum(n for op, n in ops.items() if f"_scaled_dot_product_{kernel}_attention_backward" in op)
        cpu = sum(n for op, n in ops.items() if "for_cpu" in op)
        other = "efficient" if kernel == "flash" else "flash"
        wrong = sum(n for op, n in ops.items() if f"_scaled_dot_product_{other}_attention" in op)
        check = Check()
        check.that(fwd > 0 and bwd > 0, f"rank {rank}: the {kernel} kernel ran {fwd} forward, {bwd} backward")
        check.that(cpu == 0 and wrong == 0, f"rank {rank}: CPU or {other} kernels ran ({cpu}, {wrong})")
        # Recompute runs each layer's forward again in backward, so at least as many forward calls as backward.
        check.that(fwd >= (2 * bwd if recompute else bwd), f"rank {rank}: {fwd} forward vs {bwd} backward calls")
        for collective in ("c10d._allgather_base_", "c10d._reduce_scatter_base_", "c10d.broadcast_", "c10d.send",
                           "c10d.recv_"):
            check.that(ops.get(collective, 0) > 0, f"rank {rank}: no {collective} (NCCL path)")
        out["problems"] += check.problems
        out["ops"][rank] = {"fwd": fwd, "bwd": bwd, "all": r["n_ops"], "syncs": r["syncs"]}
    return out


def pairing(scheme: str, dtype_name: str, recompute: bool):
    """Every rank of D = 4 in turn; their c10d ops must meet (fake_cuda.check_pairing)."""
    import torchtsp

    dtype = getattr(torch, dtype_name)
    cfg = torchtsp.ModelConfig(**DENSE)
    degrees = {"tsp": {"tsp": WORLD}, "tp_sp": {"tp": 2, "sp": 2}}[scheme]
    logs = {}
    for rank in range(WORLD):
        fake_cuda.init_world(rank, WORLD)
        mesh = torchtsp.init_mesh(**degrees, device_type="cuda")
        shell, weights = _models(cfg, dtype)
        with fake_cuda.FakeCuda() as fake:
            model = torchtsp.parallelize(shell, mesh, scheme, weights=weights, recompute=recompute)
            tokens, labels = _batch(cfg)
            fake.reset()
            model.loss_on_shard(model.shard_batch(tokens), model.shard_batch(labels)).backward()
        logs[rank] = list(fake.comm_log)
    problems = fake_cuda.check_pairing(logs)
    return {"problems": problems, "entries": sum(map(len, logs.values()))}


def tsp_rocm():
    """fp32 on a ROCm build (torch.version.hip set): the efficient kernel's LSE is not padded there."""
    hip = torch.version.hip
    torch.version.hip = "6.2"
    try:
        return tsp_attention("float32", False)
    finally:
        torch.version.hip = hip


def tsp_features():
    """Qwen-like features (q/k/v bias, q/k norm, tied embeddings) and 2 KV heads at D = 4: each KV head copied on
    2 ranks, whose K/V exchange runs on a process group of each copy's block (AxisComm.blocks)."""
    features = dict(n_kv_heads=2, qkv_bias=True, qk_norm=True, tie_embeddings=True)
    out = {"problems": [], "ops": {}}
    for rank in RANKS:
        r = training_step("tsp", {"tsp": WORLD}, torch.bfloat16, rank=rank, **features)
        out["problems"] += [f"rank {rank}: {p}" for p in r["problems"]]
        out["ops"][rank] = {"all": r["n_ops"], "syncs": r["syncs"]}
    return out


def scheme_step(scheme: str):
    degrees = {"tp": {"tp": WORLD}, "sp": {"sp": WORLD}, "tp_sp": {"tp": 2, "sp": 2}}[scheme]
    out = {"problems": []}
    for dtype in (torch.bfloat16, torch.float32):
        r = training_step(scheme, degrees, dtype, rank=WORLD - 1)
        out["problems"] += [f"{dtype}: {p}" for p in r["problems"]]
        out[str(dtype)] = {"bytes": r["bytes"], "predicted": r["predicted"]}
    return out


def moe_reads():
    """TSP with experts spread over the axis, up to the token exchange. Dropless routing sends each rank's rows
    per expert, counts only the data know: ``expert_parallel`` exchanges them (an all_to_all_single on the GPU)
    and reads the split sizes to the host (``.tolist()``), which a fake tensor cannot answer (it answers 0 here,
    so the exchange refuses its splits). What ran before must be on the GPU, and those reads the only ones."""
    import torchtsp

    cfg = torchtsp.ModelConfig(**MOE)
    fake_cuda.init_world(1, WORLD)
    mesh = torchtsp.init_mesh(tsp=WORLD, device_type="cuda")
    shell, weights = _models(cfg, torch.bfloat16)
    check = Check()
    with fake_cuda.FakeCuda() as fake:
        model = torchtsp.parallelize(shell, mesh, "tsp", weights=weights)
        tokens, labels = _batch(cfg)
        fake.reset()
        try:
            model.loss_on_shard(model.shard_batch(tokens), model.shard_batch(labels))
            stopped = None
        except ValueError as e:
            stopped = str(e)
    check.that(stopped is not None and "all_to_all_single needs" in stopped, f"stopped at {stopped!r}")
    check.that(fake.count("c10d.alltoall_base_") == 1, "the expert counts were not exchanged by all_to_all_single")
    # Every read is of split sizes, through the one helper that reads them (host.counts_on_host, called by the
    # expert exchange in moe.py and by layers.routing_counts).
    check.that(len(fake.host_reads) > 0 and all(line.endswith("(counts_on_host)") for line in fake.host_reads),
               f"host reads: {fake.host_reads}")
    return {"problems": check.problems, "host_reads": sorted(set(fake.host_reads)), "stopped": stopped}


def collectives():
    """Each AxisComm operation on a fake NCCL group of 4: its c10d op, and the bytes the comm.py table gives."""
    from torchtsp.distributed.comm import AxisComm

    check = Check()
    D, rank = WORLD, 2
    fake_cuda.init_world(rank, D)
    comm = AxisComm(torch.distributed.group.WORLD, "axis")
    check.that(not comm.point_to_point, "a fake (NCCL-like) group took the point-to-point path")
    with fake_cuda.FakeCuda() as fake:
        x = torch.empty(3, 5, dtype=torch.bfloat16, device="cuda")
        n = x.numel() * x.element_size()
        rows, out_rows = [1, 2, 0, 3], [2, 1, 3, 1]  # rows to each rank, rows from each rank
        table = [  # (name, call, c10d op, received bytes as the comm.py table counts them, output shape)
            ("all_gather", lambda: comm.all_gather(x), "c10d._allgather_base_", (D - 1) * n, (D, 3, 5)),
            ("all_gather_prefixes", lambda: comm.all_gather_prefixes(x, (0, 1))[0], "c10d._allgather_base_",
             (D - 1) * n, (3, 5)),
            ("reduce_scatter", lambda: comm.reduce_scatter(torch.empty(D, 3, 5, device="cuda")),
             "c10d._reduce_scatter_base_", (D - 1) * 15 * 4, (3, 5)),
            ("broadcast", lambda: comm.broadcast(x, src=0), "c10d.broadcast_", n, (3, 5)),
            ("reduce", lambda: comm.reduce(x, dst=rank), "c10d.reduce_", (D - 1) * n, (3, 5)),
            ("all_reduce", lambda: comm.all_reduce(x), "c10d.allreduce_", 2 * (D - 1) * n // D, (3, 5)),
            ("ring_shift", lambda: comm.ring_shift(x), "c10d.recv_", n, (3, 5)),
            ("all_to_all", lambda: comm.all_to_all_single(torch.empty(6, 5, device="cuda"), out_rows, rows),
             "c10d.alltoall_base_", (sum(out_rows) - out_rows[rank]) * 5 * 4, (7, 5)),
        ]
        for name, call, op, expected, shape in table:
            fake.reset()
            with comm.counting() as stats:
                out = call()
            check.tensor(f"{name} output", out, shape)
            check.that(fake.count(op) >= 1, f"{name}: no {op} (ops: {dict(fake.ops)})")
            check.that(stats.total_recv == expected, f"{name}: counted {stats.total_recv} bytes, expected {expected}")
    return {"problems": check.problems}


def zero_step():
    """The distributed optimizer (--zero 2, bf16 with fp32 masters) at dp = 2 x tsp = 2 on fake CUDA: its
    reduce-scatters and all-gathers take NCCL's collectives, counted as the formula says; everything it keeps
    lives on the GPU; no host read but the norm's ``.item()``."""
    import torchtsp
    from torchtsp.distributed.comm import Traffic
    from torchtsp.train.zero import ZeroOptimizer

    check = Check()
    cfg = _config()
    fake_cuda.init_world(0, WORLD)
    mesh = torchtsp.init_mesh(dp=2, tsp=2, device_type="cuda")
    shell, weights = _models(cfg, torch.float32)
    with fake_cuda.FakeCuda() as fake:
        model = torchtsp.parallelize(shell, mesh, "tsp", weights=weights)
        zero = ZeroOptimizer(model, 2, 1e-3, 0.1, master_weights=True, bucket_mb=0.01)
        model.sum_gradients_with(zero.grad_sum)
        tokens, labels = _batch(cfg)
        for _ in range(2):  # the first backward also rebuilds the buckets in its gradients' order
            fake.reset()
            with Traffic(model.comms()) as traffic:
                zero.wait_for_weights()
                loss = model.forward_backward(tokens, labels)
                zero.reduce_gradients()
                zero.clip_(1.0)
                zero.step()
                zero.wait_for_weights()
            zero.zero_grad()
        check.tensor("loss", loss, (), torch.float32)
        for slot in zero.slots:
            check.tensor(f"parameter {slot.name}", slot.param, dtype=torch.bfloat16)
            check.tensor(f"master of {slot.name}", slot.master, (slot.hi - slot.lo,), torch.float32)
            for key, value in zero._state(slot).items():
                if key != "step":
                    check.tensor(f"{key} of {slot.name}", value, (slot.hi - slot.lo,), torch.float32)
        check.that(not model.comms()["dp"].point_to_point, "dp took the point-to-point path on a fake NCCL group")
        check.that(fake.count("c10d._reduce_scatter_base_") >= 2, f"no NCCL reduce-scatter: {dict(fake.ops)}")
        check.that(fake.count("c10d._allgather_base_") >= 2, f"no NCCL all-gather: {dict(fake.ops)}")
        reads = [line for line in fake.host_reads if "train/zero.py" in line]
        check.that(len(reads) <= 1, f"host reads of the optimizer: {reads}")
    chunks = sum(-(-p.shape[0] // 2) * p[0].numel() for p in model.parameters())
    recv = traffic.stats["dp"].bytes_recv
    check.that(recv.get("reduce_scatter") == chunks * 4, f"reduce-scatter {recv}, expected {chunks * 4}")
    check.that(recv.get("all_gather") == chunks * 2, f"all-gather {recv}, expected {chunks * 2}")
    return {"problems": check.problems}


def pipeline_pair():
    """pp = 2 stages of TSP (tsp = 2) as rank 0 (stage 0) and rank 3 (stage 1). The schedule's warm-up vote
    reads its result to the host; every stage gives its shapes (static mode), so a real run reads 1 there."""
    import torchtsp
    from torchtsp.parallel.pipeline import pipeline_parallelize

    check = Check()
    cfg = _config(n_layers=4)
    reads = []
    for rank in (0, WORLD - 1):  # mesh [pp, dp, sp, tp, tsp]: ranks 0-1 are stage 0, ranks 2-3 stage 1
        fake_cuda.init_world(rank, WORLD)
        mesh = torchtsp.init_mesh(pp=2, tsp=2, device_type="cuda")
        shell, weights = _models(cfg, torch.bfloat16)
        with fake_cuda.FakeCuda(host_values={"torch/distributed/pipelining/schedules.py": 1}) as fake:
            model = pipeline_parallelize(shell, mesh, weights=weights)
            tokens, labels = _batch(cfg)
            fake.reset()
            with model.pp.counting() as pp_traffic:
                loss = model.forward_backward(tokens, labels)
            check.tensor(f"rank {rank} loss", loss, (), torch.float32)
            check.grads(model, torch.bfloat16)
        # Stage boundary: per microbatch (2) one [B/2, S/tsp, h] bf16 shard in, or one gradient back.
        shard = (B // 2) * (S // 2) * cfg.dim * 2
        check.that(pp_traffic.bytes_recv["pipeline_p2p"] == 2 * shard,
                   f"rank {rank}: {pp_traffic.bytes_recv['pipeline_p2p']} bytes between stages, expected {2 * shard}")
        check.that(fake.count("c10d.send") > 0 and fake.count("c10d.recv_") > 0, f"rank {rank}: no stage p2p")
        reads += fake.host_reads
    return {"problems": check.problems, "host_reads": sorted(set(reads))}


def generation(scheme: str):
    """generate(): prefill and one decode step; each step's ids on the fake GPU, no host read inside a step."""
    import torchtsp
    from torchtsp.infer import generate

    check = Check()
    cfg = _config()
    degrees = {"tsp": {"tsp": WORLD}, "tp": {"tp": WORLD}}[scheme]
    fake_cuda.init_world(1, WORLD)
    mesh = torchtsp.init_mesh(**degrees, device_type="cuda")
    steps = []
    shell, weights = _models(cfg, torch.bfloat16)
    with fake_cuda.FakeCuda() as fake:
        model = torchtsp.parallelize(shell, mesh, scheme, weights=weights)
        fake.reset()

        def on_step(t, ids):
            steps.append(t)
            check.tensor(f"ids of step {t}", ids, (2,), torch.long)
            check.that(not fake.host_reads, f"host reads before step {t}: {fake.host_reads}")

        result = generate(model, [[1, 2, 3, 4, 5], [6, 7]], max_new_tokens=2, on_step=on_step)
    check.that(steps == [0, 1], f"steps {steps}, expected the prefill's (0) and one decode's (1)")
    check.that([len(t) for t in result.tokens] == [7, 4], f"token counts {[len(t) for t in result.tokens]}")
    # The one host read: the finished tokens, after the loop (api.py: new.tolist()).
    check.that(all(line.startswith("infer/api.py") for line in fake.host_reads),
               f"host reads outside the result assembly: {fake.host_reads}")
    check.that(not [s for s in fake.syncs if s[0] != "aten._local_scalar_dense.default"],
               f"host-syncing ops: {fake.syncs}")
    return {"problems": check.problems, "host_reads": len(fake.host_reads)}


def spy_flags():
    """The audit sees syncs on fake CUDA: boolean-mask indexing, nonzero and .item() are each flagged."""
    check = Check()
    with fake_cuda.FakeCuda() as fake:
        x, mask = torch.empty(6, device="cuda"), torch.empty(6, dtype=torch.bool, device="cuda")
        for op in (lambda: x.__setitem__(mask, 0.0), lambda: mask.nonzero(), lambda: x.sum().item()):
            try:
                op()
            except Exception:  # data-dependent shapes: fake tensors stop there, after the spy saw the op
                pass
    check.that(len(fake.syncs) == 3, f"flagged {fake.syncs}")
    return {"problems": check.problems}


# Heaviest first (seconds of one case alone on this machine, in the comments): tests/test_fake_cuda.py deals them
# out to its children in that order.
CASES = {
    "pairing_tsp_float32_recompute": (pairing, ("tsp", "float32", True)),  # 9
    "pairing_tsp_bfloat16_save": (pairing, ("tsp", "bfloat16", False)),  # 7
    **{f"tsp_{d}_{'recompute' if r else 'save'}": (tsp_attention, (d, r))  # 3-5
       for d in ("bfloat16", "float32") for r in (True, False)},
    "tsp_features": (tsp_features, ()),  # 4
    "tsp_bfloat16_documents": (tsp_attention, ("bfloat16", False, True)),  # 4
    "pipeline_pair": (pipeline_pair, ()),  # 3
    "tsp_float32_rocm": (tsp_rocm, ()),  # 3
    "zero_step": (zero_step, ()),  # 2
    "pairing_tp_sp": (pairing, ("tp_sp", "bfloat16", False)),  # 2
    **{f"{s}_step": (scheme_step, (s,)) for s in ("sp", "tp_sp", "tp")},  # 1
    "generate_tsp": (generation, ("tsp",)),
    "generate_tp": (generation, ("tp",)),
    "moe_reads": (moe_reads, ()),
    "collectives": (collectives, ()),
    "spy_flags": (spy_flags, ()),
}


def main(names) -> dict:
    torch.set_num_threads(1)
    fake_cuda.install()
    results = {}
    for name in [n for n in names if n != "-v"] or CASES:
        fn, args = CASES[name]
        try:
            results[name] = fn(*args)
        except Exception as e:  # a case that cannot run is a finding: report it with where it stopped
            tb = traceback.extract_tb(e.__traceback__)
            root = os.path.dirname(os.path.realpath(torchtsp.__file__)) + os.sep
            where = [f"{os.path.realpath(f.filename)[len(root):]}:{f.lineno}" for f in tb
                     if os.path.realpath(f.filename).startswith(root)][-3:]
            if "-v" in sys.argv:
                traceback.print_exc()
            results[name] = {"problems": [f"{type(e).__name__}: {str(e)[:600]} (at {' <- '.join(reversed(where))})"]}
    return results


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
