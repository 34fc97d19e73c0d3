"""ModelRunner: turns a scheduled Batch into tensors, runs the model, samples a token per sequence.

Owns: the model and its weights on one device, the paged KV cache tensor, the flat batch tensors
and sampling. With tensor parallelism there is one ModelRunner per rank: rank 0 builds the batch
on the host (`prepare`), sends the ForwardContext to the other ranks (distributed.Workers), every
rank runs `forward` and joins the collectives, and rank 0 alone samples.
Does not own: which sequences run (scheduler), which blocks they hold (block_manager), the CUDA
graphs (extensions.cuda_graphs) or the worker processes (distributed).
Extension points: the host side's Extensions (`Extension`, in the engine's list; the runner
calls their sampling hooks), and on the device side the backends (`choose_backends`: what the
layers compute with, the cache dtype, cascade's shared prefix) and the graph runner
(extensions.cuda_graphs' decode graphs, or prefill_graphs', which replay a lone prompt's prefill
too), each chosen once, when the runner is built, from the settings.
Invariant: the KV cache is sized once, at start-up, before any request is admitted.
Called by: llm_engine (run, shutdown), extensions.overlap (run with input ids on the device).
"""
import gc
import logging
import mmap
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from nanoserve import kernels, layers
from nanoserve.config import Config, cdiv, extension
from nanoserve.distributed import DIST_TIMEOUT, PEER_EXIT_WAIT_SECONDS, Workers
from nanoserve.layers import ForwardContext, forward_context
from nanoserve.models import DecoderModel
from nanoserve.scheduler import Batch
from nanoserve.sequence import Sequence, TextStream
from nanoserve.weights import load_weights

CPU_KV_CACHE_BYTES = 1 << 30  # KV cache on the CPU when num_kvcache_blocks is not given: 1 GiB
GRAPH_BATCH_SIZES = [1, 2, 4, 8] + list(range(16, 513, 16))  # decode batch sizes captured
KEY_LIMIT = 1 << 63  # sampling keys are int64 >= 0

logger = logging.getLogger("nanoserve")


def graph_batch_size(num_seqs: int) -> int:
    """The captured size for num_seqs sequences: the smallest that holds them, else the largest."""
    return next((b for b in GRAPH_BATCH_SIZES if b >= num_seqs), GRAPH_BATCH_SIZES[-1])


def pinned(array: np.ndarray) -> Tensor:
    """array in pinned host memory: a copy from there to the GPU is queued and returns at once,
    while one from pageable memory waits for every queued kernel, stalling the host."""
    return torch.from_numpy(array).pin_memory()


def sampling_key(seed: int, position: int) -> int:
    """The sampler's key of a seeded request's token at `position`: a function of the two alone
    (Python's hash of a tuple of ints is the same in every process), so the draw is the same in
    any batch, in any order, after preemption and with or without overlap."""
    return hash((seed, position)) % KEY_LIMIT


def choose_backends(cfg: Config, device: torch.device) -> layers.Backends:
    """The device side's extension point: what the layers compute with, chosen once, before the
    model is built. Each extension whose setting is on builds on the backends chosen before it
    (batch_invariant replaces the products, norms and attention; fused's other steps stay)."""
    backends = layers.Backends()
    triton = device.type == "cuda" or kernels.INTERPRETED  # where the kernels run
    for name, on in (("fused", cfg.fused_kernels and triton),
                     ("cascade", cfg.cascade_attention and triton and not cfg.batch_invariant),
                     ("batch_invariant", cfg.batch_invariant and triton),
                     ("fp8", cfg.kv_cache_dtype == "fp8")):
        if on:
            backends = extension(name).backends(backends, cfg)
    return backends


@dataclass
class StepOutput:
    """One step's sampled tokens: kept on the device (the next step may read them there) and
    copied, without blocking, to the host; tolist() waits for that copy only."""
    token_ids: Tensor  # (S,) int64 on the device
    host: Tensor  # (S,) int64 on the host, pinned on CUDA
    copied: torch.cuda.Event | None = None  # recorded after the copies; None on CPU
    # what sampling hooks add, per row on the host (copies in flight until `copied`)
    extras: dict[str, tuple[Tensor, ...]] = field(default_factory=dict)

    def tolist(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


class Extension:
    """The host side's extension point: hooks called at fixed points of a step and of a request's
    life, for each extension in the engine's list, in its order (LLMEngine.switch_on). All are
    no-ops here; an extension overrides the ones it needs. The model runner calls the two around
    sampling (rank 0), the engine the others."""

    def __init__(self, engine: object) -> None:
        """Built once by LLMEngine.switch_on, given the engine (its tokenizer, scheduler...)."""
        self.engine = engine

    def on_request(self, seq: Sequence, streamed: bool) -> TextStream | None:
        """A request passed validation; return a TextStream to follow its text with, or None."""

    def before_sample(self, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        """The logits (S, V) the sampler draws from: these, or changed ones."""
        return logits

    def after_sample(self, logits: Tensor, token_ids: Tensor, seqs: list[Sequence],
                     out: StepOutput) -> None:
        """The model's logits and the tokens; may add host copies to out.extras (waited for with
        the tokens)."""

    def on_tokens(self, batch: Batch, out: StepOutput, token_ids: list[int]) -> list[Sequence]:
        """A step's tokens (host lists, synced), just recorded by the scheduler: each sequence
        that got one has it last. Return the sequences this extension finishes now."""
        return []

    def after_step(self, batch: Batch, finished: list[Sequence]) -> None:
        """A whole engine step is done (with speculation: every round of it)."""

    def on_abort(self, seq: Sequence) -> None:
        """seq was aborted between steps."""


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0, port: int | None = None,
                 workers: Workers | None = None, extensions: list[Extension] | tuple = ()) -> None:
        """rank 0 passes the Workers it started (none with one rank), whose port the ranks meet at,
        and the engine's Extensions (its list itself); ranks > 0 pass that port and no Workers."""
        self.config, self.rank, self.workers, self.extensions = config, rank, workers, extensions
        self.block_size = config.kvcache_block_size
        self.max_blocks_per_seq = cdiv(config.max_model_len, self.block_size)
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            gc.collect()  # memory an engine shut down earlier may still hold, freed before this
            torch.cuda.empty_cache()  # one's model is built in it (its blocks would stay taken)
        if config.tensor_parallel_size > 1:  # the collectives: NCCL on GPUs, gloo on CPUs
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", rank=rank,
                                    world_size=config.tensor_parallel_size, timeout=DIST_TIMEOUT,
                                    init_method=f"tcp://127.0.0.1:{port or workers.port}")
        # decode batches up to this many rows (a row per new token: with speculation a sequence's
        # drafts take one each) replay a graph, of the captured size at or above it
        use_graphs = self.device.type == "cuda" and not config.enforce_eager
        k = config.num_speculative_tokens if config.speculative_method else 0
        self.max_graph_batch = graph_batch_size(config.max_num_seqs * (1 + k)) if use_graphs else 0
        self.backends = choose_backends(config, self.device)
        # rng: unseeded keys; no graphs yet (the warm-up that sizes the cache runs eagerly)
        self.model, self.rng, self.graphs = self._build_model(), np.random.default_rng(), None
        self.allocate_kv_cache()
        # the graph runner, chosen by setting: extensions.cuda_graphs' decode graphs, or
        # prefill_graphs' (a lone prompt's prefill too) on one rank, not with batch_invariant
        # (whose prefill attention runs eagerly); captured on the device. None: all steps eager
        if use_graphs:
            prefill = config.prefill_graphs and config.tensor_parallel_size == 1
            name = "prefill_graphs" if prefill and not config.batch_invariant else "cuda_graphs"
            with self.device, torch.inference_mode():
                self.graphs = extension(name).graph_runner(self.model, self.max_graph_batch,
                                                           self.max_blocks_per_seq, self.backends)

    @torch.inference_mode()
    def _build_model(self) -> DecoderModel:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.config.torch_dtype)
        try:
            with self.device:  # parameters are created on the device, in the model dtype
                model = DecoderModel(self.config.hf_config, self.backends)
        finally:
            torch.set_default_dtype(default_dtype)
        load_weights(model, self.config.model)
        return model.eval()

    # ---- KV cache -----------------------------------------------------------------------------
    def allocate_kv_cache(self) -> None:
        """Size the paged KV cache from the memory a worst-case forward pass leaves, allocate it."""
        layers = self.model.attention_layers()
        block = (self.block_size, layers[0].num_kv_heads, layers[0].head_dim)  # (B, Hkv, D)
        kv_dtype = self.backends.kv_cache_dtype or self.config.torch_dtype
        block_bytes = 2 * len(layers) * int(np.prod(block)) * kv_dtype.itemsize
        if (num_blocks := self.config.num_kvcache_blocks) is None:
            num_blocks = self._measure_num_blocks(block_bytes)
            if self.config.tensor_parallel_size > 1:  # every rank must agree on the block count
                t = torch.tensor([num_blocks], device=self.device)
                dist.all_reduce(t, op=dist.ReduceOp.MIN)
                num_blocks = int(t.item())
            self.config.check_kvcache_fits(num_blocks, block_bytes)
            self.config.num_kvcache_blocks = num_blocks
        # (2, layers, num_blocks + 1, B, Hkv, D): K and V of every layer at once, zeroed (the CPU's
        # decode reads slots past a context: there an anonymous mapping, whose pages the OS zeroes
        # when first touched); the last block is a spare no sequence owns, where slot -1 writes
        shape, n = (2, len(layers), num_blocks + 1, *block), (num_blocks + 1) * block_bytes
        self.kv_cache = (torch.zeros(shape, dtype=kv_dtype, device=self.device)
                         if self.device.type == "cuda" else
                         torch.frombuffer(mmap.mmap(-1, n), dtype=kv_dtype).view(shape))
        if self.rank == 0:
            logger.info(f"model in {self.config.torch_dtype}; KV cache: {num_blocks} blocks of "
                        f"{self.block_size} tokens, {num_blocks * block_bytes / 2**30:.2f} GiB "
                        f"({block_bytes // self.block_size:,} bytes per token), {kv_dtype}")
        for i, attn in enumerate(layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def _measure_num_blocks(self, block_bytes: int) -> int:
        if self.device.type == "cpu":
            wanted = self.max_blocks_per_seq * self.config.max_num_seqs
            return min(wanted, CPU_KV_CACHE_BYTES // block_bytes)
        torch.cuda.reset_peak_memory_stats()
        self.warmup()
        free, total = torch.cuda.mem_get_info()
        # the budget minus what is in use now, minus the warm-up's activation peak that recurs
        peak_extra = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        available = total * self.config.gpu_memory_utilization - (total - free) - peak_extra
        return max(int(available // block_bytes), 0)

    @torch.inference_mode()
    def warmup(self) -> None:
        """A prefill of max_num_batched_tokens tokens: the largest activations the engine makes."""
        cfg = self.config
        seq_len = min(cfg.max_model_len, cfg.max_num_batched_tokens)
        num_seqs = max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))
        # num_seqs sequences of seq_len tokens: n tokens, cu (S+1,) their starts and end
        n, cu = num_seqs * seq_len, np.arange(num_seqs + 1, dtype=np.int32) * seq_len
        logits = self.forward(ForwardContext(  # slot -1: the warm-up writes no KV cache
            is_prefill=True, input_ids=np.zeros(n, np.int64), slot_mapping=np.full(n, -1, np.int32),
            positions=np.tile(np.arange(seq_len), num_seqs), cu_seqlens_q=cu, cu_seqlens_k=cu,
            max_seqlen_q=seq_len, max_seqlen_k=seq_len))
        if self.rank == 0:  # a compiled sampler (the backends') compiles now, not in the first
            for rows in (1, 2):  # requests: torch.compile makes a kernel for 1 row, one for more
                ones = torch.ones(rows, device=self.device)  # temperatures and keys
                self.backends.sample(logits[:1].repeat(rows, 1), ones, ones.long())
        torch.cuda.synchronize()

    # ---- host side: batch -> arrays (rank 0) --------------------------------------------------
    def prepare(self, batch: Batch) -> ForwardContext:
        """The batch as host arrays: seqs[i] computes num_new_tokens[i] tokens from position
        starts[i] (a decode: its newest token) and attends to every token up to them."""
        input_ids, positions = [], []
        for seq, start, num_new in zip(batch.seqs, batch.starts, batch.num_new_tokens):
            input_ids += seq.token_ids[start:start + num_new]
            positions += range(start, start + num_new)
        positions, block_tables = np.array(positions, np.int64), self.block_tables(batch.seqs)
        # (S,) each sequence's keys: the cached prefix plus the new tokens
        num_keys = np.add(batch.starts, batch.num_new_tokens)
        # each new token's slot, block_id * B + offset, the block from its sequence's table row
        block_index, offset = np.divmod(positions, self.block_size)  # (N,) each
        seq_index = np.repeat(np.arange(len(batch.seqs)), batch.num_new_tokens)  # (N,)
        new_slots = block_tables[seq_index, block_index] * self.block_size + offset.astype(np.int32)
        ctx = ForwardContext(is_prefill=batch.is_prefill, input_ids=np.array(input_ids, np.int64),
                             positions=positions, slot_mapping=new_slots, block_tables=block_tables)
        if batch.is_prefill:
            self._prepare_prefill(ctx, batch.num_new_tokens, num_keys)
        else:
            self._prepare_decode(ctx, num_keys)
        return ctx

    def _prepare_prefill(self, ctx: ForwardContext, num_new_tokens: list[int],
                         num_keys: np.ndarray) -> None:
        """A prefill's layout: where each sequence's new tokens and keys start, and every key's
        slot, as attention reads them all (prefix-cache hits and new tokens)."""
        ctx.cu_seqlens_q = np.cumsum([0, *num_new_tokens], dtype=np.int32)  # (S+1,)
        ctx.cu_seqlens_k = np.cumsum([0, *num_keys], dtype=np.int32)  # (S+1,)
        ctx.max_seqlen_q, ctx.max_seqlen_k = max(num_new_tokens), int(num_keys.max())
        # the slots of each sequence's blocks (S, width * B), of which the first num_keys of each
        # row (Nk,)
        block_slots = ctx.block_tables[:, :, None] * self.block_size + np.arange(self.block_size)
        block_slots = block_slots.reshape(len(num_keys), -1)
        ctx.context_slots = block_slots[np.arange(block_slots.shape[1]) < num_keys[:, None]]

    def _prepare_decode(self, ctx: ForwardContext, num_keys: np.ndarray) -> None:
        """A decode's layout: each row's keys, which the decode kernel reads through its block
        table; with cascade, from common_blocks_from rows on, the blocks every row shares."""
        ctx.context_lens, backends = num_keys.astype(np.int32), self.backends
        if backends.common_blocks is not None and len(num_keys) >= backends.common_blocks_from:
            ctx.num_common_blocks = backends.common_blocks(ctx.block_tables, ctx.context_lens)

    def block_tables(self, seqs: list[Sequence]) -> np.ndarray:
        table = np.full((len(seqs), max(len(seq.block_table) for seq in seqs)), -1, np.int32)
        for row, seq in zip(table, seqs):  # -1: no block; a row filled from a list converts fast
            row[:len(seq.block_table)] = seq.block_table
        return table  # (S, width)

    # ---- device side: arrays -> logits (every rank) -------------------------------------------
    def to_device(self, array: np.ndarray | Tensor | None) -> Tensor | None:
        """array on the device, copied without blocking the host (from pinned memory on CUDA);
        a tensor (a CUDA graph's buffer) is there already."""
        if array is None or isinstance(array, Tensor):
            return array  # on the CPU: nothing to copy
        cpu = self.device.type == "cpu"
        return torch.from_numpy(array) if cpu else pinned(array).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def forward(self, inputs: ForwardContext, input_ids: Tensor | None = None) -> Tensor | None:
        """Run the model on one batch; return logits (S, V) on rank 0, None on other ranks.
        input_ids: the batch's tokens already on the device (overlap), else inputs.input_ids."""
        num_seqs = len(inputs.cu_seqlens_q) - 1 if inputs.is_prefill else len(inputs.positions)
        input_ids = self.to_device(inputs.input_ids) if input_ids is None else input_ids
        if self.graphs is not None and self.graphs.can_replay(inputs):
            hidden = self.graphs.replay(inputs, input_ids)  # (graph size, hidden)
        else:
            with forward_context(ctx := self._context(inputs)):
                hidden = self.model(input_ids, ctx.positions)  # (N, hidden)
        # prefill computes logits at each sequence's last new token only; decode at every row
        rows = self.to_device(self._logits_rows(inputs.cu_seqlens_q)) if inputs.is_prefill else None
        logits = self.model.lm_head(hidden, rows)  # (rows, V) on rank 0
        return None if logits is None else logits[:num_seqs]

    def _context(self, inputs: ForwardContext) -> ForwardContext:
        """The batch layout on the device, for an eager forward pass."""
        return replace(inputs, **{name: self.to_device(array) for name, array in
                                  vars(inputs).items() if isinstance(array, np.ndarray)})

    def _logits_rows(self, cu_seqlens_q: np.ndarray) -> np.ndarray:
        """(rows,) int64: each sequence's last new token, where prefill computes logits. With
        CUDA graphs the last row repeats up to a captured size, so the LM head only meets GEMM
        shapes it has already run (see extensions/cuda_graphs.py)."""
        last = cu_seqlens_q[1:].astype(np.int64) - 1  # (S,)
        num_rows = graph_batch_size(len(last)) if len(last) <= self.max_graph_batch else len(last)
        return np.pad(last, (0, num_rows - len(last)), mode="edge")

    # ---- sampling (rank 0) --------------------------------------------------------------------
    @torch.inference_mode()
    def sample(self, logits: Tensor, seqs: list[Sequence], positions: list[int]) -> StepOutput:
        """A token for each row of logits: seqs[i]'s token at positions[i]."""
        masked = logits  # the extensions' hooks may mask them; after_sample sees the model's
        for ext in self.extensions:
            masked = ext.before_sample(masked, seqs)
        if all(seq.params.temperature == 0 for seq in seqs):  # every row greedy: nothing to draw
            token_ids = masked.argmax(-1)  # (S,) int64
        else:  # the draw decided by each row's key (kernels.sampling, or a backend's): a seeded
            # row's from its seed and the position of the token it samples, any other's at random
            random_keys = self.rng.integers(0, KEY_LIMIT, len(seqs)).tolist()
            keys = [key if seq.params.seed is None else sampling_key(seq.params.seed, position)
                    for seq, position, key in zip(seqs, positions, random_keys)]
            temperatures = np.array([seq.params.temperature for seq in seqs], np.float32)
            token_ids = self.backends.sample(masked, self.to_device(temperatures),
                                             self.to_device(np.array(keys, np.int64)))
        # on CUDA a copy into pinned memory, queued without waiting; on the CPU token_ids itself
        out = StepOutput(token_ids, token_ids.to("cpu", non_blocking=True))
        for ext in self.extensions:
            ext.after_sample(logits, token_ids, seqs, out)
        if self.device.type == "cuda":  # after every copy to the host
            out.copied = torch.cuda.current_stream().record_event()
        return out

    def run(self, batch: Batch, input_ids: Tensor | None = None) -> StepOutput:
        """One engine step on rank 0: every rank runs the forward pass, rank 0 samples. Returns
        without waiting for the GPU. input_ids: see forward."""
        inputs = self.prepare(batch)
        # each sequence samples the token after its last new token
        positions = [start + n for start, n in zip(batch.starts, batch.num_new_tokens)]
        if self.workers is None:
            return self.sample(self.forward(inputs, input_ids), batch.seqs, positions)
        self.workers.check()
        self.workers.call("forward", inputs)
        try:
            out = self.sample(self.forward(inputs), batch.seqs, positions)
            out.tolist()  # wait here, where a collective broken by a dying worker is recognised
            return out
        except RuntimeError:
            self.workers.check(PEER_EXIT_WAIT_SECONDS)  # a worker died: raise its error
            raise

    def shutdown(self) -> None:
        """Free every GPU tensor now, so a next engine in this process finds the memory free."""
        if self.workers is not None:
            self.workers.call("exit")
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        # the graphs go before the process group: they hold its NCCL all-reduces, and
        # destroying the group under them hangs the ranks
        del self.graphs, self.model, self.kv_cache
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.cuda.empty_cache()  # (nothing to do where CUDA never started)
