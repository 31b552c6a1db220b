"""benchmarks/gpu_check.py end to end on the CPU (``--device cpu``, small sizes): the script a GPU machine runs
must not first fail there. CI never needs a GPU; the real run is the README's "Checking on a GPU"."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_gpu_check_smoke_test_on_the_cpu(tmp_path):
    out = tmp_path / "gpu-check.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                          "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert json.loads(out.read_text()) == result
    assert result["sizes"] == "small (smoke test)" and result["ok"], result
    for dtype in ("float32", "bfloat16"):
        part = result["tsp_vs_reference"][dtype]
        assert part["ok"], part
        # fp32 against float64: round-off only (a wrong gradient would be O(1)).
        assert dtype == "bfloat16" or part["grad_rel_err_vs_float64"]["tsp_max"] < 1e-4, part
    assert all(v["ok"] for v in result["fused_vs_portable"].values()), result["fused_vs_portable"]
    for row in result["step"].values():
        for name in ("reference", "tsp_d1"):
            assert row[name]["step_s_median"] > 0 and row[name]["peak_bytes"] > 0, row
    assert 0 < result["attention_share"]["share"] < 1, result["attention_share"]
