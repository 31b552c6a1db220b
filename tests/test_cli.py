import os
import re
import subprocess
import sys

import pytest

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


# ------------------------------------------------------------------ one vocabulary of flags across the commands


def subparser(command: str):
    from torchtsp.cli import build_parser

    parser = build_parser()
    return parser, next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)
                        ).choices[command]


def flag(command: str, name: str):
    return next(a for a in subparser(command)[1]._actions if name in a.option_strings)


def test_version_is_the_installed_distributions(capsys):
    from importlib.metadata import version

    parser, _ = subparser("train")
    try:
        parser.parse_args(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert capsys.readouterr().out == f"torchtsp {version('torchtsp')}\n"


@pytest.mark.parametrize("argv,dest,value", [
    (["train", "--seq-len", "32k"], "seq_len", 32 * 1024),
    (["train", "--seq-len", "2K"], "seq_len", 2048),
    (["train", "--seq-len", "4096"], "seq_len", 4096),
    (["plan", "--seq-len", "1M"], "seq_len", 2**20),
    (["bench", "--seq-lens", "4k,8K,100"], "seq_lens", [4096, 8192, 100]),
    (["bench", "--prompt-lens", "1k"], "prompt_lens", [1024]),
    (["bench", "--max-seq-cap", "64k"], "max_seq_cap", 65536),
    (["generate", "--max-new-tokens", "2k"], "max_new_tokens", 2048),
    (["generate", "--prefill-chunk", "1k"], "prefill_chunk", 1024),
    (["serve", "--max-model-len", "8k"], "max_model_len", 8192),
])
def test_lengths_take_the_k_and_m_suffixes_everywhere(argv, dest, value):
    from torchtsp.cli import build_parser

    assert getattr(build_parser().parse_args(argv), dest) == value


@pytest.mark.parametrize("text", ["32x", "1.5k", "k", ""])
def test_a_length_that_is_not_one_is_a_one_line_error(capsys, text):
    with pytest.raises(SystemExit) as e:
        main(["train", "--seq-len", text])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "such as 4096, 32k or 1M" in err[0], err


def test_plan_takes_the_dtype_names_of_train_and_its_aliases(capsys):
    from torchtsp.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["plan", "--dtype", "float32"]).dtype == parse(["plan", "--dtype", "fp32"]).dtype == "float32"
    assert parse(["plan", "--dtype", "bfloat16"]).dtype == parse(["plan", "--dtype", "bf16"]).dtype == "bfloat16"
    assert parse(["plan"]).dtype == "bfloat16"
    assert flag("plan", "--dtype").choices == flag("train", "--dtype").choices == ["float32", "bfloat16"]
    outputs = {}
    for name in ("fp32", "float32"):
        assert main(["plan", "--preset", "llama3-8b", "--seq-len", "8k", "--dtype", name]) == 0
        outputs[name] = capsys.readouterr().out
    assert outputs["fp32"] == outputs["float32"] and "4 bytes per element" in outputs["fp32"]


def test_convert_says_overwrite_like_train_and_still_reads_force():
    from torchtsp.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["convert", "a", "b", "--overwrite"]).overwrite is True
    assert parse(["convert", "a", "b", "--force"]).overwrite is True
    assert parse(["convert", "a", "b"]).overwrite is False
    help_text = subparser("convert")[1].format_help()
    assert "--overwrite" in help_text and "--force" not in help_text


def test_serve_lists_the_registrys_serving_schemes():
    from torchtsp.schemes import SCHEMES

    choices = flag("serve", "--scheme").choices
    # The schemes with an engine over one shared batch: dp splits rows over replicas, tp_sp has no engine.
    assert choices and set(choices) == set(SCHEMES.servable()) == {"tsp", "tp", "sp"}
    assert "{" + ",".join(choices) + "}" in subparser("serve")[1].format_usage()


def test_every_timeout_default_is_a_named_constant_with_its_reason():
    from torchtsp import timeouts
    from torchtsp.distributed.comm import DEFAULT_TIMEOUT_S
    from torchtsp.generate_job import GenerateJob
    from torchtsp.train.config import TrainConfig

    expected = {"train": timeouts.COLLECTIVE_TIMEOUT_S, "generate": timeouts.COLLECTIVE_TIMEOUT_S,
                "serve": timeouts.SERVE_TIMEOUT_S, "bench": timeouts.BENCH_CELL_TIMEOUT_S}
    for command, default in expected.items():
        action = flag(command, "--timeout-s")
        assert action.default in (None, default), command  # train: None, TrainConfig's default applies
        assert f"(default: {default:g})" in action.help and "means" in action.help, (command, action.help)
    assert TrainConfig().timeout_s == GenerateJob("preset", "tiny", [], 1).timeout_s == DEFAULT_TIMEOUT_S
    assert DEFAULT_TIMEOUT_S == timeouts.COLLECTIVE_TIMEOUT_S


def test_help_says_what_sampling_and_tokenizer_really_are():
    sample = flag("train", "--sample-tokens").help
    assert "greedy" not in sample and "temperature 0.8" in sample and "40" in sample, sample
    checkpoint = flag("generate", "--checkpoint").help
    assert "byte tokenizer" not in checkpoint and "run's own tokenizer" in checkpoint, checkpoint


def test_serve_refuses_a_scheme_outside_its_choices_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--preset", "tiny", "--scheme", "dp"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert "invalid choice: 'dp'" in err[0] and "'tsp', 'tp', 'sp'" in err[0], err


def test_generate_with_a_tokenizer_larger_than_the_model_names_both_sizes(tmp_path, capsys):
    from test_train_tokenizer import bpe_tokenizer

    folder = bpe_tokenizer(tmp_path / "bpe", 300)
    assert main(["generate", "--preset", "tiny", "--tokenizer", str(folder), "--prompt", "the"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has 300 ids but the model's vocabulary (--preset tiny) has 257" in err, err
