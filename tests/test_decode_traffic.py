"""One decode step's collectives and bytes, counted on the ranks (``AxisComm.counting``), against the analytic
model ``analysis.comm_model.decode_step_traffic``, for TP and every TSP cache layout that has an engine; and the
model against arithmetic written here from the engines' descriptions (kv_layouts.py, issue 35)."""

from __future__ import annotations

import pytest

import torchtsp
from torchtsp.analysis.comm_model import SUM_BY_GATHER_MAX_BYTES, decode_step_traffic
from torchtsp.kv_layouts import allowed_kv_layouts, resolve_kv_layout

PROMPT = 8


def _cfg(n_kv: int) -> torchtsp.ModelConfig:
    return torchtsp.ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=n_kv, ffn_dim=256, vocab_size=64,
                                max_seq_len=32)


# ---------------------------------------------------------------- the model against arithmetic


# (n_kv, D) -> what auto picks and what an explicit layout the model does not allow names (issue 35's rule).
AUTO = {(4, 4): "heads", (8, 4): "heads", (4, 2): "heads", (2, 4): "grouped", (1, 2): "grouped", (1, 4): "grouped",
        (4, 1): "heads", (4, 8): "grouped", (6, 4): "sequence", (3, 2): "sequence"}


@pytest.mark.parametrize("n_kv,D", sorted(AUTO))
def test_auto_picks_heads_else_grouped_else_sequence(n_kv, D):
    from torchtsp.schemes import get_scheme

    assert set(dict(get_scheme("tsp").kv_layouts)) == {"heads", "grouped", "sequence"}  # each with its engine
    assert resolve_kv_layout("auto", n_kv, D) == AUTO[(n_kv, D)]
    for refused in {"heads", "grouped"} - {AUTO[(n_kv, D)]} - ({"grouped"} if D % n_kv == 0 and D > n_kv else set()):
        with pytest.raises(ValueError, match=f"n_kv={n_kv} KV heads on D={D} ranks"):
            resolve_kv_layout(refused, n_kv, D)
    assert resolve_kv_layout("sequence", n_kv, D) == "sequence"


@pytest.mark.parametrize("p2p", [True, False])
def test_decode_traffic_by_hand(p2p):
    """bench model shape, B = 4, float32: h = 256, d = 64, 4 layers; a [B, h] partial is 4 kB."""
    cfg = torchtsp.ModelConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=768, vocab_size=257)
    gqa = torchtsp.ModelConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768, vocab_size=257)
    B, D, L, part = 4, 4, 4, 4 * 256 * 4
    # One sum: a direct all-gather of 3 partials on gloo, a ring all-reduce 2·3/4 of one elsewhere.
    one_sum = ("all_gather", 3 * part) if p2p else ("all_reduce", 2 * 3 * part // 4)
    tp = decode_step_traffic("tp", cfg, B, D, point_to_point=p2p)
    assert tp.calls == {one_sum[0]: 1 + 2 * L} and tp.recv == {one_sum[0]: (1 + 2 * L) * one_sum[1]}
    assert tp.collectives == 9  # the 10 per step counts the token choice too
    heads = decode_step_traffic("tsp", cfg, B, D, "heads", point_to_point=p2p)
    assert heads == tp == decode_step_traffic("tsp", cfg, B, D, point_to_point=p2p)  # auto picks heads here
    seq = decode_step_traffic("tsp", cfg, B, D, "sequence", point_to_point=p2p)
    qkv = 3 * B * (1 + 2) * 64 * 4  # one q head and one K/V head per rank, from 3 ranks
    lse = 3 * B * 1 * (64 + 1) * 4  # one head's (O, LSE) per sequence, float32, from 3 ranks
    assert seq.collectives == 1 + 4 * L == 17
    assert seq.recv_bytes == (1 + 2 * L) * one_sum[1] + L * (qkv + lse)
    grouped = decode_step_traffic("tsp", gqa, B, D, "grouped", point_to_point=p2p)
    q, lse = 1 * B * 64 * 4, 1 * B * 65 * 4  # inside a group of c = 2: one peer
    assert grouped.collectives == 1 + 4 * L
    gathers = (1 + 2 * L) * one_sum[1] if p2p else 0
    assert grouped.recv.get("all_gather", 0) == gathers + L * q and grouped.recv["all_to_all"] == L * lse
    assert decode_step_traffic("tsp", gqa, B, D, point_to_point=p2p) == grouped  # auto: heads not allowed
    with pytest.raises(ValueError, match="n_kv=2 KV heads on D=4"):
        decode_step_traffic("tsp", gqa, B, D, "heads")


def test_large_partials_are_all_reduced_even_on_gloo():
    cfg = _cfg(4)
    B = SUM_BY_GATHER_MAX_BYTES // (cfg.dim * 4) + 1
    t = decode_step_traffic("tp", cfg, B, 4, point_to_point=True)
    assert t.calls == {"all_reduce": 1 + 2 * cfg.n_layers}
    assert t.recv["all_reduce"] == (1 + 2 * cfg.n_layers) * (2 * 3 * B * cfg.dim * 4 // 4)


# ---------------------------------------------------------------- counted on the ranks


def decode_counts_on_rank(scheme, n_kv, batch, kv_layout):
    """Prefill, then count one decode step (the engine's own comm) after one uncounted step."""
    import torch

    from torchtsp.distributed import comm
    from torchtsp.infer.api import make_engine
    from torchtsp.infer.sampling import TokenSelector
    from torchtsp.layout import Layout

    cfg = _cfg(n_kv)
    layout = Layout.resolve(scheme, comm.world_size(), cfg=cfg)
    torch.manual_seed(0)
    model = torchtsp.parallelize(torchtsp.Transformer(cfg, device="meta"), torchtsp.init_mesh(layout), layout)
    engine = make_engine(model, kv_layout)
    tokens = torch.randint(cfg.vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(0))
    lengths = torch.full((batch,), PROMPT)
    engine.choose_schedule("activations" if scheme == "tsp" else "auto", batch, PROMPT)
    engine.start(batch, PROMPT, 3)
    select = TokenSelector(engine.vocab_comm, cfg.vocab_size, engine.vocab_start, batch, slice(0, batch), 0.0,
                           None, None, 0, engine.device)
    with torch.inference_mode():
        ids = select(engine.prefill(tokens, lengths, PROMPT))
        ids = select(engine.decode(ids, lengths))
        with engine.comm.counting() as stats:
            engine.decode(ids, lengths + 1)
    return dict(stats.calls), dict(stats.bytes_recv), engine.kv_layout, engine.comm.point_to_point


CASES = [(D, scheme, n_kv, layout) for D in (2, 4)
         for scheme, n_kv, layout in [("tp", 4, "auto"), ("tsp", 4, "heads"), ("tsp", 2, "grouped"),
                                      ("tsp", 1, "grouped"), ("tsp", 4, "sequence"), ("tsp", 2, "sequence")]
         if scheme == "tp" or layout in allowed_kv_layouts(n_kv, D)]  # grouped needs D > n_kv


@pytest.mark.parametrize("D,scheme,n_kv,kv_layout", CASES, ids=[f"D{D}-{s}-kv{n}-{k}" for D, s, n, k in CASES])
@pytest.mark.parametrize("batch", [2, SUM_BY_GATHER_MAX_BYTES // (128 * 4) + 1], ids=["gathered", "all-reduced"])
def test_one_decode_step_moves_what_the_model_says(pools, D, scheme, n_kv, kv_layout, batch):
    for calls, recv, used, p2p in pools(D).run(decode_counts_on_rank, scheme, n_kv, batch, kv_layout):
        assert used == ("heads" if scheme == "tp" else kv_layout) and p2p
        want = decode_step_traffic(scheme, _cfg(n_kv), batch, D, kv_layout, e=4, point_to_point=True)
        assert (calls, recv) == (want.calls, want.recv)
