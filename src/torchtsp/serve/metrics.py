"""Prometheus figures of one server (its own registry, so that several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("torchtsp_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("torchtsp_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("torchtsp_generation_tokens", "tokens generated", registry=r)
        self.queue = Gauge("torchtsp_queue_length", "requests waiting for a row of the batch", registry=r)
        self.running = Gauge("torchtsp_running_sequences", "sequences in the running batch", registry=r)
        self.kv_used = Gauge("torchtsp_kv_slots_used", "KV cache slots in use (tokens, prompt padding "
                             "included), per rank", ["rank"], registry=r)
        self.kv_total = Gauge("torchtsp_kv_slots_total", "KV cache slots allocated, per rank", ["rank"], registry=r)
        self.ttft = Histogram("torchtsp_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("torchtsp_time_per_output_token_seconds", "mean time between a request's tokens "
                              "after the first", buckets=LATENCY_BUCKETS, registry=r)
        self.steps = Counter("torchtsp_engine_steps", "engine steps (idle heartbeats included)", registry=r)
        self.healthy = Gauge("torchtsp_engine_healthy", "1 while the engine answers", registry=r)
        self.model_name = model_name

    def on_step(self, body: dict) -> None:
        self.steps.inc()
        self.queue.set(body["waiting"])
        self.running.set(body["running"])
        for rank, used in enumerate(body["kv_slots_used"]):
            self.kv_used.labels(rank=str(rank)).set(used)

    def set_capacity(self, per_rank: list[int]) -> None:
        for rank, total in enumerate(per_rank):
            self.kv_total.labels(rank=str(rank)).set(total)

    def render(self) -> bytes:
        return generate_latest(self.registry)
