"""bench.py: nanoserve's offline throughput against Hugging Face transformers and against the hardware.

Workloads (DESIGN.md, "Benchmark workloads"); every engine gets the same prompts and output lengths,
samples at temperature 0.6 (as nano-vllm's bench.py does) and ignores EOS, so each request yields
exactly its max_tokens:
  w1  the nano-vllm workload. random.seed(0); 256 prompts of randint(100, 1024) token ids, each id
      randint(0, 10000); then 256 max_tokens of randint(100, 1024): 133,966 output tokens. Model:
      Qwen3-0.6B's shapes with random bf16 weights, built and saved on this machine (no download).
  w2  shared prefix. 256 requests = one 1,024-token system prefix + randint(32, 128) own tokens,
      128 output tokens each; nanoserve runs twice, prefix caching on and off.
Throughput = sum of max_tokens / wall time of the whole run (prefill included), after a warm-up: each engine
first runs, untimed, as many random prompts of the same lengths for 1-16 tokens (warmup_workload).

Engines, one after the other in this process (each freed before the next starts):
  nanoserve  LLM.generate over all requests at once.
  hf         transformers `generate` on static batches of --hf-batch-size in workload order, left
             padded. A batch decodes for its longest request (min_new_tokens = max_new_tokens), and
             each request is credited only its own max_tokens: the wasted steps are the nature of
             static batching, which is what continuous batching fixes.
  hf-cb      transformers continuous batching (init_continuous_batching, paged sdpa attention,
             per-request max_new_tokens, EOS disabled), with the library's default settings (which
             include its own prefix sharing, so it also gains on w2).

Roofline: a decode step is memory-bound; it must read every weight once plus the KV cache of every
running sequence. We simulate the ideal schedule (all requests decode together, up to max_num_seqs;
at step t a request with output_len > t reads prompt_len + t tokens of KV), add up the bytes of the
steps and divide by HBM bandwidth: a lower bound on decode time. "roof" = achieved tokens/s / bound
tokens/s. Prefill is not in the bound but is in the wall time, so 100% is out of reach. On w2 each
sequence reads its own copy of the shared prefix's KV, as paged attention does.

CPU mode (--cpu, or no CUDA): the packaged default model and small workloads; roofline is "-".
  python bench.py                                  # GPU: w1 + w2, nanoserve + both HF peers
  python bench.py --cpu                            # about 3.5 minutes on a 2-core VM (2.5 without hf-cb)
  python bench.py --plot-from bench.json --plot bench.png   # also merges several JSONs: a.json,b.json
The hf peers take minutes on w1 (about 4 each on an H100): split long runs with --engines/--workload,
one --json each, and merge them with --plot-from.
"""
import argparse
import contextlib
import gc
import inspect
import json
import os
import platform
import random
import shutil
import struct
import subprocess
import sys
import time
import traceback
import zlib
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

TEMPERATURE = 0.6          # nano-vllm's bench.py samples at 0.6; all engines use the same
MAX_NUM_SEQS = 512         # nanoserve's default batch limit, used by the roofline schedule
WARMUP_SEED = 1_000        # warm-up prompts: random, so they share no prefix with the timed ones
WARMUP_MAX_OUTPUT = 16     # warm-up requests generate 1 to this many tokens
CB_STALL_S = 600           # hf-cb: give up when no request finishes for this long
QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6)
# --tiny: the same code path with a model small enough for a CPU smoke test.
QWEN3_TINY = {**QWEN3_0_6B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}
BOS_ID, EOS_ID = 151643, 151645    # Qwen3's <|endoftext|> and <|im_end|>
# HBM bandwidth in bytes/s by a substring of torch.cuda.get_device_name(); first match wins, so
# longer names come before their prefixes ("GH200" before "H200", "L40S" before "L4").
HBM_BANDWIDTH = [("GH200", 4.0e12), ("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12),
                 ("H100", 3.35e12), ("B200", 8.0e12), ("A100-SXM4-80GB", 2.039e12),
                 ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12), ("L40", 0.864e12),
                 ("L4", 0.3e12), ("A10", 0.6e12), ("RTX 4090", 1.008e12), ("RTX 3090", 0.936e12),
                 ("V100", 0.9e12), ("T4", 0.32e12)]
PLOT_COLORS = {"nanoserve": (31, 119, 180), "nanoserve-nocache": (158, 202, 225), "hf": (255, 127, 14),
               "hf-cb": (44, 160, 44)}


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- workloads
@dataclass
class Workload:
    name: str
    description: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_w1(num_seqs: int = 256, min_input_len: int = 100, max_input_len: int = 1024,
            min_output_len: int = 100, max_output_len: int = 1024, seed: int = 0) -> Workload:
    """nano-vllm's bench: random.Random(seed) draws the same stream as random.seed(seed) + randint."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(min_input_len, max_input_len))]
               for _ in range(num_seqs)]
    output_lens = [rng.randint(min_output_len, max_output_len) for _ in range(num_seqs)]
    desc = (f"{num_seqs} random prompts of {min_input_len}-{max_input_len} tokens, "
            f"{min_output_len}-{max_output_len} output tokens, ignore_eos")
    return Workload("w1", desc, prompts, output_lens)


def warmup_workload(wl: Workload) -> Workload:
    """What each engine runs, untimed, before a workload: as many requests, random prompts of the workload's
    length range (as long, so prefill runs in the same chunks) and 1-16 output tokens, so batches shrink through
    the same sizes. First-time work (kernel loading, compilation, allocations) happens here, not in the timing."""
    lens = list(map(len, wl.prompts))
    return make_w1(len(lens), min(lens), max(lens), 1, WARMUP_MAX_OUTPUT, seed=WARMUP_SEED)


def make_w2(num_seqs: int = 256, prefix_len: int = 1024, min_own: int = 32, max_own: int = 128,
            output_len: int = 128, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prefix = [rng.randint(0, 10000) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randint(0, 10000) for _ in range(rng.randint(min_own, max_own))]
               for _ in range(num_seqs)]
    desc = (f"{num_seqs} requests sharing a {prefix_len}-token prefix + {min_own}-{max_own} own tokens, "
            f"{output_len} output tokens each, ignore_eos")
    return Workload("w2", desc, prompts, [output_len] * num_seqs)


def build_workloads(args: argparse.Namespace, cpu: bool) -> list[Workload]:
    """Full-size workloads on a GPU, small ones on a CPU; the --num-seqs/--max-*-len flags scale both."""
    n = args.num_seqs or (16 if cpu else 256)
    max_in = args.max_input_len or (256 if cpu else 1024)
    max_out = args.max_output_len or (128 if cpu else 1024)
    lo_in, lo_out = (32, 32) if cpu else (100, 100)
    builders = {
        "w1": lambda: make_w1(n, min(lo_in, max_in), max_in, min(lo_out, max_out), max_out),
        "w2": lambda: make_w2(n, args.max_input_len or (256 if cpu else 1024),
                              output_len=args.max_output_len or (32 if cpu else 128)),
    }
    return [builders[name]() for name in args.workload.split(",")]


# ----------------------------------------------------------------------------- roofline
def kv_bytes_per_token(cfg: dict) -> int:
    """K and V, every layer: 2 * layers * Hkv * D * dtype bytes."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[cfg.get("dtype") or cfg.get("torch_dtype")]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes


def weight_bytes(model_dir: str) -> int:
    """Bytes of all tensors in the *.safetensors files, read from their headers. A tied LM head is
    stored once, and read once per step, so it counts once."""
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0]
                     for name, t in header.items() if name != "__metadata__")
    return total


def decode_bound_seconds(prompt_lens: list[int], output_lens: list[int], weight_bytes: int,
                         kv_bytes_per_token: int, bandwidth: float, max_num_seqs: int = MAX_NUM_SEQS) -> float:
    """Ideal decode: FIFO admission up to max_num_seqs; each step reads the weights once plus the KV
    of every running request's context (prompt_len + tokens decoded so far)."""
    waiting, running, total = deque(zip(prompt_lens, output_lens)), [], 0
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            running.append(list(waiting.popleft()))             # [context_len, tokens_left]
        total += weight_bytes + kv_bytes_per_token * sum(ctx for ctx, _ in running)
        for req in running:
            req[0], req[1] = req[0] + 1, req[1] - 1
        running = [req for req in running if req[1] > 0]
    return total / bandwidth


def gpu_bandwidth(device_name: str) -> float | None:
    return next((bw for key, bw in HBM_BANDWIDTH if key in device_name), None)


# ----------------------------------------------------------------------------- models
def build_tokenizer(vocab_size: int):
    """A decode-only tokenizer: token i is the word "<i>". Prompts are token ids, so nothing else is needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    vocab = {**{k: v for k, v in vocab.items() if v not in (BOS_ID, EOS_ID)},
             "<|endoftext|>": BOS_ID, "<|im_end|>": EOS_ID}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")


def build_random_qwen3(out_dir: Path, shape: dict, device: str) -> str:
    """Qwen3 with random bf16 weights (std 0.02 keeps logits sane) plus a tokenizer, saved once."""
    if (out_dir / "config.json").exists() and (out_dir / "tokenizer.json").exists():
        log(f"reusing random-weight model {out_dir}")
        return str(out_dir)
    from transformers import AutoModelForCausalLM, Qwen3Config
    log(f"building random-weight Qwen3 {shape} in {out_dir}")
    cfg = Qwen3Config(**shape, bos_token_id=BOS_ID, eos_token_id=EOS_ID, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device(device):                      # init on the GPU: seconds instead of a minute
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)                      # safetensors; the tied LM head is stored once
    build_tokenizer(shape["vocab_size"]).save_pretrained(tmp)
    tmp.rename(out_dir)                             # renamed last: a half-written dir is never reused
    del model
    return str(out_dir)


def resolve_model_dir(args: argparse.Namespace, cpu: bool) -> str:
    if args.model:
        return args.model
    cache = Path(os.environ.get("NANOSERVE_CACHE", Path.home() / ".cache" / "nanoserve"))
    if args.tiny:
        return build_random_qwen3(cache / "qwen3-tiny-random", QWEN3_TINY, "cpu" if cpu else "cuda")
    if cpu:
        from nanoserve.weights import default_model_dir
        return default_model_dir()
    return build_random_qwen3(cache / "qwen3-0.6b-random", QWEN3_0_6B, "cuda")


def load_hf_model(model_dir: str, attn_implementation: str, device: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", attn_implementation=attn_implementation)
    return model.to(device).eval()


def pad_token_id(model) -> int:
    cfg = model.config
    return next((t for t in (cfg.pad_token_id, cfg.eos_token_id, 0) if isinstance(t, int)), 0)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- engines
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


def short_tokens(lengths: list[int], wanted: list[int]) -> str:
    """Every engine ignores EOS, so each request must return exactly its max_tokens."""
    short = sum(got != want for got, want in zip(lengths, wanted))
    return f"{short} requests returned a different token count than asked" if short else ""


def nanoserve_params(wl: Workload) -> list:
    """Each request's SamplingParams: the bench temperature, its own max_tokens, EOS ignored."""
    from nanoserve import SamplingParams
    return [SamplingParams(temperature=TEMPERATURE, max_tokens=n, ignore_eos=True) for n in wl.output_lens]


def run_nanoserve(model_dir: str, wl: Workload, args: argparse.Namespace, device: str,
                  prefix_caching: bool = True) -> tuple[float, str]:
    from nanoserve import LLM
    max_len = max(len(p) + n for p, n in zip(wl.prompts, wl.output_lens))
    with LLM(model_dir, enforce_eager=args.eager, enable_prefix_caching=prefix_caching,
             tensor_parallel_size=args.tp, max_model_len=max(4096, max_len), device=device) as llm:
        warm = warmup_workload(wl)
        llm.generate(warm.prompts, nanoserve_params(warm), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(wl.prompts, nanoserve_params(wl), use_tqdm=False)
        seconds = time.perf_counter() - start
    return seconds, short_tokens([len(o["token_ids"]) for o in outs], wl.output_lens)


def hf_generate_batch(model, prompts: list[list[int]], num_new: int, pad_id: int) -> torch.Tensor:
    """One static batch, left padded so every row's last prompt token sits in the last column."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                         max_new_tokens=num_new, min_new_tokens=num_new,  # min = max: EOS never ends a row
                         do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0, pad_token_id=pad_id)
    return out[:, width:]                                                 # (batch, num_new)


def hf_static_batches(model, wl: Workload, bs: int, pad_id: int) -> list[int]:
    """wl in static batches of bs, in order; returns the tokens credited to each request."""
    lengths, start = [], time.perf_counter()
    for i in range(0, len(wl.prompts), bs):
        want = wl.output_lens[i:i + bs]
        new = hf_generate_batch(model, wl.prompts[i:i + bs], max(want), pad_id)
        lengths += [min(new.shape[1], n) for n in want]                   # credit each its own max_tokens
        log(f"  hf: batch {i // bs + 1}/{-(-len(wl.prompts) // bs)} done at {time.perf_counter() - start:.1f}s")
    return lengths


def run_hf(model_dir: str, wl: Workload, args: argparse.Namespace, device: str) -> tuple[float, str]:
    model = load_hf_model(model_dir, "sdpa", device)
    pad_id, bs = pad_token_id(model), args.hf_batch_size
    hf_static_batches(model, warmup_workload(wl), bs, pad_id)
    start = time.perf_counter()
    lengths = hf_static_batches(model, wl, bs, pad_id)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, short_tokens(lengths, wl.output_lens)


def cb_attn_implementation() -> str:
    """transformers <= 5.22 wants "paged|sdpa" for continuous batching; 5.23 deprecates the prefix and
    takes plain "sdpa" (it still strips "paged|" with a warning)."""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "sdpa" if (major, minor) >= (5, 23) else "paged|sdpa"


def init_cb_manager(model, wl: Workload):
    """init_continuous_batching with the hints generate_batch would give, where this version takes them."""
    from transformers import GenerationConfig
    gen = GenerationConfig(max_new_tokens=max(wl.output_lens), do_sample=True, temperature=TEMPERATURE,
                           top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=pad_token_id(model))
    kwargs = {"generation_config": gen}                      # eos None: the manager disables EOS (-1)
    if "workload_hints" in inspect.signature(model.init_continuous_batching).parameters:
        from transformers.generation.continuous_batching.utils import WorkloadHints
        hints = dict(max_prompt_length=max(map(len, wl.prompts)), max_generated_length=max(wl.output_lens),
                     num_requests=len(wl.prompts))
        fields = inspect.signature(WorkloadHints).parameters
        kwargs["workload_hints"] = WorkloadHints(**{k: v for k, v in hints.items() if k in fields})
    return model.init_continuous_batching(**kwargs)


def collect_cb(mgr, request_ids: set[str]) -> dict[str, int]:
    """Wait for every request to finish; returns the number of generated tokens of each."""
    lengths, last = {}, time.perf_counter()
    while len(lengths) < len(request_ids):
        result = mgr.get_result(timeout=1)
        if result is None:
            if not mgr.is_running() or time.perf_counter() - last > CB_STALL_S:
                raise RuntimeError(f"hf-cb stopped with {len(lengths)}/{len(request_ids)} requests finished")
            continue
        if result.request_id not in request_ids or not result.is_finished():
            continue
        if getattr(result, "error", None):
            raise RuntimeError(f"hf-cb request {result.request_id} failed: {result.error}")
        lengths[result.request_id], last = len(result.generated_tokens), time.perf_counter()
        if len(lengths) % 64 == 0:
            log(f"  hf-cb: {len(lengths)}/{len(request_ids)} requests done")
    return lengths


def run_hf_cb(model_dir: str, wl: Workload, args: argparse.Namespace, device: str) -> tuple[float, str]:
    model = load_hf_model(model_dir, cb_attn_implementation(), device)
    mgr = init_cb_manager(model, wl)
    if hasattr(mgr, "warmup"):   # 5.17: generate_batch warms the manager up before start(), so we do too
        mgr.warmup()
    log(f"  hf-cb settings: {getattr(mgr, 'continuous_batching_config', 'n/a')}")
    mgr.start()
    try:
        run_cb_requests(mgr, warmup_workload(wl), "warmup")  # its first request also allocates the cache
        start = time.perf_counter()
        lengths = run_cb_requests(mgr, wl, "req")
        seconds = time.perf_counter() - start
    finally:
        mgr.stop(block=True, timeout=60)
        if hasattr(mgr, "destroy"):   # 5.23: also releases the manager's distributed resources
            mgr.destroy()
    return seconds, short_tokens(lengths, wl.output_lens)


def run_cb_requests(mgr, wl: Workload, name: str) -> list[int]:
    """Add every request of wl to the running manager, wait for all; tokens generated by each, in order."""
    ids = [f"{name}_{i}" for i in range(len(wl.prompts))]
    for rid, prompt, n in zip(ids, wl.prompts, wl.output_lens):
        mgr.add_request(prompt, request_id=rid, max_new_tokens=n)
    lengths = collect_cb(mgr, set(ids))
    return [lengths[r] for r in ids]


def engines_for(wl: Workload, names: list[str]) -> list[tuple[str, Callable]]:
    runners = []
    for name in names:
        if name == "nanoserve":
            runners.append(("nanoserve", run_nanoserve))
            if wl.name == "w2":   # the prefix-caching comparison
                runners.append(("nanoserve-nocache",
                                lambda *a: run_nanoserve(*a, prefix_caching=False)))
        else:
            runners.append((name, {"hf": run_hf, "hf-cb": run_hf_cb}[name]))
    return runners


def run_engine(name: str, runner, model_dir: str, wl: Workload, args: argparse.Namespace, device: str) -> Row:
    """One engine on one workload. A failing engine becomes a row with its error, not a dead run."""
    row = Row(wl.name, name, len(wl.prompts), wl.output_tokens)
    log(f"-- {wl.name} / {name}: {row.requests} requests, {row.output_tokens:,} output tokens")
    try:
        with gpu_monitor(device) as samples:
            row.seconds, row.note = runner(model_dir, wl, args, device)
        row.gpu_during = summarize_gpu(samples)
        row.tokens_per_s = row.output_tokens / row.seconds
        log(f"   {row.seconds:.2f} s, {row.tokens_per_s:,.1f} tokens/s {row.note}")
        if row.gpu_during:
            log(f"   GPU during the run: {row.gpu_during}")
    except Exception as e:  # noqa: BLE001 -- any peer failure is reported in its row
        traceback.print_exc()
        row.note = f"error: {type(e).__name__}: {e}".splitlines()[0][:200]
    finally:
        free_memory()
    return row


# ----------------------------------------------------------------------------- report
def fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, spec) + suffix


def print_table(rows: list[Row]) -> None:
    cols = [("workload", 8), ("engine", 17), ("requests", 8), ("out tokens", 10), ("seconds", 8),
            ("tokens/s", 10), ("vs nanoserve", 12), ("roof", 6)]
    head = " ".join(f"{name:>{w}}" if i > 1 else f"{name:{w}}" for i, (name, w) in enumerate(cols)) + "  note"
    log("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        roof = None if r.roofline_fraction is None else 100 * r.roofline_fraction
        cells = [f"{r.requests:d}", f"{r.output_tokens:,d}", fmt(r.seconds, ".2f"), fmt(r.tokens_per_s, ",.1f"),
                 fmt(r.ratio, ".2f", "x"), fmt(roof, ".1f", "%")]
        log(f"{r.workload:8} {r.engine:17} " + " ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, cols[2:]))
            + f"  {r.note}")


def hardware_info(cpu: bool) -> dict:
    import transformers
    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "cpu": platform.processor() or platform.machine()}
    if not cpu:
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_limits"] = gpu_limits()
    try:
        # "-dirty" when the working tree differs from that commit: the figures are not that commit's
        info["commit"] = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                        cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def gpu_limits() -> str | None:
    """The first GPU's clock ceilings, power limit and driver, from nvidia-smi: throughput differs by a few
    percent between machines of one kind, and these are the settings that may explain it."""
    fields = "clocks.max.sm,clocks.max.mem,power.limit,driver_version"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return ", ".join(f"{name} {value.strip()}" for name, value in zip(fields.split(","), out.split(",")))


GPU_SAMPLE_FIELDS = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_event_reasons.active"


@contextlib.contextmanager
def gpu_monitor(device: str) -> Iterator[list[str]]:
    """nvidia-smi samples every 200 ms while the block runs (warm-up included), as CSV lines: a run slower
    than another on the same code shows here whether the GPU ran at other clocks, hotter or throttled."""
    samples: list[str] = []
    proc = None
    if device == "cuda":
        try:
            proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={GPU_SAMPLE_FIELDS}", "--format=csv,noheader,nounits",
                                     "-lms", "200", "-i", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    text=True)
        except OSError:
            proc = None
    try:
        yield samples
    finally:
        if proc is not None:
            proc.terminate()
            samples += proc.communicate(timeout=30)[0].splitlines()


def summarize_gpu(samples: list[str]) -> str | None:
    """Busy samples only (power above its median): SM and memory clocks, temperature, power, event reasons."""
    rows = [line.split(", ") for line in samples if line.count(", ") == 4]
    try:
        values = [(float(sm), float(mem), float(temp), float(power), reason) for sm, mem, temp, power, reason in rows]
    except ValueError:  # "[N/A]" fields on some machines
        return None
    if not values:
        return None
    median_power = sorted(v[3] for v in values)[len(values) // 2]
    busy = [v for v in values if v[3] >= median_power]
    sm, mem, temp, power = ([v[i] for v in busy] for i in range(4))
    reasons = sorted({v[4] for v in busy})
    return (f"{len(busy)} busy samples: SM {min(sm):.0f}-{max(sm):.0f} MHz, memory {min(mem):.0f}-{max(mem):.0f} MHz, "
            f"{min(temp):.0f}-{max(temp):.0f} C, {sum(power) / len(power):.0f} W mean, event reasons {reasons}")


def write_png(path: str, pixels: list[bytearray], width: int, height: int) -> None:
    """A minimal RGB PNG: signature, IHDR, one zlib IDAT (each row prefixed by filter byte 0), IEND."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


# A 3x5 bitmap font (rows of 3 bits, top to bottom) for the PNG written without matplotlib.
FONT = {"0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
        "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
        "8": "111101111101111", "9": "111101111001111", ",": "000000000010100", ".": "000000000000010",
        "-": "000000111000000", "/": "001001010100100", " ": "000000000000000", "A": "010101111101101",
        "B": "110101110101110", "C": "111100100100111", "E": "111100110100111", "F": "111100110100100",
        "H": "101101111101101", "K": "101101110101101", "N": "110101101101101", "O": "111101101101111",
        "R": "110101110101101", "S": "111100111001111", "T": "111010010010010", "V": "101101101101010",
        "W": "101101111111101"}


def draw_rect(pixels: list[bytearray], x0: int, y0: int, x1: int, y1: int, color: tuple) -> None:
    for y in range(max(y0, 0), min(y1, len(pixels))):
        pixels[y][3 * x0:3 * x1] = bytes(color) * (x1 - x0)


def draw_text(pixels: list[bytearray], x: int, y: int, text: str, scale: int = 2) -> None:
    """Upper-case text in the 3x5 font, each font pixel a scale x scale square; 4 * scale per character."""
    for ch in text.upper():
        for i, bit in enumerate(FONT.get(ch, FONT[" "])):
            if bit == "1":
                px, py = x + (i % 3) * scale, y + (i // 3) * scale
                draw_rect(pixels, px, py, px + scale, py + scale, (0, 0, 0))
        x += 4 * scale


def plot_without_matplotlib(path: str, groups: dict[str, dict[str, float]]) -> None:
    """Grouped bars: one group per workload (name below), one colour per engine (legend at the top),
    tokens/s above each bar."""
    engines = list(dict.fromkeys(e for g in groups.values() for e in g))
    bar, gap, margin, legend_h, height = 56, 40, 20, 16 * len(engines) + 10, 420
    width = max(2 * margin + sum(len(g) * (bar + 6) + gap for g in groups.values()), 420)
    pixels = [bytearray(b"\xff" * width * 3) for _ in range(height)]
    colors = {e: PLOT_COLORS.get(e, (127, 127, 127)) for e in engines}
    for i, engine in enumerate(engines):                      # legend
        draw_rect(pixels, margin, margin + 16 * i, margin + 10, margin + 16 * i + 10, colors[engine])
        draw_text(pixels, margin + 16, margin + 16 * i, engine + " TOKENS/S")
    top, base = max((v for g in groups.values() for v in g.values()), default=1.0), height - margin - 16
    span, x = base - margin - legend_h - 16, margin
    for workload, values in groups.items():
        draw_text(pixels, x, base + 4, workload)
        for engine, value in values.items():
            y = base - int(span * value / top)
            draw_rect(pixels, x, y, x + bar, base, colors[engine])
            draw_text(pixels, x, y - 12, f"{value:,.0f}")
            x += bar + 6
        x += gap
    draw_rect(pixels, margin, base, width - margin, base + 1, (0, 0, 0))  # x axis
    write_png(path, pixels, width, height)


def plot(rows: list[dict], path: str) -> None:
    groups: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("tokens_per_s"):
            groups.setdefault(r["workload"], {})[r["engine"]] = r["tokens_per_s"]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plot_without_matplotlib(path, groups)
    else:
        engines = list(dict.fromkeys(e for g in groups.values() for e in g))
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for i, engine in enumerate(engines):
            xs = [j + (i - (len(engines) - 1) / 2) * 0.8 / len(engines) for j in range(len(groups))]
            ax.bar(xs, [g.get(engine, 0) for g in groups.values()], 0.8 / len(engines), label=engine,
                   color=[c / 255 for c in PLOT_COLORS.get(engine, (127, 127, 127))])
        ax.set_xticks(range(len(groups)), list(groups))
        ax.set_ylabel("output tokens/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    log(f"wrote {path}")


# ----------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", default="nanoserve,hf-cb,hf", help="comma list of nanoserve, hf, hf-cb")
    p.add_argument("--workload", default="w1,w2", help="comma list of w1, w2")
    p.add_argument("--num-seqs", type=int, help="requests per workload (256; CPU 16)")
    p.add_argument("--max-input-len", type=int, help="w1 prompt max, w2 prefix length (1024; CPU 256)")
    p.add_argument("--max-output-len", type=int, help="w1 output max (1024; CPU 128), w2 output (128; CPU 32)")
    p.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of the hf peer")
    p.add_argument("--model", help="HF-layout model dir (default: random Qwen3-0.6B; CPU: packaged SmolLM2)")
    p.add_argument("--cpu", action="store_true", help="CPU mode (automatic without CUDA)")
    p.add_argument("--eager", action="store_true", help="nanoserve without CUDA graphs")
    p.add_argument("--tp", type=int, default=1, help="nanoserve tensor-parallel size")
    p.add_argument("--bandwidth", type=float, help="HBM bytes/s per GPU for the roofline (default: by GPU name)")
    p.add_argument("--json", help="write rows, hardware, model and workloads to this file")
    p.add_argument("--plot", help="write a PNG bar chart of tokens/s")
    p.add_argument("--plot-from", help="only render --plot from JSON file(s) written by --json, comma-separated")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # smoke test of the w1 model path
    return p.parse_args()


def roofline_tokens_per_s(wl: Workload, w_bytes: int, kv_bytes: int, bandwidth: float | None) -> float | None:
    if not bandwidth:
        return None
    seconds = decode_bound_seconds([len(p) for p in wl.prompts], wl.output_lens, w_bytes, kv_bytes, bandwidth)
    return wl.output_tokens / seconds


def fill_ratios(rows: list[Row], bound: float | None) -> None:
    """Ratios against nanoserve (prefix caching on) on the same workload, and against the roofline."""
    base = next((r.tokens_per_s for r in rows if r.engine == "nanoserve"), None)
    for r in rows:
        if r.tokens_per_s:
            r.ratio = r.tokens_per_s / base if base else None
            r.roofline_fraction = r.tokens_per_s / bound if bound else None


def write_json(path: str, meta: dict, rows: list[Row]) -> None:
    Path(path).write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=2))


def main() -> None:
    args = parse_args()
    if args.plot_from:   # several JSON files (one per run) merge into one chart
        rows = [r for f in args.plot_from.split(",") for r in json.loads(Path(f).read_text())["rows"]]
        return plot(rows, args.plot or "bench.png")
    cpu = args.cpu or not torch.cuda.is_available()
    engines = args.engines.split(",")
    unknown = (set(engines) - {"nanoserve", "hf", "hf-cb"}) | (set(args.workload.split(",")) - {"w1", "w2"})
    if unknown:
        raise SystemExit(f"unknown engine or workload {sorted(unknown)}: use --engines nanoserve,hf,hf-cb "
                         "and --workload w1,w2")
    hardware = hardware_info(cpu)
    bandwidth = None if cpu else (args.bandwidth or gpu_bandwidth(hardware["gpu"]))
    if not cpu and bandwidth is None:
        log(f"unknown HBM bandwidth for {hardware['gpu']}: pass --bandwidth to get the roofline column")
    model_dir = resolve_model_dir(args, cpu)
    model_cfg = json.loads((Path(model_dir) / "config.json").read_text())
    w_bytes, kv_bytes = weight_bytes(model_dir), kv_bytes_per_token(model_cfg)
    total_bw = bandwidth * args.tp if bandwidth else None    # with TP each GPU streams its own shard
    log(f"{hardware}\nmodel {model_dir}: {w_bytes / 1e9:.3f} GB of weights, {kv_bytes:,} KV bytes/token, "
        f"HBM bandwidth {fmt(bandwidth, '.3g')} B/s x {args.tp} GPU(s)")
    shape = {k: model_cfg[k] for k in (*QWEN3_0_6B, "architectures", "dtype", "torch_dtype") if k in model_cfg}
    meta = {"command": " ".join(sys.argv), "hardware": hardware, "temperature": TEMPERATURE,
            "model": {"dir": model_dir, **shape, "weight_bytes": w_bytes, "kv_bytes_per_token": kv_bytes},
            "bandwidth_bytes_per_s": bandwidth, "tensor_parallel_size": args.tp, "workloads": {}}
    rows: list[Row] = []
    for wl in build_workloads(args, cpu):
        bound = roofline_tokens_per_s(wl, w_bytes, kv_bytes, total_bw)
        meta["workloads"][wl.name] = {"description": wl.description, "requests": len(wl.prompts),
                                      "output_tokens": wl.output_tokens, "roofline_tokens_per_s": bound}
        log(f"\n== {wl.name}: {wl.description}; decode roofline {fmt(bound, ',.0f')} tokens/s")
        wl_rows: list[Row] = []
        for name, runner in engines_for(wl, engines):
            wl_rows.append(run_engine(name, runner, model_dir, wl, args, device="cpu" if cpu else "cuda"))
            fill_ratios(wl_rows, bound)
            if args.json:   # after every engine: a run cut short still leaves its figures
                write_json(args.json, meta, rows + wl_rows)
        rows += wl_rows
    print_table(rows)
    if args.json:
        log(f"wrote {args.json}")
    if args.plot:
        plot([asdict(r) for r in rows], args.plot)


if __name__ == "__main__":
    main()
