"""The trainer: exact against single-device training, exact resume, resharding, bad input, Ctrl-C."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import cli_in_process
from torchtsp.presets import get_preset
from torchtsp.train.config import TrainConfig
from torchtsp.train.single import train_single
from torchtsp.train.trainer import run_training

SMALL = {"preset": "tiny", "batch_size": 4, "seq_len": 32, "steps": 20, "sample_tokens": 0}


def run(pools, world, tmp_path, name, **settings):
    cfg = TrainConfig(**{**SMALL, "out": str(tmp_path / name), **settings})
    return pools(world).run(run_training, cfg)[0]


@pytest.fixture(scope="module")
def single_device_losses():
    s = SMALL
    return train_single(get_preset(s["preset"]), s["steps"], s["batch_size"], s["seq_len"], lr=TrainConfig.lr,
                        seed=0, prompt=None)


@pytest.mark.parametrize("degrees", [{"dp": 2, "tsp": 2}, {"tsp": 4}])
def test_training_matches_single_device_at_every_step(pools, tmp_path, single_device_losses, degrees):
    summary = run(pools, 4, tmp_path, "run", **degrees)
    assert summary["status"] == "done" and len(summary["losses"]) == SMALL["steps"]
    for step, (got, want) in enumerate(zip(summary["losses"], single_device_losses)):
        # float32 round-off of reordered sums, compounded over 20 AdamW steps: 1e-4 relative.
        assert abs(got - want) <= 1e-4 * abs(want), (step, got, want)
    assert summary["losses"][-1] < summary["losses"][0] - 1.0


def test_recompute_gives_the_same_losses_with_less_memory(pools, tmp_path):
    base = run(pools, 2, tmp_path, "plain", tsp=2, steps=3, seq_len=256)
    recompute = run(pools, 2, tmp_path, "recompute", tsp=2, steps=3, seq_len=256, recompute=True)
    selective = run(pools, 2, tmp_path, "selective", tsp=2, steps=3, seq_len=256, recompute="selective")
    assert recompute["losses"] == base["losses"]  # recomputation repeats the same float ops
    assert selective["losses"] == base["losses"]  # so does selective (the same GEMMs, the same elementwise ops)
    assert recompute["peak_mem_bytes"] < selective["peak_mem_bytes"] < base["peak_mem_bytes"]
    print(f"\npeak/rank at S=256, D=2: {base['peak_mem_bytes'] / 2**20:.2f} MiB, "
          f"with recompute {recompute['peak_mem_bytes'] / 2**20:.2f} MiB, "
          f"selective {selective['peak_mem_bytes'] / 2**20:.2f} MiB")


def test_bfloat16_mixed_precision_trains(pools, tmp_path):
    summary = run(pools, 2, tmp_path, "bf16", tsp=2, steps=6, dtype="bfloat16")
    fp32 = run(pools, 2, tmp_path, "fp32", tsp=2, steps=6)
    # bf16 has an 8-bit mantissa: losses agree to a few percent, not to round-off.
    assert all(abs(a - b) < 0.05 * b for a, b in zip(summary["losses"], fp32["losses"]))


# ---------------------------------------------------------------- through the command line


def torchtsp_cli(*args, wait=True, **kwargs):
    cmd = [sys.executable, "-m", "torchtsp", "train", *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=240)
    return proc.returncode, out, err


def cli_train(*args):
    """``torchtsp train ARGS`` through the command line's main in this process (its ranks are real processes), for
    runs whose process as a whole is not what is tested: a fresh interpreter costs seconds of imports."""
    proc = cli_in_process("train", *args)
    return proc.returncode, proc.stdout, proc.stderr


def cli_settings(out, steps=12, tsp=2, **extra):
    args = ["--nproc", tsp, "--tsp", tsp, "--batch-size", 4, "--seq-len", 32, "--steps", steps,
            "--sample-tokens", 0, "--out", out]
    return args + [x for k, v in extra.items() for x in (f"--{k.replace('_', '-')}", v)]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").open())}


def wait_for_step(run_dir, step, proc, limit=180):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        metrics = Path(run_dir) / "metrics.jsonl"
        if metrics.exists() and max(losses(run_dir), default=0) >= step:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise TimeoutError(f"no step {step} in {run_dir}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    code, _, err = cli_train(*cli_settings(out, checkpoint_every=5))
    assert code == 0, err
    return out


def test_killed_run_resumes_with_identical_losses(tmp_path, uninterrupted):
    out = tmp_path / "killed"
    proc = torchtsp_cli(*cli_settings(out, checkpoint_every=5), wait=False)
    wait_for_step(out, 7, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole process group, mid-run
    proc.communicate()
    assert (out / "checkpoints" / "latest").read_text() == "step_000005"
    code, _, err = cli_train(*cli_settings(out, resume=out))
    assert code == 0, err
    full, resumed = losses(uninterrupted), losses(out)
    assert all(resumed[s] == full[s] for s in range(6, 13)), (resumed, full)  # bit-identical


def test_resume_at_another_tsp_degree_continues_within_round_off(pools, tmp_path, uninterrupted):
    """The command line's run, resumed at D = 4 by the trainer in the shared pool of 4 (the resharding is the
    trainer's; the command line's own resume is test_killed_run_resumes_with_identical_losses)."""
    out = tmp_path / "resharded"
    run(pools, 4, tmp_path, "resharded", tsp=4, steps=12, resume=str(uninterrupted / "checkpoints" / "step_000005"))
    full, resumed = losses(uninterrupted), losses(out)
    assert sorted(resumed) == list(range(6, 13))
    # Another D reorders float32 sums: round-off, compounded over 7 steps.
    assert all(abs(resumed[s] - full[s]) <= 1e-5 * full[s] for s in resumed), (resumed, full)


def damaged_copy(src, tmp_path):
    dst = tmp_path / "damaged"
    shutil.copytree(src / "checkpoints" / "step_000005", dst)
    shard = sorted(dst.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    return dst


@pytest.mark.parametrize("case,match", [
    ("shape", "holds a different model shape"),
    ("missing", "does not exist"),
    ("damaged", "is damaged: __0_0.distcp does not match the checksum"),
    ("mesh", "needs 6 ranks but the world has 2"),
])
def test_bad_input_is_one_clear_error_and_a_non_zero_exit(tmp_path, uninterrupted, case, match):
    extra = {
        "shape": {"resume": uninterrupted, "preset": "small"},
        "missing": {"resume": tmp_path / "nowhere"},
        "damaged": {"resume": damaged_copy(uninterrupted, tmp_path) if case == "damaged" else None},
        "mesh": {"dp": 3},
    }[case]
    start = time.monotonic()
    proc = cli_in_process("train", *cli_settings(tmp_path / "bad", **extra))  # main's exit code and stderr
    code, err = proc.returncode, proc.stderr
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("torchtsp: error:")]
    assert len(lines) == 1 and match in lines[0], err
    assert "Traceback" not in err
    assert time.monotonic() - start < 120


def test_ctrl_c_finishes_the_step_saves_and_exits(tmp_path):
    out = tmp_path / "interrupted"
    proc = torchtsp_cli(*cli_settings(out, steps=500), wait=False)
    wait_for_step(out, 3, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to the foreground process group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    saved = (out / "checkpoints" / "latest").read_text()
    last = max(losses(out))
    assert saved == f"step_{last:06d}" and f"interrupted at step {last}" in err


def test_hf_in_and_out(pools, tmp_path):
    """--init-from-hf starts from HF weights; `torchtsp convert` exports the trained run to HF."""
    import torch
    import transformers

    from torchtsp import Transformer
    from torchtsp.data.samples import BatchStream, PackedSamples
    from torchtsp.data.sources import TokenSource, builtin_corpus
    from torchtsp.data.tokenizers import ByteTokenizer
    from torchtsp.hf import config_to_hf, save_hf_checkpoint

    cfg = get_preset("tiny")
    torch.manual_seed(123)
    start = Transformer(cfg)
    save_hf_checkpoint(tmp_path / "hf_in", start.state_dict(), cfg)
    assert config_to_hf(cfg)["vocab_size"] == cfg.vocab_size
    summary = run(pools, 2, tmp_path, "from_hf", tsp=2, steps=2, init_from_hf=str(tmp_path / "hf_in"))
    corpus = TokenSource("builtin", builtin_corpus(ByteTokenizer()), "builtin")  # no tokenizer.json: bytes
    batch = BatchStream([(1.0, PackedSamples(corpus, SMALL["seq_len"]))], SMALL["batch_size"], 0).next_batch()
    tokens, labels = batch[:, :-1], batch[:, 1:]  # the trainer's first batch
    expected = start.loss(tokens, labels).item()
    assert abs(summary["losses"][0] - expected) <= 1e-5 * expected  # float32 round-off of TSP vs reference

    code = subprocess.run([sys.executable, "-m", "torchtsp", "convert", str(tmp_path / "from_hf"),
                           str(tmp_path / "hf_out")], capture_output=True, text=True, timeout=120)
    assert code.returncode == 0, code.stderr
    from torchtsp.train.checkpoint import load_full_state_dict

    trained_cfg, weights = load_full_state_dict(tmp_path / "from_hf")
    trained = Transformer(trained_cfg)
    trained.load_state_dict(weights)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf_out")
    assert torch.equal(hf(tokens).logits, trained(tokens))


def test_torchrun_launch_uses_the_launched_ranks(tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc-per-node", "2", "-m", "torchtsp", "train", "--steps", "2", "--batch-size", "4",
           "--seq-len", "32", "--sample-tokens", "0", "--out", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("summary") == 1 and "tsp / tsp=2" in result.stdout  # TSP took both ranks


def test_toml_settings_are_overridden_by_flags(tmp_path):
    from torchtsp.train.config import build_config

    toml = tmp_path / "run.toml"
    toml.write_text('[train]\nsteps = 7\nseq-len = 64\nscheme = "tp"\n')
    cfg = build_config(str(toml), steps=9, seq_len=None)  # None: flag not given
    assert (cfg.steps, cfg.seq_len, cfg.scheme) == (9, 64, "tp")
    toml.write_text("stepz = 3\n")
    with pytest.raises(ValueError, match="unknown setting\\(s\\) stepz"):
        build_config(str(toml))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_config(str(tmp_path / "missing.toml"))


def test_resume_under_another_scheme_and_dp_traffic_is_counted(pools, tmp_path):
    first = run(pools, 2, tmp_path, "tsp", tsp=2, steps=4, checkpoint_every=2)
    resumed = run(pools, 2, tmp_path, "tp", scheme="tp", tp=2, steps=4,
                  resume=str(tmp_path / "tsp" / "checkpoints" / "step_000002"))
    # Another scheme sums in another order: float32 round-off over two steps.
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(resumed["losses"], first["losses"][2:]))
    assert sorted(losses(tmp_path / "tp")) == [3, 4]
    run(pools, 2, tmp_path, "dp", scheme="dp", dp=2, steps=1)
    record = json.loads((tmp_path / "dp" / "metrics.jsonl").read_text())
    assert record["bytes_recv_rank0"] > 0  # the dp scheme's gradient all-reduces are counted
