"""What every rank of ``torchtsp serve`` runs: load the model, then engine steps until told to stop.

Rank 0 also owns the scheduler: it takes requests and cancellations from the HTTP process over one
authenticated local connection, decides each step's plan with the paged scheduler (``paged_scheduler``:
admission by free blocks, a token budget per step and a sequence cap; chunked prefills beside the decodes;
preemption of the newest sequence when blocks run out; prefix caching), broadcasts it to every rank
(``plan.exchange``; even when empty, every ``IDLE_S`` when idle, so the ranks stay in lockstep and a dead rank
shows up within the collective timeout), runs the step like every rank, and sends the step's tokens and
figures back.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field

from ..kv_layouts import DEFAULT_BLOCK_SIZE

IDLE_S = 0.05  # an idle engine still steps (an empty plan) this often: a heartbeat for /health
# A grammar compiles on the ranks' own threads while steps go on; one that has not compiled everywhere by then fails
# its request ("grammar_timeout"). Twice the HTTP side's check, which compiled it already within its deadline.
RANK_COMPILE_DEADLINE_S = 20.0
CPU_KV_CACHE_MB = 256.0  # the KV pool per rank when --kv-cache-mb is not given, on a CPU
GPU_KV_CACHE_SHARE = 0.9  # ... on a GPU: this share of the memory free once the weights are loaded


@dataclass
class ServeJob:
    """Everything a rank needs (picklable)."""

    load: object  # a generate_job.GenerateJob naming the model source, scheme, degrees, dtype, timeout
    address: tuple
    authkey: bytes
    max_num_seqs: int = 16
    max_model_len: int = 2048
    kv_cache_mb: float | None = None  # MiB per rank (None: CPU_KV_CACHE_MB, or GPU_KV_CACHE_SHARE of free memory)
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    prefill_chunk: int | None = None  # tokens of one prompt per step at most (None: only the budget)
    schedule: str = "auto"
    eos_token_id: int | None = None
    kv_layout: str = "auto"  # kv_layouts.py; checked by the launcher (generate_job.check_kv_layout)
    info: dict = field(default_factory=dict)


class StepPlanner:
    """Rank 0: the requests from the HTTP process, the paged scheduler over the block manager, each step's plan.

    ``blocks``: the ``blocks.KVBlockManager`` of the pool every rank holds. Request ids the ranks have seen
    (``known``) are cancelled in the plan; the others never reach them. Every request that ends without the
    ranks' word (cancelled, refused, too long, the server stopping) is reported in ``dropped``."""

    def __init__(self, runner, conn, blocks, max_num_batched_tokens: int = 2048, max_num_seqs: int = 16,
                 max_model_len: int = 2048, prefill_chunk: int | None = None):
        from .paged_scheduler import PagedScheduler

        self.runner, self.conn, self.max_model_len = runner, conn, max_model_len
        self.paged = PagedScheduler(blocks, max_num_batched_tokens, max_num_seqs, prefill_chunk,
                                    rebuild_at=runner.engine.cfg.rope.switch_length)
        self.admissions: dict = {}  # request id -> Admission, queued and not yet sent to the ranks
        self.known: set[int] = set()
        self.cancelled: set[int] = set()
        self.stopping = False
        self.draining = False  # shutting down: running requests go on, nothing waiting is admitted
        self.dropped: list[tuple[int, str]] = []  # (request id, reason): ended without the ranks' word
        # (request id, its prompt's tokens the prefix cache held) of the requests this step schedules first: a
        # request's usage reports it (a preempted one scheduled again counts its first admission's).
        self.cached_tokens: list[tuple[int, int]] = []
        self._pending = None  # the paged plan of the step in flight
        self.forget: set[int] = set()  # requests rank 0 ended that the ranks still hold (a failed step's)
        # Requests whose grammars the ranks compile (admitted to them at once, scheduled once compiled everywhere):
        # request id -> (Admission, deadline on the monotonic clock).
        self.compiling: dict[int, tuple] = {}
        self.compile_deadline_s = RANK_COMPILE_DEADLINE_S

    @property
    def waiting(self) -> list:
        return self.paged.waiting

    def has_work(self) -> bool:
        """Sequences to run now. Grammars still compiling are not: the loop then waits IDLE_S between its polls
        instead of spinning empty steps against the compiling threads."""
        return self.paged.has_work()

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
        from .paged_scheduler import RequestTooLong
        from .plan import admission_problem

        rid = getattr(admission, "request_id", -1)
        try:
            problem = admission_problem(admission, self.runner.cfg.vocab_size, self.max_model_len)
            if problem is None and admission.grammar is not None:  # to the ranks now, to compile; scheduled later
                self.paged.check_request(admission.prompt, admission.max_tokens)
                self.compiling[rid] = (admission, time.monotonic() + self.compile_deadline_s)
                self.admissions[rid] = admission
                return
            if problem is None:
                self._schedule(admission)
                return
            reason = "rejected"
        except RequestTooLong as e:
            problem, reason = str(e), "too_long"
        except Exception as e:  # noqa: BLE001 - not even an Admission's shape: that request fails, not the ranks
            problem, reason = f"{type(e).__name__}: {e}", "rejected"
        print(f"torchtsp: the engine refused request {rid}: {problem}"[:300], file=sys.stderr, flush=True)
        self.dropped.append((rid, reason))

    def _schedule(self, admission) -> None:
        """Hand a request to the paged scheduler (it waits there for blocks)."""
        self.paged.add_request(admission.request_id, admission.prompt, admission.max_tokens,
                               use_prefix_cache=admission.prompt_logprobs is None)
        self.admissions.setdefault(admission.request_id, admission)

    def _cancel(self, rids) -> list[int]:
        """Drop requests wherever they are (their blocks free at once); the ids the ranks know, to forget."""
        forget = []
        for rid in rids:
            if self.compiling.pop(rid, None) is not None or self.paged.cancel(rid):
                self.dropped.append((rid, "cancelled"))
                self.admissions.pop(rid, None)
                if rid in self.known:
                    self.known.discard(rid)
                    forget.append(rid)
        return sorted(forget)

    def plan(self, step: int):
        from .plan import StepPlan

        self.cached_tokens = []
        if self.stopping:
            return StepPlan(step, cancel=self._cancel([*self.paged.seqs, *self.compiling]), stop=True)
        if self.draining:  # the requests no rank has seen yet fail now
            self.cancelled |= set(self.admissions)
        cancel = sorted({*self._cancel(self.cancelled), *self.forget})
        self.cancelled.clear()
        self.forget.clear()
        plan = self.paged.schedule()
        plan.step, self._pending = step, plan
        scheduled = [*(r for r, _, _ in plan.prefill), *plan.decode]
        # A request first scheduled starts as a prefill past its cached prefix; it is still among the admissions.
        self.cached_tokens = [(r, start) for r, start, _ in plan.prefill if r in self.admissions]
        early = [r for r in self.compiling if r not in self.known]  # the ranks start compiling their grammars
        plan.admit = [self.admissions[r] for r in [*early, *scheduled] if r not in self.known]
        for rid in scheduled:
            self.admissions.pop(rid, None)
        plan.cancel, plan.poll = cancel, sorted(self.compiling)
        self.known.update(a.request_id for a in plan.admit)
        return plan

    def after(self, result) -> None:
        """The step's outcome: sequences advance, chosen tokens join them, ended ones free their blocks (those
        that ended without the ranks' word, refused by them, are reported in ``dropped``)."""
        if self._pending is None:
            return
        reasons = dict(result.finished)
        ended = self.paged.update(self._pending, dict(result.tokens), reasons, written=result.written)
        self._grammars(self._pending.poll, result.grammar_states)
        self._pending = None
        self.known.difference_update(reasons)
        for rid, why in ended:
            if rid not in reasons:  # rank 0 ended it without the ranks' word: they may still hold its state
                self.dropped.append((rid, why))
                if rid in self.known:
                    self.known.discard(rid)
                    self.forget.add(rid)

    def _grammars(self, polled: list[int], states: list[int]) -> None:
        """How the polled grammars stand on every rank (the minimum over the ranks: 1 compiled, 0 compiling, -1
        failed): compiled ones go to the paged scheduler; failed or late ones fail their request alone."""
        now = time.monotonic()
        for rid, state in zip(polled, states):
            if rid not in self.compiling:
                continue  # cancelled meanwhile
            admission, deadline = self.compiling[rid]
            if state == 1:
                del self.compiling[rid]
                self._schedule(admission)
            elif state < 0 or now > deadline:
                del self.compiling[rid]
                self.admissions.pop(rid, None)
                self.dropped.append((rid, "bad_grammar" if state < 0 else "grammar_timeout"))
                self.known.discard(rid)
                self.forget.add(rid)  # the ranks hold its state (and maybe a compile still running)

    def step_failed(self) -> None:
        """The step in flight raised: its requests fail ("error", reported in ``dropped``), nothing of it enters
        the prefix cache, and the next plan has the ranks forget them."""
        if self._pending is None:
            return
        for rid in self.paged.abandon(self._pending):
            self.dropped.append((rid, "error"))
            if rid in self.known:
                self.known.discard(rid)
                self.forget.add(rid)  # the ranks hold its state: the next plan's cancel clears it

    def figures(self) -> dict:
        blocks = self.paged.blocks
        return {"running": len(self.paged.running), "waiting": len(self.paged.waiting) + len(self.compiling),
                "kv_usage": blocks.usage,
                "num_preemptions": self.paged.num_preemptions, "prefix_queries": blocks.prefix_queries,
                "prefix_hits": blocks.prefix_hits}


def kv_cache_budget_bytes(kv_cache_mb: float | None, device) -> int:
    """The KV pool's bytes on this rank: the flag's, else the documented default for the device."""
    import torch

    if kv_cache_mb is not None:
        return int(kv_cache_mb * 2**20)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_KV_CACHE_SHARE)
    return int(CPU_KV_CACHE_MB * 2**20)


@dataclass(frozen=True)
class PoolSizing:
    """One rank's paged pool: ``pages`` pages shared by every block group (kv_layouts.KVGroups; one group for a model
    without sliding layers), each ``bytes_per_page`` (K and V of ``block_size`` tokens of ``group_size`` layers)."""

    pages: int
    bytes_per_page: int
    windows: tuple[int | None, ...]  # each group's (None: full attention)
    group_size: int
    block_size: int
    block_tokens: int  # tokens one block id covers (block_size x the ranks sharing a sequence's tokens)
    budget: int

    @property
    def least_pages(self) -> int:
        """The null page (with a sliding group), a block per full group and a decoding sequence's window per
        sliding group (``kv_layouts.window_blocks``), so that one token a step always fits."""
        from ..kv_layouts import window_blocks

        sliding = [w for w in self.windows if w is not None]
        return (len(self.windows) - len(sliding) + bool(sliding)
                + sum(window_blocks(w, self.block_tokens) for w in sliding))

    def check(self) -> None:
        if self.pages < self.least_pages:
            raise ValueError(f"--kv-cache-mb {self.budget / 2**20:.3g} holds {self.pages} pages of {self.block_size} "
                             f"tokens ({self.bytes_per_page} bytes per rank each) shared by the cache's "
                             f"{len(self.windows)} block groups (windows {list(self.windows)}), which need at least "
                             f"{self.least_pages}; raise --kv-cache-mb or lower --block-size")


def pool_sizing(cfg, engine, block_size: int, budget: int) -> PoolSizing:
    """This rank's pages from ``budget`` bytes: as many as fit, all shared by the groups (none set aside per group:
    each takes pages as its sequences need them, serve/blocks.py)."""
    from ..kv_layouts import KVGroups, bytes_per_block

    groups = KVGroups.of(cfg)
    per_page = bytes_per_block(groups.group_size, engine.kv_heads_per_rank, cfg.head_dim, engine.dtype.itemsize,
                               block_size)
    return PoolSizing(budget // per_page, per_page, groups.windows, groups.group_size, block_size,
                      block_size * engine.kv_token_ranks, budget)


def block_manager(runner, enable_prefix_caching: bool = True):
    """Rank 0's ``blocks.KVBlockManager`` over ``runner``'s pool: its pages and its groups' windows. No prefix
    cache for a RoPE table that reads the sequence's length (dynamic NTK, LongRoPE): a block's K/V then depend on
    the length of the sequence that wrote it, not on its tokens alone."""
    from .blocks import KVBlockManager

    reuse = enable_prefix_caching and not runner.engine.cfg.rope.reads_length
    return KVBlockManager(runner.pool.num_blocks, runner.block_tokens, reuse, runner.pool.groups.windows)


def run_serve_rank(job: ServeJob) -> dict:
    """On every rank: load, parallelize, size the KV pool, then engine steps until the plan says stop."""
    import torch

    from ..distributed import comm
    from ..distributed.comm import AxisComm
    from ..distributed.mesh import init_mesh
    from ..generate_job import _load_model, model_config_and_tokenizer
    from ..infer.api import make_engine
    from .batch import BatchRunner
    from .structured import Grammars

    load = job.load
    cfg, tokenizer, _ = model_config_and_tokenizer(load.source, load.location, load.tokenizer)
    mesh = init_mesh(**load.degrees, timeout_s=load.timeout_s)
    model = _load_model(load, cfg, mesh)
    engine = make_engine(model, job.kv_layout)
    control = AxisComm(comm.cpu_world_group(load.timeout_s), "serve.control", load.timeout_s)
    budget = kv_cache_budget_bytes(job.kv_cache_mb, engine.device)
    sizing = pool_sizing(cfg, engine, job.block_size, budget)
    # Every rank holds the same pages: the least any rank can afford.
    pages = control.all_gather(torch.tensor([sizing.pages]), label="serve.ready").amin()
    sizing = dataclasses.replace(sizing, pages=int(pages))
    sizing.check()
    runner = BatchRunner(engine, sizing.pages, job.block_size, job.schedule, job.eos_token_id,
                         Grammars(tokenizer, cfg.vocab_size, job.eos_token_id))
    conn = scheduler = None
    if control.rank == 0:
        from multiprocessing.connection import Client

        manager = block_manager(runner, job.enable_prefix_caching)
        conn = Client(tuple(job.address), authkey=job.authkey)
        conn.send(("ready", {"world": control.size, "engine": engine.scheme, "kv_layout": engine.kv_layout,
                             "num_blocks": manager.pool.total, "block_size": job.block_size,
                             "block_tokens": runner.block_tokens,
                             "kv_groups": [{"window": g.window} for g in manager.groups],
                             "kv_capacity_tokens": manager.capacity_tokens,
                             "kv_cache_bytes_per_rank": runner.pool.nbytes, "max_model_len": job.max_model_len}))
        scheduler = StepPlanner(runner, conn, manager, job.max_num_batched_tokens, job.max_num_seqs,
                              job.max_model_len, job.prefill_chunk)
    try:
        return _step_loop(control, runner, scheduler, conn)
    finally:
        if conn is not None:
            conn.close()


def _step_loop(control, runner, scheduler, conn) -> dict:
    """Engine steps in lockstep until a plan says stop (rank 0 plans, reports, and waits for work when idle)."""
    import torch

    from .plan import exchange

    step, steps = 0, 0
    while True:
        if scheduler is not None:
            scheduler.receive(0 if scheduler.has_work() else IDLE_S)
            plan = scheduler.plan(step)
        else:
            plan = None
        t0 = time.perf_counter()
        plan = exchange(control, plan)
        try:
            result = runner.step(plan)
            if plan.poll:  # every rank's word on the compiling grammars: the least ready one counts
                states = torch.tensor(result.grammar_states, dtype=torch.long)
                result.grammar_states = control.all_gather(states, label="serve.grammars").view(
                    control.size, -1).amin(dim=0).tolist()
        except BaseException:
            if scheduler is not None:  # nothing of the step enters the prefix cache; the rank then exits, and the
                scheduler.step_failed()  # HTTP process fails every stream with the launcher's word on the cause
            raise
        if scheduler is not None:
            scheduler.after(result)
            finished = result.finished + scheduler.dropped
            scheduler.dropped = []
            conn.send(("step", {"tokens": result.tokens, "finished": finished, "admitted": result.admitted,
                                "cached_tokens": scheduler.cached_tokens,
                                "logprobs": result.logprobs, "prompt_logprobs": result.prompt_logprobs,
                                **scheduler.figures(), "step_s": time.perf_counter() - t0}))
        steps += bool(plan.prefill or plan.decode or plan.admit or result.finished)
        if plan.stop:
            return {"steps": steps}
        step += 1
