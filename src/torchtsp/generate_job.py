"""``torchtsp generate``: the launcher-side checks and the function every rank runs.

The launcher resolves the model's shape, the tokenizer and the prompts and checks them (one-line errors
before any rank starts); every rank then loads the weights, builds its mesh axis, parallelizes, and calls
``generate``. Rank 0 streams the text, or the launcher prints one JSON object.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .timeouts import COLLECTIVE_TIMEOUT_S


@dataclass
class GenerateJob:
    """Everything a rank needs (picklable)."""

    source: str  # "hf", "checkpoint" or "preset"
    location: str  # directory, run/step folder or preset name
    prompts: list[list[int]]
    max_new_tokens: int
    scheme: str = "tsp"
    degrees: dict = field(default_factory=dict)  # mesh degrees (from the scheme registry)
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None
    tokenizer: str | None = None  # --tokenizer DIR: overrides the model source's own tokenizer
    schedule: str = "auto"
    prefill_chunk: int | None = None
    kv_layout: str = "auto"  # kv_layouts.py
    dtype: str = "float32"
    stream: bool = True
    timeout_s: float = COLLECTIVE_TIMEOUT_S


def model_config_and_tokenizer(source: str, location: str, tokenizer: str | None = None):
    """(ModelConfig, tokenizer or None, EOS id or None) of a model source, without loading weights; ``tokenizer``
    (a folder of tokenizer.json) overrides the source's own."""
    from .data.tokenizers import ByteTokenizer, HFTokenizer

    if tokenizer is not None:
        cfg, _, eos = model_config_and_tokenizer(source, location)
        override = HFTokenizer(tokenizer, eos_id=eos)
        return cfg, override, override.eos_id if override.eos_id is not None else eos

    if source == "hf":
        from .hf import HF_CONFIG_NAME, config_from_hf, read_json

        path = Path(location)
        if not path.is_dir():
            raise FileNotFoundError(f"--hf {location}: not a directory (give a Hugging Face checkpoint folder)")
        hf_config = read_json(path / HF_CONFIG_NAME, "a Hugging Face checkpoint directory needs config.json")
        cfg = config_from_hf(hf_config)
        eos = hf_config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        tokenizer = None
        if (path / "tokenizer.json").is_file():
            try:  # a malformed tokenizer.json is a one-line error naming it
                tokenizer = HFTokenizer(path, eos_id=eos if isinstance(eos, int) else None)
            except OSError:
                tokenizer = None  # ids only, without the optional tokenizers library
        eos = eos if isinstance(eos, int) else None
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_id  # tokenizer_config.json's eos_token when config.json names none
        return cfg, tokenizer, eos
    if source == "checkpoint":
        from .config import ModelConfig
        from .data.tokenizers import run_tokenizer_folder
        from .train import checkpoint

        meta = checkpoint.read_meta(checkpoint.resolve(location))
        kept = run_tokenizer_folder(location)  # a run trained with its model's own tokenizer kept a copy
        if kept is not None:
            tokenizer = HFTokenizer(kept)
            return ModelConfig.from_dict(meta["model"]), tokenizer, tokenizer.eos_id
        return ModelConfig.from_dict(meta["model"]), ByteTokenizer(), ByteTokenizer.eot_id
    from .presets import get_preset

    cfg = get_preset(location)
    return cfg, (ByteTokenizer() if cfg.vocab_size >= ByteTokenizer.vocab_size else None), None


def check_kv_layout(requested: str, cfg, scheme: str, degrees: dict) -> str:
    """The KV-cache layout ``generate`` will use for ``--kv-layout``; the engine's one-line ValueError, before any
    rank starts, for one the model does not allow on the scheme's ranks."""
    from .kv_layouts import resolve_kv_layout

    return resolve_kv_layout(requested, cfg.n_kv_heads, degrees.get("tsp", 1), scheme)


def parse_prompt_ids(text: str) -> list[list[int]]:
    """``"1,2,3;4,5"`` -> [[1, 2, 3], [4, 5]] (``;`` separates prompts)."""
    prompts = []
    for i, part in enumerate(text.split(";")):
        try:
            prompts.append([int(t) for t in part.replace(" ", "").split(",") if t != ""])
        except ValueError:
            raise ValueError(f"--prompt-ids: prompt {i} ({part.strip()!r}) is not a comma-separated list of "
                             f"integers") from None
    return prompts


def parse_ids(text: str | None, flag: str) -> list[int]:
    if not text:
        return []
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of integers") from None


# ---------------------------------------------------------------- on every rank


def _load_model(job: GenerateJob, cfg, mesh):
    """The parallel model, built on the meta device: each rank reads (a checkpoint, slice by slice) or draws
    (a preset's seeded initial values) only its own shards."""
    import torch

    from .model import Transformer
    from .parallel import parallelize

    weights = None
    if job.source == "hf":
        from .hf import open_hf_weights

        cfg, weights = open_hf_weights(job.location)
    elif job.source == "checkpoint":
        from .train.checkpoint import CheckpointWeights

        weights = CheckpointWeights(job.location)
        cfg = weights.cfg
    torch.manual_seed(job.seed)
    model = parallelize(Transformer(cfg, device="meta"), mesh, job.scheme, timeout_s=job.timeout_s, weights=weights)
    return model.to(getattr(torch, job.dtype)).eval()


def run_generate(job: GenerateJob) -> dict:
    """On every rank: load, parallelize, generate; returns the summary (per-rank figures gathered)."""
    import torch

    from .distributed import comm
    from .distributed.comm import AxisComm
    from .distributed.mesh import init_mesh
    from .infer.api import generate
    from .memory import measure_peak

    cfg, tokenizer, _ = model_config_and_tokenizer(job.source, job.location, job.tokenizer)
    mesh = init_mesh(**job.degrees, timeout_s=job.timeout_s)
    model = _load_model(job, cfg, mesh)
    rank0 = comm.global_rank() == 0
    show = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else (lambda ids: " ".join(map(str, ids)))
    single = len(job.prompts) == 1 and job.stream and rank0
    streamed = list(job.prompts[0])
    printed = [show(streamed)]

    def stream(step, ids):
        """Rank 0 prints the single prompt's new text as it is produced: prompt and new ids are decoded
        together (word joins, whole UTF-8 characters) and the new part of the text is printed."""
        new_id = int(ids[0])
        if new_id < 0:
            return
        streamed.append(new_id)
        text = show(streamed).rstrip("\ufffd")  # an unfinished UTF-8 character waits for its next bytes
        if text.startswith(printed[0]):
            print(text[len(printed[0]):], end="", flush=True)
            printed[0] = text

    if single:
        print(printed[0], end="", flush=True)
    result, peak = measure_peak(lambda: generate(
        model, job.prompts, job.max_new_tokens, temperature=job.temperature, top_k=job.top_k, top_p=job.top_p,
        seed=job.seed, stop_token_ids=job.stop_token_ids, eos_token_id=job.eos_token_id, schedule=job.schedule,
        prefill_chunk=job.prefill_chunk, on_step=stream if single else None, kv_layout=job.kv_layout), model)
    if single:
        print(flush=True)
    elif job.stream and rank0:
        for i, tokens in enumerate(result.tokens):
            print(f"[{i}] {show(tokens)}", flush=True)
    per_rank = AxisComm.world(job.timeout_s).all_gather(torch.tensor([peak, result.kv_cache_bytes]),
                                                        label="generate.summary")
    summary = {"tokens": result.tokens, "prefill_s": result.prefill_s,
               "decode_s_per_token": result.decode_s_per_token,
               "peak_mem_bytes_per_rank": per_rank[:, 0].tolist(), "kv_cache_bytes_per_rank": per_rank[:, 1].tolist(),
               "schedule": result.schedule, "kv_layout": result.kv_layout, "scheme": job.scheme, "mesh": job.degrees}
    if tokenizer is not None:
        summary["text"] = [tokenizer.decode(t) for t in result.tokens]
    return summary


def print_json(summary: dict) -> None:
    print(json.dumps(summary), file=sys.stdout, flush=True)
