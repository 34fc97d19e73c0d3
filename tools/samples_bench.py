"""Speed of several answers to one prompt (extensions/samples.py), one mode per fresh process.

    python tools/samples_bench.py samples   # 64 prompts x n = 8 samples x 256 tokens, shared blocks
    python tools/samples_bench.py separate  # the same 512 sequences as separate requests, no cache
    python tools/samples_bench.py beam      # beam search, beam_width 4, on the default model
    python tools/samples_bench.py all --runs 3  # each mode in 3 fresh processes, taking turns

`samples` and `separate` run Qwen3-0.6B's shapes with random bf16 weights (bench.py's model) on the
GPU, 1,000-token random prompts, temperature 1.0 and ignore_eos, after an untimed warm-up of the
same shape; `beam` runs the default model's chat prompts (tests/test_e2e.QUESTIONS). Each prints one
JSON line: the mode, output tokens, seconds and output tokens/s (beam: the tokens of every beam
step, beam_width a prompt a step); `all` prints each run's line and then each mode's median
tokens/s with the range. --tiny runs on the CPU, smaller (a tiny random Qwen3 for the
samples; 8-token beams): the smoke test of this script.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the chat prompts: tests/test_e2e.QUESTIONS
from bench import QWEN3_0_6B, QWEN3_TINY  # noqa: E402
from bench_utils import build_random_qwen3  # noqa: E402
from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.extensions.samples import BeamSearchParams, sample_params  # noqa: E402
from nanoserve.weights import default_model_dir  # noqa: E402

MODES = ("samples", "separate", "beam")


def random_model(tiny: bool) -> str:
    cache = Path(os.environ.get("NANOSERVE_CACHE", Path.home() / ".cache" / "nanoserve"))
    if tiny:
        return build_random_qwen3(cache / "qwen3-tiny-random", QWEN3_TINY, "cpu")
    return build_random_qwen3(cache / "qwen3-0.6b-random", QWEN3_0_6B, "cuda")


def run_samples(mode: str, tiny: bool) -> dict:
    """n samples a prompt with prefix caching (`samples`), or as many separate requests without
    it (`separate`): the same sequences, the same seeds, timed after a warm-up."""
    num_prompts, n, prompt_len, max_tokens = (4, 8, 100, 16) if tiny else (64, 8, 1000, 256)
    rng = random.Random(0)
    prompts = [[rng.randrange(10_000) for _ in range(prompt_len)] for _ in range(num_prompts + 1)]
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0, n=n)
    device = "cpu" if tiny else "cuda"
    singles = sample_params(params)  # separate requests: one each, the samples' seeds

    with LLM(random_model(tiny), device=device, enable_prefix_caching=mode == "samples") as llm:
        def run(batch: list) -> None:
            if mode == "samples":
                llm.generate(batch, params, use_tqdm=False)
            else:
                llm.generate([p for p in batch for _ in singles], singles * len(batch),
                             use_tqdm=False)
        run(prompts[-1:])  # warm-up: one prompt's samples, untimed
        start = time.perf_counter()
        run(prompts[:num_prompts])
        seconds = time.perf_counter() - start
    tokens = num_prompts * n * max_tokens
    return {"mode": mode, "sequences": num_prompts * n, "output_tokens": tokens,
            "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}


def run_beam(tiny: bool) -> dict:
    """Beam search, beam_width 4, 64 tokens at most, on the chat prompts; a prompt's search counts
    beam_width tokens a step, for as many steps as its longest beam."""
    from test_e2e import QUESTIONS
    width, max_tokens = 4, 8 if tiny else 64
    with LLM(default_model_dir(), device="cpu" if tiny else "cuda") as llm:
        chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                   add_generation_prompt=True, tokenize=True,
                                                   return_dict=False) for q in QUESTIONS]
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
        llm.beam_search(chats[:1], BeamSearchParams(beam_width=width, max_tokens=4))  # warm-up
        start = time.perf_counter()
        beams = llm.beam_search(chats, params)
        seconds = time.perf_counter() - start
    tokens = width * sum(max(len(b["token_ids"]) for b in found) for found in beams)
    return {"mode": "beam", "prompts": len(chats), "beam_width": width,
            "output_tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1)}


def run_all(runs: int, tiny: bool) -> dict:
    """Every mode `runs` times, each run a fresh process, the modes taking turns; per mode the
    median tokens/s and the range."""
    speeds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(runs):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, mode] + ["--tiny"] * tiny,
                                 capture_output=True, text=True, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            print(json.dumps(result), flush=True)
            speeds[mode].append(result["tokens_per_s"])
    return {mode: {"median_tokens_per_s": statistics.median(s), "range": [min(s), max(s)]}
            for mode, s in speeds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=[*MODES, "all"])
    parser.add_argument("--runs", type=int, default=3, help="with `all`: processes per mode")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model on the CPU")
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("needs a GPU (or --tiny, the CPU smoke run)")
    if args.mode == "all":
        result = run_all(args.runs, args.tiny)
    else:
        result = run_beam(args.tiny) if args.mode == "beam" else run_samples(args.mode, args.tiny)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
