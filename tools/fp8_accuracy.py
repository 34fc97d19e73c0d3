"""fp8_accuracy.py: what an fp8 KV cache costs in accuracy, against the cache in the model's dtype.

Each model runs twice, kv_cache_dtype="auto" and "fp8", on the same prompts, greedy, with
SamplingParams(logprobs=5). Printed for each model:
- how many sequences stay token-identical over their first 16 and over all their tokens;
- over the tokens where both runs still agree (the prefix before their first difference): the mean
  and largest |delta logprob| of the sampled token, and the largest over the top-5 tokens of both;
- the range of the K and V values the model writes into its cache (read back from the "auto" run's
  cache), against e4m3's: the largest |value| (e4m3 saturates at 448), the share below 2^-6 (e4m3's
  subnormals, where a scale of 1 keeps fewer bits), and the relative RMS error of rounding them to
  e4m3 with nanoserve's scale of 1 and with a calibrated scale per layer (amax / 448).
CPU (default): the packaged default model (SmolLM2-135M-Instruct, float32) on the chat prompts of
tests/test_e2e.py, 32 tokens (EOS ends a sequence). --gpu: random Qwen3- and Llama-shaped models
(tests/test_gpu.py's) on random prompts, 24 tokens each, EOS ignored, in bf16 on a GPU (without
one, in float32 on the CPU reference path).
--round k or v (CPU): the second run keeps the cache in the model's dtype and rounds only K, or
only V, through e4m3 as it stores them: which of the two makes the sequences part.
--questions more (CPU): 48 other chat questions (MORE_QUESTIONS) in the place of the 8 of
tests/test_e2e.py, to see how far a count over 8 sequences carries.
--transformers (CPU): the rounding probe in transformers in the place of nanoserve: its model
greedy with K and V rounded through e4m3 in every attention call, as an fp8 cache holds them,
against the unrounded model, and both teacher-forced on the unrounded model's outputs.
--jitter N (CPU): how far the count of identical sequences is decided by near-ties. N more fp8
runs (or probe runs, with --transformers), each with every K and V value moved by a pseudo-random
relative amount below JITTER before its e4m3 rounding, a function of the value and the run: moves
no larger than the difference between nanoserve's and transformers' own float32 K and V (a median
of 5e-7 to 1e-6 relative, measured first), which tip some roundings the other way. Printed: the
count of each run.
--fa3 Q P (CPU): FlashAttention-3's fp8 products, emulated: the fp8 run's attention (both CPU
reference paths call torch SDPA) also rounds each query row to Q e4m3 terms (scaled by its amax /
448) and the softmax weights exp(s - max) to P terms, before the two products; the denominator
sums the unrounded weights. Q = P = 1 is FA3's recipe; 2 splits a value into hi + lo terms, two
products each; 0 leaves it (0 0: the emulation's own float32 against SDPA).
--teacher-forced: also ask every position of the "auto" run's outputs as a one-token request (its
prompt plus the tokens before it) of both caches, and count how often their top tokens agree and
the mean |delta logprob| of the "auto" run's token there. Sequences that part no longer decide what
is compared, and prefix-cache hits make every key come back from the cache, as in decode.

    python tools/fp8_accuracy.py [--gpu | --round k|v | --transformers | --fa3 Q P]
                                 [--questions e2e|more] [--teacher-forced] [--jitter N]
                                 [--json out.json]
"""
import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from nanoserve import LLM, SamplingParams, kernels  # noqa: E402
from nanoserve.kernels import rotary  # noqa: E402
from nanoserve.weights import default_model_dir  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest value
FP8_MIN_NORMAL = 2.0**-6  # below it e4m3 is subnormal: fewer significant bits
TOP_K = 5
MAX_TOKENS = 32  # a CPU sequence's new tokens, at most (docs/fp8_cache.md's figures)
PREFIX = 16  # sequences are also compared over their first PREFIX tokens
JITTER = 1e-6  # --jitter: the largest relative move of a K or V value before its rounding
PRIME = 1_000_003  # jitter's hash: values and runs mapped to [0, PRIME)
MORE_QUESTIONS = [  # short chat questions of the kind tests/test_e2e.py asks, none of its own
    "What is the boiling point of water in Celsius?",
    "Name a famous painting by Leonardo da Vinci.", "Why is the sky blue?", "What does a CPU do?",
    "Suggest a name for a pet goldfish.", "How do plants make food?",
    "What is the largest planet in our solar system?", "Give me a synonym for happy.",
    "What is the square root of 81?", "Describe a cat in one sentence.",
    "What language is spoken in Brazil?", "Write a short poem about autumn.", "What is gravity?",
    "How many days are in a leap year?", "Name three fruits that are red.",
    "What is the opposite of cold?", "Explain what an API is.", "Who wrote Romeo and Juliet?",
    "What is photosynthesis?", "Give a tip for staying focused while studying.",
    "What is the chemical symbol for gold?", "How many continents are there?", "What is a noun?",
    "Tell me a fun fact about octopuses.", "What is 7 plus 15?", "Why do we need sleep?",
    "What is the tallest mountain in the world?", "Explain recursion in one sentence.",
    "Name a musical instrument with strings.", "What is the freezing point of water in Fahrenheit?",
    "How does a rainbow form?", "What is the main ingredient of guacamole?",
    "Write one sentence about the moon.", "What is a prime number?",
    "Name two animals that live in the ocean.", "What is the capital of Japan?",
    "How many hours are in a day?", "What is a verb?", "Give me a healthy breakfast idea.",
    "What does DNA stand for?", "What is the speed of light, roughly?",
    "Explain what a database is.", "What color do you get by mixing blue and yellow?",
    "How many sides does a hexagon have?", "What is the capital of Italy?",
    "Why do leaves change color in autumn?", "Write a one-line motivational quote.",
    "What is machine learning?"]


def generate(llm: LLM, prompts: list, params: SamplingParams) -> tuple[list, list]:
    """Greedy token ids and per-token logprob dicts of each prompt."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o["token_ids"] for o in outs], [o["logprobs"] for o in outs]


def compare(auto: tuple[list, list], fp8: tuple[list, list]) -> dict:
    """The fp8 run against the auto run: identical sequences, and |delta logprob| over the tokens
    where both still agree."""
    (ids_a, lps_a), (ids_b, lps_b) = auto, fp8
    chosen, top = [], []
    for seq_a, steps_a, seq_b, steps_b in zip(ids_a, lps_a, ids_b, lps_b):
        for tok_a, lp_a, tok_b, lp_b in zip(seq_a, steps_a, seq_b, steps_b):
            if tok_a != tok_b:
                break
            chosen.append(abs(lp_a[tok_a] - lp_b[tok_b]))
            top.append(max(abs(lp_a[t] - lp_b[t]) for t in lp_a.keys() & lp_b.keys()))
    pairs = list(zip(ids_a, ids_b))
    return {"sequences": len(pairs),
            f"identical_first_{PREFIX}": sum(a[:PREFIX] == b[:PREFIX] for a, b in pairs),
            "identical_all": sum(a == b for a, b in pairs),
            "output_tokens": sum(map(len, ids_a)), "agreeing_tokens": len(chosen),
            "mean_abs_dlogprob": statistics.fmean(chosen), "max_abs_dlogprob": max(chosen),
            "max_abs_dlogprob_top5": max(top)}


def forced_requests(prompts: list, outputs: list) -> tuple[list, list]:
    """Every position of the outputs as a one-token request (the prompt and the output's tokens
    before it), and the token the output has there."""
    requests = [prompt + out[:t] for prompt, out in zip(prompts, outputs) for t in range(len(out))]
    return requests, [token for out in outputs for token in out]


def compare_forced(auto: tuple[list, list], fp8: tuple[list, list], chosen: list) -> dict:
    """One-token runs of the same requests: how often the top tokens agree, and |delta logprob| of
    the chosen tokens (where both runs' top-k hold one)."""
    (ids_a, lps_a), (ids_b, lps_b) = auto, fp8
    deltas = [abs(lp_a[0][t] - lp_b[0][t]) for lp_a, lp_b, t in zip(lps_a, lps_b, chosen)
              if t in lp_a[0] and t in lp_b[0]]
    return {"forced_positions": len(chosen), "forced_compared": len(deltas),
            "forced_top1_agreement": statistics.fmean(a == b for a, b in zip(ids_a, ids_b)),
            "forced_mean_abs_dlogprob": statistics.fmean(deltas)}


def rounding_error(x: Tensor, scale: float) -> float:
    """Relative RMS error of x (fp32) stored as e4m3 with this scale (x / scale, rounded, times
    scale)."""
    return float((x - (x / scale).to(FP8).float() * scale).norm() / x.norm())


def value_ranges(kv_cache: Tensor) -> dict:
    """K and V written into a cache that was zeroed first, per layer: the largest |value|, the share
    below e4m3's normal range, the rounding error with scale 1 and with a per-layer amax scale."""
    out = {}
    for name, cache in zip("KV", kv_cache):  # (layers, num_blocks, B, Hkv, D) each
        rows = cache.flatten(1, 2).flatten(2).float()  # (layers, slots, Hkv * D)
        written = (rows != 0).any(-1).any(0)  # (slots,) a slot that some layer wrote
        layers = [r[written] for r in rows]
        amax = [float(x.abs().max()) for x in layers]
        out[name] = {"amax": amax,
                     "subnormal_share": [float((x.abs() < FP8_MIN_NORMAL).float().mean())
                                         for x in layers],
                     "error_scale_1": [rounding_error(x, 1.0) for x in layers],
                     "error_amax_scale": [rounding_error(x, a / FP8_MAX)
                                          for x, a in zip(layers, amax)]}
    return out


@contextlib.contextmanager
def rounded_store(part: str):
    """Within it, the CPU reference store rounds only K (part "k") or only V ("v") through e4m3
    (as an fp8 cache would) before writing them into a cache in the model's dtype."""
    store = rotary.store_kv

    def store_rounded(key: Tensor, value: Tensor, *caches_and_slots: Tensor) -> None:
        def rounded(x: Tensor) -> Tensor:  # as an fp8 cache stores it, back in x's dtype
            return rotary.to_cache_dtype(x, torch.float8_e4m3fn).to(x.dtype)
        key, value = (rounded(key), value) if part == "k" else (key, rounded(value))
        store(key, value, *caches_and_slots)
    rotary.store_kv = kernels.store_kv = store_rounded  # both callers' names
    try:
        yield
    finally:
        rotary.store_kv = kernels.store_kv = store


def e4m3_terms(x: Tensor, terms: int, per_row: bool) -> Tensor:
    """x (fp32) as the sum of `terms` e4m3 values (what is left after each term is the next's),
    each scaled by its rows' amax / 448 (per_row) or by 1, rounded as the fp8 cache rounds."""
    out, rest = torch.zeros_like(x), x
    for _ in range(terms):
        scale = rest.abs().amax(-1, keepdim=True).clamp(min=1e-30) / FP8_MAX if per_row else 1.0
        term = kernels.to_cache_dtype(rest / scale, FP8).float() * scale
        out, rest = out + term, rest - term
    return out if terms else x


@contextlib.contextmanager
def fa3_products(terms_q: int, terms_p: int):
    """Within it, torch SDPA (the CPU decode and prefill reference paths) runs FA3's fp8 products:
    q rounded to terms_q e4m3 terms per row, the softmax weights p = exp(s - max) to terms_p terms
    before p @ v, the denominator summed from the unrounded p. attn_mask is a boolean mask."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def products(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor, scale: float,
                 enable_gqa: bool = False) -> Tensor:
        group = q.shape[-3] // k.shape[-3]  # (..., H, L, D): GQA repeats each KV head
        k, v = (x.float().repeat_interleave(group, -3) for x in (k, v))
        s = e4m3_terms(q.float(), terms_q, True) @ k.transpose(-1, -2) * scale  # (..., H, Lq, Lk)
        s = s.masked_fill(~attn_mask, float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True))  # in [0, 1], as FA3 rounds it
        return (e4m3_terms(p, terms_p, False) @ v / p.sum(-1, keepdim=True)).to(q.dtype)
    torch.nn.functional.scaled_dot_product_attention = products
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa


def jitter(x: Tensor, run: int) -> Tensor:
    """x with each value moved by u * JITTER relative, u in [-1, 1) a hash of the value's float32
    bits and the run: the same value moves the same way in the store and in the prefill's round
    trip, and each run tips other roundings."""
    bits = x.float().contiguous().view(torch.int32).long()
    h = (bits * 2_654_435_761 % PRIME + run * 7_919 + 1) % PRIME
    u = (h * h * 31 + run) % PRIME / PRIME * 2 - 1  # (x's shape) in [-1, 1)
    return (x.float() * (1 + JITTER * u)).to(x.dtype)


@contextlib.contextmanager
def jittered_rounding(run: int):
    """Within it, every rounding to e4m3 (the CPU store and the transformers probe both call
    kernels.to_cache_dtype) rounds jitter(x, run) in the place of x."""
    to_cache_dtype = rotary.to_cache_dtype

    def jittered(x: Tensor, dtype: torch.dtype) -> Tensor:
        return to_cache_dtype(jitter(x, run) if dtype == torch.float8_e4m3fn else x, dtype)
    rotary.to_cache_dtype = kernels.to_cache_dtype = jittered  # both callers' names
    try:
        yield
    finally:
        rotary.to_cache_dtype = kernels.to_cache_dtype = to_cache_dtype


def kv_difference_from_transformers(asked: list[str], num_prompts: int = 4) -> dict:
    """How far nanoserve's float32 K and V (read back from its cache) lie from transformers' own
    (its cache after one forward pass), relative, over the first num_prompts prompts and every
    layer: the median and the 90th percentile. A jitter of that size is float32-level."""
    from transformers import AutoModelForCausalLM

    model_dir = default_model_dir()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    diffs: dict[str, list[Tensor]] = {"K": [], "V": []}
    with LLM(model_dir, device="cpu", enable_prefix_caching=False) as llm:
        for prompt in chat_prompts(model_dir, asked)[:num_prompts]:
            kv_cache = llm.model_runner.kv_cache  # (2, layers, num_blocks, B, Hkv, D)
            kv_cache.zero_()  # then the prompt's slots are the non-zero ones
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            with torch.no_grad():
                theirs = hf(torch.tensor([prompt]), use_cache=True).past_key_values.layers
            for i, layer in enumerate(theirs):
                for name, ours, hf_kv in (("K", kv_cache[0, i], layer.keys),
                                          ("V", kv_cache[1, i], layer.values)):
                    rows = ours.flatten(0, 1)  # (slots, Hkv, D)
                    # a prompt gets never-used blocks, handed out in ascending order (the least
                    # recently freed first): its written slots, in order, are its tokens
                    written = (rows != 0).flatten(1).any(1).nonzero().flatten()
                    assert len(written) == len(prompt), "one written slot per prompt token"
                    hf_kv = hf_kv[0].transpose(0, 1)  # (1, Hkv, N, D) -> (N, Hkv, D)
                    diffs[name].append(((rows[written] - hf_kv).abs()
                                        / hf_kv.abs().clamp_min(1e-30)).flatten())
    quantiles = torch.tensor([0.5, 0.9])
    return {name: dict(zip(("median", "p90"), torch.quantile(torch.cat(d), quantiles).tolist()))
            for name, d in diffs.items()}


def jittered_counts(runs: int, asked: list[str], probe: bool) -> dict:
    """Sequences identical over PREFIX tokens in each of `runs` jittered fp8 runs (probe: the
    transformers probe), against the unrounded run, which the jitter does not touch: run once."""
    difference = kv_difference_from_transformers(asked)
    print(f"  nanoserve's K and V against transformers' (relative): {difference}")
    model_dir = default_model_dir()
    prompts = chat_prompts(model_dir, asked)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP_K)
    if probe:
        reference = probe_greedy(probe_model(model_dir, "sdpa"), prompts)
        rounded = probe_model(model_dir, "e4m3_rounded")  # rounds at each call
    else:
        with LLM(model_dir, device="cpu") as llm:
            reference = generate(llm, prompts, params)
    counts, means = [], []
    for run in range(runs):
        with jittered_rounding(run):
            if probe:
                r = compare(reference, probe_greedy(rounded, prompts))
            else:  # a fresh engine: no prefix-cache hit on the K and V of an earlier run
                with LLM(model_dir, device="cpu", kv_cache_dtype="fp8") as llm:
                    r = compare(reference, generate(llm, prompts, params))
        print(f"  jittered run {run}: {r[f'identical_first_{PREFIX}']}/{r['sequences']} "
              f"identical over {PREFIX} tokens, mean |dlogprob| {r['mean_abs_dlogprob']:.4f}",
              flush=True)
        counts.append(r[f"identical_first_{PREFIX}"])
        means.append(r["mean_abs_dlogprob"])
    half = sum(2 * c >= r["sequences"] for c in counts)
    return {"probe": probe, "jitter": JITTER, "kv_difference_from_transformers": difference,
            f"identical_first_{PREFIX}_per_run": counts,
            "runs_with_half_or_more": half, "mean_abs_dlogprob_per_run": means}


def measure(model_dir: str, prompts: list, params: SamplingParams, part: str = "kv",
            forced: bool = False, fa3: tuple | None = None, **engine) -> dict:
    """Greedy runs with the cache in the model's dtype ("auto") and in fp8 (part "kv"), or with
    only K or V rounded (part "k" or "v", CPU), compared; forced: teacher-forced too; fa3 (terms
    of q, of p): the fp8 run's attention runs FA3's fp8 products (CPU)."""
    runs, forced_runs = {}, {}
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=TOP_K)
    for kv in ("auto", "fp8"):
        store = rounded_store(part) if kv == "fp8" and part != "kv" else contextlib.nullcontext()
        products = fa3_products(*fa3) if kv == "fp8" and fa3 else contextlib.nullcontext()
        cache = "auto" if part != "kv" else kv
        with store, products, LLM(model_dir, kv_cache_dtype=cache, **engine) as llm:
            if kv == "auto":
                llm.model_runner.kv_cache.zero_()  # then the written slots are the non-zero ones
            runs[kv] = generate(llm, prompts, params)
            if kv == "auto":
                ranges = value_ranges(llm.model_runner.kv_cache)
                requests, chosen = forced_requests(prompts, runs["auto"][0])
            if forced:  # the "auto" run's outputs, asked of this cache
                forced_runs[kv] = generate(llm, requests, one)
    r = {**compare(runs["auto"], runs["fp8"]), "kv_ranges": ranges}
    return {**r, **compare_forced(forced_runs["auto"], forced_runs["fp8"], chosen)} if forced else r


def chat_prompts(model_dir: str, questions: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) for q in questions]


def cpu_results(part: str, asked: list[str], forced: bool = False,
                fa3: tuple | None = None) -> dict:
    model_dir = default_model_dir()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP_K)
    rounded = {"kv": "", "k": ", K rounded only", "v": ", V rounded only"}[part]
    rounded += f", FA3 products: q {fa3[0]} and p {fa3[1]} e4m3 terms" if fa3 else ""
    name = f"SmolLM2-135M-Instruct (float32, CPU{rounded}, {len(asked)} questions)"
    return {name: measure(model_dir, chat_prompts(model_dir, asked), params, part, forced, fa3)}


def probe_model(model_dir: str, attention: str):
    """transformers' model in float32 with this attention: "sdpa", or "e4m3_rounded", which rounds
    K and V through e4m3 (scale 1) in every attention call, after rotary, as an fp8 cache holds
    them."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded_attention(module, q: Tensor, k: Tensor, v: Tensor, *args, **kwargs):
        # looked up at each call: jittered_rounding replaces kernels.to_cache_dtype
        rounded = [kernels.to_cache_dtype(x, torch.float8_e4m3fn).to(x.dtype) for x in (k, v)]
        return sdpa_attention_forward(module, q, *rounded, *args, **kwargs)
    AttentionInterface.register("e4m3_rounded", rounded_attention)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation=attention).eval()


@torch.no_grad()
def probe_greedy(model, prompts: list) -> tuple[list, list]:
    """As generate: greedy token ids and per-token top-k logprob dicts of each prompt."""
    outs = [model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS,
                           do_sample=False)[0, len(p):].tolist() for p in prompts]
    return outs, [[top_logprobs(row) for row in rows] for rows in teacher_forced(model, prompts,
                                                                                 outs)]


@torch.no_grad()
def teacher_forced(model, prompts: list, outs: list) -> list[Tensor]:
    """(T, V) logprobs per prompt at every position of its output (T tokens)."""
    return [model(torch.tensor([p + o])).logits[0, len(p) - 1:-1].log_softmax(-1)
            for p, o in zip(prompts, outs)]


def transformers_results(asked: list[str]) -> dict:
    """The issue's rounding probe, on the CPU prompts: transformers' model greedy with K and V
    rounded (probe_model), against the unrounded model; and both teacher-forced on the unrounded
    model's outputs."""
    model_dir = default_model_dir()
    prompts = chat_prompts(model_dir, asked)
    runs, forced = {}, {}
    for kv, attention in (("auto", "sdpa"), ("fp8", "e4m3_rounded")):
        model = probe_model(model_dir, attention)
        runs[kv] = probe_greedy(model, prompts)
        forced[kv] = torch.cat(teacher_forced(model, prompts, runs["auto"][0]))  # (positions, V)
    chosen = torch.tensor([t for out in runs["auto"][0] for t in out])  # (positions,)
    deltas = (forced["auto"] - forced["fp8"]).gather(1, chosen[:, None]).abs()
    name = f"transformers, SmolLM2-135M-Instruct (float32, CPU, {len(asked)} questions)"
    return {name: {"what": "K and V rounded to e4m3 in attention vs not",
                   **compare(runs["auto"], runs["fp8"]), "forced_positions": len(chosen),
                   "forced_compared": len(chosen),
                   "forced_top1_agreement": float((forced["auto"].argmax(-1)
                                                   == forced["fp8"].argmax(-1)).float().mean()),
                   "forced_mean_abs_dlogprob": float(deltas.mean())}}


def top_logprobs(row: Tensor) -> dict:
    """{token: logprob} of the TOP_K most likely tokens of a (V,) row of logprobs."""
    values, tokens = row.topk(TOP_K)
    return dict(zip(tokens.tolist(), values.tolist()))


def gpu_results(forced: bool = False) -> dict:
    from test_gpu import MAX_TOKENS, SHAPES, prompts, save_random_model
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    results, dtype = {}, "bf16" if torch.cuda.is_available() else "float32, CPU"
    for name, make_config in SHAPES.items():
        with tempfile.TemporaryDirectory() as model_dir:
            save_random_model(make_config(), model_dir)
            results[f"random {name} shapes ({dtype})"] = measure(
                model_dir, prompts(n=16, seed=8), params, forced=forced,
                num_kvcache_blocks=4096, max_model_len=1024)
    return results


def report(name: str, r: dict) -> None:
    n = r["sequences"]
    what = r.get("what", "fp8 KV cache vs the model dtype's")
    print(f"\n{name}: {n} sequences, {r['output_tokens']} tokens ({what})\n  identical over "
          f"the first {PREFIX} tokens: {r[f'identical_first_{PREFIX}']}"
          f"/{n}; over all: {r['identical_all']}/{n}\n  over the {r['agreeing_tokens']} tokens "
          f"where both agree: mean |dlogprob| {r['mean_abs_dlogprob']:.4f}, max "
          f"{r['max_abs_dlogprob']:.4f}; max over the top-{TOP_K}: "
          f"{r['max_abs_dlogprob_top5']:.4f}")
    if "forced_positions" in r:
        print(f"  teacher-forced, {r['forced_positions']} positions: top tokens agree at "
              f"{100 * r['forced_top1_agreement']:.2f}%; mean |dlogprob| of the auto run's token "
              f"{r['forced_mean_abs_dlogprob']:.4f} (over {r['forced_compared']})")
    for kv, s in r.get("kv_ranges", {}).items():
        print(f"  {kv} over {len(s['amax'])} layers: max |value| {max(s['amax']):.3g} (per layer "
              f"{min(s['amax']):.3g}-{max(s['amax']):.3g}); below 2^-6: "
              f"{100 * statistics.fmean(s['subnormal_share']):.2f}% (at most "
              f"{100 * max(s['subnormal_share']):.2f}%); e4m3 rounding error (relative RMS) with "
              f"scale 1: {100 * statistics.fmean(s['error_scale_1']):.2f}%, with amax / 448: "
              f"{100 * statistics.fmean(s['error_amax_scale']):.2f}%")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", action="store_true", help="random Qwen3 and Llama shapes on a GPU")
    p.add_argument("--round", default="kv", choices=["kv", "k", "v"],
                   help="CPU: round K and V (an fp8 cache), or only K, or only V")
    p.add_argument("--questions", default="e2e", choices=["e2e", "more"],
                   help="CPU: the 8 chat questions of tests/test_e2e.py, or 48 others")
    p.add_argument("--teacher-forced", action="store_true",
                   help="also compare both caches on every position of the auto run's outputs")
    p.add_argument("--transformers", action="store_true",
                   help="CPU: the rounding probe in transformers (K and V rounded in attention), "
                        "greedy and teacher-forced, in the place of nanoserve's fp8 cache")
    p.add_argument("--jitter", type=int, default=0, metavar="N",
                   help="CPU: N more runs with K and V moved by float32-level amounts before "
                        "their rounding, to see which counts near-ties decide")
    p.add_argument("--fa3", type=int, nargs=2, choices=range(3), metavar=("Q", "P"),
                   help="CPU: the fp8 run's attention rounds q and the softmax weights to Q and "
                        "P e4m3 terms (FlashAttention-3's fp8 products: 1 1)")
    p.add_argument("--json", help="write the figures (per layer too) to this file")
    args = p.parse_args()
    if args.gpu and (args.round != "kv" or args.questions != "e2e" or args.transformers
                     or args.jitter or args.fa3):
        p.error("--round, --questions, --transformers, --jitter and --fa3 choose what the CPU "
                "run does: leave out --gpu")
    if args.fa3 and (args.round != "kv" or args.transformers or args.jitter):
        p.error("--fa3 changes the fp8 cache's attention: leave out --round, --transformers "
                "and --jitter")
    if args.jitter and args.round != "kv":
        p.error("--jitter moves the values an fp8 cache rounds: leave out --round")
    from test_e2e import QUESTIONS
    forced, asked = args.teacher_forced, QUESTIONS if args.questions == "e2e" else MORE_QUESTIONS
    if args.gpu:
        results = gpu_results(forced)
    elif args.transformers:
        results = transformers_results(asked)
    else:
        results = cpu_results(args.round, asked, forced, args.fa3 and tuple(args.fa3))
    for name, r in results.items():
        report(name, r)
    if args.jitter:
        print(f"\n{args.jitter} runs, K and V moved by up to {JITTER:g} relative before rounding:")
        j = results["jittered"] = jittered_counts(args.jitter, asked, args.transformers)
        print(f"identical over {PREFIX} tokens: {j[f'identical_first_{PREFIX}_per_run']}; half "
              f"or more in {j['runs_with_half_or_more']} of {args.jitter} runs")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
