"""Several answers to one prompt (extensions/samples.py): n, best_of and beam search, on the CPU.

n greedy samples are n copies; seeded samples keep their tokens in any batch; best_of returns the
likeliest; beam search gives transformers' beams; the samples share the prompt's blocks, and every
block is back in the pool after finish, abort and preemption."""
from dataclasses import replace

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.extensions.samples import BeamSearchParams, sample_params

SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=12, n=4)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, device="cpu", max_model_len=512) as llm:
        yield llm


def ids(outs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outs]


def all_blocks_free(llm: LLM) -> bool:
    manager = llm.scheduler.block_manager
    return (manager.num_free_blocks == len(manager.blocks)
            and all(b.ref_count == 0 for b in manager.blocks))


def test_greedy_samples_are_copies_and_seeded_ones_keep_their_tokens_in_any_batch(llm, prompts):
    """A prompt alone with n=1 (greedy, and seeded: sample 0's seed), then with n > 1 alone, then
    mixed into batches: the greedy samples are copies, the seeded ones keep their tokens."""
    greedy, one = (SamplingParams(temperature=t, seed=11, max_tokens=12) for t in (0, 1.0))
    alone = ids(llm.generate(prompts[:1] * 2, [greedy, one], use_tqdm=False))
    copies, seeded = (ids(out) for out in llm.generate(
        prompts[:1] * 2, [replace(greedy, n=3), SEEDED], use_tqdm=False))
    assert copies == [alone[0]] * 3 and seeded[0] == alone[1]  # sample 0 is the n=1 answer
    assert len(set(map(tuple, seeded))) > 1  # four seeds: the samples differ
    mixed = llm.generate(prompts[1:4] + prompts[:1], [greedy] * 3 + [SEEDED], use_tqdm=False)
    assert ids(mixed[3]) == seeded
    assert all_blocks_free(llm)


def test_best_of_returns_the_likeliest_samples(llm, prompts):
    """best_of=4, n=2: of the four samples that n=4 gives (the same seeds), the two with the
    highest sum of their tokens' logprobs, likeliest first."""
    best = llm.generate(prompts[:1], SamplingParams(temperature=1.0, seed=5, max_tokens=10, n=2,
                                                    best_of=4), use_tqdm=False)[0]
    every = llm.generate(prompts[:1], SamplingParams(temperature=1.0, seed=5, max_tokens=10, n=4,
                                                     logprobs=0), use_tqdm=False)[0]
    sums = [sum(lp[t] for lp, t in zip(s["logprobs"], s["token_ids"])) for s in every]
    order = sorted(range(4), key=lambda i: -sums[i])
    assert ids(best) == [every[i]["token_ids"] for i in order[:2]]
    assert [b["cumulative_logprob"] for b in best] == pytest.approx([sums[i] for i in order[:2]])
    assert "logprobs" not in best[0]  # asked for ranking only
    with pytest.raises(ValueError, match="best_of must be"):
        llm.generate(prompts[:1], SamplingParams(n=3, best_of=2))
    with pytest.raises(ValueError, match="n > 1: generate"):
        llm.add_request(prompts[0], SamplingParams(n=2))


# by default two prompts at beam width 2; the slow tail the six prompts at widths 2 and 4
@pytest.mark.parametrize("width, num_prompts", [
    (2, 2), pytest.param(2, 6, marks=pytest.mark.slow), pytest.param(4, 6, marks=pytest.mark.slow)])
def test_beam_search_matches_transformers(llm, hf_model, prompts, width, num_prompts):
    """Chat prompts' beams against transformers' generate(num_beams=width, do_sample=False,
    length_penalty=1.0, early_stopping=False): the same beams, best first."""
    params = BeamSearchParams(beam_width=width, max_tokens=16)
    ours = llm.beam_search(prompts[:num_prompts], params)
    for prompt, beams in zip(prompts[:num_prompts], ours):
        with torch.no_grad():
            theirs = hf_model.generate(torch.tensor([prompt]), num_beams=width, do_sample=False,
                                       num_return_sequences=width, max_new_tokens=16,
                                       length_penalty=1.0, early_stopping=False)
        assert [b["token_ids"] for b in beams] == [unpadded(row[len(prompt):].tolist())
                                                   for row in theirs]
        assert [b["score"] for b in beams] == sorted((b["score"] for b in beams), reverse=True)
    assert all_blocks_free(llm)


def test_samples_share_the_prompts_blocks(tiny_qwen3):
    """n = 8 samples of 64 tokens on a 1,000-token prompt (a tiny random model: the blocks do not
    depend on it) hold the prompt's full blocks once (peak blocks in use, read from the block
    manager), each sample at most one block beyond its own output; 8 separate requests without
    prefix caching hold the prompt 8 times. Every block is free after finish, abort and
    preemption, and a preempted sample recomputes the same tokens."""
    prompt, outs = [t % 997 for t in range(1000)], 64
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=outs, ignore_eos=True, n=8)
    peaks = {}
    for caching in (True, False):
        with LLM(tiny_qwen3, device="cpu", max_model_len=1536, enable_prefix_caching=caching,
                 max_num_batched_tokens=2048) as llm:
            manager, peak = llm.scheduler.block_manager, 0
            seqs = [llm.add_request(prompt, p) for p in sample_params(params)]
            while llm.has_unfinished():
                llm.step()
                peak = max(peak, len(manager.blocks) - manager.num_free_blocks)
            peaks[caching] = peak
            assert all(s.num_output_tokens == outs for s in seqs) and all_blocks_free(llm)
            seqs = [llm.add_request(prompt, p) for p in sample_params(params)]
            for _ in range(3):
                llm.step()
            for seq in seqs:  # abort part-way
                llm.abort_request(seq)
            llm.loop.finish()
            assert all_blocks_free(llm)
    full, own = 1000 // 16, -(-(1000 % 16 + outs) // 16)  # the prompt's full blocks; a sample's
    assert peaks[True] <= full + 8 * (own + 1) and peaks[False] >= 8 * (full + own)
    small = dict(max_model_len=512, num_kvcache_blocks=40)  # 8 samples need about 8 * 11
    runs = {}
    for name, settings in {"preempted": small, "not": dict(max_model_len=512)}.items():
        with LLM(tiny_qwen3, device="cpu", **settings) as llm:
            runs[name] = ids(llm.generate([prompt[:100]], replace(params, max_tokens=64),
                                          use_tqdm=False)[0])
            assert (llm.scheduler.num_preemptions > 0) == (name == "preempted")
            assert all_blocks_free(llm)
    assert runs["preempted"] == runs["not"]


def unpadded(row: list[int], pad: int = 2) -> list[int]:
    """A transformers beam without the padding after its EOS (the default model pads with EOS)."""
    while len(row) > 1 and row[-1] == row[-2] == pad:
        row = row[:-1]
    return row
