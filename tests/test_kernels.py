"""Each kernel of nanoserve/kernels/ against its plain-torch reference; the references against naive
loops.

CPU (CI): the Triton kernels run under Triton's interpreter. Triton reads TRITON_INTERPRET once,
when it is imported (its own tl.sum / tl.max are @triton.jit functions built then), so one process
cannot hold both compiled and interpreted kernels. The *_interpreted tests therefore run only in a
process started with TRITON_INTERPRET=1; in any other run,
test_kernels_interpreted.py::test_kernels_under_triton_interpreter starts such a child process for
them (a file of its own: the GPU suite's first run, the GPU's tests, leaves it to the second). The
kernels are also compiled for a Hopper GPU (sm_90) on the CPU, which catches what only the GPU
compiler rejects. GPU tests carry the `gpu` marker and skip without CUDA.
Run: `python -m pytest -q tests/test_kernels.py` (CPU; GPU tests skip), `... -m gpu` on a GPU.
"""

import functools
import math
import pathlib
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from decode_ref import paged_decode_ref
from fused_ref import rotary_and_store_ref
from torch import Tensor

from nanoserve import kernels
from nanoserve.extensions import cascade, fused
from nanoserve.extensions.cascade import cascade_decode
from nanoserve.kernels import decode
from nanoserve.layers import RotaryEmbedding

FP8 = torch.float8_e4m3fn  # kv_cache_dtype="fp8"
# neighbouring e4m3 values: 3 mantissa bits, so 1/8 apart relative; subnormals 2^-9 apart
FP8_TOL = dict(atol=2**-9, rtol=2**-3)
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
interpreted = pytest.mark.skipif(
    not kernels.INTERPRETED, reason="needs TRITON_INTERPRET=1 from start-up: "
    "test_kernels_interpreted.py runs it in a child process")


def make_paged_kv(context_lens: list[int], B: int, Hkv: int, D: int, dtype: torch.dtype,
                  device: str = "cpu", seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Caches whose unused slots hold NaN, scattered blocks, and block-table columns past each
    sequence filled with -1 or a huge id: a kernel that reads anything it should not either fails or
    returns NaN."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(n / B) for n in context_lens]
    num_blocks, max_blocks = sum(blocks) + 2, max(blocks) + 2
    k_cache = torch.full((num_blocks, B, Hkv, D), float("nan"))  # (num_blocks, B, Hkv, D)
    v_cache = torch.full((num_blocks, B, Hkv, D), float("nan"))
    block_tables = torch.full((len(blocks), max_blocks), -1, dtype=torch.int32)  # (S, max_blocks)
    block_tables[:, max_blocks - 1] = 10**7  # garbage past the end: never dereference
    free = torch.randperm(num_blocks, generator=gen).tolist()
    for s, (n, nb) in enumerate(zip(context_lens, blocks)):
        ids = [free.pop() for _ in range(nb)]
        block_tables[s, :nb] = torch.tensor(ids, dtype=torch.int32)
        for t in range(n):  # only the first n slots of the sequence hold data
            k_cache[ids[t // B], t % B] = torch.randn(Hkv, D, generator=gen)
            v_cache[ids[t // B], t % B] = torch.randn(Hkv, D, generator=gen)
    context_lens_t = torch.tensor(context_lens, dtype=torch.int32, device=device)  # (S,)
    caches = k_cache.to(device, dtype), v_cache.to(device, dtype)
    return *caches, block_tables.to(device), context_lens_t


def make_cascade_kv(num_common: int, own_lens: list[int], B: int, Hkv: int, D: int,
                    dtype: torch.dtype, device: str = "cpu",
                    seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sequences that share their first num_common blocks (the same physical ids, as prefix caching
    makes them), then own_lens[s] tokens each in their own shuffled blocks. Slots past a sequence's
    end, unused blocks and block-table columns past the end are garbage (NaN, -1, a huge id), as in
    make_paged_kv."""
    gen = torch.Generator().manual_seed(seed)
    own_blocks = [math.ceil(n / B) for n in own_lens]
    num_blocks, max_blocks = num_common + sum(own_blocks) + 2, num_common + max(own_blocks) + 2
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)  # shared blocks first, then own
    k_cache = torch.randn(num_blocks, B, Hkv, D, generator=gen)  # (num_blocks, B, Hkv, D)
    v_cache = torch.randn(num_blocks, B, Hkv, D, generator=gen)
    block_tables = torch.full((len(own_lens), max_blocks), -1, dtype=torch.int32)  # (S, max_blocks)
    block_tables[:, max_blocks - 1] = 10**7
    block_tables[:, :num_common] = ids[:num_common]  # every sequence points at the same prefix
    first = num_common
    for s, (n, nb) in enumerate(zip(own_lens, own_blocks)):
        block_tables[s, num_common:num_common + nb] = ids[first:first + nb]
        if n % B:  # the ragged tail of the last block is garbage
            last = ids[first + nb - 1]
            k_cache[last, n % B:] = v_cache[last, n % B:] = float("nan")
        first += nb
    k_cache[ids[first:].long()] = v_cache[ids[first:].long()] = float("nan")  # blocks nobody owns
    context_lens = torch.tensor([num_common * B + n for n in own_lens], dtype=torch.int32,
                                device=device)
    caches = k_cache.to(device, dtype), v_cache.to(device, dtype)
    return *caches, block_tables.to(device), context_lens


# --------------------------------------------------------------------------------------------------
# CPU: Triton kernels under the interpreter vs references
# --------------------------------------------------------------------------------------------------

def make_rotary_inputs(N: int, H: int, Hkv: int, D: int, dtype: torch.dtype, device: str = "cpu",
                       num_blocks: int = 8, B: int = 16,
                       cache_dtype: torch.dtype | None = None) -> dict:
    """A fused qkv projection's views, positions, a rotary table, q/k norm weights, and caches (in
    cache_dtype, default dtype) with slots scattered over them (every 4th token padded: slot -1)."""
    cache_dtype = cache_dtype or dtype
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(N, (H + 2 * Hkv) * D, generator=gen).to(device, dtype)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], -1)
    slots = torch.randperm(num_blocks * B, generator=gen)[:N].to(torch.int32)
    slots[::4] = -1
    return dict(q=q.view(N, H, D), k=k.view(N, Hkv, D), v=v.view(N, Hkv, D),
                positions=torch.randint(0, 4096, (N,), generator=gen).to(device),
                cos_sin=RotaryEmbedding(D, 4096, 1e6).cos_sin.to(device),
                k_cache=torch.randn(num_blocks, B, Hkv, D, generator=gen).to(device, cache_dtype),
                v_cache=torch.randn(num_blocks, B, Hkv, D, generator=gen).to(device, cache_dtype),
                slot_mapping=slots.to(device),
                qk_norm=(torch.rand(D, generator=gen).to(device, dtype) + 0.5,
                         torch.rand(D, generator=gen).to(device, dtype) + 0.5, 1e-6))


def check_rotary_and_store(args: dict, qk_norm: bool, store: bool, tol: dict) -> None:
    """The kernel rotates q and k in place and stores like the reference; untouched slots stay
    untouched. An fp8 cache: k may round to a neighbouring e4m3 value where the kernel's and the
    reference's rotations differ in their last bit; v, only cast, rounds the same."""
    if not qk_norm:
        args["qk_norm"] = None
    if not store:
        args["k_cache"] = args["v_cache"] = torch.tensor([], device=args["q"].device)
    ref_args = {name: t.clone() if isinstance(t, Tensor) else t for name, t in args.items()}
    q_ref, k_ref = rotary_and_store_ref(**ref_args)
    q, k = fused.rotary_and_store(**args)
    assert q.data_ptr() == args["q"].data_ptr() and k.data_ptr() == args["k"].data_ptr()  # in place
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k, k_ref, **tol)
    assert torch.equal(args["v"], ref_args["v"])
    cache_tol = FP8_TOL if args["k_cache"].dtype == FP8 else tol
    torch.testing.assert_close(args["k_cache"].float(), ref_args["k_cache"].float(), **cache_tol)
    # values are copied (and cast), not computed
    assert torch.equal(args["v_cache"].float(), ref_args["v_cache"].float())


@interpreted
# Qwen3-0.6B; SmolLM2, whose 9 and 3 heads pad to 16 and 4
@pytest.mark.parametrize("H, Hkv, D", [(16, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("qk_norm, store", [(True, True), (False, False), (True, False)])
def test_rotary_and_store_interpreted(H: int, Hkv: int, D: int, qk_norm: bool, store: bool) -> None:
    args = make_rotary_inputs(9, H, Hkv, D, torch.float32)
    check_rotary_and_store(args, qk_norm, store, dict(atol=1e-5, rtol=1e-5))


@pytest.fixture
def torch_fp8_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter rounds a float cast to e4m3 without carrying into the exponent (1.98
    becomes 1.0, 500 becomes 256) and reads e4m3's NaN as 480. The GPU rounds to nearest even and
    saturates at +-448 (cvt.rn.satfinite): the interpreter gets torch's cast, saturated first
    (kernels.to_cache_dtype: torch before 2.13 casts past 480 to NaN)."""
    import triton.language as tl
    from triton.runtime import interpreter
    original = interpreter._convert_float
    dtypes = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
              tl.float8e4nv: FP8}

    def convert(data: np.ndarray, src, dst, rounding_mode) -> np.ndarray:
        if tl.float8e4nv not in (src, dst):
            return original(data, src, dst, rounding_mode)
        flat = torch.from_numpy(np.ascontiguousarray(data).reshape(-1)).view(dtypes[src])
        cast = kernels.to_cache_dtype(flat, FP8) if dst == tl.float8e4nv else flat.to(dtypes[dst])
        out = cast.view(torch.uint8).numpy()  # the bytes, viewed by the caller
        return out.view(interpreter._get_np_dtype(dst)).reshape(np.shape(data))

    monkeypatch.setattr(interpreter, "_convert_float", convert)


@interpreted
@pytest.mark.parametrize("H, Hkv, D", [(16, 8, 128), (9, 3, 64)])
def test_rotary_and_store_fp8_interpreted(torch_fp8_casts: None, H: int, Hkv: int, D: int) -> None:
    """The store quantizes to e4m3 in its cast, as the reference store does."""
    args = make_rotary_inputs(9, H, Hkv, D, torch.float32, cache_dtype=FP8)
    args["v"][1] *= 1000  # past e4m3's largest value, 448: saturates
    check_rotary_and_store(args, True, True, dict(atol=1e-5, rtol=1e-5))


@interpreted
def test_rotary_and_store_rejects_a_head_dim_not_a_power_of_two_interpreted() -> None:
    args = make_rotary_inputs(3, 4, 2, 48, torch.float32)
    with pytest.raises(AssertionError, match="power of two"):
        fused.rotary_and_store(**args)


def sample_case(S: int, V: int, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> list[Tensor]:
    """logits (S, V), temperatures, keys with the sampler's corner cases in the first rows."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(S, V, generator=gen) * 3
    logits[1, :V // 2] = float("-inf")  # a masked row (top-k / top-p): its first half is out
    logits[3, [3, V - 1]] = 50.0  # a tie for the max, near either end: the first wins
    temperatures = torch.rand(S, generator=gen) + 0.3
    temperatures[::3] = 0  # every third row greedy
    keys = torch.randint(0, 2**62, (S,), generator=gen)
    keys[4], keys[5] = 0, 2**63 - 1  # either end of the key range
    return [logits.to(device, dtype), temperatures.to(device), keys.to(device)]


def check_race(logits: Tensor, temperatures: Tensor, tokens: Tensor) -> None:
    """Greedy rows took the (first) argmax, every other row a token of probability > 0."""
    greedy = temperatures == 0
    assert torch.equal(tokens[greedy], logits[greedy].float().argmax(-1))
    chosen = logits[~greedy].float().gather(1, tokens[~greedy].unsqueeze(1))
    assert (chosen > float("-inf")).all()


def test_sample_keeps_the_race_contract() -> None:
    """kernels.sample on the CPU: greedy rows take the first argmax, the others a token of
    probability > 0, keys at either end of the range included; a key decides the draw."""
    args = sample_case(12, 100)
    tokens = kernels.sample(*args)
    check_race(args[0], args[1], tokens)
    assert torch.equal(kernels.sample(*(a.flip(0) for a in args)), tokens.flip(0))


def test_rotary_ref_rotates_pairs_by_position() -> None:
    """rotary_ref against the definition: pair (x[i], x[i + D/2]) turns by
    position * theta^(-2i/D)."""
    D, pos = 8, 5
    x = torch.randn(1, 1, D)
    cos_sin = RotaryEmbedding(D, 16, 100.0).cos_sin
    out = kernels.rotary_ref(x, cos_sin[torch.tensor([pos])])
    for i in range(D // 2):
        angle = pos * 100.0 ** (-2 * i / D)
        a, b = x[0, 0, i].item(), x[0, 0, i + D // 2].item()
        cos, sin = math.cos(angle), math.sin(angle)
        assert out[0, 0, i].item() == pytest.approx(a * cos - b * sin, abs=1e-5)
        assert out[0, 0, i + D // 2].item() == pytest.approx(b * cos + a * sin, abs=1e-5)


DECODE_SHAPES = [  # (group = H // Hkv, Hkv, D, B)
    (1, 2, 64, 16),
    (2, 2, 128, 16),  # Qwen3-0.6B's group and head dim
    (3, 3, 64, 32),   # SmolLM2: 9 q / 3 kv heads
    (8, 1, 64, 16),
]
CORE_DECODE_SHAPES = DECODE_SHAPES + [(5, 2, 32, 64)]  # a group of 5; blocks of 64, 4 per context


def check_paged_decode_interpreted(decode_fn, group: int, Hkv: int, D: int, B: int) -> None:
    # context 1, exactly one block, ragged, exactly two blocks, 0 (a padded CUDA-graph slot)
    context_lens = [1, B, 2 * B + 5, 2 * B, 0]
    k_cache, v_cache, block_tables, ctx = make_paged_kv(context_lens, B, Hkv, D, torch.float32)
    q = torch.randn(len(context_lens), group * Hkv, D)  # (S, H, D)
    args = (q, k_cache, v_cache, block_tables, ctx, D**-0.5)
    out = decode_fn(*args)
    torch.testing.assert_close(out, paged_decode_ref(*args), atol=1e-5, rtol=1e-5)
    assert torch.all(out[-1] == 0)  # context_len 0: zeros, not NaN


@interpreted
@pytest.mark.parametrize("group, Hkv, D, B", CORE_DECODE_SHAPES)
def test_paged_decode_interpreted(group: int, Hkv: int, D: int, B: int) -> None:
    """The core kernel: one program per (KV head, sequence)."""
    check_paged_decode_interpreted(kernels.paged_decode, group, Hkv, D, B)


@interpreted
@pytest.mark.parametrize("group, Hkv, D, B, num_splits",  # each shape, each split count once
                         [(*shape, n) for shape, n in zip(DECODE_SHAPES, [1, 3, None, 3])])
def test_cascade_decode_interpreted(group: int, Hkv: int, D: int, B: int,
                                    num_splits: int | None) -> None:
    """The extension's split-KV kernels without a shared prefix."""
    check_paged_decode_interpreted(functools.partial(cascade_decode, num_splits=num_splits), group,
                                   Hkv, D, B)


@interpreted
@pytest.mark.parametrize("tile, group_pad", [(16, 16), (64, 32)])
def test_paged_decode_tile_variants_interpreted(tile: int, group_pad: int) -> None:
    """The core kernel with tiles smaller and larger than a block (B = 32), wider group padding."""
    group, Hkv, D, B = 3, 2, 64, 32
    kv = make_paged_kv([1, 3 * B + 7, 2 * B], B, Hkv, D, torch.float32)
    args = (torch.randn(3, group * Hkv, D), *kv, 0.125)
    with pytest.MonkeyPatch.context() as mp:  # the launch settings that paged_decode reads
        mp.setattr(decode, "TILE_TOKENS", tile)
        mp.setattr(decode, "MIN_GROUP_ROWS", group_pad)
        mp.setattr(decode, "NUM_STAGES", 1)
        out = kernels.paged_decode(*args)
    torch.testing.assert_close(out, paged_decode_ref(*args), atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("blocks_per_iter, group_pad", [(1, 16), (2, 32)])
def test_cascade_decode_tile_variants_interpreted(blocks_per_iter: int, group_pad: int) -> None:
    """Tiles of one and of several blocks (a tile's last block partly past the split), wider group
    padding."""
    group, Hkv, D, B = 3, 2, 64, 16
    kv = make_paged_kv([1, 3 * B + 7, 2 * B], B, Hkv, D, torch.float32)
    args = (torch.randn(3, group * Hkv, D), *kv, 0.125)
    with pytest.MonkeyPatch.context() as mp:  # the launch settings that cascade_decode reads
        mp.setattr(cascade, "DECODE_TILE_TOKENS", blocks_per_iter * B)
        mp.setattr(decode, "MIN_GROUP_ROWS", group_pad)
        mp.setattr(cascade, "DECODE_NUM_STAGES", 1)
        out = cascade_decode(*args, num_splits=2)
    torch.testing.assert_close(out, paged_decode_ref(*args), atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("decode_fn", [kernels.paged_decode,
                                       functools.partial(cascade_decode, num_splits=2)])
def test_paged_decode_fp16_interpreted(decode_fn) -> None:
    """Half precision in and out. (Not bf16: numpy has none, and the interpreter's tl.dot gets
    it wrong.)"""
    k_cache, v_cache, block_tables, ctx = make_paged_kv([5, 37], 16, 2, 64, torch.float16)
    q = torch.randn(2, 4, 64, dtype=torch.float16)
    out = decode_fn(q, k_cache, v_cache, block_tables, ctx, 0.125)
    assert out.dtype == torch.float16
    ref = paged_decode_ref(q, k_cache, v_cache, block_tables, ctx, 0.125)
    torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-3)


@interpreted
@pytest.mark.parametrize("group, Hkv, D, B", [(2, 2, 128, 16), (3, 3, 64, 32), (5, 1, 64, 16)])
def test_paged_decode_fp8_interpreted(torch_fp8_casts: None, group: int, Hkv: int, D: int,
                                      B: int) -> None:
    """The core kernel on an fp8 cache (unused slots NaN, which e4m3 has), bf16 queries as the
    engine passes them: it dequantizes in registers and must match the reference, which reads the
    same e4m3 values in fp32."""
    kv = make_paged_kv([1, B, 2 * B + 5, 300, 0], B, Hkv, D, FP8)  # 300: several 128-token tiles
    q = torch.randn(5, group * Hkv, D).bfloat16()  # (S, H, D)
    out = kernels.paged_decode(q, *kv, D**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, paged_decode_ref(q, *kv, D**-0.5), atol=2e-2, rtol=2e-2)
    assert torch.all(out[-1] == 0)


@interpreted
@pytest.mark.parametrize("group, Hkv, D, B", [(2, 2, 128, 16), (3, 3, 64, 32)])
@pytest.mark.parametrize("num_splits, prefix, busy", [(1, False, True), (None, True, False)])
def test_cascade_decode_fp8_interpreted(torch_fp8_casts: None, group: int, Hkv: int, D: int,
                                        B: int, num_splits: int | None, prefix: bool,
                                        busy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp8 cache (unused slots NaN, which e4m3 has), bf16 queries as the engine passes them: the
    kernels dequantize in registers and must match the reference, which reads the same e4m3
    values in fp32. Plain, and cascade with a 2-block shared prefix; busy: the launch of a busy
    grid (FP8_BUSY_LAUNCH's shorter tiles)."""
    if busy:
        monkeypatch.setattr(cascade, "FP8_BUSY_PROGRAMS_PER_SM", 0)
    own_lens = [1, B, 2 * B + 5, 0]  # ragged, one block, several, a padded row
    if prefix:
        kv = make_cascade_kv(2, own_lens, B, Hkv, D, FP8)
        kv[3][-1] = 0  # a padded row holds no prefix either
    else:
        kv = make_paged_kv(own_lens, B, Hkv, D, FP8)
    q = torch.randn(len(own_lens), group * Hkv, D).bfloat16()  # (S, H, D)
    P = torch.tensor([2], dtype=torch.int32) if prefix else None
    out = cascade_decode(q, *kv, D**-0.5, num_common_blocks=P, num_splits=num_splits)
    assert out.dtype == torch.bfloat16
    ref = paged_decode_ref(q, *kv, D**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert torch.all(out[-1] == 0)


# num_common 3: the whole shared prefix = all full blocks of the shortest sequence (0 own tokens).
# num_splits 1: the own kernel folds the prefix partials in; None (2 splits on the interpreter's 8
# "SMs"): the merge kernel combines them all.
@interpreted
@pytest.mark.parametrize("group, Hkv, D, num_common, num_splits",  # P = 3 with either split
                         [(1, 2, 64, 0, 1), (2, 2, 128, 2, None), (4, 1, 64, 3, 1),
                          (1, 2, 64, 3, None)])
def test_cascade_decode_prefix_interpreted(group: int, Hkv: int, D: int, num_common: int,
                                           num_splits: int | None) -> None:
    """A shared prefix passed as num_common_blocks: same result as plain paged decode, for any P
    that is shared (P = 0 too), with several prefix splits (some idle) and a padded row
    (context_len 0)."""
    B, own_lens = 16, [0, 5, 16, 2 * 16 + 3, 37, 1]  # after 3 shared blocks; the last row: padding
    k_cache, v_cache, block_tables, ctx = make_cascade_kv(3, own_lens, B, Hkv, D, torch.float32)
    ctx[-1] = 0  # a padded CUDA-graph row: no prefix, no tokens
    q = torch.randn(len(own_lens), group * Hkv, D)  # (S, H, D)
    P = torch.tensor([num_common], dtype=torch.int32)
    args = (q, k_cache, v_cache, block_tables, ctx, D**-0.5)
    out = cascade_decode(*args, num_common_blocks=P, num_splits=num_splits)
    torch.testing.assert_close(out, paged_decode_ref(*args), atol=1e-5, rtol=1e-5)
    plain = cascade_decode(*args, num_splits=num_splits)
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, kernels.paged_decode(*args), atol=1e-5, rtol=1e-5)  # the core
    assert torch.all(out[-1] == 0)  # context_len 0: zeros, not the prefix's attention or NaN


@interpreted
@pytest.mark.parametrize("num_splits", [1, 2])  # own kernel folds prefix partials in / merge does
def test_cascade_decode_row_tiles_interpreted(num_splits: int) -> None:
    """Small row tiles: several per KV head, rows of one sequence's group split across two tiles, a
    last tile with padded rows; every prefix split has work (4 blocks, 2 splits); fp16 in and
    out."""
    B, group, Hkv, D = 16, 3, 2, 64
    kv = make_cascade_kv(4, [7, 16, 1, 30, 9, 3, 20], B, Hkv, D, torch.float16)
    q = torch.randn(7, group * Hkv, D, dtype=torch.float16)  # 7 x 3 = 21 rows per KV head: 16 + 5
    P = torch.tensor([4], dtype=torch.int32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cascade, "CASCADE_ROWS", 16)
        out = cascade_decode(q, *kv, 0.125, num_common_blocks=P, num_splits=num_splits)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, paged_decode_ref(q, *kv, 0.125), atol=5e-3, rtol=5e-3)


@interpreted
def test_engine_greedy_matches_transformers_interpreted(tmp_path: pathlib.Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole engine on the Triton kernels (CI's only run of the GPU attention path end to end):
    the fused projection's q and k rotated in place by rotary_and_store, prefill on the cached K/V
    of a prefix that the batch shares, paged decode with cascade attention (4 sequences share 2
    blocks: its threshold, CASCADE_MIN_SEQS, lowered to 4 for the interpreter), the batch ordered
    longest first; and with batch_invariant=True, its one attention kernel, RMSNorm and float32
    product. A tiny random Qwen3 (q/k norm) in float32: greedy tokens
    equal transformers'."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from nanoserve import LLM, SamplingParams
    monkeypatch.setattr(cascade, "CASCADE_MIN_SEQS", 4)  # read when the engine is built
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=500,
                      max_position_embeddings=512, initializer_range=0.2)
    hf = Qwen3ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(0, 500, (32,), generator=gen).tolist()  # 2 full blocks of 16 tokens
    prompts = [shared + torch.randint(0, 500, (3 + i % 7,), generator=gen).tolist()
               for i in range(cascade.CASCADE_MIN_SEQS)]
    num_new = 4
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=num_new, min_new_tokens=num_new,
                                do_sample=False)[0, len(p):].tolist() for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=num_new, ignore_eos=True)
    for invariant in (False, True):
        with LLM(str(tmp_path), max_model_len=128, enforce_eager=True,
                 batch_invariant=invariant) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o["token_ids"] for o in outs] == expected, f"batch_invariant={invariant}"


def test_default_num_splits() -> None:
    cuda = torch.device("cuda")
    with pytest.MonkeyPatch.context() as mp:  # the SM count is the only device fact used: an H100's
        mp.setattr(cascade, "sm_count", lambda device: 132)
        # (sequence, KV head) programs fill the GPU
        assert cascade.default_num_splits(256, 8, 256, cuda) == 1
        assert cascade.default_num_splits(1, 8, 256, cuda) == cascade.MAX_SPLITS
        assert cascade.default_num_splits(1, 8, 3, cuda) == 3  # no more splits than table columns
        assert 1 < cascade.default_num_splits(32, 8, 256, cuda) < cascade.MAX_SPLITS
        # to SPLIT_WARPS_PER_SM: 2 programs of 4 warps an SM (batch 33 unsplit), 4 of 2 (split)
        assert cascade.default_num_splits(33, 8, 256, cuda) == 1
        assert cascade.default_num_splits(33, 8, 256, cuda, warps=2) == 2


# --------------------------------------------------------------------------------------------------
# CPU: the kernels compile for a Hopper GPU (Triton's front end and ptxas, no GPU needed)
# --------------------------------------------------------------------------------------------------

DECODE_TILES = dict(BLOCK_SIZE=16, BLOCKS_PER_ITER=4)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))  # kernel_report
SM90_MODULES = {"fused": fused, "decode": decode, "cascade": cascade}
SM90_CASES = [  # (module.kernel, constexpr arguments): the engine's launches for Qwen3-0.6B heads
    # with an fp8 cache (the cache pointers' type), then in the model dtype; num_warps: 4 if absent
    ("fused._rotary_store_kernel@fp8",
     dict(H=16, H_PAD=16, HKV=8, HKV_PAD=8, HEAD_DIM=128, QK_NORM=True, STORE=True)),
    ("decode._paged_decode_kernel@fp8",
     dict(GROUP=2, GROUP_PAD=16, HEAD_DIM=128, BLOCK_SIZE=16, TILE=decode.TILE_TOKENS_FP8,
          NUM_STAGES=decode.NUM_STAGES)),
    *[("cascade._cascade_decode_kernel@fp8",  # both fp8 launches, as (tile tokens, warps)
       dict(GROUP=2, GROUP_PAD=8, HEAD_DIM=128, NUM_STAGES=cascade.DECODE_NUM_STAGES, CASCADE=True,
            SINGLE_SPLIT=True, ATTEND_TILE=cascade._attend_tile_t, BLOCK_SIZE=16,
            BLOCKS_PER_ITER=tile // 16, num_warps=warps))
      for tile, warps in (cascade.FP8_LAUNCH, cascade.FP8_BUSY_LAUNCH)],
    ("cascade._cascade_prefix_kernel@fp8",
     dict(GROUP=2, ROWS=64, HEAD_DIM=128, NUM_STAGES=cascade.CASCADE_NUM_STAGES, BLOCK_SIZE=16,
          BLOCKS_PER_ITER=decode.TILE_TOKENS_FP8 // 16)),
    ("fused._rotary_store_kernel",
     dict(H=16, H_PAD=16, HKV=8, HKV_PAD=8, HEAD_DIM=128, QK_NORM=True, STORE=True)),
    ("fused._rotary_store_kernel",
     dict(H=9, H_PAD=16, HKV=3, HKV_PAD=4, HEAD_DIM=64, QK_NORM=False, STORE=False)),
    ("decode._paged_decode_kernel",
     dict(GROUP=2, GROUP_PAD=16, HEAD_DIM=128, BLOCK_SIZE=16, TILE=decode.TILE_TOKENS,
          NUM_STAGES=decode.NUM_STAGES)),
    ("decode._paged_decode_kernel",  # SmolLM2: 9 q / 3 KV heads, D 64
     dict(GROUP=3, GROUP_PAD=16, HEAD_DIM=64, BLOCK_SIZE=16, TILE=decode.TILE_TOKENS,
          NUM_STAGES=decode.NUM_STAGES)),
    ("cascade._cascade_decode_kernel",
     dict(GROUP=2, GROUP_PAD=16, HEAD_DIM=128, NUM_STAGES=cascade.DECODE_NUM_STAGES, CASCADE=True,
          SINGLE_SPLIT=True, ATTEND_TILE=cascade._attend_tile, **DECODE_TILES)),
    ("cascade._cascade_decode_kernel",
     dict(GROUP=3, GROUP_PAD=16, HEAD_DIM=64, NUM_STAGES=cascade.DECODE_NUM_STAGES, CASCADE=False,
          SINGLE_SPLIT=False, ATTEND_TILE=cascade._attend_tile, **DECODE_TILES)),
    ("cascade._cascade_prefix_kernel",
     dict(GROUP=2, ROWS=64, HEAD_DIM=128, NUM_STAGES=cascade.CASCADE_NUM_STAGES, **DECODE_TILES)),
    ("cascade._merge_splits_kernel", dict(HEAD_DIM=128, SPLITS_PAD=8)),
]


@pytest.mark.skipif(kernels.INTERPRETED, reason="the interpreter replaces the kernels' compiler")
@pytest.mark.parametrize("name, constexprs", SM90_CASES)
def test_kernel_compiles_for_sm90(name: str, constexprs: dict) -> None:
    """Compile a kernel to a cubin for compute capability 9.0 on this CPU machine: a kernel that
    only the GPU compiler rejects (the interpreter runs plain Python) fails here in CI, not on the
    GPU machine. tools/kernel_report.py compiles, with the alignment hints of run time."""
    try:
        import kernel_report
    except ImportError as e:
        pytest.skip(f"this Triton cannot compile ahead of time: {e}")
    module, kernel_name = name.removesuffix("@fp8").split(".")
    kernel = getattr(SM90_MODULES[module], kernel_name)
    cache_type = "*fp8e4nv" if name.endswith("@fp8") else "*bf16"
    warps = constexprs.get("num_warps", 4)  # a launch option, not one of the kernel's arguments
    constexprs = {k: v for k, v in constexprs.items() if k != "num_warps"}
    compiled = kernel_report.compile_sm90(kernel, cache_type, constexprs, warps)
    assert compiled.asm["cubin"] and compiled.metadata.num_warps == warps


# --------------------------------------------------------------------------------------------------
# CPU: references against naive loops
# --------------------------------------------------------------------------------------------------

def naive_causal_attention(q: Tensor, k: Tensor, v: Tensor, lens_q: list[int],
                           lens_k: list[int], scale: float) -> Tensor:
    """Token by token, head by head: query i of a sequence sees keys j <= i + Lk - Lq
    (bottom-right)."""
    H, Hkv = q.shape[1], k.shape[1]
    out, q0, k0 = torch.zeros_like(q), 0, 0
    for Lq, Lk in zip(lens_q, lens_k):
        for i in range(Lq):
            visible = i + Lk - Lq + 1
            for h in range(H):
                kv = h // (H // Hkv)  # GQA: consecutive query heads share a KV head
                scores = k[k0:k0 + visible, kv] @ q[q0 + i, h] * scale  # (visible,)
                out[q0 + i, h] = torch.softmax(scores, dim=0) @ v[k0:k0 + visible, kv]
        q0, k0 = q0 + Lq, k0 + Lk
    return out


def cu_seqlens(lens: list[int], device: str = "cpu") -> Tensor:
    return torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)


def context_slots(block_tables: Tensor, lens: list[int], B: int) -> Tensor:
    """(sum(lens),) int64: the cache slot of every context token, sequence after sequence."""
    slots = [int(block_tables[s, t // B]) * B + t % B for s, n in enumerate(lens) for t in range(n)]
    return torch.tensor(slots, dtype=torch.int64, device=block_tables.device)


def test_prepare_reads_every_key_at_its_slot() -> None:
    """ModelRunner.prepare (no model needed): the new tokens' slots, and with prefix hits
    every key's slot, the cached ones included, sequence after sequence."""
    from nanoserve.config import SamplingParams
    from nanoserve.model_runner import ModelRunner
    from nanoserve.scheduler import Batch
    from nanoserve.sequence import Sequence
    runner = ModelRunner.__new__(ModelRunner)  # prepare reads only the block size
    runner.block_size = B = 4
    seqs = [Sequence(list(range(n)), SamplingParams(), B) for n in (6, 9)]
    seqs[0].block_table, seqs[1].block_table = [7, 2], [5, 1, 3]
    ctx = runner.prepare(Batch(seqs, [6, 9], is_prefill=True, starts=[0, 0]))
    tables = torch.tensor([[7, 2, -1], [5, 1, 3]], dtype=torch.int32)
    assert ctx.slot_mapping.tolist() == context_slots(tables, [6, 9], B).tolist()
    assert ctx.context_slots.tolist() == ctx.slot_mapping.tolist()  # no hits: the new tokens
    assert (ctx.max_seqlen_q, ctx.max_seqlen_k) == (9, 9)
    ctx = runner.prepare(Batch(seqs, [2, 1], is_prefill=True, starts=[4, 8]))  # hits
    assert ctx.slot_mapping.tolist() == [2 * B, 2 * B + 1, 3 * B]
    assert ctx.context_slots.tolist() == context_slots(tables, [6, 9], B).tolist()
    assert (ctx.max_seqlen_q, ctx.max_seqlen_k) == (2, 9)


@pytest.mark.parametrize("H, Hkv", [(4, 4), (4, 2), (3, 1)])
def test_prefill_attention_ref(H: int, Hkv: int) -> None:
    lens_q, lens_k = [5, 3, 1, 4], [5, 8, 6, 4]  # sequences 2 and 3 hit a cached prefix (Lq < Lk)
    D = 16
    q = torch.randn(sum(lens_q), H, D)
    k, v = torch.randn(sum(lens_k), Hkv, D), torch.randn(sum(lens_k), Hkv, D)
    args = (q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q), max(lens_k), 0.3)
    ref = kernels.prefill_attention_ref(*args)
    torch.testing.assert_close(ref, naive_causal_attention(q, k, v, lens_q, lens_k, 0.3))
    torch.testing.assert_close(kernels.prefill_attention(*args), ref)  # CPU dispatch: the reference


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_gather_kv(cache_dtype: torch.dtype) -> None:
    """The packed context in the queries' dtype: an fp8 cache dequantized (exactly: every e4m3
    value is a float32)."""
    B, Hkv, D = 16, 2, 8
    lens = [5, 0, 17, 32]  # ragged, empty, crosses a block, exactly two blocks
    k_cache, v_cache, block_tables, _ = make_paged_kv(lens, B, Hkv, D, cache_dtype)
    slots = context_slots(block_tables, lens, B)
    k, v = kernels.gather_kv(k_cache, v_cache, slots, torch.float32)
    assert k.shape == v.shape == (sum(lens), Hkv, D) and k.dtype == v.dtype == torch.float32
    k_cache, v_cache = k_cache.float(), v_cache.float()
    rows = [(s, t) for s, n in enumerate(lens) for t in range(n)]
    expect_k = torch.stack([k_cache[block_tables[s, t // B], t % B] for s, t in rows])
    expect_v = torch.stack([v_cache[block_tables[s, t // B], t % B] for s, t in rows])
    assert torch.equal(k, expect_k) and torch.equal(v, expect_v)


def test_attention_prefill_reads_what_an_fp8_cache_holds() -> None:
    """layers.Attention's prefill attends over K and V as an fp8 cache holds them, rounded to
    e4m3, read back from the cache for every key: so a prompt's output does not depend on whether
    its prefix was a cache hit, and differs from attention over the unrounded K/V."""
    from nanoserve import layers
    torch.manual_seed(0)
    lens, H, Hkv, D, B = [5, 20], 4, 2, 16, 16
    q = torch.randn(sum(lens), H, D)
    k, v = 3 * torch.randn(sum(lens), Hkv, D), 3 * torch.randn(sum(lens), Hkv, D)
    attn = layers.Attention(H, Hkv, D, layers.Backends())
    attn.k_cache, attn.v_cache = (torch.zeros(4, B, Hkv, D, dtype=FP8) for _ in range(2))
    slots = torch.cat([torch.arange(0, 5), torch.arange(16, 36)]).int()  # blocks 0, then 1-2
    cu = cu_seqlens(lens)
    ctx = layers.ForwardContext(is_prefill=True, slot_mapping=slots, cu_seqlens_q=cu,
                                cu_seqlens_k=cu, max_seqlen_q=20, max_seqlen_k=20,
                                context_slots=slots.long())
    with layers.forward_context(ctx):
        kernels.store_kv(k, v, attn.k_cache, attn.v_cache, slots)
        out = attn(q, k, v)
    rounded = [kernels.to_cache_dtype(x, FP8).float() for x in (k, v)]
    expect = kernels.prefill_attention_ref(q, *rounded, cu, cu, 20, 20, attn.scale)
    assert torch.equal(out, expect)
    assert not torch.allclose(kernels.prefill_attention_ref(q, k, v, cu, cu, 20, 20, attn.scale),
                              expect, atol=1e-3)


def test_paged_decode_ref_matches_prefill_ref() -> None:
    """Decode is prefill with one query, the newest token: the two references must agree."""
    lens, B, Hkv, D, H = [1, 16, 23], 16, 2, 32, 6
    k_cache, v_cache, block_tables, ctx = make_paged_kv(lens, B, Hkv, D, torch.float32)
    q = torch.randn(len(lens), H, D)
    slots = context_slots(block_tables, lens, B)
    k, v = kernels.gather_kv(k_cache, v_cache, slots, q.dtype)
    one_query = cu_seqlens([1] * len(lens))  # each sequence's newest token is its only query
    prefill = kernels.prefill_attention_ref(q, k, v, one_query, cu_seqlens(lens), 1, max(lens), 0.2)
    decoded = paged_decode_ref(q, k_cache, v_cache, block_tables, ctx, 0.2)
    torch.testing.assert_close(decoded, prefill)


# --------------------------------------------------------------------------------------------------
# GPU: compiled kernels vs references
# --------------------------------------------------------------------------------------------------

TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=5e-3, rtol=5e-3),
       torch.float32: dict(atol=5e-3, rtol=5e-3)}  # fp32 products run in TF32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H, Hkv, D", [(9, 3, 64), (16, 8, 128)])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
@gpu
@requires_cuda
def test_rotary_and_store_gpu(dtype: torch.dtype, H: int, Hkv: int, D: int, qk_norm: bool,
                              fp8: bool) -> None:
    args = make_rotary_inputs(300, H, Hkv, D, dtype, "cuda", num_blocks=40,
                              cache_dtype=FP8 if fp8 else dtype)
    args["v"][1] *= 1000  # an fp8 cache saturates at 448 (the GPU's cvt.satfinite, torch's cast)
    check_rotary_and_store(args, qk_norm, True, TOL[dtype])


@pytest.mark.parametrize("group, Hkv", [(1, 4), (2, 8), (3, 3), (8, 2), (16, 1)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 5])
@gpu
@requires_cuda
def test_cascade_decode_gpu(group: int, Hkv: int, D: int, B: int, num_splits: int) -> None:
    check_paged_decode_gpu(group, Hkv, D, B, num_splits, torch.bfloat16)


@pytest.mark.parametrize("group, Hkv, D, B, num_splits", [(2, 8, 128, 16, None), (3, 3, 64, 64, 1),
                                                          (8, 2, 128, 32, None)])
@gpu
@requires_cuda
def test_cascade_decode_fp16_gpu(group: int, Hkv: int, D: int, B: int,
                                 num_splits: int | None) -> None:
    check_paged_decode_gpu(group, Hkv, D, B, num_splits, torch.float16)


@pytest.mark.parametrize("group, Hkv, D, B, num_splits", [(2, 8, 128, 16, None), (2, 8, 128, 16, 1),
                                                          (3, 3, 64, 64, 5), (8, 2, 128, 32, None),
                                                          (1, 4, 64, 16, 1)])
@pytest.mark.parametrize("busy", [False, True])  # busy: FP8_BUSY_LAUNCH, as for big batches
@gpu
@requires_cuda
def test_cascade_decode_fp8_gpu(group: int, Hkv: int, D: int, B: int, num_splits: int | None,
                                busy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if busy:
        monkeypatch.setattr(cascade, "FP8_BUSY_PROGRAMS_PER_SM", 0)
    check_paged_decode_gpu(group, Hkv, D, B, num_splits, torch.bfloat16, FP8)


@pytest.mark.parametrize("group, Hkv", [(1, 4), (2, 8), (3, 3), (5, 2), (8, 2), (16, 1)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B", [16, 32, 128])
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.bfloat16, None), (torch.float16, None),
                                                (torch.float32, None), (torch.bfloat16, FP8)])
@gpu
@requires_cuda
def test_paged_decode_gpu(group: int, Hkv: int, D: int, B: int, dtype: torch.dtype,
                          cache_dtype: torch.dtype | None) -> None:
    """The core kernel (num_splits "core"); block 128: a tile smaller than a block."""
    check_paged_decode_gpu(group, Hkv, D, B, "core", dtype, cache_dtype)


def check_paged_decode_gpu(group: int, Hkv: int, D: int, B: int, num_splits: int | str | None,
                           dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> None:
    """cascade_decode with num_splits, or the core paged_decode for num_splits "core"."""
    context_lens = [1, B, 2 * B + 5, 0, 300, 1000]
    k_cache, v_cache, block_tables, ctx = make_paged_kv(context_lens, B, Hkv, D,
                                                        cache_dtype or dtype, "cuda")
    q = torch.randn(len(context_lens), group * Hkv, D, dtype=dtype, device="cuda")
    args = (q, k_cache, v_cache, block_tables, ctx, D**-0.5)
    out = (kernels.paged_decode(*args) if num_splits == "core"
           else cascade_decode(*args, num_splits=num_splits))
    torch.testing.assert_close(out, paged_decode_ref(*args), **TOL[dtype])
    assert torch.all(out[3] == 0)


@gpu
@requires_cuda
@pytest.mark.parametrize("S", [1, 64])
def test_sample_gpu(S: int) -> None:
    """The sampler at Qwen's vocabulary on CUDA, plain and compiled (extensions.fused): the race
    contract, and the CPU's tokens but at near-ties of the float math."""
    args = sample_case(max(S, 6), 151_936, torch.bfloat16, "cuda")
    args = [a[:S] for a in args]
    cpu = kernels.sample(*(a.cpu() for a in args))
    for tokens in (kernels.sample(*args), fused.compiled_steps()["sample"](*args)):
        check_race(args[0].cpu(), args[1].cpu(), tokens.cpu())
        assert (tokens.cpu() != cpu).sum() <= S // 32  # near-ties only


@gpu
@requires_cuda
def test_prefill_attention_gpu() -> None:
    """The FlashAttention path (aten FA2 or flash-attn) against the reference: GQA, prefix hits, qkv
    views."""
    H, Hkv, D = 16, 8, 128
    lens_q, lens_k = [37, 20, 1, 128], [37, 100, 1, 300]
    qkv = torch.randn(sum(lens_q), (H + 2 * Hkv) * D, dtype=torch.bfloat16, device="cuda")
    q = qkv[:, :H * D].view(-1, H, D)  # (Nq, H, D) a strided view, as the model passes it
    k = torch.randn(sum(lens_k), Hkv, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    args = (q, k, v, cu_seqlens(lens_q, "cuda"), cu_seqlens(lens_k, "cuda"), max(lens_q),
            max(lens_k), D**-0.5)
    out = kernels.prefill_attention(*args)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, kernels.prefill_attention_ref(*args), **TOL[torch.bfloat16])


@gpu
@requires_cuda
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_gather_kv_compiled_gpu(cache_dtype: torch.dtype) -> None:
    """The layers' gather (gather and dequantize compiled into one kernel) equals the eager one."""
    B, Hkv, D, lens = 16, 8, 128, [5, 0, 170, 320]
    k_cache, v_cache, block_tables, _ = make_paged_kv(lens, B, Hkv, D, cache_dtype, "cuda")
    slots = context_slots(block_tables, lens, B)
    compiled = fused.compiled_steps()["gather_kv"](k_cache, v_cache, slots,
                                                       torch.bfloat16)
    for got, expect in zip(compiled, kernels.gather_kv(k_cache, v_cache, slots, torch.bfloat16)):
        assert got.dtype == torch.bfloat16 and torch.equal(got, expect)


@gpu
@requires_cuda
def test_compiled_layer_fixes_row_length_gpu() -> None:
    """fused.gpu_compiled compiles SiLU-and-mul once for every token count, with the row length
    a constant of the kernel, not an argument (`ks0`): a row length known at compile time lets
    the kernel skip the per-element index arithmetic (docs/performance.md has the times)."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    from nanoserve import layers
    act = fused.gpu_compiled(lambda x: layers.silu_and_mul(x))  # a fresh cache
    codes: list[str] = []  # the code of every compile (run_and_get_code would reset dynamo)
    with (torch.inference_mode(), torch._inductor.config.patch(fx_graph_cache=False),
          mock.patch.object(GraphLowering, "save_output_code", codes.append)):
        for n in (300, 17, 4096):
            x = torch.randn(n, 2 * 3072, device="cuda", dtype=torch.bfloat16)
            gate, up = x.float().chunk(2, -1)
            torch.testing.assert_close(act(x), (F.silu(gate) * up).bfloat16(),
                                       **TOL[torch.bfloat16])
    assert len(codes) == 1, f"{len(codes)} compiles for three token counts"
    assert "ks0" not in codes[0], "the row length is an argument of the compiled kernel"


@gpu
@requires_cuda
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("decode_fn", [kernels.paged_decode, cascade_decode])
def test_decode_cuda_graph_gpu(cache_dtype: torch.dtype, decode_fn) -> None:
    """rotary_and_store + paged_decode (the core's, or cascade_decode's split-KV) captured once,
    replayed on new contents: equal to eager, no host sync."""
    S, B, Hkv, D, H = 8, 16, 8, 128, 16
    lens = [1, 17, 64, 200, 0, 5, 300, 33]
    capacity = [n + 2 for n in lens]  # room for the two steps below
    k_cache, v_cache, block_tables, ctx = make_paged_kv(capacity, B, Hkv, D, cache_dtype, "cuda")
    q = torch.randn(S, H, D, dtype=torch.bfloat16, device="cuda")
    key, value = torch.randn(2, S, Hkv, D, dtype=torch.bfloat16, device="cuda")
    slots = torch.full((S,), -1, dtype=torch.int32, device="cuda")
    positions = torch.zeros(S, dtype=torch.int64, device="cuda")
    cos_sin = RotaryEmbedding(D, 4096, 1e6).cos_sin.cuda()

    def decode_step() -> Tensor:  # what one attention layer does in a decode step
        fused.rotary_and_store(q, key, value, positions, cos_sin, k_cache, v_cache, slots)
        return decode_fn(q, k_cache, v_cache, block_tables, ctx, D**-0.5)

    decode_step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = decode_step()
    for step in range(2):  # new inputs in the same buffers, as the engine does between steps
        q.normal_()
        key.normal_()
        value.normal_()
        new_lens = [n + step + 1 if n else 0 for n in lens]  # a padded slot (context 0) stays 0
        ctx.copy_(torch.tensor(new_lens, dtype=torch.int32))
        for s, n in enumerate(new_lens):
            slots[s] = block_tables[s, (n - 1) // B] * B + (n - 1) % B if n else -1
        positions.copy_((ctx - 1).clamp(min=0))
        q_before, key_before = q.clone(), key.clone()  # rotated in place: eager restarts from these
        k_before, v_before = k_cache.clone(), v_cache.clone()
        graph.replay()
        k_graph, v_graph = k_cache.clone(), v_cache.clone()
        k_cache.copy_(k_before)
        v_cache.copy_(v_before)
        q.copy_(q_before)
        key.copy_(key_before)
        eager = decode_step()
        assert torch.equal(graph_out, eager)
        # bit for bit (unused cache slots hold NaN on purpose)
        assert torch.equal(k_graph.view(torch.uint8), k_cache.view(torch.uint8))
        assert torch.equal(v_graph.view(torch.uint8), v_cache.view(torch.uint8))
        ref = paged_decode_ref(q, k_cache, v_cache, block_tables, ctx, D**-0.5)
        torch.testing.assert_close(eager, ref, **TOL[torch.bfloat16])


def make_cascade_decode(S: int, num_common: int, dtype: torch.dtype = torch.bfloat16,
                        seed: int = 0, cache_dtype: torch.dtype | None = None) -> tuple:
    """The workload cascade attention is for, with Qwen3-0.6B heads (16 q / 8 kv, D 128), B 16: S
    sequences share a num_common-block prompt and have 32-250 own tokens each."""
    H, Hkv, D, B = 16, 8, 128, 16
    own_lens = torch.randint(32, 251, (S,), generator=torch.Generator().manual_seed(seed)).tolist()
    kv = make_cascade_kv(num_common, own_lens, B, Hkv, D, cache_dtype or dtype, "cuda", seed)
    q = torch.randn(S, H, D, dtype=dtype, device="cuda")  # (S, H, D)
    return q, *kv, D**-0.5


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
@gpu
@requires_cuda
def test_cascade_decode_prefix_gpu(num_splits: int | None, cache_dtype: torch.dtype) -> None:
    args = make_cascade_decode(256, 64, cache_dtype=cache_dtype)
    P = torch.tensor([64], dtype=torch.int32, device="cuda")
    out = cascade_decode(*args, num_common_blocks=P, num_splits=num_splits)
    torch.testing.assert_close(out, paged_decode_ref(*args), **TOL[torch.bfloat16])


@gpu
@requires_cuda
def test_cascade_decode_prefix_cuda_graph_gpu() -> None:
    """Captured once with P = 64, replayed with P = 0 and 32 (and a padded row): the grid never
    depends on P."""
    q, k_cache, v_cache, block_tables, ctx, scale = make_cascade_decode(256, 64)
    ctx[-1] = 0  # a padded CUDA-graph row
    P = torch.tensor([64], dtype=torch.int32, device="cuda")

    def step() -> Tensor:
        return cascade_decode(q, k_cache, v_cache, block_tables, ctx, scale, num_common_blocks=P)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    ref = paged_decode_ref(q, k_cache, v_cache, block_tables, ctx, scale)
    for num_common in (64, 0, 32):
        P.fill_(num_common)
        graph_out.zero_()
        graph.replay()
        assert torch.equal(graph_out, step())  # the same kernels with the same P: bit-identical
        torch.testing.assert_close(graph_out, ref, **TOL[torch.bfloat16])
        assert torch.all(graph_out[-1] == 0)


def test_common_prefix_blocks_counts_full_shared_leading_blocks():
    from nanoserve.extensions.cascade import common_prefix_blocks
    tables = np.array([[7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 3, -1]], np.int32)  # -1 pads a table
    assert common_prefix_blocks(tables, np.array([64, 60, 40], np.int32), 16) == 2  # col 2 differs
    assert common_prefix_blocks(tables[:2], np.array([64, 60], np.int32), 16) == 3
    # block 2 is not full in row 1
    assert common_prefix_blocks(tables[:2], np.array([64, 47], np.int32), 16) == 2
    assert common_prefix_blocks(tables[:2], np.array([64, 15], np.int32), 16) == 0


def test_prefill_logits_rows_pad_to_a_graph_batch_size():
    """With graphs the LM head runs only at captured batch sizes (their cuBLAS kernels loaded at
    start-up): prefill repeats its last sequence's row up to one, and the caller keeps the first
    num_seqs rows of logits."""
    from types import SimpleNamespace

    from nanoserve.model_runner import ModelRunner, graph_batch_size
    sizes = [graph_batch_size(n) for n in (1, 3, 8, 9, 37, 48, 512, 600)]
    assert sizes == [1, 4, 8, 16, 48, 48, 512, 512]
    cu_q = np.array([0, 5, 7, 20], np.int32)  # 3 sequences
    rows = ModelRunner._logits_rows(SimpleNamespace(max_graph_batch=48), cu_q)
    assert rows.tolist() == [4, 6, 19, 19] and rows.dtype == np.int64  # padded to 4 rows
    # no graphs, or none big enough
    for no_graph in (SimpleNamespace(max_graph_batch=0), SimpleNamespace(max_graph_batch=2)):
        assert ModelRunner._logits_rows(no_graph, cu_q).tolist() == [4, 6, 19]


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_core_store_writes_each_slot_and_slot_minus_one_into_the_spare_slot(
        cache_dtype: torch.dtype) -> None:
    """kernels.store_kv: no mask (no host sync in a CUDA graph); a padded row's slot -1 lands in
    the cache's last slot, which the model runner keeps in a spare block no sequence owns."""
    torch.manual_seed(0)
    key, value = 3 * torch.randn(4, 2, 16), 3 * torch.randn(4, 2, 16)  # (N, Hkv, D)
    key[0, 0, 0] = 1000  # past e4m3's largest value: saturated, not NaN
    k_cache, v_cache = (torch.zeros(3, 4, 2, 16, dtype=cache_dtype) for _ in "kv")  # 2 + spare
    kernels.store_kv(key, value, k_cache, v_cache, torch.tensor([5, -1, 0, 6], dtype=torch.int32))
    for cache, x in ((k_cache, key), (v_cache, value)):
        rows = cache.view(-1, 2, 16).float()  # (slots, Hkv, D)
        expect = kernels.to_cache_dtype(x, cache_dtype).float()
        assert torch.equal(rows[[5, 11, 0, 6]], expect)  # slot -1: the last one, 11
        assert rows.abs().max() <= (448 if cache_dtype == FP8 else 1000)
        assert not rows[[1, 2, 3, 4, 7, 8, 9, 10]].any()


# --------------------------------------------------------------------------------------------------
# extensions.batch_invariant: one attention kernel for prefill and decode, a row-a-program RMSNorm
# --------------------------------------------------------------------------------------------------

def check_invariant_attention(device: str, dtype: torch.dtype, group: int, Hkv: int, D: int,
                              tol: float) -> None:
    """Prompts with cached prefixes (fewer new tokens than keys) through the kernel: close to the
    plain prefill over the gathered keys; and every token alone, as a decode row, gives the same
    bits as in its prompt's tiles."""
    from nanoserve.extensions import batch_invariant
    seq_lens, lens_q = [37, 16, 80, 5], [37, 3, 50, 1]  # whole prompts and prefix-cache hits
    B, H = 16, group * Hkv
    k_cache, v_cache, block_tables, _ = make_paged_kv(seq_lens, B, Hkv, D, dtype, device)
    q = torch.randn(sum(lens_q), H, D).to(device, dtype)  # (N, H, D)
    cu_q, cu_k = cu_seqlens(lens_q).to(device), cu_seqlens(seq_lens).to(device)
    out = batch_invariant.attention(q, k_cache, v_cache, block_tables, cu_q,
                                    cu_k[1:] - cu_k[:-1], max(lens_q), D**-0.5)
    k, v = kernels.gather_kv(k_cache, v_cache, context_slots(block_tables, seq_lens, B),
                             torch.float32)
    ref = kernels.prefill_attention_ref(q.float(), k, v, cu_q, cu_k, max(lens_q), max(seq_lens),
                                        D**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    # each token alone: a decode row of its sequence, its position's keys
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(lens_q))  # (N,)
    ends = torch.cat([torch.arange(n - m + 1, n + 1) for n, m in zip(seq_lens, lens_q)])
    rows = torch.arange(len(seq) + 1, dtype=torch.int32, device=device)
    alone = batch_invariant.attention(q, k_cache, v_cache, block_tables[seq.to(device)], rows,
                                      ends.to(device, torch.int32), 1, D**-0.5)
    torch.testing.assert_close(alone, out, atol=tol, rtol=tol)
    # the interpreter's products are numpy's, whose rounding moves with a row's place in the tile
    assert torch.equal(alone, out) or not q.is_cuda


@interpreted
def test_batch_invariant_attention_interpreted() -> None:
    """A GQA group of 3 (not a power of two) on one KV head; the GPU test runs more shapes."""
    check_invariant_attention("cpu", torch.float32, 3, 1, 32, 1e-5)


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group, Hkv, D", [(2, 8, 128), (3, 3, 64)])
def test_batch_invariant_attention_gpu(dtype: torch.dtype, group: int, Hkv: int, D: int) -> None:
    check_invariant_attention("cuda", dtype, group, Hkv, D, 2e-2)


def check_invariant_rms_norm(device: str, dtype: torch.dtype) -> None:
    """Close to the plain RMSNorm (with and without the residual add); a row's bits the same in a
    batch of 1 and of 300."""
    from nanoserve.extensions import batch_invariant
    x, res = (torch.randn(300, 576).to(device, dtype) for _ in range(2))
    weight = (torch.rand(576) + 0.5).to(device, dtype)
    tol = dict(atol=1e-2, rtol=1e-2) if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch_invariant.rms_norm(x, weight, 1e-6),
                               kernels.rms_norm_ref(x, weight, 1e-6), **tol)
    out, total = batch_invariant.rms_norm(x, weight, 1e-6, res)
    torch.testing.assert_close(total, x + res)
    torch.testing.assert_close(out, kernels.rms_norm_ref(x + res, weight, 1e-6), **tol)
    assert torch.equal(batch_invariant.rms_norm(x[:1], weight, 1e-6, res[:1])[0], out[:1])


@interpreted
def test_batch_invariant_rms_norm_interpreted() -> None:
    check_invariant_rms_norm("cpu", torch.float32)


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_rms_norm_gpu(dtype: torch.dtype) -> None:
    check_invariant_rms_norm("cuda", dtype)


def check_invariant_linear(device: str) -> None:
    """The float32 product: close to F.linear, with and without a bias; a row's bits the same in
    a batch of 1 and of 300."""
    from nanoserve.extensions import batch_invariant
    x, weight, bias = torch.randn(300, 200), torch.randn(96, 200), torch.randn(96)
    x, weight, bias = x.to(device), weight.to(device), bias.to(device)
    for b in (None, bias):
        out = batch_invariant.linear(x, weight, b)
        torch.testing.assert_close(out, F.linear(x, weight, b), atol=1e-4, rtol=1e-4)
        # (the interpreter's products are numpy's: its rounding is not the kernel's promise)
        assert torch.equal(batch_invariant.linear(x[:1], weight, b), out[:1]) or not x.is_cuda


@interpreted
def test_batch_invariant_linear_interpreted() -> None:
    check_invariant_linear("cpu")


@gpu
@requires_cuda
def test_batch_invariant_linear_gpu() -> None:
    check_invariant_linear("cuda")
