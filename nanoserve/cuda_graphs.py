"""CUDA graphs for decode: one captured forward pass per batch size, replayed every decode step.

A decode step launches ~10 kernels per layer, each small; launched one by one from Python the host
is slower than the GPU. A CUDA graph records the whole forward once per batch size and replays it
with a single launch. A graph reads and writes fixed buffers, so replay copies the batch into them
first; a batch of S sequences replays the smallest captured size >= S, its padded rows writing
into the KV cache's spare block (slot -1) and attending to nothing (context 0).
The LM head runs outside the graphs, but only at captured sizes, all run once at capture: a GEMM
shape cuBLAS meets for the first time loads a kernel lazily, which stalls the host.
Owned and called by model_runner on the GPU (not with enforce_eager), through the graph runner's
two verbs: `can_replay(inputs)`, then `replay(inputs, input_ids)`. A prefill runs eagerly here;
extensions.prefill_graphs' runner, a DecodeGraphs that also replays lone prompts, is the other.
"""
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from nanoserve.layers import Backends, ForwardContext, forward_context
from nanoserve.models import DecoderModel

GRAPH_BATCH_SIZES = [1, 2, 4, 8] + list(range(16, 513, 16))  # decode batch sizes captured


def graph_batch_size(num_seqs: int) -> int:
    """The captured size for num_seqs sequences: the smallest that holds them, else the largest."""
    return next((b for b in GRAPH_BATCH_SIZES if b >= num_seqs), GRAPH_BATCH_SIZES[-1])


def pinned(array: np.ndarray) -> Tensor:
    """array in pinned host memory: a copy from there to the GPU is queued and returns at once,
    while one from pageable memory waits for every queued kernel, stalling the host."""
    return torch.from_numpy(array).pin_memory()


class DecodeGraphs:
    def __init__(self, model: DecoderModel, max_batch: int, max_blocks_per_seq: int,
                 make_context: Callable[[ForwardContext], ForwardContext],
                 backends: Backends) -> None:
        """Capture a graph for every size up to max_batch, and one with cascade attention's
        shared prefix too at the sizes where the backends look for one; all share one memory
        pool. make_context: the model runner's, which builds every context."""
        self.model, self.make_context, self.max_batch = model, make_context, max_batch
        self.buffers = {  # static inputs and output that every graph reads and writes
            "input_ids": torch.zeros(max_batch, dtype=torch.int64),
            "positions": torch.zeros(max_batch, dtype=torch.int64),
            "slot_mapping": torch.full((max_batch,), -1, dtype=torch.int32),
            "context_lens": torch.zeros(max_batch, dtype=torch.int32),
            "block_tables": torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32),
            "num_common_blocks": torch.zeros(1, dtype=torch.int32),
            "hidden": model.lm_head.weight.new_zeros(max_batch, model.lm_head.weight.shape[1])}
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (size, shared) -> graph
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool that all graphs share
        # largest first: the smaller ones reuse its memory
        for bs in reversed([b for b in GRAPH_BATCH_SIZES if b <= max_batch]):
            for shared in {False, backends.common_blocks is not None
                           and bs >= backends.common_blocks_from}:
                self.graphs[bs, shared] = self._capture(bs, shared)
            model.lm_head(self.buffers["hidden"][:bs])  # load the LM head's GEMM kernel now
        torch.cuda.synchronize()

    def _capture(self, bs: int, shared: bool) -> torch.cuda.CUDAGraph:
        b = {name: buf[:bs] for name, buf in self.buffers.items()}  # num_common_blocks: (1,)
        inputs = {name: b[name] for name in b if name != "hidden"}  # every buffer but hidden
        if not shared:  # the plain decode: no shared prefix looked for
            inputs["num_common_blocks"] = None
        graph = torch.cuda.CUDAGraph()
        with forward_context(self.make_context(ForwardContext(is_prefill=False, **inputs))):
            b["hidden"][:] = self.model(b["input_ids"], b["positions"])  # warm-up, not captured
            with torch.cuda.graph(graph, self.pool):
                b["hidden"][:] = self.model(b["input_ids"], b["positions"])
        return graph

    def can_replay(self, inputs: ForwardContext) -> bool:
        """A decode batch that fits a captured graph."""
        return not inputs.is_prefill and len(inputs.positions) <= self.max_batch

    def replay(self, inputs: ForwardContext, input_ids: Tensor) -> Tensor:
        """Run the decode forward of inputs; returns (graph size, hidden), padded rows included."""
        bs, buf = len(inputs.positions), self.buffers
        graph_bs = graph_batch_size(bs)
        buf["input_ids"][:bs].copy_(input_ids)
        for name in ("positions", "slot_mapping", "context_lens"):
            buf[name][:bs].copy_(pinned(getattr(inputs, name)), non_blocking=True)
        buf["slot_mapping"][bs:graph_bs].fill_(-1)  # padded rows write the spare block...
        buf["context_lens"][bs:graph_bs].zero_()  # ...and attend to nothing
        width = inputs.block_tables.shape[1]
        buf["block_tables"][:bs, :width].copy_(pinned(inputs.block_tables), non_blocking=True)
        # the blocks all sequences share (None: not looked for); read by cascade graphs only
        shared = 0 if inputs.num_common_blocks is None else int(inputs.num_common_blocks[0])
        if shared:
            buf["num_common_blocks"].fill_(shared)
        # the cascade graph only when blocks are shared: else its prefix kernel runs for nothing
        self.graphs[graph_bs, shared > 0].replay()
        return buf["hidden"][:graph_bs]
