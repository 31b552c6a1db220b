"""The KV cache of one rank as a pool of blocks, attention against it, and the exact merge of per-rank partial
attention.

**Storage.** Per layer K and V are a pool of ``num_blocks`` blocks [heads, block_size, d] (``KVPool``), plus
a spare place where tokens this rank does not keep are written and never read: one more block in a server's
pool, one more slot per block in ``generate``'s (its blocks are whole sequences: a spare block would be one
more sequence). A sequence owns a block table; its token at position p lives at a place fixed by p alone
(docs/design.md, "Paged cache"), by the rule ``kv_layouts.KVPlacement`` writes once: with its tokens split over
R ranks (``kv_layouts.kv_token_ranks``: 1 for a head-sharded cache, D for TSP's sequence layout and SP, c for
the grouped one), p is kept by member ``p mod R``, in block ``table[p // (R·bs)]`` at slot
``(p mod R·bs) // R``. A chunk may start anywhere. Which rank computes a token (a zigzag share, a replicated
step) is the engine's business; it writes every token it has to ``reserve``'s slots and the tokens it does not
keep land in the spare slot.

**Reading.** ``KVCache`` is the view an engine runs on: the step's block tables [B, n] and each sequence's
cached length. Keys are gathered from the sequences' blocks (never the whole pool) with their positions,
which the rule gives without storing them; slots past a sequence's length are masked.

``generate`` gives each sequence one block of its whole length; the server (``torchtsp.serve``) deals blocks
from rank 0's block manager and sends the tables with every step.

**Block groups.** A server's pool of a hybrid model (sliding-window and full layers) is one pool of pages shared
by its block groups (``kv_layouts.KVGroups``: groups of equal layer count, so that every group's block is one page):
a sequence has a table per group, [G, B, n], over the same placement, and a page belongs to one group at a time.
Slots are per group ([G, B, T]); a layer writes and reads through its group's, in its slot's tensor. A sliding
group's table points entries that left the window at the null page (never written: zeros), at positions the
window masks; a masked key's weight is exactly 0, so those zeros add nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..host import on_host
from ..kv_layouts import KVGroups, KVPlacement
from ..layer_kinds import AttentionKind
from ..layers import apply_sinks, attend, layer_rope, positions_mask, with_sink

MERGE_BY_GATHER_MAX_TOKENS = 64  # merge_partials: up to this many (tokens x ranks), one packed all-gather
FAR = torch.iinfo(torch.long).max  # the position of an empty slot: after every query, so never attended


@dataclass(frozen=True)
class CacheStep:
    """The ``cache`` argument an engine gives ``layers.block_forward``: its KV cache view, the layer, the slots this
    step's tokens are written to (``KVCache.reserve``), their positions [B, T] and the layer's RoPE tables and
    attention kind (``tables`` and ``kinds``: every layer's, which ``at`` picks from)."""

    cache: KVCache
    slots: torch.Tensor
    pos: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    layer: int = 0
    kind: AttentionKind = AttentionKind()
    tables: tuple = ()
    kinds: tuple = ()

    @classmethod
    def of(cls, cfg, cache: KVCache, slots: torch.Tensor, pos: torch.Tensor) -> CacheStep:
        """The step of tokens at ``pos`` of a model ``cfg``, at layer 0. A context-dependent RoPE table reads each
        sequence's ``KVCache.rope_lengths`` (docs/inference.md)."""
        with on_host():  # the driver's host values, real in a fake-tensor trace too
            lengths = cache.rope_lengths.unsqueeze(1)
        tables = tuple(layer_rope(pos, cfg, lengths))
        kinds = tuple(spec.attention for spec in cfg.layer_specs)
        return cls(cache, slots, pos, *tables[0], 0, kinds[0], tables, kinds)

    def at(self, layer: int) -> CacheStep:
        if not self.tables:
            return replace(self, layer=layer)
        return replace(self, layer=layer, cos=self.tables[layer][0], sin=self.tables[layer][1],
                       kind=self.kinds[layer])

    def masked(self, mask):
        """``mask`` (the step's keys, the same in every layer) as this layer's kind sees it: a sliding layer's decode
        never sees the keys that left its window (the cache keeps them for now)."""
        return self.kind.restrict(mask)

    def write(self, k: torch.Tensor, v: torch.Tensor, heads: slice = slice(None)) -> None:
        """Store this step's k, v [B, h, T, d] (of ``heads``) in its slots of this layer."""
        self.cache.write(self.layer, self.slots, k, v, heads)

    def attend(self, q: torch.Tensor, mask=None):
        """(out, lse) of queries q [B, Hq, T, d] against this rank's cache of this layer; ``mask``: the keys' mask
        if already built, else that of this step's positions against the cached ones."""
        k, v = self.cache.keys(self.layer)
        return attend(q, k, v, self.masked(self.cache.mask(self.pos) if mask is None else mask))


class KVPool:
    """One rank's K/V storage: ``num_blocks`` blocks (+ 1: a spare block) of [heads, block_size (+ 1: a spare slot),
    d] per layer. Head-major inside a block, so a sequence that is one block (``generate``) is read as [heads,
    tokens, d] matrices with no copy, as the attention kernel's batched products want them.

    ``groups`` (a server's pool of a hybrid model, ``kv_layouts.KVGroups``): the blocks are *pages* shared by every
    group, each of ``groups.group_size`` layers' K and V; the storage is ``group_size`` K and V tensors of
    [num_blocks (+ 1), heads, stride, d], and layer i reads and writes tensor ``groups.layer_slot[i]`` at the pages
    of its group's table (rank 0's one block pool hands each page to one group at a time, so the groups never
    collide). ``k[i]`` and ``v[i]`` are layer i's tensors (shared with the other layers of its slot). Without
    ``groups`` every layer is in one group: a tensor per layer, as in ``generate``."""

    def __init__(self, n_layers: int, num_blocks: int, heads: int, head_dim: int, dtype, device,
                 placement: KVPlacement, member: int = 0, spare_slots: bool = False, groups: KVGroups | None = None):
        block_size = placement.block_size
        groups = groups or KVGroups((0,) * n_layers, (None,))
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of at least one slot, got {num_blocks} blocks of "
                             f"{block_size}: raise the cache budget")
        # Slots per stored block: block_size, and with ``spare_slots`` one more that no position maps to.
        self.stride = block_size + int(spare_slots)
        self.groups, self.layer_group = groups, groups.layer_group
        shape = (num_blocks + int(not spare_slots), heads, self.stride, head_dim)
        self.k_slots = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(groups.group_size)]
        self.v_slots = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(groups.group_size)]
        self.k = [self.k_slots[s] for s in groups.layer_slot]
        self.v = [self.v_slots[s] for s in groups.layer_slot]
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device
        self.placement, self.member = placement, member  # the rule, and which of the R ranks sharing tokens this is
        # The spare place as a slot number (block · stride + offset): block 0's extra slot, or the extra block.
        self.spare = block_size if spare_slots else num_blocks * self.stride

    @property
    def block_tokens(self) -> int:
        """Tokens of a sequence one block id covers (each of the R members stores block_size of them)."""
        return self.placement.block_tokens

    @property
    def nbytes(self) -> int:
        """Bytes of K and V the blocks hold for tokens (every layer; the spare place not counted)."""
        return sum(t[0, :, 0].numel() * t.element_size() * self.num_blocks * self.block_size
                   for t in (*self.k_slots, *self.v_slots))

    def rows(self, tables: torch.Tensor, lengths: torch.Tensor) -> KVCache:
        """The view of the sequences with block tables ``tables`` ([G, B, n], one per group; [B, n] with one group)
        that hold ``lengths`` [B] tokens so far (host tensors: the driver knows them)."""
        with on_host():  # host values, real in a fake-tensor trace too
            tables, lengths = tables.cpu(), lengths.cpu()
        return KVCache(self, tables, lengths)


class KVCache:
    """The sequences one engine step runs on: their block tables and cached lengths over a ``KVPool``.

    Shapes (how many slots to read) come from the lengths, which the host knows: the driver of the steps
    (``generate``, the server's runner) says what they will be after each step (``expect``), so a step never
    reads the device; without it ``reserve`` reads them back (tests, benchmarks driving an engine directly).

    ``rope_lengths`` [B] (host): the length each sequence's step reads its RoPE table at, where the table depends
    on it (dynamic NTK, LongRoPE): its length once the forward's tokens are in, as transformers reads
    max(position_ids) + 1 of that forward; the whole prompt's for every chunk of a prefill (``expect``'s
    ``whole``), as one forward of the prompt reads it."""

    def __init__(self, pool: KVPool, tables: torch.Tensor, lengths: torch.Tensor):
        self.pool = pool
        if tables.dim() == 2:  # one group
            with on_host():  # the tables and lengths are the driver's host values, real in a fake-tensor trace too
                tables = tables.unsqueeze(0)  # [G, B, n]
        if tables.shape[0] != len(pool.groups.windows):
            raise ValueError(f"{tables.shape[0]} block tables per sequence for a pool of {len(pool.groups.windows)} "
                             f"groups; rank 0's block manager and the ranks disagree")
        # Under the caller's mode: a trace's CPU pool keeps the host tensors, a (fake) GPU's gets copies.
        self.tables, self.lengths = tables.to(pool.device), lengths.to(pool.device)
        with on_host():
            self.host_lengths = lengths.clone()
            # Sequence b in block b alone (``Engine.start``): its slots are one stretch of the pool, read as a view.
            self.one_block_each = tables.shape[0] == 1 and tables.shape[2] == 1 and bool(
                (tables[0, :, 0] == torch.arange(tables.shape[1])).all())
        self.before, self.host_before = self.lengths, self.host_lengths  # before this step's tokens (``reserve``)
        self._next: torch.Tensor | None = None  # host lengths after the next step (``expect``)
        self._whole: torch.Tensor | None = None  # host lengths once the next step's prefill is whole (``expect``)
        self.rope_lengths = self.host_lengths
        self._index = {}  # (before?, member) -> (key positions [B, S], valid [B, S])
        self.capacity = tables.shape[2] * pool.block_tokens  # tokens each sequence's table covers

    def expect(self, lengths, whole=None) -> None:
        """The sequences' lengths after the next step's tokens (host values; ``reserve`` then reads none back), and
        with ``whole`` their lengths once the prefill this step is a chunk of is done (``rope_lengths``)."""
        self._next = torch.as_tensor(lengths, dtype=torch.long).cpu()
        self._whole = None if whole is None else torch.as_tensor(whole, dtype=torch.long).cpu()

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def reserve(self, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Take this step's tokens at ``pos`` [B, T] (``valid`` [B, T]; any order, any share of the step: every
        rank passes the positions of the tokens it will write) and return the pool slots to write them to; tokens
        this rank does not keep, and padding, go to the spare slot. Grows the lengths to cover the valid ones."""
        new = torch.where(valid, pos + 1, 0).amax(dim=1) if pos.shape[1] else torch.zeros_like(self.lengths)
        grown = torch.maximum(self.lengths, new)
        if self._next is None:
            host = grown.cpu()
        else:
            with on_host():
                host = torch.maximum(self.host_lengths, self._next)
        with on_host():
            longest = int(host.max()) if len(host) else 0
        if longest > self.capacity:
            raise ValueError(f"KV cache full: a sequence reaches {longest} tokens, its blocks hold {self.capacity}")
        self.before, self.host_before, self._index, self._next = self.lengths, self.host_lengths, {}, None
        self.lengths, self.host_lengths = grown, host
        self.rope_lengths, self._whole = (host if self._whole is None else self._whole), None
        return self.slots_of(pos, valid)

    def slots_of(self, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Pool slots [G, B, T] (block · stride + offset, in each group's blocks) of the tokens at ``pos`` that this
        rank keeps; the spare block's first slot for the others."""
        pool, rule = self.pool, self.pool.placement
        kept = valid & (rule.keeper(pos) == pool.member)
        pos = torch.where(kept, pos, 0)
        index, offset = rule.block_index(pos), rule.offset(pos)
        return torch.stack([torch.where(kept, table.gather(1, index) * pool.stride + offset, pool.spare)
                            for table in self.tables])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: slice = slice(None)):
        """Store k, v [B, h, T, d] of the given heads at ``slots`` ([G, B, T]: the layer's group's are used)."""
        stride, slots = self.pool.stride, slots[self.pool.layer_group[layer]]
        block, offset = slots.flatten() // stride, slots.flatten() % stride
        self.pool.k[layer][block, heads, offset] = k.transpose(1, 2).flatten(0, 1)
        self.pool.v[layer][block, heads, offset] = v.transpose(1, 2).flatten(0, 1)

    def _slots(self, before: bool, member: int | None = None):
        """(key positions [B, S], valid [B, S]) of the first S own slots of every sequence (its table's blocks in
        order), S covering the longest one's tokens (before this step's, or after). ``member``: the positions as
        another member of the R ranks sees its own slots (they are the same slots of the same blocks)."""
        key = (before, member)
        if key not in self._index:
            pool, lengths = self.pool, self.before if before else self.lengths
            with on_host():
                longest = int((self.host_before if before else self.host_lengths).max()) if len(lengths) else 0
            S = pool.placement.local_slot(longest - 1) + 1 if longest else 0
            positions = pool.placement.position(torch.arange(S, device=pool.device),
                                                pool.member if member is None else member)
            positions = positions.expand(len(lengths), S)
            self._index[key] = positions, positions < lengths.unsqueeze(1)
        return self._index[key]

    def keys(self, layer: int, heads: slice = slice(None), before: bool = False):
        """K and V [B, h, S, d] of ``heads`` in this rank's slots of the sequences: a view where each sequence is
        one block, else a copy of the sequences' blocks (never of the whole pool)."""
        B, S = self._slots(before)[0].shape
        bs = self.pool.block_size
        if self.one_block_each:
            return tuple(t[layer][:B, heads, :S] for t in (self.pool.k, self.pool.v))
        blocks = self.tables[self.pool.layer_group[layer], :, :-(-S // bs)]  # [B, n]: the blocks of the first S slots
        return tuple(t[layer][blocks][:, :, heads, :bs].transpose(1, 2).flatten(2, 3)[:, :, :S]
                     for t in (self.pool.k, self.pool.v))

    def key_positions(self, before: bool = False, member: int | None = None) -> torch.Tensor:
        """Positions [B, S] of ``keys``' slots, ``FAR`` where a slot holds no token (yet)."""
        positions, valid = self._slots(before, member)
        return torch.where(valid, positions, FAR)

    def mask(self, pos: torch.Tensor):
        """The mask of queries at ``pos`` [B, T] against this rank's keys (after this step's tokens)."""
        positions, valid = self._slots(False)
        return positions_mask(pos, positions, valid)


def merge_packed(parts: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The exact merge over dim 0 of partial attentions packed as [D, B, h, ..., d + 1]: (O_r, LSE_r) of each key
    set r, with the h heads' ``sinks`` (GPT-OSS) entering once, in the merged normaliser. A query no key set sees
    (every LSE -inf) gets zeros."""
    d = parts.shape[-1] - 1
    total = with_sink(torch.logsumexp(parts[..., d], dim=0), sinks)
    weight = torch.exp(parts[..., d] - torch.where(torch.isfinite(total), total, 0.0))
    return (parts[..., :d] * weight.unsqueeze(-1)).sum(dim=0)


def merge_partials(comm, out, lse, heads: slice | None = None, sinks: torch.Tensor | None = None):
    """Exact softmax merge of per-rank partial attention over disjoint key sets (flash-decoding).

    out [B, Hq, T, d] and lse [B, Hq, T] (float32) from ``attend`` on this rank's keys; the merged output
    of the query heads ``heads`` (all by default), [B, h, T, d] float32, on every rank.

    Few tokens (decode): one all-gather of (out, lse) packed together, merged locally: one collective
    instead of two, and collectives of a few kB cost their latency, not their bytes. Many tokens (an
    activations-move prefill chunk): the LSEs are all-gathered (small), each rank rescales its partial
    output by exp(lse_p - lse) and one reduce-scatter sums the head groups to their owners (``heads``
    must then be this rank's group), so no rank ever holds D partial outputs. ``sinks``: those of the heads
    ``heads`` (GPT-OSS), entering once, in the merged normaliser.
    """
    B, Hq, T, d = out.shape
    heads = heads or slice(0, Hq)
    if T * comm.size <= MERGE_BY_GATHER_MAX_TOKENS:
        # Every rank sends all heads (an all-gather, not an all-to-all); each keeps the heads it needs.
        parts = comm.all_gather(torch.cat([out, lse.unsqueeze(-1)], dim=-1),
                                label="infer.attention.merge")[:, :, heads]  # [D, B, h, T, d + 1]
        return merge_packed(parts, sinks)
    lse_all = torch.logsumexp(comm.all_gather(lse, label="infer.attention.lse"), dim=0)
    scaled = out * torch.exp(lse - torch.where(torch.isfinite(lse_all), lse_all, 0.0)).unsqueeze(-1)
    if heads == slice(0, Hq):
        merged = comm.all_reduce(scaled, label="infer.attention.merge")
    else:
        per_group = scaled.view(B, comm.size, Hq // comm.size, T, d).movedim(1, 0).contiguous()
        merged = comm.reduce_scatter(per_group, label="infer.attention.merge")
    return merged if sinks is None else apply_sinks(merged, lse_all[:, heads], sinks)[0]


def gathered_positions(comm, pos: torch.Tensor, valid: torch.Tensor, label: str) -> torch.Tensor:
    """Every rank's ``pos`` [B, T] (``FAR`` where not ``valid``), rank-major [B, D·T], as ``all_gather`` lays out the
    ranks' tokens."""
    return comm.all_gather(torch.where(valid, pos, FAR), label=label).movedim(0, 1).flatten(1)


class SequenceShardedPrefill:
    """A prefill chunk whose tokens are split over the ranks (each rank its zigzag share) against a cache split
    the same way (TSP's sequence layout, SP): per layer (and KV head group) ONE all-gather brings every rank's
    earlier slots and its share of the chunk's K/V; each rank keeps the chunk tokens the cache rule gives it.
    Rank r is member r mod R of the cache (R = D here), which gives its earlier slots' positions."""

    def __init__(self, comm, cache: KVCache, pos: torch.Tensor, valid: torch.Tensor, label: str):
        self.comm, self.cache = comm, cache
        chunk_pos = gathered_positions(comm, pos, valid, label + ".positions")  # [B, D·T]
        self.slots = cache.reserve(chunk_pos, chunk_pos != FAR)
        earlier = [cache.key_positions(before=True, member=cache.pool.placement.member_of_rank(r))
                   for r in range(comm.size)]
        key_pos = torch.cat([*earlier, chunk_pos], dim=1)
        self.mask = positions_mask(pos, key_pos, torch.ones_like(key_pos, dtype=torch.bool))
        self.earlier_slots = earlier[0].shape[1]
        self.label = label

    def keys(self, layer: int, k: torch.Tensor, v: torch.Tensor, heads: slice = slice(None)) -> torch.Tensor:
        """This rank's share k, v [B, h, T, d] of ``heads`` -> every rank's earlier keys then every rank's share of
        the chunk, [2, B, h, D·(S + T), d] in the order of ``mask``; this rank's kept chunk tokens are stored."""
        mine = torch.stack([k, v])
        if self.earlier_slots:
            mine = torch.cat([torch.stack(self.cache.keys(layer, heads, before=True)), mine], dim=3)
        every = self.comm.all_gather(mine, label=self.label)  # [D, 2, B, h, S + T, d]
        S = self.earlier_slots
        chunk = every[:, :, :, :, S:].permute(1, 2, 3, 0, 4, 5).flatten(3, 4)  # [2, B, h, D·T, d]
        self.cache.write(layer, self.slots, chunk[0], chunk[1], heads)
        if not S:
            return chunk
        earlier = every[:, :, :, :, :S].permute(1, 2, 3, 0, 4, 5).flatten(3, 4)
        return torch.cat([earlier, chunk], dim=3)
