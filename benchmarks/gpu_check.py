"""The checks only a GPU can make, in one run on one CUDA (or ROCm) GPU, printed as one JSON object.

    PYTHONPATH=src python benchmarks/gpu_check.py                    # the GPU (a few minutes)
    PYTHONPATH=src python benchmarks/gpu_check.py --device cpu       # smoke test, small sizes (CI)
    PYTHONPATH=src python benchmarks/gpu_check.py --out benchmarks/results/gpu-check.json

1. ``tsp_vs_reference``: TSP at D = 1 (the library's own code path: packed shards, zigzag attention through the
   fused kernels, its comm layer) against the reference model on the same device and both against the
   reference in float64 on the CPU: loss and every gradient, fp32 and bf16.
2. ``fused_vs_portable``: the fused attention kernels the library calls on this device (flash for bf16, the
   memory-efficient kernel for fp32 on CUDA; the CPU flash kernel on the CPU) against the portable
   kernel: outputs, log-sum-exp and gradients, causal and not, Lq != Lk.
3. ``step``: forward + backward time and peak memory (torch.cuda.max_memory_allocated; live tensor bytes on
   the CPU) of the reference and of TSP at D = 1 on the bench model, S = 2048 and 8192, bf16.
4. ``attention_share``: the fraction of a TSP step's kernel time spent in attention (torch.profiler).

Every comparison reports its figures and an ``ok`` against a stated bound; the script never fails on a
bound (a GPU run is for reading), only on an error.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time

import torch

import torchtsp
from torchtsp import kernels
from torchtsp.bench.args import BENCH_MODEL
from torchtsp.distributed import comm as comm_module

SMALL_MODEL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=101)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64 on the CPU."""
    a, b = actual.detach().double().cpu(), expected.detach().double().cpu()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(cfg, batch, seq_len, device):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g)
    return tokens.to(device), labels.to(device)


def _tsp(model, device):
    mesh = torchtsp.init_mesh(tsp=1, device_type=device.type)
    return torchtsp.parallelize(model, mesh, "tsp")


def _loss_and_grads(model, tokens, labels, names):
    loss = model.loss(tokens, labels)
    loss.backward()
    grads = model.full_grads() if hasattr(model, "full_grads") else {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), {n: grads[n] for n in names}


def tsp_vs_reference(cfg, device, batch, seq_len) -> dict:
    torch.manual_seed(0)
    ref = torchtsp.Transformer(cfg)
    names = [n for n, _ in ref.named_parameters()]
    tokens, labels = _batch(cfg, batch, seq_len, "cpu")
    exact = copy.deepcopy(ref).double()
    exact_loss, exact_grads = _loss_and_grads(exact, tokens, labels, names)
    out = {"shape": {"batch": batch, "seq_len": seq_len, **{k: getattr(cfg, k) for k in SMALL_MODEL}}}
    for dtype in (torch.float32, torch.bfloat16):
        t, lab = tokens.to(device), labels.to(device)
        same = copy.deepcopy(ref).to(device=device, dtype=dtype)
        same_loss, same_grads = _loss_and_grads(same, t, lab, names)
        tsp = _tsp(copy.deepcopy(ref).to(device=device, dtype=dtype), device)
        tsp_loss, tsp_grads = _loss_and_grads(tsp, t, lab, names)
        ref_err = {n: rel_err(same_grads[n], exact_grads[n]) for n in names}
        tsp_err = {n: rel_err(tsp_grads[n], exact_grads[n]) for n in names}
        mean = lambda e: sum(e.values()) / len(e)  # noqa: E731
        # Bound: TSP at least as accurate as the reference in the same dtype, up to the reordering of sums
        # (tests/test_tsp_step.py's 1.25x of the mean gradient error), with a floor of a quarter ulp of the dtype.
        floor = torch.finfo(dtype).eps / 4
        out[str(dtype).removeprefix("torch.")] = {
            "loss": {"float64_cpu": exact_loss.item(), "reference": same_loss.item(), "tsp": tsp_loss.item()},
            "loss_rel_err_vs_float64": {"reference": abs(same_loss.item() - exact_loss.item()) / exact_loss.item(),
                                        "tsp": abs(tsp_loss.item() - exact_loss.item()) / exact_loss.item()},
            "grad_rel_err_vs_float64": {"reference_mean": mean(ref_err), "tsp_mean": mean(tsp_err),
                                        "reference_max": max(ref_err.values()), "tsp_max": max(tsp_err.values())},
            "tsp_vs_reference_max_grad_rel_err": max(rel_err(tsp_grads[n], same_grads[n]) for n in names),
            "ok": mean(tsp_err) <= 1.25 * max(mean(ref_err), floor),
        }
        comm_module.release_subgroups()
    return out


def fused_vs_portable(device, length) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for causal in (True, False):
            g = torch.Generator().manual_seed(1)
            q = torch.randn(2, 4, length, 64, generator=g).to(device, dtype)
            k = torch.randn(2, 4, length if causal else length + length // 2, 64, generator=g).to(device, dtype)
            v = torch.randn(k.shape, generator=g).to(device, dtype)
            dout = torch.randn(q.shape, generator=g).to(device, dtype)
            fused_out, fused_lse = kernels._flash_forward(q, k, v, causal)
            port_out, port_lse = kernels.portable_forward(q, k, v, causal)
            fused_grads = kernels._flash_backward(dout, q, k, v, fused_out, fused_lse, causal)
            port_grads = kernels.portable_backward(dout, q, k, v, port_out, port_lse, causal)
            errs = {"out": rel_err(fused_out, port_out), "lse": rel_err(fused_lse, port_lse),
                    **{f"d{n}": rel_err(a, b) for n, a, b in zip("qkv", fused_grads, port_grads)}}
            # bf16 has 8 mantissa bits (2^-8 relative rounding of every input and output); both accumulate in fp32.
            bound = 1e-5 if dtype == torch.float32 else 2e-2
            out[f"{str(dtype).removeprefix('torch.')}_{'causal' if causal else 'full'}"] = {
                **errs, "lse_shape": list(fused_lse.shape), "lse_dtype": str(fused_lse.dtype),
                "bound": bound, "ok": max(errs.values()) <= bound and list(fused_lse.shape) == list(q.shape[:3])}
    return out


def _peak_bytes(device, fn):
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torchtsp.memory import measure_peak

    return measure_peak(fn)[1]


def step(cfg, device, seq_lens, steps) -> dict:
    out = {}
    for S in seq_lens:
        tokens, labels = _batch(cfg, 1, S, device)
        torch.manual_seed(0)
        ref = torchtsp.Transformer(cfg).to(device=device, dtype=torch.bfloat16)
        models = {"reference": ref, "tsp_d1": _tsp(copy.deepcopy(ref), device)}
        row = {}
        for name, model in models.items():
            def run(model=model, tokens=tokens, labels=labels):
                for p in model.parameters():
                    p.grad = None
                model.loss(tokens, labels).backward()
            run()  # warm-up: kernels chosen, workspaces allocated
            times = []
            for _ in range(steps):
                sync(device)
                start = time.perf_counter()
                run()
                sync(device)
                times.append(time.perf_counter() - start)
            row[name] = {"step_s_median": statistics.median(times), "step_s": times,
                         "peak_bytes": _peak_bytes(device, run)}
        row["tsp_over_reference_time"] = row["tsp_d1"]["step_s_median"] / row["reference"]["step_s_median"]
        row["tsp_over_reference_peak"] = row["tsp_d1"]["peak_bytes"] / max(1, row["reference"]["peak_bytes"])
        out[f"S={S}"] = row
        comm_module.release_subgroups()
    return out


ATTENTION_NAMES = ("attention", "flash", "fmha", "attn")  # aten ops and the CUDA/ROCm kernels behind them


def attention_share(cfg, device, seq_len) -> dict:
    from torch.profiler import ProfilerActivity, profile

    tokens, labels = _batch(cfg, 1, seq_len, device)
    torch.manual_seed(0)
    model = _tsp(torchtsp.Transformer(cfg).to(device=device, dtype=torch.bfloat16), device)
    model.loss(tokens, labels).backward()  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        model.loss(tokens, labels).backward()
        sync(device)
    on_gpu = device.type == "cuda"
    total = attn = 0.0
    for e in prof.key_averages():
        t = e.self_device_time_total if on_gpu else e.self_cpu_time_total
        total += t
        if any(s in e.key.lower() for s in ATTENTION_NAMES):
            attn += t
    comm_module.release_subgroups()
    return {"seq_len": seq_len, "clock": "device kernels" if on_gpu else "CPU self time",
            "attention_us": attn, "total_us": total, "share": attn / total if total else None}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda (also ROCm): the real check; cpu: a smoke test on small sizes")
    parser.add_argument("--out", help="also write the JSON to this file")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA/ROCm GPU here; use --device cpu for the smoke test")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    small = device.type == "cpu"
    started = time.perf_counter()
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip,
        "python": platform.python_version(), "sizes": "small (smoke test)" if small else "full",
    }
    bench = torchtsp.ModelConfig(**(SMALL_MODEL if small else BENCH_MODEL), max_seq_len=8192)
    result["tsp_vs_reference"] = tsp_vs_reference(bench, device, 2, 64 if small else 1024)
    result["fused_vs_portable"] = fused_vs_portable(device, 64 if small else 1024)
    result["step"] = step(bench, device, (128, 256) if small else (2048, 8192), 1 if small else 5)
    result["attention_share"] = attention_share(bench, device, 256 if small else 8192)
    result["ok"] = all(v["ok"] for part in ("tsp_vs_reference", "fused_vs_portable")
                       for v in result[part].values() if isinstance(v, dict) and "ok" in v)
    result["seconds"] = time.perf_counter() - started
    comm_module.destroy_process_group()
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    main()
    sys.exit(0)
