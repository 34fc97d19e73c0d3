"""Temporary GPU profile of nanoserve on W1 (not committed)."""
import time, sys, collections, argparse
import torch
from bench import make_w1, resolve_model_dir
from nanoserve import LLM, SamplingParams

model_dir = resolve_model_dir(argparse.Namespace(model=None, tiny=False), cpu=False)
wl = make_w1()
t0 = time.perf_counter()
llm = LLM(model_dir, max_model_len=4096)
print("init s", time.perf_counter() - t0, "blocks", llm.config.num_kvcache_blocks, flush=True)
r, s = llm.model_runner, llm.scheduler
acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(obj, name, key, sync=False):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.perf_counter(); out = f(*a, **k)
        if sync: torch.cuda.synchronize()
        acc[key] += time.perf_counter() - t; cnt[key] += 1
        return out
    setattr(obj, name, g)
wrap(s, "schedule", "schedule"); wrap(s, "postprocess", "postprocess")
wrap(r, "prepare", "prepare"); wrap(r, "forward", "forward", True); wrap(r, "sample", "sample", True)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
acc.clear(); cnt.clear()
params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
t = time.perf_counter()
llm.generate(wl.prompts, params, use_tqdm=False)
total = time.perf_counter() - t
print(f"W1 total {total:.2f}s  {sum(wl.output_lens)/total:.0f} tok/s", flush=True)
for k in acc: print(f"  {k:12s} {acc[k]:7.2f}s  calls {cnt[k]}", flush=True)
# kernel breakdown of a few decode steps at batch 256
seqs = [llm.add_request(p, SamplingParams(temperature=0.6, max_tokens=40, ignore_eos=True)) for p in wl.prompts]
while any(x.num_output_tokens == 0 for x in seqs): llm.step()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(10): llm.step()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
prefill = [llm.add_request(p, SamplingParams(max_tokens=1)) for p in wl.prompts[:40]]
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    llm.step()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20), flush=True)
llm.shutdown()
