"""Prometheus metrics of the server, served at GET /metrics in the text format.

The API server's receiving task writes them as the replicas' messages come in: the timings when a
request's tokens arrive, the gauges from each replica's report of its queues and blocks, each with
a `replica` label: the replica's rank, or "total" for them all. Each server gets its own registry,
so two servers in one process (tests) do not clash. Names follow vLLM's (`vllm:` becomes
`nanoserve_`); counters get prometheus_client's `_total`.
"""
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from nanoserve.llm_engine import RequestOutput

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STEP_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SPEC_COUNTERS = {"num_drafts": "Sequence-steps that proposed draft tokens (speculative decoding)",
                 "num_draft_tokens": "Draft tokens proposed",
                 "num_accepted_tokens": "Draft tokens accepted"}
GAUGES = {  # per replica (label: its rank, or "total"): name -> (help, its value from a load)
    "replica_up": ("1 while the replica serves, else 0", None),
    "num_requests_running": ("Requests in the running queue (decoding)", "num_running"),
    "num_requests_waiting": ("Requests in the waiting queue (not started, preempted or part-way "
                             "through a chunked prefill)", "num_waiting"),
    "kv_cache_usage_perc": ("Share of KV blocks held by requests, 0..1", "usage")}


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        counter, histogram = partial(Counter, registry=r), partial(Histogram, registry=r)
        self.gauges = {name: Gauge(f"nanoserve_{name}", help, ["replica"], registry=r)
                       for name, (help, _) in GAUGES.items()}
        self.prompt_tokens = counter("nanoserve_prompt_tokens", "Prompt tokens of started requests")
        self.prefix_hit_tokens = counter("nanoserve_prefix_cache_hit_tokens",
                                         "Prompt tokens served by the prefix cache")
        self.generation_tokens = counter("nanoserve_generation_tokens", "Tokens generated")
        self.num_finished = counter("nanoserve_request_success", "Requests finished, by reason",
                                    ["finished_reason"])
        self.num_aborted = counter("nanoserve_num_aborted_requests",
                                   "Requests aborted (the client disconnected)")
        self.ttft = histogram("nanoserve_time_to_first_token_seconds", "Arrival to first token",
                              buckets=TTFT_BUCKETS_S)
        self.itl = histogram("nanoserve_inter_token_latency_seconds",
                             "Time between two output tokens of a request", buckets=ITL_BUCKETS_S)
        self.e2e = histogram("nanoserve_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=E2E_BUCKETS_S)
        self.spec = {name: counter(f"nanoserve_spec_decode_{name}", help)
                     for name, help in SPEC_COUNTERS.items()}
        self.step_size = histogram("nanoserve_iteration_num_requests", "Requests that advanced "
                                   "in one engine step (the batch)", buckets=STEP_SIZE_BUCKETS)

    def observe_load(self, replicas: list) -> None:
        """Each replica's gauges as it last reported (0 while down), and their totals."""
        loads = {str(r.rank): {**r.load, "replica_up": r.up} for r in replicas}
        loads["total"] = {key: sum(load.get(key, 0) for load in loads.values())
                          for key in set().union(*loads.values())}
        for label, load in loads.items():
            num_blocks = load.get("num_blocks", 0)
            load["usage"] = (num_blocks - load.get("num_free_blocks", 0)) / max(num_blocks, 1)
            for name, (_, key) in GAUGES.items():
                self.gauges[name].labels(label).set(load.get(key or name, 0))

    def observe_output(self, out: RequestOutput, now: float, arrival: float,
                       last_token: float | None) -> None:
        """One request's output of a step, at `now`: the time since its arrival (the first) or
        its last output; a last output (wire.FinalOutput) also brings its speculative decoding's
        counts."""
        num_tokens, seconds = len(out.token_ids), now - (last_token or arrival)
        if last_token is None:
            self.ttft.observe(seconds)
            self.prompt_tokens.inc(out.num_prompt_tokens)
            self.prefix_hit_tokens.inc(out.num_cached_tokens)
        else:
            for _ in range(num_tokens):  # a step that brought several tokens spreads its time
                self.itl.observe(seconds / num_tokens)
        self.generation_tokens.inc(num_tokens)
        if out.finish_reason is not None:
            self.num_finished.labels(finished_reason=out.finish_reason).inc()
            self.e2e.observe(now - arrival)
            for name in SPEC_COUNTERS:  # speculation's
                self.spec[name].inc(getattr(out, name, None) or 0)

