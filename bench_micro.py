"""bench_micro.py: the GPU micro-benchmarks behind docs/performance.md's kernel figures.

  decode kernel   the core's paged_decode and the cascade extension's cascade_decode (split-KV,
                  what the engine runs on the GPU by default) at Qwen3-0.6B's heads (16 q / 8 KV,
                  head dim 128, bf16, block 16), context 1024: bytes each must read (K and V of
                  every sequence, q, out) over its time, as a fraction of the HBM bandwidth. Inputs
                  rotate through more memory than L2 holds, so every read is a real HBM read. Calls
                  are timed as CUDA-graph replays, as the engine runs decode: no launch time.
  sampler         the sampler as the engine runs it on the GPU (kernels.sampling.sample, compiled
                  by extensions.fused) over Qwen's 151,936 bf16 logits per row, GPU time from
                  CUDA-graph replays (no launch time).
  W1's shapes     both kernels with a bf16 and an fp8 (e4m3) cache at the batches and contexts of
                  W1's decode steps: after t of its steps, the requests still running with their
                  prompt + t tokens each (t = 1, 256, 512, 768), longest context first as the
                  scheduler orders a batch; bytes read over time against the HBM bandwidth.
                  `--w1-shapes` runs this part alone.
  FlashInfer      with `flashinfer-python` installed (`pip install -e '.[flashinfer]'`, never
                  needed to run nanoserve): its batch paged decode, the kernel library vLLM and
                  SGLang use, on the same caches and block tables beside both kernels, as the
                  yardstick (`flashinfer` rows; the first call JIT-compiles its kernels with nvcc,
                  timed and printed).
  decode step     one whole decode forward (model + LM head + sampling) of the random-weight
                  Qwen3-0.6B from bench.py, eager vs CUDA graph, at several batch sizes, context
                  1024.

    python bench_micro.py [--bandwidth 3.35e12] [--json out.json] [--w1-shapes]
"""
import argparse
import functools
import importlib.util
import json
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from bench import HBM_BANDWIDTH, QWEN3_0_6B, make_w1, resolve_model_dir
from nanoserve import LLM, SamplingParams
from nanoserve.extensions.cascade import cascade_decode
from nanoserve.extensions.fused import compiled_steps
from nanoserve.kernels import paged_decode
from nanoserve.scheduler import Batch
from nanoserve.sequence import Sequence

CONTEXT = 1024
H, HKV, D, B = 16, 8, 128, 16  # the kernels' shapes: Qwen3-0.6B's heads and head dim, blocks of 16
DECODE_KERNELS = {"paged_decode": paged_decode, "cascade_decode": cascade_decode}
L2_FLUSH_BYTES = 256 << 20  # rotate inputs through more than the 50-60 MB L2
W1_STEPS = (1, 256, 512, 768)  # W1 decode steps whose batch and contexts are measured
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def flashinfer_pages(block_tables: Tensor, context_lens: Tensor,
                     block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """nanoserve's block tables (S, max_blocks) as FlashInfer's paged-KV layout: indptr (S + 1,),
    the pages of every sequence one after another (indptr[-1],), and the tokens in each
    sequence's last page (S,), 1..block_size; int32, on the tables' device."""
    pages = (context_lens.long() + block_size - 1) // block_size  # (S,)
    used = torch.arange(block_tables.shape[1], device=pages.device) < pages[:, None]  # (S, max)
    indptr = F.pad(pages.cumsum(0), (1, 0))
    last = context_lens.long() - (pages - 1) * block_size
    return indptr.int(), block_tables[used].int(), last.int()


class FlashInferDecode:
    """FlashInfer's batch paged decode (BatchDecodeWithPagedKVCacheWrapper, NHD caches as
    nanoserve's) with paged_decode's arguments. time_graph calls each input set once eagerly,
    then inside a CUDA graph: the first call plans a wrapper for those block tables (host work,
    outside the graph), every call runs it. One instance per shape (time_decode makes it)."""
    compile_seconds: float | None = None  # the process's first call: FlashInfer's JIT compile

    def __init__(self) -> None:
        self.workspace = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")  # split-KV
        self.planned: dict[int, tuple] = {}  # id(block_tables) -> (wrapper, what it holds)

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                 context_lens: Tensor, scale: float) -> Tensor:
        import flashinfer
        if id(block_tables) not in self.planned:
            (_, heads, head_dim), (block, kv_heads) = q.shape, k_cache.shape[1:3]
            start, pages = time.perf_counter(), flashinfer_pages(block_tables, context_lens, block)
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=pages[0],
                paged_kv_indices_buffer=pages[1], paged_kv_last_page_len_buffer=pages[2])
            wrapper.plan(*pages, heads, kv_heads, head_dim, block, q_data_type=q.dtype,
                         kv_data_type=k_cache.dtype, sm_scale=scale)  # out in q's dtype
            self.planned[id(block_tables)] = wrapper, block_tables, pages
            if FlashInferDecode.compile_seconds is None:
                wrapper.run(q, (k_cache, v_cache))
                torch.cuda.synchronize()
                FlashInferDecode.compile_seconds = time.perf_counter() - start
                print(f"FlashInfer: first plan and run (JIT compile) "
                      f"{FlashInferDecode.compile_seconds:.0f} s", flush=True)
        return self.planned[id(block_tables)][0].run(q, (k_cache, v_cache))


if importlib.util.find_spec("flashinfer") is not None:  # the yardstick, where installed
    DECODE_KERNELS["flashinfer"] = FlashInferDecode


def time_cuda(fn, iters: int = 20) -> float:
    """Median seconds of fn() over iters runs, timed with CUDA events after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return float(np.median(times))


def paged_inputs(context_lens: list[int], kv_dtype: torch.dtype
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q (S, H, D) in bf16, K and V caches (blocks, B, HKV, D) of kv_dtype, and block tables (S,
    max blocks) that give each sequence its own blocks, scattered at random over the cache."""
    batch, blocks = len(context_lens), [-(-n // B) for n in context_lens]
    k = torch.randn(sum(blocks), B, HKV, D, device="cuda").to(kv_dtype)
    v = torch.randn_like(k, dtype=torch.float32).to(kv_dtype)
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
    order = torch.randperm(sum(blocks), device="cuda", dtype=torch.int32)
    tables = torch.zeros(batch, max(blocks), device="cuda", dtype=torch.int32)  # (S, max)
    for i, own in enumerate(order.split(blocks)):  # each sequence its own blocks
        tables[i, :len(own)] = own
    return q, k, v, tables


def time_decode(decode_fn: Callable, context_lens: list[int],
                kv_dtype: torch.dtype) -> tuple[float, int]:
    """decode_fn's median seconds over sequences of these contexts (paged_inputs), and the
    bytes it must read: K and V of every sequence, q, out."""
    if isinstance(decode_fn, type):  # a kernel planned per shape (FlashInferDecode): a new one
        decode_fn = decode_fn()
    kv_bytes = 2 * sum(context_lens) * HKV * D * kv_dtype.itemsize
    copies = max(1, L2_FLUSH_BYTES // kv_bytes + 1)
    sets = [paged_inputs(context_lens, kv_dtype) for _ in range(copies)]
    lens = torch.tensor(context_lens, device="cuda", dtype=torch.int32)
    # one graph of >= 12 calls, each on the next copy, so nothing is served from L2
    calls = [functools.partial(decode_fn, *inputs, lens, D ** -0.5) for inputs in sets]
    return time_graph(calls * -(-12 // copies)), kv_bytes + 2 * len(context_lens) * H * D * 2


def time_graph(calls: list[Callable]) -> float:
    """Median seconds of one of `calls`, from replays of a CUDA graph that runs them all in turn:
    no launch time, as in the engine's decode graphs."""
    for fn in calls:  # compile outside the graph
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return time_cuda(graph.replay, iters=10) / len(calls)


def decode_kernel(name: str, decode_fn: Callable, batch: int, bandwidth: float) -> dict:
    seconds, bytes_read = time_decode(decode_fn, [CONTEXT] * batch, torch.bfloat16)
    bytes_per_s = bytes_read / seconds
    return {"kernel": name, "batch": batch, "us": seconds * 1e6, "bytes": bytes_read,
            "TB/s": bytes_per_s / 1e12, "fraction_of_bandwidth": bytes_per_s / bandwidth}


def w1_step_kernel(name: str, decode_fn: Callable, step: int, kv: str, bandwidth: float) -> dict:
    """One decode kernel at W1's decode step `step`: its running requests, each with its prompt
    plus `step` tokens of context, over a cache of dtype kv; bytes read / time / bandwidth."""
    w1 = make_w1()
    lens = sorted((len(p) + step for p, n in zip(w1.prompts, w1.output_lens) if n > step),
                  reverse=True)  # the scheduler's order: longest context first
    seconds, bytes_read = time_decode(decode_fn, lens, KV_DTYPES[kv])
    return {"kernel": name, "kv": kv, "step": step, "batch": len(lens),
            "mean_context": sum(lens) / len(lens), "us": seconds * 1e6, "bytes": bytes_read,
            "fraction_of_bandwidth": bytes_read / seconds / bandwidth}


def flashinfer_agrees() -> float:
    """The largest difference between FlashInfer's decode and paged_decode's on one bf16 shape
    (64 sequences of 1 to 2,000 tokens): the yardstick computes the same attention."""
    torch.manual_seed(0)
    context_lens = torch.randint(1, 2000, (64,)).tolist()
    inputs = paged_inputs(context_lens, torch.bfloat16)
    lens = torch.tensor(context_lens, device="cuda", dtype=torch.int32)
    ours = paged_decode(*inputs, lens, D ** -0.5)
    theirs = FlashInferDecode()(*inputs, lens, D ** -0.5)
    return float((ours.float() - theirs.float()).abs().max())


def w1_shapes(bandwidth: float) -> list[dict]:
    rows = []
    for kernel, decode_fn in DECODE_KERNELS.items():
        for kv in KV_DTYPES:
            for step in W1_STEPS:
                r = w1_step_kernel(kernel, decode_fn, step, kv, bandwidth)
                rows.append(r)
                print(f"{kernel:14s} {kv:4s} W1 step {step:3d} (batch {r['batch']:3d}, context "
                      f"{r['mean_context']:6.0f}): {r['us']:7.1f} us  "
                      f"{100 * r['fraction_of_bandwidth']:.0f}% of {bandwidth / 1e12:.2f} TB/s",
                      flush=True)
    return rows


def decode_step(llm: LLM, batch: int, graphs: bool) -> float:
    """Seconds of one decode step (inputs -> forward -> sample) for `batch` sequences of CONTEXT
    tokens."""
    runner = llm.model_runner
    B = llm.config.kvcache_block_size
    seqs = []
    for s in range(batch):
        seq = Sequence(list(range(1, CONTEXT + 1)), SamplingParams(temperature=0), B)
        seq.block_table = list(range(s * CONTEXT // B, (s + 1) * CONTEXT // B))
        seqs.append(seq)
    inputs = runner.prepare(Batch.decode(seqs))
    max_graph_batch = runner.max_graph_batch
    runner.max_graph_batch = max_graph_batch if graphs else 0  # 0: every decode runs eagerly
    seconds = time_cuda(lambda: runner.sample(runner.forward(inputs), seqs), iters=30)
    runner.max_graph_batch = max_graph_batch
    return seconds


def sampler(batch: int, vocab: int = 151_936, calls: int = 20) -> float:
    """GPU seconds of one call of the compiled sampler on (batch, vocab) bf16 logits at temperature
    0.6 (bench.py's): `calls` calls captured in one CUDA graph, so no launch time is counted, as in
    the engine, where the sampler's launches overlap the forward pass."""
    logits = torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16) * 3
    temperatures = torch.full((batch,), 0.6, device="cuda")
    keys = torch.randint(0, 2**62, (batch,), device="cuda")
    sample = compiled_steps()["sample"]
    sample(logits, temperatures, keys)  # compile outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            sample(logits, temperatures, keys)
    return time_cuda(graph.replay, iters=10) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bandwidth", type=float, help="HBM bytes/s (default: by GPU name)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--w1-shapes", action="store_true", help="only the kernels at W1's shapes")
    args = p.parse_args()
    name = torch.cuda.get_device_name()
    bandwidth = args.bandwidth or next(bw for key, bw in HBM_BANDWIDTH if key in name)
    result = {"gpu": name, "bandwidth": bandwidth, "kernel": [], "step": []}
    if "flashinfer" in DECODE_KERNELS:
        result["flashinfer_max_difference"] = difference = flashinfer_agrees()
        result["flashinfer_compile_seconds"] = FlashInferDecode.compile_seconds
        print(f"FlashInfer against paged_decode, bf16: largest difference {difference:.2e}")
    else:
        print("FlashInfer is not installed (pip install -e '.[flashinfer]'): no yardstick rows")
    result["w1_shapes"] = w1_shapes(bandwidth)
    if args.w1_shapes:
        return write(result, args.json)
    for kernel, decode_fn in DECODE_KERNELS.items():
        for batch in (256, 32, 1):
            r = decode_kernel(kernel, decode_fn, batch, bandwidth)
            result["kernel"].append(r)
            print(f"{kernel:14s} batch {batch:3d}: {r['us']:8.1f} us  {r['TB/s']:.2f} TB/s  "
                  f"{100 * r['fraction_of_bandwidth']:.0f}% of {bandwidth / 1e12:.2f} TB/s",
                  flush=True)
    result["sampler"] = [{"batch": b, "us": sampler(b) * 1e6} for b in (1, 32, 256)]
    for r in result["sampler"]:
        print(f"sampler batch {r['batch']:3d}: {r['us']:6.1f} us", flush=True)
    model_dir = resolve_model_dir(argparse.Namespace(model=None, tiny=False), cpu=False)
    with LLM(model_dir, max_model_len=2048, num_kvcache_blocks=256 * CONTEXT // 16 + 64) as llm:
        for batch in (1, 32, 256):
            eager, graph = decode_step(llm, batch, False), decode_step(llm, batch, True)
            result["step"].append({"batch": batch, "eager_ms": eager * 1e3,
                                   "graph_ms": graph * 1e3})
            print(f"decode step batch {batch:3d}: eager {eager * 1e3:7.2f} ms  "
                  f"graph {graph * 1e3:7.2f} ms  ({eager / graph:.1f}x)", flush=True)
    write(result, args.json)


def write(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    assert torch.cuda.is_available(), "bench_micro.py measures GPU kernels: run it on an NVIDIA GPU"
    assert QWEN3_0_6B["head_dim"] == 128
    main()
