import os
import re
import subprocess
import sys

from torchtsp.cli import main


def torchtsp(*args):
    env = {**os.environ, "TORCHTSP_DEBUG": "0"}
    return subprocess.run([sys.executable, "-m", "torchtsp", *args], capture_output=True, text=True, env=env)


def test_help_lists_every_command():
    result = torchtsp("--help")
    assert result.returncode == 0
    for command in ("train", "prepare-data", "bench", "plan", "generate", "convert"):
        assert re.search(rf"^\s+{command}\s+\S", result.stdout, re.M), command


def test_train_loss_falls(tmp_path):
    result = torchtsp("train", "--steps", "8", "--seq-len", "32", "--batch-size", "4", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    first, last = map(float, re.search(r"^\s+loss\s+(\S+) -> (\S+)", result.stdout, re.M).groups())
    assert first > last


def test_generate_without_prompt_is_a_one_line_error(capsys):
    assert main(["generate"]) == 2
    assert capsys.readouterr().err == "torchtsp: error: no prompt: give --prompt TEXT or --prompt-ids IDS\n"


def test_plan_runs_from_the_command_line():
    result = torchtsp("plan", "--preset", "paper-7b", "--seq-len", "131072", "--gpus", "8")
    assert result.returncode == 0, result.stderr
    assert "recommended:" in result.stdout and "38.8" in result.stdout  # the paper's TSP figure beside ours


def test_missing_data_is_a_one_line_error():
    result = torchtsp("train", "--data", "/does/not/exist")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "torchtsp: error: --data /does/not/exist: no such file, folder or Megatron dataset (exist.bin + exist.idx)"
    ]


def _one_line_error(result, expected):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("torchtsp: error:") and expected in lines[0], lines[0]


def test_convert_bad_checkpoints_are_one_line_errors(tmp_path):
    import json

    from torchtsp import ModelConfig, Transformer
    from torchtsp.hf import save_hf_checkpoint

    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64, vocab_size=50)
    save_hf_checkpoint(tmp_path / "hf", Transformer(cfg).state_dict(), cfg)
    _one_line_error(torchtsp("convert", str(tmp_path / "nothing"), str(tmp_path / "out")), "does not exist")

    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # truncated
    _one_line_error(torchtsp("convert", str(tmp_path / "hf"), str(tmp_path / "out")), "model.safetensors")

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    _one_line_error(torchtsp("convert", str(tmp_path / "hf"), str(tmp_path / "out")), "attention_bias")
