"""Inference: ``generate`` with the reference model or any parallel model (tsp, tp, sp, dp), exact against one
device. TSP prefills with the weights moving into a sequence-sharded KV cache and decodes with the weights
in place (tsp.py); ``schedule="auto"`` switches by the tokens in flight.

On every rank of the mesh, with the same arguments::

    model = torchtsp.parallelize(torchtsp.Transformer(cfg), torchtsp.init_mesh(tsp=4), "tsp")
    result = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=16, temperature=0.8, top_k=40, seed=0)
    result.tokens, result.prefill_s, result.decode_s_per_token, result.kv_cache_bytes, result.schedule
"""

from .api import GenerationResult, generate, make_engine

__all__ = ["GenerationResult", "generate", "make_engine"]

from ..lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # submodules as attributes on first use
