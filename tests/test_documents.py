"""Document masking of packed rows, on every scheme, against transformers run on each document alone.

A packed row holds several documents; ``document_ids`` marks them. Within a document attention is causal and
RoPE positions start at 0; nothing crosses a document edge. The ground truth is the Hugging Face model run on
every document separately (positions from 0), its summed NLL over all valid targets divided by their count:
the packed loss and every parameter gradient of each scheme must equal it. The batch has documents that cross
zigzag chunk and rank edges, a one-token document, and rows of different layouts.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import torchtsp
from torchtsp.distributed import zigzag
from torchtsp.distributed.attention import zigzag_attention_backward, zigzag_attention_forward
from torchtsp.hf import config_from_hf, from_hf_state_dict
from torchtsp.layers import IGNORE_INDEX, Documents, attend

transformers = pytest.importorskip("transformers")

# Both sides compute in float32 but in other orders (per-document SDPA calls vs HF eager matmul + softmax,
# partial attention results merged by LSE over ranks, gradients summed over ranks): ~1e-7 to 1e-6 relative
# seen. 2e-5 leaves room for that, while a document mask quietly replaced by plain causal attention, or
# positions that do not restart, is off by 1e-2 or more (checked below: the plain-causal loss is far off).
TOL = 2e-5
S = 48  # divisible by 2·D for D = 1, 2, 3, 4
# Row 0: a document crossing every chunk edge at D = 4 (chunks of 6), a one-token document; row 1 another layout.
LENGTHS = [[5, 1, 13, 29], [20, 3, 25]]


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def packed_batch(vocab: int, lengths=LENGTHS, seed: int = 3):
    """tokens, labels (next token within the document; a document's last token has none) and document ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])
    tokens = torch.randint(vocab, ids.shape, generator=g)
    labels = torch.randint(vocab, ids.shape, generator=g)
    last = torch.ones_like(ids, dtype=torch.bool)
    last[:, :-1] = ids[:, 1:] != ids[:, :-1]
    labels[last] = IGNORE_INDEX
    labels[0, 7] = IGNORE_INDEX  # an ignored target inside a document
    return tokens, labels, ids


def documents_alone(model, tokens, labels, lengths=LENGTHS):
    """Mean NLL of every document run alone (HF model), over all valid targets, and its backward."""
    total, count = 0.0, 0
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            logits = model(input_ids=tokens[b:b + 1, start:start + n]).logits[0]
            target = labels[b, start:start + n]
            total = total + F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX, reduction="sum")
            count += int((target != IGNORE_INDEX).sum())
            start += n
    loss = total / count
    loss.backward()
    return loss


def make_llama(heads: int, kv_heads: int, head_dim: int = 8, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=heads * head_dim, num_hidden_layers=2, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, intermediate_size=96, vocab_size=61,
                                      max_position_embeddings=64, attn_implementation="eager")
    return _spread(transformers.LlamaForCausalLM(config).float().eval())


def make_mixtral(seed: int = 0):
    torch.manual_seed(seed)
    # No load-balancing term: it is a whole-batch statistic, which documents run alone cannot reproduce.
    config = transformers.MixtralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                        num_hidden_layers=2, intermediate_size=48, num_local_experts=4,
                                        num_experts_per_tok=2, vocab_size=61, max_position_embeddings=64,
                                        router_aux_loss_coef=0.0, router_jitter_noise=0.0, sliding_window=None,
                                        attn_implementation="eager")
    return _spread(transformers.MixtralForCausalLM(config).float().eval())


def _spread(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(std=0.1)
    return model


def hf_truth(hf):
    """(config, weights, tokens, labels, document ids, loss, gradients) with the ground truth of ``hf``."""
    cfg = config_from_hf(hf.config.to_dict())
    tokens, labels, ids = packed_batch(cfg.vocab_size)
    loss = documents_alone(hf, tokens, labels)
    weights = from_hf_state_dict({n: p.detach() for n, p in hf.named_parameters()}, cfg)
    grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()}, cfg)
    assert all(g.abs().max() > 0 for g in grads.values())  # every gradient carries signal: the check can fail
    return cfg, weights, tokens, labels, ids, loss.item(), grads


def check(results, truth, what):
    *_, hf_loss, grads = truth
    for loss, full in results:
        assert abs(loss - hf_loss) <= TOL * hf_loss, (what, loss, hf_loss)
        assert full.keys() == grads.keys(), what
        errs = {n: rel_err(full[n], g) for n, g in grads.items()}
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, (what, worst, errs[worst])


@pytest.fixture(scope="module")
def llama():
    return hf_truth(make_llama(heads=8, kv_heads=4))


# ----------------------------------------------------------------------------- the reference model, one process


def test_documents_from_ids():
    ids = torch.tensor([[7, 7, 3, 3, 3, 7], [1, 1, 1, 1, 1, 1]])
    docs = Documents.from_ids(ids)
    assert docs.runs == (((0, 2), (2, 5), (5, 6)), ((0, 6),))  # a repeated id after another one is a new document
    assert docs.positions.tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]
    assert Documents.from_positions(docs.positions).runs == docs.runs
    with pytest.raises(ValueError, match="integer"):
        Documents.from_ids(ids.float())
    with pytest.raises(ValueError, match="must equal tokens shape"):
        torchtsp.Transformer(torchtsp.ModelConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2, n_kv_heads=2,
                                                ffn_dim=16)).loss(
            torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long), ids)


def reference(truth):
    cfg, weights = truth[:2]
    model = torchtsp.Transformer(cfg)
    model.load_state_dict(weights)
    return model


def test_reference_equals_each_document_alone(llama):
    model = reference(llama)
    tokens, labels, ids = llama[2:5]
    loss = model.loss(tokens, labels, ids)
    loss.backward()
    check([(loss.item(), {n: p.grad for n, p in model.named_parameters()})], llama, "reference")
    # Without the mask the same batch is far off: the comparison above can fail.
    assert abs(model.loss(tokens, labels).item() - llama[5]) > 100 * TOL * llama[5]


def test_a_token_changes_only_its_own_document(llama):
    model = reference(llama)
    tokens, _, ids = llama[2:5]
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 61  # inside document 2 of row 0, tokens [6, 19)
    with torch.no_grad():
        a, b = model(tokens, document_ids=ids), model(changed, document_ids=ids)
    assert not torch.equal(a[0, 10:19], b[0, 10:19])
    assert torch.equal(a[0, :6], b[0, :6]) and torch.equal(a[0, 19:], b[0, 19:]) and torch.equal(a[1], b[1])


def test_a_document_anywhere_in_a_row_gives_its_logits_alone(llama):
    model = reference(llama)
    g = torch.Generator().manual_seed(9)
    doc = torch.randint(61, (1, 11), generator=g)
    with torch.no_grad():
        alone = model(doc)
        for offset in (0, 1, 17, 37):
            row = torch.randint(61, (1, S), generator=g)
            row[0, offset:offset + 11] = doc
            ids = torch.zeros(1, S, dtype=torch.long)
            ids[0, offset:] = 1
            ids[0, offset + 11:] = 2
            # Other shapes of the same per-document call: round-off only (the kernels may block differently).
            assert rel_err(model(row, document_ids=ids)[:, offset:offset + 11], alone) < 1e-5, offset


def test_mixture_of_experts_reference_equals_each_document_alone():
    truth = hf_truth(make_mixtral())
    model = reference(truth)
    loss = model.loss(*truth[2:5])
    loss.backward()
    check([(loss.item(), {n: p.grad for n, p in model.named_parameters()})], truth, "reference moe")


class AttentionWork(TorchDispatchMode):
    """Counts the (query, key) pairs handed to the fused attention kernels: what attention computes."""

    def __init__(self):
        super().__init__()
        self.pairs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__ and "backward" not in func.__name__:
            q, k = args[0], args[1]
            self.pairs += q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        return func(*args, **(kwargs or {}))


def zigzag_parts(D, B, Hq, Hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, d, generator=g)
    k, v = torch.randn(2, B, Hkv, S, d, generator=g)
    return q, k, v


@pytest.mark.parametrize("D", [1, 2, 3, 4])
def test_zigzag_attention_with_documents_equals_whole_rows_and_skips_foreign_blocks(D):
    """Every rank's zigzag part, forward and backward, against one document-masked attention of whole rows."""
    docs = Documents.from_ids(packed_batch(61)[2])
    B, Hq, Hkv, d = 2, 4, 2, 8
    q, k, v = zigzag_parts(D, B, Hq, Hkv, d)
    dout = torch.randn(B, Hq, S, d, generator=torch.Generator().manual_seed(1))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    whole, _ = attend(qr, kr, vr, docs.mask())
    whole.backward(dout)
    shard = lambda t: zigzag.shard(t, D, r, dim=2)
    # Every rank's local K/V, token-major [2, B, S/D, Hkv, d], as the all-gather delivers them.
    kv = [torch.stack([zigzag.shard(k, D, r, dim=2), zigzag.shard(v, D, r, dim=2)]).transpose(2, 3)
          for r in range(D)]
    outs, dqs, dkv = [], [], torch.zeros(D, 2, B, S // D, Hkv, d)
    work = AttentionWork()
    for r in range(D):
        with work:
            out, lse = zigzag_attention_forward(shard(q), kv, r, D, docs.mask())
        dq, part = zigzag_attention_backward(shard(dout), shard(q), kv, out, lse, r, D, docs.mask())
        outs.append(out)
        dqs.append(dq)
        dkv += torch.stack(list(part)) if isinstance(part, list) else part
    assert rel_err(zigzag.unshard(torch.stack(outs), dim=2), whole) < 1e-6
    assert rel_err(zigzag.unshard(torch.stack(dqs), dim=2), qr.grad) < 1e-6
    dk = zigzag.unshard(dkv[:, 0].transpose(2, 3), dim=2)
    dv = zigzag.unshard(dkv[:, 1].transpose(2, 3), dim=2)
    assert rel_err(dk, kr.grad) < 1e-6 and rel_err(dv, vr.grad) < 1e-6
    # The kernels were handed exactly the (query, key) pairs of each document's chunk blocks (a query chunk
    # against its own and every earlier chunk, over all ranks), nothing of blocks that no document spans.
    chunks = 1 if D == 1 else 2 * D  # at D = 1 the whole row is one diagonal part
    chunk = S // chunks
    expected = 0
    for row in LENGTHS:
        start = 0
        for n in row:
            overlap = [max(0, min(start + n, (c + 1) * chunk) - max(start, c * chunk)) for c in range(chunks)]
            expected += sum(overlap[qc] * overlap[kc] for qc in range(chunks) for kc in range(qc + 1))
            start += n
    assert work.pairs == Hq * expected, (work.pairs, Hq * expected)
    with AttentionWork() as plain:
        for r in range(D):
            zigzag_attention_forward(shard(q), kv, r, D)
    assert plain.pairs > 1.5 * work.pairs


# ----------------------------------------------------------------------------- every scheme, several ranks


def scheme_on_rank(truth, scheme, degrees, pipeline=False, **options):
    cfg, weights, tokens, labels, ids = truth[:5]
    model = torchtsp.Transformer(cfg)
    model.load_state_dict(weights)
    mesh = torchtsp.init_mesh(**degrees)
    if pipeline:
        from torchtsp.parallel.pipeline import pipeline_parallelize

        pmodel = pipeline_parallelize(model, mesh, microbatches=2)
        loss = pmodel.forward_backward(tokens, labels, ids)
    else:
        pmodel = torchtsp.parallelize(copy.deepcopy(model), mesh, scheme, **options)
        loss = pmodel.loss(tokens, labels, ids)
        loss.backward()
    return loss.item(), pmodel.full_grads()


def merged_stages(results):
    """A pipeline rank holds its stages' gradients only: the union over ranks is the whole model."""
    full = {}
    for _, grads in results:
        full.update(grads)
    return [(results[0][0], full)]


@pytest.mark.parametrize("scheme,degrees", [
    ("tsp", {"tsp": 1}), ("tsp", {"tsp": 2}), ("tsp", {"tsp": 4}), ("sp", {"sp": 4}), ("tp", {"tp": 4}),
    ("tp_sp", {"tp": 2, "sp": 2}), ("tsp", {"dp": 2, "tsp": 2}), ("torch_tp", {"tp": 2}), ("dp", {"dp": 2}),
])
def test_scheme_equals_each_document_alone(pools, llama, scheme, degrees):
    world = 1
    for n in degrees.values():
        world *= n
    check(pools(world).run(scheme_on_rank, llama, scheme, degrees), llama, (scheme, degrees))


@pytest.mark.parametrize("scheme", ["tsp", "sp", "tp"])
def test_recompute_equals_each_document_alone(pools, llama, scheme):
    check(pools(2).run(scheme_on_rank, llama, scheme, {scheme: 2}, recompute=True), llama, (scheme, "recompute"))


def test_megatron_sequence_parallel_equals_each_document_alone(pools, llama):
    check(pools(2).run(scheme_on_rank, llama, "tp", {"tp": 2}, sequence_parallel=True), llama, "tp + sp")


def test_tsp_at_three_ranks_equals_each_document_alone(pools):
    truth = hf_truth(make_llama(heads=6, kv_heads=3))
    check(pools(3).run(scheme_on_rank, truth, "tsp", {"tsp": 3}), truth, "tsp3")


def test_pipeline_stages_over_tsp_equal_each_document_alone(pools, llama):
    results = pools(4).run(scheme_on_rank, llama, "tsp", {"pp": 2, "tsp": 2}, pipeline=True)
    check(merged_stages(results), llama, "pp2 x tsp2")


def test_mixture_of_experts_under_tsp_equals_each_document_alone(pools):
    truth = hf_truth(make_mixtral())
    check(pools(2).run(scheme_on_rank, truth, "tsp", {"tsp": 2}), truth, "moe tsp2")


# ----------------------------------------------------------------------------- the trainer's --document-mask


@pytest.fixture(scope="module")
def documents_npy(tmp_path_factory):
    """Byte-range documents of 3 to 40 ids, each ended by the byte tokenizer's EOS (256)."""
    import numpy as np

    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, 256, rng.integers(3, 40)), 256) for _ in range(150)]
    path = tmp_path_factory.mktemp("documents") / "ids.npy"
    np.save(path, np.concatenate(docs).astype(np.uint16))
    return path


def train_losses(pools, world, out, **settings):
    from torchtsp.train.config import TrainConfig
    from torchtsp.train.trainer import run_training

    cfg = TrainConfig(batch_size=4, seq_len=48, steps=4, lr=1e-2, sample_tokens=0, out=str(out), **settings)
    return pools(world).run(run_training, cfg)[0]["losses"]


def test_packed_inputs_end_documents_after_eos():
    from torchtsp.train.data import packed_inputs

    batch = torch.tensor([[5, 9, 256, 7, 256, 256, 3, 4]])
    tokens, labels, ids = packed_inputs(batch, eos_id=256)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 3]]  # an EOS closes its document; an empty one is one EOS
    assert labels.tolist() == [[9, 256, IGNORE_INDEX, 256, IGNORE_INDEX, IGNORE_INDEX, 4]]
    assert packed_inputs(batch, eos_id=None)[2] is None


def test_trainer_document_mask_is_exact_across_layouts_accumulation_and_resume(pools, tmp_path, documents_npy):
    data = {"data": str(documents_npy), "document_mask": True}
    one = train_losses(pools, 1, tmp_path / "one", **data)
    plain = train_losses(pools, 1, tmp_path / "plain", data=str(documents_npy))
    # The mask changes the losses (the first barely: a fresh model hardly attends), so the checks below can fail.
    assert abs(one[-1] - plain[-1]) > 1e-2, (one, plain)
    runs = {
        "tsp2, accum 2": train_losses(pools, 2, tmp_path / "tsp2", tsp=2, grad_accum=2, **data),
        "dp2 x tsp2, accum 2": train_losses(pools, 4, tmp_path / "dp", dp=2, tsp=2, grad_accum=2, **data),
        "pp2, accum 2": train_losses(pools, 2, tmp_path / "pp", pp=2, tsp=1, grad_accum=2, **data),
        "sp2": train_losses(pools, 2, tmp_path / "sp", scheme="sp", sp=2, **data),
    }
    for name, losses in runs.items():
        # float32 sums over ranks and micro-batches in another order, compounded over 3 AdamW steps.
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(losses, one)), (name, losses, one)
    # Resume mid-run: the same batches with the same documents, bit for bit.
    first = train_losses(pools, 2, tmp_path / "first", tsp=2, checkpoint_every=2, **data)
    step2 = tmp_path / "first" / "checkpoints" / "step_000002"
    assert train_losses(pools, 2, tmp_path / "again", tsp=2, resume=str(step2), **data) == first[2:]


def test_bench_masks_documents_without_adding_memory(pools):
    """The bench's --documents cells: both run, and the mask adds no buffer (no S x S mask, ever)."""
    import dataclasses

    from torchtsp.bench.measure import CellSpec, packed_document_ids

    ids = packed_document_ids(2, 512, 64, seed=0)
    assert ids.shape == (2, 512) and 4 < len(Documents.from_ids(ids).runs[0]) < 20
    assert torch.equal(ids, packed_document_ids(2, 512, 64, seed=0))  # seeded
    cfg = torchtsp.ModelConfig(vocab_size=257, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=128,
                               max_seq_len=512)
    plain = CellSpec("tsp", {"tsp": 2}, cfg, 2, 512, warmup=1, steps=2)
    from torchtsp.bench.measure import paired_on_rank

    result = pools(2).run(paired_on_rank, [plain, dataclasses.replace(plain, documents=64)], True)[0]
    masked, unmasked = result["tsp documents=64"], result["tsp"]
    # The live-tensor peaks differ by the per-document kernels' small outputs only (no [S, S] mask: at S=512 a
    # float32 one would be 1 MiB per head and row, far above the 3% allowed here).
    assert masked["peak_bytes"] <= 1.03 * unmasked["peak_bytes"], (masked, unmasked)
