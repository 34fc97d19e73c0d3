"""CUDA graphs for decode: one captured forward pass per batch size, replayed every decode step.

A decode step launches ~10 kernels per layer, each small; launched one by one from Python the host
is slower than the GPU. A CUDA graph records the whole forward once per batch size and replays it
with a single launch. A graph reads and writes fixed buffers, so replay copies the batch into them
first; a batch of S sequences replays the smallest captured size >= S, its padded rows writing
into the KV cache's spare block (slot -1) and attending to nothing (context 0).
The LM head runs outside the graphs, but only at captured sizes (model_runner.GRAPH_BATCH_SIZES,
which its logits rows are padded to), all run once at capture: a GEMM shape cuBLAS meets for the
first time loads a kernel lazily, which stalls the host.
The graph runner, one of the backends the model runner chooses when it is built: on the GPU, not
with enforce_eager. It calls two verbs, `can_replay(inputs)`, then `replay(inputs, input_ids)`.
A prefill runs eagerly here; extensions.prefill_graphs' runner, a DecodeGraphs that also replays
lone prompts, is the other.
"""
import torch
from torch import Tensor

from nanoserve.layers import Backends, ForwardContext, forward_context
from nanoserve.model_runner import GRAPH_BATCH_SIZES, graph_batch_size, pinned
from nanoserve.models import DecoderModel


class DecodeGraphs:
    def __init__(self, model: DecoderModel, max_batch: int, max_blocks_per_seq: int,
                 backends: Backends) -> None:
        """Capture a graph for every size up to max_batch, and one with cascade attention's
        shared prefix too at the sizes where the backends look for one; all share one memory
        pool."""
        self.model, self.max_batch = model, max_batch
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
        hidden = b.pop("hidden")  # the output; the other buffers are the inputs
        b["num_common_blocks"] = b["num_common_blocks"] if shared else None  # None: not looked for
        graph = torch.cuda.CUDAGraph()
        with forward_context(ForwardContext(is_prefill=False, **b)):
            hidden[:] = self.model(b["input_ids"], b["positions"])  # warm-up, not captured
            with torch.cuda.graph(graph, self.pool):
                hidden[:] = self.model(b["input_ids"], b["positions"])
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


graph_runner = DecodeGraphs  # what the model runner builds, without prefill_graphs
