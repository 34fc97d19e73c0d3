"""extensions.prefill_graphs on the CPU: which prefills replay a graph, and the inputs they replay
with (the tokens and keys padded to a graph's size, the padded tokens writing the spare block).
CUDA graphs need a GPU (tests/test_gpu.py captures them); here each "graph" replays by running
the model eagerly on the graphs' buffers, what a capture records, so the padding, the choice of
size and the logits row meet the tiny random Qwen3 (conftest) and must give transformers' greedy
tokens."""
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import cdiv
from nanoserve.extensions import prefill_graphs
from nanoserve.layers import ForwardContext

NUM_TOKENS = 8  # each prefill's K/V is read by this many greedy decodes: transformers' first 8
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


class EagerGraph:
    """A stand-in for the CUDA graph of one size: replay() runs the forward pass that the capture
    would have recorded (PrefillGraphs.run), on the same buffers."""

    def __init__(self, graphs: prefill_graphs.PrefillGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs.run(self.size)


@pytest.fixture(params=[16384, 16], ids=["whole", "chunked"])
def llm(tiny_qwen3, monkeypatch, request):
    """An engine whose graph runner is PrefillGraphs, with no decode graphs and prefill graphs
    that replay eagerly; "chunked": 16 tokens a step, so a prompt's later chunks replay with its
    earlier chunks as cached keys."""
    monkeypatch.setattr(prefill_graphs.PrefillGraphs, "_capture_prefill",
                        lambda graphs, size: EagerGraph(graphs, size))
    monkeypatch.setattr(prefill_graphs, "FLASH_DTYPES", (torch.float32,))  # the CPU's dtype
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)  # no decode graph to pool
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    with LLM(tiny_qwen3, device="cpu", max_model_len=1024,
             max_num_batched_tokens=request.param) as llm:
        runner = llm.model_runner
        assert runner.graphs is None  # no graphs on the CPU: the test gives its own
        runner.graphs = prefill_graphs.PrefillGraphs(runner.model, 0, runner.max_blocks_per_seq,
                                                     runner.backends)
        yield llm


def test_lone_prompts_replay_and_match_transformers(llm, tiny_prompts, tiny_hf_outputs):
    """Two prompts one at a time, then again as prefix-cache hits (fewer new tokens than keys):
    every prefill replays, with transformers' greedy tokens; a batch of two runs eagerly."""
    graphs, step = llm.model_runner.graphs, llm.config.max_num_batched_tokens
    prompts, refs = tiny_prompts, [ref[:NUM_TOKENS] for ref in tiny_hf_outputs]  # GREEDY's
    for run in ("computed", "cached"):
        replays = graphs.num_replays
        outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts[:2]]
        assert [o["token_ids"] for o in outs] == refs[:2], run
        # a step per chunk of the prompt's uncached tokens (the prompts' shared start is cached
        # from the first prompt on), each a replay
        chunks = [cdiv(len(p) - o["num_cached_tokens"], step) for p, o in zip(prompts, outs)]
        assert graphs.num_replays - replays == sum(chunks), run
    assert all(o["num_cached_tokens"] > 0 for o in outs)
    replays = graphs.num_replays
    outs = llm.generate(prompts[2:4], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == refs[2:4]
    assert graphs.num_replays == replays or step < max(map(len, prompts[2:4]))  # chunks go alone


def test_what_fits_a_graph(llm):
    graphs, largest = llm.model_runner.graphs, prefill_graphs.GRAPH_TOKENS[-1]
    one = dict(is_prefill=True, slot_mapping=None, cu_seqlens_q=[0, 5])
    assert graphs.can_replay(ForwardContext(**one, context_slots=range(largest)))
    assert not graphs.can_replay(ForwardContext(**one, context_slots=range(largest + 1)))
    assert not graphs.can_replay(ForwardContext(is_prefill=True, slot_mapping=None,
                                                cu_seqlens_q=[0, 5, 9], context_slots=range(9)))
    # a decode: the decode graphs' (none here, max_batch 0)
    assert not graphs.can_replay(ForwardContext(is_prefill=False, slot_mapping=None,
                                                positions=[3]))
