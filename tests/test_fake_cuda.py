"""Every CUDA branch of training and generation, executed on fake CUDA tensors over torch's ``fake`` process
group (no GPU, no peers): kernel argument contracts, shapes, dtypes, devices, the NCCL collective path and its
byte counts, and the absence of host syncs. See tests/fake_cuda.py for how, and docs/design.md ("Status on
GPUs") for what this does and does not prove.

The cases run in one child process (fake CUDA changes process-wide state for good); each test reads its case.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fake_cuda_cases import CASES, RANKS

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def results():
    """The cases split over one child per core (each case builds its own fake world, so none depends on another):
    about a minute in one child alone, near three on this 2-core machine when other runs share it (measured); the
    bound stays under pytest's 600 s per test."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE),
                                                        os.environ.get("PYTHONPATH", "")])}
    n = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    # Listed heaviest first: dealt out back and forth (0, 1, 1, 0, 0, 1, ... for two), the children's loads come
    # out within a few percent of each other.
    shares = [[] for _ in range(n)]
    for i, name in enumerate(CASES):
        turn, seat = divmod(i, n)
        shares[seat if turn % 2 == 0 else n - 1 - seat].append(name)
    children = [subprocess.Popen([sys.executable, str(HERE / "fake_cuda_cases.py"), *share], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for share in shares]
    out = {}
    try:
        for child in children:
            stdout, stderr = child.communicate(timeout=540)
            assert child.returncode == 0, stderr[-4000:]
            out.update(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for child in children:
            child.kill()
    assert sorted(out) == sorted(CASES)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_case_on_fake_cuda(results, case):
    assert results[case]["problems"] == [], "\n".join(results[case]["problems"])


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("tsp_")])
def test_tsp_step_has_no_host_device_sync_on_fake_cuda(results, case):
    """tests/test_tsp_step.py's audit, on the CUDA path: same flagged ops, fake CUDA tensors, NCCL-style comm."""
    for rank in RANKS:
        seen = results[case]["ops"][str(rank)]
        assert seen["all"] > 100, "the spy saw no ops"
        assert seen["syncs"] == [], (rank, seen["syncs"])


def test_moe_step_reads_only_its_split_sizes_to_the_host(results):
    """Dropless expert parallelism needs its all-to-all split sizes on the host: the one sync of a MoE step."""
    reads = results["moe_reads"]["host_reads"]  # distinct library lines: the split sizes' one reader
    assert len(reads) == 1 and reads[0].startswith("host.py:") and reads[0].endswith("(counts_on_host)"), reads


def test_pipeline_step_never_reads_the_host(results):
    """Token ids and labels are checked on the host batch before it moves (check_inputs reads values only of a CPU
    batch), so nothing of a pipelined step on the device reads the host."""
    reads = results["pipeline_pair"]["host_reads"]
    assert reads == [], reads
