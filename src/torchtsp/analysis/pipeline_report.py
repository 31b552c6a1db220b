"""``torchtsp plan --pp N`` and ``plan --gpus-per-node G --nodes N``: pipeline stages around TSP, per stage, and
where each mesh axis lands on a multi-node machine. Pure arithmetic (``pipeline_model``), no torch."""

from __future__ import annotations

import math

from ..argtypes import DTYPE_BYTES
from ..presets import get_preset
from .pipeline_model import placement, predict_pipeline
from .policies import by_policy, paper_figure, policy_label, print_policies
from .validation import check_gpu_mem, check_gpus, dumps

GB = 1e9


def resolve_layout(args) -> dict:
    """GPUs, pp, dp and tsp from the flags: TSP fills a node (or GPUs / pp without nodes), dp takes the rest."""
    nodes, per_node = args.nodes, args.gpus_per_node
    if (nodes is None) != (per_node is None):
        raise ValueError("give --nodes and --gpus-per-node together (or neither, and --gpus)")
    for name in ("nodes", "gpus_per_node", "pp", "tsp", "microbatches", "gpus"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    gpus = nodes * per_node if nodes else args.gpus
    check_gpus(gpus, "--nodes x --gpus-per-node" if nodes else "--gpus")
    pp = args.pp or 1
    if gpus % pp:
        raise ValueError(f"--pp {pp} does not divide the {gpus} GPUs")
    tsp = args.tsp or (per_node if per_node and (gpus // pp) % per_node == 0 else gpus // pp)
    if (gpus // pp) % tsp:
        raise ValueError(f"--tsp {tsp} does not divide the {gpus // pp} GPUs of a stage (GPUs / pp)")
    if not (args.inter_node_gbps > 0 and math.isfinite(args.inter_node_gbps)):
        raise ValueError(f"--inter-node-gbps must be positive, got {args.inter_node_gbps}")
    return {"gpus": gpus, "nodes": nodes or 1, "gpus_per_node": per_node or gpus, "pp": pp,
            "dp": gpus // (pp * tsp), "tsp": tsp}


def run_pipeline_plan(args) -> int:
    cfg = get_preset(args.preset)
    if args.seq_len < 1 or (args.batch_size is not None and args.batch_size < 1):
        raise ValueError("--seq-len and --batch-size must be positive")
    check_gpu_mem(args.gpu_mem)
    lay = resolve_layout(args)
    if args.batch_size is None:  # the default: one sequence per microbatch of each replica
        args.batch_size = lay["dp"] * (args.microbatches or lay["pp"])
    e = DTYPE_BYTES[args.dtype]
    predict = lambda policy: predict_pipeline(cfg, args.batch_size, args.seq_len, pp=lay["pp"], dp=lay["dp"],
                                              tsp=lay["tsp"], microbatches=args.microbatches, schedule=args.schedule,
                                              dtype_bytes=e, recompute=policy, zero=args.zero)
    plan = predict(args.recompute)
    # Each policy's fullest stage (activations and peak per GPU).
    policies = by_policy(lambda p: max(predict(p).stages, key=lambda s: s.total))
    paper = paper_figure(args.preset, "tsp", {"tsp": lay["tsp"]}, args.seq_len, args.batch_size // lay["dp"]) \
        if lay["pp"] == 1 else None
    where = placement(lay["pp"], lay["dp"], lay["tsp"], lay["gpus_per_node"], lay["nodes"], plan,
                      args.inter_node_gbps)
    fits = [s.total <= args.gpu_mem * GB for s in plan.stages]
    if args.json:
        print(dumps({"inputs": {"preset": args.preset, "seq_len": args.seq_len, "batch_size": args.batch_size,
                                "dtype": args.dtype, "recompute": args.recompute, "gpu_mem_gb": args.gpu_mem,
                                "inter_node_gbps": args.inter_node_gbps, **lay},
                     "pipeline": plan.to_dict(), "fits": fits, "placement": where,
                     "recompute_policies": {**policies, "paper_gb": paper}}))
        return 0
    M, pp = plan.microbatches, lay["pp"]
    nodes = f" ({lay['nodes']} nodes x {lay['gpus_per_node']})" if lay["nodes"] > 1 else ""
    print(f"torchtsp plan: {args.preset} (L={cfg.n_layers}), B={args.batch_size}, S={args.seq_len:,}, "
          f"{lay['gpus']} GPUs{nodes}, mesh pp={pp} x dp={lay['dp']} x tsp={lay['tsp']}, {M} microbatches, "
          f"{args.schedule}, {args.dtype}{policy_label(args)}")
    if pp > 1:
        v = 2 if args.schedule == "interleaved_1f1b" else 1
        formula = "(pp-1)/(M+pp-1)" if v == 1 else "(pp-1)/(2M+pp-1)"
        print(f"bubble: {formula} = {plan.bubble:.1%} of each step idle (predicted step time = stage work / "
              f"{1 - plan.bubble:.3f})")
    print(f"{'stage':>5} {'layers':<12} {'w+g+opt GB':>10} {'activ. GB':>10} {'peak GB':>8} {'in flight':>9}  fits")
    for s, ok in zip(plan.stages, fits):
        layers = ",".join(f"{a}-{b - 1}" for a, b in s.layers)
        print(f"{s.stage:>5} {layers:<12} {s.params / GB:>10.1f} {s.activations / GB:>10.1f} {s.total / GB:>8.1f} "
              f"{s.in_flight:>9}  {'yes' if ok else 'no'}")
    if pp > 1:
        print(f"stage boundary: rank p of a stage sends its own token shard [B/(dp M), S/tsp, h] = "
              f"{plan.boundary_bytes / 1e6:.1f} MB to rank p of the next per microbatch, and gets its gradient back")
    print("traffic per GPU per step (received): " + ", ".join(
        f"{axis} {where[axis]['bytes_per_gpu'] / GB:.2f} GB" for axis in ("tsp", "dp", "pp")))
    crossing = [a for a in ("tsp", "dp", "pp") if where[a]["crosses_nodes"]]
    if lay["nodes"] > 1:
        for axis in ("tsp", "dp", "pp"):
            w = where[axis]
            if w["crosses_nodes"]:
                print(f"  {axis}: spans {w['nodes_spanned']} nodes, crosses the inter-node link: "
                      f"{w['seconds_per_step'] * 1e3:.0f} ms per step at {args.inter_node_gbps:g} Gbit/s per node")
            else:
                print(f"  {axis}: inside one node")
        if "tsp" in crossing:
            print("  warning: TSP moves weights and K/V every layer; keep --tsp within --gpus-per-node")
        print(f"slow link carries: {', '.join(crossing) or 'nothing'}")
    print("(GB = 1e9 bytes per GPU; memory as `plan` models it for TSP, per stage: one microbatch's backward walk "
          "plus the activations of the microbatches in flight; dp traffic counted whole on the slow link)")
    print_policies(policies, "the fullest stage", paper)
    return 0
