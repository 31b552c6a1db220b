"""A bare ``--resume RUN`` continues the run it names: every saved setting restored, another dataset refused."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import cli_in_process

pytestmark = pytest.mark.multirank


def train(*args):
    """``torchtsp train ARGS`` through the command line's main in this process; its ranks are real processes (the
    entry point as a process: tests/test_train.py, tests/test_cli.py)."""
    proc = cli_in_process("train", *args)
    return proc.returncode, proc.stderr


def refused(*args):
    """A resume refused before any rank starts, run as the command line's main in this process."""
    proc = cli_in_process("train", *args)
    return proc.returncode, proc.stderr


def metrics(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").open())}


def ids(path, seed, n=6000, vocab=256):
    # Documents of random bytes, each ended by the byte tokenizer's EOS (256), so the document mask has work.
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, n).astype(np.int32)
    tokens[rng.choice(n, n // 40, replace=False)] = 256
    np.save(path, tokens)
    return path


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """Two ranks, its own train and eval data, the document mask, a schedule unlike the defaults: 6 steps, a
    checkpoint every 3; none of it is a default a resume could fall back on by luck."""
    root = tmp_path_factory.mktemp("resume")
    data, eval_data = ids(root / "train.npy", 1), ids(root / "eval.npy", 2)
    out = root / "full"
    code, err = train("--nproc", 2, "--tsp", 2, "--data", data, "--eval-data", eval_data, "--eval-every", 3,
                      "--document-mask", "--batch-size", 4, "--seq-len", 32, "--steps", 6, "--lr", 1e-2,
                      "--warmup-steps", 1, "--checkpoint-every", 3, "--sample-tokens", 0, "--seed", 7, "--out", out)
    assert code == 0, err
    return root, out


def interrupted_copy(full: Path, dest: Path) -> Path:
    """The run as if it had stopped after step 3: its latest checkpoint is step 3's, and later ones are gone."""
    shutil.copytree(full, dest)
    shutil.rmtree(dest / "checkpoints" / "step_000006")
    (dest / "checkpoints" / "latest").write_text("step_000003")
    return dest


def test_a_bare_resume_restores_every_setting_and_continues_bit_identically(full_run, tmp_path):
    _, full = full_run
    run = interrupted_copy(full, tmp_path / "run")
    code, err = train("--resume", run)
    assert code == 0, err
    want, got = metrics(full), metrics(run)
    assert sorted(got) == list(range(1, 7))
    # Same ranks, data, mask, seed and schedule: the same float operations in the same order, so equal bits.
    assert all(got[s]["loss"] == want[s]["loss"] for s in range(4, 7)), (got, want)
    evals = lambda m: {s: r["eval_loss"] for s, r in m.items() if "eval_loss" in r}
    assert evals(got) == evals(want) and 6 in evals(got)


def test_a_flag_given_on_resume_overrides_and_is_reported(full_run, tmp_path):
    _, full = full_run
    run = interrupted_copy(full, tmp_path / "run")
    code, err = train("--resume", run, "--steps", 4)
    assert code == 0, err
    assert "--steps 4 (saved 6)" in err
    assert max(metrics(run)) == 4


def test_another_dataset_is_refused_unless_its_position_is_reset(full_run, tmp_path):
    root, full = full_run
    run = interrupted_copy(full, tmp_path / "run")
    other = ids(tmp_path / "train.npy", 3)  # another file of the same size and name: the contents differ
    code, err = refused("--resume", run, "--data", other)
    assert code != 0 and "--reset-data" in err and "Traceback" not in err, err
    same_path_other_contents = ids(root / "train.npy", 4, n=7000)
    try:
        code, err = refused("--resume", run)
        assert code != 0 and "--reset-data" in err, err
    finally:
        ids(root / "train.npy", 1)  # the fixture's data back, for any test after this one
    code, err = train("--resume", run, "--data", other, "--reset-data")
    assert code == 0, err
    assert same_path_other_contents.exists()


def test_another_tokenizer_is_refused(full_run, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    _, full = full_run
    run = interrupted_copy(full, tmp_path / "run")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    code, err = refused("--resume", run, "--tokenizer", tmp_path / "tok")
    assert code != 0 and "tokenizer" in err and "Traceback" not in err, err
