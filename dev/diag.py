import sys, time
from pathlib import Path
sys.path.insert(0, ".")
from bench import QWEN3_0_6B, TEMPERATURE, build_random_qwen3, make_w1
from nanoserve import LLM, SamplingParams
model_dir = build_random_qwen3(Path.home() / ".cache/nanoserve/qwen3-0.6b-random", QWEN3_0_6B, "cuda")
wl = make_w1()
params = [SamplingParams(temperature=TEMPERATURE, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
with LLM(model_dir, max_model_len=4096) as llm:
    llm.generate([list(range(1, 17))], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    for i in range(3):
        t = time.perf_counter()
        llm.generate(wl.prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        print(f"run {i}: {dt:.3f} s, {wl.output_tokens / dt:,.0f} tok/s", flush=True)
