"""profile_steps.py: where the time of a bench workload goes, step by step (a developer tool, GPU).

For every engine step it records the host time of each phase (schedule, prepare, launch, wait
for the sampled tokens, postprocess) and the GPU time between two CUDA events around forward +
sampling. It prints the totals by step kind and decode batch size, then (--kernels) torch.profiler
kernel tables of a few decode steps at batch 256 and at batch 32, and of a prefill. --guided one
or each guides every request as `bench.py --guided` does (the model paired with --tokenizer's
files, the packaged default model's by default) and times the guided extension's before_sample
as its own phase, `guided` (inside `run`, its in-flight wait in `wait`). The phases
are timed by wrapping the engine's methods: Scheduler's and ModelRunner's for both loops,
OverlapLoop's too with overlap scheduling. On a CPU it runs a tiny model, as a smoke test.

    python tools/profile_steps.py [--workload w1|w2] [--no-prefix-caching] [--no-overlap]
                                  [--kv-cache-dtype auto|fp8] [--kernels] [--prefill]
                                  [--guided off|one|each] [--tokenizer DIR] [--json out.json]
"""
import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import (  # noqa: E402
    QWEN3_0_6B,
    QWEN3_TINY,
    TEMPERATURE,
    make_w1,
    make_w2,
    nanoserve_params,
    resolve_model_dir,
    warmup_workload,
)
from bench_utils import build_random_qwen3  # noqa: E402
from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.extensions.overlap import OverlapLoop  # noqa: E402
from nanoserve.model_runner import StepOutput  # noqa: E402
from nanoserve.weights import default_model_dir  # noqa: E402

CUDA = torch.cuda.is_available()
BUCKETS = [(192, "decode b>=192"), (64, "decode b 64-191"), (16, "decode b 16-63"),
           (1, "decode b<16")]
KEYS = ["wall", "gpu", "schedule", "run", "prepare", "guided", "wait", "postprocess"]


def bucket(batch) -> str:
    if batch.is_prefill:
        return "prefill"
    return next(name for lo, name in BUCKETS if len(batch.seqs) >= lo)


def instrument(llm: LLM) -> list[dict]:
    """Wrap the engine's step phases with timers; returns the list each step appends its record
    to. A step's GPU time runs from the launch of its forward to the end of its sampling (CUDA
    events); with overlap the next step is scheduled, prepared and launched inside this step's
    call (OverlapLoop._launch_next), and its host time counts here."""
    runner, sched, records = llm.model_runner, llm.scheduler, []
    current: dict = {}
    active: set[str] = set()  # phases being timed: a nested call of the same phase adds nothing
    events: dict[int, tuple] = {}  # id(batch) -> (batch, start, end) CUDA events of its GPU work

    def timed(obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            if key in active:  # e.g. schedule() calling schedule_prefill()
                return fn(*a, **k)
            active.add(key)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                current[key] = current.get(key, 0.0) + time.perf_counter() - t
                active.discard(key)
        setattr(obj, name, wrapper)

    forward, run = runner.forward, runner.run

    def forward_with_event(inputs, input_ids=None):
        if CUDA:
            current["launch"] = torch.cuda.Event(enable_timing=True)
            current["launch"].record()
        return forward(inputs, input_ids)

    def run_with_events(batch, input_ids=None):
        out = run(batch, input_ids)
        if CUDA:  # the batch is kept in the dict, so its id is not reused while it waits there
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events[id(batch)] = (batch, current.pop("launch"), end)
        return out

    # the overlap loop calls these through the same runner and scheduler objects
    runner.forward, runner.run = forward_with_event, run_with_events
    timed(runner, "prepare", "prepare")
    timed(runner, "run", "run")
    for name in ("schedule", "schedule_prefill", "schedule_decode"):
        timed(sched, name, "schedule")
    timed(sched, "postprocess", "postprocess")
    if isinstance(llm.loop, OverlapLoop):  # its own halves: the next decode, dropping late tokens
        timed(llm.loop, "_schedule_decode", "schedule")
        timed(llm.loop, "_postprocess", "postprocess")
    timed(StepOutput, "tolist", "wait")
    if "guided" in llm.switched_on:  # its masks: inside run (sample), its in-flight wait in wait
        timed(llm.switched_on["guided"], "before_sample", "guided")
    step = llm.step

    def step_wrapper():
        current.clear()
        t = time.perf_counter()
        finished, batch = step()
        current["wall"] = time.perf_counter() - t
        if CUDA:
            _, start, end = events.pop(id(batch))
            end.synchronize()
            current["gpu"] = start.elapsed_time(end) / 1e3
        records.append({"kind": bucket(batch), "seqs": len(batch.seqs),
                        "tokens": sum(batch.num_new_tokens),
                        **{k: v for k, v in current.items() if k != "launch"}})
        return finished, batch
    llm.step = step_wrapper
    return records


def summarize(records: list[dict], total_s: float) -> dict:
    groups: dict = defaultdict(lambda: defaultdict(float))
    for r in records:
        g = groups[r["kind"]]
        g["steps"] += 1
        g["tokens"] += r["tokens"]
        for k in KEYS:
            g[k] += r.get(k, 0.0)
    print(f"\nwall {total_s:.3f} s over {len(records)} steps; seconds per group. gpu: CUDA event "
          "time from forward launch to end of sampling; run: host time launching (prepare "
          "included); wait: host waiting for sampled tokens")
    print(f"{'group':18} {'steps':>6} {'tokens':>8} " + " ".join(f"{k:>11}" for k in KEYS))
    for name, g in groups.items():
        print(f"{name:18} {int(g['steps']):6d} {int(g['tokens']):8d} "
              + " ".join(f"{g[k]:11.3f}" for k in KEYS))
    return {name: dict(g) for name, g in groups.items()}


def drain(llm: LLM) -> None:
    """Step until every request has finished and no step is left in flight."""
    while llm.scheduler.has_unfinished():
        llm.step()
    if llm.loop is not None:
        llm.loop.finish()  # a step launched for sequences that turned out finished


def kernel_table(llm: LLM, batch: int, context: int, prefill: bool = False) -> str:
    """torch.profiler over the prefill steps, or over 8 decode steps, of `batch` prompts of
    `context` tokens."""
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=12, ignore_eos=True)
    for i in range(batch):
        llm.add_request([(i * 7 + j) % 10000 + i for j in range(context)], params)
    while llm.scheduler.waiting and not prefill:  # the prefills, outside the profile
        llm.step()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(8):
            if prefill and not llm.scheduler.waiting:
                break
            llm.step()
        torch.cuda.synchronize()
    drain(llm)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=22,
                                     max_name_column_width=60)


def prefill_timing(llm: LLM, num_seqs: int = 16, prompt_len: int = 1024) -> None:
    """Time single prefill steps of random prompts (the plain loop's calls, no overlap): host
    time to launch vs GPU time; then their kernels."""
    rng = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=1, ignore_eos=True)

    def one_step():
        for _ in range(num_seqs):
            llm.add_request(torch.randint(0, 10000, (prompt_len,), generator=rng).tolist(), params)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch = llm.scheduler.schedule()
        t1 = time.perf_counter()
        out = llm.model_runner.run(batch)
        t2 = time.perf_counter()
        token_ids = out.tolist()
        t3 = time.perf_counter()
        llm.scheduler.postprocess(batch, token_ids)
        return t1 - t0, t2 - t1, t3 - t1, sum(batch.num_new_tokens)
    for _ in range(3):
        sched, launch, total, tokens = one_step()
        print(f"prefill step of {tokens} tokens: schedule {sched * 1e3:.1f} ms, "
              f"prepare+launch {launch * 1e3:.1f} ms, launch to tokens {total * 1e3:.1f} ms")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        one_step()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                    max_name_column_width=60))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="w1", choices=["w1", "w2"])
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-overlap", action="store_true", help="overlap_scheduling=False")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the KV cache's dtype (fp8 needs a GPU)")
    p.add_argument("--kernels", action="store_true",
                   help="also print the torch.profiler kernel tables")
    p.add_argument("--prefill", action="store_true",
                   help="only time and profile single prefill steps")
    p.add_argument("--guided", default="off", choices=["off", "one", "each"],
                   help="guide every request by one JSON schema, or each by its own (bench.py's)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="--guided: the tokenizer files to pair the model with (default: the "
                        "packaged default model's: no grammar accepts the random model's own)")
    p.add_argument("--json", help="write the per-group totals and every step's record here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    cache = Path.home() / ".cache/nanoserve"
    if CUDA:
        model_dir = build_random_qwen3(cache / "qwen3-0.6b-random", QWEN3_0_6B, "cuda")
        wl = make_w1() if args.workload == "w1" else make_w2()
    else:  # a smoke test of this script on the CPU
        model_dir = build_random_qwen3(cache / "qwen3-tiny-random", QWEN3_TINY, "cpu")
        wl = make_w1(8, 16, 64, 8, 32) if args.workload == "w1" else make_w2(8, 64, 8, 16, 16)
    if args.guided != "off":  # the model with a tokenizer whose tokens a grammar can accept
        tokenizer = args.tokenizer or default_model_dir()
        model_dir = resolve_model_dir(argparse.Namespace(model=model_dir, tiny=False,
                                                         tokenizer=tokenizer), not CUDA)
    with LLM(model_dir, max_model_len=4096, enable_prefix_caching=not args.no_prefix_caching,
             overlap_scheduling=not args.no_overlap, kv_cache_dtype=args.kv_cache_dtype) as llm:
        warm = warmup_workload(wl)  # as bench.py does
        llm.generate(warm.prompts, nanoserve_params(warm, args.guided), use_tqdm=False)
        if args.prefill:
            return prefill_timing(llm) if CUDA else None
        records = instrument(llm)
        before = torch.cuda.memory_stats() if CUDA else {}
        t = time.perf_counter()
        llm.generate(wl.prompts, nanoserve_params(wl, args.guided, 1), use_tqdm=False)
        total = time.perf_counter() - t
        if CUDA:  # the caching allocator's slow paths: each can block the host
            after = torch.cuda.memory_stats()
            keys = ("num_alloc_retries", "num_device_alloc", "num_device_free",
                    "num_sync_all_streams")
            print("allocator during the run:",
                  {k: after.get(k, 0) - before.get(k, 0) for k in keys})
        guided = "" if args.guided == "off" else f", guided ({args.guided})"
        print(f"{args.workload}{guided}: {wl.output_tokens / total:,.0f} tokens/s (instrumented: "
              "timers)")
        summary = summarize(records, total)
        if args.kernels and CUDA:
            for b, ctx in ((256, 600), (32, 1500)):
                print(f"\nkernels of 8 decode steps, batch {b}, context {ctx}\n"
                      + kernel_table(llm, b, ctx))
            print("\nkernels of the prefill steps of 32 prompts of 1000 tokens\n"
                  + kernel_table(llm, 32, 1000, True))
    if args.json:
        Path(args.json).write_text(json.dumps({"total_s": total, "groups": summary,
                                               "steps": records}))


if __name__ == "__main__":
    main()
