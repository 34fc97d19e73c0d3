"""On an NVIDIA GPU: nanoserve against transformers with the same random weights (Qwen3 and Llama
shapes), comparing per-step logprobs the way vLLM's check_logprobs_close does (equal tokens until
the first near-tie, logprobs within a tolerance); CUDA-graph decode against eager decode;
prefix-cache hit against no hit; with batch_invariant=True, bitwise the same tokens and logprobs
in any batch, chunking, preemption and with speculation (and, as the negative control, not without
it). Skipped on machines without CUDA."""
import gc
import itertools
import os
import re

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

from nanoserve import LLM, SamplingParams
from nanoserve.extensions.stats import scheduler_stats

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

VOCAB = 8192
MAX_TOKENS = 24
# nats: bf16 rounding differs between the engines and grows over steps; a bug costs several
LOGPROB_TOL = 0.5
# nanoserve against itself: split counts, padding, chunking, TP reductions and cascade attention
# change only the bf16 rounding (up to ~0.15: cascade vs plain decode, 40 seqs, qwen3 shape)
SAME_ENGINE_TOL = 0.25
# nats: an fp8 KV cache against bf16's, mean over agreeing tokens (measured: docs/fp8_cache.md,
# Accuracy); a bug costs whole nats
FP8_MEAN_LOGPROB_TOL = 0.4
SHAPES = {
    "qwen3": lambda: Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 vocab_size=VOCAB, tie_word_embeddings=True,
                                 max_position_embeddings=4096, rope_theta=1e6,
                                 initializer_range=0.1, architectures=["Qwen3ForCausalLM"]),
    # SmolLM2's head layout: 3 KV heads x 64 = 192 values a token, not a power of two
    "llama": lambda: LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                                 num_attention_heads=9, num_key_value_heads=3, vocab_size=VOCAB,
                                 tie_word_embeddings=True, max_position_embeddings=4096,
                                 rope_theta=1e5, initializer_range=0.1,
                                 architectures=["LlamaForCausalLM"]),
}


def save_random_model(cfg, path: str) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="t1")
    tok.save_pretrained(path)


@pytest.fixture(scope="module", params=list(SHAPES))
def model_dir(request, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp(request.param))
    save_random_model(SHAPES[request.param](), path)
    return path


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):  # a length, then its tokens, from the one generator
        length = int(torch.randint(5, 300, (1,), generator=g))
        out.append(torch.randint(2, VOCAB, (length,), generator=g).tolist())
    return out


def record_logprobs(llm: LLM, prompt_list: list[list[int]], **engine_params) -> tuple[list, list]:
    """Greedy token ids and per-step logprobs (one (V,) row per generated token) of each prompt."""
    runner = llm.model_runner
    steps: dict[int, list[torch.Tensor]] = {}
    sample = runner.sample

    def spy(logits, seqs, positions):
        assert logits.shape[0] == len(seqs)  # the LM head's padding rows (_logits_rows) are cut off
        lp = logits.float().log_softmax(-1).cpu()
        for row, seq in zip(lp, seqs):
            steps.setdefault(seq.seq_id, []).append(row)
        return sample(logits, seqs, positions)

    runner.sample = spy
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        seqs = [llm.add_request(p, params) for p in prompt_list]
        while llm.scheduler.has_unfinished():
            llm.step()
    finally:
        runner.sample = sample
    # a chunked prefill also records logits of unfinished chunks: only the last MAX_TOKENS sample
    return [s.output_token_ids for s in seqs], [steps[s.seq_id][-MAX_TOKENS:] for s in seqs]


def hf_logprobs(model_dir: str, prompt_list: list[list[int]]) -> tuple[list, list]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids, lps = [], []
    with torch.no_grad():
        for p in prompt_list:
            out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            ids.append(out.sequences[0, len(p):].tolist())
            lps.append([step[0].float().log_softmax(-1).cpu() for step in out.logits])
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return ids, lps


def assert_logprobs_close(ids_a, lps_a, ids_b, lps_b, tol: float = LOGPROB_TOL) -> None:
    """Same tokens until the first step where the two disagree; there it must be a near-tie in both.
    Along the shared prefix, the logprobs of the top-5 tokens agree within tol."""
    for seq_a, steps_a, seq_b, steps_b in zip(ids_a, lps_a, ids_b, lps_b):
        for tok_a, lp_a, tok_b, lp_b in zip(seq_a, steps_a, seq_b, steps_b):
            top = lp_b.topk(5).indices
            assert (lp_a[top] - lp_b[top]).abs().max() < tol
            if tok_a != tok_b:  # a near-tie: each engine's choice is almost as likely in the other
                assert lp_b[tok_b] - lp_b[tok_a] < tol and lp_a[tok_a] - lp_a[tok_b] < tol
                break


def test_logprobs_close_to_transformers(model_dir):
    prompt_list = prompts()
    ref_ids, ref_lps = hf_logprobs(model_dir, prompt_list)
    with LLM(model_dir, gpu_memory_utilization=0.3, max_model_len=1024) as llm:
        ids, lps = record_logprobs(llm, prompt_list)
    assert_logprobs_close(ids, lps, ref_ids, ref_lps)


def test_cudagraph_decode_matches_eager(model_dir):
    prompt_list = prompts(n=37, seed=1)  # 37 running sequences replay the graph captured for 48
    results = {}
    for eager in (True, False):
        # max_num_seqs=40 is no captured size: the graphs go up to 48, the one that holds 40
        with LLM(model_dir, num_kvcache_blocks=4096, max_model_len=1024, enforce_eager=eager,
                 max_num_seqs=40) as llm:
            assert bool(getattr(llm.model_runner, "graphs", None)) == (not eager)
            results[eager] = record_logprobs(llm, prompt_list)
    assert_logprobs_close(*results[False], *results[True], tol=SAME_ENGINE_TOL)


def test_prefill_graphs_match_transformers(model_dir):
    """Prompts one at a time, each prefill a replay of extensions.prefill_graphs (5-1000 tokens:
    graphs of 16 to 1,024 keys), then again as prefix-cache hits (fewer new tokens than keys):
    logprobs close to transformers' both times."""
    prompt_list = prompts(n=4, seed=5) + [(prompts(n=1, seed=6)[0] * 8)[:1000]]
    ref_ids, ref_lps = hf_logprobs(model_dir, prompt_list)
    with LLM(model_dir, gpu_memory_utilization=0.3, max_model_len=1024) as llm:
        graphs = llm.model_runner.graphs
        for run in ("computed", "cached"):
            replays = graphs.num_replays
            ids, lps = zip(*(record_logprobs(llm, [p]) for p in prompt_list))  # one at a time
            assert graphs.num_replays - replays == len(prompt_list), run
            assert_logprobs_close([i[0] for i in ids], [lp[0] for lp in lps], ref_ids, ref_lps)
        assert scheduler_stats(llm.scheduler).num_hits > 0


def test_core_alone_matches_the_extensions(model_dir):
    """The core's plain paths (no overlap, no cascade or split-KV decode, no fused kernels or race
    sampler, no prefill graphs; decode graphs on, with the core's KV store) against the default
    engine: the same greedy tokens up to near-ties, logprobs close. 40 sequences share a prefix:
    the cascade kernel runs."""
    system = prompts(n=1, seed=2)[0][:5] * 20
    prompt_list = [system + t[:40] for t in prompts(n=40, seed=4)]
    results = {}
    for on in (True, False):
        with LLM(model_dir, num_kvcache_blocks=4096, max_model_len=1024, overlap_scheduling=on,
                 cascade_attention=on, fused_kernels=on, prefill_graphs=on) as llm:
            runner = llm.model_runner
            assert (runner.backends.common_blocks is not None) == on
            assert (type(llm.loop).__name__ == "OverlapLoop") == on
            assert (type(runner.graphs).__name__ == "PrefillGraphs") == on
            results[on] = record_logprobs(llm, prompt_list)
    # the fused kernels round as one kernel what the plain ops round step by step (0.26 nats at
    # most, measured on the llama shape): the tolerance against transformers, not SAME_ENGINE_TOL
    assert_logprobs_close(*results[True], *results[False], tol=LOGPROB_TOL)


def test_prefix_hit_matches_no_hit(model_dir):
    system = prompts(n=1, seed=2)[0][:5] * 20  # 100 shared tokens: 6 full blocks of 16
    tails = prompts(n=41, seed=3)  # 40 decode together after the first: cascade attention (>= 32)
    shared = [system + t[:40] for t in tails]
    results = {}
    for caching in (True, False):
        with LLM(model_dir, num_kvcache_blocks=4096, max_model_len=1024,
                 enable_prefix_caching=caching) as llm:
            record_logprobs(llm, shared[:1])  # computes and caches the shared prefix
            results[caching] = record_logprobs(llm, shared[1:])
            hits = scheduler_stats(llm.scheduler).num_hits
        assert (hits >= 6 * 40) if caching else hits == 0
    assert_logprobs_close(*results[True], *results[False], tol=SAME_ENGINE_TOL)


def test_fp8_kv_cache_close_to_bf16(model_dir):
    """kv_cache_dtype="fp8" against the bf16 cache, through prefix-cache hits (prefill gathers the
    cached K/V), cascade decode (40 sequences share 6 blocks) and CUDA graphs: twice the blocks in
    the same memory, and logprobs close along the tokens where both runs agree. These random
    models part at near-ties within a few tokens, so the check is the mean |delta logprob| of the
    sampled tokens (the measured means: docs/fp8_cache.md, Accuracy); a cache stored or read
    wrongly moves logprobs by whole nats."""
    system = prompts(n=1, seed=2)[0][:5] * 20  # 100 shared tokens: 6 full blocks of 16
    shared = [system + t[:40] for t in prompts(n=41, seed=9)]
    results, blocks = {}, {}
    for kv in ("auto", "fp8"):
        with LLM(model_dir, gpu_memory_utilization=0.3, max_model_len=1024,
                 kv_cache_dtype=kv) as llm:
            record_logprobs(llm, shared[:1])  # computes and caches the shared prefix
            results[kv] = record_logprobs(llm, shared[1:])
            blocks[kv] = llm.config.num_kvcache_blocks
            assert llm.model_runner.kv_cache.dtype == (torch.float8_e4m3fn if kv == "fp8"
                                                       else torch.bfloat16)
    assert 1.95 < blocks["fp8"] / blocks["auto"] < 2.05
    deltas = []
    for ids_a, lps_a, ids_b, lps_b in zip(*results["auto"], *results["fp8"]):
        for tok_a, lp_a, tok_b, lp_b in zip(ids_a, lps_a, ids_b, lps_b):
            if tok_a != tok_b:
                break
            deltas.append(abs(float(lp_a[tok_a] - lp_b[tok_b])))
    assert deltas, "every sequence parted from bf16's at its first token"
    mean = sum(deltas) / len(deltas)
    print(f"fp8 KV cache: mean |delta logprob| {mean:.3f} over {len(deltas)} agreeing tokens; "
          f"{blocks['fp8']} blocks against {blocks['auto']}")
    assert mean < FP8_MEAN_LOGPROB_TOL


def test_chunked_prefill_matches_whole(model_dir):
    prompt_list = prompts(n=3, seed=4)
    results = {}
    for budget in (16384, 64):
        with LLM(model_dir, num_kvcache_blocks=4096, max_model_len=1024,
                 max_num_batched_tokens=budget) as llm:
            results[budget] = record_logprobs(llm, prompt_list)
    assert_logprobs_close(*results[64], *results[16384], tol=SAME_ENGINE_TOL)


def invariance_requests(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n greedy and n seeded requests with logprobs, on prompts that repeat a motif (n-gram
    speculation proposes drafts from them)."""
    g = torch.Generator().manual_seed(11)
    prompt_list, params = [], []
    for i in range(2 * n):
        motif = torch.randint(2, VOCAB, (int(torch.randint(2, 12, (1,), generator=g)),),
                              generator=g).tolist()
        prompt_list.append((motif * 100)[:int(torch.randint(4, 300, (1,), generator=g))])
        params.append(SamplingParams(temperature=0.0 if i < n else 0.9, seed=i, logprobs=3,
                                     max_tokens=int(torch.randint(8, 32, (1,), generator=g))))
    return prompt_list, params


def run(llm: LLM, prompt_list: list, params: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each output's tokens and logprobs as tensors: (T,) ids and (T, 1 + k) (token, value) rows."""
    outs = llm.generate(prompt_list, params, use_tqdm=False)
    return [(torch.tensor(o["token_ids"]),
             torch.tensor([[t, lp] for step in o.get("logprobs", [])
                           for t, lp in sorted(step.items())], dtype=torch.float64))
            for o in outs]


def num_different(runs: list, reference: list) -> int:
    """How many outputs are not bitwise those of the reference, tokens or logprobs."""
    return sum(not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]))
               for a, b in zip(runs, reference))


@pytest.fixture
def fresh_compiles() -> None:
    """torch.compile's recompile limit (8 a function) counts every engine this process built:
    past it, fused's compiled steps run eagerly, rounded otherwise. batch_invariant=True promises
    the same bits within an engine, so its tests start with no compiled code."""
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_compiles")
def test_batch_invariant_same_bits_in_any_batch(model_dir):
    """batch_invariant=True: 64 greedy and 64 seeded requests give bitwise the same tokens and
    logprobs alone, mixed with 200 others, in reverse order, and with speculative decoding; with
    the setting off, the same requests mixed with the others do not (the check can fail)."""
    prompt_list, params = invariance_requests(64)
    others, other_params = prompts(n=200, seed=12), [
        SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=m, ignore_eos=True)
        for t, p, k, m in itertools.product((0, 1.0), (1.0, 0.8), (0, 20), (5, 60))] * 13
    base = dict(max_model_len=1024, gpu_memory_utilization=0.25, max_num_batched_tokens=4096)
    mixed = others[:100] + prompt_list + others[100:]
    mixed_params = other_params[:100] + params + other_params[100:200]
    runs = {}
    for invariant in (True, False):
        with LLM(model_dir, batch_invariant=invariant, **base) as llm:
            runs[invariant, "alone"] = [run(llm, [p], [sp])[0]
                                        for p, sp in zip(prompt_list, params)]
            runs[invariant, "mixed"] = run(llm, mixed, mixed_params)[100:228]
            if invariant:
                runs[invariant, "reversed"] = run(llm, prompt_list[::-1], params[::-1])[::-1]
    with LLM(model_dir, batch_invariant=True, speculative_method="ngram", prompt_lookup_min=1,
             num_speculative_tokens=4, **base) as llm:
        runs[True, "speculative"] = run(llm, mixed, mixed_params)[100:228]
        assert llm.loop.stats.num_draft_tokens > 0
    for (invariant, name), outs in runs.items():
        print(f"batch_invariant={invariant} {name}: "
              f"{num_different(outs, runs[invariant, 'alone'])}/128 differ from alone")
        if invariant:
            assert num_different(outs, runs[True, "alone"]) == 0, name
    assert num_different(runs[False, "mixed"], runs[False, "alone"]) > 0  # the negative control


@pytest.mark.usefixtures("fresh_compiles")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_through_chunks_hits_preemption_and_graphs(model_dir, dtype):
    """batch_invariant=True: seeded and greedy requests keep their bits through chunked prefill
    (two chunk sizes), prefix-cache hits, preemption and recompute, eager decode and no overlap."""
    prompt_list, params = invariance_requests(8)
    base = dict(max_model_len=1024, dtype=dtype, batch_invariant=True, num_kvcache_blocks=512)
    runs = {}
    with LLM(model_dir, **base) as llm:
        runs["whole"] = run(llm, prompt_list, params)
        runs["prefix hits"] = run(llm, prompt_list, params)
        assert scheduler_stats(llm.scheduler).num_hits > 0
    for name, settings in {"chunks of 40": dict(max_num_batched_tokens=40),
                           "chunks of 97": dict(max_num_batched_tokens=97),
                           "eager, no overlap": dict(enforce_eager=True, overlap_scheduling=False),
                           "preempted": dict(num_kvcache_blocks=40, max_model_len=384)}.items():
        with LLM(model_dir, **{**base, **settings}) as llm:
            runs[name] = run(llm, prompt_list, params)
            if name == "preempted":
                assert llm.scheduler.num_preemptions > 0
    for name, outs in runs.items():
        assert num_different(outs, runs["whole"]) == 0, name


def test_kv_cache_too_small_names_missing_memory(model_dir):
    # 0.1% of an H100 is 80 MB: less than is already in use
    with pytest.raises(ValueError, match="GiB missing"):
        LLM(model_dir, gpu_memory_utilization=0.001, max_model_len=4096,
            max_num_batched_tokens=4096)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("dtype, kv_cache_dtype", [("bfloat16", "auto"), ("float32", "auto"),
                                                   ("bfloat16", "fp8")])
def test_tp2_matches_tp1_on_qwen3_0_6b_shapes(tmp_path, dtype, kv_cache_dtype):
    """Qwen3-0.6B's full shapes (28 layers, 16 q / 8 KV heads, vocab 151936) with random weights,
    on two GPUs. bf16: TP=2 sums the row-parallel products in another order, so greedy tokens may
    part at near-ties (often half the sequences); float32 rounds ~65,000x finer: the tokens must be
    identical. With an fp8 cache each rank rounds its own heads' K and V as one GPU does."""
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096,
                      rope_theta=1e6, initializer_range=0.02, architectures=["Qwen3ForCausalLM"])
    save_random_model(cfg, str(tmp_path))
    prompt_list = prompts(n=8, seed=5)
    results, shm_before = {}, set(os.listdir("/dev/shm"))
    for tp in (1, 2):
        with LLM(str(tmp_path), tensor_parallel_size=tp, num_kvcache_blocks=4096,
                 max_model_len=1024, dtype=dtype,
                 kv_cache_dtype=kv_cache_dtype) as llm:  # CUDA graphs: shutdown must not hang
            results[tp] = record_logprobs(llm, prompt_list)
    assert set(os.listdir("/dev/shm")) - shm_before == set()  # the workers' segment is gone
    assert_logprobs_close(*results[2], *results[1], tol=SAME_ENGINE_TOL)
    identical = sum(a == b for a, b in zip(results[2][0], results[1][0]))
    print(f"{dtype}, {kv_cache_dtype} cache: TP=2 vs TP=1: {identical}/{len(prompt_list)} "
          f"sequences token-identical over {MAX_TOKENS} tokens")
    if dtype == "float32":
        assert results[2][0] == results[1][0]


@pytest.mark.usefixtures("fresh_compiles")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_speculative_decoding_keeps_the_greedy_tokens(model_dir, kv_cache_dtype):
    """Prompts that repeat themselves and random ones, speculation on (lookups of single tokens:
    drafts at most steps, so decode graphs replay with up to k + 1 rows a sequence) and off, with
    batch_invariant=True: bitwise the same tokens and logprobs. (Acceptance is the CPU tests'
    part: on random weights few drafts are accepted.)"""
    g = torch.Generator().manual_seed(1)
    loops = [torch.randint(2, VOCAB, (n,), generator=g).tolist() * 4 for n in (3, 8, 20, 50)]
    prompt_list = loops + prompts(4)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=5)
    outs = {}
    for spec in ("ngram", None):
        with LLM(model_dir, speculative_method=spec, kv_cache_dtype=kv_cache_dtype,
                 max_model_len=1024, max_num_seqs=64, prompt_lookup_min=1,
                 batch_invariant=True, gpu_memory_utilization=0.25) as llm:
            outs[spec] = run(llm, prompt_list, [params] * len(prompt_list))
            if spec:  # decode ran in CUDA graphs, with drafts accepted
                assert llm.model_runner.graphs is not None
                stats = llm.loop.stats
    assert stats.num_draft_tokens > 20
    assert num_different(outs["ngram"], outs[None]) == 0


def test_guided_decoding_on_the_gpu(model_dir):
    """A regular expression over the test vocabulary's tokens ("t0" to "t8191", EOS "t1"): guided
    greedy requests next to unguided ones, overlap scheduling on and off (the mask of the step
    after a step in flight), CUDA graphs and eager: each guided text matches in full, and overlap
    changes no token."""
    from nanoserve import GuidedDecodingParams
    regex = "(t[2-5][0-9]*){4,8}"  # every token that starts a group also ends one
    guided = SamplingParams(temperature=0, max_tokens=24,
                            guided_decoding=GuidedDecodingParams(regex=regex))
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt_list, params = prompts(8), [guided, plain] * 4
    outs = {}
    for eager, overlap in ((False, True), (False, False), (True, True)):
        with LLM(model_dir, enforce_eager=eager, overlap_scheduling=overlap, max_model_len=1024,
                 num_kvcache_blocks=1024) as llm:
            outs[eager, overlap] = llm.generate(prompt_list, params, use_tqdm=False)
            assert (llm.model_runner.graphs is None) == eager
    for out in outs[False, True][::2] + outs[True, True][::2]:  # the guided requests
        text = "".join(f"t{t}" for t in out["token_ids"][:-1])  # less EOS, which ends them
        assert out["finish_reason"] == "stop" and re.fullmatch(regex, text), out
    guided_outs = [[o["token_ids"] for o in outs[False, on][::2]] for on in (True, False)]
    assert guided_outs[0] == guided_outs[1]
    assert all(len(o["token_ids"]) == 24 for o in outs[False, True][1::2])


def test_guided_masking_graphs_on_the_gpu(model_dir):
    """Batches of 1, 2 and 4 rows, all guided, mask by replaying a CUDA graph captured at their
    logits' place: the same tokens as with the copy and the masking launched one by one
    (graph_rows 0). A mixed batch whose logits lie where a graph was captured launches its
    masking instead: its unguided row is left as it was."""
    from nanoserve import GuidedDecodingParams
    guided = SamplingParams(temperature=0, max_tokens=24,
                            guided_decoding=GuidedDecodingParams(regex="(t[2-5][0-9]*){4,8}"))
    with LLM(model_dir, max_model_len=1024, num_kvcache_blocks=1024) as llm:
        ext, tokens = llm.switch_on("guided"), {}
        for graph_rows in (0, ext.graph_rows):
            ext.graph_rows = graph_rows
            tokens[graph_rows] = [[o["token_ids"] for o in llm.generate(
                prompts(n), guided, use_tqdm=False)] for n in (1, 2, 4, 1, 2, 4)]
            assert len(ext.graphs) >= 3 if graph_rows else not ext.graphs
        assert tokens[0] == tokens[ext.graph_rows]
        torch.cuda.synchronize()
        ext.filled[:2], ext.rows[0] = 0, 0  # rows 0 and 1 refuse every token
        logits = torch.zeros(2, ext.vocab_size, device="cuda")
        for _ in range(2):  # launched and captured, then replayed
            ext._mask(logits.zero_(), None)
            assert torch.isinf(logits).all()
        ext._mask(logits.zero_(), ext.rows[:1])  # row 0 guided, row 1 not
        assert torch.isinf(logits[0]).all() and not torch.isinf(logits[1]).any()


@pytest.mark.parametrize("engine", ["hf", "hf-cb"])
def test_bench_hugging_face_peers_on_the_gpu(tmp_path, engine, monkeypatch):
    """bench.py's Hugging Face peers with the transformers installed here, as bench.py runs them
    on a GPU (hf-cb sizes its own cache and captures its graphs): a small w2 end to end on the
    tiny random Qwen3, every requested token returned. (Here, in the serial run, as hf-cb takes
    most of the GPU's free memory while it runs.)"""
    import argparse

    import bench
    import bench_utils
    model = bench_utils.build_random_qwen3(tmp_path / "qwen3", bench.QWEN3_TINY, "cuda")
    monkeypatch.setattr(bench, "MIN_TIMED_SECONDS", 0.0)
    wl = bench.make_w2(num_seqs=3, prefix_len=16, min_own=4, max_own=8, output_len=4)
    args = argparse.Namespace(eager=False, tp=1, hf_batch_size=2)
    row = bench.run_engine(engine, bench.ENGINES[engine], model, wl, args, "cuda")
    assert row.note == "" and row.tokens_per_s > 0, row.note
