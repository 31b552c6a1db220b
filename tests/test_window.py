"""A sliding layer's pruned K/V exchange (``distributed.window``; the rule: ``chunks.window_keys``), in one
process: a whole tensor cut as D ranks hold it, the exchange done by handing tensors over, compared with the
whole tensor (which keys each rank ends up with) and with one windowed attention of whole rows (forward and
backward); the goal figure; a planted off-by-one in the rule fails the check. The same exchange on real
ranks, counted against the comm model: tests/test_families_parallel.py."""

from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from torchtsp import chunks
from torchtsp.distributed import window as W
from torchtsp.distributed import zigzag
from torchtsp.layers import Documents, attend, sequence_mask

# (D, S, window): the window inside one chunk, exactly a chunk, spanning several, longer than the sequence;
# window 1 (each query sees itself) moves nothing.
CASES = [(2, 16, 3), (2, 16, 4), (2, 16, 5), (2, 16, 9), (4, 32, 2), (4, 32, 4), (4, 32, 9), (4, 32, 17),
         (4, 32, 40), (3, 24, 7), (4, 32, 1)]


def exchanged(kv_whole: torch.Tensor, D: int, window: int) -> list[W.WindowKV]:
    """Every rank's ``WindowKV`` of a whole [2, B, S, H, d] K/V: each rank's zigzag share, and what every other
    rank sends it (``window_sends``), handed over as the exchange would."""
    local = [zigzag.shard(kv_whole, D, r, dim=2) for r in range(D)]
    sends = [W.window_sends(local[r], r, D, window) for r in range(D)]
    return [W.WindowKV(local[p], [sends[r][p] for r in range(D)], p, window) for p in range(D)]


def check_rule(D: int, S: int, window: int) -> None:
    """Each rank's keys per query chunk are exactly global tokens [start - window + 1, end) (clipped at 0), in
    order; what it receives is exactly the tokens its queries see that it does not hold, each once."""
    C = S // (2 * D)
    ids = torch.arange(S, dtype=torch.float32).view(1, 1, S, 1, 1).expand(2, 1, S, 1, 1)  # K/V = global index
    for p, kv in enumerate(exchanged(ids, D, window)):
        for c, chunk in enumerate(zigzag.chunk_ids(p, D)):
            expected = torch.arange(max(0, chunk * C - window + 1), (chunk + 1) * C, dtype=torch.float32)
            assert torch.equal(kv.keys(c)[0, 0, :, 0, 0], expected), (D, S, window, p, c)
        held = set(zigzag.positions(S, D, p).tolist())
        seen = {j for i in held for j in range(max(0, i - window + 1), i + 1)} - held
        received = [int(j) for t in kv.received if t is not None for j in t[0, 0, :, 0, 0].tolist()]
        assert sorted(received) == sorted(seen), (D, S, window, p)  # exactly these, none twice
        assert chunks.window_traffic(S, D, p, window)[0] == len(seen)


@pytest.mark.parametrize("D,S,window", CASES)
def test_each_rank_receives_exactly_the_keys_its_window_reads(D, S, window):
    check_rule(D, S, window)


def test_an_off_by_one_in_the_rule_is_caught(monkeypatch):
    """A window rule that reaches one token too far back, or one too short, fails the check above (both a
    window inside a chunk and one spanning chunks)."""
    real = chunks.window_keys
    for delta in (1, -1):
        monkeypatch.setattr(chunks, "window_keys", lambda s, d, r, w, delta=delta: real(s, d, r, w + delta))
        for D, S, window in ((2, 16, 3), (4, 32, 9)):
            with pytest.raises(AssertionError):
                check_rule(D, S, window)


def test_the_goal_figure_a_window_of_512_at_8192_tokens_over_4_ranks():
    """S = 8192, D = 4, W = 512: no rank receives more than 1024 tokens' K/V in a sliding layer, against the
    6144 of every other rank's tokens a full layer's all-gather brings (S - S/D)."""
    received = [chunks.window_traffic(8192, 4, r, 512)[0] for r in range(4)]
    assert max(received) <= 1024, received
    assert received == [511, 1022, 1022, 511]


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("D,S,window", [(2, 24, 3), (2, 24, 8), (4, 24, 2), (4, 24, 5), (4, 24, 13), (3, 24, 30)])
def test_window_attention_on_the_exchanged_keys_equals_whole_rows(D, S, window, documents):
    """Every rank's queries against the keys the exchange gave it, forward and backward, with the gradients of
    received keys returned to their owners (``add_returned``): one windowed attention of whole rows."""
    Hq, Hkv, d, B = 4, 2, 8, 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, S, d, generator=g)
    k, v = torch.randn(2, B, Hkv, S, d, generator=g)
    dout = torch.randn(B, Hq, S, d, generator=g)
    docs = Documents.from_ids(torch.tensor([[0] * 7 + [1] * 11 + [2] * (S - 18), [0] * S])) if documents else None
    mask = sequence_mask(docs, window)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    whole, _ = attend(qr, kr, vr, mask)
    whole.backward(dout)
    shard = lambda t, r: zigzag.shard(t, D, r, dim=2)
    kvs = exchanged(torch.stack([k, v]).transpose(2, 3), D, window)  # token-major [2, B, S, Hkv, d]
    outs, dqs, grads = [], [], []
    for r, kv in enumerate(kvs):
        out, lse = W.window_attention_forward(shard(q, r), kv, mask)
        dq, grad = W.window_attention_backward(shard(dout, r), shard(q, r), kv, out, lse, mask)
        outs.append(out)
        dqs.append(dq)
        grads.append(grad)
    # The return: rank r gets back from each peer the gradient of what it sent that peer.
    dkv = torch.stack([W.add_returned(grads[r].local, [grads[p].back[r] for p in range(D)], r, window)
                       for r in range(D)])
    # float32 round-off of sums in another order (blocks merged through LSEs): ~1e-7 of the largest entry.
    assert rel_err(zigzag.unshard(torch.stack(outs), dim=2), whole) < 1e-6
    assert rel_err(zigzag.unshard(torch.stack(dqs), dim=2), qr.grad) < 1e-6
    assert rel_err(zigzag.unshard(dkv[:, 0].transpose(2, 3), dim=2), kr.grad) < 1e-6
    assert rel_err(zigzag.unshard(dkv[:, 1].transpose(2, 3), dim=2), vr.grad) < 1e-6


def test_a_mask_of_another_window_is_refused():
    kv = exchanged(torch.zeros(2, 1, 16, 1, 4), 2, 3)[0]
    with pytest.raises(ValueError, match="window of 3 tokens, attended with a mask of window 4"):
        W.window_attention_forward(torch.zeros(1, 1, 8, 4), kv, sequence_mask(window=4))
    with pytest.raises(ValueError, match="positive number of tokens"):
        chunks.window_keys(16, 2, 0, 0)


def test_predict_comm_counts_a_sliding_layer_by_its_window():
    """``predict_comm``'s sliding layer differs from its full layer by the K/V tokens it does not receive, per
    rank, on a collective backend (full layers: every other rank's 6144 tokens) and on a point-to-point one
    (full layers causally pruned); without a rank, the busiest rank's figure."""
    from torchtsp.analysis import predict_comm
    from torchtsp.config import ModelConfig

    S, D, window = 8192, 4, 512
    cfg = ModelConfig(dim=64, n_heads=4, n_kv_heads=4, ffn_dim=96, vocab_size=101, n_layers=2, max_seq_len=S,
                      layer_types=("sliding_attention", "full_attention"), sliding_window=window)
    per_token = 2 * 64 * 4  # K and V of one token (n_kv·d = 64 wide), float32, batch 1
    full_tokens = {False: [6144] * D, True: [6144, 5120, 4096, 3072]}
    for point_to_point in (False, True):
        for r in range(D):
            types = predict_comm("tsp", cfg, 1, S, tsp=D, seq_rank=r, point_to_point=point_to_point).layer_types
            received = chunks.window_traffic(S, D, r, window)[0]
            forward = types["full_attention"]["forward"] - types["sliding_attention"]["forward"]
            assert forward == (full_tokens[point_to_point][r] - received) * per_token, (point_to_point, r)
    busiest = predict_comm("tsp", cfg, 1, S, tsp=D).layer_types["sliding_attention"]["forward"]
    assert busiest == predict_comm("tsp", cfg, 1, S, tsp=D, seq_rank=1, point_to_point=False).layer_types[
        "sliding_attention"]["forward"]
