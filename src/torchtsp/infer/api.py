"""``generate(model, prompts, max_new_tokens, ...)``: batched generation with any scheme, exact against one device.

Prompts of different lengths are right padded: under causal attention a real token never sees a later
padding token, and the cache marks padding slots invalid, so decode attention skips them. Every rank
of the model's mesh calls ``generate`` with the same arguments and gets the same result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..host import on_host, traced
from ..kv_layouts import resolve_kv_layout
from ..schemes import INFERENCE_SCHEDULES, SCHEMES, inference_schemes, resolve
from .engine import Engine
from .sampling import TokenSelector, check_sampling

SCHEDULES = INFERENCE_SCHEDULES


@dataclass
class GenerationResult:
    """``tokens[i]``: prompt i followed by its new ids (ending at a stop id if one was produced).

    ``prefill_s``: time to the first new token (prefill and its selection). ``decode_s_per_token``: mean
    time of a decode step (None when no step ran). ``kv_cache_bytes``: this rank's K/V storage.
    ``schedule``: the schedule each phase used. ``logits`` (with ``return_logits``): per step, the
    float32 logits [B, V] the step's token was chosen from.
    """

    tokens: list[list[int]]
    prompt_lengths: list[int]
    prefill_s: float
    decode_s_per_token: float | None
    kv_cache_bytes: int
    schedule: dict[str, str]
    kv_layout: str = "sequence"
    logits: list[torch.Tensor] | None = field(default=None, repr=False)

    @property
    def new_tokens(self) -> list[list[int]]:
        return [t[n:] for t, n in zip(self.tokens, self.prompt_lengths)]


def make_engine(model, kv_layout: str = "auto") -> Engine:
    """The inference engine of a reference ``Transformer`` or a model from ``parallelize``; ``kv_layout``: how a
    TSP engine lays out its KV cache (``kv_layouts.py``; ValueError for one the model does not allow)."""
    from ..model import Transformer
    from .reference import ReferenceEngine

    if isinstance(model, Transformer):
        resolve_kv_layout(kv_layout, model.cfg.n_kv_heads, 1, None)
        return ReferenceEngine(model)
    scheme = getattr(model, "scheme", None)
    spec = SCHEMES.get(scheme)
    if spec is None or spec.inference is None:
        raise ValueError(f"generate supports the reference Transformer and the {', '.join(inference_schemes())} "
                         f"schemes, not {scheme or type(model).__name__!r}")
    view = model.shard_view()
    layout = resolve_kv_layout(kv_layout, model.cfg.n_kv_heads, view.comm.size, spec)
    engine = resolve(spec.inference)  # the engine the scheme's registry entry names
    return engine(view, layout) if spec.kv_layouts else engine(view)  # composed with its layout's steps


def check_request(cfg, prompts, max_new_tokens, temperature, top_k, top_p, prefill_chunk) -> list[list[int]]:
    """The prompts as lists of ints; ValueError (the same on every rank, before any communication) on bad input."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    clean = []
    for i, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {i} is empty; give at least one token")
        outside = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if outside:
            raise ValueError(f"prompt {i} has token id {outside[0]} outside the vocabulary [0, {cfg.vocab_size})")
        try:
            cfg.check_length(len(ids) + max_new_tokens, f"prompt {i} ({len(ids)} tokens) plus {max_new_tokens} new "
                                                        "tokens:")
        except ValueError as e:
            raise ValueError(f"{e}; shorten the prompt or ask for fewer tokens") from None
        clean.append(ids)
    check_sampling(temperature, top_k, top_p)
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive number of tokens, got {prefill_chunk}")
    return clean


def _sync(device) -> None:
    """Wait for the device before reading the clock (timing only; a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def generate(model, prompts, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, stop_token_ids=None, eos_token_id: int | None = None,
             schedule: str = "auto", prefill_chunk: int | None = None, return_logits: bool = False,
             on_step=None, kv_layout: str = "auto") -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after each prompt (a list of token-id lists).

    ``temperature`` 0 is greedy; otherwise tokens are sampled from softmax(logits / temperature), restricted
    to the ``top_k`` most likely and / or the ``top_p`` nucleus, with a generator seeded by ``seed`` (the
    same tokens at every D and scheme). A sequence ends after producing ``eos_token_id`` or any of
    ``stop_token_ids``. ``schedule`` (tsp; the other schemes have one schedule and ignore it): "auto"
    picks per phase by the tokens in flight, "weights" / "activations" force one. ``prefill_chunk``:
    prefill at most this many tokens per sequence at a time (bounds prefill activations; the cache
    still holds every token). ``on_step(t, ids)`` is called with each step's new ids [B_local] (-1 for
    finished sequences), e.g. to stream text. ``kv_layout`` (tsp): "auto", "heads", "grouped" or "sequence", the
    KV-cache layout decode runs on (``kv_layouts.py``); the other schemes accept "auto" or their own.
    """
    cfg = model.cfg
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of: {', '.join(SCHEDULES)}")
    prompts = check_request(cfg, prompts, max_new_tokens, temperature, top_k, top_p, prefill_chunk)
    stops = sorted({int(t) for t in (stop_token_ids or ())} | ({int(eos_token_id)} if eos_token_id is not None
                                                                 else set()))
    engine = make_engine(model, kv_layout)
    B = len(prompts)
    rows = engine.batch_rows(B)
    local = [prompts[i] if i < B else prompts[0] for i in range(rows.start, rows.stop)]  # DP pads its last share
    device = engine.device
    with on_host():  # the driver's knowledge of the lengths: host values, real in a fake-tensor trace too
        host_lengths = torch.tensor([len(p) for p in local])
    lengths = host_lengths.to(device)
    prompt_ids = [torch.tensor(p, device=device) for p in local]
    switch = cfg.rope.switch_length  # LongRoPE: a sequence that grows past it has its cache rebuilt (docs/inference.md)
    fed = torch.zeros(len(local), max_new_tokens, dtype=torch.long, device=device)  # the ids chosen so far

    def prefill(steps: int):
        """Prefill of every sequence's prompt and its first ``steps`` chosen ids, into a fresh cache sized for the
        rest; the logits of the next token."""
        with on_host():
            now = host_lengths + steps
            longest = int(now.max())
        chunk = _round_up(min(prefill_chunk or longest, longest), engine.token_multiple)
        tokens = torch.zeros(len(local), _round_up(longest, chunk), dtype=torch.long, device=device)
        for i, p in enumerate(prompt_ids):
            tokens[i, :len(p)] = p
            tokens[i, len(p):len(p) + steps] = fed[i, :steps]
        engine.choose_schedule(schedule, len(local), chunk)
        # The cache is made outside inference mode, as before LongRoPE's rebuilds ran this inside it: its tensors
        # stay ordinary ones (which a fake-tensor CUDA world moves as it should: tests/fake_cuda.py).
        with torch.inference_mode(False):
            engine.start(len(local), tokens.shape[1], max_new_tokens - steps)
        return engine.prefill(tokens, lengths + steps, chunk, now)

    select = TokenSelector(engine.vocab_comm, cfg.vocab_size, engine.vocab_start, B, rows, temperature, top_k,
                           top_p, seed, device)
    stop_ids = torch.tensor(stops, dtype=torch.long, device=device)
    new = torch.full((len(local), max_new_tokens), -1, dtype=torch.long, device=device)
    done = torch.zeros(len(local), dtype=torch.bool, device=device)
    seen_logits = []
    with torch.inference_mode():
        _sync(device)
        t0 = time.perf_counter()
        logits = prefill(0)
        ids = select(logits)
        _sync(device)
        prefill_s = time.perf_counter() - t0
        decode_s, steps = 0.0, 0
        for t in range(max_new_tokens):
            new[:, t] = torch.where(done, -1, ids)
            if return_logits:
                seen_logits.append(select.gather_full(logits))
            done |= torch.isin(ids, stop_ids)
            if on_step is not None:
                on_step(t, new[:, t])
            # The one host read of the loop (not of a step): stop early once every sequence has ended.
            if t + 1 == max_new_tokens or (stops and bool(done.all())):
                break
            t0 = time.perf_counter()
            fed[:, t] = ids
            with on_host():
                crossing = switch is not None and bool(((host_lengths + t <= switch) &
                                                        (host_lengths + t + 1 > switch)).any())
            if crossing:  # its K/V were written with the table before the switch: all are computed again
                logits = prefill(t + 1)
            else:
                with on_host():
                    engine.cache.expect(host_lengths + t + 1)
                logits = engine.decode(ids, lengths + t)
            ids = select(logits)
            _sync(device)
            decode_s, steps = decode_s + time.perf_counter() - t0, steps + 1
    if getattr(engine, "rows_comm", None) is not None:  # each replica decoded its own rows (Scheme.rows_over_dp)
        new, seen_logits = _gather_rows(engine.rows_comm, new, seen_logits, B, max_new_tokens)
    result_tokens = []
    # A fake-tensor trace (torchtsp.trace) chose no tokens it could read: its result holds the prompts alone.
    for prompt, row in zip(prompts, [[]] * len(prompts) if traced(new) else new.tolist()):
        result_tokens.append(prompt + [i for i in row if i >= 0])
    return GenerationResult(
        tokens=result_tokens, prompt_lengths=[len(p) for p in prompts], prefill_s=prefill_s,
        decode_s_per_token=decode_s / steps if steps else None, kv_cache_bytes=engine.kv_cache_bytes,
        schedule=dict(engine.schedule), kv_layout=engine.kv_layout, logits=seen_logits if return_logits else None)


def _gather_rows(comm, new, seen_logits, batch, max_new_tokens):
    """DP: every rank's rows -> all B rows on every rank (padding rows dropped)."""
    new = comm.all_gather(new, label="dp.tokens").flatten(0, 1)[:batch]
    if seen_logits:
        # Ranks may stop at different steps: pad to max_new_tokens steps with NaN.
        stacked = torch.full((max_new_tokens, *seen_logits[0].shape), float("nan"), device=new.device)
        stacked[: len(seen_logits)] = torch.stack(seen_logits)
        gathered = comm.all_gather(stacked, label="dp.logits").movedim(0, 1).flatten(1, 2)[:, :batch]
        seen_logits = list(gathered.unbind(0))
    return new, seen_logits
