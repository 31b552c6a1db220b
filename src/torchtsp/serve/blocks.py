"""Rank 0's bookkeeping of the paged KV cache: the block pool with its LRU free queue,
per-sequence block tables and prefix caching (docs/design.md, "Serving: the paged cache"); the page arithmetic
(a block's bytes, the blocks a window spans) is kv_layouts.py's. Plain Python: the ranks only ever see block ids,
sent with each step's plan.

A block id names a *virtual* block of ``block_tokens`` consecutive tokens of one sequence (the engine's
``KVPool.block_tokens``, infer/cache.py, which also decides which rank stores which of them): under the
``grouped`` and ``sequence`` layouts the ranks that share a sequence's tokens each store ``block_size`` of
them under the same id, so one id covers ``block_size ×`` (those ranks) tokens; under ``heads`` every rank
stores all ``block_size`` tokens of its heads.

**Block groups** (a hybrid model: sliding-window and full layers). The layers are split into groups of equal layer
count (``kv_layouts.KVGroups``), each a full or a sliding group with its own per-sequence tables over the same
positions (``KVPlacement``), so a block of any group takes the same bytes: a *page*. One ``BlockPool`` of pages
serves every group, each taking pages on demand: no share of the budget is fixed per group ahead of the traffic
(docs/design.md, "the paged cache of a hybrid model"). A full group keeps every block of a sequence; a sliding group
of window W gives a block back to the shared pool once no query still to come sees any of its tokens
(``first_needed_block``), its entry in the table then pointing at the null page (id 0, never handed out, never
written: the mask hides every position it stands for). A model without sliding layers has one full group, exactly
the cache of before.
"""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Hashable, Sequence

# The page arithmetic lives below serve/, where the memory model reads it too.
from ..kv_layouts import first_needed_block, max_blocks_spanned

NULL_BLOCK = 0  # a sliding group's stand-in for a block that left the window: never handed out, never written


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
    block that still holds a full cached block keeps its key until it is handed out again. With ``null_block``
    (a pool with sliding groups) id ``NULL_BLOCK`` is set aside, never handed out: ``total`` counts the others.
    The prefix cache's keys: (block group, content address), since the groups share the pool."""

    def __init__(self, total: int, enable_caching: bool = True, null_block: bool = False):
        if total < 1:
            raise ValueError(f"the KV cache needs at least one block, got {total}: raise the cache budget")
        self.total, self.enable_caching = total, enable_caching
        first = int(null_block)  # with a null block, ids are 1 .. total (the pool stores total + 1)
        self.ref = [0] * (total + first)
        self.hash: list[Hashable | None] = [None] * (total + first)
        self.cached: dict[Hashable, int] = {}  # key -> block id
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

    def lookup(self, digest: Hashable) -> int | None:
        return self.cached.get(digest) if self.enable_caching else None

    def register(self, block: int, digest: Hashable) -> None:
        """Record a full block's content address. A block whose content is already cached under another id
        (two sequences computed the same prefix at once) stays unregistered and is freed like any other."""
        if self.enable_caching and digest not in self.cached and self.hash[block] is None:
            self.cached[digest] = block
            self.hash[block] = digest


class BlockGroup:
    """One group's per-sequence tables (``window`` None: full attention, every block kept). Its blocks are pages of
    the manager's shared pool; its prefix-cache keys are (``index``, content address), so the groups' copies of a
    block never answer for each other."""

    def __init__(self, index: int, window: int | None):
        self.index, self.window = index, window
        self.tables: dict[int, list[int]] = {}

    def key(self, digest: bytes) -> tuple[int, bytes]:
        return self.index, digest

    def holds(self, block: int) -> bool:
        """Whether a table entry is a page of the group's (a sliding group's null entries are not)."""
        return block != NULL_BLOCK or self.window is None

    def live(self, table: list[int]) -> list[int]:
        return [b for b in table if self.holds(b)]


class KVBlockManager:
    """Per-sequence block tables of every block group over ONE ``BlockPool`` of pages, with prefix caching of full
    blocks.

    ``num_blocks``: the pool's pages (with a sliding group, the null page among them); ``windows``: each group's
    window (None: full attention; by default one full group, a model without sliding layers). Every group takes
    pages from the shared pool as its sequences need them, so a sequence's need is the sum over the groups.
    ``tables`` are the first group's (a full one when there is one)."""

    def __init__(self, num_blocks: int, block_tokens: int, enable_prefix_caching: bool = True,
                 windows: Sequence[int | None] = (None,)):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        if not windows:
            raise ValueError("a KV block manager needs at least one block group")
        sliding = any(w is not None for w in windows)
        if sliding and num_blocks < 2:
            raise ValueError(f"a pool with sliding groups needs its null page and at least one more, got {num_blocks} "
                             f"pages: raise the cache budget")
        self.pool = BlockPool(num_blocks - sliding, enable_prefix_caching, null_block=sliding)
        self.groups = [BlockGroup(i, w) for i, w in enumerate(windows)]
        self.block_tokens = block_tokens
        self.slots: dict[int, int] = {}  # tokens each sequence has slots for
        # Each sequence's hash chain (the caller's list when it gave one, so nothing is hashed twice) and how many
        # of its full blocks are registered in the prefix cache.
        self.hashes: dict[int, list[bytes]] = {}
        self.registered: dict[int, int] = {}
        self.prefix_queries = 0  # tokens looked up (prompts of new or recomputed sequences)
        self.prefix_hits = 0  # of them, tokens found cached

    @property
    def tables(self) -> dict[int, list[int]]:
        return self.groups[0].tables

    def group_tables(self, seq: int) -> list[list[int]]:
        """``seq``'s table in every group, in group order (what a step plan carries)."""
        return [list(g.tables[seq]) for g in self.groups]

    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_tokens)

    def pages_alone(self, n_tokens: int, chunk: int = 1) -> int:
        """The most pages a sequence of at most ``n_tokens`` positions holds, summed over the groups, during a step
        of at most ``chunk`` tokens (after ``free_out_of_window``, as the scheduler runs it): a full group every
        block; a sliding group the blocks of the chunk's positions and the window before them (c - W + 1 ..
        c + chunk - 1: ``max_blocks_spanned(chunk + W - 1)``), never more than the sequence's. With ``chunk`` 1
        this is a decoding sequence's need (``sequence_blocks`` in each group)."""
        blocks = self.blocks_for(n_tokens)
        return sum(blocks if g.window is None else min(blocks, max_blocks_spanned(chunk + g.window - 1,
                                                                                 self.block_tokens))
                   for g in self.groups)

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence the pool holds alone (``fits_ever``), in whole blocks: each full group's blocks and
        each sliding group's window share the pages. A model of sliding layers only holds any length that its
        windows fit; its figure is then the pool's pages spread over its groups, in tokens."""
        if all(g.window is not None for g in self.groups):
            return self.pool.total // len(self.groups) * self.block_tokens
        blocks = _largest(lambda b: self.pages_alone(b * self.block_tokens) <= self.pool.total, 0, self.pool.total)
        return blocks * self.block_tokens

    @property
    def usage(self) -> float:
        """Share of the pool's pages held by sequences (0-1), every group's together; cached free pages count as
        free."""
        return 1 - self.pool.num_free / self.pool.total

    def max_chunk_tokens(self, n_tokens: int) -> int | None:
        """The most tokens one step of a sequence of ``n_tokens`` positions (or fewer) may compute so that it fits
        the whole pool alone (``pages_alone``); 0 when even a decode does not; None without a sliding group, where
        any chunk of a sequence that fits ever fits."""
        if all(g.window is None for g in self.groups):
            return None
        if not self.fits_ever(n_tokens):
            return 0
        return _largest(lambda c: self.pages_alone(n_tokens, c) <= self.pool.total, 1, max(n_tokens, 1))

    def fits_ever(self, n_tokens: int) -> bool:
        """Whether a sequence of ``n_tokens`` fits the whole pool alone: every block in each full group and its
        window in each sliding group (computed in steps of at most ``max_chunk_tokens``, at least one)."""
        return self.pages_alone(n_tokens) <= self.pool.total

    def _hit_blocks(self, tokens: Sequence[int], chain: list[bytes] | None) -> tuple[int, list[list[int]]]:
        """(k, each group's table of the hit): the longest prefix of k full blocks, leaving at least the last token to
        compute, that every full group holds entirely and every sliding group holds from the first block a query
        at k·block_tokens still sees (the entries before it are the null page). The content addresses are the
        same in every group; each group looks up its own copy (``BlockGroup.key``)."""
        n = (len(tokens) - 1) // self.block_tokens
        chain = extend_chain([] if chain is None else chain, tokens, self.block_tokens, n)[:n]
        found = [[self.pool.lookup(g.key(digest)) for digest in chain] for g in self.groups]
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
        tokens the cache already holds, or None (nothing changed) when the pool is short of pages for all groups
        together (their new blocks, and the free cached pages their hit takes back)."""
        if seq in self.slots:
            raise ValueError(f"sequence {seq} already has blocks")
        k, hits = self._hit_blocks(tokens, chain) if use_cache else (0, [[] for _ in self.groups])
        cached = k * self.block_tokens
        need = self.blocks_for(cached + n_tokens) - k
        revived = sum(self.pool.ref[b] == 0 for g, hit in zip(self.groups, hits) for b in g.live(hit))
        if len(self.groups) * need + revived > self.pool.num_free:
            return None
        for g, hit in zip(self.groups, hits):
            self.pool.share(g.live(hit))
            g.tables[seq] = hit + self.pool.take(need)
        self.slots[seq] = cached + n_tokens
        self.hashes[seq] = [] if chain is None else chain
        self.registered[seq] = k
        self.prefix_queries += len(tokens)
        self.prefix_hits += cached
        return cached

    def free_out_of_window(self, seq: int, next_pos: int) -> int:
        """Give back to the shared pool the blocks of ``seq`` that no query at ``next_pos`` or later sees, in each
        sliding group (their entries become the null page); returns how many. Full blocks among them stay cached
        (evictable), for any group to reuse the page once evicted."""
        freed = 0
        for g in self.groups:
            if g.window is None:
                continue
            table = g.tables[seq]
            gone = [i for i in range(min(first_needed_block(next_pos, g.window, self.block_tokens), len(table)))
                    if table[i] != NULL_BLOCK]
            self.pool.release([table[i] for i in gone])
            for i in gone:
                table[i] = NULL_BLOCK
            freed += len(gone)
        return freed

    def append_slots(self, seq: int, n: int) -> bool:
        """Slots for ``n`` more tokens of ``seq``, growing its table in every group by whole blocks; False (nothing
        changed) when the pool is short of their pages."""
        need = max(0, self.blocks_for(self.slots[seq] + n) - len(self.groups[0].tables[seq]))
        if len(self.groups) * need > self.pool.num_free:
            return False
        for g in self.groups:
            g.tables[seq] += self.pool.take(need)
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
                if g.holds(table[i]):
                    self.pool.register(table[i], g.key(chain[i]))
        self.registered[seq] = max(self.registered[seq], full)

    def free(self, seq: int) -> None:
        """Drop ``seq``'s blocks (no-op for one without blocks). Its tail goes first into the free queue (position
        by position, every group's), so under pressure a prefix's last blocks are evicted before the blocks other
        prompts share."""
        if seq not in self.slots:
            return
        del self.slots[seq], self.hashes[seq], self.registered[seq]
        tables = [(g, g.tables.pop(seq)) for g in self.groups]
        self.pool.release([t[i] for i in reversed(range(len(tables[0][1]))) for g, t in tables if g.holds(t[i])])


def _largest(fits, low: int, high: int) -> int:
    """The largest n in low .. high with ``fits(n)`` (``fits`` true at ``low`` and monotone: true, then false)."""
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low
