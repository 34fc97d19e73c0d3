"""Speculative decoding (extensions/speculative.py): n-gram proposals, verified in one step.

Greedy output identical to transformers with speculation on; seeded output identical on and off;
unseeded sampling keeps the plain sampler's distribution (a chi-square test); and the rest holds
with it: preemption, chunked prefill, prefix caching, stop tokens and strings inside an accepted
run, max_tokens, logprobs, streaming, abort, the blocks of rejected drafts given back."""
import itertools
from collections import Counter

import pytest
import torch
from test_e2e import GREEDY

from nanoserve import LLM, SamplingParams
from nanoserve.config import cdiv
from nanoserve.extensions import speculative
from nanoserve.extensions.overlap import OverlapLoop
from nanoserve.extensions.speculative import NgramIndex

# engines on the GPU that take most of its memory: in one pytest-xdist worker, one after another
pytestmark = pytest.mark.xdist_group(name="gpu_memory")

# On a GPU, speculation keeps a request's tokens with batch_invariant=True (the README's claim):
# every engine here runs with it there, and compares with the engine's own greedy tokens without
# speculation, not transformers' float32 ones, from which bf16 parts at near-ties
ON_GPU = dict(batch_invariant=True) if torch.cuda.is_available() else {}
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, **ON_GPU)
PASSAGE = ("The library opens at nine in the morning and closes at six in the evening. Visitors "
           "may borrow up to five books at a time, and each loan lasts three weeks.")


@pytest.fixture(scope="module")
def editing(model_dir) -> list[list[int]]:
    """Chat prompts whose answers repeat their own text: proposals are accepted."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    asks = [f"Repeat the following paragraph exactly:\n\n{PASSAGE}",
            f"Copy this text word for word:\n\n{PASSAGE}",
            "Correct the spelling and write the sentence again: Teh weather was beautifull and we "
            "walkd to the beech."]
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) for q in asks]


def token_ids(outs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outs]


@pytest.fixture(scope="module")
def greedy_reference(request, model_dir, prompts) -> list[list[int]]:
    """transformers' greedy tokens of the chat prompts (conftest's hf_outputs); on a GPU the
    engine's own without speculation (ON_GPU)."""
    if not ON_GPU:
        return request.getfixturevalue("hf_outputs")
    with LLM(model_dir, overlap_scheduling=False, **ON_GPU) as llm:
        return token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))


def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex(1, 3)
    assert index.propose([1, 2, 3], 4) == []  # no earlier occurrence of any suffix
    # suffix [5, 6] occurs twice earlier; the latest one is followed by 9, 1
    assert index.propose([5, 6, 7, 5, 6, 9, 1, 5, 6], 2) == [9, 1]
    index = NgramIndex(1, 3)
    # the 3-gram [1, 2, 3] beats the later 1-gram [3]
    assert index.propose([1, 2, 3, 4, 4, 3, 8, 1, 2, 3], 3) == [4, 4, 3]
    tokens = [1, 2, 3, 4, 4, 3, 8, 1, 2, 3]
    index = NgramIndex(2, 2)
    assert index.propose(tokens, 5) == [4, 4, 3, 8, 1]
    tokens += [4, 9, 2, 3]  # grown: only the new n-grams are indexed, the latest match wins
    assert index.propose(tokens, 2) == [4, 9]


def test_greedy_matches_transformers_with_speculation(model_dir, prompts, greedy_reference):
    with LLM(model_dir, **SPEC) as llm:
        assert isinstance(llm.loop, speculative.SpeculativeLoop)
        assert isinstance(llm.loop.fallback, OverlapLoop)  # it runs the steps without drafts
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.loop.stats
    assert token_ids(outs) == greedy_reference
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0


def test_editing_prompts_accept_drafts_and_keep_their_tokens(model_dir, editing):
    params = SamplingParams(temperature=0, max_tokens=40)
    with LLM(model_dir, overlap_scheduling=False, **ON_GPU) as llm:
        off = token_ids(llm.generate(editing, params, use_tqdm=False))
    with LLM(model_dir, max_num_seqs=1, timeline=True, **SPEC) as llm:
        on = token_ids(llm.generate(editing, params, use_tqdm=False))
        stats, steps = llm.loop.stats, llm.timeline.steps
    assert on == off
    assert stats.mean_accepted_length > 2  # more than two tokens a step where drafts were made
    # the timeline: a decode step of one sequence kept several tokens, and computed its drafts
    decodes = [s for s in steps if not s.is_prefill]
    assert max(s.num_sampled for s in decodes) > 2 and max(s.num_tokens for s in decodes) == 5
    assert sum(s.num_sampled for s in decodes) + len(editing) == sum(map(len, on))


@pytest.mark.slow  # its tokens: test_greedy_matches_transformers_with_speculation's promise
def test_a_large_batch_that_proposes_nothing_runs_overlapped(model_dir, prompts, greedy_reference,
                                                             monkeypatch):
    """Past SMALL_BATCH sequences, a decode without drafts hands PROBE_EVERY steps to the overlap
    loop; the tokens do not change."""
    monkeypatch.setattr(speculative, "SMALL_BATCH", 1)
    with LLM(model_dir, **SPEC) as llm:
        fallback, calls = llm.loop.fallback, []
        step = fallback.step
        fallback.step = lambda: calls.append(fallback.ahead) or step()
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outs) == greedy_reference
    assert len(calls) > 10 and any(ahead is not None for ahead in calls)  # overlapped steps


def near_ties(a: list[list[int]], b: list[list[int]]) -> int:
    """Outputs that differ; each is printed (a near-tie between two batch shapes' rounding)."""
    differ = [(x, y) for x, y in zip(a, b) if x != y]
    for x, y in differ:
        print("differs:", x, y)
    return len(differ)


def test_seeded_and_greedy_outputs_are_the_same_on_and_off(model_dir, prompts, editing):
    chats = prompts[:3] + editing  # each seeded, then each greedy, the whole twice in one batch
    params = ([SamplingParams(temperature=0.8, seed=100 + i, max_tokens=16)
               for i in range(len(chats))] + [SamplingParams(temperature=0, max_tokens=16)] *
              len(chats))
    with LLM(model_dir, overlap_scheduling=False, **ON_GPU) as llm:
        off = token_ids(llm.generate(chats * 2, params, use_tqdm=False))
    # one draft a step: the other tests here run the default, 4
    with LLM(model_dir, speculative_method="ngram", num_speculative_tokens=1, **ON_GPU) as llm:
        on = token_ids(llm.generate(chats * 2, params, use_tqdm=False))
    assert near_ties(on, off) == 0


def chi_square_pvalue(table: list[list[int]]) -> float:
    """Pearson's chi-square test that the rows of a contingency table (counts of the same outcomes
    in two samples) come from one distribution: the p-value."""
    t = torch.tensor(table, dtype=torch.float64)
    expected = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    statistic = ((t - expected) ** 2 / expected).sum()
    dof = (t.shape[0] - 1) * (t.shape[1] - 1)  # Q(dof / 2, statistic / 2): chi2's survival
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         statistic / 2))


# the slow tail: by default, seeded draws equal on and off check the sampler
@pytest.mark.slow
def test_unseeded_sampling_keeps_the_distribution(model_dir):
    """The first three tokens of 400 unseeded samples of a prompt that repeats itself (drafts are
    proposed at every step and often rejected): the same distribution with speculation on and
    off, by a chi-square test of the two samples. 400: one batch (max_num_seqs 512) each."""
    prompt = [504, 3575, 282, 1048] * 4
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    counts = {}
    for spec in ({}, dict(SPEC, prompt_lookup_min=1)):
        with LLM(model_dir, overlap_scheduling=False, max_model_len=64, **spec) as llm:
            outs = llm.generate([prompt] * 400, params, use_tqdm=False)
            if spec:
                stats = llm.loop.stats
        counts[bool(spec)] = Counter(tuple(o["token_ids"]) for o in outs)
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    support = sorted(set(counts[False]) | set(counts[True]))
    table = [[counts[on][s] for s in support] for on in (False, True)]
    assert len(support) > 3  # more than one outcome to compare
    assert chi_square_pvalue(table) > 1e-3


# the slow tail (as the two below): test_e2e.py checks each without speculation by default
@pytest.mark.slow
def test_preemption_chunked_prefill_and_prefix_caching(model_dir, prompts, greedy_reference):
    with LLM(model_dir, max_model_len=192, num_kvcache_blocks=12, **SPEC) as llm:
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == greedy_reference
        assert llm.scheduler.num_preemptions > 0
    with LLM(model_dir, max_num_batched_tokens=16, **SPEC) as llm:
        assert token_ids(llm.generate(prompts[:3], GREEDY, use_tqdm=False)) == greedy_reference[:3]
        # a second run hits the first's blocks: only accepted tokens were hashed into them
        again = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert token_ids(again) == greedy_reference[:3]
    assert all(o["num_cached_tokens"] > 0 for o in again)


@pytest.mark.slow
def test_stops_and_max_tokens_inside_an_accepted_run(model_dir, editing):
    with LLM(model_dir, overlap_scheduling=False, **ON_GPU) as llm:
        full = llm.generate(editing[:1], SamplingParams(temperature=0, max_tokens=48),
                            use_tqdm=False)[0]
        ids, text = full["token_ids"], full["text"]
        cases = [SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[ids[20]]),
                 SamplingParams(temperature=0, max_tokens=48, stop=[text[40:46]]),
                 SamplingParams(temperature=0, max_tokens=23)]
        off = llm.generate(editing[:1] * 3, cases, use_tqdm=False)
    with LLM(model_dir, max_num_seqs=1, **SPEC) as llm:
        on = llm.generate(editing[:1] * 3, cases, use_tqdm=False)
        assert llm.loop.stats.num_accepted_tokens > 0
    assert [(o["token_ids"], o["text"], o["finish_reason"]) for o in on] == \
        [(o["token_ids"], o["text"], o["finish_reason"]) for o in off]
    assert [o["finish_reason"] for o in on] == ["stop", "stop", "length"]
    assert len(on[0]["token_ids"]) <= 21 and len(on[2]["token_ids"]) == 23


@pytest.mark.slow
def test_logprobs_for_every_emitted_token(model_dir, editing):
    params = SamplingParams(temperature=0, max_tokens=32, logprobs=2)
    outs = {}
    for spec in ({}, SPEC):
        with LLM(model_dir, overlap_scheduling=False, max_num_seqs=1, **{**ON_GPU, **spec}) as llm:
            outs[bool(spec)] = llm.generate(editing[:2], params, use_tqdm=False)
    for on, off in zip(outs[True], outs[False]):
        assert on["token_ids"] == off["token_ids"]
        assert len(on["logprobs"]) == len(on["token_ids"])
        for token, a, b in zip(on["token_ids"], on["logprobs"], off["logprobs"]):
            assert a.keys() == b.keys() and token in a
            assert all(abs(a[t] - b[t]) < 1e-3 for t in a)


def test_streaming_and_abort_with_speculation(model_dir, editing):
    params = SamplingParams(temperature=0, max_tokens=32)
    with LLM(model_dir, **SPEC) as llm:
        whole = llm.generate(editing[:1], params, use_tqdm=False)[0]
        deltas = list(llm.stream(editing[0], params))
        assert "".join(d.text for d in deltas) == whole["text"]
        assert list(itertools.chain(*(d.token_ids for d in deltas))) == whole["token_ids"]
        assert max(len(d.token_ids) for d in deltas) > 1  # a step emitted several tokens
        bm = llm.scheduler.block_manager
        seq = llm.add_request(editing[0], params, stream=True)
        for _ in range(4):
            llm.stream_step()
            if not seq.is_finished:  # the blocks of rejected drafts went back after the step
                assert len(seq.block_table) == cdiv(seq.num_tokens, bm.block_size)
        llm.abort_request(seq)
        assert not llm.has_unfinished() and bm.num_free_blocks == len(bm.blocks)


def test_speculative_settings_are_checked(model_dir):
    with pytest.raises(ValueError, match="speculative_method"):
        LLM(model_dir, speculative_method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model_dir, speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        LLM(model_dir, speculative_method="ngram", prompt_lookup_min=5, prompt_lookup_max=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_same_bits_on_and_off_on_the_gpu(model_dir, prompts, editing, dtype):
    """The README's claim on a GPU: with batch_invariant=True, the chat and edit prompts' greedy
    and seeded outputs are bitwise the same with speculation on and off, logprobs too."""
    chats = prompts + editing
    params = ([SamplingParams(temperature=0.8, seed=i, max_tokens=64, logprobs=2)
               for i in range(len(chats))]
              + [SamplingParams(temperature=0, max_tokens=64, logprobs=2)] * len(chats))
    outs = {}
    for spec in ({}, SPEC):
        with LLM(model_dir, dtype=dtype, **{**ON_GPU, **spec}) as llm:
            outs[bool(spec)] = [(o["token_ids"], o["logprobs"])
                                for o in llm.generate(chats * 2, params, use_tqdm=False)]
            if spec:
                assert llm.loop.stats.num_accepted_tokens > 0
    assert outs[True] == outs[False]
