"""kernel_report.py: what the decode kernels compile to for an H100 (a developer tool, no GPU).

Compiles the core's paged-decode kernel and the cascade extension's decode kernel (one split, no
shared prefix) for sm_90 with the engine's launch settings at Qwen3-0.6B's heads (GQA group 2,
head dim 128, blocks of 16), once with a bf16 and once with an fp8 cache, and prints for each:
registers per thread, shared memory, how many programs of its warps fit an SM, which loads the
pipeliner made asynchronous (`cp.async` into shared memory), and the main loop's instructions by
opcode.
Pointer and stride arguments get the divisible-by-16 hint that aligned arguments get at run
time; without it Triton cannot vectorize or pipeline the K/V loads and the figures mislead.
docs/fp8_cache.md reads these figures against the kernels' measured bandwidth.

    python tools/kernel_report.py [--top 12]
"""
import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanoserve.extensions import cascade  # noqa: E402
from nanoserve.kernels import decode  # noqa: E402

H100 = dict(registers=65536, shared_bytes=228 * 1024, max_warps=64)  # per SM
SHAPES = dict(GROUP=2, GROUP_PAD=decode.MIN_GROUP_ROWS, HEAD_DIM=128, BLOCK_SIZE=16)
CUOBJDUMP = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"


def cases() -> list[tuple[str, triton.JITFunction, str, dict, int]]:
    """(name, kernel, cache pointer type, constexprs, warps) as the engine launches them."""
    rows = []
    for cache, tile in (("*bf16", decode.TILE_TOKENS), ("*fp8e4nv", decode.TILE_TOKENS_FP8)):
        rows.append((f"paged_decode {cache[1:]}", decode._paged_decode_kernel, cache,
                     dict(SHAPES, TILE=tile, NUM_STAGES=decode.NUM_STAGES), 4))
    # the cascade kernel runs an fp8 cache's products transposed: the group pads to 8, and its
    # launch (tile tokens, warps) is FP8_LAUNCH, or FP8_BUSY_LAUNCH on a busy grid
    for name, cache, group_pad, (tile, warps), step in (
            ("", "*bf16", SHAPES["GROUP_PAD"],
             (cascade.DECODE_TILE_TOKENS, cascade.DECODE_NUM_WARPS), cascade._attend_tile),
            ("", "*fp8e4nv", cascade.FP8_GROUP_ROWS, cascade.FP8_LAUNCH, cascade._attend_tile_t),
            (" busy", "*fp8e4nv", cascade.FP8_GROUP_ROWS, cascade.FP8_BUSY_LAUNCH,
             cascade._attend_tile_t)):
        rows.append((f"cascade_decode {cache[1:]}{name}", cascade._cascade_decode_kernel, cache,
                     dict(SHAPES, GROUP_PAD=group_pad, CASCADE=False, SINGLE_SPLIT=True,
                          ATTEND_TILE=step, BLOCKS_PER_ITER=tile // 16,
                          NUM_STAGES=cascade.DECODE_NUM_STAGES), warps))
    return rows


POINTER_TYPES = {  # element types of pointer arguments; others hold the model dtype (bf16)
    "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "cos_sin_ptr": "*fp32",
    "positions_ptr": "*i64", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
    "num_common_ptr": "*i32", "slot_mapping_ptr": "*i32"}


def argument_type(name: str, cache: str = "*bf16") -> str:
    """Triton's type of a kernel argument that is not a constexpr, from its name."""
    if name in ("k_cache_ptr", "v_cache_ptr"):
        return cache
    if name.endswith("_ptr"):
        return POINTER_TYPES.get(name, "*bf16")
    return "fp32" if name in ("qk_scale", "v_scale", "eps") else "i32"


def compile_sm90(kernel: triton.JITFunction, cache: str, constexprs: dict, warps: int = 4):
    """The kernel compiled for sm_90, its KV cache pointers of type `cache`; pointers and strides
    hinted divisible by 16, as aligned arguments are at run time."""
    params = kernel.params
    signature = {p.name: "constexpr" if p.is_constexpr else argument_type(p.name, cache)
                 for p in params}
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
               if not p.is_constexpr and (p.name.endswith("_ptr") or "stride" in p.name)}
    index = {p.name: i for i, p in enumerate(params)}
    source = ASTSource(kernel, signature, {(index[k],): v for k, v in constexprs.items()}, aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's range: the kernel's main loop."""
    lines = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", line)[1], 16) for line in lines]
    best = (0, -1)
    for line, at in zip(lines, addr):
        target = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", line)
        if target and int(target[1], 16) < at and at - int(target[1], 16) > best[1] - best[0]:
            best = (int(target[1], 16), at)
    return [line for line, at in zip(lines, addr) if best[0] <= at <= best[1]]


def report(name: str, compiled, warps: int, top: int) -> None:
    cubin = Path(f"/tmp/kernel_report_{compiled.metadata.hash}.cubin")
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run([CUOBJDUMP, "-res-usage", cubin], capture_output=True, text=True).stdout
    registers = int(re.search(r"REG:(\d+)", usage)[1])
    shared = compiled.metadata.shared
    fits = min(H100["registers"] // (registers * 32 * warps), H100["max_warps"] // warps,
               H100["shared_bytes"] // max(shared, 1))
    copy = r"async_copy_global_to_local %\S+, %\S+.*?: tensor<(\d+(?:x\d+)*)"
    copies = sorted(set(re.findall(copy, compiled.asm["ttgir"])))  # shapes of the async tiles
    sass = subprocess.run([CUOBJDUMP, "-sass", cubin], capture_output=True, text=True).stdout
    loop = main_loop(sass)
    ops = collections.Counter(m[1] for line in loop
                              if (m := re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)", line)))
    print(f"{name}: {registers} registers, {shared / 1024:.1f} KB shared, {warps} warps, "
          f"{fits} programs an SM; cp.async tiles {copies or 'none'}")
    print(f"  main loop: {len(loop)} instructions; "
          + ", ".join(f"{op} {n}" for op, n in ops.most_common(top)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--top", type=int, default=12, help="opcodes listed per loop")
    args = p.parse_args()
    print(f"triton {triton.__version__}, sm_90")
    for name, kernel, cache, constexprs, warps in cases():
        report(name, compile_sm90(kernel, cache, constexprs, warps), warps, args.top)


if __name__ == "__main__":
    main()
