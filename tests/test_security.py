"""Issue 30's probes, each reproduced: no code runs from a checkpoint, no path read from a file leaves its folder,
and every bad value of generate, train, plan and bench is one line before any rank starts."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchtsp
from helpers import cli_in_process, is_rank
from torchtsp.cli import main
from torchtsp.distributed.launch import WorkerPool
from torchtsp.errors import RankFailedError
from torchtsp.presets import get_preset
from torchtsp.train import checkpoint

TINY = torchtsp.ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=40, max_seq_len=32)


def cli(*args):
    return cli_in_process(*args)  # every call here is refused before any rank starts


def one_line_error(source) -> str:
    """The single stderr line of a refused command: ``source`` is capsys, a finished subprocess, or the text."""
    err = source if isinstance(source, str) else getattr(source, "stderr", None)
    err = source.readouterr().err if err is None else err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("torchtsp: error: "), err
    return lines[0]


# ---------------------------------------------------------------- 1. no code from a checkpoint


class WritesMarker:
    """Unpickled, it creates ``path``: what a crafted pickle would do with os.system instead."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def crafted_checkpoint(folder: Path, marker: Path) -> Path:
    """A folder holding only a meta.json (no checksums, as an attacker writes it) and a pickled .metadata."""
    folder.mkdir(parents=True)
    meta = {"format": checkpoint.FORMAT, "version": 1, "model": get_preset("tiny").to_dict()}
    (folder / checkpoint.META).write_text(json.dumps(meta))
    (folder / ".metadata").write_bytes(pickle.dumps(WritesMarker(marker)))
    return folder


@pytest.mark.parametrize("command", ["train", "generate", "convert"])
def test_a_crafted_dcp_metadata_runs_no_code(tmp_path, command):
    marker = tmp_path / "marker"
    crafted = crafted_checkpoint(tmp_path / "crafted", marker)
    args = {"train": ["train", "--resume", crafted, "--out", tmp_path / "run", "--nproc", "1", "--steps", "1",
                      "--batch-size", "2", "--seq-len", "32", "--sample-tokens", "0"],
            "generate": ["generate", "--checkpoint", crafted, "--prompt-ids", "1,2", "--max-new-tokens", "1"],
            "convert": ["convert", crafted, tmp_path / "out"]}[command]
    result = cli(*args)
    assert not marker.exists(), "the checkpoint's pickle ran"
    assert result.returncode == 2
    line = one_line_error(result)
    assert "refused" in line and "io.open" in line, line  # the callable the pickle asked for is named


def small_dcp_checkpoint(folder: Path) -> dict:
    """A single-process DCP save of a step counter (stored as bytes) and a tensor; returns a state to load into."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"train/step": 7, "w": torch.arange(4.0)}, checkpoint_id=str(folder))
    return {"train/step": 0, "w": torch.zeros(4)}


def rewrite_metadata(folder: Path, change) -> None:
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own file
    for index, info in list(metadata.storage_data.items()):
        metadata.storage_data[index] = change(index.fqn, info)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def test_a_crafted_bytes_value_runs_no_code(tmp_path):
    """DCP stores non-tensor values (the step counter) as pickled bytes and reads them with an unrestricted
    torch.load: the payload goes in a data file the (innocent-looking) metadata points to."""
    import dataclasses

    folder, marker = tmp_path / "ckpt", tmp_path / "marker"
    state = small_dcp_checkpoint(folder)
    payload = folder / "payload.distcp"
    torch.save(WritesMarker(marker), payload)
    rewrite_metadata(folder, lambda fqn, info: dataclasses.replace(
        info, relative_path=payload.name, offset=0, length=payload.stat().st_size) if fqn == "train/step" else info)
    with pytest.raises(ValueError, match="could not be loaded"):
        checkpoint._load_tensors(folder, state)
    assert not marker.exists()


def test_a_clean_dcp_checkpoint_still_loads(tmp_path):
    state = small_dcp_checkpoint(tmp_path / "ckpt")
    checkpoint._load_tensors(tmp_path / "ckpt", state)
    assert state["train/step"] == 7 and torch.equal(state["w"], torch.arange(4.0))


def test_dcp_data_files_outside_the_checkpoint_are_refused(tmp_path):
    import dataclasses
    import shutil

    folder = tmp_path / "ckpt"
    state = small_dcp_checkpoint(folder)
    (tmp_path / "elsewhere").mkdir()
    for data in folder.glob("*.distcp"):
        shutil.move(data, tmp_path / "elsewhere" / data.name)
    rewrite_metadata(folder, lambda fqn, info: dataclasses.replace(info, relative_path="../elsewhere/"
                                                                   + info.relative_path))
    with pytest.raises(ValueError, match="outside"):
        checkpoint._load_tensors(folder, state)


def test_an_unreadable_metadata_is_one_line_without_dcp_tracebacks(tmp_path):
    folder = crafted_checkpoint(tmp_path / "ckpt", tmp_path / "marker")
    (folder / ".metadata").write_bytes(os.urandom(100))
    result = cli("generate", "--checkpoint", folder, "--prompt-ids", "1,2", "--max-new-tokens", "1")
    assert result.returncode == 2
    assert ".metadata is unreadable" in one_line_error(result)


# ---------------------------------------------------------------- 2. no path read from a file leaves its folder


@pytest.fixture
def hf_pair(tmp_path):
    """``other``: a complete HF checkpoint; ``hf``: a folder with its config and an index to fill in."""
    from torchtsp.hf import save_hf_checkpoint

    torch.manual_seed(0)
    save_hf_checkpoint(tmp_path / "other", torchtsp.Transformer(TINY).state_dict(), TINY)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text((tmp_path / "other" / "config.json").read_text())
    return tmp_path / "hf", tmp_path / "other"


def write_index(folder: Path, shard: str, names) -> None:
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, shard)}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def tensor_names(path: Path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def test_an_index_naming_a_shard_outside_its_folder_is_refused(hf_pair, tmp_path, capsys):
    from torchtsp.hf import load_hf_checkpoint, open_hf_weights

    hf, other = hf_pair
    write_index(hf, "../other/model.safetensors", tensor_names(other / "model.safetensors"))
    for read in (open_hf_weights, load_hf_checkpoint):
        with pytest.raises(ValueError, match="outside"):
            read(hf)
    assert main(["convert", str(hf), str(tmp_path / "out")]) == 2
    assert "../other/model.safetensors" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_a_shard_symlinked_outside_its_folder_is_refused(hf_pair):
    from torchtsp.hf import load_hf_checkpoint, open_hf_weights

    hf, other = hf_pair
    (hf / "model-00001-of-00001.safetensors").symlink_to(other / "model.safetensors")
    write_index(hf, "model-00001-of-00001.safetensors", tensor_names(other / "model.safetensors"))
    for read in (open_hf_weights, load_hf_checkpoint):
        with pytest.raises(ValueError, match="outside"):
            read(hf)


def test_a_hub_cache_snapshot_links_into_its_blobs_and_loads(hf_pair, tmp_path):
    """The Hugging Face hub cache keeps every file in ``blobs/`` and links ``snapshots/<rev>/`` names to them."""
    from torchtsp.hf import load_hf_checkpoint

    _, other = hf_pair
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name, blob in (("config.json", "c0"), ("model-00001-of-00001.safetensors", "w0")):
        source = other / ("config.json" if name == "config.json" else "model.safetensors")
        (repo / "blobs" / blob).write_bytes(source.read_bytes())
        (snapshot / name).symlink_to(Path("../..") / "blobs" / blob)
    write_index(snapshot, "model-00001-of-00001.safetensors", tensor_names(other / "model.safetensors"))
    cfg, sd = load_hf_checkpoint(snapshot)
    assert (cfg.dim, cfg.n_layers, cfg.vocab_size) == (TINY.dim, TINY.n_layers, TINY.vocab_size)
    assert len(sd) == len(torchtsp.Transformer(TINY).state_dict())


def write_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer.json written with the tokenizers library, and its config naming the EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(TINY.vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w39"}))
    return folder


@pytest.mark.parametrize("name", ["special_tokens_map.json", "tokenizer_config.json", "tokenizer.json"])
def test_a_tokenizer_file_linked_outside_is_neither_exported_nor_read(hf_pair, tmp_path, capsys, name):
    from torchtsp.data.tokenizers import HFTokenizer, copy_tokenizer_files

    _, model = hf_pair
    secret = tmp_path / "secret.json"
    secret.write_text('{"api_key": "s3cr3t"}')
    write_tokenizer(model)
    if name == "tokenizer.json":  # a real tokenizer elsewhere: reading it would still leave the folder
        secret = write_tokenizer(tmp_path / "elsewhere") / name
    (model / name).unlink(missing_ok=True)
    (model / name).symlink_to(secret)
    assert main(["convert", str(model), str(tmp_path / "out")]) == 2
    line = one_line_error(capsys)
    assert f"{name} is a link to {secret}, outside" in line and "in place of the link" in line
    assert not (tmp_path / "out").exists()  # refused before any file was written
    with pytest.raises(ValueError, match="outside"):
        copy_tokenizer_files(model, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    with pytest.raises(ValueError, match="outside"):  # refused when named, before a run would copy it
        HFTokenizer(model)


def test_a_run_whose_tokenizer_leads_outside_is_refused(tmp_path):
    from torchtsp.data.tokenizers import HFTokenizer, run_tokenizer_folder

    elsewhere = write_tokenizer(tmp_path / "elsewhere")
    run = tmp_path / "run"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "tokenizer").symlink_to(elsewhere, target_is_directory=True)
    for path in (run, run / "checkpoints" / "step_1"):
        with pytest.raises(ValueError, match=r"tokenizer.json leads to .*, outside the run"):
            run_tokenizer_folder(path)
    (run / "tokenizer").unlink()
    write_tokenizer(run / "tokenizer")
    assert HFTokenizer(run_tokenizer_folder(run)).eos_id == 39


def test_a_hub_snapshot_tokenizer_is_read_and_exported_as_plain_files(tmp_path):
    """The hub cache's own links (snapshots/<rev>/x -> ../../blobs/<hash>) stay allowed; the copies are files,
    and a link already at the destination is replaced, never written through."""
    from torchtsp.data.tokenizers import HFTokenizer, copy_tokenizer_files

    source = write_tokenizer(tmp_path / "source")
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (repo / "blobs" / name).write_bytes((source / name).read_bytes())
        (snapshot / name).symlink_to(Path("../..") / "blobs" / name)
    assert HFTokenizer(snapshot).eos_id == 39
    victim = tmp_path / "victim"
    victim.write_text("not to be overwritten")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tokenizer.json").symlink_to(victim)  # a copy must replace a link, not write through it
    assert copy_tokenizer_files(snapshot, tmp_path / "out") == ["tokenizer.json", "tokenizer_config.json"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        copy = tmp_path / "out" / name
        assert not copy.is_symlink() and copy.read_bytes() == (source / name).read_bytes()
    assert victim.read_text() == "not to be overwritten"


def test_manifest_files_outside_the_checkpoint_are_not_hashed(tmp_path):
    folder = tmp_path / "run" / "checkpoints" / "step_000001"
    folder.mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.write_text("not a checkpoint file")
    meta = {"format": checkpoint.FORMAT, "files": {"../../../secret": checkpoint.sha256(secret)}}
    with pytest.raises(ValueError, match="outside"):
        checkpoint.verify(folder, meta)


@pytest.mark.parametrize("pointer", ["/etc", "../../elsewhere", "step_1/../../elsewhere", "link"])
def test_latest_naming_a_folder_elsewhere_is_refused(tmp_path, pointer):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / checkpoint.META).write_text("{}")
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    (root / "link").symlink_to(elsewhere)
    (root / checkpoint.LATEST).write_text(pointer)
    with pytest.raises(ValueError, match="latest"):
        checkpoint.resolve(tmp_path / "run")


def test_a_crafted_latest_cannot_make_a_save_remove_a_folder_elsewhere(tmp_path):
    """``latest`` = ``../../../A/x.tmp`` once made the first save of a resumed run (``recover``, then ``publish``)
    replace ``runs/A/x``, outside the run folder, with ``A/x.tmp``."""
    run = tmp_path / "runs" / "r1"
    root = run / "checkpoints"
    root.mkdir(parents=True)
    victim = tmp_path / "runs" / "A" / "x"
    victim.mkdir(parents=True)
    (victim / "precious").write_text("keep me")
    staged = tmp_path / "A" / "x.tmp"
    staged.mkdir(parents=True)
    (staged / checkpoint.META).write_text("{}")
    (root / checkpoint.LATEST).write_text("../../../A/x.tmp")
    with pytest.raises(ValueError, match="latest"):
        checkpoint.recover(root)
    assert (victim / "precious").read_text() == "keep me"


# ---------------------------------------------------------------- 3, 5, 6. generate refuses bad values


@pytest.mark.parametrize("flags,match", [
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--temperature", "inf"], "temperature must be a finite number"),
    (["--temperature", "1", "--top-p", "nan"], "top_p must"),
    (["--timeout-s", "-1"], "--timeout-s must be a finite number > 0"),
    (["--timeout-s", "nan"], "--timeout-s must be a finite number > 0"),
    (["--nproc", "0"], "--nproc must be >= 1, got 0"),
    (["--stop-token-ids", "99999,-5"], "--stop-token-ids: token id 99999 is outside the vocabulary [0, 257)"),
    (["--stop-token-ids", "-5"], "token id -5 is outside the vocabulary"),
])
def test_generate_refuses_bad_values_before_any_rank_starts(monkeypatch, capsys, flags, match):
    import torchtsp.generate_job as command

    monkeypatch.setattr(command, "run_generate", lambda job: pytest.fail(f"generate ran with {flags}"))
    assert main(["generate", "--prompt-ids", "1,2", "--max-new-tokens", "1", *flags]) == 2
    assert match in one_line_error(capsys)


class OneRank:
    """The vocabulary axis of a rank that holds every column."""

    def all_gather(self, t, label=None):
        return t.unsqueeze(0)


@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, None), (1.0, 3)])
def test_sampling_never_returns_an_id_outside_the_vocabulary(temperature, top_k):
    """A slice padded past the vocabulary (V = 5 in 8 columns) whose padding columns hold NaN, as
    -inf / inf gives: the chosen ids stay in [0, V), whatever the scores."""
    from torchtsp.infer.sampling import TokenSelector

    V = 5
    select = TokenSelector(OneRank(), V, 0, 4, slice(0, 4), temperature, top_k, None, seed=0, device="cpu")
    logits = torch.full((4, 8), float("nan"))
    logits[:, :V] = torch.tensor([0.0, 1.0, float("nan"), -1.0, 2.0])
    logits[3, :V] = float("-inf")  # nothing finite at all
    ids = select(logits)
    assert ((ids >= 0) & (ids < V)).all(), ids
    if temperature == 0:
        assert ids[:3].tolist() == [4, 4, 4]  # the NaN entry never wins either


@pytest.mark.parametrize("temperature,top_k,top_p,match", [
    (float("nan"), None, None, "temperature"), (float("inf"), None, None, "temperature"),
    (1.0, None, float("nan"), "top_p"), (1.0, 2.5, None, "top_k"),
])
def test_the_generate_api_refuses_non_finite_sampling_values(temperature, top_k, top_p, match):
    from torchtsp.infer import generate

    model = torchtsp.Transformer(TINY)
    with pytest.raises(ValueError, match=match):
        generate(model, [[1, 2]], 2, temperature=temperature, top_k=top_k, top_p=top_p)


# ---------------------------------------------------------------- 7, 10. train settings


@pytest.mark.parametrize("toml,names", [
    ("seq_len = 'abc'\n[train]\nsteps = 2\n", ["seq_len"]),
    ("[train]\nsteps = 2\n[model]\ndim = 64\n", ["model"]),
    ("[model]\ndim = 64\n", ["unknown table(s) model"]),
])
def test_toml_keys_and_tables_that_would_be_ignored_are_errors(tmp_path, capsys, toml, names):
    path = tmp_path / "run.toml"
    path.write_text(toml)
    assert main(["train", "--config", str(path)]) == 2
    line = one_line_error(capsys)
    assert all(name in line for name in names), line


@pytest.mark.parametrize("out", ["afile", "afile/run"])
def test_out_naming_a_file_is_one_line(tmp_path, capsys, monkeypatch, out):
    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("")
    assert main(["train", "--out", out, "--nproc", "1", "--steps", "1"]) == 2
    line = one_line_error(capsys)
    assert "afile" in line and "is a file" in line and "Errno" not in line, line


# ---------------------------------------------------------------- 8, 9, 11. dead, stopped and killed ranks


def die_on_rank(dead):
    from torchtsp.distributed.comm import AxisComm

    world = AxisComm.world(60)
    world.all_reduce(torch.ones(1))
    if world.rank == dead:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    world.all_reduce(torch.ones(1))


def test_a_killed_rank_is_not_reported_as_out_of_memory(pools, monkeypatch, capsys):
    import torchtsp.train.trainer as trainer

    with pytest.raises(RankFailedError) as info:
        pools(2).run(die_on_rank, 1)

    def killed(cfg, *args):  # run_training(cfg, data_checked)
        raise info.value

    monkeypatch.setattr(trainer, "run_training", killed)
    assert main(["train", "--nproc", "1", "--tsp", "1"]) == 2
    line = one_line_error(capsys)
    assert "rank 1 died (killed by SIGKILL" in line and "out of memory:" not in line and "--batch-size" not in line


def test_an_out_of_memory_error_on_a_rank_is_still_reported_as_such(monkeypatch, capsys):
    import torchtsp.train.trainer as trainer

    def oom(cfg, *args):  # run_training(cfg, data_checked)
        raise RankFailedError("rank 1 raised:", 1, "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory.")

    monkeypatch.setattr(trainer, "run_training", oom)
    assert main(["train", "--nproc", "1", "--tsp", "1"]) == 2
    assert "lower --batch-size" in one_line_error(capsys)


def stop_on_rank(stopped):
    from torchtsp.distributed.comm import AxisComm

    world = AxisComm.world(3)
    world.all_reduce(torch.ones(1))
    if world.rank == stopped:
        os.kill(os.getpid(), signal.SIGSTOP)
    world.all_reduce(torch.ones(1))


@pytest.mark.multirank  # launches processes of its own
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states through /proc")
def test_a_stopped_rank_is_named_not_the_rank_that_timed_out_waiting(tmp_path):
    with WorkerPool(2, timeout_s=3) as pool, pytest.raises(RankFailedError) as info:
        pool.run(stop_on_rank, 1, timeout_s=120)  # the collective timeout (3 s) ends it, as in `train`
    assert info.value.rank == 1, info.value.summary
    assert "rank 1 did not answer" in info.value.summary and "stopped" in info.value.summary


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.mark.multirank  # launches processes of its own
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks through /proc")
def test_a_rank_killed_under_the_launcher_leaves_one_line(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "torchtsp", "train", "--nproc", "2", "--steps", "2000",
                             "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "0", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    rank = next(pid for child in children(proc.pid) for pid in children(child) if is_rank(pid))
    os.kill(rank, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    # The progress bar ends without a newline: the error may follow it on the same line.
    error = err.partition("torchtsp: error: ")[2]
    assert proc.returncode == 2 and err.count("torchtsp: error: ") == 1, err[-2000:]
    assert error.strip().count("\n") == 0 and "died (killed by SIGKILL" in error, err[-2000:]
    assert "leaked semaphore" not in err and "Traceback" not in err


# ---------------------------------------------------------------- 12, 13, 14. plan and bench


@pytest.mark.parametrize("gpus", ["1000000000", "1048576", "720720"])
def test_plan_answers_or_refuses_quickly_for_any_gpu_count(capsys, gpus):
    start = time.perf_counter()
    code = main(["plan", "--gpus", gpus, "--batch-size", gpus, "--json"])
    elapsed = time.perf_counter() - start
    assert code == (2 if gpus == "1000000000" else 0)
    # Well under a second on an idle core (0.05-0.2 s); the bound leaves room for a loaded 2-core test machine.
    assert elapsed < 3.0, elapsed
    captured = capsys.readouterr()
    if code:
        assert "--gpus must be at most" in one_line_error(captured.err)


@pytest.mark.parametrize("flags", [["--pp", "2", "--gpu-mem", "0"], ["--pp", "2", "--gpu-mem", "nan", "--json"],
                                   ["--pp", "2", "--gpu-mem", "inf"], ["--pp", "2", "--inter-node-gbps", "inf"]])
def test_pipeline_plan_validates_like_plan(capsys, flags):
    assert main(["plan", *flags]) == 2
    assert "must be positive" in one_line_error(capsys)


def test_plan_json_is_strict(capsys):
    for argv in (["plan", "--pp", "2", "--batch-size", "4", "--json"],
                 ["plan", "--json", "--preset", "tiny", "--gpus", "4"]):
        assert main(argv) == 0
        text = capsys.readouterr().out
        json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


@pytest.mark.parametrize("value", ["0", "nan", "-1", "inf"])
def test_bench_timeout_is_checked_before_any_rank_starts(monkeypatch, capsys, value):
    import torchtsp.bench.run as run

    monkeypatch.setattr(run, "WorkerPool", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(SystemExit) as info:
        main(["bench", "--timeout-s", value])
    assert info.value.code == 2
    assert "--timeout-s: expected a positive number" in capsys.readouterr().err


@pytest.mark.parametrize("flags,match", [
    (["--pp", "2", "--microbatches", "0"], "--microbatches must be at least 1, got 0"),
    (["--pp", "2", "--microbatches", "-3"], "--microbatches must be at least 1, got -3"),
    (["--microbatches", "2"], "--microbatches applies to pipeline stages"),
    (["--pp", "0"], "--pp must be at least 2, got 0"),
    (["--seed", "-1"], "--seed must be at least 0, got -1"),
    (["--dim", "0"], "--dim must be at least 1, got 0"),
    (["--n-layers", "-2"], "--n-layers must be at least 1, got -2"),
    (["--nproc", "0"], "--nproc must be at least 1, got 0"),
    (["--out", ""], "--out is an empty path"),
])
def test_bench_integer_flags_are_never_replaced_by_their_default(monkeypatch, capsys, flags, match):
    """``--microbatches 0`` used to run with the default (``0 or pp``) where train and plan refuse it."""
    import torchtsp.bench.run as run

    monkeypatch.setattr(run, "WorkerPool", lambda *a, **k: pytest.fail("ranks started"))
    assert main(["bench", "--nproc", "4", *flags]) == 2
    assert match in one_line_error(capsys)
