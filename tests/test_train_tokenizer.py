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


# A run on bytes (the presets' default) keeps no tokenizer: convert writes the byte tokenizer as Hugging Face files.
BYTE_TEXTS = ["Once upon a time", "  two  spaces\nnewline\ttab", "naïve café, 日本語 🙂", "", "ends with EOS"]


def test_convert_of_a_byte_run_writes_a_tokenizer_transformers_and_torchtsp_read_as_bytes(tmp_path):
    from transformers import AutoTokenizer

    from torchtsp.data.tokenizers import ByteTokenizer
    from torchtsp.generate_job import model_config_and_tokenizer

    run, folder = tmp_path / "run", tmp_path / "hf_export"
    trained = cli_in_process("train", "--nproc", 1, "--tsp", 1, "--steps", 1, "--batch-size", 2, "--seq-len", 16,
                             "--sample-tokens", 0, "--out", run)
    assert trained.returncode == 0, trained.stderr
    converted = cli_in_process("convert", run, folder)
    assert converted.returncode == 0, converted.stderr
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}

    hf = AutoTokenizer.from_pretrained(folder)
    _, ours, eos = model_config_and_tokenizer("hf", str(folder))  # what generate and serve --hf load
    assert hf.eos_token_id == ours.eos_id == eos == ByteTokenizer.eos_id == 256
    for text in BYTE_TEXTS:
        expected = list(text.encode("utf-8"))  # ByteTokenizer's ids, by definition
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text) == expected, text
        assert hf.decode(expected + [256], skip_special_tokens=True) == ours.decode(expected + [256]) == text
    # The model answers the same through the converted folder as through its run (the byte tokenizer).
    prompt = ("--prompt", "Once upon", "--max-new-tokens", 6, "--temperature", 0)
    via_hf = cli_in_process("generate", "--hf", folder, *prompt)
    via_run = cli_in_process("generate", "--checkpoint", run, *prompt)
    assert via_hf.returncode == via_run.returncode == 0, via_hf.stderr + via_run.stderr
    assert via_hf.stdout == via_run.stdout
