"""Every public way out to Hugging Face, for every family, against transformers: ``to_hf_state_dict`` (a live
model's names, and with ``files`` a checkpoint's), ``save_hf_checkpoint`` and ``torchtsp convert``. Each result
must hold transformers' own state dict of the model it came from (names, shapes, values), and a folder must load
with ``from_pretrained`` into a model with that state dict and the same logits. Tiny models; CPU, float32, offline.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

import test_families  # noqa: E402
import test_hybrid  # noqa: E402
import test_moe  # noqa: E402
import test_rope_families  # noqa: E402
from helpers import cli_in_process, hf_batch  # noqa: E402
from torchtsp.hf import (  # noqa: E402
    config_from_hf,
    from_hf_state_dict,
    save_hf_checkpoint,
    save_torchtsp_checkpoint,
    to_hf_state_dict,
)

# The tiny configs the family tests build, one per family torchtsp reads (model_type in config.json).
MAKERS = {
    "llama": lambda: test_families.make_hf("llama3"),
    "qwen2": lambda: test_families.make_hf("qwen2"),
    "qwen3": lambda: test_families.make_hf("qwen3"),
    "mistral": lambda: test_families.make_hf("mistral"),
    "phi3": lambda: test_rope_families.make_hf("phi3"),  # fused q/k/v and gate/up, LongRoPE
    "gemma3_text": lambda: test_hybrid.make_hf("gemma3", window=5),  # sandwich norms, 1 + w norms, tied
    "qwen2_moe": lambda: test_moe.make_hf("qwen2_moe_norm"),
    "mixtral": lambda: test_moe.make_hf("mixtral"),
}
PATHS = ("to_hf_state_dict", "to_hf_state_dict(files=True)", "save_hf_checkpoint", "torchtsp convert")


def _hf_folder(path: str, sd: dict, cfg, hf, folder):
    """Write ``sd`` (torchtsp names) to ``folder`` through the public writer ``path`` names."""
    if path == "to_hf_state_dict(files=True)":
        from safetensors.torch import save_file

        folder.mkdir()
        tensors = to_hf_state_dict(sd, cfg, files=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        hf.config.save_pretrained(folder)  # transformers' own config: only the tensor names are under test
    elif path == "save_hf_checkpoint":
        save_hf_checkpoint(folder, sd, cfg)
    else:
        save_torchtsp_checkpoint(folder.with_name("native"), sd, cfg)
        result = cli_in_process("convert", folder.with_name("native"), folder)
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", list(MAKERS))
def test_export_loads_in_transformers_as_the_model_it_came_from(tmp_path, family, path):
    hf = MAKERS[family]().eval()
    assert hf.config.model_type == family
    expected = hf.state_dict()
    cfg = config_from_hf(hf.config.to_dict())
    sd = from_hf_state_dict(expected, cfg)
    if cfg.tie_embeddings:  # written once, as save_pretrained writes a tied model
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    if path == "to_hf_state_dict":
        out = to_hf_state_dict(sd, cfg)
        assert {k: tuple(v.shape) for k, v in out.items()} == {k: tuple(v.shape) for k, v in expected.items()}
        assert all(torch.equal(out[k], expected[k]) for k in expected)
        return
    _hf_folder(path, sd, cfg, hf, tmp_path / "hf")
    # The attention kernel of the model compared with, so that the same weights give the same logits bit for bit.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", attn_implementation=hf.config._attn_implementation).float().eval()
    assert type(loaded) is type(hf)
    got = loaded.state_dict()
    assert set(got) >= set(expected) and set(got) - set(expected) <= {"lm_head.weight"}
    assert all(torch.equal(got[k], expected[k]) for k in expected), family
    tokens, _ = hf_batch(cfg.vocab_size, 2, 9)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, hf(input_ids=tokens).logits), family
