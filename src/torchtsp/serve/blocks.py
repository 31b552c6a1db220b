"""Rank 0's bookkeeping of the paged KV cache: the bytes of a block, the block pool with its LRU free queue,
per-sequence block tables and prefix caching (docs/design.md, "Serving: the paged cache"). Plain Python: the
ranks only ever see block ids, sent with each step's plan.

A block id names a *virtual* block of ``block_tokens`` consecutive tokens of one sequence (the engine's
``KVPool.block_tokens``, infer/cache.py, which also decides which rank stores which of them): under the
``grouped`` and ``sequence`` layouts the ranks that share a sequence's tokens each store ``block_size`` of
them under the same id, so one id covers ``block_size ×`` (those ranks) tokens; under ``heads`` every rank
stores all ``block_size`` tokens of its heads.

**Block groups** (a hybrid model: sliding-window and full-attention layers). Each attention type is a group with
its own pool and per-sequence tables over the same positions (``KVPlacement``): a full group keeps every block of
a sequence; a sliding group of window W frees a block once no query still to come sees any of its tokens
(``first_needed_block``), its entry in the table then pointing at the group's null block (id 0, never handed out,
never written: the mask hides every position it stands for). A model without sliding layers has one full group,
exactly the cache of before.
"""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass


def bytes_per_block(n_layers: int, heads_per_rank: int, head_dim: int, dtype_bytes: int, block_size: int) -> int:
    """Bytes one block takes on one rank: K and V of ``block_size`` tokens, every layer."""
    return 2 * n_layers * heads_per_rank * head_dim * dtype_bytes * block_size


NULL_BLOCK = 0  # a sliding group's stand-in for a block that left the window: never handed out, never written


def first_needed_block(next_pos: int, window: int, block_tokens: int) -> int:
    """Index of the first block of a sequence that a query at ``next_pos`` or later can still see under a sliding
    window ``window`` (masks.py: a query at q sees keys q - window < k <= q, so the oldest visible key is
    next_pos - window + 1); every block before it is out of the window for good."""
    return max(0, next_pos - window + 1) // block_tokens


def max_blocks_spanned(n_positions: int, block_tokens: int) -> int:
    """The most blocks ``n_positions`` consecutive positions can touch (they may start anywhere in a block)."""
    return 0 if n_positions <= 0 else (n_positions + block_tokens - 2) // block_tokens + 1


def window_blocks(window: int, block_tokens: int) -> int:
    """The blocks one decoding sequence of a sliding group holds at most: its window of ``window`` positions, the
    query's own (the one being written) included, starting anywhere in a block."""
    return max_blocks_spanned(window, block_tokens)


def sequence_blocks(window: int | None, n_tokens: int, block_tokens: int) -> int:
    """Blocks a decoding sequence of ``n_tokens`` holds in a group: every one in a full group (``window`` None),
    at most its window's in a sliding one."""
    blocks = math.ceil(n_tokens / block_tokens)
    return blocks if window is None else min(blocks, window_blocks(window, block_tokens))


@dataclass(frozen=True)
class GroupSpec:
    """One block group: ``num_blocks`` stored blocks (a sliding group's include its null block) of the layers of
    one attention type; ``window`` None for full attention."""

    num_blocks: int
    window: int | None = None


def split_budget(budget_bytes: int, bytes_per_block_of: Sequence[int], windows: Sequence[int | None],
                 max_model_len: int, block_tokens: int, chunk_tokens: int | None = None) -> list[int]:
    """Blocks of each group (a sliding group's count includes its null block) from one budget of bytes.

    A sliding group first sets aside its null block and what one prefill chunk of ``chunk_tokens`` (default
    ``max_model_len``) needs beyond a decoding sequence's window (the chunk's positions and the window before
    them), so a sequence can always be brought in; the rest is shared in proportion to what one sequence of
    ``max_model_len`` tokens needs in each group once decoding, in bytes (a full group: every token; a sliding
    one: ``window_blocks``, at most the sequence's), so the groups fill up together as sequences of that length
    arrive. ``bytes_per_block_of``: a block's bytes in each group (its own layers only)."""
    seq_blocks = math.ceil(max_model_len / block_tokens)
    chunk = min(chunk_tokens or max_model_len, max_model_len)
    need = [sequence_blocks(w, max_model_len, block_tokens) for w in windows]
    aside = [0 if w is None else
             1 + max(0, min(seq_blocks, max_blocks_spanned(chunk + w - 1, block_tokens)) - need[g])
             for g, w in enumerate(windows)]
    rest = max(0, budget_bytes - sum(a * per for a, per in zip(aside, bytes_per_block_of)))
    total = sum(n * per for n, per in zip(need, bytes_per_block_of))
    return [a + int(rest * n * per / total) // per for a, n, per in zip(aside, need, bytes_per_block_of)]


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Content address of a full block: its tokens and, through ``parent``, every token before them."""
    h = hashlib.sha256(parent or b"\0")
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


def extend_chain(chain: list[bytes], tokens: Sequence[int], block_tokens: int,
                 n_blocks: int | None = None) -> list[bytes]:
    """``chain``, the content addresses of the first full blocks of ``tokens``, extended in place to ``n_blocks``
    (default: every full block): a growing token list is hashed once, block by block."""
    n_blocks = len(tokens) // block_tokens if n_blocks is None else n_blocks
    for i in range(len(chain), n_blocks):
        chain.append(block_hash(chain[-1] if chain else None, tokens[i * block_tokens:(i + 1) * block_tokens]))
    return chain


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    """``total`` blocks with reference counts. Free blocks wait in LRU order (evicted from the front); a free
    block that still holds a full cached block keeps its hash until it is handed out again. With ``null_block``
    (a sliding group's pool) id ``NULL_BLOCK`` is set aside, never handed out: ``total`` counts the others."""

    def __init__(self, total: int, enable_caching: bool = True, null_block: bool = False):
        if total < 1:
            raise ValueError(f"the KV cache needs at least one block, got {total}: raise the cache budget")
        self.total, self.enable_caching = total, enable_caching
        first = int(null_block)  # with a null block, ids are 1 .. total (the pool stores total + 1)
        self.ref = [0] * (total + first)
        self.hash: list[bytes | None] = [None] * (total + first)
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.free_queue: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(first, total + first))

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (cached ones included: they are evicted on demand)."""
        return len(self.free_queue)

    def take(self, n: int) -> list[int]:
        """``n`` fresh blocks (refcount 1), evicting the least recently freed cached ones first."""
        if n > len(self.free_queue):
            raise NoFreeBlocks(f"{n} blocks asked, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            if self.hash[block] is not None:
                del self.cached[self.hash[block]]
                self.hash[block] = None
            self.ref[block] = 1
            out.append(block)
        return out

    def share(self, blocks: Sequence[int]) -> None:
        """One more reference to each (cache hits): a free one leaves the free queue."""
        for block in blocks:
            if self.ref[block] == 0:
                del self.free_queue[block]
            self.ref[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """One reference less; blocks reaching 0 join the back of the free queue in the order given."""
        for block in blocks:
            if self.ref[block] < 1:
                raise RuntimeError(f"block {block} released more often than taken")
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free_queue[block] = None

    def lookup(self, digest: bytes) -> int | None:
        return self.cached.get(digest) if self.enable_caching else None

    def register(self, block: int, digest: bytes) -> None:
        """Record a full block's content address. A block whose content is already cached under another id
        (two sequences computed the same prefix at once) stays unregistered and is freed like any other."""
        if self.enable_caching and digest not in self.cached and self.hash[block] is None:
            self.cached[digest] = block
            self.hash[block] = digest


class BlockGroup:
    """One group's pool and per-sequence tables (``window`` None: full attention, every block kept)."""

    def __init__(self, spec: GroupSpec, enable_caching: bool):
        self.window = spec.window
        sliding = spec.window is not None
        self.pool = BlockPool(spec.num_blocks - sliding, enable_caching, null_block=sliding)
        self.tables: dict[int, list[int]] = {}

    def live(self, table: list[int]) -> list[int]:
        return [b for b in table if b != NULL_BLOCK or self.window is None]


class KVBlockManager:
    """Per-sequence block tables over one ``BlockPool`` per block group, with prefix caching of full blocks.

    ``groups``: a number of blocks (one full-attention group: a model without sliding layers), or a
    ``GroupSpec`` per group. ``pool`` and ``tables`` are the first group's (the full one when there is one)."""

    def __init__(self, groups: int | Sequence[GroupSpec], block_tokens: int, enable_prefix_caching: bool = True):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        specs = [GroupSpec(groups)] if isinstance(groups, int) else list(groups)
        for spec in specs:
            if spec.window is not None and spec.num_blocks < 2:
                raise ValueError(f"a sliding group needs its null block and at least one more, got {spec.num_blocks} "
                                 f"blocks: raise the cache budget")
        self.groups = [BlockGroup(spec, enable_prefix_caching) for spec in specs]
        self.block_tokens = block_tokens
        self.slots: dict[int, int] = {}  # tokens each sequence has slots for
        # Each sequence's hash chain (the caller's list when it gave one, so nothing is hashed twice) and how many
        # of its full blocks are registered in the prefix cache.
        self.hashes: dict[int, list[bytes]] = {}
        self.registered: dict[int, int] = {}
        self.prefix_queries = 0  # tokens looked up (prompts of new or recomputed sequences)
        self.prefix_hits = 0  # of them, tokens found cached

    @property
    def pool(self) -> BlockPool:
        return self.groups[0].pool

    @property
    def tables(self) -> dict[int, list[int]]:
        return self.groups[0].tables

    def group_tables(self, seq: int) -> list[list[int]]:
        """``seq``'s table in every group, in group order (what a step plan carries)."""
        return [list(g.tables[seq]) for g in self.groups]

    @property
    def capacity_tokens(self) -> int:
        """Tokens the cache holds: every token of a sequence is in each full group, so the smallest of those (a
        model of sliding layers only: its sliding group's blocks, in tokens)."""
        full = [g.pool.total for g in self.groups if g.window is None]
        return min(full or [g.pool.total for g in self.groups]) * self.block_tokens

    @property
    def usage(self) -> float:
        """Share of blocks held by sequences (0-1) in the fullest group; cached free blocks count as free."""
        return max(1 - g.pool.num_free / g.pool.total for g in self.groups)

    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_tokens)

    @property
    def max_chunk_tokens(self) -> int | None:
        """The most tokens one step of one sequence may compute so that it fits every sliding group alone: a chunk
        of n tokens at position c needs the blocks of positions c - W + 1 .. c + n - 1 (None: no sliding group)."""
        limits = [(g.pool.total - 1) * self.block_tokens - g.window + 2 for g in self.groups if g.window is not None]
        return min(limits) if limits else None

    def fits_ever(self, n_tokens: int) -> bool:
        """Whether a sequence of ``n_tokens`` fits the whole pool of every group, alone (a sliding group: in steps
        of at most ``max_chunk_tokens``, which must be at least one)."""
        chunk = self.max_chunk_tokens
        if chunk is not None and chunk < 1:
            return False
        return all(self.blocks_for(n_tokens) <= g.pool.total for g in self.groups if g.window is None)

    def _hit_blocks(self, tokens: Sequence[int], chain: list[bytes] | None) -> tuple[int, list[list[int]]]:
        """(k, each group's table of the hit): the longest prefix of k full blocks, leaving at least the last token to
        compute, that every full group holds entirely and every sliding group holds from the first block a query
        at k·block_tokens still sees (the entries before it are the null block). Content addresses are shared."""
        n = (len(tokens) - 1) // self.block_tokens
        chain = extend_chain([] if chain is None else chain, tokens, self.block_tokens, n)[:n]
        found = [[g.pool.lookup(digest) for digest in chain] for g in self.groups]
        for k in range(n, -1, -1):
            tables = []
            for g, blocks in zip(self.groups, found):
                first = 0 if g.window is None else first_needed_block(k * self.block_tokens, g.window,
                                                                      self.block_tokens)
                if any(b is None for b in blocks[first:k]):
                    break
                tables.append([NULL_BLOCK] * first + blocks[first:k])
            else:
                return k, tables
        raise AssertionError("k = 0 always fits")

    def cached_prefix(self, tokens: Sequence[int], chain: list[bytes] | None = None) -> list[int]:
        """The first group's blocks of the longest cached prefix of ``tokens`` made of full blocks (``_hit_blocks``),
        leaving at least the last token to compute (its logits give the next token). ``chain``: its content
        addresses hashed so far (``extend_chain``; extended here as far as needed)."""
        return self._hit_blocks(tokens, chain)[1][0]

    def allocate(self, seq: int, tokens: Sequence[int], n_tokens: int, use_cache: bool = True,
                 chain: list[bytes] | None = None) -> int | None:
        """Start ``seq`` (prompt ``tokens``, ``chain`` its content addresses if hashed already) with slots for its
        first ``n_tokens`` past its cached prefix (none without ``use_cache``), in every group; returns how many
        tokens the cache already holds, or None (nothing changed) when some group is short of blocks."""
        if seq in self.slots:
            raise ValueError(f"sequence {seq} already has blocks")
        k, hits = self._hit_blocks(tokens, chain) if use_cache else (0, [[] for _ in self.groups])
        cached = k * self.block_tokens
        need = self.blocks_for(cached + n_tokens) - k
        for g, hit in zip(self.groups, hits):
            if need + sum(g.pool.ref[b] == 0 for b in g.live(hit)) > g.pool.num_free:
                return None
        for g, hit in zip(self.groups, hits):
            g.pool.share(g.live(hit))
            g.tables[seq] = hit + g.pool.take(need)
        self.slots[seq] = cached + n_tokens
        self.hashes[seq] = [] if chain is None else chain
        self.registered[seq] = k
        self.prefix_queries += len(tokens)
        self.prefix_hits += cached
        return cached

    def free_out_of_window(self, seq: int, next_pos: int) -> int:
        """Give back the blocks of ``seq`` that no query at ``next_pos`` or later sees, in each sliding group (their
        entries become the null block); returns how many. Full blocks among them stay cached (evictable)."""
        freed = 0
        for g in self.groups:
            if g.window is None:
                continue
            table = g.tables[seq]
            gone = [i for i in range(min(first_needed_block(next_pos, g.window, self.block_tokens), len(table)))
                    if table[i] != NULL_BLOCK]
            g.pool.release([table[i] for i in gone])
            for i in gone:
                table[i] = NULL_BLOCK
            freed += len(gone)
        return freed

    def append_slots(self, seq: int, n: int) -> bool:
        """Slots for ``n`` more tokens of ``seq``, growing its tables by whole blocks; False (nothing changed)
        when some group's pool is short."""
        need = self.blocks_for(self.slots[seq] + n) - len(self.groups[0].tables[seq])
        if any(need > g.pool.num_free for g in self.groups):
            return False
        for g in self.groups:
            g.tables[seq] += g.pool.take(max(need, 0))
        self.slots[seq] += n
        return True

    def cache_blocks(self, seq: int, tokens: Sequence[int], num_computed: int) -> None:
        """Register the full blocks among the first ``num_computed`` tokens of ``seq`` (their K/V are now
        written) in every group, extending its hash chain."""
        chain, full = self.hashes[seq], num_computed // self.block_tokens
        extend_chain(chain, tokens, self.block_tokens, full)
        for g in self.groups:
            table = g.tables[seq]
            for i in range(self.registered[seq], full):
                if table[i] != NULL_BLOCK or g.window is None:
                    g.pool.register(table[i], chain[i])
        self.registered[seq] = max(self.registered[seq], full)

    def free(self, seq: int) -> None:
        """Drop ``seq``'s blocks (no-op for one without blocks). Its tail goes first into the free queue, so
        under pressure a prefix's last blocks are evicted before the blocks other prompts share."""
        if seq not in self.slots:
            return
        del self.slots[seq], self.hashes[seq], self.registered[seq]
        for g in self.groups:
            g.pool.release(g.live(g.tables.pop(seq))[::-1])
