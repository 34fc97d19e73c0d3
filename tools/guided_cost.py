"""guided_cost.py: what guided decoding costs a lone request, or a batch (a developer tool, GPU).

One greedy request (--batch N: N copies of it at once) on the default model (bf16 on a GPU),
EOS ignored: unguided, then under bench.guided_schema (a JSON array longer than the output, so
every token is masked). The engine's steps are timed one by one; the figures are medians over the
decode steps of --runs requests (or batches) of each kind, after an untimed one of each
(compiles, kernels' first launches):
- ms per output token (per step, at a batch), unguided and guided, and their ratio;
- the guided extension's before_sample per step: its host time (taking the last tokens, filling
  the mask, launching the copies and the masking), timed after the step in flight's tokens are
  on the host (before_sample would wait for them).
--profile N also runs the timed hook under cProfile and prints its N costliest functions (by
their own time) to stderr: where the host time goes (the figures above then include cProfile's).

With --batch 256 the hook's host time is W1's at its largest batch (the rows' matchers take a
token and fill a mask each, as in W1), on a model whose steps leave the host no slack.

    python tools/guided_cost.py [--tokens 200] [--runs 3] [--batch 1] [--json out.json]
                                [--profile 15]
"""
import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import guided_schema  # noqa: E402
from nanoserve import LLM, GuidedDecodingParams, SamplingParams  # noqa: E402
from nanoserve.config import Config  # noqa: E402
from nanoserve.model_runner import Extension  # noqa: E402

PROMPT = "Give a list of people, with their names, ids and tags, as JSON."


def step_times(llm: LLM, prompt: str, params: SamplingParams, batch: int = 1) -> list[float]:
    """Seconds of each engine step of `batch` copies of one request, after their first two (the
    prefill and the first decode step, which the overlap loop launches before it postprocesses
    the prefill)."""
    for _ in range(batch):
        llm.add_request(prompt, params)
    times = []
    while llm.has_unfinished():
        start = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - start)
    return times[2:]


class Start(Extension):
    """Starts the clock (and the profile) before the guided hook, once the step in flight's
    tokens are on the host: the hook's own host work is timed, not its wait for them."""

    def __init__(self, guided: Extension, profile: cProfile.Profile | None) -> None:
        self.guided, self.profile, self.started = guided, profile, 0.0

    def before_sample(self, logits, seqs):
        if self.guided.last is not None:
            self.guided.last[1].tolist()
        if self.profile is not None:
            self.profile.enable()
        self.started = time.perf_counter()
        return logits


class Stop(Extension):
    """Stops them after the guided hook; keeps the seconds of the steps with a guided row."""

    def __init__(self, start: Start, masks: list[float]) -> None:
        self.start, self.masks, self.profile = start, masks, start.profile

    def before_sample(self, logits, seqs):
        if self.profile is not None:
            self.profile.disable()
        if any(seq.params.guided_decoding is not None for seq in seqs):
            self.masks.append(time.perf_counter() - self.start.started)
        return logits


def measure(tokens: int, runs: int, device: str = "auto",
            profile: cProfile.Profile | None = None, batch: int = 1) -> dict:
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    with LLM(dtype=dtype, device=device, max_num_seqs=max(Config.max_num_seqs, batch)) as llm:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                   add_generation_prompt=True, tokenize=False)
        plain = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        guided = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                guided_decoding=GuidedDecodingParams(json=guided_schema("name")))
        step_times(llm, prompt, plain, batch), step_times(llm, prompt, guided, batch)  # warm-up
        ext, masks = llm.switched_on["guided"], []
        # the hook timed by two Extensions of this tool's, one on each side of it in the list
        at, start = llm.extensions.index(ext), Start(ext, profile)
        llm.extensions[at:at + 1] = [start, ext, Stop(start, masks)]
        steps = {"unguided": [], "guided": []}
        for _ in range(runs):  # the two kinds take turns
            steps["unguided"] += step_times(llm, prompt, plain, batch)
            steps["guided"] += step_times(llm, prompt, guided, batch)
    ms = {kind: 1e3 * statistics.median(times) for kind, times in steps.items()}
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "dtype": dtype, "tokens": tokens, "runs": runs, "batch": batch,
            "unguided_ms_per_token": round(ms["unguided"], 4),
            "guided_ms_per_token": round(ms["guided"], 4),
            "guided_over_unguided": round(ms["guided"] / ms["unguided"], 3),
            "before_sample_us": round(1e6 * statistics.median(masks), 1),
            "before_sample_steps": len(masks)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=200, help="output tokens a request (200)")
    p.add_argument("--runs", type=int, default=3, help="timed requests of each kind (3)")
    p.add_argument("--batch", type=int, default=1, help="copies of the request at once (1)")
    p.add_argument("--device", default="auto", help="the engine's device (auto: the GPU if any)")
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile the hook; print its N costliest functions to stderr")
    args = p.parse_args()
    profile = cProfile.Profile() if args.profile else None
    figures = measure(args.tokens, args.runs, args.device, profile, args.batch)
    print(json.dumps(figures))
    if profile is not None:
        pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
