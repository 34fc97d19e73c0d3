"""The developer tools' own logic, on the CPU: what fp8_accuracy.py rounds and how it compares."""
import sys
from pathlib import Path

import pytest
import torch

from nanoserve import kernels
from nanoserve.kernels import rotary

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
fp8_accuracy = pytest.importorskip("fp8_accuracy")


@pytest.mark.parametrize("part", ["k", "v"])
def test_rounded_store_rounds_only_one_part(part: str) -> None:
    torch.manual_seed(0)
    key, value = torch.randn(4, 2, 16) * 3, torch.randn(4, 2, 16) * 3  # (N, Hkv, D)
    k_cache, v_cache = torch.zeros(2, 2, 2, 16), torch.zeros(2, 2, 2, 16)  # (blocks, B, Hkv, D)
    store = kernels.store_kv
    with fp8_accuracy.rounded_store(part):
        kernels.store_kv(key, value, k_cache, v_cache, torch.arange(4))
    assert kernels.store_kv is store and rotary.store_kv is store  # restored
    stored = {"k": k_cache.view(4, 2, 16), "v": v_cache.view(4, 2, 16)}
    original = {"k": key, "v": value}
    other = "v" if part == "k" else "k"
    torch.testing.assert_close(stored[part], original[part].to(torch.float8_e4m3fn).float())
    assert not torch.equal(stored[part], original[part])
    assert torch.equal(stored[other], original[other])


def test_compare_counts_identical_sequences_and_agreeing_tokens() -> None:
    auto = ([[1, 2, 3], [4, 5, 6]], [[{1: -0.1}, {2: -0.2}, {3: -0.3}],
                                      [{4: -0.4}, {5: -0.5}, {6: -0.6}]])
    fp8 = ([[1, 2, 3], [4, 9, 6]], [[{1: -0.2}, {2: -0.2}, {3: -0.3}],
                                     [{4: -0.4}, {9: -0.1}, {6: -0.6}]])
    r = fp8_accuracy.compare(auto, fp8)
    assert (r["identical_all"], r["agreeing_tokens"]) == (1, 4)  # 3 tokens, then 1 before 5 != 9
    assert r["mean_abs_dlogprob"] == pytest.approx(0.1 / 4)
    assert r["max_abs_dlogprob"] == pytest.approx(0.1)


def test_more_questions_are_new_chat_prompts() -> None:
    from test_e2e import QUESTIONS

    from nanoserve.weights import default_model_dir
    more = fp8_accuracy.MORE_QUESTIONS
    assert len(more) == len(set(more)) == 48 and not set(more) & set(QUESTIONS)
    prompts = fp8_accuracy.chat_prompts(default_model_dir(), more)
    assert len(prompts) == 48 and all(isinstance(t, int) for p in prompts for t in p)
    assert len({tuple(p) for p in prompts}) == 48  # each question its own prompt


def test_forced_requests_ask_every_position_of_the_outputs() -> None:
    requests, chosen = fp8_accuracy.forced_requests([[7, 8], [9]], [[1, 2, 3], [4]])
    assert requests == [[7, 8], [7, 8, 1], [7, 8, 1, 2], [9]]
    assert chosen == [1, 2, 3, 4]


def test_compare_forced_counts_top_token_agreement_and_chosen_deltas() -> None:
    chosen = [1, 2, 3]
    auto = ([[1], [2], [3]], [[{1: -0.1, 5: -2.0}], [{2: -0.2}], [{3: -0.3}]])
    fp8 = ([[1], [5], [3]], [[{1: -0.3, 5: -1.9}], [{5: -0.5, 2: -0.9}], [{7: -0.1}]])
    r = fp8_accuracy.compare_forced(auto, fp8, chosen)
    assert r["forced_positions"] == 3 and r["forced_compared"] == 2  # token 3 not in fp8's top-k
    assert r["forced_top1_agreement"] == pytest.approx(2 / 3)
    assert r["forced_mean_abs_dlogprob"] == pytest.approx((0.2 + 0.7) / 2)


@pytest.mark.slow
def test_transformers_probe_rounds_k_and_v() -> None:
    """The probe's rounded attention moves transformers' logprobs, by little: a greedy run and a
    teacher-forced one of each model, compared."""
    (name, r), = fp8_accuracy.transformers_results(["What is 2 plus 2?"]).items()
    assert name.startswith("transformers") and r["sequences"] == 1
    assert r["forced_positions"] == r["output_tokens"] > 0 and r["agreeing_tokens"] > 0
    assert 0 < r["forced_mean_abs_dlogprob"] < 0.2 and 0 <= r["forced_top1_agreement"] <= 1


def test_top_logprobs_keeps_the_most_likely_tokens() -> None:
    row = torch.tensor([-3.0, -0.5, -9.0, -1.0, -2.0, -4.0, -0.1])
    assert fp8_accuracy.top_logprobs(row) == pytest.approx({6: -0.1, 1: -0.5, 3: -1.0, 4: -2.0,
                                                             0: -3.0})


def test_jitter_moves_each_value_by_less_than_its_bound() -> None:
    x = torch.randn(4096) * 10  # float32
    moved = fp8_accuracy.jitter(x, run=0)
    bound = fp8_accuracy.JITTER + 2**-23  # and the float32 rounding of the product
    assert ((moved - x).abs() <= bound * x.abs()).all()
    assert (moved != x).float().mean() > 0.9  # nearly every value moves
    assert torch.equal(fp8_accuracy.jitter(x.clone(), run=0), moved)  # a function of the value
    assert not torch.equal(fp8_accuracy.jitter(x, run=1), moved)  # and of the run


def test_jittered_rounding_tips_ties_both_ways_in_the_store() -> None:
    def to_fp8(x: torch.Tensor) -> torch.Tensor:  # whatever rotary.to_cache_dtype is now
        return rotary.to_cache_dtype(x, torch.float8_e4m3fn)
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 2^-9..448
    ties = (e4m3[:-1] + e4m3[1:]) / 2  # halfway between neighbours: exact in float32
    plain = to_fp8(ties).float()
    with fp8_accuracy.jittered_rounding(run=3):
        tipped = rotary.to_cache_dtype(ties, torch.float8_e4m3fn).float()
        # (blocks, B, Hkv, D) each
        k_cache, v_cache = (torch.zeros(2, 16, 1, 125, dtype=torch.float8_e4m3fn) for _ in "kv")
        kernels.store_kv(ties.view(1, 1, 125), ties.view(1, 1, 125), k_cache, v_cache,
                         torch.tensor([5], dtype=torch.int32))
    assert to_fp8(ties).float().equal(plain)  # restored
    up, down = tipped == e4m3[1:], tipped == e4m3[:-1]
    assert (up | down).all() and up.sum() > 30 and down.sum() > 30  # ties to even would go 62/63
    assert not tipped.equal(plain)
    assert k_cache[0, 5, 0].float().equal(tipped) and v_cache[0, 5, 0].float().equal(tipped)


@pytest.mark.slow
def test_nanoserve_kv_lies_within_float32_differences_of_transformers() -> None:
    """What --jitter compares its moves with: nanoserve's float32 K and V, token by token, against
    transformers' own, a few float32 steps apart (far apart if the slots were misread)."""
    from test_e2e import QUESTIONS
    difference = fp8_accuracy.kv_difference_from_transformers(QUESTIONS, num_prompts=2)
    for name in "KV":
        assert 0 < difference[name]["median"] < 1e-5, (name, difference)
        assert difference[name]["p90"] < 1e-4, (name, difference)


@pytest.mark.slow
def test_jittered_counts_compares_each_jittered_run_with_one_reference() -> None:
    """--jitter's loop on one question: one count per run, each of the one sequence."""
    j = fp8_accuracy.jittered_counts(2, ["What is 2 plus 2?"], probe=False)
    counts = j[f"identical_first_{fp8_accuracy.PREFIX}_per_run"]
    assert len(counts) == len(j["mean_abs_dlogprob_per_run"]) == 2 and set(counts) <= {0, 1}
    assert j["runs_with_half_or_more"] == sum(counts) and not j["probe"]
    assert all(0 <= m < 0.2 for m in j["mean_abs_dlogprob_per_run"])


@pytest.mark.skipif(kernels.INTERPRETED, reason="the interpreter replaces the kernels' compiler")
def test_kernel_report_reads_the_fp8_decode_loop(capsys: pytest.CaptureFixture) -> None:
    """kernel_report.py compiles for sm_90 on this CPU. With its alignment hints the fp8 kernel's
    K/V tiles go to shared memory asynchronously, and the main loop it finds converts e4m3 pairs
    and runs the products on tensor cores."""
    kernel_report = pytest.importorskip("kernel_report")
    name, kernel, cache, constexprs, warps = next(case for case in kernel_report.cases()
                                                  if case[0] == "paged_decode fp8e4nv")
    compiled = kernel_report.compile_sm90(kernel, cache, constexprs, warps)
    kernel_report.report(name, compiled, warps, top=40)
    out = capsys.readouterr().out
    assert "cp.async tiles ['128x128']" in out and "programs an SM" in out
    assert "F2FP" in out and "HMMA" in out


def test_e4m3_terms_round_per_row_and_a_second_term_shrinks_the_error() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 32) * torch.logspace(-3, 2, 6)[:, None]  # rows of very different sizes
    one, two = (fp8_accuracy.e4m3_terms(x, n, True) for n in (1, 2))
    scale = x.abs().amax(-1, keepdim=True) / 448
    torch.testing.assert_close(one, (x / scale).to(torch.float8_e4m3fn).float() * scale)
    assert torch.equal(fp8_accuracy.e4m3_terms(x, 0, True), x)
    assert (two - x).norm() < (one - x).norm() / 8  # hi + lo: about 4 more significant bits
    p = torch.rand(4, 16)  # softmax weights in [0, 1]: rounded as they are (scale 1)
    torch.testing.assert_close(fp8_accuracy.e4m3_terms(p, 1, False),
                               p.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("gqa", [False, True])
def test_fa3_products_match_sdpa_unrounded_and_restore_it(gqa: bool) -> None:
    torch.manual_seed(0)
    F = torch.nn.functional
    sdpa = F.scaled_dot_product_attention
    kv_heads = 2 if gqa else 4
    q, k, v = torch.randn(4, 3, 16), torch.randn(kv_heads, 5, 16), torch.randn(kv_heads, 5, 16)
    mask = torch.ones(3, 5, dtype=torch.bool).tril(diagonal=2)  # bottom-right causal
    want = sdpa(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=gqa)
    with fp8_accuracy.fa3_products(0, 0):  # no rounding: the emulation's float32 is SDPA's
        torch.testing.assert_close(F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=0.25, enable_gqa=gqa), want)
    with fp8_accuracy.fa3_products(1, 1):
        rounded = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25,
                                                 enable_gqa=gqa)
    assert F.scaled_dot_product_attention is sdpa  # restored
    assert 1e-3 < (rounded - want).abs().max() < 0.2  # FA3's e4m3 q and p move the output


def test_profile_steps_times_the_overlap_loops_own_halves(tmp_path: Path) -> None:
    """tools/profile_steps.instrument wraps the engine's step loop too: with overlap scheduling
    (the default) a decode step's record holds the next step's scheduling."""
    from bench import QWEN3_TINY
    from bench_utils import build_random_qwen3
    from nanoserve import LLM, SamplingParams
    from nanoserve.extensions.overlap import OverlapLoop
    profile_steps = pytest.importorskip("profile_steps")
    model_dir = build_random_qwen3(tmp_path / "tiny", QWEN3_TINY, "cpu")
    # on the CPU on every machine: a GPU would add its graphs' capture and compiles, not a check
    with LLM(model_dir, device="cpu", max_model_len=256) as llm:
        assert isinstance(llm.loop, OverlapLoop)
        records = profile_steps.instrument(llm)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        llm.add_request([1, 2, 3, 4], params)
        profile_steps.drain(llm)
    decode = [r for r in records if r["kind"] != "prefill"]
    assert len(decode) == 5  # the prefill samples the first of the 6 tokens
    assert any(r.get("schedule", 0) > 0 for r in decode)  # the overlap loop's _schedule_decode
    assert all(r["postprocess"] > 0 for r in decode)


def test_profile_steps_times_guided_decodings_hook_apart(tmp_path: Path) -> None:
    """profile_steps --guided: the guided extension's before_sample is a phase of its own in each
    step that samples (the tiny model paired with the default model's tokenizer, as --guided
    pairs them: its first 1,001 ids hold the digits)."""
    import argparse

    from bench import QWEN3_TINY, resolve_model_dir
    from bench_utils import build_random_qwen3
    from nanoserve import LLM, GuidedDecodingParams, SamplingParams
    from nanoserve.weights import default_model_dir
    profile_steps = pytest.importorskip("profile_steps")
    tiny = build_random_qwen3(tmp_path / "tiny", QWEN3_TINY, "cpu")
    paired = resolve_model_dir(argparse.Namespace(model=tiny, tiny=False,
                                                  tokenizer=default_model_dir()), True)
    with LLM(paired, device="cpu", max_model_len=256) as llm:
        llm.switch_on("guided")
        records = profile_steps.instrument(llm)
        digits = GuidedDecodingParams(regex="[0-9]{6}")
        llm.add_request([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=6,
                                                     guided_decoding=digits))
        profile_steps.drain(llm)
    # (the last call only collects the step the one before it launched: it runs nothing)
    ran = [r for r in records if "run" in r]
    assert len(ran) == 5 and all(r["guided"] > 0 for r in ran)


def test_guided_cost_times_the_hook_at_every_step_of_a_batch() -> None:
    """guided_cost --batch N: N copies of the request at once; the hook is timed once a step
    (not a row), on the steps that sample guided rows."""
    guided_cost = pytest.importorskip("guided_cost")
    figures = guided_cost.measure(tokens=4, runs=1, device="cpu", batch=3)
    assert figures["batch"] == 3 and figures["before_sample_steps"] == 4
    assert figures["before_sample_us"] > 0 and figures["guided_ms_per_token"] > 0


def test_guided_hook_times_the_hook_and_its_parts_without_a_model(model_dir: str) -> None:
    """guided_hook: the hook on a stand-in engine masks every row (each row's argmax, drawn
    from random logits, starts its schema's JSON), and xgrammar's parts are timed at a few
    rows."""
    guided_hook = pytest.importorskip("guided_hook")
    from transformers import AutoTokenizer

    from nanoserve.extensions import guided

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    times, seqs = guided_hook.run_hook(guided, tokenizer, rows=3, each=True, steps=4)
    assert len(times) == 4 and all(t > 0 for t in times)
    assert all(tokenizer.decode(seq.output_token_ids).startswith('[{"k') for seq in seqs)
    compiler = guided_hook.compiler_for(tokenizer)
    parts = guided_hook.parts_us(compiler, tokenizer, rows=4, depth=3, each=False)
    assert set(parts) >= {"take_one_by_one", "fill_engine_thread", "fill_pool_8"}
    assert all(us > 0 for us in parts.values())


# the slow tail: the samples the tool times are tests/test_samples.py's
@pytest.mark.slow
def test_samples_bench_runs_both_modes_on_the_same_sequences(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    """tools/samples_bench.py's smoke run (--tiny, on the CPU): n samples with shared blocks and
    the same sequences as separate requests produce as many tokens each."""
    samples_bench = pytest.importorskip("samples_bench")
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    shared, separate = (samples_bench.run_samples(mode, tiny=True)
                        for mode in ("samples", "separate"))
    assert shared["output_tokens"] == separate["output_tokens"] == 4 * 8 * 16
    assert shared["tokens_per_s"] > 0 and separate["tokens_per_s"] > 0
