"""Log-probabilities from vocabulary-sharded logits against log_softmax over the whole vocabulary."""

import math

import pytest
import torch

from torchtsp.distributed.comm import AxisComm
from torchtsp.infer.logprobs import vocab_logprobs

VOCAB, ROWS, TOP = 37, 5, 4  # 37 is prime: every D > 1 pads the last slice


def full_logits() -> torch.Tensor:
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    logits[1, 3] = logits[1, 30] = logits[1].max() + 1  # a tie at the top, across slices
    return logits


def on_rank(targets: list[int]) -> tuple:
    comm = AxisComm.world(30)
    cols = math.ceil(VOCAB / comm.size)
    padded = torch.nn.functional.pad(full_logits(), (0, cols * comm.size - VOCAB), value=float("-inf"))
    start = comm.rank * cols
    return vocab_logprobs(padded[:, start:start + cols], torch.tensor(targets), start, comm, top_n=TOP)


def expected(targets: list[int]):
    reference = torch.log_softmax(full_logits().double(), dim=-1)
    # The stable sort of the whole vocabulary: ties by the lower id.
    order = reference.argsort(dim=-1, descending=True, stable=True)[:, :TOP]
    want = reference.gather(1, torch.tensor(targets).clamp_min(0).unsqueeze(1)).squeeze(1)
    return want, reference.gather(1, order), order


@pytest.mark.multirank
@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharded_logprobs_equal_log_softmax_of_the_whole_vocabulary(pools, world):
    targets = [0, 30, 36, 17, -1]  # first id, a tied top id, the last id, one inside, no target
    want, want_top, want_ids = expected(targets)
    for got, got_top, got_ids in pools(world).run(on_rank, targets):
        # float32 logits, merged in float64: within a few float32 ulps of the exact log-softmax.
        assert torch.allclose(got[:4].double(), want[:4], atol=1e-5), (got, want)
        assert math.isnan(got[4])
        assert torch.equal(got_ids, want_ids), (got_ids, want_ids)
        assert torch.allclose(got_top.double(), want_top, atol=1e-5)
    assert want_ids[1, :2].tolist() == [3, 30]  # the tie is in the test, ordered by id
