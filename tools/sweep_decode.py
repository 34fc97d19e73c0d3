"""sweep_decode.py: cascade_decode's launch settings and batch order on ragged contexts (a
developer tool, GPU; nanoserve/extensions/cascade.py holds the settings).

For each case (batch S, contexts drawn uniformly from lo-hi tokens, the batch unsorted or sorted
longest first, as the scheduler orders it), and each (tile tokens, pipeline stages, warps) setting,
it times 20 calls captured in one CUDA graph and reports microseconds per call and the fraction of
HBM bandwidth (the K/V bytes the call must read over its time). Qwen3-0.6B heads: 16 q / 8 KV, head
dim 128, bf16 queries, block 16; the cache in bf16, or fp8 (--kv-cache-dtype fp8: each setting
is both FP8_LAUNCH and FP8_BUSY_LAUNCH). The sorted and unsorted cases draw their own context
lengths from the same range, so compare their bandwidth fractions, not their microseconds.

    python tools/sweep_decode.py [--kv-cache-dtype bf16,fp8] [--sorted]
    # writes $OUT/sweep.json (or ./sweep.json); --sorted: only the scheduler's order
"""
import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanoserve.extensions import cascade  # noqa: E402

H, Hkv, D, B = 16, 8, 128, 16
BANDWIDTH = 3.35e12  # H100 SXM HBM3, bytes/s
CASES = [(256, 100, 2000), (256, 1024, 1024), (128, 600, 2048), (64, 800, 2048)]  # (S, lo, hi)
NANOSERVE = (cascade.DECODE_TILE_TOKENS, cascade.DECODE_NUM_STAGES, cascade.DECODE_NUM_WARPS)
CONFIGS = [NANOSERVE] + [c for c in [(64, 3, 4), (64, 2, 4), (64, 4, 4), (32, 3, 4), (32, 4, 4),
                                     (32, 2, 4), (128, 2, 4), (128, 2, 8), (64, 3, 8), (32, 3, 2)]
                         if c != NANOSERVE]  # (tile tokens, stages, warps); nanoserve's first
NANOSERVE_FP8 = (cascade.FP8_LAUNCH[0], cascade.DECODE_NUM_STAGES, cascade.FP8_LAUNCH[1])
NANOSERVE_FP8_BUSY = (cascade.FP8_BUSY_LAUNCH[0], cascade.DECODE_NUM_STAGES,
                      cascade.FP8_BUSY_LAUNCH[1])
CONFIGS_FP8 = [NANOSERVE_FP8] + [c for c in [NANOSERVE_FP8_BUSY, (64, 3, 4), (64, 2, 2),
                                             (32, 3, 2), (128, 3, 4)]
                                 if c != NANOSERVE_FP8]  # 8 warps or 256 rows were far slower
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def make_case(S: int, lo: int, hi: int, sort: bool, num_blocks: int,
              value_bytes: int = 2) -> tuple:
    """q (S, H, D), block tables scattered over the cache, context lengths, and the K/V bytes to
    read (value_bytes per cached value)."""
    lens = torch.randint(lo, hi + 1, (S,))
    if sort:
        lens = lens.sort(descending=True).values
    max_blocks = (int(lens.max()) + B - 1) // B
    tables = torch.randperm(num_blocks, dtype=torch.int32)[:S * max_blocks]
    tables = tables.view(S, max_blocks).cuda()  # (S, max_blocks)
    q = torch.randn(S, H, D, device="cuda", dtype=torch.bfloat16)
    return q, tables, lens.to(torch.int32).cuda(), int(lens.sum()) * Hkv * D * 2 * value_bytes


def graph_time(fn, reps: int = 20) -> float:
    """Seconds per call of fn, replayed as `reps` calls captured in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (2 * reps)


LAUNCH_SETTINGS = ("DECODE_TILE_TOKENS", "DECODE_NUM_STAGES", "DECODE_NUM_WARPS", "FP8_LAUNCH",
                   "FP8_BUSY_LAUNCH")  # what set_launch changes


def set_launch(cache: str, tile: int, stages: int, warps: int) -> None:
    """cascade_decode reads its launch settings from these constants at each call."""
    cascade.DECODE_NUM_STAGES = stages
    if cache == "fp8":  # both fp8 launches: the setting holds for any grid
        cascade.FP8_LAUNCH = cascade.FP8_BUSY_LAUNCH = (tile, warps)
    else:
        cascade.DECODE_TILE_TOKENS, cascade.DECODE_NUM_WARPS = tile, warps


def sweep(cache: str, sorts: tuple[bool, ...], results: list[dict]) -> None:
    """Every case and launch setting with a cache of dtype cache ("bf16" or "fp8")."""
    torch.manual_seed(0)
    num_blocks = 2 * 256 * 2048 // B + 64
    # (num_blocks, B, Hkv, D), ~2 GB each in bf16: far past L2
    k = torch.randn(num_blocks, B, Hkv, D, device="cuda").to(CACHE_DTYPES[cache])
    v = torch.randn_like(k, dtype=torch.float32).to(CACHE_DTYPES[cache])
    configs = CONFIGS_FP8 if cache == "fp8" else CONFIGS
    kept = {name: getattr(cascade, name) for name in LAUNCH_SETTINGS}  # restored after the sweep
    for S, lo, hi in CASES:
        for sort in sorts:
            q, tables, lens, nbytes = make_case(S, lo, hi, sort, num_blocks, k.element_size())
            default = cascade.default_num_splits(S, Hkv, tables.shape[1], q.device,
                                                 warps=configs[0][2])  # the engine's launch
            for splits in sorted({default, 1, 2}):
                for tile, stages, warps in configs if splits == default else configs[:1]:
                    set_launch(cache, tile, stages, warps)
                    t = graph_time(functools.partial(cascade.cascade_decode, q, k, v, tables,
                                                     lens, D ** -0.5, num_splits=splits))
                    row = dict(cache=cache, S=S, lens=f"{lo}-{hi}", sort=sort, splits=splits,
                               tile=tile, stages=stages, warps=warps, us=round(t * 1e6, 1),
                               bw=round(nbytes / t / BANDWIDTH, 3))
                    print(row, flush=True)
                    results.append(row)
    for name, value in kept.items():
        setattr(cascade, name, value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv-cache-dtype", default="bf16", help="comma list of bf16, fp8")
    p.add_argument("--sorted", action="store_true", help="only batches sorted longest first")
    args = p.parse_args()
    results: list[dict] = []
    for cache in args.kv_cache_dtype.split(","):
        sweep(cache, (True,) if args.sorted else (False, True), results)
    with open(os.path.join(os.environ.get("OUT", "."), "sweep.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
