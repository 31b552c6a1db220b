"""torchtsp bench: a tiny sweep and a tiny --max-seq-under search on 2 local ranks, run in-process."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from torchtsp.bench.args import add_bench_arguments
from torchtsp.bench.run import run_bench, scheme_degrees

TINY = ["--nproc", "2", "--dim", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "4", "--ffn-dim", "96",
        "--vocab-size", "101"]
OURS = ("tsp", "tp", "sp", "tp_sp", "dp")
PNG = b"\x89PNG\r\n\x1a\n"


def parse(argv):
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Every scheme at S = 30 (not divisible by 2x2: zigzag schemes refuse it), 32 and 64; --json on stdout."""
    out = tmp_path_factory.mktemp("bench")
    import contextlib
    import io

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = run_bench(parse([*TINY, "--seq-lens", "30,32,64", "--steps", "1", "--out", str(out), "--json"]))
    return code, json.loads(stdout.getvalue()), out


def test_sweep_json_structure(sweep):
    code, result, _ = sweep
    assert code == 0
    meta = result["meta"]
    assert meta["world"] == 2 and meta["batch"] == 4 and meta["model"]["dim"] == 64
    cells = {(c["scheme"], c["seq_len"]): c for c in result["cells"]}
    assert set(cells) == {(s, S) for s in (*OURS, "torch_tp") for S in (30, 32, 64)}
    for S in (32, 64):
        for s in (*OURS, "torch_tp"):
            c = cells[s, S]
            assert c["status"] == "ok", c
            assert c["peak_bytes"] == max(c["peak_bytes_per_rank"]) > 0
            assert len(c["step_times_s"]) == 1 and c["median_step_s"] > 0
            assert c["tokens_per_s"] == pytest.approx(4 * S / c["median_step_s"])
    assert cells["tp_sp", 32]["mesh"] == "tp=2"  # the most square T x Σ of 2 ranks


def test_indivisible_sequence_is_a_cell_not_a_crash(sweep):
    cells = {(c["scheme"], c["seq_len"]): c for c in sweep[1]["cells"]}
    for s in ("tsp", "sp"):  # zigzag over 2 ranks needs S divisible by 4
        assert cells[s, 30]["status"].startswith("n/a: sequence length 30 must be divisible"), cells[s, 30]
    assert cells["tp", 30]["status"] == "ok"


def test_bytes_equal_the_prediction(sweep):
    for c in sweep[1]["cells"]:
        if c["status"] != "ok":
            continue
        if c["scheme"] == "torch_tp":  # DTensor's own collectives are not counted
            assert c["forward_bytes"] is None and c["bytes_match"] is None and c["predicted_forward_bytes"] is None
            continue
        assert c["bytes_match"] is True, (c["scheme"], c["seq_len"], c["forward_bytes_per_rank"],
                                          c["predicted_forward_bytes"])
        assert c["forward_bytes"] == c["predicted_forward_bytes"]
        assert c["step_bytes_match"] is True, (c["scheme"], c["seq_len"], c["step_bytes_per_rank"],
                                               c["predicted_step_bytes"])


def test_memory_prediction_and_tsp_lowest(sweep):
    cells = [c for c in sweep[1]["cells"] if c["status"] == "ok"]
    for c in cells:
        if c["scheme"] in OURS:
            assert abs(c["peak_error_pct"]) <= 15, (c["scheme"], c["seq_len"], c["peak_error_pct"])
    for S in (32, 64):
        peaks = {c["scheme"]: c["peak_bytes"] for c in cells if c["seq_len"] == S}
        assert min(peaks, key=peaks.get) == "tsp", (S, peaks)
    ratio = sweep[1]["tp_vs_torch_tp"]
    assert set(ratio["ratio_by_seq_len"]) == {"30", "32", "64"} and ratio["max_ratio"] > 0
    assert set(ratio["cell_ratio_by_seq_len"]) == {"30", "32", "64"}
    for p in ratio["interleaved"].values():
        assert len(p["tp"]["step_times_s"]) == len(p["torch_tp"]["step_times_s"]) == 1


def test_markdown_and_plots_written(sweep):
    _, result, out = sweep
    assert json.loads((out / "results.json").read_text())["cells"] == result["cells"]
    md = (out / "results.md").read_text()
    assert "| scheme | mesh | S | peak MiB | predicted MiB |" in md
    assert "| tsp | tsp=2 | 64 |" in md and "n/a: sequence length 30" in md and "tp / torch_tp" in md
    # Every measured cell's row shows its own peak and prediction in MiB (bytes / 2^20), not another cell's.
    rows = {}
    for line in md.splitlines():
        cols = [x.strip() for x in line.strip().strip("|").split("|")]
        if len(cols) > 4 and cols[2].isdigit():
            rows[cols[0], int(cols[2])] = cols
    for c in result["cells"]:
        if c["status"] == "ok":
            row = rows[c["scheme"], c["seq_len"]]
            assert float(row[3]) == pytest.approx(c["peak_bytes"] / 2**20, abs=0.051), (row, c["peak_bytes"])
            predicted = c["predicted_peak_bytes"]  # None for torch_tp, which the memory model does not cover
            assert row[4] == "-" if predicted is None else float(row[4]) == pytest.approx(predicted / 2**20, abs=0.051)
    for name in ("memory_vs_seq.png", "throughput_vs_seq.png", "bytes_pred_vs_meas.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, name


def test_max_seq_under_finds_tsp_longest(tmp_path, capsys):
    # 0.003 GiB = 3.1 MiB: the tiny model's TSP fits S = 128 on 2 ranks, every other scheme only S = 64.
    budget = 0.003
    assert run_bench(parse([*TINY, "--max-seq-under", str(budget), "--max-seq-start", "32", "--max-seq-cap", "512",
                            "--schemes", "tsp,tp,sp,dp", "--out", str(tmp_path), "--json"])) == 0
    result = json.loads(capsys.readouterr().out)
    longest = {s: r["longest_seq_len"] for s, r in result["schemes"].items()}
    assert longest == {"tsp": 128, "tp": 64, "sp": 64, "dp": 64}, longest
    for r in result["schemes"].values():
        last = r["tried"][-1]
        assert last["peak_bytes"] > budget * 2**30 >= max(t["peak_bytes"] for t in r["tried"][:-1])
    assert (tmp_path / "max_seq.md").read_text().count("| tsp |") >= 2
    assert (tmp_path / "max_seq.png").read_bytes().startswith(PNG)
    assert not (tmp_path / "results.json").exists()


def test_nproc_must_match_torchrun_world(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--nproc 4 does not match the torchrun world of 2 ranks"):
        run_bench(parse(["--nproc", "4"]))


def test_bad_flags():
    with pytest.raises(SystemExit):
        parse(["--schemes", "tsp,zero"])
    with pytest.raises(ValueError, match="--steps must be at least 1"):
        run_bench(parse(["--steps", "0"]))


def test_mesh_degrees():
    assert scheme_degrees("tp_sp", 4) == {"dp": 1, "tsp": 1, "tp": 2, "sp": 2}
    assert scheme_degrees("tp_sp", 8) == {"dp": 1, "tsp": 1, "tp": 4, "sp": 2}
    assert scheme_degrees("torch_tp", 4)["tp"] == 4 and scheme_degrees("tsp", 4)["tsp"] == 4


def test_flags_and_report_do_not_import_torch():
    code = ("import sys, argparse; import torchtsp.bench.args as a, torchtsp.bench.report; "
            "a.add_bench_arguments(argparse.ArgumentParser()); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": "src"})


def test_zero_cells_move_the_bytes_the_model_predicts(tmp_path):
    """--zero 2 on the dp scheme: the reduce-scatter and all-gather bytes counted equal predict_comm's exactly."""
    import contextlib
    import io

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert run_bench(parse([*TINY, "--schemes", "dp", "--seq-lens", "32", "--steps", "1", "--zero", "2",
                                "--out", str(tmp_path), "--json", "--no-plots"])) == 0
    (cell,) = json.loads(stdout.getvalue())["cells"]
    ops = cell["step_bytes_by_op_rank0"]["dp"]
    assert ops["reduce_scatter"] > 0 and ops["all_gather"] > 0 and "all_reduce" in ops  # only the loss sums
    assert cell["step_bytes_match"], (cell["step_bytes_per_rank"], cell["predicted_step_bytes_per_rank"])


# ------------------------------------------------------------------ the plots: every series visible, readable axes


def synthetic_sweep() -> dict:
    """tp, torch_tp and tp_sp on 2 ranks (tp=2 x sp=1: plain TP) measure the same values; tokens/s vary little."""
    cells = []
    for i, S in enumerate((256, 512, 1024)):
        for scheme, mesh in (("tsp", "tsp=2"), ("tp", "tp=2"), ("tp_sp", "tp=2"), ("torch_tp", "tp=2")):
            same = scheme != "tsp"
            cells.append({"scheme": scheme, "mesh": mesh, "seq_len": S, "status": "ok",
                          "peak_bytes": (40 if same else 30) * 2**20 * (i + 1),
                          "predicted_peak_bytes": (40 if same else 30) * 2**20 * (i + 1),
                          "tokens_per_s": 1000.0 + (100 * i if same else 150 * i),
                          "forward_bytes": 2**20 * (i + 1), "predicted_forward_bytes": 2**20 * (i + 1),
                          "bytes_match": True, "step_bytes": 3 * 2**20 * (i + 1),
                          "predicted_step_bytes": 3 * 2**20 * (i + 1), "step_bytes_match": True})
    return {"meta": {"world": 2, "batch": 4, "device": "cpu"}, "cells": cells}


def figures():
    from torchtsp.bench import report

    result = synthetic_sweep()
    for make in (report.memory_figure, report.throughput_figure, report.bytes_figure):
        fig = make(result)
        fig.canvas.draw()
        yield make.__name__, fig


def test_every_series_is_visible_even_where_values_coincide():
    for name, fig in figures():
        for ax in fig.axes:
            measured = [line for line in ax.get_lines() if line.get_marker() not in ("None", "", None)]
            assert len(measured) == 4, name
            points = [{(round(x, 9), round(y, 9)) for x, y in zip(*line.get_data())} for line in measured]
            for i in range(len(points)):
                for j in range(i):
                    assert not points[i] & points[j], (name, measured[i].get_label(), measured[j].get_label())
            styles = {(line.get_marker(), str(line.get_linestyle()), line.get_markersize()) for line in measured}
            assert len(styles) == len(measured), name


def test_log_axes_have_several_plain_tick_labels():
    for name, fig in figures():
        for ax in fig.axes:
            low, high = ax.get_ylim()
            shown = [t.get_text() for t in ax.yaxis.get_ticklabels(which="both")
                     if t.get_text() and low <= t.get_position()[1] <= high]
            assert len(shown) >= 3, (name, shown)
            labels = shown + [t.get_text() for t in ax.xaxis.get_ticklabels(which="both")]
            assert not [t for t in labels if any(c in t for c in "×$^e")], (name, labels)
            assert [t.get_text() for t in ax.xaxis.get_ticklabels() if t.get_text()] == ["256", "512", "1,024"]


def test_a_tp_sp_cell_at_sp_1_is_labelled_by_its_real_layout():
    for name, fig in figures():
        labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        assert "TP2 (tp_sp, sp=1)" in labels and "tp_sp" not in labels, (name, labels)
    from torchtsp.bench.report import series_label

    assert series_label("tp_sp", "tp=2 x sp=2") == "tp_sp" and series_label("tp", "tp=2") == "tp"


def test_the_default_output_folder_is_ignored_by_git():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    default = parse([]).out
    result = subprocess.run(["git", "check-ignore", "-q", f"{default}/results.json"], cwd=root)
    assert result.returncode == 0, f"{default} is not ignored by .gitignore"
