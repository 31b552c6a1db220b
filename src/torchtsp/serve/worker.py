"""What every rank of ``torchtsp serve`` runs: load the model, then engine steps until told to stop.

Rank 0 also owns the scheduler: it takes requests and cancellations from the HTTP process over one
authenticated local connection, decides each step's plan (cancellations, then admissions in arrival order
while rows and cache slots allow), broadcasts it to every rank (``plan.exchange``; even when empty, every
``IDLE_S`` when idle, so the ranks stay in lockstep and a dead rank shows up within the collective
timeout), runs the step like every rank, and sends the step's tokens and figures back.
"""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass, field

IDLE_S = 0.05  # an idle engine still steps (an empty plan) this often: a heartbeat for /health
PREFILL_GROUP_TOKENS = 4096  # padded prompt tokens of one prefill group at most (a longer prompt still runs alone)


@dataclass
class ServeJob:
    """Everything a rank needs (picklable)."""

    load: object  # a generate_job.GenerateJob naming the model source, scheme, degrees, dtype, timeout
    address: tuple
    authkey: bytes
    max_num_seqs: int = 16
    max_model_len: int = 2048
    kv_cache_mb: float | None = None  # MiB per rank; None: decided on the ranks (CPU 256, CUDA 90% of free memory)
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    prefill_chunk: int | None = None  # a per-prompt cap per step; None: only the token budget
    schedule: str = "auto"
    eos_token_id: int | None = None
    kv_layout: str = "auto"  # kv_layouts.py; checked by the launcher (generate_job.check_kv_layout)
    info: dict = field(default_factory=dict)


class Scheduler:
    """Rank 0: the waiting queue, the cancellations, and each step's plan."""

    def __init__(self, runner, conn):
        self.runner, self.conn = runner, conn
        self.waiting: collections.deque = collections.deque()
        self.cancelled: set[int] = set()
        self.stopping = False
        self.draining = False  # shutting down: running requests go on, nothing waiting is admitted
        self.dropped: list[tuple[int, str]] = []  # (request id, reason): left the queue without reaching a rank

    def receive(self, timeout: float) -> None:
        while self.conn.poll(timeout):
            timeout = 0
            kind, *body = self.conn.recv()
            if kind == "submit":
                self._queue(body[0])
            elif kind == "cancel":
                self.cancelled.add(body[0])
            elif kind == "stop":
                self.stopping = True
            elif kind == "drain":
                self.draining = True

    def _queue(self, admission) -> None:
        from .plan import admission_problem

        vocab_size, max_model_len = self.runner.cfg.vocab_size, self.runner.max_model_len
        try:
            problem = admission_problem(admission, vocab_size, max_model_len)
        except Exception as e:  # noqa: BLE001 - not even an Admission's shape: that request fails, not the ranks
            problem = f"{type(e).__name__}: {e}"
        if problem is None:
            self.waiting.append(admission)
        else:
            rid = getattr(admission, "request_id", -1)
            print(f"torchtsp: the engine refused request {rid}: {problem}"[:300], file=sys.stderr, flush=True)
            self.dropped.append((rid, "rejected"))

    def plan(self, step: int):
        from .batch import round_up, row_slots
        from .plan import StepPlan

        runner = self.runner
        running = runner.active_ids()
        if self.stopping:
            return StepPlan(step, cancel=sorted(running), stop=True)
        if self.draining:
            self.dropped += [(a.request_id, "cancelled") for a in self.waiting]
            self.waiting.clear()
        cancel = sorted(running & self.cancelled)
        for a in [a for a in self.waiting if a.request_id in self.cancelled]:
            self.waiting.remove(a)
            self.dropped.append((a.request_id, "cancelled"))
        self.cancelled.clear()  # running ones leave in this plan; ids of finished requests are forgotten
        free = runner.max_batch - (len(running) - len(cancel))
        admit: list = []
        while self.waiting and len(admit) < free and runner.prefilling is None:
            group = [*admit, self.waiting[0]]
            padded = round_up(max(len(a.prompt) for a in group), runner.token_multiple)
            if any(row_slots(runner.token_ranks, padded, a.max_tokens) > runner.capacity for a in group):
                if not admit:  # not even alone (the HTTP checks make this impossible; never block the queue)
                    self.dropped.append((self.waiting.popleft().request_id, "too_long"))
                    continue
                break  # prefilled next to a longer prompt it would not fit its row: it waits for the next group
            if admit and padded * len(group) > PREFILL_GROUP_TOKENS:
                break
            admit.append(self.waiting.popleft())
        return StepPlan(step, admit=admit, cancel=cancel)


def run_serve_rank(job: ServeJob) -> dict:
    """On every rank: load, parallelize, then engine steps until the plan says stop."""
    import torch

    from ..distributed import comm
    from ..distributed.comm import AxisComm
    from ..distributed.mesh import init_mesh
    from ..generate_job import _load_model, model_config_and_tokenizer
    from ..infer.api import make_engine
    from .batch import BatchRunner
    from .plan import exchange
    from .structured import Grammars

    load = job.load
    cfg, tokenizer, _ = model_config_and_tokenizer(load.source, load.location, load.tokenizer)
    mesh = init_mesh(**load.degrees, timeout_s=load.timeout_s)
    model = _load_model(load, cfg, mesh)
    runner = BatchRunner(make_engine(model, job.kv_layout), job.max_num_seqs, job.max_model_len,
                         job.prefill_chunk or 512, job.schedule, job.eos_token_id,
                         Grammars(tokenizer, cfg.vocab_size, job.eos_token_id))
    control = AxisComm(comm.cpu_world_group(load.timeout_s), "serve.control", load.timeout_s)
    capacity = control.all_gather(torch.tensor([runner.capacity * runner.max_batch]), label="serve.ready")
    rank0 = control.rank == 0
    conn = scheduler = None
    if rank0:
        from multiprocessing.connection import Client

        conn = Client(tuple(job.address), authkey=job.authkey)
        slots = int(capacity.flatten()[0])
        conn.send(("ready", {"world": control.size, "engine": runner.engine.scheme,
                             "kv_layout": runner.engine.kv_layout,
                             "num_blocks": slots, "block_size": 1, "block_tokens": runner.token_ranks,
                             "kv_capacity_tokens": slots * runner.token_ranks,
                             "kv_cache_bytes_per_rank": runner.cache.nbytes, "max_model_len": job.max_model_len}))
        scheduler = Scheduler(runner, conn)
    step, steps = 0, 0
    try:
        while True:
            if rank0:
                scheduler.receive(0 if (runner.rows or runner.prefilling or scheduler.waiting) else IDLE_S)
                plan = scheduler.plan(step)
            else:
                plan = None
            t0 = time.perf_counter()
            plan = exchange(control, plan)
            result = runner.step(plan)
            used = control.all_gather(torch.tensor([runner.slots_used()]), label="serve.slots").flatten().tolist()
            if rank0:
                finished = result.finished + scheduler.dropped
                scheduler.dropped = []
                conn.send(("step", {"tokens": result.tokens, "finished": finished, "admitted": result.admitted,
                                    "logprobs": result.logprobs, "prompt_logprobs": result.prompt_logprobs,
                                    "running": len(runner.rows), "waiting": len(scheduler.waiting),
                                    "kv_usage": max(used) / max(1, runner.capacity * runner.max_batch),
                                    "num_preemptions": 0, "prefix_queries": 0, "prefix_hits": 0,
                                    "step_s": time.perf_counter() - t0}))
            steps += bool(plan.admit) or bool(runner.rows) or runner.prefilling is not None or bool(result.finished)
            if plan.stop:
                break
            step += 1
    finally:
        if conn is not None:
            conn.close()
    return {"steps": steps}
