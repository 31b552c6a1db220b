"""``torchtsp generate`` from the command line: every model source, local ranks, streamed text and --json,
and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import torchtsp
from helpers import cli_in_process
from torchtsp.cli import main
from torchtsp.infer import generate

TINY = torchtsp.ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=40, max_seq_len=32)


def torchtsp_cli(*args):
    """``torchtsp generate ARGS`` through the command line's ``main`` in this process (its ranks, with --nproc > 1,
    are real processes): a fresh interpreter would add seconds of imports per call. The entry point as a process
    is test_streams_text_without_json's."""
    return cli_in_process("generate", *args)


def generate_process(*args):
    env = {**os.environ, "TORCHTSP_DEBUG": "0"}
    return subprocess.run([sys.executable, "-m", "torchtsp", "generate", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def last_json(result) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random Llama checkpoint with a word-level tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from torchtsp.hf import save_hf_checkpoint

    path = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = torchtsp.Transformer(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.3)  # far from uniform: greedy tokens are decided by clear margins
    save_hf_checkpoint(path, model.state_dict(), TINY)
    words = ["[unk]"] + [f"w{i}" for i in range(TINY.vocab_size - 1)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[unk]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    return path, model


def test_hf_checkpoint_with_tokenizer_on_two_tsp_ranks_matches_the_reference(hf_dir):
    path, model = hf_dir
    out = last_json(torchtsp_cli("--hf", str(path), "--prompt", "w1 w2 w3", "--prompt", "w7", "--max-new-tokens", "5",
                                 "--nproc", "2", "--json"))
    expected = generate(model, [[2, 3, 4], [8]], 5).tokens
    assert out["tokens"] == expected
    assert out["text"][1].split()[0] == "w7" and len(out["text"][1].split()) == 6
    assert out["schedule"] == {"prefill": "activations", "decode": "activations"}
    assert len(out["peak_mem_bytes_per_rank"]) == len(out["kv_cache_bytes_per_rank"]) == 2
    assert all(b > 0 for b in out["peak_mem_bytes_per_rank"] + out["kv_cache_bytes_per_rank"])
    assert out["prefill_s"] > 0 and out["decode_s_per_token"] > 0


def test_schemes_and_schedules_agree_from_the_command_line(hf_dir):
    path, model = hf_dir
    expected = generate(model, [[1, 2, 3, 4, 5], [6, 7]], 4, temperature=0.9, top_k=8, seed=5).tokens
    common = ("--hf", str(path), "--prompt-ids", "1,2,3,4,5; 6,7", "--max-new-tokens", "4", "--temperature", "0.9",
              "--top-k", "8", "--seed", "5", "--json")
    for extra in (("--scheme", "tp", "--tp", "2"), ("--scheme", "tsp", "--nproc", "2", "--schedule", "weights")):
        assert last_json(torchtsp_cli(*common, *extra))["tokens"] == expected, extra


def test_streams_text_without_json(hf_dir):
    path, _ = hf_dir
    result = generate_process("--hf", str(path), "--prompt", "w1 w2", "--max-new-tokens", "3")
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert words[:2] == ["w1", "w2"] and len(words) == 5


def test_stop_ids_end_the_sequence(hf_dir):
    path, model = hf_dir
    free = generate(model, [[3, 4]], 6).tokens[0]
    stop = free[3]  # the second new token
    out = last_json(torchtsp_cli("--hf", str(path), "--prompt-ids", "3,4", "--max-new-tokens", "6",
                                 "--stop-token-ids", str(stop), "--json"))
    assert out["tokens"][0] == free[:free.index(stop, 2) + 1]


def test_training_checkpoint_with_the_byte_tokenizer(tmp_path):
    run = tmp_path / "run"
    train = cli_in_process("train", "--steps", "2", "--seq-len", "16", "--batch-size", "2", "--sample-tokens", "0",
                           "--out", str(run))
    assert train.returncode == 0, train.stderr
    out = last_json(torchtsp_cli("--checkpoint", str(run), "--prompt", "def ", "--max-new-tokens", "3", "--json"))
    assert out["tokens"][0][:4] == list(b"def ") and len(out["tokens"][0]) <= 7
    assert out["text"][0].startswith("def ")


@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", "1,2,300"], "prompt 0 has token id 300 outside the vocabulary [0, 257)"),
    (["--prompt", ""], "prompt 0 is empty"),
    (["--prompt-ids", "1,2;"], "prompt 1 is empty"),
    (["--prompt-ids", "1,x"], "is not a comma-separated list of integers"),
    (["--prompt", "a", "--max-new-tokens", "1024"], "exceeds the model's max_seq_len=1024"),
    (["--prompt", "a", "--tsp", "3"], "n_heads=8 divisible by 3"),
    (["--prompt", "a", "--scheme", "tp", "--tsp", "2"], "does not use --tsp 2"),
    (["--prompt", "a", "--top-p", "1.5"], "top_p"),
    (["--hf", "/does/not/exist", "--prompt", "a"], "not a directory"),
])
def test_bad_input_is_a_one_line_error(capsys, args, message):
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchtsp: error: ") and message in err and err.count("\n") == 1, err
