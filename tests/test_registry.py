"""The scheme registry: degrees from flags, legality before any communication, mesh-axis checks on every rank,
one data-parallel path over any scheme, and imports that stay one-way."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchtsp
from helpers import run_against_reference
from torchtsp.layout import Layout
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


def test_the_one_layout_resolution_raises_the_errors_a_run_would():
    def resolve(scheme, batch, seq_len, cfg=CFG, **degrees):
        return Layout.of_degrees(scheme, cfg, batch, seq_len, **degrees)

    resolve("tsp", 2, 32, tsp=2)
    resolve("tsp", 2, 32, tsp=4)  # 2 KV heads over 4 ranks: each copied on 2
    resolve("tp", 2, 32, tp=4)  # TP copies KV heads too
    with pytest.raises(ValueError, match="n_kv_heads=2 divisible by 4; .* torch_tp cannot replicate KV heads"):
        resolve("torch_tp", 2, 32, tp=4)
    with pytest.raises(ValueError, match="n_kv_heads=3 divisible by 4, or 4 a multiple of it"):
        resolve("tsp", 2, 32, CFG.replace(n_heads=12, n_kv_heads=3, dim=96), tsp=4)
    with pytest.raises(ValueError, match=r"divisible by 2\*D = 4 for zigzag"):
        resolve("tsp", 2, 30, tsp=2)
    with pytest.raises(ValueError, match="divisible by the DP degree 2"):
        resolve("tsp", 3, 32, tsp=2, dp=2)
    with pytest.raises(ValueError, match="scheme 'sp' does not support sequence_parallel"):
        Layout.of_degrees("sp", CFG, 2, 32, sp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="unknown scheme 'pp'"):
        get_scheme("pp")


def test_every_registered_scheme_has_a_class_and_its_formulas():
    from torchtsp.analysis import memory_model
    from torchtsp.parallel.base import ParallelTransformer

    for spec in SCHEMES.values():
        model_class = spec.load("model")
        assert issubclass(model_class, ParallelTransformer) and model_class.scheme == spec.name
        assert (spec.traffic is None) == (spec.memory_walk is None), spec.name
        if spec.traffic:
            assert callable(spec.load("traffic"))
            assert memory_model.predict_memory(spec.name, CFG, 4, 64, **spec.degrees(2)).total > 0
        if spec.inference:
            assert spec.load("inference").__name__.endswith("Engine")


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


# ---------------------------------------------------------------- one object per scheme


TOY_MODULE = '''
from torchtsp.parallel.tp import TPTransformer


class ToyTransformer(TPTransformer):
    """A new scheme's one file: Megatron TP under another name."""

    scheme = "toy"
'''


def toy_scheme(tmp_path, monkeypatch):
    """Register a scheme the source tree has never heard of: one module (written here) and one registry entry."""
    from torchtsp.schemes import Scheme

    (tmp_path / "toy_scheme.py").write_text(TOY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = Scheme("toy", "Toy", "a test's scheme", axes=("tp",), weight_axes=("tp",), free_axis="tp",
                  options=("recompute",), kv_replication=True, model="toy_scheme:ToyTransformer",
                  inference="torchtsp.infer.tp:MegatronEngine",
                  traffic="torchtsp.analysis.comm_model:tp_step_traffic",
                  memory_walk="torchtsp.analysis.memory_model:REFERENCE_WALK",
                  step_cost="torchtsp.analysis.hardware:tp_exposed_s")
    monkeypatch.setitem(SCHEMES, "toy", spec)
    return spec


def test_a_new_scheme_is_one_module_and_one_registry_entry(tmp_path, monkeypatch, capsys):
    import json

    from torchtsp.analysis.hardware import group_layouts
    from torchtsp.cli import build_parser, main

    toy_scheme(tmp_path, monkeypatch)
    parser = build_parser()
    assert parser.parse_args(["train", "--scheme", "toy"]).scheme == "toy"
    assert parser.parse_args(["generate", "--scheme", "toy"]).scheme == "toy"
    # plan: the toy's layouts of 2 GPUs, its memory and traffic those of TP (the formulas it names)
    assert main(["plan", "--preset", "tiny", "--seq-len", "64", "--gpus", "2", "--json"]) == 0
    rows = {(r["scheme"], r["layout"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    toy, tp = rows["toy", "TP2"], rows["tp", "TP2"]
    assert toy["memory_bytes"] == tp["memory_bytes"] and toy["comm_bytes"] == tp["comm_bytes"]
    assert toy["memory_bytes"]["total"] > 0
    assert [d for s, d, _ in group_layouts(8) if s == "toy"] == [{"tp": 8}]
    # train: the registry's class runs, in this process (one rank)
    out = tmp_path / "run"
    assert main(["train", "--scheme", "toy", "--nproc", "1", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                 "--out", str(out)]) == 0
    assert "loss" in capsys.readouterr().out
    # generate: the engine the entry names, in this process; greedy tokens those of tp (the same split at T = 1)
    tokens = {}
    for scheme in ("toy", "tp"):
        assert main(["generate", "--scheme", scheme, "--nproc", "1", "--prompt-ids", "1,2,3;4,5",
                     "--max-new-tokens", "3", "--json"]) == 0
        tokens[scheme] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]
    assert tokens["toy"] == tokens["tp"] and len(tokens["toy"][0]) == 6
    assert "toy" in SCHEMES.servable()


# Registry fields that once held a scheme's name as a key into other code (``spec.memory_walk == "tsp"``).
ENTRY_FIELDS = ("name", "model", "inference", "traffic", "memory_walk", "step_cost")


def _scheme_name_uses(tree, schemes, axes):
    """(line, what) for each place ``tree`` branches on a scheme name or lists scheme names.

    Scheme and mesh-axis names overlap (tsp, tp, sp, dp), so a name alone is not enough: a comparison counts when
    one side is named like a scheme (``scheme``, ``spec.scheme``, ``SERVE_SCHEMES``...) and the other holds a scheme
    name; a literal tuple, list or set of scheme names when one of them is no axis (``tp_sp``) or it is bound to a
    scheme-like name or ``choices``; a dict keyed by scheme names when its values are code or settings rather than
    degrees or numbers (``{"tp": t}``); any ``globals()`` lookup."""
    def held(node):
        if isinstance(node, ast.Constant) and node.value in schemes:
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in schemes]
        return []

    def schemeish(node):
        ident = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return "scheme" in ident.lower() or ident in ENTRY_FIELDS

    def all_names(node):
        return len(node.elts) >= 2 and all(isinstance(e, ast.Constant) and e.value in schemes for e in node.elts)

    def code_or_setting(key, value):  # a class, function or string per scheme, not a degree or a number
        if isinstance(value, ast.Name) and value.id != key:
            return value.id[0].isupper() or key in value.id.lower()
        return isinstance(value, (ast.Attribute, ast.Lambda)) or (isinstance(value, ast.Constant)
                                                                  and isinstance(value.value, str))

    bound = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign) and any(map(schemeish, n.targets))}
    bound |= {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.keyword) and n.arg == "choices"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(map(schemeish, operands)) and any(map(held, operands)):
                found.append((node.lineno, "compares a scheme with a scheme name"))
        elif isinstance(node, ast.Match) and schemeish(node.subject):
            found.append((node.lineno, "matches a scheme against names"))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and all_names(node):
            if id(node) in bound or any(e.value not in axes for e in node.elts):
                found.append((node.lineno, "lists scheme names"))
        elif isinstance(node, ast.Dict) and len(node.keys) >= 2 and all(
                isinstance(k, ast.Constant) and k.value in schemes for k in node.keys):
            if any(code_or_setting(k.value, v) for k, v in zip(node.keys, node.values)):
                found.append((node.lineno, "maps scheme names to code or settings"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "globals":
            found.append((node.lineno, "looks a name up in globals()"))
    return found


def _uses(source):
    from torchtsp.schemes import AXES

    return [what for _, what in _scheme_name_uses(ast.parse(source), set(SCHEMES), set(AXES))]


@pytest.mark.parametrize("source", [
    'if scheme == "tsp":\n    pass',
    'if model.scheme != "dp":\n    pass',
    'if spec.memory_walk == "tsp":\n    pass',
    'ok = spec.scheme in ("tp", "sp")',
    'SERVE_SCHEMES = ("tsp", "tp", "sp")',
    'p.add_argument("--scheme", choices=["tsp", "tp"])',
    'for s in ("tsp", "tp_sp"):\n    pass',
    'engines = {"tsp": TSPEngine, "tp": MegatronEngine}',
    'formulas = {"tsp": tsp_step_traffic, "sp": sp_step_traffic}',
    'COLORS = {"tsp": "#d62728", "tp": "#1f77b4"}',
    'f = globals()[spec.traffic]',
    'match scheme:\n    case "tsp":\n        pass',
])
def test_the_scheme_name_check_catches_each_pattern(source):
    assert _uses(source), source


@pytest.mark.parametrize("source", [
    'for axis in ("dp", "tsp", "tp", "sp"):\n    pass',
    'degrees = {"dp": dp, "tsp": tsp, "tp": tp, "sp": sp}',
    'at_least = {"dp": 1, "tp": 1}',
    'split = {"tp": t, "sp": group // t}',
    'split = "n_experts" if "tsp" in spec.weight_axes else "moe_ffn_dim"',
    'spec = get_scheme(scheme)',
])
def test_the_scheme_name_check_passes_mesh_axes(source):
    assert not _uses(source), source


def test_nothing_outside_parallel_and_the_registry_names_a_scheme():
    from torchtsp.schemes import AXES

    src = Path(torchtsp.__file__).resolve().parent
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        if rel.parts[0] == "parallel" or rel == Path("schemes.py"):
            continue
        found += [f"{rel}:{line}: {what}"
                  for line, what in _scheme_name_uses(ast.parse(path.read_text()), set(SCHEMES), set(AXES))]
    assert not found, "\n".join(found)
