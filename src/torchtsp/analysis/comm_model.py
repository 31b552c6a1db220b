"""Analytic communication volume per layer, in elements received per rank (DESIGN.md section 5).

Symbols: B batch, S sequence, h = n_q·d model width, g = n_q / n_kv, F ffn width, D (or T, Σ) axis sizes.
The counts follow the accounting of ``torchtsp.distributed.comm`` (all-reduce = ring algorithm,
2(D-1)/D of the tensor), so a measured run must equal them exactly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import ModelConfig


def layer_weight_elements(cfg: ModelConfig) -> int:
    """P = (2 + 2/g + 3F/h)·h²: wq, wo (h x n_q·d), wk, wv (h x n_kv·d), and three h x F MLP matrices."""
    h, d = cfg.dim, cfg.head_dim
    return 2 * h * cfg.n_heads * d + 2 * h * cfg.n_kv_heads * d + 3 * h * cfg.ffn_dim


def _kv_elements(cfg: ModelConfig, batch: int, seq_len: int) -> int:
    """K and V of every token: 2·B·S·h/g."""
    return 2 * batch * seq_len * cfg.n_kv_heads * cfg.head_dim


def tsp_layer_forward_recv_elements(cfg: ModelConfig, batch: int, seq_len: int, world: int) -> int:
    """TSP: (P + 2·B·S·h/g)·(D-1)/D.

    Every rank receives the D-1 weight shards it does not own (broadcast for attention, ring for the
    MLP) and, per head group, the K/V of the other ranks' tokens (2·B·S·h/g in all).
    """
    return (layer_weight_elements(cfg) + _kv_elements(cfg, batch, seq_len)) * (world - 1) // world


def tp_layer_forward_recv_elements(cfg: ModelConfig, batch: int, seq_len: int, tp: int) -> int:
    """Megatron TP: two all-reduces of the [B, S, h] activations, 4·B·S·h·(T-1)/T.

    With sequence parallelism the all-reduces become all-gather + reduce-scatter pairs: the same volume.
    """
    return 4 * batch * seq_len * cfg.dim * (tp - 1) // tp


def sp_layer_forward_recv_elements(cfg: ModelConfig, batch: int, seq_len: int, sp: int) -> int:
    """Sequence (context) parallel: the K/V all-gather, 2·B·S·h/g·(Σ-1)/Σ."""
    return _kv_elements(cfg, batch, seq_len) * (sp - 1) // sp


def tp_sp_layer_forward_recv_elements(cfg: ModelConfig, batch: int, seq_len: int, tp: int, sp: int) -> int:
    """TP(T) x SP(Σ): the TP all-reduces on the B·S/Σ local tokens, plus the K/V all-gather over Σ of
    this rank's 1/T of the KV heads."""
    return (tp_layer_forward_recv_elements(cfg, batch, seq_len // sp, tp)
            + _kv_elements(cfg, batch, seq_len) // tp * (sp - 1) // sp)


def layer_forward_recv_elements(scheme: str, cfg: ModelConfig, batch: int, seq_len: int,
                                dp: int = 1, tsp: int = 1, tp: int = 1, sp: int = 1) -> int:
    """Elements one rank receives during one layer's forward under ``scheme`` (DP moves nothing forward)."""
    if scheme == "dp":
        return 0
    if scheme == "tsp":
        return tsp_layer_forward_recv_elements(cfg, batch // dp, seq_len, tsp)
    if scheme == "tp":
        return tp_layer_forward_recv_elements(cfg, batch // dp, seq_len, tp)
    if scheme == "sp":
        return sp_layer_forward_recv_elements(cfg, batch // dp, seq_len, sp)
    if scheme == "tp_sp":
        return tp_sp_layer_forward_recv_elements(cfg, batch // dp, seq_len, tp, sp)
    raise ValueError(f"no communication model for scheme {scheme!r}")


# ---------------------------------------------------------------- crossover and whole-step traffic


def tsp_tp_crossover_tokens(cfg: ModelConfig):
    """B·S at which TSP's forward traffic per layer equals TP's (same degree D = T), as an exact Fraction.

    TSP ≤ TP ⇔ P + 2·B·S·h/g ≤ 4·B·S·h ⇔ B·S ≥ P / (4h - 2h/g). With P = (2 + 2/g + 3F/h)·h² this is
    B·S ≥ h·(2 + 2/g + 3F/h) / (4 - 2/g): 8h for the paper's model (g = 1, F = 4h).
    """
    from fractions import Fraction

    kv_width = cfg.n_kv_heads * cfg.head_dim  # h/g
    return Fraction(layer_weight_elements(cfg), 4 * cfg.dim - 2 * kv_width)


def _all_reduce(nbytes: int, world: int) -> int:
    """Bytes one rank receives in a ring all-reduce, as ``torchtsp.distributed.comm`` counts them."""
    return 2 * (world - 1) * nbytes // world


def _reference_tensors(cfg: ModelConfig, tp: int = 1) -> list[int]:
    """Element counts of the parameters one rank holds when the reference's matrices are split over
    ``tp`` ranks (one all-reduce each for replicated schemes; the whole model at tp = 1)."""
    h, d = cfg.dim, cfg.head_dim
    layer = [h, cfg.n_heads * d * h // tp, cfg.n_kv_heads * d * h // tp, cfg.n_kv_heads * d * h // tp,
             h * cfg.n_heads * d // tp, h, cfg.ffn_dim * h // tp, cfg.ffn_dim * h // tp, h * cfg.ffn_dim // tp]
    vocab = -(-cfg.vocab_size // tp) * h if tp > 1 else cfg.vocab_size * h
    head = [] if cfg.tie_embeddings else [vocab]
    return [vocab] + layer * cfg.n_layers + [h] + head


@dataclass(frozen=True)
class CommBreakdown:
    """Bytes one rank receives in one step, as ``torchtsp.distributed.comm`` counts them.

    layer_forward / layer_backward: one decoder layer (backward includes the re-run forward under
    recompute, and TSP's weight-gradient reduce and travelling gradients, which are part of its
    schedule). embed_head_forward / embed_head_backward: embedding, LM head and loss. grad_sync:
    all-reduces of gradients of replicated weights (every weight for DP and SP, sp-replicated shards
    for TP x SP, norms for TSP and Megatron-SP) plus the trainer's all-reduce over ``dp`` replicas.
    total = L·(layer_forward + layer_backward) + embed_head_forward + embed_head_backward + grad_sync.
    """

    layer_forward: int
    layer_backward: int
    embed_head_forward: int
    embed_head_backward: int
    grad_sync: int
    total: int

    def to_dict(self) -> dict:
        return asdict(self)


def predict_comm(scheme: str, cfg: ModelConfig, batch: int, seq_len: int, *, dp: int = 1, tsp: int = 1,
                 tp: int = 1, sp: int = 1, sequence_parallel: bool = False, dtype_bytes: int = 4,
                 mode: str = "train", recompute: bool = False) -> CommBreakdown:
    """Bytes one rank receives per training step (forward + backward + gradient sync), or per prefill
    (``mode="infer"``: the forward only, no loss), under ``scheme`` as our parallel/ modules run it.

    ``batch`` is the global batch (B/dp rows per replica). Activations and weights move in the model
    dtype (``dtype_bytes``); loss statistics in fp32. The per-layer forward equals
    ``layer_forward_recv_elements(...) · dtype_bytes`` for every scheme.
    """
    from .memory_model import check_layout  # the same layout rules as the memory model

    check_layout(scheme, cfg, batch, seq_len, dp=dp, tsp=tsp, tp=tp, sp=sp, sequence_parallel=sequence_parallel)
    if mode not in ("train", "infer"):
        raise ValueError(f"mode must be 'train' or 'infer', got {mode!r}")
    e, h, L = dtype_bytes, cfg.dim, cfg.n_layers
    B = batch // dp
    kv_width = cfg.n_kv_heads * cfg.head_dim
    P = layer_weight_elements(cfg)
    p_attn = 2 * h * cfg.n_heads * cfg.head_dim + 2 * h * kv_width
    p_mlp = 3 * h * cfg.ffn_dim
    fwd = layer_forward_recv_elements(scheme, cfg, batch, seq_len, dp=dp, tsp=tsp, tp=tp, sp=sp) * e
    loss_scalars = 0
    grad_sync = 0
    local_params = sum(_reference_tensors(cfg))  # replaced below for sharding schemes

    if scheme == "tsp":
        D = tsp
        rows = -(-cfg.vocab_size // D) * h  # elements of one vocabulary shard
        kv = 2 * B * (seq_len // D) * kv_width // D  # elements of one group's K/V of one rank
        travel = D if D > 1 else 0  # hops of a travelling gradient (ring_shift counts nothing at D = 1)
        g = 4  # gradient sums (dK/dV, partial weight gradients, travelling gradients) travel in float32
        bwd = ((D - 1) * p_attn // D * e  # broadcasts again
               + D * (D - 1) * kv * (e + g)  # K/V all-gather again + dK/dV reduce-scatter, every group
               + (D - 1) * p_attn // D * g  # partial weight gradients reduced to their owner
               + (D - 1) * p_mlp // D * e + travel * p_mlp // D * g)  # ring again + travelling gradient
        emb_fwd = 2 * (D - 1) * rows * e  # embedding and head rings
        emb_bwd = (D - 1) * rows * e + 2 * travel * rows * g  # head ring again; head and embedding gradients
        loss_scalars = 2 * _all_reduce(4, D)  # token count and NLL sum
        grad_sync = (2 * L + 1) * _all_reduce(h * e, D)  # norm weights
        local_params = L * P // D + 2 * rows + (2 * L + 1) * h - (0 if not cfg.tie_embeddings else rows)
    elif scheme == "dp":
        bwd = emb_fwd = emb_bwd = 0
        loss_scalars = 2 * _all_reduce(4, dp)
        grad_sync = sum(_all_reduce(n * e, dp) for n in _reference_tensors(cfg))
    elif scheme == "sp":
        bwd = fwd  # dK/dV reduce-scatter mirrors the K/V all-gather
        emb_fwd = emb_bwd = 0
        loss_scalars = 2 * _all_reduce(4, sp)
        grad_sync = sum(_all_reduce(n * e, sp) for n in _reference_tensors(cfg))
    else:  # tp, tp_sp (Megatron TP on the B·S/Σ tokens of an sp group)
        T = tp
        tokens = B * seq_len // sp
        act = tokens * h * e  # one [B, S/Σ, h] activation
        chunk = (T - 1) * act // T  # one all-gather or reduce-scatter of it
        rows = -(-cfg.vocab_size // T) * h
        kv_sp = 0
        if scheme == "tp_sp":
            kv_sp = (sp - 1) * 2 * B * (seq_len // sp) * (kv_width // T) * e  # K/V gather over sp, per layer
        if sequence_parallel:
            bwd = 6 * chunk + kv_sp  # re-gather + reduce-scatter (column), all-gather (row), twice
            emb_fwd = chunk + chunk  # embedding reduce-scatter, head input all-gather
            emb_bwd = chunk + 2 * chunk  # embedding gradient all-gather; head re-gather + reduce-scatter
            grad_sync = (2 * L + 1) * _all_reduce(h * e, T)  # norms see only local tokens
        else:
            bwd = 2 * _all_reduce(act, T) + kv_sp  # column-parallel dX all-reduces
            emb_fwd = _all_reduce(act, T)  # vocabulary-parallel embedding
            emb_bwd = _all_reduce(act, T)  # head input gradient
        emb_fwd += (T - 1) * 3 * tokens * 4  # cross-entropy statistics (max, sum-exp, target), fp32
        local_params = (L * P + 2 * rows - (rows if cfg.tie_embeddings else 0)) // T + (2 * L + 1) * h
        if scheme == "tp_sp":
            loss_scalars = 2 * _all_reduce(4, sp)
            # Every use of a weight is wrapped in an all-reduce over sp: a tied vocabulary shard twice.
            tensors = _reference_tensors(cfg, T) + ([rows] if cfg.tie_embeddings else [])
            grad_sync += sum(_all_reduce(n * e, sp) for n in tensors)
    if recompute:
        bwd += fwd
    if dp > 1 and scheme != "dp":
        grad_sync += _all_reduce(local_params * e, dp)  # the trainer's flat all-reduce over replicas
    if mode == "infer":
        bwd = emb_bwd = grad_sync = 0
        loss_scalars = 0
    emb_fwd += loss_scalars
    total = L * (fwd + bwd) + emb_fwd + emb_bwd + grad_sync
    return CommBreakdown(layer_forward=fwd, layer_backward=bwd, embed_head_forward=emb_fwd,
                         embed_head_backward=emb_bwd, grad_sync=grad_sync, total=total)
