"""Cascade decode: paged decode with split-KV (flash-decoding) and cascade attention.

What it changes: decode attention. Small batches split each sequence's blocks over several programs
(merged by their log-sum-exp) so the GPU fills; big ones that share a prefix (a prefix-cache hit,
say a system prompt) read it once per CASCADE_ROWS query rows instead of once per sequence. Where it
plugs in: the backends (`backends`): decode attention by cascade_decode, same result, and the
host's search for the shared prefix of each decode batch.
What it gains: see docs/performance.md. Invariant, as the core's: no host sync, a grid from shapes
and arguments only.
"""

import dataclasses
import functools

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from nanoserve.config import Config
from nanoserve.kernels import decode
from nanoserve.kernels.decode import _attend_tile, _dot_dtype  # the core's tile step, reused
from nanoserve.layers import Backends, ForwardContext

# Launch settings of the decode kernel, tuned on H100 and H200 (docs/performance.md, fp8_cache.md)
DECODE_TILE_TOKENS = 64  # K/V rows per loop step (whole blocks)
DECODE_NUM_STAGES = 3  # software pipelining: the next two steps' loads fly during this one
DECODE_NUM_WARPS = 4  # more warps per program were slower
# An fp8 cache's transposed products need fewer warps: (tile tokens, warps), so smaller programs,
# 4 an SM. A grid of at least FP8_BUSY_PROGRAMS_PER_SM programs an SM (a big batch) halves them
# again, 8 an SM, which hide each other's latency; a smaller grid finishes sooner on longer tiles.
FP8_LAUNCH, FP8_BUSY_LAUNCH, FP8_BUSY_PROGRAMS_PER_SM = (64, 2), (32, 1), 8
FP8_GROUP_ROWS = 8  # and its GQA group padded to tl.dot's N of 8, not its M of 16
SPLIT_WARPS_PER_SM = 8  # split KV to 8 warps an SM: bf16 2 programs (2 beat 4), fp8 4 (4 beat 2)
MAX_SPLITS = 16  # more splits were slower even at batch 1: each adds a partial to merge
# Cascade prefix kernel (a shared prefix, see cascade_decode): one program multiplies CASCADE_ROWS
# query rows (sequences x the query heads of one KV head) by each prefix K/V tile, so the prefix is
# read once per CASCADE_ROWS rows, not once per sequence; the rows also fill tl.dot's M dimension.
CASCADE_ROWS = 64  # tuned together with CASCADE_NUM_WARPS: 32 or 128 rows were slower
CASCADE_NUM_WARPS = 4
CASCADE_NUM_STAGES = 3  # tuned apart from the decode kernel: its own tiles, its own best depth
CASCADE_PROGRAMS_PER_SM = 1  # prefix splits fill one wave of (KV head, row tile, split) programs
MERGE_NUM_WARPS = 2  # a merge reads only a few partials per row: more warps were slower
CASCADE_MIN_SEQS = 32  # the shared-prefix kernel from this decode batch size on (it costs at tiny)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device: the split heuristics fill them with programs."""
    if device.type != "cuda":
        return 8  # the interpreter on CPU: any small number keeps the split logic exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


# --------------------------------------------------------------------------------------------------
# Program (sequence, KV head, split) walks its share of the sequence's blocks with an online softmax
# for all GROUP query heads of that KV head (K/V read once per group), and writes a partial output
# plus its log-sum-exp; a second kernel merges the splits by their LSEs.
# Cascade: a first kernel attends the rows of many sequences to the shared prefix blocks at once (a
# real matrix product) and writes its partials; the per-sequence kernel then skips those blocks and,
# when it has one split, folds the prefix partials into its own state (else the merge kernel does).
# --------------------------------------------------------------------------------------------------

@triton.jit
def _split_block_range(context_len, first_block, BLOCK_SIZE: tl.constexpr):
    # The split's share of blocks [first_block, end) is computed here from context_len, so the grid
    # stays fixed (CUDA-graph safe) and the splits always share the real work evenly; a split past
    # the end gets nothing and writes LSE = -inf. first_block > 0 skips a shared prefix that the
    # cascade prefix kernel reads.
    split, num_splits = tl.program_id(2), tl.num_programs(2)  # grid axis 2 is the split
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    first_block = tl.minimum(first_block, num_blocks)  # a padded row (context_len 0) has no prefix
    blocks_per_split = tl.cdiv(num_blocks - first_block, num_splits)
    block_start = first_block + split * blocks_per_split
    return block_start, tl.minimum(block_start + blocks_per_split, num_blocks)  # [start, end)


@triton.jit
def _attend_tile_t(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_id, offset, valid, head_base,
                   offs_d, cache_stride_block, cache_stride_token, qk_scale, v_scale):
    """decode._attend_tile for an fp8 cache, its products transposed: scores^T = k q^T (TILE,
    ROWS) and acc^T += v^T p^T (D, ROWS). Tokens and the head dim are the products' M, so the GQA
    group pads to 8 rows, not 16, and a program needs fewer warps."""
    rows = block_id.to(tl.int64) * cache_stride_block + offset * cache_stride_token + head_base
    k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    # dequantized to q's fp16; V times its scale widens it before p @ v, as in _attend_tile
    k, v = k.to(q.dtype), v.to(q.dtype) * tl.cast(v_scale, q.dtype)
    s = tl.where(valid[:, None], tl.dot(k, tl.trans(q)) * qk_scale, float("-inf"))  # (TILE, ROWS)
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha, p = tl.exp2(m_i - m_new), tl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    return m_new, l_i, acc * alpha[:, None] + tl.trans(tl.dot(tl.trans(v), p.to(v.dtype)))


@triton.jit
def _cascade_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                           num_common_ptr, out_ptr, part_out_ptr, part_lse_ptr, qk_scale, v_scale,
                           first_slot, num_slots, q_stride_s, q_stride_h, cache_stride_block,
                           cache_stride_token, block_tables_stride, GROUP: tl.constexpr,
                           GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
                           NUM_STAGES: tl.constexpr, CASCADE: tl.constexpr,
                           SINGLE_SPLIT: tl.constexpr, ATTEND_TILE: tl.constexpr):
    # KV heads vary fastest in the grid: the GPU starts programs in that order, so a batch sorted
    # longest context first (the scheduler's order) starts its longest work first; SMs end together
    kv_head, seq, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    TILE: tl.constexpr = BLOCK_SIZE * BLOCKS_PER_ITER  # tokens per step: whole blocks, no straddle
    context_len = tl.load(context_lens_ptr + seq)
    # with CASCADE the first P blocks are the shared prefix: _cascade_prefix_kernel reads them
    first_block = tl.load(num_common_ptr) if CASCADE else 0
    block_start, block_end = _split_block_range(context_len, first_block, BLOCK_SIZE)
    offs_g, offs_d, offs_t = tl.arange(0, GROUP_PAD), tl.arange(0, HEAD_DIM), tl.arange(0, TILE)
    heads = kv_head * GROUP + offs_g  # (GROUP_PAD,) query heads of this KV head: one K/V read
    # Padded so both products run on tensor cores (tl.dot); the extra rows are zeros and the math
    # is free in a memory-bound kernel, cheaper than a broadcast-multiply-sum, whose cross-thread
    # reductions cost more than the wasted rows.
    q = _dot_dtype(tl.load(q_ptr + seq * q_stride_s + heads[:, None] * q_stride_h + offs_d[None, :],
                           mask=offs_g[:, None] < GROUP, other=0.0), k_cache_ptr)  # (GROUP_PAD, D)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of scores (log2 units)
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running softmax denominator
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)  # running numerator
    # Block ids are loaded a step ahead (a loop-carried value): a step's K/V addresses are known
    # before it starts, so the pipeliner issues its loads while earlier steps compute.
    table, ahead = block_tables_ptr + seq * block_tables_stride, block_start + offs_t // BLOCK_SIZE
    block_id = tl.load(table + ahead, mask=ahead < block_end, other=0)  # (TILE,) the first step's
    for block in tl.range(block_start, block_end, BLOCKS_PER_ITER, num_stages=NUM_STAGES):
        seq_block = block + offs_t // BLOCK_SIZE  # (TILE,) the sequence's block index of each row
        valid = (seq_block < block_end) & (block * BLOCK_SIZE + offs_t < context_len)  # ragged end
        # the tile step: decode._attend_tile, or _attend_tile_t with an fp8 cache (cascade_decode)
        m_i, l_i, acc = ATTEND_TILE(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_id,
                                    offs_t % BLOCK_SIZE, valid, kv_head * HEAD_DIM, offs_d,
                                    cache_stride_block, cache_stride_token, qk_scale, v_scale)
        ahead = seq_block + BLOCKS_PER_ITER  # never read block-table entries past the split's end
        block_id = tl.load(table + ahead, mask=ahead < block_end, other=0)  # (TILE,) the next's
    q_rows = seq * tl.num_programs(0) * GROUP + heads  # (GROUP_PAD,) rows of out (S * H, D)
    if SINGLE_SPLIT:  # the cascade prefix kernel ran first: fold its partials in, no merge launch
        m_i, l_i, acc = _fold_partials(m_i, l_i, acc, q_rows, offs_g < GROUP, offs_d, first_slot,
                                       num_slots, part_out_ptr, part_lse_ptr, HEAD_DIM)
    _store_decode_partial(acc, m_i, l_i, q_rows, offs_g < GROUP, offs_d, first_slot + split,
                          num_slots, out_ptr, part_out_ptr, part_lse_ptr, HEAD_DIM, SINGLE_SPLIT)


@triton.jit
def _fold_partials(m_i, l_i, acc, q_rows, row_mask, offs_d, num_partials, num_slots, part_out_ptr,
                   part_lse_ptr, HEAD_DIM: tl.constexpr):
    """Merge the first num_partials partials of rows q_rows (the cascade prefix kernel's) into the
    online-softmax state (m_i, l_i, acc); returns the new state."""
    for slot in range(0, num_partials):  # 0: no prefix
        # A partial (out, lse) is the online-softmax state m = lse, l = 1, acc = out: merged as a
        # tile. An empty partial (LSE -inf) never wrote its output; both empty: weights 0.
        row = q_rows * num_slots + slot  # (ROWS,) into part_lse (S, H, slots)
        lse = tl.load(part_lse_ptr + row, mask=row_mask, other=float("-inf"))
        out = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=(lse > float("-inf"))[:, None], other=0.0)  # (ROWS, D)
        m_new = tl.maximum(m_i, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # both empty: not exp2(nan)
        alpha, beta = tl.exp2(m_i - m_safe), tl.exp2(lse - m_safe)
        m_i, l_i, acc = m_new, l_i * alpha + beta, acc * alpha[:, None] + out * beta[:, None]
    return m_i, l_i, acc


@triton.jit
def _store_decode_partial(acc, m_i, l_i, q_rows, row_mask, offs_d, slot, num_slots, out_ptr,
                          part_out_ptr, part_lse_ptr, HEAD_DIM: tl.constexpr,
                          SINGLE_SPLIT: tl.constexpr):
    # q_rows (ROWS,) = seq * H + head: rows of out (S * H, D); row_mask drops padded rows
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty split / context_len 0: zeros, not NaN
    if SINGLE_SPLIT:  # one split: the partial is the answer, skip the merge launch
        dst = out_ptr + q_rows[:, None] * HEAD_DIM + offs_d[None, :]  # out (S, H, D)
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        row = q_rows * num_slots + slot  # (ROWS,) into part_lse (S, H, slots)
        # an empty partial writes only its LSE: the merge never reads its output (cheap early-outs)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=(row_mask & (l_i > 0))[:, None])
        lse = m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))  # log-sum-exp of the split's scores (log2)
        lse = tl.where(l_i > 0, lse, float("-inf"))  # no tokens: -inf, weight 0 in the merge
        tl.store(part_lse_ptr + row, lse, mask=row_mask)


@triton.jit
def _cascade_prefix_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                           num_common_ptr, part_out_ptr, part_lse_ptr, qk_scale, v_scale, num_seqs,
                           num_slots, q_stride_s, q_stride_h, cache_stride_block,
                           cache_stride_token, GROUP: tl.constexpr, ROWS: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                           BLOCKS_PER_ITER: tl.constexpr, NUM_STAGES: tl.constexpr):
    # Program (KV head, row tile, prefix split): ROWS query rows of many sequences against one split
    # of the shared prefix, so each prefix K/V tile is loaded once per ROWS rows, not per sequence.
    kv_head, row_tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    prefix_len = tl.load(num_common_ptr) * BLOCK_SIZE  # P full blocks, read on device: no host sync
    block_start, block_end = _split_block_range(prefix_len, 0, BLOCK_SIZE)
    offs_r = row_tile * ROWS + tl.arange(0, ROWS)  # (ROWS,) sequence-major: row = seq * GROUP + g
    seq, heads = offs_r // GROUP, kv_head * GROUP + offs_r % GROUP  # (ROWS,) sequence, query head
    offs_d, offs_t = tl.arange(0, HEAD_DIM), tl.arange(0, BLOCK_SIZE * BLOCKS_PER_ITER)  # (TILE,)
    row_mask = seq < num_seqs
    load_q = seq < tl.where(block_start < block_end, num_seqs, 0)  # an idle split: no q loads
    q = _dot_dtype(tl.load(q_ptr + seq[:, None] * q_stride_s + heads[:, None] * q_stride_h
                           + offs_d[None, :], mask=load_q[:, None], other=0.0), k_cache_ptr)
    m_i, l_i = tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)  # the online softmax's state, as in decode
    for block in tl.range(block_start, block_end, BLOCKS_PER_ITER, num_stages=NUM_STAGES):
        seq_block = block + offs_t // BLOCK_SIZE  # (TILE,)
        valid = seq_block < block_end  # prefix blocks are full: only the split's end masks
        # row 0 of the block tables: every row has the same prefix
        block_id = tl.load(block_tables_ptr + seq_block, mask=valid, other=0)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_id,
                                     offs_t % BLOCK_SIZE, valid, kv_head * HEAD_DIM, offs_d,
                                     cache_stride_block, cache_stride_token, qk_scale, v_scale)
    # a padded CUDA-graph row (context_len 0) does not hold the prefix: drop its share (LSE -inf)
    l_i = tl.where(tl.load(context_lens_ptr + seq, mask=row_mask, other=0) >= prefix_len, l_i, 0.0)
    q_rows = seq * tl.num_programs(0) * GROUP + heads  # (ROWS,) rows of out (S * H, D)
    _store_decode_partial(acc, m_i, l_i, q_rows, row_mask, offs_d, split, num_slots, part_out_ptr,
                          part_out_ptr, part_lse_ptr, HEAD_DIM, False)  # always a partial


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits, HEAD_DIM: tl.constexpr,
                         SPLITS_PAD: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    row = seq * tl.num_programs(1) + head  # row of part_lse (S, H, splits) and out (S, H, D)
    offs_s, offs_d = tl.arange(0, SPLITS_PAD), tl.arange(0, HEAD_DIM)
    split_mask = offs_s < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # context_len 0: all empty, no NaN
    weight = tl.exp2(lse - lse_max)  # (SPLITS_PAD,) each split's share of the softmax mass
    # (SPLITS_PAD, D) partial outputs; empty splits wrote none
    parts = tl.load(part_out_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM
                    + offs_d[None, :], mask=(lse > float("-inf"))[:, None], other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)  # (D,)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty))


# --------------------------------------------------------------------------------------------------
# Split heuristics, launch settings and the Python entry points
# --------------------------------------------------------------------------------------------------

def default_num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, device: torch.device,
                       prefix: bool = False, warps: int = DECODE_NUM_WARPS) -> int:
    """Splits per sequence for cascade_decode, from shapes only (CUDA-graph safe, never from
    context_lens).

    Flash-decoding: split each sequence's blocks only until the (sequence, KV head, split) grid of
    programs of `warps` warps has SPLIT_WARPS_PER_SM warps for every SM. Large batches get there
    alone: 1 split, no merge launch. Never more splits than block-table columns (a split needs >= 1
    block) or MAX_SPLITS.

    prefix=True: the shared prefix's splits for the cascade prefix kernel (never from P), num_seqs
    counting row tiles: (KV head, row tile) programs, CASCADE_PROGRAMS_PER_SM of them, rounded
    down: each split adds a partial that the own kernel must read back.
    """
    programs, sms = num_seqs * num_kv_heads, sm_count(device)
    splits = (CASCADE_PROGRAMS_PER_SM * sms // programs if prefix
              else triton.cdiv(SPLIT_WARPS_PER_SM * sms, programs * warps))
    return max(1, min(splits, max_blocks, MAX_SPLITS))


def cascade_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                   context_lens: Tensor, scale: float, num_common_blocks: Tensor | None = None,
                   num_splits: int | None = None) -> Tensor:
    """kernels.decode.paged_decode's result and input contract, (S, H, D) -> (S, H, D), with
    split-KV: num_splits programs per (sequence, KV head), default_num_splits by default, their
    partials merged by LSE. No host sync, grid from shapes only: safe to capture in a CUDA graph.

    Cascade attention: num_common_blocks, a (1,) int32 device tensor P (may be 0), says the first P
    block-table columns are the same full blocks for every sequence (a prefix-cache hit, say a
    shared system prompt), with context_lens >= P * B or 0 (a padded graph row: zeros out). That
    prefix is then read once per CASCADE_ROWS query rows instead of once per sequence, and merged
    by LSE with each sequence's own blocks; P stays on the device, so one graph replays for any P.
    Callers use it for big batches only: on small ones the extra launch costs more than it saves.
    """
    decode._check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens)
    (S, H, D), (B, Hkv), max_blocks = q.shape, k_cache.shape[1:3], block_tables.shape[1]
    group, cascade = H // Hkv, num_common_blocks is not None
    assert not cascade or (num_common_blocks.shape, num_common_blocks.dtype) == ((1,), torch.int32)
    assert num_splits is None or num_splits >= 1
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    # an fp8 cache's products run transposed (_attend_tile_t), its group padded to 8 rows
    busy = S * Hkv >= FP8_BUSY_PROGRAMS_PER_SM * sm_count(q.device)
    step, min_rows, (tile, warps) = (
        (_attend_tile_t, FP8_GROUP_ROWS, FP8_BUSY_LAUNCH if busy else FP8_LAUNCH) if fp8
        else (_attend_tile, decode.MIN_GROUP_ROWS, (DECODE_TILE_TOKENS, DECODE_NUM_WARPS)))
    num_splits = num_splits or default_num_splits(S, Hkv, max_blocks, q.device, warps=warps)
    row_tiles = triton.cdiv(S * group, CASCADE_ROWS)  # (sequence, query head) rows per KV head
    # the shared prefix's splits (prefix=True): none without one
    prefix_splits = default_num_splits(row_tiles, Hkv, max_blocks, q.device, True) if cascade else 0
    out = q.new_empty(S, H, D)  # (S, H, D)
    # Slots for partial results per (sequence, head): the prefix splits', then the own splits',
    # unless one own split folds the prefix partials in and writes the answer itself (the big
    # batches cascade is for). With no slots the kernels get `out` in the buffers' place and never
    # write it.
    num_slots = prefix_splits + (num_splits if num_splits > 1 else 0)
    part_lse = q.new_empty(S, H, num_slots, dtype=torch.float32) if num_slots else out
    part_out = part_lse.new_empty(S, H, num_slots, D) if num_slots else out  # fp32 (S, H, slots, D)
    qk_scale = scale * decode.LOG2E  # scores in log2 units: the kernels use exp2
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1))
    launch = dict(GROUP=group, HEAD_DIM=D, BLOCK_SIZE=B)  # both kernels walk whole blocks
    if cascade:  # launched first: the per-sequence kernel folds its partials in
        _cascade_prefix_kernel[(Hkv, row_tiles, prefix_splits)](  # (Hkv, cdiv(S * GROUP, ROWS), .)
            q, k_cache, v_cache, block_tables, context_lens, num_common_blocks, part_out, part_lse,
            qk_scale, decode.FP8_V_SCALE, S, num_slots, *strides, ROWS=CASCADE_ROWS,
            NUM_STAGES=CASCADE_NUM_STAGES, num_warps=CASCADE_NUM_WARPS, **launch,  # fp8: 2x rows
            BLOCKS_PER_ITER=max(1, (decode.TILE_TOKENS_FP8 if fp8 else DECODE_TILE_TOKENS) // B))
    _cascade_decode_kernel[(Hkv, S, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, num_common_blocks, out, part_out, part_lse,
        qk_scale, decode.FP8_V_SCALE, prefix_splits, num_slots, *strides, block_tables.stride(0),
        GROUP_PAD=max(min_rows, triton.next_power_of_2(group)), ATTEND_TILE=step, CASCADE=cascade,
        SINGLE_SPLIT=num_splits == 1, NUM_STAGES=DECODE_NUM_STAGES, num_warps=warps,
        BLOCKS_PER_ITER=max(1, tile // B), **launch)
    if num_splits > 1:
        _merge_splits_kernel[(S, H)](part_out, part_lse, out, num_slots, HEAD_DIM=D,
                                     SPLITS_PAD=triton.next_power_of_2(num_slots),
                                     num_warps=MERGE_NUM_WARPS)
    return out


def common_prefix_blocks(block_tables: np.ndarray, context_lens: np.ndarray,
                         block_size: int) -> np.ndarray:
    """(1,) int32: how many leading block-table columns hold the same full block in every row, a
    shared prefix (prefix-cache hits) that cascade attention reads once for the whole batch."""
    limit = int(context_lens.min()) // block_size
    same = (block_tables[:, :limit] == block_tables[0, :limit]).all(axis=0)  # (limit,)
    return np.array([same.argmin() if not same.all() else limit], np.int32)


def backends(chosen: Backends, config: Config) -> Backends:
    """Decode attention by cascade_decode; with prefix caching (only its hits share blocks), a
    decode batch of CASCADE_MIN_SEQS rows or more looks for the blocks its rows share."""
    shared = (functools.partial(common_prefix_blocks, block_size=config.kvcache_block_size)
              if config.enable_prefix_caching else None)
    return dataclasses.replace(chosen, decode_attention=decode_attention, common_blocks=shared,
                               common_blocks_from=CASCADE_MIN_SEQS)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                     ctx: ForwardContext, scale: float) -> Tensor:
    """The decode attention backend (k and v, in the cache already, are not read again)."""
    return cascade_decode(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale,
                          ctx.num_common_blocks)

