"""torchtsp.trace: one rank's training step traced under FakeTensorMode and a fake process group, against a real
4-rank gloo run of the same layout (its measured per-rank live-tensor peak and its counted bytes: torchtsp bench's
cell on a worker pool), and the plan's --trace rows."""

import json
import subprocess
import sys

import pytest

from torchtsp import get_preset
from torchtsp.bench.measure import CellSpec, cells_on_rank

S, WORLD = 1024, 4
DEGREES = {"tsp": {"tsp": 4}, "tp": {"tp": 4}, "sp": {"sp": 4}, "tp_sp": {"tp": 2, "sp": 2}}
RANKS = (0, WORLD - 1)  # zigzag: the first and last chunks' ranks differ most on gloo's pruned K/V exchange

TRACE = """
import json, sys
from torchtsp import get_preset
from torchtsp.layout import Layout
from torchtsp.trace import trace_step
scheme, degrees, ranks, S = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
layout = Layout.of_degrees(scheme, **degrees)
cfg, zero, batch = get_preset(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
print(json.dumps([trace_step(cfg, layout, batch, S, rank=r, stands_for="gloo", zero=zero).to_dict() for r in ranks]))
"""


def traced(scheme: str, preset: str = "tiny", degrees: dict | None = None, zero: int = 0, batch: int = 1,
           ranks=RANKS) -> dict[int, dict]:
    """The traced step of ``ranks``, in a process of its own (a fake default group needs a process without one)."""
    degrees = degrees or DEGREES[scheme]
    out = subprocess.run([sys.executable, "-c", TRACE, scheme, json.dumps(degrees), json.dumps(ranks), str(S), preset,
                          str(zero), str(batch)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return {t["rank"]: t for t in json.loads(out.stdout.strip().splitlines()[-1])}


@pytest.mark.multirank
@pytest.mark.parametrize("scheme, preset", [*((s, "tiny") for s in DEGREES), ("tsp", "tiny-moe"), ("sp", "tiny-moe")])
def test_traced_step_matches_a_real_gloo_run(pools, scheme, preset):
    """tiny-moe: the real run routes its random tokens as its router says, the trace assumes every expert its
    equal share (balanced): the bytes of the dispatch and combine all-to-alls and the peak follow the routing."""
    spec = CellSpec(scheme, DEGREES[scheme], get_preset(preset), batch=1, seq_len=S, warmup=1, steps=1)
    real = pools(WORLD).run(cells_on_rank, [spec], timeout_s=240)[0][0]
    assert real["error"] is None, real
    for rank, t in traced(scheme, preset).items():
        assert (t.get("routing") == "balanced (assumed)") == (preset == "tiny-moe")
        assert t["comm_path"] == "point_to_point"  # the path a gloo rank runs: like with like
        peak, counted = real["peak_bytes_per_rank"][rank], real["step_bytes_per_rank"][rank]
        print(f"\n{preset} {scheme} rank {rank}: traced / measured peak "
              f"{t['peak_bytes']} / {peak}, traced / counted bytes {t['comm_bytes']} / {counted}")
        # The trace's step adds the trainer's gradient clipping (a norm's all-reduce of a few scalars).
        assert t["comm_bytes"] == pytest.approx(counted, rel=0.02), (scheme, rank, t["comm_bytes_by_op"])
        assert t["peak_bytes"] == pytest.approx(peak, rel=0.10), (scheme, rank, t["categories"])
        assert sum(t["categories"].values()) == t["peak_bytes"]
        assert 0 < t["largest_allocation_bytes"] <= t["peak_bytes"]


@pytest.mark.multirank
def test_traced_zero1_step_matches_a_real_gloo_run(pools):
    """dp = 2 x tsp = 2 under --zero 1 (train/zero.py: the reduce-scatter of gradients into float32 buffers kept
    from step to step, AdamW on the owned half, the all-gather of weights): the trace of ranks 0 and 3 (dp 0 / tsp 0
    and dp 1 / tsp 1) against the real run's measured peak and counted bytes. The bytes are those of --zero 0's
    all-reduce but for padding rows, and the peak is in backward, so the traced AdamW state at the peak is held to
    the arithmetic too: two float32 moments of the owned half of this rank's parameters (--zero 0: all of them)."""
    from torchtsp.analysis.memory_model import param_elements

    owned = sum(param_elements("tsp", get_preset("tiny"), tsp=2).values()) / 2
    degrees = {"dp": 2, "tsp": 2}
    spec = CellSpec("tsp", degrees, get_preset("tiny"), batch=2, seq_len=S, warmup=1, steps=1, zero=1)
    real = pools(WORLD).run(cells_on_rank, [spec], timeout_s=240)[0][0]
    assert real["error"] is None, real
    for rank, t in traced("tsp", degrees=degrees, zero=1, batch=2, ranks=(0, 3)).items():
        peak, counted = real["peak_bytes_per_rank"][rank], real["step_bytes_per_rank"][rank]
        print(f"\nDP2xTSP2 --zero 1 rank {rank}: traced / measured peak {t['peak_bytes']} / {peak}, traced / counted "
              f"bytes {t['comm_bytes']} / {counted}")
        assert t["comm_bytes"] == pytest.approx(counted, rel=0.02), (rank, t["comm_bytes_by_op"])
        assert t["peak_bytes"] == pytest.approx(peak, rel=0.10), (rank, t["categories"])
        assert t["categories"]["optimizer"] == pytest.approx(2 * 4 * owned, rel=0.01), t["categories"]


INFER_TRACE = """
import json, sys
from torchtsp import get_preset
from torchtsp.layout import Layout
from torchtsp.trace import trace_generate
scheme, degrees, ranks, S = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
layout = Layout.of_degrees(scheme, **degrees)
print(json.dumps([trace_generate(get_preset("tiny"), layout, 1, S, rank=r, stands_for="gloo").to_dict()
                  for r in ranks]))
"""


@pytest.mark.multirank
@pytest.mark.parametrize("scheme", ["tsp", "tp", "sp"])
def test_traced_generate_matches_a_real_gloo_run(pools, scheme):
    """Inference: a prefill of S tokens that fills the KV cache, then one decode step, as torchtsp bench --mode
    infer measures it on 4 gloo ranks (its per-rank live-tensor peak over generate), against the trace of the same
    ranks: peaks within 10%. TSP decodes on its default KV layout (heads), SP on its sequence-split cache."""
    from dataclasses import asdict

    from torchtsp.bench.infer import InferCell, infer_on_rank

    cell = InferCell(scheme, WORLD, asdict(get_preset("tiny")), S, new_tokens=2)
    real = pools(WORLD).run(infer_on_rank, cell, timeout_s=240)
    out = subprocess.run([sys.executable, "-c", INFER_TRACE, scheme, json.dumps(DEGREES[scheme]), json.dumps(RANKS),
                          str(S)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for t in json.loads(out.stdout.strip().splitlines()[-1]):
        measured = real[t["rank"]]
        assert "error" not in measured, measured
        print(f"\n{scheme} generate rank {t['rank']}: traced / measured peak {t['peak_bytes']} / "
              f"{measured['peak_bytes']}, KV {t['kv_cache_bytes']} / {measured['kv_bytes']}")
        assert t["kv_cache_bytes"] == measured["kv_bytes"]
        assert t["peak_bytes"] == pytest.approx(measured["peak_bytes"], rel=0.10), t["categories"]
        assert sum(t["categories"].values()) == t["peak_bytes"]


def plan(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchtsp", "plan", "--gpus", str(WORLD), "--seq-len", str(S),
                           "--dtype", "fp32", "--trace", *argv], capture_output=True, text=True, timeout=300)


def test_plan_trace_rows_agree_with_the_analytic_model():
    """Every row of the tiny model's plan traced (NCCL's collectives, as plan counts them): the bytes equal the
    model's arithmetic but for the clipping norm's all-reduce of a few scalars, the peaks within 10%."""
    out = plan("--preset", "tiny", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in json.loads(out.stdout)["rows"] if "error" not in r]
    assert {r["scheme"] for r in rows} == set(DEGREES)
    for r in rows:
        t = r["traced"]
        assert t["comm_path"] == "collectives" and not t["flagged"], (r["layout"], t)
        assert 0 <= t["comm_bytes"] - r["comm_bytes"]["total"] <= 64, (r["layout"], t["comm_bytes_by_op"])
        assert t["peak_bytes"] == pytest.approx(r["memory_bytes"]["total"], rel=0.10), (r["layout"], t["categories"])
        zigzag = r["scheme"] != "tp"
        assert [x["rank"] for x in t["ranks"]] == ([0, WORLD - 1 if r["scheme"] != "tp_sp" else 2] if zigzag else [0])
        assert t["peak_bytes"] == max(x["peak_bytes"] for x in t["ranks"])


def test_plan_trace_mixture_of_experts_assumes_balanced_routing():
    """tiny-moe: every row the plan can run is traced (the split sizes the host needs taken from a balanced
    routing, said in the row), the bytes equal the model's (whose all-to-alls assume the same balance) but for the
    clipping norm's few, and the peaks are within 10% of the model's but SP4's, which the model puts 13% high
    (a real gloo run of SP4 measures the traced peak: test_traced_step_matches_a_real_gloo_run)."""
    out = plan("--preset", "tiny-moe", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [r for r in json.loads(out.stdout)["rows"] if "error" not in r]
    assert {r["scheme"] for r in rows} == {"tsp", "tp", "sp"}
    for r in rows:
        t = r["traced"]
        assert t["routing"] == "balanced (assumed)", (r["layout"], t)
        assert 0 <= t["comm_bytes"] - r["comm_bytes"]["total"] <= 64, (r["layout"], t["comm_bytes_by_op"])
        assert t["peak_bytes"] == pytest.approx(r["memory_bytes"]["total"], rel=0.10 if r["scheme"] != "sp" else 0.15)
    assert "Traceback" not in out.stderr


def test_measured_peak_counts_float32_masters_and_foreach_sqrt():
    """A mixed-precision AdamW step on real tensors, measured as bench, train and the trace measure it: one bfloat16
    weight of N elements, its float32 master, both moments, the bfloat16 gradient and its float32 copy, and
    foreach AdamW's sqrt(v): 2 + 2 + 4 + 4 + 8 + 4 = 24 bytes an element at the peak (hand-counted). MemTracker
    alone leaves out the masters (the optimizer's parameters, not its state): 20."""
    import torch

    from torchtsp.memory import measure_peak_by_kind
    from torchtsp.train.optim import MasterWeights, build_adamw

    n = 1 << 20
    model = torch.nn.Linear(n, 1, bias=False)
    master = MasterWeights([model.weight])
    optimizer = build_adamw([(["w"], master.masters[0])], 1e-3, 0.1, foreach=True)

    def step():
        model.weight.grad = torch.ones_like(model.weight)
        master.grads_to_masters()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        master.masters_to_params()

    step()  # the moments exist from here on
    _, peak, parts = measure_peak_by_kind(step, model, optimizer)
    assert peak == pytest.approx(24 * n, abs=64), parts
    assert parts["optimizer"] >= (4 + 8 + 4) * n  # masters, moments, sqrt(v): the optimizer's, as the model counts


def traced_short() -> dict[str, int]:
    """The tiny TSP4 step at S = 64 in bfloat16 traced standing for each backend (one process, run in turn)."""
    script = ("import json; from torchtsp import get_preset; from torchtsp.layout import Layout; "
              "from torchtsp.trace import trace_step; "
              "print(json.dumps({b: trace_step(get_preset('tiny'), Layout.of_degrees('tsp', tsp=4), 1, 64, "
              "dtype='bfloat16', stands_for=b).peak_bytes for b in ('nccl', 'gloo')}))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_traced_adamw_step_is_the_backends():
    """At S = 64 the optimizer step holds the peak (bfloat16 weights, float32 masters). Standing for NCCL the trace
    takes AdamW's multi-tensor step, as a CUDA rank does (sqrt(v) of every parameter at once), standing for gloo
    the per-tensor loop: each peak is the analytic model's for that step (which differ by 6%)."""
    from torchtsp.analysis.memory_model import predict_memory

    cfg = get_preset("tiny")
    model = {foreach: predict_memory("tsp", cfg, 1, 64, tsp=4, dtype_bytes=2, foreach=foreach) for foreach in (0, 1)}
    assert model[1].phase == "optimizer step" and model[1].total > 1.06 * model[0].total
    traced = traced_short()
    assert traced["nccl"] == pytest.approx(model[1].total, rel=0.02)
    assert traced["gloo"] == pytest.approx(model[0].total, rel=0.03)


def test_plan_trace_infer_rows():
    """--mode infer: each row generate runs is traced (a prefill then one decode step, bfloat16 weights cast as
    torchtsp generate casts them), its peak and bytes within 10% of the inference model's; the layouts generate
    refuses (TP with Megatron-SP, tp_sp) are not traced, with generate's reason."""
    out = subprocess.run([sys.executable, "-m", "torchtsp", "plan", "--gpus", str(WORLD), "--seq-len", str(S),
                          "--dtype", "bf16", "--mode", "infer", "--trace", "--preset", "tiny", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["layout"]: r for r in json.loads(out.stdout)["rows"] if "error" not in r}
    traced = {label: r["traced"] for label, r in rows.items() if "peak_bytes" in r["traced"]}
    assert {rows[label]["scheme"] for label in traced} == {"tsp", "tp", "sp"}
    for label, t in traced.items():
        assert t["peak_bytes"] == pytest.approx(rows[label]["memory_bytes"]["total"], rel=0.10), (label, t)
        assert t["comm_bytes"] == pytest.approx(rows[label]["comm_bytes"]["total"], rel=0.10), (label, t)
        assert 0 < t["kv_cache_bytes"] < t["peak_bytes"] and not t["flagged"]
    assert "sequence parallelism" in rows["TP4+seqpar"]["traced"]["skipped"]


def test_plan_trace_on_cuda_without_a_gpu_is_one_line():
    """--device cuda where no CUDA GPU is present: one line, exit status 2, no traceback, nothing traced."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    out = plan("--preset", "tiny", "--device", "cuda")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == ["torchtsp: error: --device cuda: no CUDA GPU on this machine; --trace "
                                               "runs on the CPU by default (fake tensors, any size)"]
