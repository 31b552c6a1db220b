"""Which KV-cache layout an inference engine decodes with (docs/design.md, "Decode cache layouts"). Torch-free:
``plan`` and the CLI read it before any rank starts.

A scheme whose registry entry lists ``kv_layouts`` (TSP) chooses among them:

- ``heads`` (n_kv % D == 0): rank j caches every position of KV head group j, the group whose weights it holds;
  decode is TP's step on TSP's weight slices (two sums per layer).
- ``grouped`` (D % n_kv == 0, D > n_kv): the c = D / n_kv ranks that share one KV head cache its tokens
  interleaved; queries gather and partial attentions merge inside those groups.
- ``sequence`` (any n_kv, D): every rank caches all heads of its own 1/D of the tokens.

``auto`` picks the first of those the model allows, in that order. Every other scheme has one layout of its own
(``Scheme.own_kv_layout``: tp caches by heads, copied when n_kv < D; sp by sequence) and accepts only ``auto`` or
that one. The single-device reference holds the whole cache, which every layout is at D = 1: it accepts any.

**Where a token's K/V lives** is written here once, for the cache (infer/cache.py), the engines and the memory
model (analysis/infer_memory.py) alike: which KV heads rank j caches (``kv_heads_of_rank``), over how many ranks
a sequence's tokens are split (``kv_token_ranks``) and, for a position p, which of those ranks keeps it and in
which block and slot (``KVPlacement``). Only ``//`` and ``%``: the same code runs on ints and on tensors. So is
the paged cache's page arithmetic (a block's bytes, the blocks a sequence or a sliding window holds), which serve/
and the memory model both read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KV_LAYOUTS = ("auto", "heads", "grouped", "sequence")
# The --kv-layout flag's help (generate, serve, bench --mode infer, plan --mode infer).
KV_LAYOUT_HELP = ("tsp: how decode lays out the KV cache over the D ranks, for a model of n_kv KV heads: heads "
                  "(n_kv %% D == 0; each rank caches every token of its own KV heads and decodes as TP does), grouped "
                  "(D %% n_kv == 0, D > n_kv; the D/n_kv ranks sharing a KV head split its tokens), sequence (any; "
                  "each rank caches every head for 1/D of the tokens); auto picks heads, else grouped, else sequence "
                  "(default: auto)")
_RULES = {"heads": ("n_kv % D == 0", lambda n_kv, D: n_kv % D == 0),
          "grouped": ("D % n_kv == 0 with D > n_kv", lambda n_kv, D: D % n_kv == 0 and D > n_kv),
          "sequence": ("nothing", lambda n_kv, D: True)}


def _spec(scheme):
    from .schemes import get_scheme

    return get_scheme(scheme) if isinstance(scheme, str) else scheme


def has_kv_layouts(scheme) -> bool:
    """Whether ``scheme`` (a name or registry entry) chooses its decode cache layout (``kv_layout``)."""
    return bool(_spec(scheme).kv_layouts)


def allowed_kv_layouts(n_kv: int, ranks: int, scheme="tsp") -> tuple[str, ...]:
    """The layouts of ``scheme`` a model with ``n_kv`` KV heads allows on ``ranks`` ranks, in auto's order."""
    return tuple(name for name, _ in _spec(scheme).kv_layouts if _RULES[name][1](n_kv, ranks))


def resolve_kv_layout(requested: str, n_kv: int, ranks: int, scheme="tsp") -> str:
    """The layout ``requested`` means for this model and scheme (a name, a registry entry, or None for the
    single-device reference); ValueError (one line, naming n_kv and D) for one it does not allow."""
    if requested not in KV_LAYOUTS:
        raise ValueError(f"unknown kv_layout {requested!r}; choose one of: {', '.join(KV_LAYOUTS)}")
    if scheme is None:
        return "sequence" if requested == "auto" else requested
    spec = _spec(scheme)
    if not spec.kv_layouts:
        own = spec.own_kv_layout
        if requested not in ("auto", own):
            raise ValueError(f"kv_layout={requested!r} is a TSP layout; {spec.name} caches by {own} "
                             f"(use kv_layout='auto' or '{own}')")
        return own
    allowed = allowed_kv_layouts(n_kv, ranks, spec)
    if requested == "auto":
        return allowed[0]
    if requested not in allowed:
        raise ValueError(f"kv_layout={requested!r} needs {_RULES[requested][0]}, but the model has n_kv={n_kv} KV "
                         f"heads on D={ranks} ranks; use one of: {', '.join(('auto', *allowed))}")
    return requested


def layout_steps(scheme, layout: str) -> str:
    """The import path of the steps ``scheme``'s engine runs on cache layout ``layout`` (a resolved one of those
    its registry entry lists; the engine is composed of them, tsp.py)."""
    return dict(_spec(scheme).kv_layouts)[layout]


# ---------------------------------------------------------------- where a token's K/V lives


def kv_heads_of_rank(layout: str, n_kv: int, ranks: int, rank: int) -> range:
    """The KV heads rank ``rank`` of ``ranks`` caches under ``layout`` (a resolved one).

    ``heads`` and ``grouped``: the heads whose K/V its weights project (TSP's head group ``rank``, TP's slice):
    n_kv/D consecutive heads, or with n_kv < D the one head its c = D/n_kv neighbours share (copies under TP,
    a head split by tokens under grouped). ``sequence``: every head (its tokens are what is split)."""
    if layout == "sequence":
        return range(n_kv)
    per_rank = max(n_kv // ranks, 1)
    first = rank // max(ranks // n_kv, 1) * per_rank  # c consecutive ranks read one head when n_kv < D
    return range(first, first + per_rank)


def kv_heads_per_rank(layout: str, n_kv: int, ranks: int) -> int:
    """KV heads a rank caches for each token it keeps (every rank the same number)."""
    return len(kv_heads_of_rank(layout, n_kv, ranks, 0))


def kv_token_ranks(layout: str, n_kv: int, ranks: int) -> int:
    """Over how many ranks each sequence's cached tokens are split: 1 under ``heads`` (every rank keeps every
    token of its heads), c = D/n_kv under ``grouped`` (the ranks sharing a head), D under ``sequence``."""
    if layout == "sequence":
        return ranks
    if layout == "grouped":
        return ranks // n_kv
    return 1


@dataclass(frozen=True)
class KVPlacement:
    """Where position p of a sequence is cached, with ``token_ranks`` (R) ranks sharing its tokens and blocks of
    ``block_size`` (bs) slots per rank: on member p mod R of the R (rank r is member r mod R), in the block at
    index p // (R·bs) of the sequence's block table, at offset (p mod R·bs) // R in it. So a block id names a
    *virtual* block of R·bs consecutive tokens, each member storing bs of them under the same id, and a block's
    content depends only on the tokens before it (prefix caching may hand it to another sequence).

    Every method takes ints or integer tensors (``//`` and ``%`` only)."""

    token_ranks: int = 1
    block_size: int = 1

    @classmethod
    def of(cls, layout: str, n_kv: int, ranks: int, block_size: int = 1) -> KVPlacement:
        return cls(kv_token_ranks(layout, n_kv, ranks), block_size)

    @property
    def block_tokens(self) -> int:
        """Tokens of a sequence one block id covers."""
        return self.token_ranks * self.block_size

    def member_of_rank(self, rank):
        """Which of the R ranks sharing a sequence's tokens rank ``rank`` is."""
        return rank % self.token_ranks

    def keeper(self, pos):
        """The member that keeps position ``pos``."""
        return pos % self.token_ranks

    def block_index(self, pos):
        """Index into the sequence's block table of the block holding ``pos``."""
        return pos // self.block_tokens

    def offset(self, pos):
        """Slot of ``pos`` inside its block, on its keeper."""
        return pos % self.block_tokens // self.token_ranks

    def local_slot(self, pos):
        """Index of ``pos`` into its keeper's own slots of the sequence (its table's blocks in order, bs each)."""
        return self.block_index(pos) * self.block_size + self.offset(pos)

    def position(self, local_slot, member):
        """The inverse of (``keeper``, ``local_slot``): the position member ``member`` keeps in that slot."""
        bs = self.block_size
        return local_slot // bs * self.block_tokens + local_slot % bs * self.token_ranks + member

    def tokens_kept(self, length, member):
        """How many of positions 0 .. length - 1 (length >= 0) member ``member`` keeps."""
        return (length - member + self.token_ranks - 1) // self.token_ranks


@dataclass(frozen=True)
class KVGroups:
    """A paged cache's block groups (serve/blocks.py), all of the same layer count ``group_size`` so that a block of
    any group takes the same bytes: one *page* of the rank's one shared pool. The layers of each attention type, in
    order, fill groups of ``group_size`` (the fewest layers any type has; a type with more fills several, its last
    padded: that group's pages keep the padding's bytes unused), the full layers' groups first. ``layer_group[i]``:
    layer i's group; ``layer_slot[i]``: its place within the group (which of the pool's ``group_size`` K/V tensors it
    uses); ``windows[g]``: group g's sliding window (None: full attention). Each group is another block table over
    the same ``KVPlacement``. A model of one attention type is one group of every layer."""

    layer_group: tuple[int, ...]
    windows: tuple[int | None, ...]
    layer_slot: tuple[int, ...] = ()
    group_size: int = 0

    def __post_init__(self):
        if not self.layer_slot:  # one group per attention type, as written (a plain pool: one group of all layers)
            seen: dict[int, int] = {}
            slots = []
            for g in self.layer_group:
                slots.append(seen.get(g, 0))
                seen[g] = slots[-1] + 1
            object.__setattr__(self, "layer_slot", tuple(slots))
        if not self.group_size:
            object.__setattr__(self, "group_size", max(self.layer_slot, default=-1) + 1)

    @classmethod
    def of(cls, cfg) -> KVGroups:
        """The groups of a model config: layers grouped by what their cache holds (``LayerSpec.attention.cache``:
        every token, or a window's), full attention first."""
        kinds = [spec.attention.cache for spec in cfg.layer_specs]
        order = sorted(set(kinds), key=lambda k: (k.window is not None, k.window or 0))
        size = min(kinds.count(k) for k in order)
        layer_group, layer_slot, group_windows = [0] * len(kinds), [0] * len(kinds), []
        for kind in order:
            layers = [i for i, k in enumerate(kinds) if k == kind]
            for start in range(0, len(layers), size):
                for slot, i in enumerate(layers[start:start + size]):
                    layer_group[i], layer_slot[i] = len(group_windows), slot
                group_windows.append(kind.window)
        return cls(tuple(layer_group), tuple(group_windows), tuple(layer_slot), size)

    def layers(self, group: int) -> int:
        """How many layers group ``group`` stores (``group_size``, or fewer in a type's padded last group)."""
        return self.layer_group.count(group)


# ---------------------------------------------------------------- pages of the paged cache
# The arithmetic of serve's paged cache (serve/blocks.py keeps the pool and the tables) that the memory model
# (analysis/infer_memory.py, plan) predicts from too: here, below both.

DEFAULT_BLOCK_SIZE = 16  # tokens per block on each rank: serve's --block-size default, and what plan assumes


def bytes_per_block(n_layers: int, heads_per_rank: int, head_dim: int, dtype_bytes: int, block_size: int) -> int:
    """Bytes one block takes on one rank: K and V of ``block_size`` tokens, every layer."""
    return 2 * n_layers * heads_per_rank * head_dim * dtype_bytes * block_size


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
