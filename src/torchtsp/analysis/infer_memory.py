"""Analytic per-rank memory of inference (``predict_memory(..., mode="infer")``): the prefill's working set, the KV
cache of each scheme and decode cache layout, and a decode step's working set (docs/analysis.md, "Inference memory").
``generate`` preallocates every token of every layer (a sliding layer too: its cache is one block of the whole
sequence), and ``predict_infer`` counts that; the paged serving cache keeps a sliding layer's window only
(``paged_kv_bytes``).

Torch-free, like memory_model.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import schemes
from ..config import ModelConfig
from ..kv_layouts import KVPlacement, kv_heads_per_rank, kv_token_ranks
from ..schemes import Scheme
from ..sizes import KEY_BLOCK  # keys per block of kernels.masked_attention: a score buffer [B, heads, T, KEY_BLOCK]
from .breakdown import FP32, MemoryBreakdown, _ceil_div, _kv_heads_held, _round_up


def _attend_bytes(batch: int, heads: int, tokens: int, keys: int, d: int) -> int:
    """Peak bytes of ``kernels.masked_attention`` (what a KV-cache read, ``CacheStep.attend``, runs), reached in
    the online-softmax update of a key block: the block's float32 scores and its boolean mask, and five
    query-sized float32 buffers (the scaled queries, the old and rescaled outputs, the block's contribution and
    their sum)."""
    block = min(keys, KEY_BLOCK)
    rows = batch * heads * tokens
    return FP32 * rows * (block + 5 * d) + batch * tokens * block


def infer_schedule(scheme: str, cfg: ModelConfig, tokens_in_flight: int, schedule: str = "auto") -> str:
    """The schedule an inference phase of ``scheme`` runs with ``tokens_in_flight`` tokens per step
    (``schemes.infer_schedule``, the rule ``generate`` applies)."""
    from ..sizes import tsp_tp_crossover_tokens

    return schemes.infer_schedule(scheme, tokens_in_flight, tsp_tp_crossover_tokens(cfg), schedule)


def predict_infer(spec: Scheme, cfg: ModelConfig, batch: int, prompt_len: int, degrees: dict[str, int], *,
                   e: int, params: int, new_tokens: int, schedule: str, prefill_chunk: int | None,
                   kv_layout: str = "auto") -> MemoryBreakdown:
    """Prefill of ``prompt_len`` tokens per sequence (then ``new_tokens`` decoded) as ``infer/`` runs it: the
    weights, the KV cache at its full capacity, and the largest working set of one layer of the prefill
    chunk that sees the most keys (the last one), or of a decode step (``decode_peak``) if that is larger. The
    KV cache is preallocated, so it is counted whole.

    Per schedule (docs/analysis.md, "Inference memory"): TP keeps every token with its heads and attends
    them to all keys; SP and TSP's weights-move schedule keep 1/D of the tokens and gather K/V (SP all
    heads, TSP one head group at a time, with the received weight shards); TSP's activations-move
    schedule replicates the chunk's tokens and attends queries to the keys its cache layout gives it
    (``kv_layout``, ``_tsp_cache``).
    """
    h, d, L = cfg.dim, cfg.head_dim, cfg.n_layers
    n_heads, n_kv = cfg.n_heads, cfg.n_kv_heads
    dp = degrees.get("dp", 1)
    B = _ceil_div(batch, dp)  # generate gives a replica ceil(B/dp) rows (some replicas may get fewer)
    tok, w = spec.token_degree(degrees), spec.weight_degree(degrees)
    step = 2 * tok if spec.token_axes else 1  # generate pads prompts to a multiple of the zigzag's 2D (D = 1 too)
    chunk = _round_up(min(prefill_chunk or prompt_len, prompt_len), step)
    S = _round_up(prompt_len, chunk)  # the padded prompt; the last chunk's queries see all S keys
    rows = _ceil_div(cfg.vocab_size, w)
    held = _kv_heads_held(spec, cfg, w)  # KV heads the shards hold together (TSP, TP copy heads when n_kv < D)
    layout = _kv_layout(spec, cfg, w, kv_layout)
    if layout is not None:
        cache = _tsp_cache(layout, cfg, S, new_tokens, tok)
    elif tok > 1:  # SP: every head of 1/D of the tokens; queries stay home, partials merge by all-reduce
        cache = _Cache(n_kv, _slots("sequence", cfg, S + max(new_tokens - 1, 0), tok), n_kv, 1, tok)
    else:  # every token, this rank's KV heads (a copy of one when TP has fewer KV heads than ranks)
        cache = _Cache(kv_heads_per_rank("heads", n_kv, w), S + max(new_tokens - 1, 0), 0, 1, 1)
    kv_cache = L * 2 * e * B * cache.heads * cache.capacity * d
    rope = 2 * FP32 * d  # cos and sin per token
    which = infer_schedule(spec.name, cfg, B * chunk, schedule)
    if which == "activations":  # the chunk replicated, attended to the keys this rank's cache holds
        T = chunk
        attention = 4 * e * B * T * h + 2 * B * T * rope + _attended(cache, B, T, S, n_heads // w, held // w, d, e)
        mlp = 3 * e * B * T * h + 3 * e * B * T * cfg.ffn_dim // tok
    elif which == "weights":  # 1/D of the chunk; one head group's K/V of every token; shard double buffers
        T, keys = chunk // tok, S
        attn_shard = (2 * n_heads + 2 * held) * d * h * e // tok
        kv_group = 2 * e * B * (held // tok) * keys * d
        attention = (4 * e * B * T * h + B * T * rope + 2 * attn_shard + kv_group
                     + _attend_bytes(B, n_heads // tok, T, keys, d))
        mlp = 4 * e * B * T * h + 2 * 3 * h * cfg.ffn_dim * e // tok + 3 * e * B * T * cfg.ffn_dim // tok
    else:  # Megatron (tp, the reference, dp) or SP: replicated or head-sharded weights in place
        T, keys = chunk // tok, S
        kv_full = 2 * e * B * n_kv * keys * d if tok > 1 else 0  # SP gathers every head's K/V
        q = e * B * T * n_heads * d // w
        attention = 2 * e * B * T * h + B * T * rope + q + kv_full + _attend_bytes(B, n_heads // w, T, keys, d)
        mlp = 3 * e * B * T * h + 3 * e * B * T * cfg.ffn_dim // w
    logits = B * rows * FP32  # the last tokens' (or the decoded tokens') logits
    transient = max(attention, mlp) + logits
    decode = _decode_working_set(cfg, cache, B, S + max(new_tokens - 1, 0), w, e) + logits
    phase = f"prefill ({which})"
    if decode > transient:
        transient, phase = decode, "decode"
    return MemoryBreakdown(params=params, grads=0, optimizer=0, activations=0, transient=transient,
                           kv_cache=kv_cache, total=params + kv_cache + transient, phase=phase,
                           decode_peak=params + kv_cache + decode, kv_layout=layout or "")


def paged_kv_bytes(cfg: ModelConfig, n_tokens: int, e: int, heads_per_rank: int, block_size: int,
                   token_ranks: int = 1) -> int:
    """Bytes one decoding sequence of ``n_tokens`` holds on a rank in the paged serving cache (serve/blocks.py): in
    each block group (``kv_layouts.KVGroups``: groups of equal layer count sharing one pool of pages) its blocks
    (``kv_layouts.sequence_blocks``: a full layer every token's, a sliding layer only the blocks of its window), each a
    page of ``group_size`` layers (a padded group's unused layer included), K and V of ``heads_per_rank`` heads of
    ``block_size`` slots per block (``token_ranks`` ranks share a block's tokens)."""
    from ..kv_layouts import KVGroups, bytes_per_block, sequence_blocks

    groups, block_tokens = KVGroups.of(cfg), block_size * token_ranks
    page = bytes_per_block(groups.group_size, heads_per_rank, cfg.head_dim, e, block_size)
    return page * sum(sequence_blocks(w, n_tokens, block_tokens) for w in groups.windows)


@dataclass(frozen=True)
class _Cache:
    """A rank's KV cache: ``heads`` KV heads of ``capacity`` slots; in a decode step it receives the queries of
    ``gathered`` heads from each of the other ``members`` - 1 ranks it attends for, and holds 1/``share`` of each
    sequence's keys."""

    heads: int
    capacity: int
    gathered: int
    members: int
    share: int


def _kv_layout(spec: Scheme, cfg: ModelConfig, w: int, requested: str) -> str | None:
    """TSP's decode cache layout (``kv_layouts.resolve_kv_layout``); None for the other schemes, which have one
    layout each and accept only "auto"."""
    from ..kv_layouts import resolve_kv_layout

    if spec.kv_layouts:
        return resolve_kv_layout(requested, cfg.n_kv_heads, w, spec)
    if requested != "auto":
        raise ValueError(f"kv_layout={requested!r} is a TSP layout; {spec.name} has its own KV cache layout "
                         f"(use kv_layout='auto')")
    return None


def _slots(layout: str, cfg: ModelConfig, tokens: int, D: int) -> int:
    """Slots a rank's cache holds for each sequence of ``tokens`` cached tokens under ``layout``: the most any
    member of the ranks sharing a sequence's tokens keeps (``kv_layouts.KVPlacement``, member 0)."""
    return KVPlacement.of(layout, cfg.n_kv_heads, D).tokens_kept(tokens, 0)


def _tsp_cache(layout: str, cfg: ModelConfig, S: int, new_tokens: int, D: int) -> _Cache:
    """TSP's cache per layout (kv_layouts.py): ``heads``: n_kv/D heads, every token; ``grouped``: one KV head,
    1/c of the tokens (c = D/n_kv ranks share the head); ``sequence``: every head, 1/D of the tokens. At D = 1
    heads and sequence are the whole cache. The last chosen token is never cached: S + new_tokens - 1 tokens."""
    n_kv, q, R = cfg.n_kv_heads, cfg.n_heads // D, kv_token_ranks(layout, cfg.n_kv_heads, D)
    slots, heads = _slots(layout, cfg, S + max(new_tokens - 1, 0), D), kv_heads_per_rank(layout, n_kv, D)
    if layout == "heads":
        return _Cache(heads, slots, 0, 1, 1)
    if layout == "grouped":  # the group's queries gathered from its c members
        return _Cache(heads, slots, q, R, R)
    group_kv = kv_heads_per_rank("heads", n_kv, D)  # every head group's q/k/v gathered, copied KV heads with them
    return _Cache(heads, slots, cfg.n_heads // D + 2 * group_kv, R, R)


def _attended(cache: _Cache, B: int, T: int, S: int, hq: int, hkv: int, d: int, e: int) -> int:
    """Activations move: the q/k/v of the chunk's T tokens this rank makes (``hq`` + 2 ``hkv`` heads) or receives
    (every gathered head group's), and attention of the queries it answers for to the keys its cache holds."""
    own = e * B * T * (hq + 2 * hkv) * d
    gathered = e * B * T * cache.gathered * d * cache.members  # [members, B, T, heads, d]
    heads = hq * cache.members  # queries attended here: its own, or every member's
    return own + gathered + _attend_bytes(B, heads, T, S // cache.share, d)


def _decode_working_set(cfg: ModelConfig, cache: _Cache, B: int, context: int, w: int, e: int) -> int:
    """One decode step (one token per sequence, weights in place): the residual stream, q/k/v, the exchange
    buffers (the gathered heads, the float32 (O, LSE) partials in and out, the summed partials of every rank)
    and attention of the queries this rank answers for to the keys it holds."""
    h, d, hq = cfg.dim, cfg.head_dim, cfg.n_heads // w
    heads = hq * cache.members
    exchange = e * B * cache.gathered * d * cache.members + 2 * FP32 * B * heads * (d + 1) * (cache.members > 1)
    sums = e * B * h * w  # sum_over_ranks gathers [D, B, h] on a point-to-point backend
    hkv = kv_heads_per_rank("heads", cfg.n_kv_heads, w)  # the KV heads its weights project
    attention = 4 * e * B * h + _attended(cache, B, 1, context, hq, hkv, d, e) + exchange + sums
    mlp = 3 * e * B * h + 3 * e * B * cfg.ffn_dim // w + sums
    return max(attention, mlp)
