"""Prefill graphs: a lone prompt's prefill replays a CUDA graph, as every decode step does.

A prefill step runs its layers eagerly, since it takes any number of tokens: about ten launches
per layer, each paid in host time, so a lone prompt's first step spends several times its GPU
work on the host, and that is most of a lone request's time to first token (docs/serving.md §7
measures both). Here a prefill of one sequence with at most GRAPH_TOKENS[-1] keys
(its cached prefix and its new tokens) replays the graph captured for the smallest size that
holds them: new tokens and keys padded to that size, the padded tokens writing the spare block
(slot -1) and read by no query (the sequence ends before them, by cu_seqlens). Batches of several
sequences, and longer prompts, run eagerly. Attaches at the model runner's forward pass
(`ModelRunner.forward`) with `prefill_graphs=True` (the default), on one GPU rank with CUDA graphs
(not enforce_eager).
"""
import torch
from torch import Tensor

from nanoserve.cuda_graphs import pinned
from nanoserve.layers import ForwardContext, forward_context
from nanoserve.llm_engine import LLMEngine
from nanoserve.model_runner import ModelRunner

GRAPH_TOKENS = [16, 32, 64] + list(range(128, 2049, 128))  # the key counts captured
FLASH_DTYPES = (torch.float16, torch.bfloat16)  # where prefill attention is FlashAttention's


class PrefillGraphs:
    def __init__(self, runner: ModelRunner) -> None:
        """Capture a graph per size in GRAPH_TOKENS, largest first, in the decode graphs' pool."""
        self.runner, self.eager_forward = runner, runner.forward
        n, int64 = GRAPH_TOKENS[-1], dict(dtype=torch.int64, device=runner.device)
        # static inputs that every graph reads, (n,) each; cu_seqlens (2,): one sequence
        self.buffers = {name: torch.zeros(n, **int64)
                        for name in ("input_ids", "positions", "context_slots")}
        self.buffers["slot_mapping"] = torch.full((n,), -1, dtype=torch.int32, device=runner.device)
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            self.buffers[name] = torch.tensor([0, n], dtype=torch.int32, device=runner.device)
        self.hidden = runner.model.lm_head.weight.new_zeros(n, runner.model.lm_head.weight.shape[1])
        self.num_replays = 0
        with torch.inference_mode():
            self.graphs = {size: self._capture(size) for size in reversed(GRAPH_TOKENS)}
        runner.forward = self.forward

    def _capture(self, size: int) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        self.buffers["cu_seqlens_q"][1] = self.buffers["cu_seqlens_k"][1] = size  # every row
        self.run(size)  # warm-up, not captured
        with torch.cuda.graph(graph, self.runner.graphs.pool):
            self.run(size)
        return graph

    def run(self, size: int) -> None:
        """The forward pass a graph of `size` holds: the first size rows of the buffers."""
        b = {name: buf if name.startswith("cu_") else buf[:size]
             for name, buf in self.buffers.items()}
        with forward_context(ForwardContext(is_prefill=True, max_seqlen_q=size, max_seqlen_k=size,
                                            **b)):
            self.hidden[:size] = self.runner.model(b["input_ids"], b["positions"])

    def fits(self, inputs: ForwardContext) -> bool:
        """A prefill of one sequence whose keys fit the largest graph."""
        return (inputs.is_prefill and len(inputs.cu_seqlens_q) == 2
                and len(inputs.context_slots) <= GRAPH_TOKENS[-1])

    @torch.inference_mode()
    def forward(self, inputs: ForwardContext, input_ids: Tensor | None = None) -> Tensor | None:
        """ModelRunner.forward: logits (1, V) from a graph when inputs fits one, else eagerly."""
        if not self.fits(inputs):
            return self.eager_forward(inputs, input_ids)
        buf, n = self.buffers, len(inputs.positions)  # n new tokens
        size = next(s for s in GRAPH_TOKENS if s >= len(inputs.context_slots))
        # straight into the buffers, as DecodeGraphs.replay copies (from pinned memory on CUDA)
        host = pinned if self.runner.device.type == "cuda" else torch.from_numpy
        for name in ("positions", "slot_mapping", "context_slots", "cu_seqlens_q", "cu_seqlens_k"):
            array = getattr(inputs, name)
            buf[name][:len(array)].copy_(host(array), non_blocking=True)
        buf["input_ids"][:n].copy_(host(inputs.input_ids) if input_ids is None else input_ids,
                                   non_blocking=True)
        buf["slot_mapping"][n:size].fill_(-1)  # padded tokens write the spare block
        self.graphs[size].replay()
        self.num_replays += 1
        # logits at the last new token only: (1, V), the LM head's shape of a one-sequence decode
        return self.runner.model.lm_head(self.hidden[n - 1:n])


def attach(engine: LLMEngine) -> PrefillGraphs | None:
    """None with tensor parallelism (graphs captured by rank 0 alone would hold all-reduces the
    other ranks never join), in float32 (its prefill attention, the torch reference, reads
    cu_seqlens on the host) and with batch_invariant (its own prefill attention, eager)."""
    runner, config = engine.model_runner, engine.model_runner.config
    if (engine.workers is not None or config.torch_dtype not in FLASH_DTYPES
            or config.batch_invariant):
        return None
    return PrefillGraphs(runner)
