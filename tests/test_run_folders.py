"""Where ``torchtsp train`` writes without --out (a new folder per run, runs/latest the newest) and what a resume of
a run that has finished says. One rank, a few tiny steps, through the command line's main in this process."""

import os
from pathlib import Path

from helpers import cli_in_process

TINY_RUN = ("--nproc", 1, "--tsp", 1, "--steps", 2, "--batch-size", 2, "--seq-len", 16, "--sample-tokens", 0)


def train(*args):
    proc = cli_in_process("train", *args)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_default_run_folders_do_not_collide_and_latest_names_the_newest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, second = train(*TINY_RUN), train(*TINY_RUN)
    runs = sorted(p for p in Path("runs").iterdir() if p.name != "latest")
    assert len(runs) == 2, runs
    assert all((run / "checkpoints" / "step_000002").is_dir() for run in runs)
    assert str(runs[0]) in first.stdout and str(runs[1]) in second.stdout  # the summary names the folder
    latest = Path("runs/latest")
    assert latest.is_symlink() and latest.resolve() == runs[1].resolve()
    # What the docs show after a run: continue it, convert it.
    train("--resume", "runs/latest", "--steps", 3)
    assert (runs[1] / "checkpoints" / "step_000003").is_dir() and not (runs[0] / "checkpoints" / "step_000003").exists()
    converted = cli_in_process("convert", "runs/latest", "hf_export")
    assert converted.returncode == 0, converted.stderr
    assert Path("hf_export/config.json").is_file()


def test_an_explicit_out_is_kept_and_leaves_latest_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train(*TINY_RUN, "--out", "runs/mine")
    assert (tmp_path / "runs" / "mine" / "checkpoints").is_dir()
    assert not os.path.lexists("runs/latest")
    refused = cli_in_process("train", *TINY_RUN, "--out", "runs/mine")
    assert refused.returncode != 0 and "--overwrite" in refused.stderr


def test_resuming_a_finished_run_says_there_is_nothing_to_do(tmp_path):
    out = tmp_path / "run"
    train(*TINY_RUN, "--out", out)
    proc = train("--resume", out)
    lines = proc.stdout.strip().splitlines()
    assert lines == [f"torchtsp: nothing left to do: {out} is at step 2 of 2 (give --steps N above 2 to train "
                     f"further)"], proc.stdout
    assert "nan" not in proc.stdout + proc.stderr


def test_by_default_only_the_first_two_steps_pay_for_the_memory_peak(tmp_path):
    """A measured step runs under MemTracker (~3x slower): by default only the first step and the first with
    optimizer state, which hold the run's peak, are measured; the summary still reports the peak per rank."""
    import json

    out = tmp_path / "run"
    proc = train(*TINY_RUN[:4], "--steps", 12, *TINY_RUN[6:], "--out", out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    measured = [r["step"] for r in records if "peak_mem_bytes" in r]
    assert measured == [1, 2], measured
    peak = max(r["peak_mem_bytes"] for r in records if "peak_mem_bytes" in r)
    assert peak > 0
    assert f"peak live memory / rank  {peak / 2**20:.1f} MiB" in proc.stdout, proc.stdout
