"""A preset trained from scratch with a tokenizer of its own: the vocabulary follows the tokenizer (or
--vocab-size), and a tokenizer that does not fit a fixed vocabulary is refused naming both sizes."""

import json
import math
import random

import pytest
import torch

import torchtsp
from helpers import cli_in_process
from torchtsp.train import checkpoint
from torchtsp.train.config import TrainConfig
from torchtsp.train.trainer import run_training

SMALL = {"preset": "tiny", "batch_size": 4, "seq_len": 32, "steps": 2, "sample_tokens": 8}


def words(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(n)]


def bpe_tokenizer(folder, vocab_size: int):
    """A byte-level BPE of ``vocab_size`` ids trained here, with an EOS, and a text corpus beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir()
    text = [" ".join(words(12, seed)) for seed in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == vocab_size  # the corpus is rich enough for every merge asked for
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (folder / "corpus.txt").write_text("\n".join(text))
    return folder


@pytest.fixture(scope="module")
def tokenizers_by_size(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    return {n: bpe_tokenizer(root / f"v{n}", n) for n in (300, 1000)}


def model_vocab(out) -> int:
    return checkpoint.read_meta(checkpoint.resolve(out))["model"]["vocab_size"]


@pytest.mark.parametrize("size,world,degrees", [(300, 1, {}), (1000, 2, {"tsp": 2})])
def test_a_preset_trains_with_a_bpe_tokenizer_of_any_size(pools, tmp_path, tokenizers_by_size, size, world,
                                                          degrees):
    folder = tokenizers_by_size[size]
    cfg = TrainConfig(**SMALL, **degrees, tokenizer=str(folder), data=str(folder / "corpus.txt"),
                      out=str(tmp_path / "run"))
    summary = pools(world).run(run_training, cfg)[0]
    assert summary["status"] == "done" and all(math.isfinite(x) for x in summary["losses"])
    vocab = model_vocab(tmp_path / "run")
    # The tokenizer's size rounded up to a multiple of 128 (a preset alone has 257 rows).
    assert vocab == -(-size // 128) * 128 and vocab >= size
    # A model with a row for every id starts near the uniform loss over its rows, ln(V).
    assert abs(summary["losses"][0] - math.log(vocab)) < 1.0, (summary["losses"], math.log(vocab))


def test_vocab_size_flag_sets_the_preset_vocabulary(pools, tmp_path, tokenizers_by_size):
    folder = tokenizers_by_size[300]
    cfg = TrainConfig(**{**SMALL, "sample_tokens": 0}, vocab_size=333, tokenizer=str(folder),
                      data=str(folder / "corpus.txt"), out=str(tmp_path / "run"))
    summary = pools(1).run(run_training, cfg)[0]
    assert summary["status"] == "done" and model_vocab(tmp_path / "run") == 333


def cli(*args):
    return cli_in_process(*args)  # every call here is refused before any rank starts


def error_line(result) -> str:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("torchtsp: error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_a_tokenizer_that_does_not_fit_names_both_sizes(tmp_path, tokenizers_by_size):
    from torchtsp.hf import save_hf_checkpoint

    folder = tokenizers_by_size[1000]
    cfg = torchtsp.ModelConfig()  # the tiny shape: 257 ids
    torch.manual_seed(0)
    save_hf_checkpoint(tmp_path / "hf", torchtsp.Transformer(cfg).state_dict(), cfg)
    base = ["train", "--steps", 1, "--batch-size", 4, "--seq-len", 32, "--sample-tokens", 0,
            "--data", folder / "corpus.txt", "--tokenizer", folder, "--out", tmp_path / "run"]
    line = error_line(cli(*base, "--init-from-hf", tmp_path / "hf"))
    assert "has 1000 ids but the model's vocabulary" in line and f"--init-from-hf {tmp_path / 'hf'}" in line, line
    assert "has 257" in line and "another model" not in line, line
    line = error_line(cli(*base, "--vocab-size", 999))
    assert "has 1000 ids but the model's vocabulary, fixed by --vocab-size 999, has 999" in line, line
    line = error_line(cli(*base, "--vocab-size", 512, "--init-from-hf", tmp_path / "hf"))
    assert "applies to presets trained from scratch" in line, line
    assert not (tmp_path / "run").exists()


def test_resuming_with_a_larger_tokenizer_names_the_checkpoints_vocabulary(pools, tmp_path, tokenizers_by_size):
    folder = tokenizers_by_size[300]
    cfg = TrainConfig(**{**SMALL, "steps": 1, "sample_tokens": 0}, data=str(folder / "corpus.txt"),
                      out=str(tmp_path / "run"))
    assert pools(1).run(run_training, cfg)[0]["status"] == "done"  # the byte tokenizer: 257 ids
    line = error_line(cli("train", "--resume", tmp_path / "run", "--steps", 2, "--batch-size", 4, "--seq-len", 32,
                          "--sample-tokens", 0, "--tokenizer", folder, "--data", folder / "corpus.txt"))
    assert f"has 300 ids but the model's vocabulary, fixed by the checkpoint of --resume {tmp_path / 'run'}, " \
           f"has 257" in line, line
