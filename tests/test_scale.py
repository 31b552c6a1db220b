"""Models that do not fit one device: built on the meta device, each rank materialises only its shards, from
the seeded initial values or from a checkpoint read slice by slice; the result equals the reference."""

import pytest
import torch

import torchtsp
from helpers import batch
from torchtsp.memory import measure_peak

GQA = torchtsp.ModelConfig(dim=64, n_heads=8, n_kv_heads=4, ffn_dim=120, vocab_size=101, n_layers=2)
GQA3 = torchtsp.ModelConfig(dim=96, n_heads=6, n_kv_heads=3, ffn_dim=120, vocab_size=101, n_layers=2)
TINY = torchtsp.ModelConfig(dim=64, n_heads=4, n_kv_heads=4, ffn_dim=96, vocab_size=101, n_layers=2,
                            tie_embeddings=True)
# (scheme, mesh degrees) at D = 1..4; D = 3 needs head counts divisible by 3 (GQA3).
LAYOUTS = {1: [("tsp", {"tsp": 1}), ("tp", {"tp": 1}), ("dp", {"dp": 1})],
           2: [("tsp", {"tsp": 2}), ("tp", {"tp": 2}), ("sp", {"sp": 2}), ("dp", {"dp": 2}),
               ("torch_tp", {"tp": 2}), ("tsp", {"dp": 2, "tsp": 1})],
           3: [("tsp", {"tsp": 3}), ("tp", {"tp": 3}), ("sp", {"sp": 3})],
           4: [("tsp", {"tsp": 4}), ("tp", {"tp": 4}), ("tp_sp", {"tp": 2, "sp": 2}),
               ("tsp", {"dp": 2, "tsp": 2}), ("sp", {"sp": 4})]}


def meta_build_on_rank(world):
    out = []
    for cfg in (GQA3,) if world == 3 else (GQA, TINY):
        torch.manual_seed(7)
        reference = {n: p.detach() for n, p in torchtsp.Transformer(cfg).named_parameters()}
        for scheme, degrees in LAYOUTS[world]:
            torch.manual_seed(7)
            meta = torchtsp.Transformer(cfg, device="meta")
            assert all(p.device.type == "meta" for p in meta.parameters())
            model = torchtsp.parallelize(meta, torchtsp.init_mesh(**degrees), scheme)
            full = model.full_state_dict()
            same = sorted(full) == sorted(reference) and all(torch.equal(full[n], t) for n, t in reference.items())
            out.append((scheme, str(degrees), cfg.tie_embeddings, same))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_meta_build_equals_the_seeded_reference_for_every_scheme(pools, world):
    results = pools(world).run(meta_build_on_rank, world) if world > 1 else [meta_build_on_rank(1)]
    for rank_results in results:
        for scheme, degrees, tied, same in rank_results:
            assert same, (scheme, degrees, tied)  # bit-identical: the same values, drawn by blocks of rows


BIG = torchtsp.ModelConfig(dim=256, n_heads=4, n_kv_heads=4, ffn_dim=768, vocab_size=4099, n_layers=3)


def build_peak_on_rank(scheme, degrees, hf_dir):
    """Peak live bytes while this rank builds its part of BIG, and the bytes of what it keeps."""
    mesh = torchtsp.init_mesh(**degrees)
    weights = None
    if hf_dir is not None:
        from torchtsp.hf import open_hf_weights

        _, weights = open_hf_weights(hf_dir)
    torch.manual_seed(0)

    def build():
        return torchtsp.parallelize(torchtsp.Transformer(BIG, device="meta"), mesh, scheme, weights=weights)

    model, peak = measure_peak(build)
    kept = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(t.numel() * 4 for t in torch.nn.Module.state_dict(torchtsp.Transformer(BIG, device="meta"))
                  .values())
    return peak, kept, largest


@pytest.mark.parametrize("source", ["seeded", "hf"])
def test_a_rank_never_holds_more_than_its_shards_and_one_tensor(pools, tmp_path, source):
    hf_dir = None
    if source == "hf":
        from torchtsp.hf import save_hf_checkpoint

        torch.manual_seed(0)
        model = torchtsp.Transformer(BIG)
        hf_dir = str(tmp_path / "hf")
        save_hf_checkpoint(hf_dir, model.state_dict(), BIG, max_shard_bytes=2**21)  # several files + index
    whole = sum(p.numel() * 4 for p in torchtsp.Transformer(BIG, device="meta").parameters())
    for peak, kept, largest in pools(4).run(build_peak_on_rank, "tsp", {"tsp": 4}, hf_dir):
        print(f"\n{source}: peak {peak / 2**20:.2f} MiB, kept {kept / 2**20:.2f} MiB, whole model "
              f"{whole / 2**20:.2f} MiB, largest tensor {largest / 2**20:.2f} MiB")
        assert kept <= whole / 4 * 1.05  # 1/D of the model (vocabulary padding adds a few rows)
        # Its shards, plus one tensor being read beside the packed buffer being filled. Reading from safetensors,
        # that tensor is a view of the file's bytes (memory-mapped; MemTracker counts its whole storage, the
        # largest tensor at most) and the copy of this rank's slice of it (1/D of it): kept + (1 + 1/D) x largest.
        assert peak <= kept + largest * 5 // 4, (peak, kept, largest)


def hf_load_on_rank(hf_dir, degrees, scheme):
    from torchtsp.hf import load_hf_checkpoint, open_hf_weights

    cfg, weights = open_hf_weights(hf_dir)
    model = torchtsp.parallelize(torchtsp.Transformer(cfg, device="meta"), torchtsp.init_mesh(**degrees), scheme,
                                 weights=weights)
    _, reference = load_hf_checkpoint(hf_dir)
    full = model.full_state_dict()
    tokens, labels = batch(cfg, 2, 16)
    return all(torch.equal(full[n], t) for n, t in reference.items()), model.loss(tokens, labels).item()


def test_sharded_hf_loading_equals_the_whole_checkpoint(pools, tmp_path):
    from torchtsp.hf import load_hf_checkpoint, save_hf_checkpoint

    torch.manual_seed(1)
    model = torchtsp.Transformer(GQA)
    save_hf_checkpoint(tmp_path / "hf", model.state_dict(), GQA, max_shard_bytes=2**16)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    cfg, sd = load_hf_checkpoint(tmp_path / "hf")
    reference = torchtsp.Transformer(cfg)
    reference.load_state_dict(sd)
    tokens, labels = batch(cfg, 2, 16)
    expected = reference.loss(tokens, labels).item()
    for scheme, degrees in (("tsp", {"tsp": 2}), ("tp", {"tp": 2}), ("sp", {"sp": 2})):
        for same, loss in pools(2).run(hf_load_on_rank, str(tmp_path / "hf"), degrees, scheme):
            assert same, scheme
            assert loss == pytest.approx(expected, rel=1e-5), scheme  # float32 round-off of another order


def test_convert_streams_one_file_at_a_time(tmp_path):
    """HF -> native -> HF with small output files: equal tensors, and never more than one output file's worth
    of tensors (plus the tensor being read) alive at once."""
    from safetensors.torch import load_file

    from torchtsp.convert import convert_checkpoint
    from torchtsp.hf import load_hf_checkpoint, save_hf_checkpoint

    torch.manual_seed(2)
    model = torchtsp.Transformer(BIG)
    save_hf_checkpoint(tmp_path / "hf", model.state_dict(), BIG)
    shard = 2**21
    largest = max(t.numel() * 4 for t in model.state_dict().values())
    whole = sum(t.numel() * 4 for t in model.state_dict().values())
    _, peak = measure_peak(lambda: convert_checkpoint(tmp_path / "hf", tmp_path / "native", max_shard_bytes=shard))
    print(f"\nconvert: peak {peak / 2**20:.2f} MiB, whole model {whole / 2**20:.2f} MiB, file limit "
          f"{shard / 2**20:.0f} MiB (the largest tensor {largest / 2**20:.2f} MiB gets a file of its own)")
    assert peak <= max(shard, largest) + 2 * largest < whole
    files = sorted((tmp_path / "native").glob("model-*.safetensors"))
    assert len(files) > 2 and all(len(load_file(f)) >= 1 for f in files)
    convert_checkpoint(tmp_path / "native", tmp_path / "hf2", max_shard_bytes=shard)
    _, back = load_hf_checkpoint(tmp_path / "hf2")
    assert all(torch.equal(back[n], t) for n, t in model.state_dict().items())
