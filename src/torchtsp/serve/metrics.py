"""Prometheus figures of one server (its own registry, so that several servers can live in one process).

vLLM's names under a ``torchtsp:`` prefix, each with a ``model_name`` label, so dashboards written for vLLM
read these with the prefix changed. prometheus_client appends ``_total`` to a Counter's name itself, so the
Counters are registered without it (``torchtsp:num_preemptions`` is exposed as ``torchtsp:num_preemptions_total``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "torchtsp:"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's values of request_success's finished_reason
# The worker's cumulative figures (step message key -> Counter attribute): each step adds what grew since the last.
CUMULATIVE = {"num_preemptions": "preemptions", "prefix_queries": "prefix_queries", "prefix_hits": "prefix_hits"}


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        r = self.registry = CollectorRegistry()

        def one(kind, name: str, doc: str, **kwargs):
            return kind(PREFIX + name, doc, ["model_name"], registry=r, **kwargs).labels(model_name=model_name)

        self.running = one(Gauge, "num_requests_running", "requests in the running batch (prefilling or decoding)")
        self.waiting = one(Gauge, "num_requests_waiting", "requests waiting on rank 0 for cache blocks or a batch "
                           "place (preempted ones included)")
        self.kv_usage = one(Gauge, "kv_cache_usage_perc", "fraction of the KV cache's blocks in use (0 to 1)")
        self.kv_capacity = one(Gauge, "kv_cache_capacity_tokens", "tokens the KV cache holds in all")
        self.preemptions = one(Counter, "num_preemptions", "running sequences preempted (freed, recomputed later)")
        self.prefix_queries = one(Counter, "prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = one(Counter, "prefix_cache_hits", "prompt tokens found in the prefix cache")
        self.prompt_tokens = one(Counter, "prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = one(Counter, "generation_tokens", "tokens generated")
        self.ttft = one(Histogram, "time_to_first_token_seconds", "arrival to first token", buckets=LATENCY_BUCKETS)
        self.itl = one(Histogram, "inter_token_latency_seconds", "time between two tokens of a request",
                       buckets=LATENCY_BUCKETS)
        self.tpot = one(Histogram, "request_time_per_output_token_seconds", "a request's mean time between its "
                        "tokens after the first", buckets=LATENCY_BUCKETS)
        self.e2e = one(Histogram, "e2e_request_latency_seconds", "arrival to the last token", buckets=E2E_BUCKETS)
        self.steps = one(Counter, "engine_steps", "engine steps (idle heartbeats included)")
        self.healthy = one(Gauge, "engine_healthy", "1 while the engine answers")
        self._success = Counter(PREFIX + "request_success", "finished requests by reason", ["model_name",
                                "finished_reason"], registry=r)
        for reason in FINISHED_REASONS:  # every reason shows from the start, at 0
            self._success.labels(model_name=model_name, finished_reason=reason)
        self._http = Counter(PREFIX + "http_requests", "HTTP requests answered", ["model_name", "endpoint", "status"],
                             registry=r)
        self._seen = dict.fromkeys(CUMULATIVE, 0)

    def on_ready(self, info: dict) -> None:
        self.kv_capacity.set(info["kv_capacity_tokens"])

    def on_step(self, body: dict) -> None:
        self.steps.inc()
        self.running.set(body["running"])
        self.waiting.set(body["waiting"])
        self.kv_usage.set(body["kv_usage"])
        for key, attribute in CUMULATIVE.items():
            grown = body[key] - self._seen[key]
            if grown > 0:  # a Counter only goes up; the worker's figure never goes down either
                getattr(self, attribute).inc(grown)
                self._seen[key] = body[key]

    def finished(self, reason: str) -> None:
        """A request ended: "stop" or "length" as it says, anything else (cancelled, failed, left) as "abort"."""
        reason = reason if reason in ("stop", "length") else "abort"
        self._success.labels(model_name=self.model_name, finished_reason=reason).inc()

    def http_request(self, endpoint: str, status: int | str) -> None:
        self._http.labels(model_name=self.model_name, endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
