"""Prometheus metrics of the server, served at GET /metrics in the text format.

The engine loop thread writes them (after each command and each step, since only it may read the
engine's queues and blocks); a scrape reads them from the event loop, which prometheus_client
allows. Each server gets its own registry, so two servers in one process (tests) do not clash.
Names follow vLLM's (`vllm:` becomes `nanoserve_`); counters get prometheus_client's `_total`.
"""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nanoserve.extensions.stats import scheduler_stats
from nanoserve.llm_engine import LLMEngine, RequestOutput

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STEP_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SPEC_COUNTERS = {"num_drafts": "Sequence-steps that proposed draft tokens (speculative decoding)",
                 "num_draft_tokens": "Draft tokens proposed",
                 "num_accepted_tokens": "Draft tokens accepted"}


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.num_running = Gauge("nanoserve_num_requests_running",
                                 "Requests in the running queue (decoding)", registry=r)
        self.num_waiting = Gauge("nanoserve_num_requests_waiting",
                                 "Requests in the waiting queue (not started, preempted or "
                                 "part-way through a chunked prefill)", registry=r)
        self.kv_usage = Gauge("nanoserve_kv_cache_usage_perc",
                              "Share of KV blocks held by requests, 0..1", registry=r)
        self.prompt_tokens = Counter("nanoserve_prompt_tokens", "Prompt tokens of started "
                                     "requests", registry=r)
        self.prefix_hit_tokens = Counter("nanoserve_prefix_cache_hit_tokens",
                                         "Prompt tokens served by the prefix cache", registry=r)
        self.generation_tokens = Counter("nanoserve_generation_tokens", "Tokens generated",
                                         registry=r)
        self.num_finished = Counter("nanoserve_request_success", "Requests finished, by reason",
                                    ["finished_reason"], registry=r)
        self.num_aborted = Counter("nanoserve_num_aborted_requests", "Requests aborted (client "
                                   "disconnected, or shutdown)", registry=r)
        self.ttft = Histogram("nanoserve_time_to_first_token_seconds", "Arrival to first token",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("nanoserve_inter_token_latency_seconds",
                             "Time between two output tokens of a request", buckets=ITL_BUCKETS_S,
                             registry=r)
        self.e2e = Histogram("nanoserve_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=E2E_BUCKETS_S, registry=r)
        self.spec = {name: Counter(f"nanoserve_spec_decode_{name}", help, registry=r)
                     for name, help in SPEC_COUNTERS.items()}
        self.spec_seen = dict.fromkeys(SPEC_COUNTERS, 0)  # the engine's totals at the last look
        self.step_size = Histogram("nanoserve_iteration_num_requests",
                                   "Requests that advanced in one engine step (the batch)",
                                   buckets=STEP_SIZE_BUCKETS, registry=r)

    def observe_engine(self, engine: LLMEngine) -> None:
        """Queue lengths and KV usage, as the engine holds them now (extensions.stats)."""
        stats = scheduler_stats(engine.scheduler)
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(1 - stats.num_free_blocks / max(stats.num_blocks, 1))
        if (spec := engine.extensions.get("speculative")) is not None:  # its running totals:
            for name, counter in self.spec.items():  # add what is new
                counter.inc(getattr(spec.stats, name) - self.spec_seen[name])
                self.spec_seen[name] = getattr(spec.stats, name)

    def observe_output(self, out: RequestOutput, seconds: float, first: bool) -> None:
        """One request's output of a step: seconds since its arrival (first) or last output."""
        num_tokens = len(out.token_ids)
        if first:
            self.ttft.observe(seconds)
            self.prompt_tokens.inc(out.num_prompt_tokens)
            self.prefix_hit_tokens.inc(out.num_cached_tokens)
        else:
            for _ in range(num_tokens):  # a step that brought several tokens spreads its time
                self.itl.observe(seconds / num_tokens)
        self.generation_tokens.inc(num_tokens)

    def observe_finish(self, finish_reason: str, seconds: float) -> None:
        self.num_finished.labels(finished_reason=finish_reason).inc()
        self.e2e.observe(seconds)

    def observe_step(self, num_requests: int, engine: LLMEngine) -> None:
        if num_requests:
            self.step_size.observe(num_requests)
        self.observe_engine(engine)

    def render(self) -> bytes:
        return generate_latest(self.registry)
