"""The scheme registry: degrees from flags, legality before any communication, mesh-axis checks on every rank,
one data-parallel path over any scheme, and imports that stay one-way."""

import subprocess
import sys

import pytest
import torch

import torchtsp
from helpers import run_against_reference
from torchtsp.schemes import SCHEMES, get_scheme

CFG = torchtsp.ModelConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=101, n_layers=2)


def test_degrees_take_the_world_on_the_schemes_own_axis():
    assert get_scheme("tsp").degrees(4) == {"dp": 1, "sp": 1, "tp": 1, "tsp": 4}
    assert get_scheme("tsp").degrees(8, dp=2) == {"dp": 2, "sp": 1, "tp": 1, "tsp": 4}
    assert get_scheme("tp").degrees(4) == {"dp": 1, "sp": 1, "tp": 4, "tsp": 1}
    assert get_scheme("dp").degrees(4) == {"dp": 4, "sp": 1, "tp": 1, "tsp": 1}
    assert get_scheme("tp_sp").degrees(8) == {"dp": 1, "sp": 2, "tp": 4, "tsp": 1}  # most square, T >= Σ
    assert get_scheme("tp_sp").degrees(8, sp=4) == {"dp": 1, "sp": 4, "tp": 2, "tsp": 1}
    assert get_scheme("torch_tp").degrees(2)["tp"] == 2


@pytest.mark.parametrize("scheme,flags", [("tsp", {"tp": 4}), ("dp", {"tsp": 4}), ("sp", {"tp": 2, "sp": 2})])
def test_a_flag_for_an_axis_the_scheme_ignores_is_refused(scheme, flags):
    with pytest.raises(ValueError, match=f"scheme '{scheme}' does not use --"):
        get_scheme(scheme).degrees(4, **flags)


def test_degrees_that_do_not_fit_the_world_are_refused():
    with pytest.raises(ValueError, match="needs a multiple of 3 ranks"):
        get_scheme("tsp").degrees(4, dp=3)
    with pytest.raises(ValueError, match="needs 8 ranks but the world has 4"):
        get_scheme("tsp").degrees(4, dp=2, tsp=4)
    with pytest.raises(ValueError, match="positive integer"):
        get_scheme("tsp").degrees(4, tsp=0)


def test_validate_raises_the_layout_errors_a_run_would():
    tsp = get_scheme("tsp")
    tsp.validate(CFG, 2, 32, tsp.degrees(2))
    tsp.validate(CFG, 2, 32, tsp.degrees(4))  # 2 KV heads over 4 ranks: each copied on 2
    get_scheme("tp").validate(CFG, 2, 32, get_scheme("tp").degrees(4))  # TP copies KV heads too
    with pytest.raises(ValueError, match="n_kv_heads=2 divisible by 4; .* torch_tp cannot replicate KV heads"):
        get_scheme("torch_tp").validate(CFG, 2, 32, get_scheme("torch_tp").degrees(4))
    with pytest.raises(ValueError, match="n_kv_heads=3 divisible by 4, or 4 a multiple of it"):
        tsp.validate(CFG.replace(n_heads=12, n_kv_heads=3, dim=96), 2, 32, tsp.degrees(4))
    with pytest.raises(ValueError, match=r"divisible by 2\*D = 4 for zigzag"):
        tsp.validate(CFG, 2, 30, tsp.degrees(2))
    with pytest.raises(ValueError, match="divisible by the DP degree 2"):
        tsp.validate(CFG, 3, 32, tsp.degrees(4, dp=2))
    with pytest.raises(ValueError, match="applies to tp and torch_tp"):
        get_scheme("sp").validate(CFG, 2, 32, get_scheme("sp").degrees(2), sequence_parallel=True)
    with pytest.raises(ValueError, match="unknown scheme 'pp'"):
        get_scheme("pp")


def test_every_registered_scheme_has_a_class_and_its_formulas():
    from torchtsp.analysis import comm_model, memory_model
    from torchtsp.parallel import SCHEME_CLASSES

    assert SCHEME_CLASSES.keys() == SCHEMES.keys()
    for spec in SCHEMES.values():
        assert SCHEME_CLASSES[spec.name].scheme == spec.name
        assert (spec.traffic is None) == (spec.memory_walk is None), spec.name
        if spec.traffic:
            assert callable(getattr(comm_model, spec.traffic))
            assert memory_model.predict_memory(spec.name, CFG, 4, 64, **spec.degrees(2)).total > 0


def mismatched_mesh_on_rank():
    """Each rank builds TSP on a tp mesh (refused), then proves the job is still alive with a collective."""
    from torchtsp.distributed.comm import AxisComm

    mesh = torchtsp.init_mesh(tp=4)
    try:
        torchtsp.parallelize(torchtsp.Transformer(CFG), mesh, "tsp")
        message = None
    except ValueError as e:
        message = str(e)
    alive = AxisComm.world(timeout_s=30).all_reduce(torch.ones(1)).item()
    return message, alive


def test_a_mismatched_mesh_is_refused_on_every_rank_without_a_hang(pools):
    for message, alive in pools(4).run(mismatched_mesh_on_rank, timeout_s=120):
        assert message is not None and "scheme 'tsp' does not use the mesh axis tp=4" in message
        assert alive == 4  # no rank got stuck in a half-built model's collective


def test_a_mesh_without_the_schemes_axis_is_refused():
    with pytest.raises(ValueError, match="needs a mesh with the axis tp"):
        get_scheme("tp").check_mesh({"tsp": 1})


def dp_over_scheme_on_rank(scheme, degrees, options):
    mesh = torchtsp.init_mesh(**degrees)
    return run_against_reference(CFG, mesh, scheme, B=4, S=16, **options)


@pytest.mark.parametrize("scheme,degrees,options", [("tsp", {"dp": 2, "tsp": 2}, {}), ("tp", {"dp": 2, "tp": 2}, {}),
                                                    ("sp", {"dp": 2, "sp": 2}, {}), ("dp", {"dp": 4}, {}),
                                                    ("torch_tp", {"dp": 2, "tp": 2}, {}),
                                                    ("dp", {"dp": 4}, {"recompute": True})])
def test_data_parallel_over_any_scheme_matches_the_reference(pools, scheme, degrees, options):
    for r in pools(4).run(dp_over_scheme_on_rank, scheme, degrees, options):
        assert r["names"]
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * r["ref_loss"]  # float32 round-off of a sum over 4 ranks
        assert max(r["grad_err"].values()) <= 1e-4, r["grad_err"]  # partial sums added in another order


def test_hf_and_train_do_not_import_each_other():
    code = ("import sys, torchtsp.hf\n"
            "assert not any(m.startswith('torchtsp.train') for m in sys.modules), 'hf imports train'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def dp_traffic_on_rank(scheme, degrees, batch, seq_len):
    from torchtsp.distributed.comm import Traffic

    torch.manual_seed(0)
    model = torchtsp.parallelize(torchtsp.Transformer(CFG), torchtsp.init_mesh(**degrees), scheme)
    tokens = torch.randint(0, CFG.vocab_size, (batch, seq_len))
    with Traffic(model.comms()) as traffic:
        model.loss(tokens, tokens).backward()
    return traffic.recv, model.traffic_seq_rank()


@pytest.mark.parametrize("scheme,degrees", [("tsp", {"dp": 2, "tsp": 2}), ("dp", {"dp": 4})])
def test_data_parallel_traffic_equals_the_formula(pools, scheme, degrees):
    from torchtsp.analysis import predict_comm

    for got, seq_rank in pools(4).run(dp_traffic_on_rank, scheme, degrees, 4, 16):
        assert got == predict_comm(scheme, CFG, 4, 16, **degrees, seq_rank=seq_rank).total, seq_rank


@pytest.mark.parametrize("flags", [["--tp", "4"], ["--scheme", "dp", "--tsp", "4"],
                                   ["--scheme", "sp", "--tp", "2", "--sp", "2"]])
def test_train_refuses_a_mesh_its_scheme_would_ignore_before_starting_ranks(flags, capsys):
    from torchtsp.cli import main

    assert main(["train", "--nproc", "4", *flags, "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("torchtsp: error: scheme") and "does not use" in err and len(err.splitlines()) == 1
