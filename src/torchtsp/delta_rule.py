"""Gated DeltaNet's recurrence and short convolution (Qwen3.5, Qwen3-Next) as pure functions of a span of tokens,
so a sequence cut into zigzag chunks runs chunk by chunk and equals the whole sequence (DESIGN §24). No
communication here: the caller moves the summaries, their adjoints and the conv halos between ranks.

Conventions
-----------
- Shapes are token-major, as transformers and flash-linear-attention pass them: q, k [B, T, Hk, dk]; v [B, T, Hv,
  dv]; g, beta [B, T, Hv]. Hv is a multiple of Hk: key head h serves value heads [h*Hv/Hk, (h+1)*Hv/Hk)
  (``repeat_interleave``, the grouped value heads of Qwen3.5).
- The state is the oracle's: S [B, Hv, dk, dv], float32. Per token t, with g_t <= 0 the log-decay and beta_t the
  write strength:  S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,  o_t = q_t^T S_t
  (decay, read the decayed state through k_t, write the correction: the delta rule).
- A span's state map is affine: S_out = A @ S_in + B, A [B, Hv, dk, dk], B [B, Hv, dk, dv] (a *summary*). DESIGN
  §24 writes S_out = S_in·A + B for the transposed state [dv, dk]: its A and B are these transposed. Applying
  (A1, B1) then (A2, B2) is (A2 A1, A2 B1 + B2) (``compose``).
- q and k are L2-normalised here only with ``use_qk_l2norm_in_kernel`` (eps 1e-6, in float32, as the oracle);
  q is always scaled by dk^-1/2 inside (callers pass unscaled q). Everything runs in float32; outputs come back in
  q's dtype, states stay float32.
- ``chunk_size`` is the block of the WY form (one unit lower-triangular solve of chunk_size^2 per block): it trades
  memory for sequential steps and changes results only by float32 rounding. A span (a zigzag chunk) has any
  length, also 0 or shorter than a block; it is cut into blocks from its own first token.
- Documents (packed rows): ``doc_positions`` [B, T] ints, each token's position in its document (what
  ``masks.Documents.positions`` holds at the span's global indices). A token at position 0 starts a document: the
  state before it is dropped (a span holding a start has A = 0) and the conv reads nothing before it. A span whose
  first token has position > 0 continues the document of its incoming state and halo.

The TSP exchange of one layer, per rank (its two zigzag chunks, 2D chunks in all):
forward: ``span_summary`` of each own chunk -> all-gather the 2D summaries -> ``incoming_states`` -> ``run_span``
from its chunk's incoming state. Backward: ``run_span_backward`` gives each chunk's token gradients and G_c, the
gradient of its outputs with respect to its incoming state -> all-gather the 2D G_c -> ``state_adjoints`` (dS flows
right to left through A^T) -> ``summary_grads`` (dA_c, dB_c) -> ``span_summary_backward`` adds the summary's share
to the token gradients. The conv: ``conv_halo_sources`` says what the point-to-point halo exchange moves,
``assemble_halo`` / ``halo_grad_parts`` pack and unpack it, ``causal_conv_span`` runs a chunk and
``causal_conv_span_backward`` gives its gradients (the halo's go back to their owners). Decode:
``recurrent_step`` and ``conv_step``; a prefill's cache is ``conv_window`` plus ``run_span``'s state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .chunks import KeyPiece, window_keys

L2NORM_EPS = 1e-6  # the oracle's and flash-linear-attention's


class Summary(NamedTuple):
    """A span's state map S_out = A @ S_in + B: A [B, Hv, dk, dk], B [B, Hv, dk, dv], float32."""

    A: torch.Tensor
    B: torch.Tensor


class SpanGrads(NamedTuple):
    """Gradients of a span's outputs: its tokens' and its incoming state's (G_c of the module docstring)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    state_in: torch.Tensor


class SummaryGrads(NamedTuple):
    """Gradients of a span's summary with respect to its tokens (q does not enter a summary)."""

    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


# ---------------------------------------------------------------- inputs


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _check(q, k, v, g, beta, state=None) -> None:
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"k and v must be [batch, tokens, heads, dim], got {tuple(k.shape)} and {tuple(v.shape)}")
    (b, t, hk, dk), hv, dv = k.shape, v.shape[2], v.shape[3]
    if q is not None and q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have one shape")
    if v.shape[:2] != (b, t) or hv % hk:
        raise ValueError(f"v {tuple(v.shape)} must be [{b}, {t}, Hv, dv] with Hv a multiple of k's {hk} heads")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, hv):
            raise ValueError(f"{name} must be [batch, tokens, value heads] = {[b, t, hv]}, got {list(x.shape)}")
    if state is not None and state.shape != (b, hv, dk, dv):
        raise ValueError(f"the state must be [batch, value heads, dk, dv] = {[b, hv, dk, dv]}, "
                         f"got {list(state.shape)}")


def _head_major(x: torch.Tensor, value_heads: int | None = None) -> torch.Tensor:
    """[B, T, H, ...] token-major -> [B, Hv, T, ...] float32, key heads repeated to the value heads."""
    if value_heads is not None and x.shape[2] != value_heads:
        x = x.repeat_interleave(value_heads // x.shape[2], dim=2)
    return x.transpose(1, 2).float()


def _keys(k: torch.Tensor, value_heads: int, l2: bool) -> torch.Tensor:
    k = _head_major(k, value_heads)
    return l2norm(k) if l2 else k


def _queries(q: torch.Tensor, value_heads: int, l2: bool) -> torch.Tensor:
    q = _head_major(q, value_heads)
    return (l2norm(q) if l2 else q) * q.shape[-1] ** -0.5


def _document_starts(doc_positions: torch.Tensor | None, batch: int, tokens: int) -> torch.Tensor | None:
    """[B, 1, T] bool: True where a token starts a document (broadcast over heads), or None for one document."""
    if doc_positions is None:
        return None
    if doc_positions.shape != (batch, tokens):
        raise ValueError(f"doc_positions must be [batch, tokens] = {[batch, tokens]}, got {list(doc_positions.shape)}")
    return (doc_positions == 0).unsqueeze(1)


def _check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size!r}")


# ---------------------------------------------------------------- one span, in blocks (the WY form)


class _Blocks(NamedTuple):
    """A span cut into N blocks of C tokens (the last padded with tokens that change nothing), [B, Hv, N, C, ...].

    Within a block, with D(t, i) the decay from token i to token t (1 at t = i, 0 across a document start) and Γ_t
    the decay from the block's incoming state to token t: the corrected values are u - w @ S_in, the state leaves
    the block as Γ_last S_in + keys_to_end^T (u - w @ S_in)."""

    u: torch.Tensor  # T^-1 (beta v): what each token writes when the incoming state is zero
    w: torch.Tensor  # T^-1 (beta Γ k): how the incoming state shifts it
    keys_to_end: torch.Tensor  # k_i D(last, i)
    decay_end: torch.Tensor  # Γ_last, [B, Hv, N, 1, 1]
    decay_in: torch.Tensor  # Γ_t, [B, Hv, N, C]
    pairwise: torch.Tensor  # D(t, i) for i <= t, else 0, [B, Hv, N, C, C]
    keys: torch.Tensor  # k, [B, Hv, N, C, dk]


def _pad_blocks(x: torch.Tensor, size: int, pad: int, token_dim: int = 2) -> torch.Tensor:
    widths = [0, 0] * (x.dim() - 1 - token_dim) + [0, pad]
    x = F.pad(x, widths)
    return x.unflatten(token_dim, (-1, size))


def _blocks(k, v, g, beta, starts, chunk_size: int) -> _Blocks:
    """k [B, Hv, T, dk], v [B, Hv, T, dv], g and beta [B, Hv, T] (head-major float32), starts [B, 1, T] or None."""
    size = chunk_size
    pad = -k.shape[2] % size
    k, v = _pad_blocks(k, size, pad), _pad_blocks(v, size, pad)
    g, beta = _pad_blocks(g, size, pad), _pad_blocks(beta, size, pad)  # padding: g = 0 (no decay), beta = 0
    cum = g.cumsum(-1)  # log of the decay from the block's start through token t
    lower = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
    pairwise, to_end = cum.unsqueeze(-1) - cum.unsqueeze(-2), cum[..., -1:] - cum
    pair_kept = lower
    if starts is not None:
        segment = _pad_blocks(starts.int(), size, pad).cumsum(-1)  # documents started in the block up to t
        pair_kept = lower & (segment.unsqueeze(-1) == segment.unsqueeze(-2))
        cum = cum.masked_fill(segment != 0, float("-inf"))  # a start between the block's incoming state and t
        to_end = to_end.masked_fill(segment != segment[..., -1:], float("-inf"))  # a start after t in the block
    # Masked to -inf before exp: the upper triangle's positive differences would overflow, and exp's gradient
    # there (inf * 0) would poison the rest.
    pairwise = pairwise.masked_fill(~pair_kept, float("-inf")).exp()
    decay_in = cum.exp()
    k_beta = k * beta.unsqueeze(-1)
    # Token t's write reads the state its earlier tokens left: (I + strict_lower(beta_t D(t, i) k_t·k_i)) u =
    # beta v, solved once per block (the diagonal is unit: the solver ignores what the product puts there).
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * decay_in.unsqueeze(-1), upper=False, unitriangular=True)
    return _Blocks(u, w, k * to_end.exp().unsqueeze(-1), decay_in[..., -1, None, None], decay_in, pairwise, k)


def _block_summary(blocks: _Blocks, n: int) -> Summary:
    keys_to_end = blocks.keys_to_end[:, :, n].transpose(-1, -2)
    eye = torch.eye(keys_to_end.shape[-2], device=keys_to_end.device)
    return Summary(blocks.decay_end[:, :, n] * eye - keys_to_end @ blocks.w[:, :, n], keys_to_end @ blocks.u[:, :, n])


def identity_summary(batch: int, value_heads: int, dk: int, dv: int, device=None) -> Summary:
    """The summary of an empty span: S_out = S_in."""
    eye = torch.eye(dk, device=device).expand(batch, value_heads, dk, dk)
    return Summary(eye.clone(), torch.zeros(batch, value_heads, dk, dv, device=device))


def compose(first: Summary, then: Summary) -> Summary:
    """The summary of a span followed by the next one (THE composition rule, also of blocks within a span)."""
    return Summary(then.A @ first.A, then.A @ first.B + then.B)


def span_summary(k, v, g, beta, *, doc_positions=None, chunk_size: int = 64,
                 use_qk_l2norm_in_kernel: bool = False) -> Summary:
    """(A, B) of a span of tokens (k [B, T, Hk, dk], v [B, T, Hv, dv], g and beta [B, T, Hv]; any T, also 0),
    computed block by block in the WY form and composed: S_out = A @ S_in + B."""
    _check(None, k, v, g, beta)
    _check_chunk_size(chunk_size)
    (batch, tokens, _, dk), (value_heads, dv) = k.shape, v.shape[2:]
    summary = identity_summary(batch, value_heads, dk, dv, k.device)
    if tokens == 0:
        return summary
    blocks = _blocks(_keys(k, value_heads, use_qk_l2norm_in_kernel), _head_major(v), _head_major(g),
                     _head_major(beta), _document_starts(doc_positions, batch, tokens), chunk_size)
    for n in range(blocks.u.shape[2]):
        summary = compose(summary, _block_summary(blocks, n))
    return summary


def run_span(q, k, v, g, beta, state_in=None, *, doc_positions=None, chunk_size: int = 64,
             use_qk_l2norm_in_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs [B, T, Hv, dv] in q's dtype, state_out [B, Hv, dk, dv] float32) of a span from its incoming state
    (None: zeros). Differentiable by autograd."""
    _check(q, k, v, g, beta, state_in)
    _check_chunk_size(chunk_size)
    (batch, tokens, _, dk), (value_heads, dv) = k.shape, v.shape[2:]
    state = (torch.zeros(batch, value_heads, dk, dv, device=k.device) if state_in is None
             else state_in.float())
    if tokens == 0:
        return v.new_zeros(batch, 0, value_heads, dv).to(q.dtype), state
    blocks = _blocks(_keys(k, value_heads, use_qk_l2norm_in_kernel), _head_major(v), _head_major(g),
                     _head_major(beta), _document_starts(doc_positions, batch, tokens), chunk_size)
    queries = _pad_blocks(_queries(q, value_heads, use_qk_l2norm_in_kernel), chunk_size, -tokens % chunk_size)
    reads_in = queries * blocks.decay_in.unsqueeze(-1)  # q_t Γ_t: how token t reads the block's incoming state
    attention = (queries @ blocks.keys.transpose(-1, -2)) * blocks.pairwise  # within the block, causal
    outputs = []
    for n in range(blocks.u.shape[2]):
        corrected = blocks.u[:, :, n] - blocks.w[:, :, n] @ state
        outputs.append(reads_in[:, :, n] @ state + attention[:, :, n] @ corrected)
        state = blocks.decay_end[:, :, n] * state + blocks.keys_to_end[:, :, n].transpose(-1, -2) @ corrected
    out = torch.stack(outputs, dim=2).flatten(2, 3)[:, :, :tokens]
    return out.transpose(1, 2).contiguous().to(q.dtype), state


def chunk_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, chunk_size: int = 64,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           doc_positions=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's recurrence over a whole sequence, with the oracle's signature (transformers'
    ``torch_chunk_gated_delta_rule``, flash-linear-attention's ``chunk_gated_delta_rule``): (outputs, final state
    or None). ``run_span`` from ``initial_state``."""
    out, state = run_span(q, k, v, g, beta, initial_state, doc_positions=doc_positions, chunk_size=chunk_size,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return out, (state if output_final_state else None)


def recurrent_step(q, k, v, g, beta, state, *, use_qk_l2norm_in_kernel: bool = False):
    """One decode token (q, k [B, 1, Hk, dk], v [B, 1, Hv, dv], g and beta [B, 1, Hv]) from ``state`` [B, Hv, dk,
    dv]: (output [B, 1, Hv, dv] in q's dtype, the new state, float32)."""
    _check(q, k, v, g, beta, state)
    if k.shape[1] != 1:
        raise ValueError(f"recurrent_step takes one token per sequence, got {k.shape[1]}: use run_span for more")
    value_heads, dtype = v.shape[2], q.dtype
    q = _queries(q, value_heads, use_qk_l2norm_in_kernel)[:, :, 0]
    k = _keys(k, value_heads, use_qk_l2norm_in_kernel)[:, :, 0]
    v, g, beta = _head_major(v)[:, :, 0], _head_major(g)[:, :, 0], _head_major(beta)[:, :, 0]
    state = state.float() * g.exp()[..., None, None]
    correction = beta.unsqueeze(-1) * (v - (k.unsqueeze(-2) @ state).squeeze(-2))
    state = state + k.unsqueeze(-1) * correction.unsqueeze(-2)
    out = (q.unsqueeze(-2) @ state).squeeze(-2)
    return out.unsqueeze(1).to(dtype), state


# ---------------------------------------------------------------- the exchange's composition and its adjoint


def incoming_states(summaries: Sequence[Summary], initial_state: torch.Tensor | None = None) -> list[torch.Tensor]:
    """From the summaries of consecutive spans in global order (the 2D zigzag chunks'): [S_0, ..., S_N], S_c the
    state entering span c (S_0 the initial state, zeros if None) and S_N the state after the last."""
    if not summaries:
        raise ValueError("incoming_states needs the summaries of at least one span")
    state = torch.zeros_like(summaries[0].B) if initial_state is None else initial_state.float()
    states = [state]
    for summary in summaries:
        state = summary.A @ state + summary.B
        states.append(state)
    return states


def state_adjoints(transitions: Sequence[torch.Tensor], state_grads: Sequence[torch.Tensor],
                   final_grad: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The adjoint of ``incoming_states``: [λ_0, ..., λ_N], λ_c = dLoss/dS_c in all (λ_0 the initial state's
    gradient), from each span's A_c (``transitions``), G_c = the gradient of span c's own outputs with respect to
    S_c (``state_grads``), and the final state's gradient (None: zero). Right to left: λ_c = G_c + A_c^T λ_{c+1}."""
    if len(transitions) != len(state_grads) or not transitions:
        raise ValueError(f"one state gradient per span: {len(transitions)} transitions, {len(state_grads)} gradients")
    adjoint = torch.zeros_like(state_grads[-1]) if final_grad is None else final_grad.float()
    adjoints = [adjoint]
    for transition, local in zip(reversed(transitions), reversed(state_grads)):
        adjoint = local + transition.transpose(-1, -2) @ adjoint
        adjoints.append(adjoint)
    return adjoints[::-1]


def summary_grads(states: Sequence[torch.Tensor], adjoints: Sequence[torch.Tensor]) -> list[Summary]:
    """(dA_c, dB_c) of every span from ``incoming_states``' S_c and ``state_adjoints``' λ_{c+1}: S_{c+1} = A_c S_c
    + B_c gives dA_c = λ_{c+1} S_c^T and dB_c = λ_{c+1}."""
    if len(states) != len(adjoints):
        raise ValueError(f"one adjoint per state: {len(states)} states, {len(adjoints)} adjoints")
    return [Summary(after @ state.transpose(-1, -2), after) for state, after in zip(states[:-1], adjoints[1:])]


def _vjp(function, inputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """Gradients of ``function(*inputs)`` (a tuple of tensors) against ``grads``, on a graph of its own (also
    inside an autograd.Function's backward); an input nothing reached gets zeros."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in inputs]
        outputs = function(*leaves)
        pairs = [(out, grad) for out, grad in zip(outputs, grads) if grad is not None]
        found = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)
    return [torch.zeros_like(x) if d is None else d for x, d in zip(inputs, found)]


def run_span_backward(q, k, v, g, beta, state_in, d_out, *, doc_positions=None, chunk_size: int = 64,
                      use_qk_l2norm_in_kernel: bool = False) -> SpanGrads:
    """Gradients of ``<d_out, run_span(...) outputs>`` with respect to the span's tokens and its incoming state
    (recomputing the span; its state_out is not used: the next span's incoming state comes from the summaries)."""
    state_in = torch.zeros(v.shape[0], v.shape[2], k.shape[3], v.shape[3], device=k.device) \
        if state_in is None else state_in

    def outputs(*tensors):
        return run_span(*tensors, doc_positions=doc_positions, chunk_size=chunk_size,
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[:1]

    return SpanGrads(*_vjp(outputs, (q, k, v, g, beta, state_in), (d_out,)))


def span_summary_backward(k, v, g, beta, d_summary: Summary, *, doc_positions=None, chunk_size: int = 64,
                          use_qk_l2norm_in_kernel: bool = False) -> SummaryGrads:
    """Gradients of ``<dA, A> + <dB, B>`` of ``span_summary`` with respect to the span's tokens."""
    def summary(*tensors):
        return span_summary(*tensors, doc_positions=doc_positions, chunk_size=chunk_size,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    return SummaryGrads(*_vjp(summary, (k, v, g, beta), tuple(d_summary)))


# ---------------------------------------------------------------- the short causal convolution


def causal_conv_span(x, halo, weight, *, doc_positions=None, activation: bool = True) -> torch.Tensor:
    """Depthwise causal conv1d without bias (then SiLU with ``activation``) of a span x [B, T, C], token-major,
    given ``halo`` [B, K-1, C], the K-1 inputs before the span in global order (zeros before the sequence's start;
    None: all zeros), and ``weight`` [C, K] (``conv1d.weight[:, 0]``; column K-1 weighs the current token). With
    ``doc_positions``, token t reads only the lags j <= its position in its document."""
    channels, kernel = weight.shape
    batch, tokens = x.shape[:2]
    if x.dim() != 3 or x.shape[2] != channels:
        raise ValueError(f"x must be [batch, tokens, {channels} channels], got {list(x.shape)}")
    if halo is None:
        halo = x.new_zeros(batch, kernel - 1, channels)
    if halo.shape != (batch, kernel - 1, channels):
        raise ValueError(f"the halo must be the kernel-1 = {kernel - 1} tokens before the span, [batch, "
                         f"{kernel - 1}, {channels}], got {list(halo.shape)}")
    inputs = torch.cat([halo.to(x.dtype), x], dim=1).to(weight.dtype)
    out = 0
    for j in range(kernel):  # lag kernel-1-j: column j of the weight reads the token kernel-1-j before
        window = inputs[:, j:j + tokens]
        if doc_positions is not None:
            window = window.masked_fill((doc_positions < kernel - 1 - j).unsqueeze(-1), 0)
        out = out + window * weight[:, j]
    if activation:
        out = F.silu(out)
    return out.to(x.dtype)


class ConvGrads(NamedTuple):
    """Gradients of a span's conv outputs: its inputs', its halo's (to be sent back to the halo's owners,
    ``halo_grad_parts``) and the weight's (this span's share: the spans' shares add up)."""

    x: torch.Tensor
    halo: torch.Tensor
    weight: torch.Tensor


def causal_conv_span_backward(x, halo, weight, d_out, *, doc_positions=None, activation: bool = True) -> ConvGrads:
    """Gradients of ``<d_out, causal_conv_span(x, halo, weight)>`` (recomputing the span, also where autograd is
    off); ``halo`` None stands for zeros, as in the forward."""
    if halo is None:
        halo = x.new_zeros(x.shape[0], weight.shape[-1] - 1, x.shape[2])

    def conv(*tensors):
        return (causal_conv_span(*tensors, doc_positions=doc_positions, activation=activation),)

    return ConvGrads(*_vjp(conv, (x, halo, weight), (d_out,)))


def conv_window(x, halo, *, doc_positions=None) -> torch.Tensor:
    """The conv's state after a span: its last K-1 inputs [B, K-1, C] (with the halo before a short span), what a
    decode step continues from (the ``halo`` of ``conv_step``). Inputs before the last token's document start are
    zeroed, so a step never reads across it."""
    window = torch.cat([halo.to(x.dtype), x], dim=1)[:, x.shape[1]:]
    if doc_positions is not None and x.shape[1]:
        lag = torch.arange(window.shape[1] - 1, -1, -1, device=x.device)  # from the span's last token
        window = window.masked_fill((lag > doc_positions[:, -1:]).unsqueeze(-1), 0)
    return window


def conv_step(x, window, weight, *, activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token x [B, 1, C] from the conv's ``window`` [B, K-1, C]: (output [B, 1, C], the new window)."""
    return causal_conv_span(x, window, weight, activation=activation), conv_window(x, window)


def conv_halo_sources(seq_len: int, world: int, rank: int, kernel_size: int) -> tuple[tuple[KeyPiece, ...], ...]:
    """THE rule of the conv's halo exchange: per local chunk of ``rank`` (global chunks rank and 2D-1-rank), the
    pieces of the kernel-1 inputs before it, in global order: the last ``length`` tokens of rank ``owner``'s local
    chunk ``half``. A chunk shorter than kernel-1 reaches back into several; the first chunk has none (zeros).
    It is a sliding window of ``kernel_size`` tokens without the chunk itself (``chunks.window_keys``); document
    starts do not change what moves, only what ``causal_conv_span`` reads."""
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1:
        raise ValueError(f"the conv kernel must be a positive number of tokens, got {kernel_size!r}")
    return tuple(pieces[:-1] for pieces in window_keys(seq_len, world, rank, kernel_size))


def assemble_halo(parts: Sequence[torch.Tensor], x_span: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """The halo [B, K-1, C] of a span from the received ``parts`` ([B, length, C] each, ``conv_halo_sources``'
    order), zeros in front where the sequence starts."""
    batch, _, channels = x_span.shape
    halo = torch.cat([x_span.new_zeros(batch, 0, channels), *parts], dim=1)
    if halo.shape[1] > kernel_size - 1:
        raise ValueError(f"halo parts hold {halo.shape[1]} tokens, more than kernel-1 = {kernel_size - 1}")
    return F.pad(halo, (0, 0, kernel_size - 1 - halo.shape[1], 0))


def halo_grad_parts(d_halo: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """``assemble_halo``'s adjoint: the halo's gradient cut into the parts its owners sent (``lengths`` in
    ``conv_halo_sources``' order), each added by its owner to the gradient of its chunk's last tokens."""
    total = sum(lengths)
    if total > d_halo.shape[1]:
        raise ValueError(f"halo parts of {total} tokens do not fit a halo of {d_halo.shape[1]}")
    return list(d_halo[:, d_halo.shape[1] - total:].split(list(lengths), dim=1))
