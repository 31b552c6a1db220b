"""One way to resolve a layout: ``train``, ``plan`` and ``bench`` refuse the same bad layout with the same message,
because each goes through ``Layout.resolve`` (train before any rank starts, plan and its pipeline report, bench's
cells). Each command is driven through its own entry point, not the resolution itself; no rank starts."""

from __future__ import annotations

import json

import pytest

from torchtsp import cli
from torchtsp.bench.measure import CellSpec
from torchtsp.bench.run import layout_error
from torchtsp.presets import get_preset

# (preset, world, degrees, sequence length, pipeline flags, the message's words)
BAD = [
    ("tiny", 3, {"tsp": 3}, 48, {}, "n_heads=8 divisible by 3"),
    ("tiny", 4, {"tsp": 4}, 36, {}, "divisible by 2*D = 8 for zigzag"),
    ("tiny", 4, {"tsp": 2}, 32, {"pp": 2, "microbatches": 1}, "--microbatches 1 is fewer than the 2 pipeline stages"),
    ("tiny", 3, {"tsp": 1}, 32, {"pp": 3}, "layers do not divide into 3 stages"),
    ("tiny-moe", 4, {"tsp": 2}, 32, {"pp": 2}, "mixture-of-experts model with a load-balancing loss"),
]


def _flags(degrees: dict, pipeline: dict) -> list[str]:
    return [f for k, v in {**degrees, **pipeline}.items() for f in (f"--{k}", str(v))]


def train_refusal(capsys, preset, world, degrees, seq_len, pipeline) -> str:
    status = cli.main(["train", "--preset", preset, "--nproc", str(world), "--seq-len", str(seq_len), "--batch-size",
                       "4", "--steps", "1", *_flags(degrees, pipeline)])
    err = capsys.readouterr().err
    assert status == 2, err
    return err.split("torchtsp: error: ", 1)[1].strip()


def plan_refusal(capsys, preset, world, degrees, seq_len, pipeline) -> str:
    """The planner's word on that layout: its row's error (every layout of ``world`` GPUs is evaluated), or, with
    pipeline stages, the pipeline report's error."""
    args = ["plan", "--preset", preset, "--gpus", str(world), "--seq-len", str(seq_len), "--batch-size", "4"]
    if pipeline:
        status = cli.main([*args, *_flags({k: v for k, v in degrees.items() if k == "tsp"}, pipeline)])
        err = capsys.readouterr().err
        assert status == 2, err
        return err.split("torchtsp: error: ", 1)[1].strip()
    assert cli.main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    (row,) = [r for r in rows if r["scheme"] == "tsp" and r["tsp"] == degrees["tsp"] and r["dp"] == 1]
    return row["error"]


def bench_refusal(preset, world, degrees, seq_len, pipeline) -> str | None:
    if pipeline:
        return None  # bench --pp times TSP stages through the same resolution; covered by train's and plan's
    sizes = {"dp": 1, "sp": 1, "tp": 1, "tsp": 1, **degrees}
    return layout_error(CellSpec("tsp", sizes, get_preset(preset), 4, seq_len, 0, 0))


@pytest.mark.parametrize("preset,world,degrees,seq_len,pipeline,words", BAD, ids=[b[-1][:40] for b in BAD])
def test_train_plan_and_bench_refuse_a_layout_with_one_message(capsys, preset, world, degrees, seq_len, pipeline,
                                                               words):
    train = train_refusal(capsys, preset, world, degrees, seq_len, pipeline)
    assert words in train, train
    assert plan_refusal(capsys, preset, world, degrees, seq_len, pipeline) == train
    bench = bench_refusal(preset, world, degrees, seq_len, pipeline)
    assert bench is None or bench == " ".join(train.split())
