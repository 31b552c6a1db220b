"""Inference: ``generate`` with the reference model or any parallel model (tsp, tp, sp, dp), exact against one
device. TSP prefills with the weights moving into a sequence-sharded KV cache and decodes with the weights
in place (tsp.py)."""

from .api import GenerationResult, generate, make_engine

__all__ = ["GenerationResult", "generate", "make_engine"]
