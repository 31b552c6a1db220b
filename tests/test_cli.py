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
    for command in ("train", "bench", "plan", "generate", "convert"):
        assert re.search(rf"^\s+{command}\s+\S", result.stdout, re.M), command


def test_train_loss_falls(tmp_path):
    result = torchtsp("train", "--steps", "8", "--seq-len", "32", "--batch-size", "4", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    first, last = map(float, re.search(r"^\s+loss\s+(\S+) -> (\S+)", result.stdout, re.M).groups())
    assert first > last


def test_unimplemented_command(capsys):
    assert main(["bench"]) == 2
    assert "torchtsp bench: not implemented yet" in capsys.readouterr().err


def test_missing_data_is_a_one_line_error():
    result = torchtsp("train", "--data", "/does/not/exist")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "torchtsp: error: corpus path '/does/not/exist' does not exist; expected a text file or a folder"
    ]
