"""Analytic communication volume per layer and per step, received per rank (docs/design.md, "Traffic and memory").

Symbols: B batch, S sequence, h = n_q·d model width, g = n_q / n_kv, F ffn width, D (or T, Σ) axis sizes.
The counts follow the accounting of ``torchtsp.distributed.comm`` (all-reduce = ring algorithm,
2(D-1)/D of the tensor), so a measured run must equal them exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .. import chunks
from ..config import ModelConfig
from ..kv_layouts import resolve_kv_layout
from ..layer_kinds import attention_kinds
from ..layout import Layout
from ..recompute import FULL, recompute_policy
from ..schemes import get_scheme
from ..sizes import SUM_BY_GATHER_MAX_BYTES


def kv_exchange_halves(world: int, seq_rank: int | None = None) -> tuple[int, int]:
    """(gather, scatter): how many halves (chunks) of one rank's local K/V a rank receives in a K/V all-gather
    and in the dK/dV reduce-scatter that mirrors it, over a sequence axis of ``world`` ranks.

    ``seq_rank`` None: a collective backend (NCCL) moves every rank's K/V whole, 2(D-1) halves each way. A
    point-to-point backend (gloo) moves only what causality needs (``distributed.attention.gather_kv``): rank p
    gets the first chunk alone from each of the p ranks before it, so it gathers 2(D-1) - p halves, and in the
    reduce-scatter it gets whole gradients from them and first chunks from the D-1-p ranks after it,
    2p + (D-1-p) halves. The K/V bytes of a step then depend on the rank; summed over ranks they fall by a quarter.
    """
    if seq_rank is None:
        return 2 * (world - 1), 2 * (world - 1)
    if not 0 <= seq_rank < world:
        raise ValueError(f"seq_rank must be in [0, {world}), got {seq_rank}")
    return 2 * (world - 1) - seq_rank, 2 * seq_rank + (world - 1 - seq_rank)


def kv_exchange_tokens(seq_len: int, world: int, seq_rank: int | None = None, window: int | None = None,
                       point_to_point: bool | None = None) -> tuple[int, int]:
    """(gather, scatter): how many tokens' K/V a rank receives in one layer's K/V exchange over a sequence axis of
    ``world`` ranks, and how many tokens' dK/dV come back to it in the exchange that mirrors it.

    A full layer (``window`` None) gathers every rank's K/V: ``kv_exchange_halves`` chunks of S/2D tokens, pruned
    where the backend moves tensors point to point (``point_to_point``; None: where ``seq_rank`` is given, the
    historical meaning of ``seq_rank``). A sliding layer receives only the keys its queries read, point to point
    on every backend (``chunks.window_traffic``: the window's W-1 tokens before each query chunk, at most 2(W-1)),
    and gets back the gradients of what it sent. Its figures depend on the rank whatever the backend: with
    ``seq_rank`` None, the most any rank receives (a bound, for planning).
    """
    if window is None:
        gather, scatter = kv_exchange_halves(world, KVExchange(seq_rank, point_to_point).full_layer_rank)
        chunk = seq_len // world // 2
        return gather * chunk, scatter * chunk
    if world == 1:
        return 0, 0
    if seq_rank is None:
        figures = [chunks.window_traffic(seq_len, world, r, window) for r in range(world)]
        return max(f[0] for f in figures), max(f[1] for f in figures)
    return chunks.window_traffic(seq_len, world, seq_rank, window)


@dataclass(frozen=True)
class KVExchange:
    """How one layer's K/V cross the sequence axis, for a rank: its place on the axis (``seq_rank``), whether full
    layers' exchange is point to point (``point_to_point``, see ``kv_exchange_tokens``) and the layer's window
    (None: a full layer). What a scheme's traffic formula takes for its K/V terms."""

    seq_rank: int | None = None
    point_to_point: bool | None = None
    window: int | None = None

    @property
    def full_layer_rank(self) -> int | None:
        """``kv_exchange_halves``'s rank: this rank's on a point-to-point backend, None on a collective one."""
        point_to_point = self.seq_rank is not None if self.point_to_point is None else self.point_to_point
        if point_to_point and self.seq_rank is None:
            raise ValueError("a point-to-point K/V exchange needs seq_rank: what a rank receives depends on it")
        return self.seq_rank if point_to_point else None

    def tokens(self, seq_len: int, world: int) -> tuple[int, int]:
        """(gather, scatter) tokens of K/V received (``kv_exchange_tokens``)."""
        return kv_exchange_tokens(seq_len, world, self.seq_rank, self.window, self.point_to_point)

    def elements(self, seq_len: int, world: int, per_token: int) -> tuple[int, int]:
        """(gather, scatter) elements received, ``per_token`` elements of K/V (or dK/dV) per token. A full layer
        counts whole chunks of B·S/2D tokens' elements, rounded as a chunk is (the paper's formulas take any S)."""
        if self.window is None:
            gather, scatter = kv_exchange_halves(world, self.full_layer_rank)
            chunk = per_token * seq_len // (2 * world)
            return gather * chunk, scatter * chunk
        gather, scatter = self.tokens(seq_len, world)
        return gather * per_token, scatter * per_token


def tsp_kv_width(cfg: ModelConfig, world: int) -> int:
    """Width of the K/V projections TSP's shards hold together: n_kv·d, or D·d when n_kv < D (each KV head is
    then copied on D/n_kv ranks, so the shards together hold D KV heads)."""
    return max(cfg.n_kv_heads, world) * cfg.head_dim


def tsp_attention_elements(cfg: ModelConfig, world: int) -> int:
    """Elements of the D packed attention shards together: wq, wo, wk, wv (KV heads counted with their copies)
    and, with q/k/v bias, the biases."""
    h, q_width, kv_width = cfg.dim, cfg.n_heads * cfg.head_dim, tsp_kv_width(cfg, world)
    return 2 * h * q_width + 2 * h * kv_width + ((q_width + 2 * kv_width) if cfg.qkv_bias else 0)


def tsp_layer_forward_recv_elements(cfg: ModelConfig, batch: int, seq_len: int, world: int,
                                    seq_rank: int | None = None, window: int | None = None,
                                    point_to_point: bool | None = None) -> int:
    """TSP: (P + 2·B·S·h/g)·(D-1)/D.

    Every rank receives the D-1 weight shards it does not own (broadcast for attention, ring for the
    MLP) and, per head group, the K/V of the other ranks' tokens (2·B·S·h/g in all). P counts q/k/v biases
    (they travel in the attention shard), and with n_kv < D the copied KV heads (h/g becomes D·d).
    ``seq_rank``, ``window``, ``point_to_point``: the K/V exchange's (``kv_exchange_tokens``; a sliding layer's
    window receives only the window's tokens).
    """
    weights = tsp_attention_elements(cfg, world) + 3 * cfg.dim * cfg.ffn_dim
    kv_token = 2 * batch * tsp_kv_width(cfg, world)  # K and V of one token, every head group
    kv = KVExchange(seq_rank, point_to_point, window)
    return weights * (world - 1) // world + kv.elements(seq_len, world, kv_token)[0]


def tp_kv_heads(cfg: ModelConfig, tp: int) -> int:
    """KV heads TP's ``tp`` ranks hold together: n_kv, or T when n_kv < T (each KV head copied on T/n_kv ranks)."""
    return max(cfg.n_kv_heads, tp)


def tp_layer_forward_recv_elements(cfg: ModelConfig, batch: int, seq_len: int, tp: int) -> int:
    """Megatron TP: two all-reduces of the [B, S, h] activations, 4·B·S·h·(T-1)/T.

    With sequence parallelism the all-reduces become all-gather + reduce-scatter pairs: the same volume.
    """
    return 4 * batch * seq_len * cfg.dim * (tp - 1) // tp


def sp_layer_forward_recv_elements(cfg: ModelConfig, batch: int, seq_len: int, sp: int,
                                   seq_rank: int | None = None, window: int | None = None,
                                   point_to_point: bool | None = None) -> int:
    """Sequence (context) parallel: the K/V all-gather, 2·B·S·h/g·(Σ-1)/Σ on a collective backend; on a
    point-to-point one pass this rank's sp rank as ``seq_rank``; a sliding layer's window receives only the
    window's tokens (``kv_exchange_tokens``)."""
    kv_token = 2 * batch * cfg.n_kv_heads * cfg.head_dim
    return KVExchange(seq_rank, point_to_point, window).elements(seq_len, sp, kv_token)[0]


def tp_sp_layer_forward_recv_elements(cfg: ModelConfig, batch: int, seq_len: int, tp: int, sp: int,
                                      seq_rank: int | None = None, window: int | None = None,
                                      point_to_point: bool | None = None) -> int:
    """TP(T) x SP(Σ): the TP all-reduces on the B·S/Σ local tokens, plus the K/V all-gather over Σ of
    this rank's 1/T of the KV heads (``seq_rank``, ``window``, ``point_to_point``: ``kv_exchange_tokens``)."""
    kv_token = 2 * batch * tp_kv_heads(cfg, tp) * cfg.head_dim // tp  # a copied KV head counted on each rank
    return (tp_layer_forward_recv_elements(cfg, batch, seq_len // sp, tp)
            + KVExchange(seq_rank, point_to_point, window).elements(seq_len, sp, kv_token)[0])


def layer_forward_recv_elements(scheme: str, cfg: ModelConfig, batch: int, seq_len: int,
                                dp: int = 1, tsp: int = 1, tp: int = 1, sp: int = 1,
                                seq_rank: int | None = None, window: int | None = None,
                                point_to_point: bool | None = None) -> int:
    """Elements one rank receives during one layer's forward under ``scheme`` (DP moves nothing forward);
    ``window``: a sliding layer's."""
    degrees = {"dp": dp, "tsp": tsp, "tp": tp, "sp": sp}
    return _scheme_traffic(scheme, cfg, batch // dp, seq_len, degrees, 1, False,
                           KVExchange(seq_rank, point_to_point, window)).layer_forward


# ---------------------------------------------------------------- whole-step traffic


def _all_reduce(nbytes: int, world: int) -> int:
    """Bytes one rank receives in a ring all-reduce, as ``torchtsp.distributed.comm`` counts them."""
    return 2 * (world - 1) * nbytes // world


Shape = tuple[int, int]  # (rows, elements per row) of a parameter one rank holds; 1-D tensors are (n, 1)


def _numel(shape: Shape) -> int:
    return shape[0] * shape[1]


def _dp_chunk(shape: Shape, dp: int) -> int:
    """Elements of one dp rank's chunk of a tensor under the distributed optimizer (train/zero.py): whole
    rows, ceil(rows / dp) of them (the last chunks padded)."""
    return -(-shape[0] // dp) * shape[1]


def _reference_tensors(cfg: ModelConfig, tp: int = 1) -> list[Shape]:
    """Shapes of the parameters one rank holds when the reference's matrices are split over ``tp`` ranks (one
    all-reduce each for replicated schemes; the whole model at tp = 1); stacked experts [E, F/tp, h] and
    [E, h, F/tp] are E rows."""
    h, d, n_kv = cfg.dim, cfg.head_dim, tp_kv_heads(cfg, tp)
    q, kv, f = cfg.n_heads * d // tp, n_kv * d // tp, cfg.ffn_dim // tp
    layer = [(h, 1), (q, h), (kv, h), (kv, h), (h, q), (h, 1), (f, h), (f, h), (h, f)]
    layer += [(q, 1), (kv, 1), (kv, 1)] if cfg.qkv_bias else []
    layer += [(d, 1), (d, 1)] if cfg.qk_norm else []  # q/k norm weights: per head, replicated
    layer += [(h, 1)] * (cfg.norms_per_layer - 2)  # Gemma's sandwich norms after each sublayer
    # A sparse layer: the router, each stacked expert weight cut along F, the shared expert and its gate.
    experts = (cfg.n_experts, cfg.moe_ffn_dim * h // tp)
    sparse = layer[:6] + layer[9:] + [(cfg.n_experts, h)] + [experts] * 3
    shared = cfg.shared_expert_ffn_dim // tp
    sparse += [(shared, h), (shared, h), (h, shared), (1, h)] if cfg.shared_expert_ffn_dim else []
    vocab = (-(-cfg.vocab_size // tp) if tp > 1 else cfg.vocab_size, h)
    head = [] if cfg.tie_embeddings else [vocab]
    layers = [t for i in range(cfg.n_layers) for t in (sparse if cfg.is_moe_layer(i) else layer)]
    return [vocab] + layers + [(h, 1)] + head


@dataclass(frozen=True)
class CommBreakdown:
    """Bytes one rank receives in one step, as ``torchtsp.distributed.comm`` counts them.

    layer_forward / layer_backward: one decoder layer (backward includes the re-run forward under
    recompute, and TSP's weight-gradient reduce and travelling gradients, which are part of its
    schedule). embed_head_forward / embed_head_backward: embedding, LM head and loss. grad_sync:
    all-reduces of gradients of replicated weights (every weight for SP, sp-replicated shards for
    TP x SP, norms for TSP and Megatron-SP) plus the sums over ``dp`` replicas.
    total = L·(layer_forward + layer_backward) + embed_head_forward + embed_head_backward + grad_sync (for a
    mixture of experts or a model with sliding layers, the layer figures are the mean over its layers, rounded
    down). layer_types: per layer type the model has ("full_attention", "sliding_attention"), one dense layer's
    {"forward", "backward"} (a sliding layer's K/V exchange moves only its window's keys).
    """

    layer_forward: int
    layer_backward: int
    embed_head_forward: int
    embed_head_backward: int
    grad_sync: int
    total: int
    # Of ``total`` (and of one forward), the expert all-to-alls' expected bytes: routing decides the real figure,
    # so a measurement is compared exactly on the rest and on these by their ratio.
    routed: int = 0
    routed_forward: int = 0
    forward: int = 0  # one forward exactly: every layer's forward, the embedding, head and loss
    layer_types: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SchemeTraffic:
    """One replica's bytes per rank for one training step, as a scheme's formula gives them (the dp sums
    and the recompute and inference variants are added by ``predict_comm``). ``loss``: the all-reduces of
    the NLL sum and token count. ``local_tensors``: shapes (rows, elements per row) of the parameters one rank
    holds, each summed over dp replicas by its own all-reduce (or cut into dp chunks of whole rows)."""

    layer_forward: int
    layer_backward: int
    embed_head_forward: int
    embed_head_backward: int
    loss: int
    grad_sync: int
    local_tensors: list[Shape]
    # A mixture of experts' sparse layers (their dense layers are layer_forward / layer_backward); the expert
    # all-to-alls are data-dependent: these are their expected bytes under uniform routing (``moe_all_to_all``).
    sparse_forward: int = 0
    sparse_backward: int = 0
    routed_forward: int = 0  # of sparse_forward / sparse_backward, the expected expert all-to-all bytes
    routed_backward: int = 0
    # Under recompute, what a dense layer's forward run again in backward moves (None: the whole forward again).
    recompute_forward: int | None = None


def moe_all_to_all(cfg: ModelConfig, tokens: int, world: int) -> tuple[int, int]:
    """(elements, count bytes) one rank receives in one sparse layer's forward under TSP, in expectation under
    uniform routing: of its k·n (token, expert) pairs (n = tokens/D local tokens) a fraction (D-1)/D goes to other
    ranks' experts and as many arrive from them, and every pair crosses twice (dispatch and combine):
    2·k·n·h·(D-1)/D elements; plus the exchange of the per-expert counts, (D-1)·E/D int64. Backward moves the same
    elements again (no counts). Routing decides the real figure: tests/test_moe.py checks the counted bytes
    against the routed pairs themselves."""
    pairs = cfg.moe_top_k * tokens // world
    return 2 * pairs * cfg.dim * (world - 1) // world, (world - 1) * (cfg.n_experts // world) * 8


def _aux_stats(cfg: ModelConfig, world: int) -> int:
    """The all-reduce of a mixture of experts' router statistics (2E + 1 fp32) over ranks holding other tokens."""
    return _all_reduce((2 * cfg.n_experts + 1) * 4, world) if cfg.moe else 0


def _sparse_layers(cfg: ModelConfig) -> int:
    return sum(map(cfg.is_moe_layer, range(cfg.n_layers)))


def tsp_step_traffic(cfg: ModelConfig, B: int, seq_len: int, degrees: dict, e: int, sequence_parallel: bool,
                     kv: KVExchange = KVExchange()):
    """TSP over D: attention shards broadcast (twice), K/V gathered (twice) and dK/dV reduce-scattered per group,
    partial weight gradients reduced to their owner, MLP/embedding/head shards around the ring (the head again
    in backward) with their gradients travelling along, norm gradients (q/k norms too) all-reduced. With n_kv < D
    the KV heads' copies count as heads of their own, and the copies' float32 gradients are all-reduced over
    the D/n_kv ranks sharing each."""
    h, L, D, d = cfg.dim, cfg.n_layers, degrees["tsp"], cfg.head_dim
    kv_width = tsp_kv_width(cfg, D)
    p_attn = tsp_attention_elements(cfg, D)
    p_mlp = 3 * h * cfg.ffn_dim
    rows = -(-cfg.vocab_size // D) * h  # elements of one vocabulary shard
    gathered, scattered = kv.elements(seq_len, D, 2 * B * kv_width)  # every head group's K/V
    travel = D if D > 1 else 0  # hops of a travelling gradient (ring_shift counts nothing at D = 1)
    g = 4  # gradient sums (dK/dV, partial weight gradients, travelling gradients, norms) travel in float32
    bwd = ((D - 1) * p_attn // D * e  # broadcasts again
           + gathered * e + scattered * g  # K/V exchanged again + dK/dV back, every group
           + (D - 1) * p_attn // D * g  # partial weight gradients reduced to their owner
           + (D - 1) * p_mlp // D * e + travel * p_mlp // D * g)  # ring again + travelling gradient
    head = [] if cfg.tie_embeddings else [rows]
    qk_norms = [d, d] if cfg.qk_norm else []
    grad_sync = (cfg.norms_per_layer * L + 1) * _all_reduce(h * g, D) + L * sum(_all_reduce(n * g, D)
                                                                                for n in qk_norms)  # norms
    replicas = D // min(cfg.n_kv_heads, D)
    kv_local = (2 * h * kv_width + (2 * kv_width if cfg.qkv_bias else 0)) // D  # K/V tail of one packed shard
    grad_sync += L * _all_reduce(kv_local * g, replicas)
    dense = [h, p_attn // D, *qk_norms, h, p_mlp // D]
    fwd = tsp_layer_forward_recv_elements(cfg, B, seq_len, D, kv.seq_rank, kv.window, kv.point_to_point) * e
    sparse_fwd = sparse_bwd = routed_fwd = routed_bwd = 0
    sparse = dense[:-1]  # a sparse layer has no dense MLP shard
    if cfg.moe:
        # The shared expert takes the dense MLP's place on the ring; the routed experts never move.
        p_sh = 3 * h * cfg.shared_expert_ffn_dim
        moved, counts = moe_all_to_all(cfg, B * seq_len, D)
        routed_fwd, routed_bwd = moved * e + counts, moved * e
        sparse_fwd = fwd - (D - 1) * p_mlp // D * e + (D - 1) * p_sh // D * e + moved * e + counts
        sparse_bwd = (bwd - (D - 1) * p_mlp // D * e - travel * p_mlp // D * g
                      + (D - 1) * p_sh // D * e + travel * p_sh // D * g + moved * e)
        # Replicated router (and shared gate): their gradients are all-reduced like the norms'.
        router_sync = _all_reduce(cfg.n_experts * h * e, D) + (_all_reduce(h * e, D) if p_sh else 0)
        grad_sync += _sparse_layers(cfg) * router_sync
        experts = [(cfg.n_experts // D, cfg.moe_ffn_dim * h)] * 3
        sparse += [(cfg.n_experts, h)] + experts + ([p_sh // D, (1, h)] if p_sh else [])
    # Packed shards and norms are flat: n elements are n rows of one.
    layers = [t if isinstance(t, tuple) else (t, 1) for i in range(L)
              for t in (sparse if cfg.is_moe_layer(i) else dense)]
    return SchemeTraffic(
        layer_forward=fwd, layer_backward=bwd,
        embed_head_forward=2 * (D - 1) * rows * e,  # embedding and head rings
        embed_head_backward=(D - 1) * rows * e + 2 * travel * rows * g,  # head ring again; two gradients travel
        loss=2 * _all_reduce(4, D) + _aux_stats(cfg, D), grad_sync=grad_sync,
        local_tensors=[(rows // h, h)] + layers + [(h, 1)] + [(r // h, h) for r in head],
        sparse_forward=sparse_fwd, sparse_backward=sparse_bwd,
        routed_forward=routed_fwd, routed_backward=routed_bwd,
        # The re-run MLP moves nothing: backward's ring projects each passing shard again (TSPFeedForward).
        recompute_forward=fwd - (D - 1) * p_mlp // D * e)


def dp_step_traffic(cfg: ModelConfig, B: int, seq_len: int, degrees: dict, e: int, sequence_parallel: bool,
                    kv: KVExchange = KVExchange()):
    """The whole model on each rank: nothing moves but the sums over dp replicas."""
    return SchemeTraffic(0, 0, 0, 0, 0, 0, _reference_tensors(cfg))


def sp_step_traffic(cfg: ModelConfig, B: int, seq_len: int, degrees: dict, e: int, sequence_parallel: bool,
                    kv: KVExchange = KVExchange()):
    """SP over Σ: the K/V all-gather per layer, mirrored by the dK/dV reduce-scatter; every gradient all-reduced."""
    sp = degrees["sp"]
    fwd = sp_layer_forward_recv_elements(cfg, B, seq_len, sp, kv.seq_rank, kv.window, kv.point_to_point) * e
    # dK/dV go back in float32 (``distributed.attention.ZigzagAttention``).
    bwd = kv.elements(seq_len, sp, 2 * B * cfg.n_kv_heads * cfg.head_dim)[1] * 4
    return SchemeTraffic(
        layer_forward=fwd, layer_backward=bwd, embed_head_forward=0, embed_head_backward=0,
        loss=2 * _all_reduce(4, sp) + _aux_stats(cfg, sp),
        grad_sync=sum(_all_reduce(_numel(t) * e, sp) for t in _reference_tensors(cfg)),
        local_tensors=_reference_tensors(cfg), sparse_forward=fwd, sparse_backward=bwd)


def tp_step_traffic(cfg: ModelConfig, B: int, seq_len: int, degrees: dict, e: int, sequence_parallel: bool,
                    kv: KVExchange = KVExchange()):
    """Megatron TP over T on the B·S/Σ tokens of an sp group (Σ = 1 for plain TP), with the K/V gather over
    Σ of TP x SP and, with Megatron-SP, all-gather / reduce-scatter pairs instead of all-reduces."""
    h, L, T, sp = cfg.dim, cfg.n_layers, degrees["tp"], degrees["sp"]
    tokens = B * seq_len // sp
    act = tokens * h * e  # one [B, S/Σ, h] activation
    chunk = (T - 1) * act // T  # one all-gather or reduce-scatter of it
    rows = -(-cfg.vocab_size // T) * h
    kv_width = tp_kv_heads(cfg, T) * cfg.head_dim
    # The dK/dV reduce-scatter over sp, per layer (the gather is part of the forward).
    kv_sp = kv.elements(seq_len, sp, 2 * B * (kv_width // T))[1] * 4  # in float32
    fwd = (tp_sp_layer_forward_recv_elements(cfg, B, seq_len, T, sp, kv.seq_rank, kv.window, kv.point_to_point)
           if sp > 1
           else tp_layer_forward_recv_elements(cfg, B, seq_len, T)) * e
    grad_sync = 0
    if sequence_parallel:
        bwd = 6 * chunk + kv_sp  # re-gather + reduce-scatter (column), all-gather (row), twice
        emb_fwd = chunk + chunk  # embedding reduce-scatter, head input all-gather
        emb_bwd = chunk + 2 * chunk  # embedding gradient all-gather; head re-gather + reduce-scatter
        grad_sync = (cfg.norms_per_layer * L + 1) * _all_reduce(h * e, T)  # norms see only local tokens
    else:
        bwd = 2 * _all_reduce(act, T) + kv_sp  # column-parallel dX all-reduces
        emb_fwd = _all_reduce(act, T)  # vocabulary-parallel embedding
        emb_bwd = _all_reduce(act, T)  # head input gradient
    emb_fwd += (T - 1) * 3 * tokens * 4  # cross-entropy statistics (max, sum-exp, target), fp32
    if cfg.qk_norm:  # q/k norm weights act on this rank's heads only: their gradients are summed over tp
        grad_sync += L * 2 * _all_reduce(cfg.head_dim * e, T)
    copies = T // min(cfg.n_kv_heads, T)
    if copies > 1:  # each layer's wk, wv (bk, bv) copy gradients summed over the copies' ranks, in float32
        grad_sync += L * _all_reduce(2 * (h + cfg.qkv_bias) * cfg.head_dim * 4, copies)
    local = _reference_tensors(cfg, T)
    loss = 2 * _all_reduce(4, sp)  # NLL sum and token count over sp (nothing for plain TP)
    if sp > 1:
        # Every use of a weight is wrapped in an all-reduce over sp: a tied vocabulary shard twice.
        tied = [(rows // h, h)] if cfg.tie_embeddings else []
        grad_sync += sum(_all_reduce(_numel(t) * e, sp) for t in local + tied)
    # A sparse layer (parallel/moe.py, tp_moe): one all-reduce of the summed partial outputs, like the dense MLP's;
    # backward adds the partial gradients of the top-k weights [n, k] (and of the shared gate, [n, 1]).
    sparse_bwd = bwd + _all_reduce(tokens * cfg.moe_top_k * e, T)
    sparse_bwd += _all_reduce(tokens * e, T) if cfg.shared_expert_ffn_dim else 0
    return SchemeTraffic(fwd, bwd, emb_fwd, emb_bwd, loss, grad_sync, local, sparse_forward=fwd,
                         sparse_backward=sparse_bwd if cfg.moe else 0)


def _scheme_traffic(scheme: str, cfg: ModelConfig, B: int, seq_len: int, degrees: dict, e: int,
                    sequence_parallel: bool, kv: KVExchange = KVExchange()) -> SchemeTraffic:
    spec = get_scheme(scheme)
    if spec.traffic is None:
        raise ValueError(f"no communication model for scheme {scheme!r} (its collectives are not counted)")
    return spec.load("traffic")(cfg, B, seq_len, degrees, e, sequence_parallel, kv)


def _layer_figures(t: SchemeTraffic, recompute: bool, mode: str) -> dict[bool, tuple[int, int, int, int]]:
    """Per layer kind (sparse or dense): (forward, backward, routed forward, routed backward) of one layer."""
    fwd, bwd, sparse_fwd, sparse_bwd = t.layer_forward, t.layer_backward, t.sparse_forward, t.sparse_backward
    routed_fwd, routed_bwd = t.routed_forward, t.routed_backward
    if recompute:
        bwd += fwd if t.recompute_forward is None else t.recompute_forward
        sparse_bwd += sparse_fwd
        routed_bwd += routed_fwd
    if mode == "infer":  # a prefill: the forward only
        bwd = sparse_bwd = routed_bwd = 0
    return {False: (fwd, bwd, 0, 0), True: (sparse_fwd, sparse_bwd, routed_fwd, routed_bwd)}


def predict_comm(scheme: str, cfg: ModelConfig, batch: int, seq_len: int, *, dp: int = 1, tsp: int = 1,
                 tp: int = 1, sp: int = 1, sequence_parallel: bool = False, dtype_bytes: int = 4,
                 mode: str = "train", recompute: str | bool = False, seq_rank: int | None = None,
                 point_to_point: bool | None = None, zero: int = 0) -> CommBreakdown:
    """Bytes one rank receives per training step (forward + backward + gradient sync), or per prefill
    (``mode="infer"``: the forward only, no loss), under ``scheme`` as our parallel/ modules run it.

    ``batch`` is the global batch (B/dp rows per replica). Activations and weights move in the model
    dtype (``dtype_bytes``); loss statistics and the gradient sums over dp replicas in fp32. The per-layer
    forward equals ``layer_forward_recv_elements(...) · dtype_bytes`` for every scheme. The scheme's own
    formula is the function its registry entry names (``torchtsp.schemes``).

    ``seq_rank``: this rank's rank on the sequence axis (tsp or sp), where its bytes depend on it.
    ``point_to_point``: whether full layers' K/V move point to point (gloo, CPU), skipping what causality never
    reads (``kv_exchange_halves``); None: where ``seq_rank`` is given (the historical call: a rank was passed
    on point-to-point backends only). On a collective backend (NCCL) full layers move the same bytes on every
    rank. Sliding layers receive only their window's keys, point to point on every backend, so their bytes
    always depend on the rank (``kv_exchange_tokens``); without ``seq_rank``, the most any rank receives.
    ``model.traffic_args()`` gives a running model's pair.

    ``zero`` 1 or 2 (``train/zero.py``, dp > 1): each local tensor's gradient is reduce-scattered over dp in fp32
    and the updated weights all-gathered in the model dtype, dp - 1 chunks of ceil(rows/dp) whole rows each. ``zero``
    3 (FSDP2, ``train/fsdp.py``): the same reduce-scatter and two all-gathers, before forward and before backward
    (``reshard_after_forward``; one micro-batch of accumulation).
    """
    degrees = {"dp": dp, "tsp": tsp, "tp": tp, "sp": sp}
    Layout.of_degrees(scheme, cfg, batch, seq_len, **degrees, sequence_parallel=sequence_parallel)  # layout.py
    # Only full recompute re-runs collectives (a layer's forward again); selective recomputes no collective.
    recompute = recompute_policy(recompute) == FULL
    if mode not in ("train", "infer"):
        raise ValueError(f"mode must be 'train' or 'infer', got {mode!r}")
    traffic = lambda window: _scheme_traffic(scheme, cfg, batch // dp, seq_len, degrees, dtype_bytes,
                                             sequence_parallel, KVExchange(seq_rank, point_to_point, window))
    t = traffic(None)
    # Per attention kind, the figures of one layer (a sliding layer differs in its K/V exchange only).
    by_kind = {kind: _layer_figures(traffic(kind.window), recompute, mode) for kind in attention_kinds(cfg)}
    emb_fwd, emb_bwd, grad_sync = t.embed_head_forward, t.embed_head_backward, t.grad_sync
    if mode == "infer":  # a prefill: the forward of the layers, embedding and head, no loss
        emb_bwd = grad_sync = 0
    else:
        # Data parallelism (parallel/dp.py): the NLL sum and token count (and a mixture of experts' router
        # statistics) over replicas, and each local gradient summed in fp32 by its own all-reduce (nothing at dp = 1).
        emb_fwd += t.loss + 2 * _all_reduce(4, dp) + _aux_stats(cfg, dp)
        if zero == 3 and dp > 1:  # FSDP2: gathered for forward and again for backward (resharded after forward)
            grad_sync += sum((dp - 1) * _dp_chunk(shape, dp) * (4 + 2 * dtype_bytes) for shape in t.local_tensors)
        elif zero and dp > 1:
            grad_sync += sum((dp - 1) * _dp_chunk(shape, dp) * (4 + dtype_bytes) for shape in t.local_tensors)
        else:
            grad_sync += sum(_all_reduce(_numel(shape) * 4, dp) for shape in t.local_tensors)
    layers = [by_kind[spec.attention][spec.moe] for spec in cfg.layer_specs]
    fwd, bwd, routed_fwd, routed_bwd = (sum(column) for column in zip(*layers))
    L = cfg.n_layers
    # One layer's figures; with layers of several kinds (experts, windows) their mean, rounded down.
    return CommBreakdown(layer_forward=fwd // L, layer_backward=bwd // L, embed_head_forward=emb_fwd,
                         embed_head_backward=emb_bwd, grad_sync=grad_sync,
                         total=fwd + bwd + emb_fwd + emb_bwd + grad_sync,
                         routed=routed_fwd + routed_bwd, routed_forward=routed_fwd, forward=fwd + emb_fwd,
                         layer_types={kind.name: {"forward": f[False][0], "backward": f[False][1]}
                                      for kind, f in by_kind.items()})


# ---------------------------------------------------------------- decode: cache layouts and traffic per step


FP32_BYTES = 4  # the (O, LSE) partials travel in float32


@dataclass(frozen=True)
class DecodeTraffic:
    """What one rank issues and receives in one decode step (``Engine.decode``: the embedding and every layer; the
    token choice is not counted). ``calls`` and ``recv``: per operation kind, as ``CommStats.calls`` and
    ``CommStats.bytes_recv`` count them."""

    calls: dict
    recv: dict

    @property
    def collectives(self) -> int:
        return sum(self.calls.values())

    @property
    def recv_bytes(self) -> int:
        return sum(self.recv.values())


class _Ops:
    """Operations counted the way ``distributed.comm.AxisComm`` counts them (a one-rank comm counts the call of an
    all-gather or all-to-all, with no bytes)."""

    def __init__(self):
        self.calls, self.recv = {}, {}

    def add(self, op: str, nbytes: int, times: int = 1) -> None:
        self.calls[op] = self.calls.get(op, 0) + times
        self.recv[op] = self.recv.get(op, 0) + times * nbytes

    def all_gather(self, nbytes: int, ranks: int, times: int = 1) -> None:
        self.add("all_gather", (ranks - 1) * nbytes, times)

    def all_to_all(self, slice_bytes: int, ranks: int, times: int = 1) -> None:
        self.add("all_to_all", (ranks - 1) * slice_bytes, times)

    def sum_over_ranks(self, nbytes: int, ranks: int, point_to_point: bool, times: int = 1) -> None:
        """``infer.engine.sum_over_ranks`` of a partial of ``nbytes`` bytes per rank."""
        if ranks == 1:
            return
        if point_to_point and nbytes <= SUM_BY_GATHER_MAX_BYTES:
            self.all_gather(nbytes, ranks, times)
        else:
            self.add("all_reduce", _all_reduce(nbytes, ranks), times)


def decode_step_traffic(scheme: str, cfg: ModelConfig, batch: int, ranks: int, kv_layout: str = "auto",
                        e: int = 4, point_to_point: bool = False) -> DecodeTraffic:
    """Collectives one rank issues and bytes it receives in one decode step of ``batch`` sequences, weights in
    place (TSP's activations-move decode, ``schedule="auto"`` below the crossover; TP's only step).

    Every scheme sums the embedding's vocabulary-slice partials [B, h] over the ranks, and per layer:
    - tp, and tsp with ``heads``: the sums of the ``wo`` and MLP partials (2 per layer);
    - tsp ``sequence`` (infer/tsp.py ``decode_activations``): the all-gather of every head group's q/k/v, the
      all-to-all of the packed (O, LSE) partials (float32, hq·(d + 1) per sequence and rank), the two sums;
    - tsp ``grouped``: the all-gather of q and the (O, LSE) all-to-all inside the c = D/n_kv ranks sharing a KV
      head (each member stores the tokens it owns with its own copy of the head), the two sums over all D.
    A sum is ``infer.engine.sum_over_ranks``: on a point-to-point backend (``point_to_point``, gloo) a partial of at
    most ``SUM_BY_GATHER_MAX_BYTES`` is all-gathered, (D-1)·B·h·e bytes, not all-reduced, 2(D-1)/D·B·h·e.
    ``e``: bytes per element of the model dtype.
    """
    spec = get_scheme(scheme)
    axis = spec.weight_axes[0] if spec.inference is not None and len(spec.weight_axes) == 1 else None
    if axis not in ("tp", "tsp"):
        raise ValueError(f"decode_step_traffic models the decode of weights split by heads over tp or tsp, not of "
                         f"{scheme!r}")
    L, h, d = cfg.n_layers, cfg.dim, cfg.head_dim
    layout = resolve_kv_layout(kv_layout, cfg.n_kv_heads, ranks, spec) if spec.kv_layouts else spec.own_kv_layout
    hq = cfg.n_heads // ranks
    hkv = cfg.n_kv_heads // min(cfg.n_kv_heads, ranks)  # a rank's KV heads (a copy of one when n_kv < D)
    ops, partial = _Ops(), batch * h * e  # a [B, 1, h] partial output
    ops.sum_over_ranks(partial, ranks, point_to_point)  # the embedding
    if layout == "sequence":
        ops.all_gather(batch * (hq + 2 * hkv) * d * e, ranks, times=L)
        ops.all_to_all(batch * hq * (d + 1) * FP32_BYTES, ranks, times=L)
    elif layout == "grouped":
        group = ranks // cfg.n_kv_heads
        ops.all_gather(batch * hq * d * e, group, times=L)
        ops.all_to_all(batch * hq * (d + 1) * FP32_BYTES, group, times=L)
    ops.sum_over_ranks(partial, ranks, point_to_point, times=2 * L)  # wo and the MLP
    return DecodeTraffic(calls=ops.calls, recv=ops.recv)

