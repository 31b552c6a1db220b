"""The serving core without HTTP: the serve scheduler's plans and continuous batching on every engine give
each request exactly what ``generate`` gives it alone (rows joining and leaving at different steps, prompts of
different lengths, greedy and seeded sampling side by side); streamed text with stop strings (the step plan's
encoding: test_serve_plan.py)."""

from __future__ import annotations

import copy
import multiprocessing
import time

import pytest
import torch

import torchtsp
from torchtsp.config import ModelConfig
from torchtsp.infer import generate, make_engine
from torchtsp.serve.batch import BatchRunner
from torchtsp.serve.plan import Admission, Sampling
from torchtsp.serve.text import TextStream
from torchtsp.serve.worker import StepPlanner

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 23)), [7] * 7, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [42]]
SAMPLING = [Sampling(), Sampling(0.8, 5, None, 11), Sampling(), Sampling(1.0, None, 0.9, 3), Sampling(0.7, None,
                                                                                                         None, 5)]
MAX_TOKENS = [9, 6, 9, 9, 4]
ARRIVALS = {0: [0], 2: [1, 2], 5: [3], 6: [4]}  # step -> requests arriving
CANCEL_AT = {8: 2}  # step -> request cancelled (its tokens so far must still be a prefix of its alone run)
CANCEL_IN_PREFILL = 3  # cancelled after its first prefill chunk (the prompt takes several)


def _model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=101, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    model = torchtsp.Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.1)
    return model


def serving(model, num_blocks=64, block_size=4, max_num_seqs=3, budget=16, prefill_chunk=4, schedule="auto",
            kv_layout="auto", max_model_len=48, prefix_caching=True, eos_token_id=None, grammars=None):
    """The serving core of one rank as ``worker.run_serve_rank`` builds it: a BatchRunner over a pool of
    ``num_blocks`` blocks (in each block group, or a count per group) and rank 0's StepPlanner over their block
    manager, fed through a pipe as the HTTP process feeds it; returns (runner, scheduler, the HTTP end of the pipe)."""
    from torchtsp.serve.worker import block_manager

    runner = BatchRunner(make_engine(model, kv_layout), num_blocks, block_size, schedule=schedule,
                         eos_token_id=eos_token_id, grammars=grammars)
    inbox, http = multiprocessing.Pipe()
    blocks = block_manager(runner, prefix_caching)
    scheduler = StepPlanner(runner, inbox, blocks, budget, max_num_seqs, max_model_len, prefill_chunk)
    return runner, scheduler, http


def run_steps(runner, scheduler, outputs: dict, ended: dict, steps: int = 1) -> None:
    """``steps`` engine steps of the serve loop: plan, run, tell the scheduler; tokens and ends collected."""
    for _ in range(steps):
        scheduler.receive(0)
        result = runner.step(scheduler.plan(0))
        scheduler.after(result)
        for i, t in result.tokens:
            outputs.setdefault(i, []).append(t)
        ended.update(result.finished + scheduler.dropped)
        scheduler.dropped = []


def drive(runner, scheduler, http, admissions, steps: int = 100) -> dict:
    """Submit ``admissions`` together and step until each has ended; per request id: its tokens, their logprobs, the
    prompt's logprobs and how it ended (with ``scheduler.dropped``)."""
    out = {a.request_id: {"tokens": [], "logprobs": [], "prompt": None, "finish": None} for a in admissions}
    for a in admissions:
        http.send(("submit", a))
    for step in range(steps):
        scheduler.receive(0)
        result = runner.step(scheduler.plan(step))
        scheduler.after(result)
        for rid, token in result.tokens:
            out[rid]["tokens"].append(token)
        for rid, lp, top in result.logprobs:
            out[rid]["logprobs"].append((lp, top))
        for rid, entries in result.prompt_logprobs:
            out[rid]["prompt"] = entries
        for rid, reason in result.finished + scheduler.dropped:
            out[rid]["finish"] = reason
        scheduler.dropped = []
        if all(o["finish"] for o in out.values()):
            return out
        if scheduler.compiling and not scheduler.has_work():  # as the serve loop: wait, do not spin empty steps
            time.sleep(0.01)
    raise AssertionError(f"the requests did not end in {steps} steps: {out}")


def serve_script(model, reference, schedule="auto", max_batch=3, prefill_chunk=4, kv_layout="auto"):
    """Run the arrivals through the serve ``StepPlanner`` and a BatchRunner (at most ``max_batch`` sequences), the
    requests and cancellations sent over a pipe as the HTTP process sends them; returns (served, alone, how
    each ended, blocks still held)."""
    alone = [generate(reference, [p], m, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                      seed=s.seed).new_tokens[0] for p, s, m in zip(PROMPTS, SAMPLING, MAX_TOKENS)]
    runner, scheduler, http = serving(model, max_num_seqs=max_batch, prefill_chunk=prefill_chunk, schedule=schedule,
                                      kv_layout=kv_layout)
    out = {i: [] for i in range(len(PROMPTS))}
    done = {}
    cancelled_in_prefill = False
    for step in range(100):
        for i in ARRIVALS.get(step, []):
            http.send(("submit", Admission(i, PROMPTS[i], MAX_TOKENS[i], SAMPLING[i])))
        if step in CANCEL_AT and CANCEL_AT[step] not in done:
            http.send(("cancel", CANCEL_AT[step]))
        seq = scheduler.paged.seqs.get(CANCEL_IN_PREFILL)
        if seq is not None and 0 < seq.num_computed < seq.prompt_len and not cancelled_in_prefill:
            http.send(("cancel", CANCEL_IN_PREFILL))
            cancelled_in_prefill = True
        run_steps(runner, scheduler, out, done)
        if len(done) == len(PROMPTS):
            break
    assert cancelled_in_prefill
    return [out[i] for i in range(len(PROMPTS))], alone, done, scheduler.paged.blocks.pool.total - \
        scheduler.paged.blocks.pool.num_free


def _check(served, alone, done):
    for i, (got, want) in enumerate(zip(served, alone)):
        if done[i] == "cancelled":
            assert len(got) < len(want) and got == want[:len(got)], i
        else:
            assert got == want, i
            assert done[i] == "length"


def test_reference_engine_batches_rows_of_different_lengths():
    model = _model()
    served, alone, done, left = serve_script(model, model)
    _check(served, alone, done)
    assert done[2] == done[CANCEL_IN_PREFILL] == "cancelled" and left == 0


def _on_ranks(scheme, schedule):
    reference = _model()
    model = torchtsp.parallelize(copy.deepcopy(reference), torchtsp.init_mesh(**{scheme: 2}), scheme).eval()
    layout = "sequence" if scheme == "tsp" else "auto"  # the heads layout: test_kv_layout_heads.py
    return serve_script(model, reference, schedule=schedule, prefill_chunk=8, kv_layout=layout)


@pytest.mark.parametrize("scheme,schedule", [("tsp", "weights"), ("tsp", "activations"), ("tp", "auto"),
                                             ("sp", "auto")])
def test_parallel_engines_batch_rows_of_different_lengths(pools, scheme, schedule):
    for served, alone, done, left in pools(2).run(_on_ranks, scheme, schedule):
        _check(served, alone, done)
        assert done[CANCEL_IN_PREFILL] == "cancelled" and left == 0


def test_text_stream_holds_back_stop_strings():
    pieces = ["the", " cat", " sat", " on", " the", " mat"]
    decode_ids = lambda ids: "".join(pieces[i] for i in ids)
    s = TextStream(decode_ids, ["on th"], skip_ids=set())
    deltas = [s.add(i) for i in range(6)]
    assert "".join(deltas) + s.finish() == "the cat sat " and s.stopped
    s = TextStream(decode_ids, [], skip_ids={5})
    assert "".join(s.add(i) for i in range(6)) + s.finish() == "the cat sat on the"


@pytest.mark.parametrize("flags,words", [
    (["--max-model-len", "100000"], "--max-model-len must be in"),
    (["--max-batch", "0"], "--max-num-seqs must be >= 1"),  # --max-batch is its alias
    (["--port", "0"], "--port must be in"),
    (["--timeout-s", "nan"], "--timeout-s"),
    (["--chat-template", "/nonexistent/template.jinja"], "--chat-template"),
])
def test_bad_serve_flags_are_one_line_before_any_rank(flags, words, capsys):
    from torchtsp.cli import main

    assert main(["serve", "--preset", "tiny", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchtsp: error:") and words in err and err.count("\n") == 1, err


def test_missing_serve_extra_is_one_line(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def without_fastapi(name, *args, **kwargs):
        if name == "fastapi":
            raise ImportError("No module named 'fastapi'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_fastapi)
    from torchtsp.cli import main

    assert main(["serve", "--preset", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'torchtsp[serve]'" in err and "fastapi" in err and err.count("\n") == 1
