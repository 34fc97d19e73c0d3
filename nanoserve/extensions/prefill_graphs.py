"""Prefill graphs: a lone prompt's prefill replays a CUDA graph, as every decode step does.

A prefill step runs its layers eagerly, since it takes any number of tokens: about ten launches
per layer, each paid in host time, so a lone prompt's first step spends several times its GPU
work on the host, and that is most of a lone request's time to first token (docs/serving.md §7
measures both). Here a prefill of one sequence with at most GRAPH_TOKENS[-1] keys
(its cached prefix and its new tokens) replays the graph captured for the smallest size that
holds them: new tokens and keys padded to that size, the padded tokens writing the spare block
(slot -1) and read by no query (the sequence ends before them, by cu_seqlens). Batches of several
sequences, and longer prompts, run eagerly. A graph runner (a backend the model runner chooses):
extensions.cuda_graphs' DecodeGraphs that replays these prefills too, chosen with
`prefill_graphs=True` (the default) on one GPU rank with CUDA graphs (not enforce_eager), not with
batch_invariant (its own prefill attention, eager). In float32 it captures no prefill (its
prefill attention, the torch reference, reads cu_seqlens on the host).
"""
import torch
from torch import Tensor

from nanoserve.extensions.cuda_graphs import DecodeGraphs
from nanoserve.layers import Backends, ForwardContext, forward_context
from nanoserve.model_runner import pinned
from nanoserve.models import DecoderModel

GRAPH_TOKENS = [16, 32, 64] + list(range(128, 2049, 128))  # the key counts captured
FLASH_DTYPES = (torch.float16, torch.bfloat16)  # where prefill attention is FlashAttention's


class PrefillGraphs(DecodeGraphs):
    def __init__(self, model: DecoderModel, max_batch: int, max_blocks_per_seq: int,
                 backends: Backends) -> None:
        """The decode graphs, then a prefill graph per size in GRAPH_TOKENS, largest first, in
        their pool."""
        super().__init__(model, max_batch, max_blocks_per_seq, backends)
        weight = model.lm_head.weight
        n, int64 = GRAPH_TOKENS[-1], dict(dtype=torch.int64, device=weight.device)
        # static inputs that every graph reads, (n,) each; cu_seqlens (2,): one sequence
        self.prefill_buffers = {name: torch.zeros(n, **int64)
                                for name in ("input_ids", "positions", "context_slots")}
        self.prefill_buffers["slot_mapping"] = torch.full((n,), -1, dtype=torch.int32,
                                                          device=weight.device)
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            self.prefill_buffers[name] = torch.tensor([0, n], dtype=torch.int32,
                                                      device=weight.device)
        self.hidden = weight.new_zeros(n, weight.shape[1])
        self.num_replays = 0
        sizes = GRAPH_TOKENS if weight.dtype in FLASH_DTYPES else []
        self.prefill_graphs = {size: self._capture_prefill(size) for size in reversed(sizes)}

    def _capture_prefill(self, size: int) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        self.prefill_buffers["cu_seqlens_q"][1] = self.prefill_buffers["cu_seqlens_k"][1] = size
        self.run(size)  # warm-up, not captured
        with torch.cuda.graph(graph, self.pool):
            self.run(size)
        return graph

    def run(self, size: int) -> None:
        """The forward pass a graph of `size` holds: the first size rows of the buffers."""
        b = {name: buf if name.startswith("cu_") else buf[:size]
             for name, buf in self.prefill_buffers.items()}
        with forward_context(ForwardContext(is_prefill=True, max_seqlen_q=size, max_seqlen_k=size,
                                            **b)):
            self.hidden[:size] = self.model(b["input_ids"], b["positions"])

    def can_replay(self, inputs: ForwardContext) -> bool:
        """A decode batch that fits a decode graph, or a prefill of one sequence whose keys fit
        the largest prefill graph."""
        if not inputs.is_prefill:
            return super().can_replay(inputs)
        return (len(inputs.cu_seqlens_q) == 2 and bool(self.prefill_graphs)
                and len(inputs.context_slots) <= GRAPH_TOKENS[-1])

    def replay(self, inputs: ForwardContext, input_ids: Tensor) -> Tensor:
        """Run the forward of inputs; returns (graph size, hidden), padded rows included."""
        if not inputs.is_prefill:
            return super().replay(inputs, input_ids)
        buf, n = self.prefill_buffers, len(inputs.positions)  # n new tokens
        size = next(s for s in GRAPH_TOKENS if s >= len(inputs.context_slots))
        # straight into the buffers, as the decode graphs' replay copies (from pinned memory on
        # CUDA; tests/test_prefill_graphs.py replays on the CPU)
        host = pinned if self.hidden.is_cuda else torch.from_numpy
        for name in ("positions", "slot_mapping", "context_slots", "cu_seqlens_q", "cu_seqlens_k"):
            array = getattr(inputs, name)
            buf[name][:len(array)].copy_(host(array), non_blocking=True)
        buf["input_ids"][:n].copy_(input_ids)
        buf["slot_mapping"][n:size].fill_(-1)  # padded tokens write the spare block
        self.prefill_graphs[size].replay()
        self.num_replays += 1
        return self.hidden[:size]


graph_runner = PrefillGraphs  # what the model runner builds, with prefill_graphs=True
