"""GPU kernels, each beside a plain-torch reference: rotary + KV store, gate/up + SiLU, paged decode, prefill, sampling.

Owns the math on the paged KV cache, the decode MLP's fused gate/up + SiLU and the sampler's draw, nothing
else: layers.Attention, layers.Sampler and models.MLP pick what to call, model_runner builds the batch
tensors. On CUDA the Triton kernels run; on CPU the references run, unless the kernels were built by
Triton's interpreter (TRITON_INTERPRET=1 at import), which runs them on CPU tensors for CI.
Invariant: kernels never sync with the host and launch a grid that depends only on shapes and arguments,
so the decode step can be captured in a CUDA graph. Paged decode can also run as cascade attention: a prefix
that every sequence shares (prefix caching) is read once per batch tile, not once per sequence.

Shapes: N tokens, S sequences, H / Hkv query / KV heads (GROUP = H // Hkv query heads share a KV head),
D head dim, B block size (tokens per KV block). KV cache: (num_blocks, B, Hkv, D), slot = block_id * B + offset.
"""

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

try:  # optional dependency: the fastest varlen prefill when installed
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e)); exp2 is one instruction on the GPU
# Paged-decode tuning, measured on an H200 (Qwen3-0.6B heads, bf16, B = 16; see paged_decode's docstring):
DECODE_TILE_TOKENS = 64  # K/V rows per loop step (whole blocks): 4.4 TB/s vs 4.0 with 32 rows, 3.1 with 16
# software pipelining: the next step's loads fly during this one. H200: 4.2 TB/s against 3.4 at 1 stage. H100,
# W1-like sorted batches (graph replays): 2 stages 1-3% faster than 3 at batch 32-256, and 1 stage slower
DECODE_NUM_STAGES = 2
DECODE_NUM_WARPS = 4  # 8 warps was 10-40% slower
MIN_GROUP_ROWS = 16  # tl.dot (tensor cores) needs >= 16 rows: the GQA group is padded up to this
SPLIT_PROGRAMS_PER_SM = 2  # split KV until the grid has this many programs per SM (~4 fit; 2 measured best)
MAX_SPLITS = 16  # batch 1, context 1024: 16 splits 7.3 us, 32 splits 8.0 us, 64 splits 9.0 us
# Cascade prefix kernel (a shared prefix, see paged_decode): one program multiplies CASCADE_ROWS query rows
# (sequences x the query heads of one KV head) by each prefix K/V tile, so the prefix is read once per
# CASCADE_ROWS rows, not once per sequence; rows also make tl.dot's M dimension without padding.
CASCADE_ROWS = 64  # H200, S 256, P 64: 64 rows / 4 warps 69 us, 128 / 8 warps 72, 32 / 4 warps 75
CASCADE_NUM_WARPS = 4
CASCADE_NUM_STAGES = 3  # H200-tuned; on an H100, W2 with 2 (the decode kernel's) was 0-15% slower
CASCADE_PROGRAMS_PER_SM = 1  # prefix splits fill one wave of (KV head, row tile, split) programs; see below
MERGE_NUM_WARPS = 2  # merging 6 partials of 256 x 16 rows: 11.4 us at 1 or 2 warps, 18.6 at 4


# ---------------------------------------------------------------------------------------------------------
# Rotary + KV store: per token, Qwen3's per-head RMSNorm of q and k, the rotary embedding of both (written back
# in place), and the new keys and values scattered into their cache slots. One launch per layer, where the
# separate steps took five (two norms, two rotations, the store), each a few microseconds of a decode step.
# ---------------------------------------------------------------------------------------------------------

@triton.jit
def _norm_rotate_heads(x_ptr, weight_ptr, cos, sin, eps, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                       HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
    """One token's heads (NUM_HEADS, D) at x_ptr rotated in place, RMS-normalized first with QK_NORM; returns the
    rotated halves. Rotate-half layout: x[i] pairs with x[i + D/2] under angle i; cos, sin (1, D/2) fp32."""
    heads, half = tl.arange(0, HEADS_PAD)[:, None], tl.arange(0, HEAD_DIM // 2)[None, :]
    # (HEADS_PAD, D/2), spelled out in full (& half >= 0): Triton's interpreter does not broadcast store masks.
    # Heads pad to a power of two: SmolLM2's 9 query heads to 16.
    mask = (heads < NUM_HEADS) & (half >= 0)
    lo_ptr = x_ptr + heads * HEAD_DIM + half  # (HEADS_PAD, D/2) pointers to the first halves
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(lo_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo_ptr + HEAD_DIM // 2, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # rounded as rms_norm_ref rounds: normalized in fp32, to the model dtype, times the weight
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]  # (HEADS_PAD, 1)
        w1 = tl.load(weight_ptr + half).to(tl.float32)  # (1, D/2)
        w2 = tl.load(weight_ptr + HEAD_DIM // 2 + half).to(tl.float32)
        x1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    y1, y2 = (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)
    tl.store(lo_ptr, y1, mask=mask)
    tl.store(lo_ptr + HEAD_DIM // 2, y2, mask=mask)
    return y1, y2


@triton.jit
def _rotary_store_kernel(q_ptr, k_ptr, v_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr,
                         k_cache_ptr, v_cache_ptr, slot_mapping_ptr, q_stride, k_stride, v_stride, eps,
                         H: tl.constexpr, H_PAD: tl.constexpr, HKV: tl.constexpr, HKV_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr, STORE: tl.constexpr):
    token = tl.program_id(0)  # one program per token: all its heads of q, k and v
    half = tl.arange(0, HEAD_DIM // 2)[None, :]  # (1, D/2)
    angles = cos_sin_ptr + tl.load(positions_ptr + token) * HEAD_DIM  # the position's row: D/2 cos, D/2 sin
    cos, sin = tl.load(angles + half), tl.load(angles + HEAD_DIM // 2 + half)
    _norm_rotate_heads(q_ptr + token * q_stride, q_weight_ptr, cos, sin, eps, H, H_PAD, HEAD_DIM, QK_NORM)
    k1, k2 = _norm_rotate_heads(k_ptr + token * k_stride, k_weight_ptr, cos, sin, eps, HKV, HKV_PAD, HEAD_DIM,
                                QK_NORM)
    if STORE:  # the cache holds the rotated keys
        slot = tl.load(slot_mapping_ptr + token)
        heads = tl.arange(0, HKV_PAD)[:, None]
        mask = (heads < tl.where(slot >= 0, HKV, 0)) & (half >= 0)  # slot -1 (a padded graph row): no heads
        dst = slot.to(tl.int64) * (HKV * HEAD_DIM) + heads * HEAD_DIM + half  # a slot is one (Hkv, D) cache row
        src = v_ptr + token * v_stride + heads * HEAD_DIM + half
        tl.store(k_cache_ptr + dst, k1, mask=mask)
        tl.store(k_cache_ptr + dst + HEAD_DIM // 2, k2, mask=mask)
        tl.store(v_cache_ptr + dst, tl.load(src, mask=mask), mask=mask)
        tl.store(v_cache_ptr + dst + HEAD_DIM // 2, tl.load(src + HEAD_DIM // 2, mask=mask), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# The MLP's gate/up projection with SiLU-and-mul fused in, for decode batches. There every kernel costs a few
# microseconds however little it does; cuBLAS's GEMM plus the separate SiLU-and-mul kernel took 9.1-12.4 us per
# layer at 32-256 rows on an H100, this one kernel 8.4-10.7 us (Qwen3-0.6B, graph replays of 28 layers).
# A program computes matching tiles of x W_gate^T and x W_up^T, so it finds each (gate, up) pair in registers.
# ---------------------------------------------------------------------------------------------------------

@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, out_ptr, M, I, K, x_stride, w_stride, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    # program (row tile, column tile); row tiles vary fastest, so the programs that read one tile of W run together
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) of x and out
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) of out: gate rows of W, up rows I later
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    x_ptrs = x_ptr + rows[:, None] * x_stride + offs_k  # (BLOCK_M, BLOCK_K)
    gate_ptrs = w_ptr + cols[:, None] * w_stride + offs_k  # (BLOCK_N, BLOCK_K)
    up_ptrs = gate_ptrs + I * w_stride
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        in_k = offs_k + k < K
        x = tl.load(x_ptrs + k, mask=(rows[:, None] < M) & in_k, other=0.0)
        w_mask = (cols[:, None] < I) & in_k
        gate = tl.dot(x, tl.trans(tl.load(gate_ptrs + k, mask=w_mask, other=0.0)), gate)
        up = tl.dot(x, tl.trans(tl.load(up_ptrs + k, mask=w_mask, other=0.0)), up)
    dtype = out_ptr.dtype.element_ty
    gate, up = gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32)  # rounded as a projection's output
    tl.store(out_ptr + rows[:, None] * I + cols[None, :], (gate * tl.sigmoid(gate) * up).to(dtype),
             mask=(rows[:, None] < M) & (cols[None, :] < I))


# ---------------------------------------------------------------------------------------------------------
# Paged decode, flash-decoding style: program (sequence, KV head, split) walks its share of the sequence's
# blocks with an online softmax for all GROUP query heads of that KV head (K/V read once per group), and
# writes a partial output plus its log-sum-exp; a second kernel merges the splits by their LSEs.
# Cascade: a first kernel attends the rows of many sequences to the shared prefix blocks at once (a real
# matrix product) and writes its partials; the per-sequence kernel then skips those blocks and, when it has
# one split, folds the prefix partials into its own state (else the merge kernel takes them all).
# ---------------------------------------------------------------------------------------------------------

@triton.jit
def _split_block_range(context_len, first_block, split, num_splits, BLOCK_SIZE: tl.constexpr):
    # The split's share of blocks [first_block, end) is computed here from context_len, so the grid stays fixed
    # (CUDA-graph safe) and the splits always share the real work evenly; a split past the end gets nothing
    # and writes LSE = -inf. first_block > 0 skips a shared prefix that the cascade prefix kernel reads.
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    first_block = tl.minimum(first_block, num_blocks)  # a padded row (context_len 0) has no prefix either
    blocks_per_split = tl.cdiv(num_blocks - first_block, num_splits)
    block_start = first_block + split * blocks_per_split
    return block_start, tl.minimum(block_start + blocks_per_split, num_blocks)  # [start, end) block indices


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_id, offset, valid, head_base, offs_d,
                 cache_stride_block, cache_stride_token, qk_scale):
    """One online-softmax step of q (ROWS, D) over a tile of TILE cached tokens (block_id, offset) (TILE,)."""
    rows = block_id.to(tl.int64) * cache_stride_block + offset * cache_stride_token + head_base  # (TILE,)
    # issue K and V loads together: more bytes in flight per program hides HBM latency
    k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)  # (TILE, D)
    v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)  # (TILE, D)
    s = tl.dot(q, tl.trans(k)) * qk_scale  # (ROWS, TILE) fp32, scale folded with log2(e)
    s = tl.where(valid[None, :], s, float("-inf"))
    # Online softmax: every tile has >= 1 valid token (it starts below block_end), so m_new is finite.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # (ROWS, D) fp32 accumulation
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, num_common_ptr,
                         out_ptr, part_out_ptr, part_lse_ptr, qk_scale, first_slot, num_slots,
                         q_stride_s, q_stride_h, cache_stride_block, cache_stride_token, block_tables_stride,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr, NUM_STAGES: tl.constexpr,
                         CASCADE: tl.constexpr, SINGLE_SPLIT: tl.constexpr):
    # KV heads vary fastest in the grid: the GPU starts programs in that order, so a batch sorted longest
    # context first (the scheduler's order) starts its longest work first and the SMs finish together
    kv_head, seq, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    TILE: tl.constexpr = BLOCK_SIZE * BLOCKS_PER_ITER  # tokens per step: whole blocks, so rows never straddle
    context_len = tl.load(context_lens_ptr + seq)
    first_block = 0
    if CASCADE:  # the first P blocks are the shared prefix: _cascade_prefix_kernel reads them
        first_block = tl.load(num_common_ptr)
    block_start, block_end = _split_block_range(context_len, first_block, split, tl.num_programs(2), BLOCK_SIZE)
    offs_g, offs_d, offs_t = tl.arange(0, GROUP_PAD), tl.arange(0, HEAD_DIM), tl.arange(0, TILE)
    heads = kv_head * GROUP + offs_g  # (GROUP_PAD,) query heads of this KV head: GQA reads K/V once per group
    # Padded to >= 16 rows so both products run on tensor cores (tl.dot); the extra rows are zeros and the
    # math is free in a memory-bound kernel. Measured: 1.7-7x faster than broadcast-multiply-sum for
    # groups of 1, 2, 3 and 8, whose cross-thread reductions cost more than the wasted rows.
    q = tl.load(q_ptr + seq * q_stride_s + heads[:, None] * q_stride_h + offs_d[None, :],
                mask=offs_g[:, None] < GROUP, other=0.0)  # (GROUP_PAD, D)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of scores (log2 units)
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running softmax denominator
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)  # running numerator
    for block in tl.range(block_start, block_end, BLOCKS_PER_ITER, num_stages=NUM_STAGES):
        seq_block = block + offs_t // BLOCK_SIZE  # (TILE,) the sequence's block index of each tile row
        in_split = seq_block < block_end  # never read block-table entries past the sequence's blocks
        block_id = tl.load(block_tables_ptr + seq * block_tables_stride + seq_block, mask=in_split, other=0)
        offset = offs_t % BLOCK_SIZE
        valid = in_split & (seq_block * BLOCK_SIZE + offset < context_len)  # (TILE,) last block is ragged
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_id, offset, valid,
                                     kv_head * HEAD_DIM, offs_d, cache_stride_block, cache_stride_token, qk_scale)
    q_rows = seq * tl.num_programs(0) * GROUP + heads  # (GROUP_PAD,) rows of out (S * H, D)
    if SINGLE_SPLIT:  # the cascade prefix kernel ran first: fold its partials in here, no merge launch
        for slot in range(0, first_slot):  # first_slot = number of prefix partials (0 without a prefix)
            m_i, l_i, acc = _fold_partial(m_i, l_i, acc, part_out_ptr, part_lse_ptr, q_rows * num_slots + slot,
                                          offs_g < GROUP, offs_d, HEAD_DIM)
    _store_decode_partial(acc, m_i, l_i, q_rows, offs_g < GROUP, offs_d, first_slot + split, num_slots,
                          out_ptr, part_out_ptr, part_lse_ptr, HEAD_DIM, SINGLE_SPLIT)


@triton.jit
def _fold_partial(m_i, l_i, acc, part_out_ptr, part_lse_ptr, row, row_mask, offs_d, HEAD_DIM: tl.constexpr):
    # A partial (out, lse) is the online-softmax state m = lse, l = 1, acc = out: merge it in like a tile.
    lse = tl.load(part_lse_ptr + row, mask=row_mask, other=float("-inf"))  # (ROWS,)
    out = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=(lse > float("-inf"))[:, None],
                  other=0.0)  # (ROWS, D); an empty partial wrote no output
    m_new = tl.maximum(m_i, lse)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # both empty: weights 0, not exp2(nan)
    alpha, beta = tl.exp2(m_i - m_safe), tl.exp2(lse - m_safe)
    return m_new, l_i * alpha + beta, acc * alpha[:, None] + out * beta[:, None]


@triton.jit
def _store_decode_partial(acc, m_i, l_i, q_rows, row_mask, offs_d, slot, num_slots, out_ptr, part_out_ptr,
                          part_lse_ptr, HEAD_DIM: tl.constexpr, SINGLE_SPLIT: tl.constexpr):
    # q_rows (ROWS,) = seq * H + head: rows of out (S * H, D); row_mask drops padded rows
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty split / context_len 0: zeros, not 0/0 = NaN
    if SINGLE_SPLIT:  # one split: the partial is the answer, skip the merge launch
        dst = out_ptr + q_rows[:, None] * HEAD_DIM + offs_d[None, :]  # out (S, H, D)
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        row = q_rows * num_slots + slot  # (ROWS,) into part_lse (S, H, slots)
        # an empty partial writes only its LSE: the merge never reads its output (cheap early-outs)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=(row_mask & (l_i > 0))[:, None])
        lse = m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))  # log-sum-exp of the split's scores (log2 units)
        lse = tl.where(l_i > 0, lse, float("-inf"))  # no tokens: -inf, weight 0 in the merge
        tl.store(part_lse_ptr + row, lse, mask=row_mask)


@triton.jit
def _cascade_prefix_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, num_common_ptr,
                           part_out_ptr, part_lse_ptr, qk_scale, num_seqs, num_slots,
                           q_stride_s, q_stride_h, cache_stride_block, cache_stride_token,
                           GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr, NUM_STAGES: tl.constexpr):
    # Program (KV head, row tile, prefix split): ROWS query rows of many sequences against one split of the
    # shared prefix, so each prefix K/V tile is loaded once per ROWS rows instead of once per sequence.
    kv_head, row_tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    TILE: tl.constexpr = BLOCK_SIZE * BLOCKS_PER_ITER
    prefix_len = tl.load(num_common_ptr) * BLOCK_SIZE  # P full blocks, read on device: no host sync
    block_start, block_end = _split_block_range(prefix_len, 0, split, tl.num_programs(2), BLOCK_SIZE)
    offs_r = row_tile * ROWS + tl.arange(0, ROWS)  # (ROWS,) sequence-major: row = seq * GROUP + g
    seq, heads = offs_r // GROUP, kv_head * GROUP + offs_r % GROUP  # (ROWS,) each row's sequence, query head
    offs_d, offs_t = tl.arange(0, HEAD_DIM), tl.arange(0, TILE)
    row_mask = seq < num_seqs
    load_q = seq < tl.where(block_start < block_end, num_seqs, 0)  # an idle split (P = 0, past P) loads none
    q = tl.load(q_ptr + seq[:, None] * q_stride_s + heads[:, None] * q_stride_h + offs_d[None, :],
                mask=load_q[:, None], other=0.0)  # (ROWS, D)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for block in tl.range(block_start, block_end, BLOCKS_PER_ITER, num_stages=NUM_STAGES):
        seq_block = block + offs_t // BLOCK_SIZE  # (TILE,)
        valid = seq_block < block_end  # prefix blocks are full: only the split's end masks
        block_id = tl.load(block_tables_ptr + seq_block, mask=valid, other=0)  # row 0: every row has the same
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_id, offs_t % BLOCK_SIZE,
                                     valid, kv_head * HEAD_DIM, offs_d, cache_stride_block, cache_stride_token,
                                     qk_scale)
    # a padded CUDA-graph row (context_len 0) does not hold the prefix: drop its share (l = 0 -> LSE -inf)
    context_len = tl.load(context_lens_ptr + seq, mask=row_mask, other=0)
    l_i = tl.where(context_len >= prefix_len, l_i, 0.0)
    q_rows = seq * tl.num_programs(0) * GROUP + heads  # (ROWS,) rows of out (S * H, D)
    _store_decode_partial(acc, m_i, l_i, q_rows, row_mask, offs_d, split, num_slots,
                          part_out_ptr, part_out_ptr, part_lse_ptr, HEAD_DIM, False)  # always a partial


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits,
                         HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    row = seq * tl.num_programs(1) + head  # (seq, head) row of part_lse (S, H, splits) and out (S, H, D)
    offs_s, offs_d = tl.arange(0, SPLITS_PAD), tl.arange(0, HEAD_DIM)
    split_mask = offs_s < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + offs_s, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # context_len 0: all splits empty, no NaN
    weight = tl.exp2(lse - lse_max)  # (SPLITS_PAD,) each split's share of the softmax mass; empty ones 0
    parts = tl.load(part_out_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=(lse > float("-inf"))[:, None], other=0.0)  # (SPLITS_PAD, D); empty ones unwritten
    total = tl.sum(weight, axis=0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)  # (D,)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------------------
# Sampling by inverting the CDF: one uniform u per row, and the token where the row's cumulative softmax
# probability first exceeds u. Two kernels, so nothing scans a whole row in order: per chunk of SAMPLE_CHUNK
# logits, its max, where it is, and its softmax mass (a (rows, chunks) grid that reads the logits once); then
# per row, the chunk where the cumulative mass passes u, and the token inside that chunk.
# ---------------------------------------------------------------------------------------------------------

@triton.jit
def _chunk_stats_kernel(logits_ptr, temperatures_ptr, top_ptr, top_index_ptr, mass_ptr, vocab, row_stride,
                        num_chunks, CHUNK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    t = tl.load(temperatures_ptr + row)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)  # (CHUNK,) token ids
    x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + offs, mask=offs < vocab, other=float("-inf"))
    x = x.to(tl.float32) / tl.where(t > 0, t, 1.0)  # greedy rows (T = 0) keep their logits: argmax only
    top = tl.maximum(tl.max(x, axis=0), -3.0e38)  # finite: a chunk of only -inf (masked) gets mass 0, not NaN
    stats = row * num_chunks + chunk
    tl.store(top_ptr + stats, top)
    tl.store(top_index_ptr + stats, chunk * CHUNK + tl.argmax(x, axis=0))  # the first max, as torch's argmax
    tl.store(mass_ptr + stats, tl.sum(tl.exp(x - top), axis=0))


@triton.jit
def _first_above(cumulative, target, weights, index):
    """The first index whose cumulative weight exceeds target, never one of weight 0 (rounding can put target
    at or past the total: then the last index of positive weight)."""
    first = tl.sum((cumulative <= target).to(tl.int32), axis=0)
    return tl.minimum(first, tl.max(tl.where(weights > 0, index, 0), axis=0))


@triton.jit
def _pick_token_kernel(logits_ptr, temperatures_ptr, uniforms_ptr, top_ptr, top_index_ptr, mass_ptr, tokens_ptr,
                       vocab, row_stride, num_chunks, CHUNKS_PAD: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temperatures_ptr + row)
    chunks = tl.arange(0, CHUNKS_PAD)
    stats = row * num_chunks + chunks
    top = tl.load(top_ptr + stats, mask=chunks < num_chunks, other=-3.0e38)  # (CHUNKS_PAD,)
    mass = tl.load(mass_ptr + stats, mask=chunks < num_chunks, other=0.0)
    best = tl.argmax(top, axis=0)  # the chunk of the row's max
    row_max = tl.max(top, axis=0)
    weights = mass * tl.exp(top - row_max)  # (CHUNKS_PAD,) each chunk's mass, relative to the row max
    cumulative = tl.cumsum(weights, axis=0)
    target = tl.load(uniforms_ptr + row) * tl.max(cumulative, axis=0)
    chunk = _first_above(cumulative, target, weights, chunks)
    chunk_top = tl.sum(tl.where(chunks == chunk, top, 0.0), axis=0)
    target -= tl.sum(tl.where(chunks == chunk, cumulative - weights, 0.0), axis=0)  # what is left in the chunk
    offs = tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + chunk * CHUNK + offs,
                mask=chunk * CHUNK + offs < vocab, other=float("-inf"))
    inside = tl.exp(x.to(tl.float32) / tl.where(t > 0, t, 1.0) - chunk_top)  # (CHUNK,) relative to the chunk max
    target /= tl.exp(chunk_top - row_max)  # in the units of `inside`
    token = chunk * CHUNK + _first_above(tl.cumsum(inside, axis=0), target, inside, offs)
    greedy = tl.load(top_index_ptr + row * num_chunks + best)
    tl.store(tokens_ptr + row, tl.where(t > 0, token, greedy))


# True when TRITON_INTERPRET=1 was set at import: the kernels above were built by the interpreter and run on
# CPU tensors (slowly), which is how CI tests them. Read once, the same moment triton.jit made that choice.
_INTERPRETED = not isinstance(_rotary_store_kernel, triton.runtime.jit.JITFunction)


def _use_triton(t: Tensor) -> bool:
    return t.is_cuda or _INTERPRETED


# ---------------------------------------------------------------------------------------------------------
# Python entry points
# ---------------------------------------------------------------------------------------------------------

def rotary_and_store(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin: Tensor, k_cache: Tensor,
                     v_cache: Tensor, slot_mapping: Tensor,
                     qk_norm: tuple[Tensor, Tensor, float] | None = None) -> tuple[Tensor, Tensor]:
    """Rotary embedding of q (N, H, D) and k (N, Hkv, D) at positions (N,), after a per-head RMSNorm of each when
    qk_norm = (q_weight (D,), k_weight (D,), eps) is given (Qwen3); then the rotated k and v (N, Hkv, D) go into
    the paged caches at slot_mapping (N,) int32 (slot -1 writes nowhere; empty caches, before the KV cache
    exists, skip the store). cos_sin (max_position, D) fp32: each position's D/2 cosines, then its D/2 sines.
    q, k, v may be views of one fused projection (heads packed, any token stride). Returns the rotated q and k:
    with Triton, q and k themselves, rotated in place by one launch; otherwise new tensors (the reference)."""
    if not _use_triton(q):
        return rotary_and_store_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, qk_norm)
    (N, H, D), Hkv = q.shape, k.shape[1]
    assert k.shape == v.shape == (N, Hkv, D) and positions.shape == slot_mapping.shape == (N,)
    assert all(t.stride()[1:] == (D, 1) for t in (q, k, v)), "heads packed, last dim contiguous"
    assert D >= 4 and D & (D - 1) == 0, f"head dim {D}: the Triton kernels need a power of two"
    assert cos_sin.dtype == torch.float32 and cos_sin.shape[1] == D and cos_sin.is_contiguous()
    store = k_cache.numel() > 0
    assert not store or (k_cache.shape[2:] == (Hkv, D) and k_cache.shape == v_cache.shape and k_cache.is_contiguous()
                         and v_cache.is_contiguous() and k_cache.dtype == k.dtype and slot_mapping.dtype == torch.int32)
    q_weight, k_weight, eps = qk_norm or (q, k, 0.0)  # without the norm the weights are never read
    _rotary_store_kernel[(N,)](
        q, k, v, positions, cos_sin, q_weight, k_weight, k_cache if store else k, v_cache if store else v,
        slot_mapping, q.stride(0), k.stride(0), v.stride(0), eps, H=H, H_PAD=triton.next_power_of_2(H),
        HKV=Hkv, HKV_PAD=triton.next_power_of_2(Hkv), HEAD_DIM=D, QK_NORM=qk_norm is not None, STORE=store)
    return q, k


def gate_up_silu(x: Tensor, weight: Tensor) -> Tensor:
    """SiLU(x W_gate^T) * (x W_up^T) in one kernel: x (M, K), weight (2 I, K) with the gate rows first, as
    gate_up_proj packs them -> (M, I). Tiles from a sweep on an H100 (Qwen3-0.6B, 16-256 rows)."""
    if not _use_triton(x):
        return gate_up_silu_ref(x, weight)
    (M, K), I = x.shape, weight.shape[0] // 2
    assert weight.shape == (2 * I, K) and x.stride(1) == weight.stride(1) == 1
    out = torch.empty(M, I, dtype=x.dtype, device=x.device)
    block_m, block_n = (16 if M <= 32 else 64), (64 if 64 < M <= 128 else 32)
    _gate_up_silu_kernel[(triton.cdiv(M, block_m), triton.cdiv(I, block_n))](
        x, weight, out, M, I, K, x.stride(0), weight.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=128 if M <= 128 else 64, NUM_STAGES=4, num_warps=4)
    return out


def gate_up_silu_ref(x: Tensor, weight: Tensor) -> Tensor:
    return silu_and_mul_ref(F.linear(x, weight))


def silu_and_mul_ref(x: Tensor) -> Tensor:
    """SiLU(gate) * up of x (N, 2 I) = [gate | up] -> (N, I)."""
    gate, up = x.chunk(2, -1)  # (N, I) each
    return F.silu(gate) * up


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim: the mean of squares in fp32, then back to x's dtype (as transformers does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def rotary_ref(x: Tensor, cos_sin: Tensor) -> Tensor:
    """Rotate each (x1, x2) half-pair of x (N, heads, D) by its token's angle; cos_sin (N, D) fp32."""
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # (N, 1, D/2) each
    x1, x2 = x.float().chunk(2, dim=-1)  # (N, heads, D/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def rotary_and_store_ref(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin: Tensor, k_cache: Tensor,
                         v_cache: Tensor, slot_mapping: Tensor,
                         qk_norm: tuple[Tensor, Tensor, float] | None = None) -> tuple[Tensor, Tensor]:
    """Plain-torch rotary_and_store (CPU path and test oracle): new q and k, inputs untouched."""
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    angles = cos_sin[positions]  # (N, D)
    q, k = rotary_ref(q, angles), rotary_ref(k, angles)
    if k_cache.numel():
        store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def store_kvcache_ref(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                      slot_mapping: Tensor) -> None:
    """Write key/value (N, Hkv, D) into the caches at slot_mapping (N,); slot -1 writes nowhere. Boolean
    masking syncs: the CPU path and test oracle only, never in a CUDA graph."""
    Hkv, D = key.shape[1:]
    assert value.shape == key.shape and k_cache.shape[2:] == (Hkv, D) and slot_mapping.shape == key.shape[:1]
    keep = slot_mapping >= 0  # (N,) drop padded slots (-1)
    slots = slot_mapping[keep].long()
    k_cache.view(-1, Hkv, D).index_copy_(0, slots, key[keep])  # (num_blocks * B, Hkv, D) rows = slots
    v_cache.view(-1, Hkv, D).index_copy_(0, slots, value[keep])


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter on CPU: any small number keeps the split logic exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(num_seqs: int, num_kv_heads: int, max_blocks: int, device: torch.device) -> int:
    """Splits per sequence for paged_decode, from shapes only (CUDA-graph safe, never from context_lens).

    Flash-decoding: split each sequence's blocks only until the (sequence, KV head, split) grid has
    SPLIT_PROGRAMS_PER_SM programs for every SM. Large batches get there alone: 1 split, no merge launch.
    Never more splits than block-table columns (a split needs >= 1 block) or MAX_SPLITS. Measured on an
    H200 (132 SMs), context 1024, 8 KV heads: batch 256 -> 1 split (2 and 4 were 6-10% slower), batch 32 ->
    2 (best of 1-32), batch 1 -> 16 (best of 8-64).
    """
    target_programs = SPLIT_PROGRAMS_PER_SM * _sm_count(device)
    splits = triton.cdiv(target_programs, num_seqs * num_kv_heads)
    return max(1, min(splits, max_blocks, MAX_SPLITS))


def _prefix_num_splits(row_tiles: int, num_kv_heads: int, max_blocks: int, device: torch.device) -> int:
    """Splits of the shared prefix for the cascade prefix kernel, from shapes only (never from P).

    Like default_num_splits with (KV head, row tile) programs in the place of (sequence, KV head) ones, but
    CASCADE_PROGRAMS_PER_SM, rounded down: each split adds a partial that the own kernel must read back.
    Measured on an H200, P 64, 8 KV heads, 64-row tiles, us per step for 1/2/4/8/16 splits: S 256
    77/70/71/87/120 (this picks 2), S 128 61/49/49/54/72 (4), S 64 47/37/34/35/41 (8).
    """
    splits = CASCADE_PROGRAMS_PER_SM * _sm_count(device) // (row_tiles * num_kv_heads)
    return max(1, min(splits, max_blocks, MAX_SPLITS))


def _decode_launch_config(group: int, block_size: int) -> dict:
    """Tile and launch settings of the decode kernel (the DECODE_* constants above)."""
    # arange needs a power of two and tl.dot >= 16 rows: a group of 2 or 3 pads to 16, masked
    group_pad = max(MIN_GROUP_ROWS, triton.next_power_of_2(group))
    return dict(GROUP_PAD=group_pad, BLOCKS_PER_ITER=max(1, DECODE_TILE_TOKENS // block_size),
                NUM_STAGES=DECODE_NUM_STAGES, num_warps=DECODE_NUM_WARPS)


def paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                 scale: float, num_splits: int | None = None, num_common_blocks: Tensor | None = None) -> Tensor:
    """One new query token per sequence attends to its whole paged context: q (S, H, D) -> (S, H, D).

    k_cache / v_cache (num_blocks, B, Hkv, D) contiguous; q may be a strided view (last dim contiguous);
    block_tables (S, max_blocks) int32, context_lens (S,) int32. D and B powers of two >= 16. Output in q's
    dtype; fp32 accumulation (fp32 inputs run the products in TF32). No host sync, grid from shapes only:
    safe to capture in a CUDA graph. Measured on an H200 (141 GB, 4.8 TB/s), Qwen3-0.6B heads (16 q / 8 kv,
    D 128), bf16, B 16, context 1024, CUDA-graph replay: batch 256 reads its 1.08 GB of K/V at 4.38 TB/s.

    Cascade attention: num_common_blocks, a (1,) int32 device tensor P (may be 0), says the first P block-table
    columns are the same full blocks for every sequence (a prefix-cache hit, say a shared system prompt), with
    context_lens >= P * B (a row with context_len 0, a padded graph row, is allowed and returns zeros). That
    prefix is then read once per CASCADE_ROWS query rows instead of once per sequence, and merged by LSE with
    each sequence's own blocks. P stays on the device so one captured graph replays for any P. Measured on an
    H200, same heads, P 64 (1,024 tokens), 32-250 own tokens, graph replay: batch 256 71 us vs 222 us plain,
    128 54 vs 121, 32 26 vs 37; it breaks even at 8 and costs 4 us at 1, so callers use it for big batches.
    """
    if not _use_triton(q):  # same math either way: the prefix changes only how often the kernels read it
        return paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
    if num_splits is None:
        num_splits = default_num_splits(q.shape[0], k_cache.shape[2], block_tables.shape[1], q.device)
    return _paged_decode_launch(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits,
                                **_decode_launch_config(q.shape[1] // k_cache.shape[2], k_cache.shape[1]),
                                num_common_blocks=num_common_blocks)


def _paged_decode_launch(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                         context_lens: Tensor, scale: float, num_splits: int, GROUP_PAD: int,
                         BLOCKS_PER_ITER: int, NUM_STAGES: int, num_warps: int,
                         num_common_blocks: Tensor | None = None) -> Tensor:
    S, H, D = q.shape
    _, B, Hkv, _ = k_cache.shape
    assert H % Hkv == 0 and k_cache.shape[3] == D and v_cache.shape == k_cache.shape
    assert D >= 16 and D & (D - 1) == 0 and B >= 16 and B & (B - 1) == 0, "power-of-two D and B, >= 16"
    assert block_tables.shape[0] == S and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert context_lens.shape == (S,) and context_lens.dtype == torch.int32
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    assert 1 <= num_splits and GROUP_PAD >= max(H // Hkv, MIN_GROUP_ROWS)
    cascade = num_common_blocks is not None
    assert not cascade or (num_common_blocks.shape == (1,) and num_common_blocks.dtype == torch.int32)
    row_tiles = triton.cdiv(S * (H // Hkv), CASCADE_ROWS)  # (sequence, query head) rows of one KV head's group
    prefix_splits = _prefix_num_splits(row_tiles, Hkv, block_tables.shape[1], q.device) if cascade else 0
    # partials per (sequence, head): the prefix splits', then the own splits' unless one own split folds the
    # prefix partials in and writes the answer itself (the big-batch case, where cascade pays)
    num_slots = prefix_splits + (num_splits if num_splits > 1 else 0)
    out = torch.empty(S, H, D, dtype=q.dtype, device=q.device)  # (S, H, D)
    part_out = torch.empty(S, H, num_slots, D, dtype=torch.float32, device=q.device) if num_slots else out
    part_lse = torch.empty(S, H, num_slots, dtype=torch.float32, device=q.device) if num_slots else out
    launch = dict(HEAD_DIM=D, BLOCK_SIZE=B, BLOCKS_PER_ITER=BLOCKS_PER_ITER)
    if cascade:  # launched first: the per-sequence kernel folds its partials in
        _cascade_prefix_kernel[(Hkv, row_tiles, prefix_splits)](  # (Hkv, cdiv(S * GROUP, ROWS), splits)
            q, k_cache, v_cache, block_tables, context_lens, num_common_blocks, part_out, part_lse,
            scale * LOG2E, S, num_slots, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            GROUP=H // Hkv, ROWS=CASCADE_ROWS, NUM_STAGES=CASCADE_NUM_STAGES, num_warps=CASCADE_NUM_WARPS,
            **launch)
    _paged_decode_kernel[(Hkv, S, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, num_common_blocks, out, part_out, part_lse,
        scale * LOG2E, prefix_splits, num_slots, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0), GROUP=H // Hkv, GROUP_PAD=GROUP_PAD, CASCADE=cascade,
        SINGLE_SPLIT=num_splits == 1, NUM_STAGES=NUM_STAGES, num_warps=num_warps, **launch)
    if num_splits > 1:
        _merge_splits_kernel[(S, H)](part_out, part_lse, out, num_slots, HEAD_DIM=D,
                                     SPLITS_PAD=triton.next_power_of_2(num_slots), num_warps=MERGE_NUM_WARPS)
    return out


def paged_decode_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                     scale: float, chunk: int = 32) -> Tensor:
    """Plain-torch paged decode (CPU path and test oracle; syncs once): `chunk` sequences at a time, their
    blocks gathered from the cache, padded to the chunk's longest context and masked. Reads no block-table
    entry past a sequence's blocks (those may hold garbage) and zeroes the padding, so garbage in the
    cache, even NaN, never reaches the output."""
    S, H, D = q.shape
    _, B, Hkv, _ = k_cache.shape
    assert H % Hkv == 0 and block_tables.shape[0] == S and context_lens.shape == (S,)
    out = torch.zeros_like(q)  # (S, H, D); a context_len of 0 (a padded graph row) attends to nothing
    for c in range(0, S, chunk):
        lens = context_lens[c:c + chunk].long()  # (C,)
        num_blocks = int(lens.max() + B - 1) // B  # host sync
        cols = torch.arange(num_blocks, device=q.device)  # (nb,)
        blocks = torch.where(cols < (lens[:, None] + B - 1) // B, block_tables[c:c + chunk, :num_blocks], 0)
        valid = torch.arange(num_blocks * B, device=q.device) < lens[:, None]  # (C, L)
        # (C, nb, B, Hkv, D) -> (C, L, Hkv, D) in fp32; the padding zeroed (only its rows, the cheap way): a
        # masked score must not be NaN + (-inf), nor a zero weight times a NaN value
        k, v = (cache[blocks].flatten(1, 2).float() for cache in (k_cache, v_cache))
        padding = (~valid).flatten().nonzero().squeeze(1)  # (P,) rows of (C * L)
        k.view(-1, Hkv, D).index_fill_(0, padding, 0.0)
        v.view(-1, Hkv, D).index_fill_(0, padding, 0.0)
        o = F.scaled_dot_product_attention(q[c:c + chunk, :, None].float(), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True)
        out[c:c + chunk] = torch.where(lens[:, None, None] > 0, o[:, :, 0], 0.0)  # (C, H, D); no context: 0
    return out


# ---------------------------------------------------------------------------------------------------------
# Prefill: packed variable-length causal attention (no paging: prefix-cache hits gather their K/V first).
# ---------------------------------------------------------------------------------------------------------

def prefill_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                      max_seqlen_q: int, max_seqlen_k: int, scale: float) -> Tensor:
    """Causal varlen attention, q (Nq, H, D), k/v (Nk, Hkv, D) -> (Nq, H, D); mask aligned bottom-right."""
    assert q.shape[1] % k.shape[1] == 0 and k.shape == v.shape and q.shape[2] == k.shape[2]
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return prefill_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
    if flash_attn_varlen_func is not None:  # flash-attn's causal mask is bottom-right aligned (>= 2.1)
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=scale, causal=True)
    # torch's built-in FlashAttention-2: packed varlen, GQA, bottom-right causal; returns (out, lse, ...)
    out, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                      max_seqlen_k, 0.0, True, False, scale=scale)
    return out  # (Nq, H, D)


def prefill_attention_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                          max_seqlen_q: int, max_seqlen_k: int, scale: float) -> Tensor:
    """torch SDPA per sequence with an explicit bottom-right causal mask (CPU path and test oracle)."""
    out = torch.empty_like(q)  # (Nq, H, D)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[s], bounds_q[s + 1], bounds_k[s], bounds_k[s + 1]
        Lq, Lk = q1 - q0, k1 - k0
        # bottom-right: query i is token Lk - Lq + i of the sequence (the first Lk - Lq are a cached prefix)
        mask = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(diagonal=Lk - Lq)  # (Lq, Lk)
        o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1),
                                           v[k0:k1].transpose(0, 1), attn_mask=mask, scale=scale,
                                           enable_gqa=True)  # (H, Lq, D)
        out[q0:q1] = o.transpose(0, 1)
    return out


def context_slots(block_tables: Tensor, cu_seqlens_k: Tensor, block_size: int,
                  num_tokens: int | None = None) -> Tensor:
    """Cache slot of each of the first Lk_s tokens of every sequence s, packed (Nk,) int64: where a prefill with
    prefix hits reads its context's K/V (gather_kv). Computed once per step, then used by every layer.
    num_tokens = Nk = cu_seqlens_k[-1]; passing it from the host saves a device-to-host sync."""
    assert block_tables.shape[0] == cu_seqlens_k.shape[0] - 1
    if num_tokens is None:
        num_tokens = int(cu_seqlens_k[-1])  # host sync
    token = torch.arange(num_tokens, dtype=cu_seqlens_k.dtype, device=block_tables.device)  # (Nk,)
    seq = torch.searchsorted(cu_seqlens_k[1:], token, right=True)  # (Nk,) the sequence of each packed token
    pos = (token - cu_seqlens_k[seq]).long()  # (Nk,) its position within that sequence
    return block_tables[seq, pos // block_size].long() * block_size + pos % block_size  # block_id * B + offset


def gather_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> tuple[Tensor, Tensor]:
    """K and V (Nk, Hkv, D) of the cache slots (Nk,): a prefill's whole context, packed, for prefix hits."""
    Hkv, D = k_cache.shape[2:]
    return k_cache.view(-1, Hkv, D)[slots], v_cache.view(-1, Hkv, D)[slots]


# ---------------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------------
SAMPLE_CHUNK = 2048  # logits per chunk: 75 chunks for Qwen's 151,936 tokens


def sample(logits: Tensor, temperatures: Tensor, uniforms: Tensor) -> Tensor:
    """One draw per row of logits (S, V) from softmax(logits / T), the argmax (first one) where T = 0: the token
    where the cumulative probability first exceeds uniforms (S,) float32 in [0, 1). temperatures (S,) float32.
    One random number per row, none per logit, no host sync. Returns (S,) int64."""
    if not _use_triton(logits):
        return sample_ref(logits, temperatures, uniforms)
    (S, V), K = logits.shape, SAMPLE_CHUNK
    assert logits.stride(1) == 1 and temperatures.shape == uniforms.shape == (S,)
    C = triton.cdiv(V, K)
    top, mass = (torch.empty(S, C, dtype=torch.float32, device=logits.device) for _ in range(2))  # (S, C)
    top_index = torch.empty(S, C, dtype=torch.int64, device=logits.device)
    out = torch.empty(S, dtype=torch.int64, device=logits.device)
    _chunk_stats_kernel[(S, C)](logits, temperatures, top, top_index, mass, V, logits.stride(0), C, CHUNK=K)
    _pick_token_kernel[(S,)](logits, temperatures, uniforms, top, top_index, mass, out, V, logits.stride(0), C,
                             CHUNKS_PAD=triton.next_power_of_2(C), CHUNK=K)
    return out


def sample_ref(logits: Tensor, temperatures: Tensor, uniforms: Tensor) -> Tensor:
    """sample() by its definition (CPU path and test oracle): the whole row's CDF, no chunks."""
    x = logits.float() / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)  # (S, V)
    p = (x - x.amax(-1, keepdim=True)).exp()  # (S, V) unnormalized: the target scales with the total instead
    cdf = p.cumsum(-1)
    token = (cdf <= (uniforms * cdf[:, -1]).unsqueeze(1)).sum(-1)  # the first token whose CDF exceeds u
    last_possible = torch.where(p > 0, torch.arange(p.shape[1], device=p.device), 0).amax(-1)  # rounding at u ~ 1
    return torch.where(temperatures > 0, torch.minimum(token, last_possible), x.argmax(-1))  # (S,)
