"""What every scheme's inference engine shares: chunked prefill, the last-token logits, the vocabulary slice, the
model's embedding scale and gated MLP on replicated tokens.

An engine runs on one rank and owns that rank's KV cache. ``generate`` (api.py) drives it:
``start`` (allocate the cache), ``prefill`` (the padded prompts; returns this rank's slice of the
logits at each sequence's last real token), then ``decode`` once per new token. A server makes the pool
(``kv_pool``) and gives the engine each step's sequences (``attach_cache``).

An engine is its KV-cache layout (``kv_layout``: which heads and tokens each rank caches, ``kv_layouts.py``)
and the schedules that run on it: one each for TP, SP and DP; for TSP a prefill with the weights or the
activations moving and the decode steps of its layout (tsp.py composes them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed import zigzag
from ..distributed.comm import AxisComm
from ..host import on_host
from ..kv_layouts import KVGroups, KVPlacement, kv_heads_per_rank, kv_token_ranks
from ..layers import block_forward, norm, scale_embeddings
from ..parallel.shards import mask_vocab_padding_, vocab_slice_index
from ..sizes import SUM_BY_GATHER_MAX_BYTES
from .cache import KVPool


def sum_over_ranks(comm: AxisComm, partial: torch.Tensor, label: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The sum over the axis of every rank's ``partial``, on every rank: what each engine's row-parallel outputs
    and vocabulary-slice embedding need, TP's and TSP's alike.

    A decode step's partials are a few kB and cost their latency, not their bytes. On a point-to-point backend
    (gloo) an all-reduce is a ring of 2(D-1) dependent hops, an all-gather one direct exchange: small partials are
    gathered (into ``out``, a [D, *shape] buffer, if given) and summed here in rank order, the same sum on every
    rank. Larger ones, and collective backends (NCCL's small all-reduce is already one exchange), all-reduce.
    """
    if comm.size == 1:
        return partial
    if comm.point_to_point and partial.numel() * partial.element_size() <= SUM_BY_GATHER_MAX_BYTES:
        return comm.all_gather(partial, label=label, out=out).sum(dim=0)
    return comm.all_reduce(partial, label=label)


def vocab_logits(z: torch.Tensor, head_slice: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """float32 logits [B, rows] of hidden states z [B, h] against a vocabulary slice; padding rows -inf."""
    return mask_vocab_padding_(F.linear(z, head_slice).float(), vocab_size - vocab_start)


def summed_lookup(comm: AxisComm, ids: torch.Tensor, rows: torch.Tensor, cfg, label: str = "infer.tp.embedding",
                  summed=sum_over_ranks) -> torch.Tensor:
    """Embeddings [B, T, h] of ids every rank holds, from vocabulary-sharded ``rows`` (this rank's shard
    ``comm.rank``): each rank looks up the ids in its shard, the sum over the ranks assembles them (exact: one
    rank contributes each row; ``summed(comm, partial, label)`` sums) and the model's scale is applied to the
    sum, as the reference scales its lookup (``layers.scale_embeddings``)."""
    return scale_embeddings(summed(comm, masked_lookup(ids, rows, comm.rank)[0], label), cfg)


def masked_lookup(ids: torch.Tensor, rows: torch.Tensor, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Embedding rows of the ids inside vocabulary shard ``shard`` (``rows``: its [V/D, h] weights), zeros for the
    others, and the hit mask (``parallel.shards.vocab_slice_index``: no boolean indexing, no host sync)."""
    local, hit = vocab_slice_index(ids, rows.shape[0], shard)
    return torch.where(hit.unsqueeze(-1), F.embedding(local, rows), 0.0), hit


def select_last(z: torch.Tensor, pos: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of z [B, T, h] where pos [B, T] is the sequence's last real position (0 if absent)."""
    here = (pos == (lengths - 1).unsqueeze(1)).unsqueeze(-1)
    return torch.where(here, z, 0.0).sum(dim=1)


def gather_positions(comm: AxisComm, z: torch.Tensor, rows, label: str) -> torch.Tensor:
    """Every position's hidden states [len(rows), T, h], replicated and in position order, from each rank's
    zigzag share z [B, T/D, h] of a prefill chunk (``rows``: the batch rows wanted)."""
    return zigzag.unshard(comm.all_gather(z[rows].contiguous(), label=label), dim=1)


def run_blocks(x: torch.Tensor, step, layers, placement, final_norm: torch.Tensor, cfg) -> torch.Tensor:
    """The model's body on hidden states x: every layer's ``layers.block_forward`` with this step's cache (``step``,
    a ``cache.CacheStep``) and the layer's strategies (``placement(layer)``), then the final norm."""
    for i, layer in enumerate(layers):
        x = block_forward(x, placement(layer), step.at(i))
    return norm(x, final_norm, cfg)


class Engine:
    """Base class. Subclasses set ``cfg``, ``comm`` (the ranks the cache is split over), ``device``, ``dtype``,
    ``norm`` (the final norm's weight), ``vocab_comm``, ``vocab_start``, ``kv_layout`` and implement ``start``,
    ``prefill_chunk``, ``decode`` and ``head``."""

    scheme = "?"
    kv_layout = "sequence"  # kv_layouts.py: how this engine's KV cache is split over the ranks
    vocab_comm: AxisComm
    vocab_start = 0

    def __init__(self):
        self.cache = None
        self.schedule = {"prefill": self.scheme, "decode": self.scheme}

    # -- what generate needs to know -------------------------------------------------

    @property
    def token_multiple(self) -> int:
        """Prefill chunks must hold a multiple of this many tokens (2D for the zigzag layout)."""
        return 1

    @property
    def kv_token_ranks(self) -> int:
        """Over how many ranks each sequence's cached tokens are split (``kv_layouts.kv_token_ranks``)."""
        return kv_token_ranks(self.kv_layout, self.cfg.n_kv_heads, self.comm.size)

    @property
    def kv_member(self) -> int:
        """Which of the ``kv_token_ranks`` ranks sharing a sequence's tokens this one is."""
        return KVPlacement(self.kv_token_ranks).member_of_rank(self.comm.rank)

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads this rank caches for each token it keeps (``kv_layouts.kv_heads_per_rank``)."""
        return kv_heads_per_rank(self.kv_layout, self.cfg.n_kv_heads, self.comm.size)

    def kv_pool(self, num_blocks: int, block_size: int, spare_slots: bool = False, grouped: bool = False) -> KVPool:
        """This rank's KV storage: ``num_blocks`` blocks of ``block_size`` slots (cache.py; ``spare_slots``: the
        spare place is one more slot per block, for blocks that are whole sequences). ``grouped`` (a server's
        paged pool): the model's block groups (``kv_layouts.KVGroups``) share the ``num_blocks`` pages."""
        cfg = self.cfg
        return KVPool(cfg.n_layers, num_blocks, self.kv_heads_per_rank, cfg.head_dim, self.dtype, self.device,
                      KVPlacement(self.kv_token_ranks, block_size), self.kv_member, spare_slots,
                      KVGroups.of(cfg) if grouped else None)

    def batch_rows(self, batch: int) -> slice:
        """The rows of the global batch this rank decodes (DP splits them)."""
        return slice(0, batch)

    @property
    def kv_cache_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes

    def choose_schedule(self, schedule: str, batch: int, prefill_tokens: int) -> None:
        """TSP picks weights-move or activations-move per phase; the other schemes have one schedule each."""

    # -- steps ------------------------------------------------------------------------

    def run_blocks(self, x: torch.Tensor, step, layers, placement) -> torch.Tensor:
        return run_blocks(x, step, layers, placement, self.norm, self.cfg)

    def start(self, batch: int, prompt_len: int, max_new_tokens: int) -> None:
        """A cache for ``generate``: ``batch`` sequences of a (padded) prompt and ``max_new_tokens``, one block each
        (the last chosen token is never fed back, so it takes no slot)."""
        tokens = prompt_len + max_new_tokens - 1
        pool = self.kv_pool(batch, max(1, -(-tokens // self.kv_token_ranks)), spare_slots=True)
        with on_host():  # block tables and lengths are host data (real in a fake-tensor trace too)
            tables, lengths = torch.arange(batch).unsqueeze(1), torch.zeros(batch, dtype=torch.long)
        self.cache = pool.rows(tables, lengths)

    def attach_cache(self, cache) -> None:
        """Run the next steps on ``cache`` (a server's sequences, ``KVPool.rows``; they may differ in length)."""
        self.cache = cache

    def prefill_chunk(self, ids, pos, valid, lengths, all_positions: list[int] | None = None):
        """Run one chunk of the prompts; return this rank's share of the last-real-token hidden states [B, h].
        With ``all_positions`` (batch rows): also the final-norm hidden states of every position of the chunk
        for those rows, replicated, in position order, ``(last, [len(rows), T, h])`` (prompt logprobs: echo)."""
        raise NotImplementedError

    def finish_last(self, last: torch.Tensor) -> torch.Tensor:
        """Combine the ranks' shares of the last hidden states (identity when every rank saw every token)."""
        return last

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [B, h] -> this rank's float32 logits slice [B, cols]."""
        raise NotImplementedError

    def decode(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Feed one token per sequence (ids, positions [B]); returns the logits slice of the next one."""
        raise NotImplementedError

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, chunk: int,
                host_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Prompts [B, S_pad] (right padded; S_pad a multiple of ``chunk``) -> logits slice at the last real tokens.
        ``host_lengths``: the prompt lengths on the host (then no step reads the device)."""
        B, S = tokens.shape
        if host_lengths is None and S > chunk and any(spec.rope.reads_length for spec in self.cfg.layer_specs):
            host_lengths = lengths.cpu()  # every chunk reads the whole prompt's RoPE table (``KVCache.rope_lengths``)
        last = torch.zeros(B, self.cfg.dim, dtype=self.dtype, device=self.device)
        for c0 in range(0, S, chunk):
            if host_lengths is not None:
                with on_host():
                    self.cache.expect(host_lengths.clamp(max=c0 + chunk), whole=host_lengths)
            pos = torch.arange(c0, c0 + chunk, device=self.device).expand(B, chunk)
            last += self.prefill_chunk(tokens[:, c0:c0 + chunk], pos, pos < lengths.unsqueeze(1), lengths)
        return self.head(self.finish_last(last))
