"""Issue 13's probes, each reproduced: orphaned ranks, poisoned checkpoints, shared run folders, bad values."""

import fcntl
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import torchtsp
from helpers import is_rank
from torchtsp.cli import main
from torchtsp.errors import RankFailedError
from torchtsp.train import checkpoint
from torchtsp.train.config import TrainConfig, build_config
from torchtsp.train.trainer import Trainer, run_training

SMALL = {"preset": "tiny", "batch_size": 4, "seq_len": 32, "steps": 4, "sample_tokens": 0, "tsp": 2}


def run(pools, out, world=2, **settings):
    return pools(world).run(run_training, TrainConfig(**{**SMALL, "out": str(out), **settings}))[0]


def strict_json(line):
    """json.loads that refuses bare NaN/Infinity, as every other JSON reader does."""
    return json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in {line}"))


def metrics(out):
    return [strict_json(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- the launcher owns its ranks


def launcher(out, *extra, steps=500, nproc=2, cmd=None):
    cmd = cmd or [sys.executable, "-m", "torchtsp", "train", "--nproc", str(nproc)]
    args = [*cmd, "--batch-size", "4", "--seq-len", "32", "--steps", str(steps), "--sample-tokens", "0",
            "--out", str(out), *map(str, extra)]
    # A session of its own: the launcher leads a process group that holds every rank it starts.
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def group_members(pgid):
    """Live processes of process group ``pgid``, read from /proc (zombies waiting to be reaped do not count)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(stat.parent.name))
    return found


def ranks_in(pgid):
    return [pid for pid in group_members(pgid) if is_rank(pid)]


def wait_until_gone(pgid, limit=10.0):
    deadline = time.monotonic() + limit
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def wait_for_step(out, step, proc, limit=180):
    deadline = time.monotonic() + limit
    path = Path(out) / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= step:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise TimeoutError(f"no step {step} in {out}")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_stops_every_rank_with_a_checkpoint(tmp_path, sig):
    proc = launcher(tmp_path)
    wait_for_step(tmp_path, 2, proc)
    assert len(group_members(proc.pid)) >= 3  # the launcher and its two ranks
    os.kill(proc.pid, sig)  # the launcher alone, as `kill` does: it must pass the stop on
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and "died" not in err
    last = max(r["step"] for r in metrics(tmp_path))
    assert (tmp_path / "checkpoints" / "latest").read_text() == f"step_{last:06d}"
    assert wait_until_gone(proc.pid) == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc")
def test_ranks_of_a_killed_launcher_exit_within_seconds(tmp_path):
    proc = launcher(tmp_path)
    wait_for_step(tmp_path, 1, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert wait_until_gone(proc.pid, limit=5.0) == []


def parent_of(pid):
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc")
def test_a_killed_fork_server_is_named_by_its_ranks_and_the_launcher(tmp_path):
    """The ranks' parent is the fork server, not the launcher: killing it ends the run within seconds, and every
    message says that the server died (its pid), not the launcher, which lives, nor a rank's placeholder code."""
    proc = launcher(tmp_path)
    wait_for_step(tmp_path, 1, proc)
    server = parent_of(ranks_in(proc.pid)[0])
    assert server != proc.pid
    os.kill(server, signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode not in (0, None), err
    assert f"the fork server it was forked from (pid {server}) has gone, its launcher (pid {proc.pid}) lives" in err
    # The launcher's one-line error (a rank's message may come after it: they exit as the launcher reports).
    assert (f"torchtsp: error: run_training on 2 ranks: the fork server the ranks were forked from (pid {server}) "
            f"died") in err, err
    assert f"launcher (pid {proc.pid}) has gone" not in err and "code 255" not in err and "Traceback" not in err
    assert wait_until_gone(proc.pid, limit=5.0) == []


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_nothing_is_left_behind_under_timeout(tmp_path):
    # `timeout` signals the launcher and its whole process group; ranks stop at a step boundary and save. Its timer
    # is SIGALRM (coreutils): sent once training has begun, it expires then instead of after a fixed wait.
    proc = launcher(tmp_path, cmd=["timeout", "300", sys.executable, "-m", "torchtsp", "train", "--nproc", "2"])
    wait_for_step(tmp_path, 1, proc)
    os.kill(proc.pid, signal.SIGALRM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 124, err
    assert "Traceback" not in err and "died" not in err
    assert wait_until_gone(proc.pid) == []
    last = max(r["step"] for r in metrics(tmp_path))
    assert (tmp_path / "checkpoints" / "latest").read_text() == f"step_{last:06d}", err


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc")
def test_ctrl_c_during_start_up_is_an_interruption_not_a_dead_rank(tmp_path):
    proc = launcher(tmp_path)
    while len(ranks_in(proc.pid)) < 2:  # the ranks exist, and are still importing torch
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to the foreground process group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "died" not in err and "Traceback" not in err
    assert wait_until_gone(proc.pid) == []


def test_a_signal_while_ranks_start_reaches_the_launchers_handler():
    # The ranks are started with the stop signals blocked (they inherit it): one that arrives meanwhile must wait
    # for the launcher's handler, not vanish as an ignored signal would (the race the Ctrl-C test above hit).
    from torchtsp.rank_server import stop_signals_held

    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        with stop_signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # another thread of this process may take it at once; the handler runs in this one
        for _ in range(100):  # the handler runs at the next bytecode boundary
            if received:
                break
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [signal.SIGTERM]


def stop_signal_state():
    status = Path("/proc/self/status").read_text()
    mask = lambda field: int(status.split(f"{field}:")[1].split()[0], 16)  # noqa: E731
    return {int(sig): (bool(mask("SigBlk") >> (sig - 1) & 1), signal.getsignal(sig) == signal.SIG_IGN)
            for sig in (signal.SIGINT, signal.SIGTERM)}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the signal mask from /proc")
def test_ranks_run_with_the_stop_signals_ignored_not_blocked(pools):
    # Until a trainer installs its handler a rank ignores them (the launcher sends again until the ranks stop);
    # a rank that kept them blocked would never see the trainer's handler run.
    for state in pools(2).run(stop_signal_state):
        assert state == {int(signal.SIGINT): (False, True), int(signal.SIGTERM): (False, True)}, state


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_torchrun_leaves_no_rank_behind(tmp_path, sig):
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = launcher(tmp_path, cmd=[str(torchrun), "--nproc-per-node", "2", "-m", "torchtsp", "train"])
    wait_for_step(tmp_path, 1, proc)
    os.kill(proc.pid, sig)  # SIGTERM: torchrun passes it to the ranks; SIGKILL: the ranks must notice alone
    proc.communicate(timeout=120)
    assert wait_until_gone(proc.pid, limit=5.0) == []
    if sig == signal.SIGTERM:  # the ranks finished their step and saved it
        last = max(r["step"] for r in metrics(tmp_path))
        assert (tmp_path / "checkpoints" / "latest").read_text() == f"step_{last:06d}"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc")
def test_a_second_signal_aborts_at_once(tmp_path):
    proc = launcher(tmp_path)
    while len(ranks := ranks_in(proc.pid)) < 2:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    # Frozen ranks cannot reach a step boundary however long the test waits, so only the abort can end the run
    # (without the freeze, a fast machine finishes the step and saves before the second signal).
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(1.1)  # a second, separate request (a repeat within a second counts as the same one)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "aborted; the ranks were stopped without saving" in err, err
    assert wait_until_gone(proc.pid, limit=5.0) == []
    assert not (tmp_path / "checkpoints").exists()


def die_on_rank(dead):
    from torchtsp.distributed.comm import AxisComm

    world = AxisComm.world(60)
    world.all_reduce(torch.ones(1))
    if world.rank == dead:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # the dead rank's sockets are closed: survivors see 'connection reset', or similar
    world.all_reduce(torch.ones(1))


def test_a_dead_rank_is_named_not_a_survivor(pools):
    with pytest.raises(RankFailedError) as info:
        pools(2).run(die_on_rank, 1)
    assert info.value.rank == 1 and "rank 1 died (killed by SIGKILL" in info.value.summary, info.value.summary


def test_cuda_host_takes_one_gpu_per_rank_or_says_why_not(monkeypatch, capsys):
    from torchtsp.distributed.launch import WorkerPool, rank_backend

    assert rank_backend(2, "cpu") == ("gloo", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_backend(2, None) == ("gloo", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rank_backend(2, None) == ("nccl", "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="2 local ranks need 2 GPUs .* this host has 1; use --nproc 1"):
        WorkerPool(2, device_type=None)
    assert main(["train", "--nproc", "2", "--tsp", "2", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "need 2 GPUs" in err[0], err


# ---------------------------------------------------------------- nothing non-finite is published


def test_divergence_stops_the_run_and_publishes_nothing(tmp_path):
    proc = launcher(tmp_path, "--lr", "1e6", "--checkpoint-every", "1", steps=8)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 2, err
    lines = [line for line in err.splitlines() if line.startswith("torchtsp: error:")]
    assert len(lines) == 1 and "non-finite loss" in lines[0] and "--skip-nonfinite" in lines[0], err
    records = metrics(tmp_path)  # strict JSON: no bare NaN
    bad = records[-1]
    assert bad["skipped"] == "non-finite" and (bad["loss"] is None or bad["grad_norm"] is None)
    assert f"step {bad['step']}:" in lines[0]
    for folder in (tmp_path / "checkpoints").glob("step_*"):
        _, weights = checkpoint.load_full_state_dict(folder)
        assert all(torch.isfinite(w).all() for w in weights.values()), folder
    assert (tmp_path / "checkpoints" / "latest").read_text() < f"step_{bad['step']:06d}"


def train_with_a_poisoned_step(cfg, poisoned):
    """A trainer whose loss is NaN at step ``poisoned`` (0-based) only: a transient fault."""
    trainer = Trainer(cfg)
    loss, step_fn, current = trainer.model.loss, trainer.train_step, {}
    trainer.model.loss = lambda t, y, *ids: loss(t, y, *ids) * (float("nan") if current["step"] == poisoned else 1.0)

    def train_step(step):
        current["step"] = step
        return step_fn(step)

    trainer.train_step = train_step
    return trainer.run()


def test_a_non_finite_step_is_skipped_within_the_budget(pools, tmp_path):
    cfg = TrainConfig(**{**SMALL, "out": str(tmp_path / "skip"), "skip_nonfinite": 1})
    summary = pools(2).run(train_with_a_poisoned_step, cfg, 1)[0]
    clean = run(pools, tmp_path / "clean")
    assert summary["status"] == "done" and math.isnan(summary["losses"][1])
    assert summary["losses"][0] == clean["losses"][0]
    # Step 2 was not applied: step 3 starts from the weights after step 1, so it differs from the clean run.
    assert summary["losses"][2] != clean["losses"][2] and math.isfinite(summary["losses"][3])
    records = metrics(tmp_path / "skip")
    assert records[1]["skipped"] == "non-finite" and records[1]["loss"] is None
    _, weights = checkpoint.load_full_state_dict(tmp_path / "skip")
    assert all(torch.isfinite(w).all() for w in weights.values())

    cfg = TrainConfig(**{**SMALL, "out": str(tmp_path / "no_budget")})
    with pytest.raises(RankFailedError, match="step 2: non-finite loss"):
        pools(2).run(train_with_a_poisoned_step, cfg, 1)
    assert not (tmp_path / "no_budget" / "checkpoints").exists()


# ---------------------------------------------------------------- checksums


def test_a_corrupt_shard_is_an_error_naming_the_file(pools, tmp_path):
    run(pools, tmp_path / "run", steps=2)
    ckpt = checkpoint.resolve(tmp_path / "run")
    shard = sorted(ckpt.glob("*.distcp"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = os.urandom(64)  # same size: only a checksum can tell
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"is damaged: {shard.name} does not match the checksum"):
        checkpoint.load_full_state_dict(ckpt)
    with pytest.raises(RankFailedError, match=f"{shard.name} does not match the checksum"):
        run(pools, tmp_path / "run", steps=4, resume=str(tmp_path / "run"))
    shard.unlink()
    with pytest.raises(ValueError, match=f"{shard.name} is missing"):
        checkpoint.load_full_state_dict(ckpt)


# ---------------------------------------------------------------- run folders


def test_run_folders_are_owned(pools, tmp_path):
    out = tmp_path / "run"
    first = run(pools, out, steps=2)
    # A fresh run into a folder that holds a run is refused ...
    with pytest.raises(RankFailedError, match="already holds a run .* --resume .* --overwrite"):
        run(pools, out, steps=2)
    # ... unless told to replace it.
    again = run(pools, out, steps=2, overwrite=True, seed=1)
    assert again["losses"] != first["losses"] and [r["step"] for r in metrics(out)] == [1, 2]

    # A second concurrent run on one folder is refused while the first holds its lock.
    with open(out / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RankFailedError, match="is in use by another run"):
            run(pools, out, steps=4, resume=str(out))

    # --resume X writes to X unless --out says otherwise.
    cfg = TrainConfig(**{**SMALL, "steps": 4, "resume": str(out / "checkpoints" / "step_000002")})
    assert Path(cfg.out) == out
    pools(2).run(run_training, cfg)
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]
    assert TrainConfig(resume=str(out), out=str(tmp_path / "elsewhere")).out == str(tmp_path / "elsewhere")


def test_keep_last_and_peak_memory_every_n_steps(pools, tmp_path):
    run(pools, tmp_path, steps=6, checkpoint_every=1, keep_last=2, mem_every=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000005", "step_000006"]
    measured = [r["step"] for r in metrics(tmp_path) if "peak_mem_bytes" in r]
    assert measured == [1, 2, 4, 6]  # the first step, then every second one


def fake_checkpoint(folder: Path, content: bytes):
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(content)
    (folder / ".metadata").write_bytes(b"meta" + content)
    files = {p.name: checkpoint.sha256(p) for p in folder.iterdir()}
    (folder / checkpoint.META).write_text(json.dumps({"format": checkpoint.FORMAT, "files": files}))


class Crash(Exception):
    pass


def crashing(count, real, partial=None):
    """``real`` that raises Crash on the ``count["crash_at"]``-th call of any wrapped operation (after doing
    ``partial`` of its work, to cut a rmtree half-way)."""
    def op(*args, **kwargs):
        count["n"] += 1
        if count["n"] == count["crash_at"]:
            if partial:
                partial(*args)
            raise Crash
        return real(*args, **kwargs)
    return op


def half_rmtree(path, *args, **kwargs):
    files = sorted(p for p in Path(path).rglob("*") if p.is_file())
    for f in files[: len(files) // 2 + 1]:
        f.unlink()


def test_re_saving_a_step_is_crash_safe_at_every_point(tmp_path, monkeypatch):
    """Fault injection: the publish of a step saved again is cut at each file-system operation in turn
    (a rmtree is cut half-way); ``latest`` must always name a complete, checksum-valid checkpoint."""
    points = 0
    while True:
        root = tmp_path / f"case{points}" / "checkpoints"
        fake_checkpoint(root / "step_000002", b"old" * 100)
        checkpoint.point_latest(root, "step_000002")
        fake_checkpoint(root / ".step_000002.tmp", b"new" * 100)
        count = {"n": 0, "crash_at": points + 1}
        cut = functools.partial(crashing, count)

        with monkeypatch.context() as m:
            m.setattr(checkpoint.os, "replace", cut(os.replace))
            m.setattr(checkpoint.os, "link", cut(os.link))
            m.setattr(checkpoint.shutil, "rmtree", cut(shutil.rmtree, half_rmtree))
            m.setattr(checkpoint, "write_file", cut(checkpoint.write_file))
            try:
                checkpoint.publish(root, "step_000002")
                finished = True
            except Crash:
                finished = False
        named = checkpoint.resolve(root.parent)
        meta = checkpoint.read_meta(named)
        checkpoint.verify(named, meta)  # complete: every file present and intact
        assert (named / "__0_0.distcp").read_bytes() in (b"old" * 100, b"new" * 100)
        checkpoint.recover(root)  # what the next save does first
        assert (root / "latest").read_text() == "step_000002"
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002"]
        checkpoint.verify(root / "step_000002", checkpoint.read_meta(root / "step_000002"))
        if finished:
            assert (root / "step_000002" / "__0_0.distcp").read_bytes() == b"new" * 100
            break
        points += 1
    assert points >= 6, points  # every step of the publish was cut once


# ---------------------------------------------------------------- resume needs only the checkpoint


def test_resume_survives_damaged_or_missing_metrics(pools, tmp_path):
    out = tmp_path / "run"
    run(pools, out, steps=4, checkpoint_every=2)
    full = {r["step"]: r["loss"] for r in metrics(out)}
    path = out / "metrics.jsonl"
    text = path.read_text()
    path.write_text(text[: len(text) - 40])  # the last line cut mid-write
    summary = run(pools, out, steps=4, resume=str(out / "checkpoints" / "step_000002"))
    assert summary["status"] == "done"
    assert {r["step"]: r["loss"] for r in metrics(out)} == full  # bit-identical replay of steps 3 and 4
    path.unlink()
    run(pools, out, steps=4, resume=str(out / "checkpoints" / "step_000002"))
    assert [r["step"] for r in metrics(out)] == [3, 4]


# ---------------------------------------------------------------- every bad value is one line


@pytest.mark.parametrize("toml,match", [
    ('steps = "three"', "steps (--steps) must be an integer, got 'three'"),
    ("seq_len = 64.0", "seq_len (--seq-len) must be an integer, got 64.0"),
    ('recompute = "false"', "recompute must be one of none, full, selective"),
    ('nproc = "2"', "nproc (--nproc) must be an integer, got '2'"),
    ('scheme = "bogus"', "scheme (--scheme) must be one of tsp"),
    ("lr = nan", "lr (--lr) must be a finite number"),
    ("warmup-steps = -5", "warmup_steps (--warmup-steps) must be >= 0"),
    ("timeout_s = 0", "timeout_s (--timeout-s) must be > 0"),
])
def test_toml_values_are_type_and_domain_checked(tmp_path, capsys, toml, match):
    path = tmp_path / "run.toml"
    path.write_text(f"[train]\n{toml}\n")
    with pytest.raises(ValueError) as info:
        build_config(str(path))
    assert match in str(info.value)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err


@pytest.mark.parametrize("argv,match", [
    (["train", "--nproc", "0"], "nproc (--nproc) must be >= 1, got 0"),
    (["train", "--warmup-steps", "-5"], "warmup_steps (--warmup-steps) must be >= 0"),
    (["train", "--timeout-s", "0"], "timeout_s (--timeout-s) must be > 0"),
    (["train", "--lr", "nan"], "lr (--lr) must be a finite number"),
    (["train", "--keep-last", "0"], "keep_last (--keep-last) must be >= 1"),
    (["train", "--steps", "three"], "argument --steps: invalid int value: 'three'"),
    (["plan", "--gpu-mem", "nan"], "--gpu-mem must be positive"),
])
def test_flags_outside_their_domain_are_one_line_errors(capsys, argv, match):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own type errors
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and match in err[0], err


def test_out_of_memory_is_one_line(monkeypatch, capsys):
    import torchtsp.train.trainer as trainer

    def oom(cfg, *args):  # run_training(cfg, data_checked)
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(trainer, "run_training", oom)
    assert main(["train", "--nproc", "1", "--tsp", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("torchtsp: error: out of memory") and "--batch-size" in err[0], err


# ---------------------------------------------------------------- disk full


@pytest.fixture
def tiny_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("needs to mount a small tmpfs (root)")
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_is_named(pools, tiny_disk):
    with pytest.raises(RankFailedError) as info:
        run(pools, tiny_disk / "run", steps=2)
    assert f"no space left on {tiny_disk / 'run'}" in info.value.summary, info.value.summary
    assert not (tiny_disk / "run" / "checkpoints" / "latest").exists()


# ---------------------------------------------------------------- labels, exports


def bad_labels_on_rank():
    cfg = torchtsp.ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64, vocab_size=101)
    degrees = {"tsp": {"tsp": 2}, "dp": {"dp": 2}, "tp": {"tp": 2}, "sp": {"sp": 2}, "tp_sp": {"tp": 2},
               "torch_tp": {"tp": 2}}
    tokens = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(0))
    errors = {}
    for scheme, mesh_degrees in degrees.items():
        mesh = torchtsp.init_mesh(**mesh_degrees)
        torch.manual_seed(0)
        model = torchtsp.parallelize(torchtsp.Transformer(cfg), mesh, scheme)
        for bad in (101, 127, -101):  # 101..127 are the padding rows of a vocabulary split in two
            labels = tokens.clone()
            labels[1, 3] = bad
            try:
                errors[scheme, bad] = f"no error, loss {model.loss(tokens, labels).item()}"
            except ValueError as e:
                errors[scheme, bad] = str(e)
        labels = tokens.clone()
        labels[0, :2] = -100
        assert math.isfinite(model.loss(tokens, labels).item())  # the ignore index stays valid
    return errors


def test_labels_outside_the_vocabulary_are_refused_by_every_scheme(pools):
    errors = pools(2).run(bad_labels_on_rank)[0]
    assert {scheme for scheme, _ in errors} == set(torchtsp.schemes.SCHEMES)
    for (scheme, bad), message in errors.items():
        assert message.startswith("labels must lie in [0, 101)") and str(bad) in message, (scheme, message)


def test_exported_files_have_ordinary_permissions(tmp_path):
    from torchtsp.hf import save_hf_checkpoint

    cfg = torchtsp.ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64, vocab_size=50)
    old = os.umask(0o022)
    try:
        save_hf_checkpoint(tmp_path, torchtsp.Transformer(cfg).state_dict(), cfg)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"model.safetensors": 0o644, "config.json": 0o644}, modes


def rank_and_world():
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def test_a_port_taken_before_the_ranks_bind_it_is_chosen_again(monkeypatch):
    """Another process may take the chosen port before rank 0 listens on it (EADDRINUSE): the pool starts again."""
    import socket

    from torchtsp.distributed import launch

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        free = launch._free_port
        monkeypatch.setattr(launch, "_free_port", lambda: next(ports, None) or free())
        starts = []
        start = launch.WorkerPool._start
        monkeypatch.setattr(launch.WorkerPool, "_start", lambda self: starts.append(1) or start(self))
        with launch.WorkerPool(2, timeout_s=60) as pool:
            assert pool.run(rank_and_world) == [(0, 2), (1, 2)]
        assert len(starts) == 2  # the first start lost its port
