"""bench.py: nanoserve's offline throughput against Hugging Face transformers and the hardware.

Workloads. Every engine gets the same prompts and output lengths, samples at temperature 0.6 (as
nano-vllm's bench does) and ignores EOS, so each request yields exactly its max_tokens:
  w1  nano-vllm's workload. random.seed(0); 256 prompts of randint(100, 1024) token ids, each id
      randint(0, 10000); then 256 max_tokens of randint(100, 1024): 133,966 output tokens.
  w2  shared prefix. 256 requests = one 1,024-token prefix + randint(32, 128) own tokens, 128
      output tokens each; nanoserve runs twice, prefix caching on and off.
Both run Qwen3-0.6B's shapes with random bf16 weights, built and saved on this machine.
Throughput = output tokens / wall time of the whole run, prefill included. Before it, each engine
runs untimed as many random prompts of the same lengths for 1-16 tokens (warmup_workload). A run
under MIN_TIMED_SECONDS is repeated with its token ids relabeled (new to the prefix cache, same
shape), up to MAX_TIMED_RUNS runs, and the median counts.

Engines, one after the other in this process (each freed before the next starts):
  nanoserve  LLM.generate over all requests at once.
  hf-cb      transformers continuous batching (init_continuous_batching, paged sdpa attention,
             per-request max_new_tokens, EOS disabled) with the library's default settings, which
             include its own prefix sharing, so it also gains on w2.
  hf         transformers `generate` on static batches of --hf-batch-size in workload order, left
             padded. A batch decodes for its longest request and each request is credited only
             its own max_tokens: the wasted steps are static batching's, which continuous
             batching fixes.

Roofline: a decode step is memory-bound; it reads every weight once plus the KV cache of every
running sequence. We simulate the ideal schedule (all requests decode together, up to
max_num_seqs), add up the bytes of its steps and divide by HBM bandwidth: a lower bound on decode
time. "roof" = achieved tokens/s / bound tokens/s. Prefill is in the wall time but not in the
bound, so 100% is out of reach. On w2 each sequence reads its own copy of the prefix's KV. The KV
bytes are the cache's: 1 per value with --kv-cache-dtype fp8, whose rows have their own bound.

Output: a table, results/bench.json (rows and the run's conditions; --out PATH or --json PATH
writes it elsewhere) and --plot PATH (a bar chart). results/ is git-ignored; the files in docs/
change only when their path is given. CPU mode (--cpu, or no CUDA) runs the packaged default
model on small workloads, without a roofline.
  python bench.py                                     # GPU: w1 + w2, nanoserve + both HF peers
  python bench.py --cpu --engines nanoserve,hf        # a few minutes on a laptop CPU
  python bench.py --engines nanoserve --kv-cache-dtype auto,fp8   # nanoserve with each KV cache
  python bench.py --plot-from a.json,b.json --plot bench.png   # redraw saved results, merged
The HF peers take minutes on w1: split a long run with --engines/--workload, one --out each.
"""
import argparse
import atexit
import contextlib
import inspect
import itertools
import json
import logging
import os
import random
import shutil
import statistics
import struct
import sys
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, StrMethodFormatter

from bench_utils import (
    build_random_qwen3,
    free_memory,
    gpu_monitor,
    hardware_info,
    log,
    summarize_gpu,
)
from nanoserve.model_runner import Extension

if TYPE_CHECKING:  # names for the type hints; the peers import transformers where they run
    from transformers import PreTrainedModel
    from transformers.generation.continuous_batching import ContinuousBatchingManager

TEMPERATURE = 0.6          # nano-vllm's bench samples at 0.6; every engine uses the same
TOKEN_ID_MAX = 10_000      # prompt token ids are randint(0, TOKEN_ID_MAX)
RESULTS_DIR = "results"    # a run's files unless a path is given (git-ignored)
WARMUP_SEED = 1_000        # warm-up prompts: random, so they share no prefix with the timed ones
WARMUP_MAX_OUTPUT = 16     # warm-up requests generate 1 to this many tokens
MIN_TIMED_SECONDS = 3.0    # a workload that runs shorter is timed again (W2: 0.7 s on an H100)
MAX_TIMED_RUNS = 5         # ... up to this many runs in all; the row reports their median
MAX_NUM_SEQS = 512         # nanoserve's default batch limit, used by the roofline schedule
MIN_MODEL_LEN = 4096       # nanoserve's max_model_len, raised when a request needs more
TEXT_MAX_TOKENS = 512      # edit and chat: each request's max_tokens (most stop at EOS before)
CB_POLL_S = 1              # hf-cb: how long one wait for a finished request lasts
CB_STALL_S = 600           # hf-cb: give up when no request finishes for this long
CB_STOP_TIMEOUT_S = 60
PROGRESS_EVERY = 64        # hf-cb: log every this many finished requests
CB_CPU_MAX_BATCH_TOKENS = 1024  # hf-cb on the CPU: tokens per step (its cache: the workload's)
NOTE_MAX_CHARS = 200       # a failed engine's error, cut to fit a table row
GUIDED_MIN_RECORDS = 1000  # --guided: the schema's shortest document, longer than W1's outputs

QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                  tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1e6,
                  rms_norm_eps=1e-6)
# --tiny: the same code path with a model small enough for a CPU smoke test.
QWEN3_TINY = {**QWEN3_0_6B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}


# ----------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    name: str
    description: str
    prompts: list[list[int]]
    output_lens: list[int]  # each request's max_tokens
    temperature: float = TEMPERATURE
    ignore_eos: bool = True  # False: a request may stop early; tokens/s counts what it returned
    relabel: bool = True  # repeats run with relabeled ids (random ones), else the same prompts

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(0, TOKEN_ID_MAX) for _ in range(n)]


def make_w1(num_seqs: int = 256, min_input_len: int = 100, max_input_len: int = 1024,
            min_output_len: int = 100, max_output_len: int = 1024, seed: int = 0) -> Workload:
    """nano-vllm's bench: random.Random(seed) draws the same stream as random.seed(seed)."""
    rng = random.Random(seed)
    prompts = [random_ids(rng, rng.randint(min_input_len, max_input_len)) for _ in range(num_seqs)]
    output_lens = [rng.randint(min_output_len, max_output_len) for _ in range(num_seqs)]
    desc = (f"{num_seqs} random prompts of {min_input_len}-{max_input_len} tokens, "
            f"{min_output_len}-{max_output_len} output tokens, ignore_eos")
    return Workload("w1", desc, prompts, output_lens)


def make_w2(num_seqs: int = 256, prefix_len: int = 1024, min_own: int = 32, max_own: int = 128,
            output_len: int = 128, seed: int = 0) -> Workload:
    """One shared system prefix, then each request's own tokens."""
    rng = random.Random(seed)
    prefix = random_ids(rng, prefix_len)
    prompts = [prefix + random_ids(rng, rng.randint(min_own, max_own)) for _ in range(num_seqs)]
    desc = (f"{num_seqs} requests sharing a {prefix_len}-token prefix + {min_own}-{max_own} own "
            f"tokens, {output_len} output tokens each, ignore_eos")
    return Workload("w2", desc, prompts, [output_len] * num_seqs)


def make_text(name: str, texts: list[str], num_seqs: int, max_tokens: int,
              model_dir: str) -> Workload:
    """Chat prompts of real text (bench_prompts), cycled to num_seqs requests; greedy, each ending
    at EOS or max_tokens: what a user of the default model asks."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.chat_template is None:  # the random models' tokenizers have none
        from nanoserve.weights import default_model_dir
        raise SystemExit(f"the {name} workload needs a tokenizer with a chat template, and "
                         f"{model_dir}'s has none: add --tokenizer {default_model_dir()} (the "
                         "default model's)")
    prompts = [tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                       add_generation_prompt=True, return_dict=False)
               for text in (texts * num_seqs)[:num_seqs]]
    desc = (f"{num_seqs} chat prompts of {len(texts)} texts in bench_prompts.py, "
            f"greedy, up to {max_tokens} output tokens, stopping at EOS")
    return Workload(name, desc, prompts, [max_tokens] * num_seqs, temperature=0,
                    ignore_eos=False, relabel=False)


def warmup_workload(wl: Workload) -> Workload:
    """What each engine runs, untimed, before wl: as many random prompts of wl's length range (so
    prefill runs in the same chunks) with 1-16 output tokens (so batches shrink through the same
    sizes). First-time work (kernel loading, compilation, allocations) happens here."""
    lens = list(map(len, wl.prompts))
    warm = make_w1(len(lens), min(lens), max(lens), 1, WARMUP_MAX_OUTPUT, seed=WARMUP_SEED)
    warm.name = f"{wl.name}-warmup"
    return warm


class Sizes(NamedTuple):
    num_seqs: int
    max_input_len: int      # w1's longest prompt, w2's prefix
    max_output_len: int     # w1's longest output
    min_len: int            # w1's shortest prompt and output
    w2_output_len: int


GPU_SIZES = Sizes(256, 1024, 1024, 100, 128)    # the workloads as defined above
CPU_SIZES = Sizes(16, 256, 128, 32, 32)         # small enough for a few minutes on a CPU


def build_workloads(args: argparse.Namespace, cpu: bool,
                    model_dir: str | None = None) -> list[Workload]:
    """Full-size workloads on a GPU, small ones on a CPU; --num-seqs/--max-*-len scale both. The
    text workloads (edit, chat) use model_dir's chat template."""
    import bench_prompts
    size = CPU_SIZES if cpu else GPU_SIZES
    n = args.num_seqs or size.num_seqs
    max_in = args.max_input_len or size.max_input_len
    max_out = args.max_output_len or size.max_output_len
    builders = {
        "w1": lambda: make_w1(n, min(size.min_len, max_in), max_in,
                              min(size.min_len, max_out), max_out),
        "w2": lambda: make_w2(n, max_in, output_len=args.max_output_len or size.w2_output_len),
        "edit": lambda: make_text("edit", bench_prompts.EDITING, args.num_seqs or 20,
                                  args.max_output_len or TEXT_MAX_TOKENS, model_dir),
        "chat": lambda: make_text("chat", bench_prompts.CHAT, args.num_seqs or 20,
                                  args.max_output_len or TEXT_MAX_TOKENS, model_dir),
    }
    return [builders[name]() for name in args.workload.split(",")]


def resolve_model_dir(args: argparse.Namespace, cpu: bool) -> str:
    """--model (`default`: the packaged default model), else the random Qwen3-0.6B (GPU), the
    packaged default model (CPU) or --tiny; with --tokenizer, that model with another tokenizer."""
    model_dir = model_weights_dir(args, cpu)
    if not args.tokenizer:
        return model_dir
    # a directory of links: the model's config and weights, the tokenizer's files
    paired = Path(tempfile.mkdtemp(prefix="nanoserve-bench-"))
    atexit.register(shutil.rmtree, paired, ignore_errors=True)  # links only: gone at exit
    for src in (model_dir, args.tokenizer):
        for f in Path(src).iterdir():
            if (src == model_dir) != f.name.startswith(("tokenizer", "special_tokens", "vocab",
                                                        "merges", "chat_template")):
                (paired / f.name).symlink_to(f.resolve())
    return str(paired)


def model_weights_dir(args: argparse.Namespace, cpu: bool) -> str:
    if args.model and args.model != "default":
        if not (Path(args.model) / "config.json").is_file():
            raise SystemExit(f"--model {args.model} is no model directory (it has no config.json): "
                             "pass a Hugging Face layout directory, or `default`")
        return args.model
    cache = Path(os.environ.get("NANOSERVE_CACHE", Path.home() / ".cache" / "nanoserve"))
    if args.tiny:
        return build_random_qwen3(cache / "qwen3-tiny-random", QWEN3_TINY, "cpu" if cpu else "cuda")
    if cpu or args.model == "default":
        from nanoserve.weights import default_model_dir
        return default_model_dir()
    return build_random_qwen3(cache / "qwen3-0.6b-random", QWEN3_0_6B, "cuda")


# ----------------------------------------------------------------------------- engines
# An engine is a context manager: it loads the model and yields a generate function, which runs
# a workload and returns the tokens generated for each request; on exit it lets the model go.
Generate = Callable[[Workload], list[int]]
EngineFactory = Callable[[str, Workload, argparse.Namespace, str],
                         AbstractContextManager[Generate]]


def guided_schema(key: str) -> dict:
    """--guided's JSON schema: an array of at least 1,000 records, longer than any W1 output, so
    a guided request runs to its max_tokens as an unguided one does (EOS ignored) and every one
    of its tokens is masked. `key` names the records' first field: new keys, new grammars."""
    string = {"type": "string"}
    record = {"type": "object", "required": [key, "id", "tags"], "properties": {
        key: string, "id": {"type": "integer"}, "tags": {"type": "array", "items": string}}}
    return {"type": "array", "items": record, "minItems": GUIDED_MIN_RECORDS}


def nanoserve_params(wl: Workload, guided: str = "off", run: int = 0) -> list:
    """Each request's SamplingParams: the bench temperature, its own max_tokens, EOS ignored;
    guided "one": all by one JSON schema, "each": each by its own (new in every run, so each
    run compiles 256 grammars)."""
    from nanoserve import SamplingParams
    schemas: list = [None] * len(wl.output_lens)
    if guided != "off":
        from nanoserve import GuidedDecodingParams
        schemas = [GuidedDecodingParams(json=guided_schema(
            "name" if guided == "one" else f"name_{run}_{i}")) for i in range(len(schemas))]
    return [SamplingParams(temperature=wl.temperature, max_tokens=n, ignore_eos=wl.ignore_eos,
                           guided_decoding=schema) for n, schema in zip(wl.output_lens, schemas)]


class FirstTokens(Extension):
    """An engine Extension (its after_step hook; in LLMEngine.extensions for one run): when each
    request of a run got its first token, in seconds since the run began (all its requests
    arrive then)."""

    def __init__(self) -> None:
        self.start, self.seconds = time.perf_counter(), {}
        self.last, self.decode = None, []  # decode steps: (batch size, seconds since the last)

    def after_step(self, batch, finished: list) -> None:
        now = time.perf_counter() - self.start
        for seq in batch.seqs:
            if seq.num_output_tokens and seq.seq_id not in self.seconds:
                self.seconds[seq.seq_id] = now
        if self.last is not None and not batch.is_prefill:
            self.decode.append((len(batch.seqs), now - self.last))
        self.last = now

    def decode_step_ms(self) -> float:
        """The decode step's period as an output token sees it: the median over tokens (a step
        of n sequences counts n times), in ms; what a server's ITL p50 would be at best."""
        steps, seen = sorted(self.decode, key=lambda step: step[1]), 0
        half = sum(n for n, _ in steps) / 2
        for n, seconds in steps:
            seen += n
            if seen >= half:
                return 1e3 * seconds
        return float("nan")

    def summary(self) -> str:
        ttft = sorted(self.seconds.values())
        return (f"median {1e3 * statistics.median(ttft):,.0f} ms, p90 "
                f"{1e3 * ttft[int(0.9 * (len(ttft) - 1))]:,.0f} ms")


@contextlib.contextmanager
def nanoserve_engine(model_dir: str, wl: Workload, args: argparse.Namespace, device: str,
                     prefix_caching: bool = True, kv_cache_dtype: str = "auto",
                     speculative: str = "off", guided: str = "off") -> Iterator[Generate]:
    """nanoserve's LLM, given all of a workload's requests at once. The first one the bench
    starts records its first timed run for --timeline (the recording's host time is in that run;
    the warm-up and the repeats of a short workload run without it). With speculation its
    acceptance over all runs is logged at the end, and each timed run's time to first token.
    guided: see nanoserve_params."""
    from nanoserve import LLM
    from nanoserve.extensions.timeline import Timeline
    timeline_path = vars(args).pop("timeline", None)  # taken: later nanoserve runs record nothing
    max_len = max(len(p) + n for p, n in zip(wl.prompts, wl.output_lens))
    recorded: list[Timeline] = []
    flags = vars(parse_args([])) | vars(args)  # the command line's defaults for flags not given
    with LLM(model_dir, enforce_eager=args.eager, enable_prefix_caching=prefix_caching,
             tensor_parallel_size=args.tp, max_model_len=max(MIN_MODEL_LEN, max_len),
             device=device, kv_cache_dtype=kv_cache_dtype, max_num_seqs=flags["max_num_seqs"],
             dtype=flags["dtype"], speculative_method=None if speculative == "off" else speculative,
             num_speculative_tokens=flags["num_speculative_tokens"],
             batch_invariant=flags["batch_invariant"]) as llm:
        step, steps, first_tokens = llm.step, [], []  # per run: engine steps, FirstTokens

        def counted_step() -> tuple:
            steps[-1] += 1
            return step()

        llm.step = counted_step

        def generate(w: Workload) -> list[int]:
            # the first timed run is recorded (repeats are relabeled copies), every run timed
            observers = [FirstTokens()] + ([Timeline(llm)] if timeline_path and w is wl else [])
            steps.append(0)
            params = nanoserve_params(w, guided, len(steps))
            llm.extensions += observers  # (the list itself: the model runner holds it too)
            outs = llm.generate(w.prompts, params, use_tqdm=False)
            del llm.extensions[-len(observers):]
            first_tokens.append(observers[0])
            recorded.extend(observers[1:])  # one run recorded: the engine stops recording
            return [len(o["token_ids"]) for o in outs]
        generate.first_tokens = first_tokens
        yield generate
        log(f"   engine steps per run: {', '.join(map(str, steps[1:]))} (warm-up: {steps[0]})")
        log(f"   time to first token: {'; '.join(f.summary() for f in first_tokens[1:])}")
        if counts := llm.loop.counts():  # speculation's
            mean = 1 + counts["num_accepted_tokens"] / max(counts["num_drafts"], 1)
            log(f"   speculation (warm-up included): {counts['num_draft_tokens']:,} tokens "
                f"drafted, {counts['num_accepted_tokens']:,} accepted, {mean:.2f} tokens per "
                "sequence-step with drafts")
    if recorded:  # drawn after the timing
        recorded[0].plot(timeline_path)
        log(f"wrote {timeline_path}")


def load_hf_model(model_dir: str, attn_implementation: str, device: str) -> "PreTrainedModel":
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto",
                                                 attn_implementation=attn_implementation)
    return model.to(device).eval()


def pad_token_id(model: "PreTrainedModel") -> int:
    cfg = model.config
    return next((t for t in (cfg.pad_token_id, cfg.eos_token_id, 0) if isinstance(t, int)), 0)


def hf_generate_batch(model: "PreTrainedModel", prompts: list[list[int]], num_new: int,
                      pad_id: int) -> torch.Tensor:
    """One static batch, left padded so every row's last prompt token sits in the last column."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                         max_new_tokens=num_new, min_new_tokens=num_new,  # EOS never ends a row
                         do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                         pad_token_id=pad_id)
    return out[:, width:]                                                 # (batch, num_new)


def hf_static_batches(model: "PreTrainedModel", wl: Workload, bs: int,
                      pad_id: int) -> list[int]:
    """wl in static batches of bs, in order; returns the tokens credited to each request."""
    from nanoserve.config import cdiv
    lengths, start, num_batches = [], time.perf_counter(), cdiv(len(wl.prompts), bs)
    for i in range(0, len(wl.prompts), bs):
        want = wl.output_lens[i:i + bs]
        new = hf_generate_batch(model, wl.prompts[i:i + bs], max(want), pad_id)
        lengths += [min(new.shape[1], n) for n in want]           # credit each its own max_tokens
        log(f"  hf: batch {i // bs + 1}/{num_batches} done at {time.perf_counter() - start:.1f}s")
    return lengths


@contextlib.contextmanager
def hf_engine(model_dir: str, wl: Workload, args: argparse.Namespace,
              device: str) -> Iterator[Generate]:
    """transformers `generate` on static batches of --hf-batch-size (hf_static_batches)."""
    model = load_hf_model(model_dir, "sdpa", device)
    yield partial(hf_static_batches, model, bs=args.hf_batch_size, pad_id=pad_token_id(model))


def cb_attn_implementation() -> str:
    """transformers <= 5.22 wants "paged|sdpa" for continuous batching; 5.23 deprecates the prefix
    and takes plain "sdpa" (it still strips "paged|" with a warning)."""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "sdpa" if (major, minor) >= (5, 23) else "paged|sdpa"


def init_cb_manager(model: "PreTrainedModel", wl: Workload,
                    device: str) -> "ContinuousBatchingManager":
    """init_continuous_batching with the hints generate_batch would give, where this version
    takes them. eos_token_id None: the manager disables EOS. On a GPU the manager sizes its
    cache itself, as users get it; on the CPU it would size it from the machine's RAM, and its
    first step would fill gigabytes of cache and masks: there the cache holds the workload."""
    from transformers import GenerationConfig
    gen = GenerationConfig(max_new_tokens=max(wl.output_lens), do_sample=True,
                           temperature=TEMPERATURE, top_k=0, top_p=1.0, eos_token_id=None,
                           pad_token_id=pad_token_id(model))
    kwargs = {"generation_config": gen}
    params = inspect.signature(model.init_continuous_batching).parameters
    if device == "cpu" and "continuous_batching_config" in params:
        from transformers import ContinuousBatchingConfig
        default = ContinuousBatchingConfig()  # tokens per cache block: 5.17's block_size
        page = getattr(default, "page_size", None) or default.block_size
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            num_blocks=sum(-(-(len(p) + n) // page) for p, n in zip(wl.prompts, wl.output_lens)),
            max_batch_tokens=min(sum(map(len, wl.prompts)), CB_CPU_MAX_BATCH_TOKENS))
    if "workload_hints" in params:
        from transformers.generation.continuous_batching.utils import WorkloadHints
        hints = dict(max_prompt_length=max(map(len, wl.prompts)),
                     max_generated_length=max(wl.output_lens), num_requests=len(wl.prompts))
        fields = inspect.signature(WorkloadHints).parameters
        kwargs["workload_hints"] = WorkloadHints(**{k: v for k, v in hints.items() if k in fields})
    return model.init_continuous_batching(**kwargs)


def collect_cb(mgr: "ContinuousBatchingManager", request_ids: set[str]) -> dict[str, int]:
    """Wait for every request to finish; returns the number of generated tokens of each."""
    lengths, last = {}, time.perf_counter()
    while len(lengths) < len(request_ids):
        result = mgr.get_result(timeout=CB_POLL_S)
        if result is None:
            if not mgr.is_running() or time.perf_counter() - last > CB_STALL_S:
                raise RuntimeError(f"hf-cb stopped with {len(lengths)}/{len(request_ids)} "
                                   "requests finished")
            continue
        if result.request_id not in request_ids or not result.is_finished():
            continue
        if getattr(result, "error", None):
            raise RuntimeError(f"hf-cb request {result.request_id} failed: {result.error}")
        lengths[result.request_id], last = len(result.generated_tokens), time.perf_counter()
        if len(lengths) % PROGRESS_EVERY == 0:
            log(f"  hf-cb: {len(lengths)}/{len(request_ids)} requests done")
    return lengths


def run_cb_requests(mgr: "ContinuousBatchingManager", wl: Workload) -> list[int]:
    """Add every request of wl to the running manager, wait for all; tokens of each, in order."""
    ids = [f"{wl.name}_{i}" for i in range(len(wl.prompts))]
    for rid, prompt, n in zip(ids, wl.prompts, wl.output_lens):
        mgr.add_request(prompt, request_id=rid, max_new_tokens=n)
    lengths = collect_cb(mgr, set(ids))
    return [lengths[r] for r in ids]


@contextlib.contextmanager
def hf_cb_engine(model_dir: str, wl: Workload, args: argparse.Namespace,
                 device: str) -> Iterator[Generate]:
    """transformers continuous batching: one running manager, to which each workload's requests
    are added (run_cb_requests); stopped on exit."""
    model = load_hf_model(model_dir, cb_attn_implementation(), device)
    mgr = init_cb_manager(model, wl, device)
    if hasattr(mgr, "warmup"):   # generate_batch warms the manager up before start(), as we do
        mgr.warmup()
    log(f"  hf-cb settings: {getattr(mgr, 'continuous_batching_config', 'n/a')}")
    mgr.start()
    try:
        yield partial(run_cb_requests, mgr)
    finally:
        mgr.stop(block=True, timeout=CB_STOP_TIMEOUT_S)
        if hasattr(mgr, "destroy"):   # newer versions: also releases distributed resources
            mgr.destroy()


ENGINES: dict[str, EngineFactory] = {"nanoserve": nanoserve_engine, "hf-cb": hf_cb_engine,
                                     "hf": hf_engine}


def engines_for(wl: Workload, names: list[str], kv_dtypes: tuple[str, ...] = ("auto",),
                speculative: tuple[str, ...] = ("off",),
                guided: tuple[str, ...] = ("off",)) -> list[tuple[str, EngineFactory]]:
    """The engines to run on wl; nanoserve once per KV cache dtype (named nanoserve-fp8 with fp8),
    speculative method (-ngram) and guided mode (-guided-one), and on w2 each twice, prefix
    caching on and off (-nocache)."""
    runners = []
    for name in names:
        if name != "nanoserve":
            runners.append((name, ENGINES[name]))
            continue
        for kv, spec, guide in itertools.product(kv_dtypes, speculative, guided):
            run_name = name + "".join(f"-{v}" for v in (kv, spec) if v not in ("auto", "off")) \
                + ("" if guide == "off" else f"-guided-{guide}")
            settings = dict(kv_cache_dtype=kv, speculative=spec, guided=guide)
            runners.append((run_name, partial(nanoserve_engine, **settings)))
            if wl.name == "w2":
                runners.append((f"{run_name}-nocache", partial(
                    nanoserve_engine, prefix_caching=False, **settings)))
    return runners


# ----------------------------------------------------------------------------- timing
@dataclass
class Row:
    workload: str
    engine: str
    requests: int
    output_tokens: int
    seconds: float | None = None
    tokens_per_s: float | None = None
    ratio: float | None = None             # tokens/s over nanoserve's on the same workload
    roofline_fraction: float | None = None
    note: str = ""                         # the error of a failed engine, or a warning
    gpu_during: str | None = None          # nvidia-smi samples over the run (gpu_monitor)
    kv_cache_dtype: str = "auto"           # nanoserve's KV cache: "auto" (the model's) or "fp8"
    runs: list[float] | None = None        # seconds of each timed run; `seconds` is their median


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def relabeled(wl: Workload, seed: int) -> Workload:
    """wl with every token id mapped through a random permutation of the ids: the same lengths and
    the same shared prefixes, but prompts the prefix cache has not seen (wl again would be served
    from it)."""
    if not wl.relabel:
        return wl  # real text: its repeats are the same prompts (served by the prefix cache)
    ids = list(range(TOKEN_ID_MAX + 1))
    random.Random(seed).shuffle(ids)
    return Workload(wl.name, wl.description, [[ids[t] for t in p] for p in wl.prompts],
                    wl.output_lens)


def time_engine(engine: AbstractContextManager[Generate], wl: Workload,
                device: str) -> tuple[list[float], list[int]]:
    """The warm-up, untimed, then wl, timed (time_runs). Returns each run's wall time and the
    tokens generated for each request in the first run."""
    with engine as generate:
        generate(warmup_workload(wl))
        synchronize(device)
        return time_runs(generate, wl, device)


def time_runs(generate: Generate, wl: Workload, device: str,
              min_runs: int = 1) -> tuple[list[float], list[int]]:
    """wl timed on a warm engine, at least min_runs times. A single short run is noisy, so while
    the runs add up to less than MIN_TIMED_SECONDS, wl runs again, relabeled (new to the prefix
    cache), up to MAX_TIMED_RUNS runs. Returns each run's wall time and the tokens generated for
    each request in the first run."""
    seconds: list[float] = []
    lengths: list[list[int]] = []
    while len(seconds) < min_runs or (len(seconds) < MAX_TIMED_RUNS
                                      and sum(seconds) < MIN_TIMED_SECONDS):
        run = relabeled(wl, len(seconds)) if seconds else wl
        start = time.perf_counter()
        lengths.append(generate(run))
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return seconds, lengths[0]


def short_tokens(lengths: list[int], wanted: list[int]) -> str:
    """Every engine ignores EOS, so each request must return exactly its max_tokens."""
    short = sum(got != want for got, want in zip(lengths, wanted))
    return f"{short} requests returned a different token count than asked" if short else ""


def run_engine(name: str, factory: EngineFactory, model_dir: str, wl: Workload,
               args: argparse.Namespace, device: str) -> Row:
    """One engine on one workload. A failing engine becomes a row with its error, not a dead run."""
    row = Row(wl.name, name, len(wl.prompts), wl.output_tokens,
              kv_cache_dtype=getattr(factory, "keywords", {}).get("kv_cache_dtype", "auto"))
    log(f"-- {wl.name} / {name}: {row.requests} requests, {row.output_tokens:,} output tokens")
    try:
        with gpu_monitor(device) as samples:
            row.runs, lengths = time_engine(factory(model_dir, wl, args, device), wl, device)
        row.seconds = statistics.median(row.runs)
        if wl.ignore_eos:
            row.note = short_tokens(lengths, wl.output_lens)
        else:  # requests that stop at EOS: what they returned
            row.output_tokens = sum(lengths)
        row.gpu_during = summarize_gpu(samples)
        row.tokens_per_s = row.output_tokens / row.seconds
        runs = (f" (median of {len(row.runs)} runs: {', '.join(f'{t:.2f}' for t in row.runs)} s)"
                if len(row.runs) > 1 else "")
        log(f"   {row.seconds:.2f} s{runs}, {row.tokens_per_s:,.1f} tokens/s {row.note}")
        if row.gpu_during:
            log(f"   GPU during the run: {row.gpu_during}")
    except Exception as e:  # noqa: BLE001 -- any peer failure is reported in its row
        traceback.print_exc()
        row.note = f"error: {type(e).__name__}: {e}".splitlines()[0][:NOTE_MAX_CHARS]
    finally:
        free_memory()
    return row


# ----------------------------------------------------------------------------- roofline
# HBM bandwidth in bytes/s by a substring of torch.cuda.get_device_name(); first match wins, so
# longer names come before their prefixes ("GH200" before "H200", "L40S" before "L4").
HBM_BANDWIDTH = [("GH200", 4.0e12), ("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12),
                 ("H100", 3.35e12), ("B200", 8.0e12), ("A100-SXM4-80GB", 2.039e12),
                 ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12),
                 ("L40", 0.864e12), ("L4", 0.3e12), ("A10", 0.6e12), ("RTX 4090", 1.008e12),
                 ("RTX 3090", 0.936e12), ("V100", 0.9e12), ("T4", 0.32e12)]
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
KV_CACHE_BYTES = {"fp8": 1}  # bytes per K/V value of a --kv-cache-dtype; "auto": the model's


def gpu_bandwidth(device_name: str) -> float | None:
    return next((bw for key, bw in HBM_BANDWIDTH if key in device_name), None)


def kv_bytes_per_token(cfg: dict, kv_cache_dtype: str = "auto") -> int:
    """K and V, every layer: 2 * layers * Hkv * D * the cache's bytes per value."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype_bytes = KV_CACHE_BYTES.get(kv_cache_dtype) or DTYPE_BYTES[cfg.get("dtype")
                                                                    or cfg.get("torch_dtype")]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes


def weight_bytes(model_dir: str) -> int:
    """Bytes of all tensors in the *.safetensors files, read from their headers (an 8-byte length,
    then JSON). A tied LM head is stored once, and read once per step, so it counts once."""
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0]
                     for name, t in header.items() if name != "__metadata__")
    return total


def decode_bound_seconds(prompt_lens: list[int], output_lens: list[int], weight_bytes: int,
                         kv_bytes_per_token: int, bandwidth: float,
                         max_num_seqs: int = MAX_NUM_SEQS) -> float:
    """Ideal decode: FIFO admission up to max_num_seqs; each step reads the weights once plus the
    KV of every running request's context (prompt_len + tokens decoded so far)."""
    waiting, running, total = deque(zip(prompt_lens, output_lens)), [], 0
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            running.append(list(waiting.popleft()))             # [context_len, tokens_left]
        total += weight_bytes + kv_bytes_per_token * sum(ctx for ctx, _ in running)
        for req in running:
            req[0], req[1] = req[0] + 1, req[1] - 1
        running = [req for req in running if req[1] > 0]
    return total / bandwidth


def roofline_tokens_per_s(wl: Workload, w_bytes: int, kv_bytes: int,
                          bandwidth: float | None) -> float | None:
    """The bound as throughput: wl's output tokens over decode_bound_seconds; None on a CPU, and
    for requests that stop at EOS (their lengths are not known before)."""
    if not bandwidth or not wl.ignore_eos:
        return None
    prompt_lens = [len(p) for p in wl.prompts]
    seconds = decode_bound_seconds(prompt_lens, wl.output_lens, w_bytes, kv_bytes, bandwidth)
    return wl.output_tokens / seconds


def fill_ratios(rows: list[Row], bounds: dict[str, float | None]) -> None:
    """Ratios against nanoserve (prefix caching on) on the same workload, and the roofline of each
    row's KV cache dtype."""
    base = next((r.tokens_per_s for r in rows if r.engine == "nanoserve"), None)
    for r in rows:
        if r.tokens_per_s:
            r.ratio = r.tokens_per_s / base if base else None
            bound = bounds.get(r.kv_cache_dtype)
            r.roofline_fraction = r.tokens_per_s / bound if bound else None


# ----------------------------------------------------------------------------- table and JSON
def fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, spec) + suffix


TABLE_COLUMNS = [("workload", 8), ("engine", 21), ("requests", 8), ("out tokens", 10),
                 ("seconds", 8), ("tokens/s", 10), ("vs nanoserve", 12), ("roof", 6)]


def print_table(rows: list[Row]) -> None:
    head = " ".join(f"{name:>{w}}" if i > 1 else f"{name:{w}}"
                    for i, (name, w) in enumerate(TABLE_COLUMNS)) + "  note"
    log("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        roof = None if r.roofline_fraction is None else 100 * r.roofline_fraction
        cells = [f"{r.requests:d}", f"{r.output_tokens:,d}", fmt(r.seconds, ".2f"),
                 fmt(r.tokens_per_s, ",.1f"), fmt(r.ratio, ".2f", "x"), fmt(roof, ".1f", "%")]
        numbers = " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, TABLE_COLUMNS[2:]))
        log(f"{r.workload:8} {r.engine:17} {numbers}  {r.note}")


def write_json(path: str, meta: dict, rows: list[Row]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=2))


def load_results(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """The rows of several --json files (one per run) and each file's conditions."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    rows = [row for result in results for row in result["rows"]]
    return rows, [{k: v for k, v in result.items() if k != "rows"} for result in results]


# ----------------------------------------------------------------------------- chart
ENGINE_NAMES = {"nanoserve": "nanoserve", "nanoserve-nocache": "nanoserve,\nno prefix caching",
                "nanoserve-fp8": "nanoserve,\nfp8 KV cache",
                "nanoserve-fp8-nocache": "nanoserve, fp8 KV cache,\nno prefix caching",
                "hf-cb": "HF-CB\n(continuous batching)",
                "hf": "HF static\n(generate, static batches)"}
PEER_NAMES = {"hf-cb": "HF-CB", "hf": "HF static"}     # nanoserve's bars state a ratio to each
ENGINE_COLORS = {"nanoserve": "tab:blue", "nanoserve-nocache": "#9ecae1", "hf-cb": "tab:green",
                 "hf": "tab:orange", "nanoserve-fp8": "tab:purple",
                 "nanoserve-fp8-nocache": "#bcbddc"}
CHART_WIDTH_IN, BAR_HEIGHT_IN, TITLE_HEIGHT_IN = 11, 0.55, 1.6
CHART_DPI = 120
X_MIN_FACTOR = 0.3     # the log axis starts a bit below the slowest bar
BARS_FRACTION = 0.6    # the bars take this share of the log axis, the labels right of them the rest
LABEL_GAP_PT = 5       # space between a bar's end and its label


def group_rows(rows: list[dict]) -> dict[str, dict[str, float]]:
    """{workload: {engine: tokens/s}} in row order; failed engines (no tokens/s) have no bar."""
    groups: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("tokens_per_s"):
            groups.setdefault(r["workload"], {})[r["engine"]] = r["tokens_per_s"]
    return groups


def bar_label(engine: str, tokens_per_s: float, peers: dict[str, float]) -> str:
    """'20,590 tok/s · 34.6x HF-CB · 36.1x HF static' on nanoserve's bars, tokens/s on a peer's."""
    parts = [f"{tokens_per_s:,.0f} tok/s"]
    if engine not in PEER_NAMES:
        ratios = {peer: tokens_per_s / value for peer, value in peers.items()}
        parts += [f"{r:.{1 if r >= 1 else 2}f}x {PEER_NAMES[peer]}" for peer, r in ratios.items()]
    return " · ".join(parts)


def unique_join(values: list[str]) -> str:
    return ", ".join(dict.fromkeys(values))


def chart_title(metas: list[dict]) -> str:
    """What the chart shows, then its conditions: hardware, model and commit of every run."""
    def hardware(meta: dict) -> str:
        info, tp = meta.get("hardware", {}), meta.get("tensor_parallel_size", 1)
        if "gpu" not in info:
            return f"CPU ({info['cpu']})" if "cpu" in info else "CPU"
        return f"{info['gpu']}, tensor parallel {tp}" if tp > 1 else info["gpu"]

    def model(meta: dict) -> str:
        cfg = meta.get("model", {})
        dtype = cfg.get("dtype") or cfg.get("torch_dtype")
        return Path(cfg.get("dir", "?")).name + (f" ({dtype})" if dtype else "")

    commits = unique_join([m.get("hardware", {}).get("commit", "?") for m in metas])
    return ("Offline throughput, output tokens/s: nanoserve vs Hugging Face transformers\n"
            f"{unique_join([hardware(m) for m in metas])} · "
            f"model {unique_join([model(m) for m in metas])} · commit {commits}")


def draw_workload(ax: Axes, title: str, values: dict[str, float]) -> None:
    """One panel: a horizontal bar per engine, in row order, each labelled with bar_label."""
    ys = list(range(len(values)))
    ax.barh(ys, list(values.values()), color=[ENGINE_COLORS.get(e, "grey") for e in values])
    ax.set_yticks(ys, [ENGINE_NAMES.get(e, e) for e in values])
    ax.invert_yaxis()                                   # the first engine on top
    peers = {e: v for e, v in values.items() if e in PEER_NAMES}
    for y, (engine, value) in enumerate(values.items()):
        ax.annotate(bar_label(engine, value, peers), (value, y), xytext=(LABEL_GAP_PT, 0),
                    textcoords="offset points", va="center", fontsize=9)
    ax.set_title(title, loc="left", fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def chart(rows: list[dict], metas: list[dict]) -> Figure:
    """A panel per workload, bars on a log axis so peers 30x slower still show, labels in text."""
    groups = group_rows(rows)
    if not groups:
        raise ValueError("no row has a tokens/s to plot: did every engine fail?")
    descriptions = {name: wl.get("description", "") for m in metas
                    for name, wl in m.get("workloads", {}).items()}
    num_bars = sum(map(len, groups.values()))
    fig = Figure(figsize=(CHART_WIDTH_IN, TITLE_HEIGHT_IN + BAR_HEIGHT_IN * num_bars),
                 layout="constrained")
    axes = fig.subplots(len(groups), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [len(g) for g in groups.values()]})[:, 0]
    for ax, (workload, values) in zip(axes, groups.items()):
        draw_workload(ax, f"{workload.upper()}: {descriptions.get(workload, '')}", values)
    every = [v for g in groups.values() for v in g.values()]
    left = min(every) * X_MIN_FACTOR
    axes[-1].set_xscale("log")
    axes[-1].set_xlim(left, left * (max(every) / left) ** (1 / BARS_FRACTION))
    axes[-1].xaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))   # 10,000, not 10^4
    axes[-1].xaxis.set_minor_formatter(NullFormatter())
    axes[-1].set_xlabel("output tokens/s (log scale)")
    fig.suptitle(chart_title(metas), fontsize=11)
    return fig


def plot(rows: list[dict], metas: list[dict], path: str) -> Figure:
    """chart() written as a PNG by the Agg canvas (no display needed)."""
    fig = chart(rows, metas)
    FigureCanvasAgg(fig)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=CHART_DPI)
    log(f"wrote {path}")
    return fig


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", default="nanoserve,hf-cb,hf",
                   help="comma list of nanoserve, hf-cb, hf")
    p.add_argument("--workload", default="w1,w2", help="comma list of w1, w2, edit, chat")
    p.add_argument("--num-seqs", type=int,
                   help="requests per workload (256; CPU 16; edit and chat: 20)")
    p.add_argument("--max-input-len", type=int,
                   help="w1 prompt max, w2 prefix length (1024; CPU 256)")
    p.add_argument("--max-output-len", type=int,
                   help=f"w1 output max (1024; CPU 128), w2 output (128; CPU 32), edit and chat "
                        f"max_tokens ({TEXT_MAX_TOKENS})")
    p.add_argument("--speculative", default="off",
                   help="comma list of off, ngram: nanoserve runs once with each")
    p.add_argument("--num-speculative-tokens", type=int, default=8,
                   help="nanoserve's num_speculative_tokens with --speculative ngram")
    p.add_argument("--guided", default="off",
                   help="comma list of off, one, each: nanoserve runs once with each: unguided, "
                        "every request guided by one JSON schema, each by its own")
    p.add_argument("--max-num-seqs", type=int, default=512,
                   help="nanoserve's max_num_seqs: 1 runs the requests one at a time")
    p.add_argument("--dtype", default="auto", help="nanoserve's dtype (auto, bfloat16, ...)")
    p.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of the hf peer")
    p.add_argument("--model",
                   help="HF-layout model dir, or `default` for the packaged SmolLM2 (default: "
                        "random Qwen3-0.6B; CPU: the packaged SmolLM2)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="run the model with this directory's tokenizer files: --guided needs one "
                        "of real text (the random Qwen3's names its tokens <i>, which no grammar "
                        "accepts) and edit and chat one with a chat template, e.g. the default "
                        "model's")
    p.add_argument("--cpu", action="store_true", help="CPU mode (automatic without CUDA)")
    p.add_argument("--eager", action="store_true", help="nanoserve without CUDA graphs")
    p.add_argument("--batch-invariant", action="store_true",
                   help="nanoserve with batch_invariant=True (the same bits in any batch)")
    p.add_argument("--tp", type=int, default=1, help="nanoserve tensor-parallel size")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="comma list of auto, fp8: nanoserve runs once with each KV cache dtype")
    p.add_argument("--bandwidth", type=float,
                   help="HBM bytes/s per GPU for the roofline (default: by GPU name)")
    p.add_argument("--out", "--json", dest="json", metavar="PATH",
                   default=f"{RESULTS_DIR}/bench.json",
                   help="write rows, hardware, model and workloads to this file "
                        "(default: %(default)s)")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of tokens/s "
                   f"(--plot-from: default {RESULTS_DIR}/bench.png)")
    p.add_argument("--timeline", metavar="PATH",
                   help="draw the timeline (requests x engine steps) of nanoserve's first run: the "
                        "first workload, prefix caching on, the first --kv-cache-dtype")
    p.add_argument("--plot-from",
                   help="run nothing: draw --plot from JSON file(s) of --out, comma-separated")
    p.add_argument("--tiny", action="store_true",
                   help="smoke test, not a benchmark: a 2-layer random Qwen3 runs the whole code "
                        "path in seconds; its figures are overheads (on W2 prefix caching may "
                        "even look slower)")
    return p.parse_args(argv)


def check_names(args: argparse.Namespace) -> list[str]:
    """The engines asked for; unknown names, or sizes below 1, stop the run before it starts."""
    engines = args.engines.split(",")
    unknown = ((set(engines) - set(ENGINES))
               | (set(args.workload.split(",")) - {"w1", "w2", "edit", "chat"})
               | (set(args.kv_cache_dtype.split(",")) - {"auto", "fp8"})
               | (set(args.speculative.split(",")) - {"off", "ngram"})
               | (set(args.guided.split(",")) - {"off", "one", "each"}))
    if unknown:
        raise SystemExit(f"unknown engine, workload, KV cache dtype, speculative method or guided "
                         f"mode {sorted(unknown)}: use --engines nanoserve,hf-cb,hf, --workload "
                         "w1,w2,edit,chat, --kv-cache-dtype auto,fp8, --speculative off,ngram and "
                         "--guided off,one,each")
    sizes = {"--num-seqs": args.num_seqs, "--max-input-len": args.max_input_len,
             "--max-output-len": args.max_output_len, "--max-num-seqs": args.max_num_seqs,
             "--hf-batch-size": args.hf_batch_size, "--tp": args.tp}
    if bad := [f"{flag} {v}" for flag, v in sizes.items() if v is not None and v < 1]:
        raise SystemExit(f"{', '.join(bad)}: each must be at least 1 (leave one out for its "
                         "default)")
    return engines


def describe_run(args: argparse.Namespace, cpu: bool) -> tuple[dict, str]:
    """The run's conditions (written into --json) and the model directory."""
    hardware = hardware_info(cpu)
    bandwidth = None if cpu else (args.bandwidth or gpu_bandwidth(hardware["gpu"]))
    if not cpu and bandwidth is None:
        log(f"unknown HBM bandwidth for {hardware['gpu']}: pass --bandwidth for the roofline")
    model_dir = resolve_model_dir(args, cpu)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    w_bytes, kv_bytes = weight_bytes(model_dir), kv_bytes_per_token(cfg)
    hbm = "" if cpu else f", HBM bandwidth {fmt(bandwidth, '.3g')} B/s x {args.tp} GPU(s)"
    log(f"{hardware}\nmodel {model_dir}: {w_bytes / 1e9:.3f} GB of weights, {kv_bytes:,} KV "
        f"bytes/token{hbm}")
    shape = {k: cfg[k] for k in (*QWEN3_0_6B, "architectures", "dtype", "torch_dtype") if k in cfg}
    meta = {"command": " ".join(sys.argv), "hardware": hardware, "temperature": TEMPERATURE,
            "model": {"dir": model_dir, **shape, "weight_bytes": w_bytes,
                      "kv_bytes_per_token": kv_bytes},
            "bandwidth_bytes_per_s": bandwidth, "tensor_parallel_size": args.tp, "workloads": {}}
    return meta, model_dir


def run_workload(wl: Workload, engines: list[str], model_dir: str, meta: dict,
                 args: argparse.Namespace, done: list[Row]) -> list[Row]:
    """Every engine on wl, after its roofline; --json is rewritten after each engine, so a run cut
    short still leaves the figures it has."""
    bandwidth = meta["bandwidth_bytes_per_s"]
    total_bw = bandwidth * args.tp if bandwidth else None    # with TP each GPU reads its shard
    kv_dtypes = tuple(args.kv_cache_dtype.split(","))
    bounds = {kv: roofline_tokens_per_s(wl, meta["model"]["weight_bytes"],
                                        kv_bytes_per_token(meta["model"], kv), total_bw)
              for kv in dict.fromkeys(("auto", *kv_dtypes))}  # "auto": the peers' rows
    meta["workloads"][wl.name] = {"description": wl.description, "requests": len(wl.prompts),
                                  "output_tokens": wl.output_tokens,
                                  "roofline_tokens_per_s": bounds["auto"]}
    if "fp8" in bounds:
        meta["workloads"][wl.name]["roofline_tokens_per_s_fp8"] = bounds["fp8"]
    log(f"\n== {wl.name}: {wl.description}; decode roofline "
        + ", ".join(f"{fmt(b, ',.0f')} tokens/s ({kv} KV cache)" for kv, b in bounds.items()))
    device = "cuda" if meta["hardware"].get("gpu") else "cpu"   # a GPU is named only when used
    rows: list[Row] = []
    variants = tuple(args.speculative.split(",")), tuple(args.guided.split(","))
    for name, factory in engines_for(wl, engines, kv_dtypes, *variants):
        rows.append(run_engine(name, factory, model_dir, wl, args, device))
        fill_ratios(rows, bounds)
        if args.json:
            write_json(args.json, meta, done + rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot_from:
        rows, metas = load_results(args.plot_from.split(","))
        plot(rows, metas, args.plot or f"{RESULTS_DIR}/bench.png")
        return
    cpu = args.cpu or not torch.cuda.is_available()
    engines = check_names(args)
    logging.basicConfig(format="%(name)s: %(message)s")   # nanoserve's start-up lines (KV cache)
    logging.getLogger("nanoserve").setLevel(logging.INFO)
    meta, model_dir = describe_run(args, cpu)
    rows: list[Row] = []
    for wl in build_workloads(args, cpu, model_dir):
        rows += run_workload(wl, engines, model_dir, meta, args, rows)
    print_table(rows)
    if args.json:
        log(f"wrote {args.json}")
    if args.plot:
        plot([asdict(r) for r in rows], [meta], args.plot)
    if failed := [r for r in rows if r.note.startswith("error")]:
        raise SystemExit(f"{len(failed)} of {len(rows)} runs failed: their errors are above")


if __name__ == "__main__":
    main()
