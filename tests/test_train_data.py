"""The trainer on real data: it reads ids (not bytes), refuses what the model cannot train on before any rank
starts, keeps its data position across resumes (also at another D), accumulates gradients exactly, evaluates,
records TensorBoard scalars and a profiler trace, and runs the whole tokenizer-to-generation workflow."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import torchtsp
from torchtsp.train.checkpoint import load_full_state_dict
from torchtsp.train.config import TrainConfig
from torchtsp.train.trainer import run_training

WIDE = torchtsp.ModelConfig(vocab_size=1024)  # the tiny shape with ids above the byte range
SMALL = {"batch_size": 4, "seq_len": 32, "sample_tokens": 0}


@pytest.fixture(scope="module")
def wide_hf(tmp_path_factory):
    """A random Llama of the tiny shape with a 1024-id vocabulary, without a tokenizer (datasets of ids)."""
    from torchtsp.hf import save_hf_checkpoint

    path = tmp_path_factory.mktemp("wide_hf")
    torch.manual_seed(0)
    save_hf_checkpoint(path, torchtsp.Transformer(WIDE).state_dict(), WIDE)
    return path


@pytest.fixture(scope="module")
def pattern_npy(tmp_path_factory):
    """A learnable stream above id 255: each id determines the next (a fixed cycle of 48 ids in 300..1023)."""
    path = tmp_path_factory.mktemp("pattern") / "ids.npy"
    cycle = 300 + np.random.default_rng(0).choice(724, 48, replace=False)
    np.save(path, np.tile(cycle, 100).astype(np.int32))
    return path


def train(pools, world, out, **settings):
    return pools(world).run(run_training, TrainConfig(**{**SMALL, "out": str(out), **settings}))[0]


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").open()]


def test_a_pattern_above_the_byte_range_is_learned(pools, tmp_path, wide_hf, pattern_npy):
    summary = train(pools, 2, tmp_path / "run", tsp=2, init_from_hf=str(wide_hf), data=str(pattern_npy),
                    steps=60, lr=1e-2, batch_size=8)
    # ln(1024) = 6.9 at the start; a model reading bytes of these ids could not get near zero.
    assert summary["losses"][0] > 6 and summary["last_loss"] < 0.3, summary["losses"][::10]


@pytest.mark.parametrize("preset,world,degrees", [("tiny", 2, {"tsp": 2}), ("tiny", 4, {"dp": 2, "tsp": 2}),
                                                  ("tiny-moe", 2, {"tsp": 2}), ("tiny", 2, {"pp": 2, "tsp": 1})])
def test_grad_accum_equals_one_big_batch(pools, tmp_path, preset, world, degrees):
    runs = {n: train(pools, world, tmp_path / f"accum{n}", preset=preset, steps=2, grad_accum=n, **degrees)
            for n in (1, 2)}
    one, two = runs[1]["losses"], runs[2]["losses"]
    # float32 round-off of a sum split in two (the first loss), then of one AdamW step (the second).
    assert all(abs(a - b) <= 2e-6 * abs(a) for a, b in zip(one, two)), (one, two)
    _, w1 = load_full_state_dict(tmp_path / "accum1")
    _, w2 = load_full_state_dict(tmp_path / "accum2")
    # AdamW's first update is lr * g / (|g| + eps): for a gradient element near eps = 1e-8, float32 round-off of
    # ~1e-10 in g (a sum of two micro-batches instead of one) moves the weight by lr * 1e-10 / (4 eps) ~ 1e-5,
    # against the 2 * lr = 6e-3 every weight moves. Dropping or double-counting a micro-batch moves it ~lr.
    worst = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert worst <= 3e-5, worst
    if preset == "tiny-moe":
        loads = [[r["aux_loss"], r["expert_load_min"], r["expert_load_max"]] for r in metrics(tmp_path / "accum2")]
        want = [[r["aux_loss"], r["expert_load_min"], r["expert_load_max"]] for r in metrics(tmp_path / "accum1")]
        assert np.allclose(loads, want, rtol=1e-5), (loads, want)  # the aux loss is over the whole batch


@pytest.fixture(scope="module")
def short_npy(tmp_path_factory):
    """1,500 ids: 46 samples of 33, so a 4-row batch wraps into a new epoch every ~12 steps."""
    path = tmp_path_factory.mktemp("short") / "ids.npy"
    np.save(path, (np.arange(1500) * 37 % 251).astype(np.uint16))
    return path


def test_resume_continues_the_data_bit_identically_also_at_another_d(pools, tmp_path, short_npy):
    full = train(pools, 2, tmp_path / "full", tsp=2, data=str(short_npy), steps=16, checkpoint_every=8)
    assert full["epoch"] > 1.3  # the run crossed an epoch boundary after the checkpoint
    step8 = tmp_path / "full" / "checkpoints" / "step_000008"
    meta = json.loads((step8 / "meta.json").read_text())
    assert meta["data_position"]["drawn"] == [32]
    same = train(pools, 2, tmp_path / "same", tsp=2, data=str(short_npy), steps=16, resume=str(step8))
    assert same["losses"] == full["losses"][8:]  # bit-identical: the same samples in the same order
    wider = train(pools, 4, tmp_path / "wider", dp=2, tsp=2, data=str(short_npy), steps=16, resume=str(step8))
    # Another mesh reorders float32 sums: round-off compounded over 8 steps, the data exactly the same.
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(wider["losses"], full["losses"][8:]))


def test_eval_tensorboard_and_profile(pools, tmp_path, short_npy, pattern_npy, wide_hf):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    summary = train(pools, 2, out, tsp=2, init_from_hf=str(wide_hf), data=str(pattern_npy),
                    eval_data=str(short_npy), eval_every=2, eval_batches=3, steps=5, tensorboard=True,
                    profile_steps="2:3", grad_accum=2)
    records = metrics(out)
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4, 5]  # every 2 steps and at the end
    assert summary["eval_loss"] == records[-1]["eval_loss"] > 0
    assert abs(records[-1]["eval_ppl"] - np.exp(records[-1]["eval_loss"])) < 1e-6 * records[-1]["eval_ppl"]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    for rank in (0, 1):
        trace = json.loads((out / "profile" / f"rank{rank}.json").read_text())
        assert trace["traceEvents"]


def test_training_on_a_large_dataset_keeps_resident_memory_flat(pools, tmp_path, wide_hf):
    ids = np.random.default_rng(0).integers(0, 1024, 6_000_000).astype(np.uint16)  # 12 MB
    np.save(tmp_path / "big.npy", ids)
    del ids
    train(pools, 2, tmp_path / "run", tsp=2, init_from_hf=str(wide_hf), data=str(tmp_path / "big.npy"), steps=30,
          batch_size=8, seq_len=64)
    rss = [r["rss_bytes"] for r in metrics(tmp_path / "run")]
    assert (tmp_path / "big.npy").stat().st_size > 8 * 2**20
    assert max(rss[5:]) - rss[5] < 4 * 2**20, [x / 2**20 for x in rss]


# ------------------------------------------------------------------ refusals, before any rank starts


def cli(*args, timeout=240):
    env = {**os.environ, "TORCHTSP_DEBUG": "0"}
    return subprocess.run([sys.executable, "-m", "torchtsp", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def one_error_line(result) -> str:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("torchtsp: error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def bpe_dataset(tmp_path_factory):
    """A dataset prepared with a BPE tokenizer (not the byte tokenizer of presets)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("bpe_ds")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["the cat sat on the mat"] * 20, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (folder / "c.jsonl").write_text("".join(json.dumps({"text": f"the cat {i} sat"}) + "\n" for i in range(300)))
    from torchtsp.data.prepare import prepare

    prepare([folder / "c.jsonl"], str(folder), str(folder / "ds"), progress=False)
    return folder


def test_refusals_are_one_line_before_any_rank(tmp_path, bpe_dataset, monkeypatch, capsys):
    """The command line's refusals, through its ``main`` in this process (what a subprocess would run, less a
    torch import per case): each is exit code 2 and one ``torchtsp: error:`` line, and no rank starts."""
    from torchtsp.cli import main

    monkeypatch.setenv("TORCHTSP_DEBUG", "0")
    base = ["train", "--nproc", 2, "--tsp", 2, "--steps", 2, "--batch-size", 4, "--seq-len", 32,
            "--sample-tokens", 0, "--out", tmp_path / "run"]
    np.save(tmp_path / "high.npy", np.arange(2000, dtype=np.int32) % 300)
    cases = [
        (["--data", tmp_path / "high.npy"], "holds token id 299, outside the model's vocabulary of 257"),
        (["--data", bpe_dataset / "ds"], "was prepared with another tokenizer"),
        (["--grad-accum", 3], "does not divide the batch"),
        (["--dp", 2, "--tsp", 1, "--batch-size", 4, "--grad-accum", 4], "does not divide the batch per replica"),
        (["--eval-every", 2], "needs eval_data (--eval-data)"),
        (["--data", "0.5 A -1 B"], "blend weight '-1' is not a positive number"),
        (["--data", tmp_path / "nowhere"], "no such file, folder or Megatron dataset"),
    ]
    for extra, match in cases:
        assert main(list(map(str, base + extra))) == 2, extra
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("torchtsp: error:") and match in lines[0], (extra, err)
    assert not (tmp_path / "run").exists()  # no rank ever started


def test_hostile_data_is_one_line_before_any_rank(tmp_path, monkeypatch, capsys):
    """Issue 38's data probes through the command line, run in a folder full of text: an empty path is never
    that folder, and a damaged file is named with the place of the damage."""
    import struct

    from torchtsp.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "private.txt").write_text("text of the current folder that must not be trained on\n" * 100)
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xff"}\n')

    def megatron(name, code, values, lengths):  # MMIDIDX v1, written here from the spec
        (tmp_path / f"{name}.bin").write_bytes(values.tobytes())
        (tmp_path / f"{name}.idx").write_bytes(
            b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(lengths), len(lengths) + 1)
            + np.asarray(lengths, np.int32).tobytes() + np.array([0, 2 * lengths[0]], np.int64).tobytes()
            + np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    megatron("floats", 6, np.full(400, np.nan), [200, 200])
    megatron("negative", 8, np.arange(400, dtype=np.uint16), [200, -5])
    megatron("sidecar", 8, np.arange(400, dtype=np.uint16) % 200, [200, 200])
    (tmp_path / "sidecar.json").write_text('{"tokenizer": "byte"}')
    base = ["train", "--nproc", "1", "--steps", "1", "--batch-size", "2", "--seq-len", "32", "--sample-tokens", "0",
            "--out", str(tmp_path / "run")]
    cases = [
        (base + ["--data", ""], "data (--data) is an empty path"),
        (base + ["--data", "  "], "data (--data) is an empty path"),
        (base + ["--eval-data", ""], "eval_data (--eval-data) is an empty path"),
        (base + ["--tokenizer", ""], "tokenizer (--tokenizer) is an empty path"),
        (base + ["--init-from-hf", ""], "init_from_hf (--init-from-hf) is an empty path"),
        (base + ["--data", "bad.jsonl"], "bad.jsonl:2: byte 0xff at byte offset 30 is not UTF-8"),
        (base + ["--data", "floats"], "floats.idx: dtype float64 (Megatron code 6) holds no token ids"),
        (base + ["--data", "negative"], "negative.idx is damaged or crafted: sequence 1 has a negative length (-5)"),
        (base + ["--data", "sidecar"], "sidecar.json: field 'tokenizer' must be an object"),
        (["prepare-data", "", "--tokenizer", "byte", "--out", "ds"], "an input is an empty path"),
    ]
    for argv, match in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and match in lines[0], (argv, err)
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob("ds*"))  # no rank ever started


def test_prepare_data_command_line(tmp_path, bpe_dataset):
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n{"txt": "y"}\n')
    line = one_error_line(cli("prepare-data", tmp_path / "bad.jsonl", "--tokenizer", bpe_dataset, "--out",
                              tmp_path / "ds"))
    assert "bad.jsonl:2: the record has no 'text' field" in line
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {')
    line = one_error_line(cli("prepare-data", bpe_dataset / "c.jsonl", "--tokenizer", tmp_path / "broken", "--out",
                              tmp_path / "ds"))
    assert "tokenizer.json is not a valid tokenizer file" in line and str(tmp_path / "broken") in line
    assert not list(tmp_path.glob("ds*"))
