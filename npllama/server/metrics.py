"""The server's Prometheus metrics (prometheus-client), in a registry of their own per server."""
from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, kv_pages: int):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("npllama_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.prompt_tokens = Counter("npllama_prompt_tokens", "Prompt tokens submitted to the engine", registry=r)
        self.cached_tokens = Counter("npllama_prompt_tokens_cached", "Prompt tokens taken from the prefix cache "
                                     "(pages shared with earlier prompts) instead of computed", registry=r)
        self.cancelled = Counter("npllama_cancelled_requests", "Requests whose client went away before the end",
                                 registry=r)
        self.generation_tokens = Counter("npllama_generation_tokens", "Tokens generated", registry=r)
        self.waiting = Gauge("npllama_queue_depth", "Requests waiting for a running slot", registry=r)
        self.running = Gauge("npllama_running_sequences", "Sequences in the running batch", registry=r)
        Gauge("npllama_kv_pages_total", "Pages in the KV pool", registry=r).set(kv_pages)
        self.kv_used = Gauge("npllama_kv_pages_used", "KV pool pages held by sequences", registry=r)
        self.kv_cached = Gauge("npllama_kv_pages_cached", "KV pool pages held only by the prefix cache",
                               registry=r)
        self.ttft = Histogram("npllama_time_to_first_token_seconds", "From submission to the first token",
                              buckets=_LATENCY, registry=r)
        self.latency = Histogram("npllama_request_duration_seconds", "Completion requests, start to end",
                                 buckets=_LATENCY, registry=r)
        self.tokens_per_second = Histogram("npllama_generation_tokens_per_second",
                                           "Each request's decode speed after its first token",
                                           buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000), registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
