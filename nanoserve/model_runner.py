"""ModelRunner: turns a scheduled Batch into tensors, runs the model, samples one token per sequence.

Owns: the model and its weights on one device, the paged KV cache tensor, the flat batch tensors,
the CUDA graphs for decode, and sampling. With tensor parallelism there is one ModelRunner per rank:
rank 0 builds the batch on the host (`prepare`), ships the resulting BatchInputs to the other ranks
(see `call`), every rank runs `forward` and joins the collectives, and rank 0 alone samples.
Does not own: which sequences run (scheduler) or which blocks they hold (block_manager).
Invariant: the KV cache is sized once, at start-up, before any request is admitted.
Called by: llm_engine (run, shutdown); TP workers run `worker_loop`.
"""
import gc
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Semaphore

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from nanoserve.config import Config
from nanoserve.kernels import context_slots
from nanoserve.layers import ForwardContext, Sampler, forward_context
from nanoserve.models import DecoderModel
from nanoserve.scheduler import Batch
from nanoserve.sequence import Sequence
from nanoserve.weights import load_weights

# cascade attention from this decode batch size on. Measured on an H200, 1,024-token shared prefix: attention
# 3.2x faster at 256 sequences, 2.2x at 64, break-even at 8, slower at 1.
CASCADE_MIN_SEQS = 32
GRAPH_BATCH_SIZES = [1, 2, 4, 8] + list(range(16, 513, 16))  # decode batch sizes captured as CUDA graphs
CPU_KV_CACHE_BYTES = 1 << 30  # KV cache on the CPU when num_kvcache_blocks is not given: 1 GiB
SHM_BYTES = 1 << 24  # shared-memory segment for rank 0 -> worker calls: 16 MiB of pickled arguments
DIST_TIMEOUT_SECONDS = 120  # a collective waiting longer than this for a silent peer raises
PEER_EXIT_WAIT_SECONDS = 5  # after a collective fails, how long to wait for the dead worker to be reaped


@dataclass(kw_only=True)
class BatchInputs:
    """A batch as host arrays: what every rank needs for one forward pass (built on rank 0)."""
    is_prefill: bool
    input_ids: np.ndarray  # (N,) int64
    positions: np.ndarray  # (N,) int64
    slot_mapping: np.ndarray  # (N,) int32
    cu_seqlens_q: np.ndarray | None = None  # (S+1,) int32, prefill
    cu_seqlens_k: np.ndarray | None = None  # (S+1,) int32, prefill
    context_lens: np.ndarray | None = None  # (S,) int32, decode
    block_tables: np.ndarray | None = None  # (S, max_blocks) int32: decode, and prefill with a prefix hit
    num_common_blocks: int = 0  # decode: leading blocks every sequence shares (cascade attention), 0 = off
    prev_rows: np.ndarray | None = None  # (S,) int64, a step scheduled ahead: row of each input token in the
    # previous step's samples, which are still on the device (input_ids holds placeholders then)


@dataclass
class StepOutput:
    """One step's sampled tokens: kept on the device (the next step may read them there) and copied,
    without blocking, to the host; tolist() waits for that copy only."""
    token_ids: Tensor  # (S,) int64 on the device
    host: Tensor  # (S,) int64 on the host, pinned on CUDA
    copied: torch.cuda.Event | None = None  # recorded after the copy; None on CPU (already there)

    def tolist(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


def common_prefix_blocks(block_tables: np.ndarray, context_lens: np.ndarray, block_size: int) -> int:
    """How many leading block-table columns hold the same block, full, in every row: a shared prefix
    (prefix-cache hits) that cascade attention reads once for the whole batch."""
    limit = int(context_lens.min()) // block_size
    same = (block_tables[:, :limit] == block_tables[0, :limit]).all(axis=0)  # (limit,)
    return int(same.argmin()) if not same.all() else limit


def graph_batch_size(num_seqs: int) -> int:
    """The captured decode batch size for num_seqs sequences: the smallest that holds them, else the largest."""
    return next((b for b in GRAPH_BATCH_SIZES if b >= num_seqs), GRAPH_BATCH_SIZES[-1])


def token_slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of tokens [start, end): slot = block_id * block_size + offset in the block."""
    slots: list[int] = []
    for i in range(start // block_size, (end - 1) // block_size + 1):
        lo, hi = max(start, i * block_size), min(end, (i + 1) * block_size)
        base = block_table[i] * block_size - i * block_size  # slot of token p in block i = base + p
        slots.extend(range(base + lo, base + hi))
    return slots


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0, shm_name: str | None = None,
                 wakeups: list[Semaphore] | None = None, port: int | None = None,
                 check_workers: Callable[[float], None] | None = None) -> None:
        self.config, self.rank = config, rank
        self.world_size = config.tensor_parallel_size
        self.check_workers = check_workers or (lambda wait_seconds=0.0: None)
        self.block_size = config.kvcache_block_size
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.use_graphs = self.device.type == "cuda" and not config.enforce_eager
        # decode batches up to this size replay a graph: the captured size that holds max_num_seqs, at most 512;
        # 0 without graphs
        self.max_graph_batch = graph_batch_size(config.max_num_seqs) if self.use_graphs else 0
        self.shm = SharedMemory(shm_name) if shm_name else None
        self.wakeups = wakeups or []  # rank 0: one per worker; a worker: its own
        self.prev_token_ids: Tensor | None = None  # (S,) the last step's samples, on the device (see run)
        self.rng = np.random.default_rng()  # the sampler's uniforms for unseeded rows
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world_size > 1:  # NCCL between GPUs, gloo between CPU processes; same code either way
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", world_size=self.world_size,
                                    rank=rank, init_method=f"tcp://127.0.0.1:{port}",
                                    timeout=timedelta(seconds=DIST_TIMEOUT_SECONDS))
        self.model = self._build_model()
        self.sampler = Sampler()
        self.allocate_kv_cache()
        if self.use_graphs:
            self.capture_cudagraphs()

    @torch.inference_mode()
    def _build_model(self) -> DecoderModel:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.config.torch_dtype)
        try:
            with self.device:  # parameters are created on the target device, in the target dtype
                model = DecoderModel(self.config.hf_config)
        finally:
            torch.set_default_dtype(default_dtype)
        load_weights(model, self.config.model)
        return model.eval()

    # ---- KV cache ---------------------------------------------------------------------------------
    def allocate_kv_cache(self) -> None:
        """Size the paged KV cache from the memory left after a worst-case forward pass, then allocate it."""
        layers = self.model.attention_layers()
        h = layers[0]
        block_bytes = (2 * len(layers) * self.block_size * h.num_kv_heads * h.head_dim
                       * self.config.torch_dtype.itemsize)
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks is None:
            num_blocks = self._measure_num_blocks(block_bytes)
            if self.world_size > 1:  # every rank must agree on the block count
                t = torch.tensor([num_blocks], device=self.device)
                dist.all_reduce(t, op=dist.ReduceOp.MIN)
                num_blocks = int(t.item())
            self.config.check_kvcache_fits(num_blocks, block_bytes)
            self.config.num_kvcache_blocks = num_blocks
        # (2, layers, num_blocks, B, Hkv, D): K and V of every layer, one tensor so it is allocated once
        self.kv_cache = torch.empty(2, len(layers), num_blocks, self.block_size, h.num_kv_heads, h.head_dim,
                                    dtype=self.config.torch_dtype, device=self.device)
        for i, attn in enumerate(layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def _measure_num_blocks(self, block_bytes: int) -> int:
        if self.device.type == "cpu":
            wanted = self.max_blocks_per_seq * self.config.max_num_seqs
            return min(wanted, CPU_KV_CACHE_BYTES // block_bytes)
        gc.collect()  # an engine shut down earlier in this process may still hold cached blocks
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.warmup()
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        # the budget minus what is in use now, minus the warm-up's activation peak that will recur
        peak_extra = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        available = total * self.config.gpu_memory_utilization - (total - free) - peak_extra
        return max(int(available // block_bytes), 0)

    @torch.inference_mode()
    def warmup(self) -> None:
        """A prefill of max_num_batched_tokens tokens, the largest activation footprint the engine creates."""
        cfg = self.config
        seq_len = min(cfg.max_model_len, cfg.max_num_batched_tokens)
        num_seqs = max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))
        cu = np.arange(num_seqs + 1, dtype=np.int32) * seq_len
        n = num_seqs * seq_len
        inputs = BatchInputs(is_prefill=True, input_ids=np.zeros(n, np.int64),
                             positions=np.tile(np.arange(seq_len), num_seqs), slot_mapping=np.full(n, -1, np.int32),
                             cu_seqlens_q=cu, cu_seqlens_k=cu)
        logits = self.forward(inputs)
        if self.rank == 0:  # compile the sampler's kernels now, not during the first requests
            rows = torch.ones(2, device=self.device)  # temperatures and uniforms of two rows
            self.sampler(logits[:1].expand(2, -1), rows, rows / 2)  # (the warm-up prefill may have one row only)
        torch.cuda.synchronize()

    # ---- host side: batch -> arrays (rank 0) --------------------------------------------------------
    def prepare(self, batch: Batch) -> BatchInputs:
        return self.prepare_prefill(batch) if batch.is_prefill else self.prepare_decode(batch.seqs)

    def prepare_prefill(self, batch: Batch) -> BatchInputs:
        input_ids, positions, slot_mapping = [], [], []
        cu_q, cu_k = [0], [0]
        for seq, start, num_new in zip(batch.seqs, batch.starts, batch.num_new_tokens):
            end = start + num_new
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slot_mapping += token_slots(seq.block_table, start, end, self.block_size)
            cu_q.append(cu_q[-1] + num_new)
            cu_k.append(cu_k[-1] + end)  # keys: the cached prefix plus the new tokens
        prefix_hit = cu_k[-1] > cu_q[-1]
        return BatchInputs(is_prefill=True, input_ids=np.array(input_ids, np.int64),
                           positions=np.array(positions, np.int64), slot_mapping=np.array(slot_mapping, np.int32),
                           cu_seqlens_q=np.array(cu_q, np.int32), cu_seqlens_k=np.array(cu_k, np.int32),
                           block_tables=self.block_tables(batch.seqs) if prefix_hit else None)

    def prepare_decode(self, seqs: list[Sequence]) -> BatchInputs:
        # each sequence computes its newest token, at position num_tokens - 1
        positions = np.array([seq.num_tokens - 1 for seq in seqs], np.int64)
        last_blocks = np.array([seq.block_table[-1] for seq in seqs], np.int64)
        context_lens, block_tables = (positions + 1).astype(np.int32), self.block_tables(seqs)
        return BatchInputs(is_prefill=False, input_ids=np.array([seq.token_ids[-1] for seq in seqs], np.int64),
                           positions=positions,
                           slot_mapping=(last_blocks * self.block_size + positions % self.block_size).astype(np.int32),
                           context_lens=context_lens, block_tables=block_tables,
                           num_common_blocks=common_prefix_blocks(block_tables, context_lens, self.block_size)
                           if self.use_cascade(len(seqs)) else 0)

    def use_cascade(self, num_seqs: int) -> bool:
        """Cascade attention for a decode batch of num_seqs? Only prefix-cache hits share blocks."""
        return self.config.enable_prefix_caching and num_seqs >= CASCADE_MIN_SEQS

    def block_tables(self, seqs: list[Sequence]) -> np.ndarray:
        width = max(len(seq.block_table) for seq in seqs)
        flat: list[int] = []
        for seq in seqs:  # one flat list, then one conversion: the fastest way from Python lists to numpy
            flat += seq.block_table
            flat += [-1] * (width - len(seq.block_table))
        return np.array(flat, np.int32).reshape(len(seqs), width)  # (S, max_blocks), -1 past each table's end

    # ---- device side: arrays -> logits (every rank) -------------------------------------------------
    def _pinned(self, array: np.ndarray) -> Tensor:
        """array as a tensor in pinned host memory on CUDA. A copy to the GPU from pinned memory is queued
        and returns at once; one from ordinary (pageable) memory first waits for every queued GPU kernel,
        which would stall the host until the running step ends. (Torch keeps a pinned block alive until
        its copy has run, so the next step cannot overwrite it early.)"""
        tensor = torch.from_numpy(array)
        return tensor.pin_memory() if self.device.type == "cuda" else tensor

    def _to_device(self, array: np.ndarray | None) -> Tensor | None:
        return None if array is None else self._pinned(array).to(self.device, non_blocking=True)

    def _input_ids(self, inputs: BatchInputs) -> Tensor:
        if inputs.prev_rows is None:
            return self._to_device(inputs.input_ids)
        return self.prev_token_ids[self._to_device(inputs.prev_rows)]  # gathered on the device: no sync

    @torch.inference_mode()
    def forward(self, inputs: BatchInputs) -> Tensor | None:
        """Run the model on one batch; return logits (S, V) on rank 0, None on other ranks."""
        input_ids = self._input_ids(inputs)
        num_seqs = len(inputs.cu_seqlens_q) - 1 if inputs.is_prefill else len(inputs.positions)
        if not inputs.is_prefill and num_seqs <= self.max_graph_batch:
            hidden = self.replay_cudagraph(inputs, input_ids)  # (graph batch, hidden): padding rows included
            ctx = ForwardContext(is_prefill=False, slot_mapping=self.graph_buffers["slot_mapping"])
        else:
            ctx = self._forward_context(inputs)
            with forward_context(ctx):
                hidden = self.model(input_ids, self._to_device(inputs.positions))  # (N, hidden)
        with forward_context(ctx):
            logits = self.model.compute_logits(hidden)  # (rows, V): num_seqs, or up to a graph batch size
        return None if logits is None else logits[:num_seqs]

    def _forward_context(self, inputs: BatchInputs) -> ForwardContext:
        d = self._to_device
        if inputs.is_prefill:
            cu_q, cu_k = inputs.cu_seqlens_q, inputs.cu_seqlens_k
            ctx = ForwardContext(
                is_prefill=True, slot_mapping=d(inputs.slot_mapping), cu_seqlens_q=d(cu_q), cu_seqlens_k=d(cu_k),
                max_seqlen_q=int(np.diff(cu_q).max()), max_seqlen_k=int(np.diff(cu_k).max()),
                logits_indices=d(self._last_token_rows(cu_q)))
            if inputs.block_tables is not None:  # prefix hits: slots computed once per step, used by every layer
                ctx.context_slots = context_slots(d(inputs.block_tables), ctx.cu_seqlens_k, self.block_size,
                                                  int(cu_k[-1]))
            return ctx
        common = np.array([inputs.num_common_blocks], np.int32) if inputs.num_common_blocks else None
        return ForwardContext(is_prefill=False, slot_mapping=d(inputs.slot_mapping),
                              context_lens=d(inputs.context_lens), block_tables=d(inputs.block_tables),
                              num_common_blocks=d(common))

    def _last_token_rows(self, cu_q: np.ndarray) -> np.ndarray:
        """(rows,) int64: the row of each sequence's last new token, where prefill computes logits. With CUDA
        graphs the last row repeats up to a graph batch size, as decode's padded rows do: the LM head then runs
        only at sizes capture_cudagraphs ran it at. A GEMM shape seen for the first time may need a cuBLAS kernel
        not loaded yet, and loading one stalls the host ~10 ms, long enough to idle the GPU: W1 lost ~11 decode
        steps that way, ~8 ms each (H100), before the LM head's rows were padded."""
        last = cu_q[1:].astype(np.int64) - 1  # (S,)
        rows = graph_batch_size(len(last)) if len(last) <= self.max_graph_batch else len(last)
        return np.pad(last, (0, rows - len(last)), mode="edge")

    # ---- CUDA graphs ------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_cudagraphs(self) -> None:
        """Record one decode forward per batch size; a replay launches all its kernels at once."""
        max_bs, hidden_size = self.max_graph_batch, self.config.hf_config.hidden_size
        with self.device:
            self.graph_buffers = {  # static inputs and output that every graph reads and writes
                "input_ids": torch.zeros(max_bs, dtype=torch.int64),
                "positions": torch.zeros(max_bs, dtype=torch.int64),
                "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int32),
                "context_lens": torch.zeros(max_bs, dtype=torch.int32),
                "block_tables": torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32),
                "num_common_blocks": torch.zeros(1, dtype=torch.int32),
                "hidden": torch.zeros(max_bs, hidden_size, dtype=self.config.torch_dtype)}
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (batch size, cascade) -> graph
        pool = None
        for bs in reversed([b for b in GRAPH_BATCH_SIZES if b <= max_bs]):  # largest first: others reuse its pool
            b = {name: buf[:bs] for name, buf in self.graph_buffers.items()}
            for cascade in {False, self.use_cascade(bs)}:  # a cascade graph only where cascade may be used
                graph = torch.cuda.CUDAGraph()
                ctx = ForwardContext(is_prefill=False, slot_mapping=b["slot_mapping"], context_lens=b["context_lens"],
                                     block_tables=b["block_tables"],
                                     num_common_blocks=b["num_common_blocks"] if cascade else None)
                with forward_context(ctx):
                    b["hidden"][:] = self.model(b["input_ids"], b["positions"])  # warm-up outside the graph
                    with torch.cuda.graph(graph, pool):
                        b["hidden"][:] = self.model(b["input_ids"], b["positions"])
                pool = pool or graph.pool()
                self.graphs[bs, cascade] = graph
        with forward_context(ForwardContext(is_prefill=False, slot_mapping=self.graph_buffers["slot_mapping"])):
            for bs in {bs for bs, _ in self.graphs}:  # load the LM head's GEMM kernels (see _last_token_rows)
                self.model.compute_logits(self.graph_buffers["hidden"][:bs])
        torch.cuda.synchronize()

    def replay_cudagraph(self, inputs: BatchInputs, input_ids: Tensor) -> Tensor:
        bs = len(inputs.positions)
        graph_bs = graph_batch_size(bs)
        buf = self.graph_buffers
        buf["input_ids"][:bs].copy_(input_ids)
        for name in ("positions", "slot_mapping", "context_lens"):
            buf[name][:bs].copy_(self._pinned(getattr(inputs, name)), non_blocking=True)
        buf["slot_mapping"][bs:graph_bs].fill_(-1)  # padded rows write nowhere...
        buf["context_lens"][bs:graph_bs].zero_()  # ...and attend to nothing
        width = inputs.block_tables.shape[1]
        buf["block_tables"][:bs, :width].copy_(self._pinned(inputs.block_tables), non_blocking=True)
        buf["num_common_blocks"].fill_(inputs.num_common_blocks)  # read only by graphs captured with cascade
        # the cascade graph only when blocks are shared: with none, its prefix kernel would launch for nothing
        self.graphs[graph_bs, inputs.num_common_blocks > 0].replay()
        return buf["hidden"][:graph_bs]

    # ---- sampling (rank 0) --------------------------------------------------------------------------
    @torch.inference_mode()  # as forward: no autograd bookkeeping on the sampling ops
    def sample(self, logits: Tensor, seqs: list[Sequence]) -> StepOutput:
        params = [seq.params for seq in seqs]
        temperatures = uniforms = None  # None: every row is greedy
        if any(p.temperature > 0 for p in params):
            temperatures = self._to_device(np.array([p.temperature for p in params], np.float32))
            u = self.rng.random(len(seqs), np.float32)  # (S,) one uniform per row: what the sampler inverts
            for i, seq in enumerate(seqs):
                if seq.params.seed is not None:  # seeded: u depends only on the seed and the position
                    u[i] = np.random.default_rng((seq.params.seed, seq.num_tokens)).random(dtype=np.float32)
            uniforms = self._to_device(u)
        top_ks = self._to_device(np.array([p.top_k for p in params])) if any(p.top_k for p in params) else None
        top_ps = (self._to_device(np.array([p.top_p for p in params], np.float32))
                  if any(p.top_p < 1 for p in params) else None)
        token_ids = self.sampler(logits, temperatures, uniforms, top_ks, top_ps)  # (S,) int64
        if self.device.type == "cpu":
            return StepOutput(token_ids, token_ids)
        host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True).copy_(token_ids, non_blocking=True)
        return StepOutput(token_ids, host, copied=torch.cuda.current_stream().record_event())

    def run(self, batch: Batch, prev: tuple[Batch, StepOutput] | None = None) -> StepOutput:
        """One engine step on rank 0: every rank runs the forward pass, rank 0 samples. Returns without
        waiting for the GPU. prev: the step before, when this one was scheduled before its tokens were known."""
        inputs = self.prepare(batch)
        if prev is not None:
            rows = {seq.seq_id: i for i, seq in enumerate(prev[0].seqs)}
            inputs.prev_rows = np.array([rows[seq.seq_id] for seq in batch.seqs], np.int64)
            self.prev_token_ids = prev[1].token_ids
        if self.world_size > 1:
            assert prev is None, "the workers never see the sampled tokens: no steps scheduled ahead with TP"
            self.check_workers()
            self.call("forward", inputs)
        try:
            out = self.sample(self.forward(inputs), batch.seqs)
            if self.world_size > 1:
                out.tolist()  # wait here, where a collective broken by a dying worker is recognised
            return out
        except RuntimeError:
            self.check_workers(PEER_EXIT_WAIT_SECONDS)  # a collective broken by a dying worker: raise its error
            raise

    # ---- tensor-parallel plumbing -----------------------------------------------------------------
    def call(self, method: str, *args: object) -> None:
        """Rank 0: write (method, args) into shared memory and wake every worker to run it too.
        A semaphore, not an Event, wakes them: Event.set() blocks forever if a waiter was killed."""
        data = pickle.dumps((method, args))
        assert len(data) + 4 <= SHM_BYTES, "call arguments exceed the shared-memory segment"
        self.shm.buf[:4] = len(data).to_bytes(4, "little")
        self.shm.buf[4:4 + len(data)] = data
        for wakeup in self.wakeups:
            wakeup.release()

    def worker_loop(self) -> None:
        """Ranks 1..N-1: wait for rank 0's call, run it, repeat until told to exit."""
        while True:
            self.wakeups[0].acquire()
            n = int.from_bytes(self.shm.buf[:4], "little")
            method, args = pickle.loads(self.shm.buf[4:4 + n])
            if method == "exit":
                break
            getattr(self, method)(*args)

    def shutdown(self) -> None:
        if self.world_size > 1 and self.rank == 0:
            self.call("exit")
        if self.shm is not None:
            self.shm.close()
        # drop every GPU tensor now, so a next engine in this process finds the memory free. The CUDA graphs
        # go before the process group: they hold its NCCL all-reduces, and destroying it under them hung
        # both ranks (measured on 2 x H200).
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.graphs, self.graph_buffers = {}, {}
        del self.model, self.kv_cache
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
