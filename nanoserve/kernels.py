"""GPU kernels of attention: KV-cache store, paged decode, varlen prefill, each beside a plain-torch reference.

Owns the math on the paged KV cache and nothing else: layers.Attention picks what to call, model_runner
builds the batch tensors. On CUDA the Triton kernels run; on CPU the references run, unless the kernels
were built by Triton's interpreter (TRITON_INTERPRET=1 at import), which runs them on CPU tensors for CI.
Invariant: kernels never sync with the host and launch a grid that depends only on shapes and arguments,
so the decode step can be captured in a CUDA graph.

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
DECODE_NUM_STAGES = 3  # software pipelining: the next steps' loads fly during this one (4.2 vs 3.4 TB/s at 1)
DECODE_NUM_WARPS = 4  # 8 warps was 10-40% slower
MIN_GROUP_ROWS = 16  # tl.dot (tensor cores) needs >= 16 rows: the GQA group is padded up to this
SPLIT_PROGRAMS_PER_SM = 2  # split KV until the grid has this many programs per SM (~4 fit; 2 measured best)
MAX_SPLITS = 16  # batch 1, context 1024: 16 splits 7.3 us, 32 splits 8.0 us, 64 splits 9.0 us


# ---------------------------------------------------------------------------------------------------------
# KV store: scatter this step's new keys/values into their cache slots.
# ---------------------------------------------------------------------------------------------------------

@triton.jit
def _store_kvcache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                          key_stride, value_stride,
                          KV_WIDTH: tl.constexpr, KV_WIDTH_PAD: tl.constexpr):
    token = tl.program_id(0)  # one program copies one token's Hkv * D keys and values
    slot = tl.load(slot_mapping_ptr + token)
    offs = tl.arange(0, KV_WIDTH_PAD)  # arange needs a power of two: SmolLM2's 3 x 64 = 192 pads to 256
    mask = offs < tl.where(slot >= 0, KV_WIDTH, 0)  # slot -1 (a padded CUDA-graph slot) writes nowhere
    k = tl.load(key_ptr + token * key_stride + offs, mask=mask)
    v = tl.load(value_ptr + token * value_stride + offs, mask=mask)
    dst = slot.to(tl.int64) * KV_WIDTH + offs  # a slot is one (Hkv, D) row of the contiguous cache
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Paged decode, flash-decoding style: program (sequence, KV head, split) walks its share of the sequence's
# blocks with an online softmax for all GROUP query heads of that KV head (K/V read once per group), and
# writes a partial output plus its log-sum-exp; a second kernel merges the splits by their LSEs.
# ---------------------------------------------------------------------------------------------------------

@triton.jit
def _split_block_range(context_len, split, num_splits, BLOCK_SIZE: tl.constexpr):
    # The split's share is computed here from context_len, so the grid stays fixed (CUDA-graph safe) and the
    # splits always share the real work evenly; a split past the end gets nothing and writes LSE = -inf.
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    blocks_per_split = tl.cdiv(num_blocks, num_splits)
    block_start = split * blocks_per_split
    return block_start, tl.minimum(block_start + blocks_per_split, num_blocks)  # [start, end) block indices


@triton.jit
def _paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                         out_ptr, part_out_ptr, part_lse_ptr, qk_scale,
                         q_stride_s, q_stride_h, cache_stride_block, cache_stride_token, block_tables_stride,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr, NUM_STAGES: tl.constexpr,
                         SINGLE_SPLIT: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_splits = tl.num_programs(2)
    TILE: tl.constexpr = BLOCK_SIZE * BLOCKS_PER_ITER  # tokens per step: whole blocks, so rows never straddle
    context_len = tl.load(context_lens_ptr + seq)
    block_start, block_end = _split_block_range(context_len, split, num_splits, BLOCK_SIZE)
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
    head_base = kv_head * HEAD_DIM  # K/V of this head inside a token's (Hkv, D) row
    for block in tl.range(block_start, block_end, BLOCKS_PER_ITER, num_stages=NUM_STAGES):
        seq_block = block + offs_t // BLOCK_SIZE  # (TILE,) the sequence's block index of each tile row
        in_split = seq_block < block_end  # never read block-table entries past the sequence's blocks
        block_id = tl.load(block_tables_ptr + seq * block_tables_stride + seq_block, mask=in_split, other=0)
        offset = offs_t % BLOCK_SIZE
        valid = in_split & (seq_block * BLOCK_SIZE + offset < context_len)  # (TILE,) last block is ragged
        rows = block_id.to(tl.int64) * cache_stride_block + offset * cache_stride_token + head_base  # (TILE,)
        # issue K and V loads together: more bytes in flight per program hides HBM latency
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)  # (TILE, D)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)  # (TILE, D)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (GROUP_PAD, TILE) fp32, scale folded with log2(e)
        s = tl.where(valid[None, :], s, float("-inf"))
        # Online softmax: every tile has >= 1 valid token (it starts below block_end), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old max
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # (GROUP_PAD, D) fp32 accumulation
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty split / context_len 0: zeros, not 0/0 = NaN
    _store_decode_partial(out, m_i, l_i, heads, offs_g < GROUP, offs_d, seq, split, num_splits, out_ptr,
                          part_out_ptr, part_lse_ptr, GROUP, HEAD_DIM, SINGLE_SPLIT)


@triton.jit
def _store_decode_partial(out, m_i, l_i, heads, head_mask, offs_d, seq, split, num_splits, out_ptr,
                          part_out_ptr, part_lse_ptr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                          SINGLE_SPLIT: tl.constexpr):
    num_heads = tl.num_programs(1) * GROUP  # head_mask (GROUP_PAD,) drops the group's padded rows
    if SINGLE_SPLIT:  # one split: the partial is the answer, skip the merge launch
        dst = out_ptr + (seq * num_heads + heads[:, None]) * HEAD_DIM + offs_d[None, :]  # out (S, H, D)
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
    else:
        row = (seq * num_heads + heads) * num_splits + split  # (GROUP_PAD,) into part_lse (S, H, splits)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=head_mask[:, None])
        lse = m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))  # log-sum-exp of the split's scores (log2 units)
        lse = tl.where(l_i > 0, lse, float("-inf"))  # no tokens: -inf, weight 0 in the merge
        tl.store(part_lse_ptr + row, lse, mask=head_mask)


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
                    mask=split_mask[:, None], other=0.0)  # (SPLITS_PAD, D)
    total = tl.sum(weight, axis=0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)  # (D,)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty))


# True when TRITON_INTERPRET=1 was set at import: the kernels above were built by the interpreter and run on
# CPU tensors (slowly), which is how CI tests them. Read once, the same moment triton.jit made that choice.
_INTERPRETED = not isinstance(_store_kvcache_kernel, triton.runtime.jit.JITFunction)


def _use_triton(t: Tensor) -> bool:
    return t.is_cuda or _INTERPRETED


# ---------------------------------------------------------------------------------------------------------
# Python entry points
# ---------------------------------------------------------------------------------------------------------

def store_kvcache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write key/value (N, Hkv, D) into the paged caches at slot_mapping (N,); slot -1 writes nowhere."""
    if not _use_triton(key):
        return store_kvcache_ref(key, value, k_cache, v_cache, slot_mapping)
    N, Hkv, D = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (N,) and slot_mapping.dtype == torch.int32
    assert k_cache.shape[2:] == (Hkv, D) and k_cache.shape == v_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == key.dtype
    # a token's heads must be packed (Hkv * D values in a row); the token stride may be wider (a qkv view)
    assert key.stride()[1:] == (D, 1) and value.stride()[1:] == (D, 1)
    _store_kvcache_kernel[(N,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
                                KV_WIDTH=Hkv * D, KV_WIDTH_PAD=triton.next_power_of_2(Hkv * D))


def store_kvcache_ref(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                      slot_mapping: Tensor) -> None:
    """Plain-torch store_kvcache (CPU path and test oracle). Boolean masking syncs: not for CUDA graphs."""
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


def _decode_launch_config(group: int, block_size: int) -> dict:
    """Tile and launch settings of the decode kernel (the DECODE_* constants above)."""
    # arange needs a power of two and tl.dot >= 16 rows: a group of 2 or 3 pads to 16, masked
    group_pad = max(MIN_GROUP_ROWS, triton.next_power_of_2(group))
    return dict(GROUP_PAD=group_pad, BLOCKS_PER_ITER=max(1, DECODE_TILE_TOKENS // block_size),
                NUM_STAGES=DECODE_NUM_STAGES, num_warps=DECODE_NUM_WARPS)


def paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                 scale: float, num_splits: int | None = None) -> Tensor:
    """One new query token per sequence attends to its whole paged context: q (S, H, D) -> (S, H, D).

    k_cache / v_cache (num_blocks, B, Hkv, D) contiguous; q may be a strided view (last dim contiguous);
    block_tables (S, max_blocks) int32, context_lens (S,) int32. D and B powers of two >= 16. Output in q's
    dtype; fp32 accumulation (fp32 inputs run the products in TF32). No host sync, grid from shapes only:
    safe to capture in a CUDA graph. Measured on an H200 (141 GB, 4.8 TB/s), Qwen3-0.6B heads (16 q / 8 kv,
    D 128), bf16, B 16, context 1024, CUDA-graph replay: batch 256 reads its 1.08 GB of K/V at 4.38 TB/s.
    """
    if not _use_triton(q):
        return paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale)
    if num_splits is None:
        num_splits = default_num_splits(q.shape[0], k_cache.shape[2], block_tables.shape[1], q.device)
    return _paged_decode_launch(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits,
                                **_decode_launch_config(q.shape[1] // k_cache.shape[2], k_cache.shape[1]))


def _paged_decode_launch(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                         context_lens: Tensor, scale: float, num_splits: int, GROUP_PAD: int,
                         BLOCKS_PER_ITER: int, NUM_STAGES: int, num_warps: int) -> Tensor:
    S, H, D = q.shape
    _, B, Hkv, _ = k_cache.shape
    assert H % Hkv == 0 and k_cache.shape[3] == D and v_cache.shape == k_cache.shape
    assert D >= 16 and D & (D - 1) == 0 and B >= 16 and B & (B - 1) == 0, "power-of-two D and B, >= 16"
    assert block_tables.shape[0] == S and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert context_lens.shape == (S,) and context_lens.dtype == torch.int32
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1
    assert 1 <= num_splits and GROUP_PAD >= max(H // Hkv, MIN_GROUP_ROWS)
    out = torch.empty(S, H, D, dtype=q.dtype, device=q.device)  # (S, H, D)
    part_out = torch.empty(S, H, num_splits, D, dtype=torch.float32, device=q.device) if num_splits > 1 else out
    part_lse = torch.empty(S, H, num_splits, dtype=torch.float32, device=q.device) if num_splits > 1 else out
    _paged_decode_kernel[(S, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        GROUP=H // Hkv, GROUP_PAD=GROUP_PAD, HEAD_DIM=D, BLOCK_SIZE=B,
        BLOCKS_PER_ITER=BLOCKS_PER_ITER, NUM_STAGES=NUM_STAGES, SINGLE_SPLIT=num_splits == 1,
        num_warps=num_warps)
    if num_splits > 1:
        _merge_splits_kernel[(S, H)](part_out, part_lse, out, num_splits, HEAD_DIM=D,
                                     SPLITS_PAD=triton.next_power_of_2(num_splits))
    return out


def paged_decode_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                     scale: float) -> Tensor:
    """Plain-torch paged decode, one sequence at a time (CPU path and test oracle; syncs once).
    Reads exactly the context_len slots of each sequence, so garbage elsewhere in the cache never matters."""
    S, H, D = q.shape
    _, B, Hkv, _ = k_cache.shape
    assert H % Hkv == 0 and block_tables.shape[0] == S and context_lens.shape == (S,)
    k_slots, v_slots = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)  # (num_blocks * B, Hkv, D)
    out = torch.zeros_like(q)  # (S, H, D); a context_len of 0 (a padded graph row) attends to nothing
    for s, n in enumerate(context_lens.tolist()):  # host sync: fine on CPU, never graph-captured
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)  # (n,) token positions
        slot = block_tables[s, pos // B].long() * B + pos % B  # (n,) slot = block_id * B + offset
        k = k_slots[slot].float().permute(1, 2, 0)  # (Hkv, D, n)
        v = v_slots[slot].float().transpose(0, 1)  # (Hkv, n, D)
        qg = q[s].float().view(Hkv, H // Hkv, D)  # (Hkv, GROUP, D): query heads grouped by their KV head
        probs = torch.softmax(torch.bmm(qg, k) * scale, dim=-1)  # (Hkv, GROUP, n)
        out[s] = torch.bmm(probs, v).view(H, D).to(q.dtype)
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


def gather_kv(k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, cu_seqlens_k: Tensor,
              num_tokens: int | None = None) -> tuple[Tensor, Tensor]:
    """The first Lk_s cached tokens of each sequence s, packed (Nk, Hkv, D), for a prefill with prefix hits.
    num_tokens = Nk = cu_seqlens_k[-1]; passing it from the host saves a device-to-host sync per layer."""
    _, B, Hkv, D = k_cache.shape
    assert block_tables.shape[0] == cu_seqlens_k.shape[0] - 1 and v_cache.shape == k_cache.shape
    if num_tokens is None:
        num_tokens = int(cu_seqlens_k[-1])  # host sync: prefill is eager, never graph-captured
    token = torch.arange(num_tokens, dtype=cu_seqlens_k.dtype, device=k_cache.device)  # (Nk,)
    seq = torch.searchsorted(cu_seqlens_k[1:], token, right=True)  # (Nk,) the sequence of each packed token
    pos = (token - cu_seqlens_k[seq]).long()  # (Nk,) its position within that sequence
    slot = block_tables[seq, pos // B].long() * B + pos % B  # slot = block_id * B + offset
    return k_cache.view(-1, Hkv, D)[slot], v_cache.view(-1, Hkv, D)[slot]  # (Nk, Hkv, D) each
