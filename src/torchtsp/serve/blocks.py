"""Rank 0's bookkeeping of the paged KV cache: the bytes of a block, the block pool with its LRU free queue,
per-sequence block tables and prefix caching (docs/design.md, "Serving: the paged cache"). Plain Python: the
ranks only ever see block ids, sent with each step's plan.

A block id names a *virtual* block of ``block_tokens`` consecutive tokens of one sequence (the engine's
``KVPool.block_tokens``, infer/cache.py, which also decides which rank stores which of them): under the
``grouped`` and ``sequence`` layouts the ranks that share a sequence's tokens each store ``block_size`` of
them under the same id, so one id covers ``block_size ×`` (those ranks) tokens; under ``heads`` every rank
stores all ``block_size`` tokens of its heads.
"""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Sequence


def bytes_per_block(n_layers: int, heads_per_rank: int, head_dim: int, dtype_bytes: int, block_size: int) -> int:
    """Bytes one block takes on one rank: K and V of ``block_size`` tokens, every layer."""
    return 2 * n_layers * heads_per_rank * head_dim * dtype_bytes * block_size


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
    block that still holds a full cached block keeps its hash until it is handed out again."""

    def __init__(self, total: int, enable_caching: bool = True):
        if total < 1:
            raise ValueError(f"the KV cache needs at least one block, got {total}: raise the cache budget")
        self.total, self.enable_caching = total, enable_caching
        self.ref = [0] * total
        self.hash: list[bytes | None] = [None] * total
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.free_queue: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(total))

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


class KVBlockManager:
    """Per-sequence block tables over one ``BlockPool``, with prefix caching of full blocks."""

    def __init__(self, total_blocks: int, block_tokens: int, enable_prefix_caching: bool = True):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.pool = BlockPool(total_blocks, enable_prefix_caching)
        self.block_tokens = block_tokens
        self.tables: dict[int, list[int]] = {}
        self.slots: dict[int, int] = {}  # tokens each sequence has slots for
        # Each sequence's hash chain (the caller's list when it gave one, so nothing is hashed twice) and how many
        # of its full blocks are registered in the prefix cache.
        self.hashes: dict[int, list[bytes]] = {}
        self.registered: dict[int, int] = {}
        self.prefix_queries = 0  # tokens looked up (prompts of new or recomputed sequences)
        self.prefix_hits = 0  # of them, tokens found cached

    @property
    def capacity_tokens(self) -> int:
        return self.pool.total * self.block_tokens

    @property
    def usage(self) -> float:
        """Share of blocks held by sequences (0-1); cached free blocks count as free."""
        return 1 - self.pool.num_free / self.pool.total

    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_tokens)

    def fits_ever(self, n_tokens: int) -> bool:
        """Whether a sequence of ``n_tokens`` fits the whole pool, alone."""
        return self.blocks_for(n_tokens) <= self.pool.total

    def cached_prefix(self, tokens: Sequence[int], chain: list[bytes] | None = None) -> list[int]:
        """Blocks of the longest cached prefix of ``tokens`` made of full blocks, leaving at least the last
        token to compute (its logits give the next token). ``chain``: its content addresses hashed so far
        (``extend_chain``; extended here as far as needed)."""
        n = (len(tokens) - 1) // self.block_tokens
        blocks = []
        for digest in extend_chain([] if chain is None else chain, tokens, self.block_tokens, n)[:n]:
            block = self.pool.lookup(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate(self, seq: int, tokens: Sequence[int], n_tokens: int, use_cache: bool = True,
                 chain: list[bytes] | None = None) -> int | None:
        """Start ``seq`` (prompt ``tokens``, ``chain`` its content addresses if hashed already) with slots for its
        first ``n_tokens`` past its cached prefix (none without ``use_cache``); returns how many tokens the cache
        already holds, or None (nothing changed) when blocks are short."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq} already has blocks")
        hit = self.cached_prefix(tokens, chain) if use_cache else []
        cached = len(hit) * self.block_tokens
        need = self.blocks_for(cached + n_tokens) - len(hit)
        if need + sum(self.pool.ref[b] == 0 for b in hit) > self.pool.num_free:
            return None
        self.pool.share(hit)
        self.tables[seq] = hit + self.pool.take(need)
        self.slots[seq] = cached + n_tokens
        self.hashes[seq] = [] if chain is None else chain
        self.registered[seq] = len(hit)
        self.prefix_queries += len(tokens)
        self.prefix_hits += cached
        return cached

    def append_slots(self, seq: int, n: int) -> bool:
        """Slots for ``n`` more tokens of ``seq``, growing its table by whole blocks; False (nothing changed)
        when the pool is short."""
        table = self.tables[seq]
        need = self.blocks_for(self.slots[seq] + n) - len(table)
        if need > self.pool.num_free:
            return False
        table += self.pool.take(max(need, 0))
        self.slots[seq] += n
        return True

    def cache_blocks(self, seq: int, tokens: Sequence[int], num_computed: int) -> None:
        """Register the full blocks among the first ``num_computed`` tokens of ``seq`` (their K/V are now
        written), extending its hash chain."""
        chain, table, full = self.hashes[seq], self.tables[seq], num_computed // self.block_tokens
        extend_chain(chain, tokens, self.block_tokens, full)
        for i in range(self.registered[seq], full):
            self.pool.register(table[i], chain[i])
        self.registered[seq] = max(self.registered[seq], full)

    def free(self, seq: int) -> None:
        """Drop ``seq``'s blocks (no-op for one without blocks). Its tail goes first into the free queue, so
        under pressure a prefix's last blocks are evicted before the blocks other prompts share."""
        table = self.tables.pop(seq, None)
        if table is None:
            return
        del self.slots[seq], self.hashes[seq], self.registered[seq]
        self.pool.release(table[::-1])
