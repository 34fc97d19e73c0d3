"""CPU tests of bench.py and bench_utils.py: the workload generators, the roofline arithmetic, the
GPU sample summary, the chart, the timing loop with a fake engine, and a smoke run of the engines
on a tiny random Qwen3 (seconds on a CPU)."""
import argparse
import contextlib
import json
import logging
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402
import bench_micro  # noqa: E402
import bench_utils  # noqa: E402

# engines on the GPU that take most of its memory: in one pytest-xdist worker, one after another
pytestmark = pytest.mark.xdist_group(name="gpu_memory")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def main_logging() -> Iterator[None]:
    """bench.main turns nanoserve's INFO lines on for its process: here, for one test only."""
    logger = logging.getLogger("nanoserve")
    level = logger.level
    yield
    logger.setLevel(level)


def test_w1_is_nano_vllms_workload():
    wl = bench.make_w1()
    assert wl.output_tokens == 133_966
    # the same draws as nano-vllm's bench.py, written with the global random module
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
               for _ in range(256)]
    output_lens = [random.randint(100, 1024) for _ in range(256)]
    assert wl.prompts == prompts and wl.output_lens == output_lens


def test_w2_shares_one_prefix():
    wl = bench.make_w2()
    prefix = wl.prompts[0][:1024]
    assert len(wl.prompts) == 256 and wl.output_lens == [128] * 256
    assert all(p[:1024] == prefix and 32 <= len(p) - 1024 <= 128 for p in wl.prompts)
    assert len({tuple(p[1024:]) for p in wl.prompts}) > 200       # the own tokens differ


def test_build_workloads_scales_and_keeps_defaults():
    defaults = argparse.Namespace(num_seqs=None, max_input_len=None, max_output_len=None,
                                  workload="w1,w2")
    w1, w2 = bench.build_workloads(defaults, cpu=False)
    assert w1.output_tokens == 133_966 and len(w2.prompts[0]) > 1024
    args = argparse.Namespace(num_seqs=8, max_input_len=50, max_output_len=20, workload="w1,w2")
    w1, w2 = bench.build_workloads(args, cpu=False)
    assert len(w1.prompts) == 8 and all(len(p) <= 50 for p in w1.prompts)
    assert all(n <= 20 for n in w1.output_lens) and w2.output_lens == [20] * 8
    w1, _ = bench.build_workloads(defaults, cpu=True)
    assert len(w1.prompts) == 16 and all(32 <= n <= 128 for n in w1.output_lens)


def test_text_workloads_are_greedy_chats_that_stop_at_eos():
    from nanoserve.weights import default_model_dir
    args = argparse.Namespace(num_seqs=None, max_input_len=None, max_output_len=None,
                              workload="edit,chat")
    edit, chat = bench.build_workloads(args, cpu=True, model_dir=default_model_dir())
    for wl in (edit, chat):
        assert len(wl.prompts) == 20 and len({tuple(p) for p in wl.prompts}) == 20
        assert wl.temperature == 0 and not wl.ignore_eos and bench.relabeled(wl, 1) is wl
        assert wl.output_lens == [bench.TEXT_MAX_TOKENS] * 20
        assert bench.roofline_tokens_per_s(wl, 10**9, 10**5, 3e12) is None
    names = [name for name, _ in bench.engines_for(edit, ["nanoserve"], ("auto",),
                                                   ("off", "ngram"))]
    assert names == ["nanoserve", "nanoserve-ngram"]


def test_bad_sizes_and_a_text_workload_without_chat_template_stop_before_any_run(tiny_model):
    """A size of 0 is refused, not read as 'the default'; a chat workload on a model whose
    tokenizer has no chat template names --tokenizer."""
    with pytest.raises(SystemExit, match="--num-seqs 0, --tp 0: each must be at least 1"):
        bench.check_names(bench.parse_args(["--num-seqs", "0", "--tp", "0"]))
    args = argparse.Namespace(num_seqs=2, max_input_len=None, max_output_len=None,
                              workload="chat")
    with pytest.raises(SystemExit, match="needs a tokenizer with a chat template.*--tokenizer"):
        bench.build_workloads(args, cpu=True, model_dir=tiny_model)
    with pytest.raises(SystemExit, match="--model /no/such/model is no model directory"):
        bench.model_weights_dir(bench.parse_args(["--model", "/no/such/model"]), cpu=True)


def test_main_exits_nonzero_when_a_run_failed(tiny_model, monkeypatch, tmp_path, main_logging):
    monkeypatch.setattr(bench, "resolve_model_dir", lambda args, cpu: tiny_model)
    monkeypatch.setattr(bench, "run_engine", lambda name, *_: bench.Row(
        "w1", name, 1, 1, note="error: RuntimeError: no GPU"))
    with pytest.raises(SystemExit, match="1 of 1 runs failed"):
        bench.main(["--tiny", "--cpu", "--engines", "nanoserve", "--workload", "w1",
                    "--out", str(tmp_path / "b.json")])


def test_kv_bytes_per_token_qwen3_0_6b():
    cfg = {**bench.QWEN3_0_6B, "dtype": "bfloat16"}
    assert bench.kv_bytes_per_token(cfg) == 2 * 28 * 8 * 128 * 2 == 114_688
    assert bench.kv_bytes_per_token(cfg, "fp8") == 114_688 // 2  # one byte per K/V value
    # no head_dim: hidden / heads
    smollm2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
               "num_hidden_layers": 30, "torch_dtype": "float32"}
    assert bench.kv_bytes_per_token(smollm2) == 2 * 30 * 3 * 64 * 4


def test_decode_bound_hand_computed():
    # weights 100 B, KV 10 B/token, 1 B/s. Prompts 2 and 3 tokens, outputs 1 and 2 tokens.
    # step 0: both run, contexts 2 + 3 -> 100 + 50; step 1: only the second, context 4 -> 100 + 40.
    assert bench.decode_bound_seconds([2, 3], [1, 2], 100, 10, 1.0) == 290
    # one at a time: 100 + 20, then 100 + 30 and 100 + 40
    assert bench.decode_bound_seconds([2, 3], [1, 2], 100, 10, 1.0, max_num_seqs=1) == 390
    assert bench.decode_bound_seconds([2, 3], [1, 2], 100, 10, 2.0) == 145


def test_decode_bound_w1_on_h100_is_plausible():
    wl = bench.make_w1()
    weights = 596_049_920 * 2              # Qwen3-0.6B parameters in bf16, tied head counted once
    prompt_lens = [len(p) for p in wl.prompts]
    secs = bench.decode_bound_seconds(prompt_lens, wl.output_lens, weights, 114_688, 3.35e12)
    steps = max(wl.output_lens)            # 256 <= max_num_seqs: all requests decode together
    assert secs > steps * weights / 3.35e12   # the weights alone, once a step
    assert 5_000 < wl.output_tokens / secs < 50_000


def test_weight_bytes_reads_safetensors_headers(tmp_path):
    from safetensors.torch import save_file
    tensors = {"a": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5)}
    save_file(tensors, str(tmp_path / "m.safetensors"), metadata={"format": "pt"})
    assert bench.weight_bytes(str(tmp_path)) == 3 * 4 * 2 + 5 * 4


@pytest.mark.parametrize("name, bandwidth", [
    ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H200", 4.8e12), ("NVIDIA H100 PCIe", 2.0e12),
    ("NVIDIA GH200 480GB", 4.0e12), ("NVIDIA L40S", 0.864e12), ("Some Future GPU", None)])
def test_gpu_bandwidth_by_name(name, bandwidth):
    assert bench.gpu_bandwidth(name) == bandwidth


def test_gpu_samples_summarized_over_busy_samples_only():
    samples = ["1980, 2619, 45, 350.0, 0x0000000000000000",
               "1755, 2619, 52, 450.0, 0x0000000000000004",
               "345, 2619, 40, 70.0, 0x0000000000000001", "garbage line"]
    summary = bench_utils.summarize_gpu(samples)  # the idle sample (power below median) is left out
    assert summary == ("2 busy samples: SM 1755-1980 MHz, memory 2619-2619 MHz, 45-52 C, "
                       "400 W mean, event reasons ['0x0000000000000000', '0x0000000000000004']")
    assert bench_utils.summarize_gpu(["[N/A], 2619, 40, 70.0, 0x0"]) is None
    assert bench_utils.summarize_gpu([]) is None
    with bench_utils.gpu_monitor("cpu") as cpu_samples:  # no GPU: no nvidia-smi, no samples
        pass
    assert cpu_samples == []


ROWS = [{"workload": "w1", "engine": "nanoserve", "tokens_per_s": 20_590.0},
        {"workload": "w1", "engine": "hf-cb", "tokens_per_s": 595.0},
        {"workload": "w1", "engine": "hf", "tokens_per_s": 570.0},
        {"workload": "w2", "engine": "nanoserve", "tokens_per_s": 47_788.0},
        {"workload": "w2", "engine": "hf", "tokens_per_s": None}]       # a failed engine: no bar
META = {"hardware": {"gpu": "NVIDIA H100 80GB HBM3", "commit": "abc1234"},
        "model": {"dir": "/cache/qwen3-0.6b-random", "dtype": "bfloat16"},
        "tensor_parallel_size": 1, "workloads": {"w1": {"description": "256 random prompts"}}}


def test_chart_labels_every_bar_and_names_its_conditions(tmp_path):
    fig = bench.plot(ROWS, [META], str(tmp_path / "b.png"))
    data = (tmp_path / "b.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    w1, w2 = fig.axes
    labels = [t.get_text() for t in w1.texts]
    assert labels == ["20,590 tok/s · 34.6x HF-CB · 36.1x HF static", "595 tok/s", "570 tok/s"]
    assert [t.get_text() for t in w2.texts] == ["47,788 tok/s"]   # no peer left to compare with
    assert bench.bar_label("nanoserve", 100.0, {"hf": 400.0}) == "100 tok/s · 0.25x HF static"
    assert w1.get_title(loc="left") == "W1: 256 random prompts"
    title = fig.get_suptitle()
    assert "NVIDIA H100 80GB HBM3" in title and "qwen3-0.6b-random" in title and "abc1234" in title
    assert w1.get_xscale() == "log"
    left, right = w1.get_xlim()
    assert left < 570 and right > 47_788                          # every bar inside the axis


def test_chart_on_cpu_and_from_merged_json_files(tmp_path):
    cpu_meta = {**META, "hardware": {"cpu": "x86_64", "commit": "def5678"}}
    for i, (rows, meta) in enumerate([(ROWS[:3], META), (ROWS[3:], cpu_meta)]):
        (tmp_path / f"{i}.json").write_text(json.dumps({**meta, "rows": rows}))
    rows, metas = bench.load_results([str(tmp_path / "0.json"), str(tmp_path / "1.json")])
    assert len(rows) == len(ROWS) and metas[1]["hardware"]["commit"] == "def5678"
    title = bench.chart(rows, metas).get_suptitle()
    assert "NVIDIA H100 80GB HBM3, CPU (x86_64)" in title and "abc1234, def5678" in title
    with pytest.raises(ValueError, match="every engine fail"):
        bench.chart(ROWS[4:], [META])


def test_timing_runs_the_warmup_first_and_a_failure_becomes_a_row(monkeypatch):
    wl = bench.make_w1(4, 10, 20, 2, 5)
    runs = []

    @contextlib.contextmanager
    def fake_engine(model_dir, wl, args, device):
        yield lambda w: runs.append((w.name, w.prompts[0][0])) or list(w.output_lens)

    # an instant workload is timed MAX_TIMED_RUNS times, relabeled after the first: the median
    row = bench.run_engine("fake", fake_engine, "unused", wl, argparse.Namespace(), "cpu")
    assert [name for name, _ in runs] == ["w1-warmup"] + ["w1"] * bench.MAX_TIMED_RUNS
    assert runs[1][1] == wl.prompts[0][0] and len({first for _, first in runs[1:]}) > 1
    assert row.note == "" and row.tokens_per_s > 0 and len(row.runs) == bench.MAX_TIMED_RUNS
    assert row.output_tokens == wl.output_tokens and row.seconds == sorted(row.runs)[2]
    monkeypatch.setattr(bench, "MIN_TIMED_SECONDS", 0.0)  # a long workload: one timed run
    runs.clear()
    row = bench.run_engine("fake", fake_engine, "unused", wl, argparse.Namespace(), "cpu")
    assert [name for name, _ in runs] == ["w1-warmup", "w1"] and row.runs == [row.seconds]

    @contextlib.contextmanager
    def short_engine(model_dir, wl, args, device):
        yield lambda w: [n - 1 for n in w.output_lens]

    row = bench.run_engine("short", short_engine, "unused", wl, argparse.Namespace(), "cpu")
    assert row.note == "4 requests returned a different token count than asked"

    def broken_engine(model_dir, wl, args, device):
        raise RuntimeError("no such model\nsecond line")

    row = bench.run_engine("broken", broken_engine, "unused", wl, argparse.Namespace(), "cpu")
    assert row.note == "error: RuntimeError: no such model" and row.tokens_per_s is None


def test_fill_ratios_against_nanoserve_and_the_roofline():
    rows = [bench.Row("w1", "nanoserve", 1, 1, tokens_per_s=200.0),
            bench.Row("w1", "hf", 1, 1, tokens_per_s=50.0), bench.Row("w1", "hf-cb", 1, 1),
            bench.Row("w1", "nanoserve-fp8", 1, 1, tokens_per_s=300.0, kv_cache_dtype="fp8")]
    bench.fill_ratios(rows, {"auto": 400.0, "fp8": 600.0})  # each row against its cache's bound
    assert [r.ratio for r in rows] == [1.0, 0.25, None, 1.5]
    assert [r.roofline_fraction for r in rows] == [0.5, 0.125, None, 0.5]


def test_nanoserve_runs_once_per_kv_cache_dtype():
    w2 = bench.make_w2(num_seqs=2, prefix_len=16)
    runners = bench.engines_for(w2, ["nanoserve", "hf"], ("auto", "fp8"))
    assert [name for name, _ in runners] == ["nanoserve", "nanoserve-nocache", "nanoserve-fp8",
                                             "nanoserve-fp8-nocache", "hf"]
    wl = bench.make_w1(4, 10, 20, 2, 5)
    row = bench.run_engine("nanoserve-fp8", runners[2][1], "no such model", wl,
                           argparse.Namespace(), "cpu")
    assert row.kv_cache_dtype == "fp8" and row.note.startswith("error")


def test_build_tiny_random_qwen3(tmp_path):
    """The w1 model path (random Qwen3 + decode-only tokenizer), shrunk to a CPU's size."""
    from transformers import AutoConfig, AutoTokenizer
    model_dir = bench_utils.build_random_qwen3(tmp_path / "qwen3", bench.QWEN3_TINY, "cpu")
    cfg = AutoConfig.from_pretrained(model_dir)
    assert cfg.architectures == ["Qwen3ForCausalLM"] and cfg.tie_word_embeddings
    assert cfg.eos_token_id == bench_utils.EOS_ID
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.eos_token_id == bench_utils.EOS_ID and tok.decode([5, 7]) == "<5> <7>"
    hidden, vocab = bench.QWEN3_TINY["hidden_size"], bench.QWEN3_TINY["vocab_size"]
    # the tied embedding is stored once
    assert vocab * hidden * 2 < bench.weight_bytes(model_dir) < 2 * vocab * hidden * 2
    assert bench_utils.build_random_qwen3(tmp_path / "qwen3", bench.QWEN3_TINY, "cpu") == model_dir


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return bench_utils.build_random_qwen3(tmp_path_factory.mktemp("m") / "qwen3", bench.QWEN3_TINY,
                                          "cpu")


@pytest.mark.parametrize("engine", ["nanoserve", "hf", "hf-cb"])
def test_engine_smoke_on_tiny_model(tiny_model, engine, monkeypatch):
    """Each engine runs a small w2 end to end on the CPU and returns every requested token (one
    timed run: the repeats of a short run are test_timeline_records_the_first_timed_run_only's)."""
    if engine == "hf-cb" and torch.cuda.is_available():
        # transformers' continuous batching turns CUDA graphs on by whether a GPU is visible,
        # not by where the model is (5.17's continuous_batching/initialization.py)
        pytest.skip("hf-cb's smoke test is the CPU's: with a GPU visible, bench.py runs hf-cb "
                    "on the GPU")
    monkeypatch.setattr(bench, "MIN_TIMED_SECONDS", 0.0)
    wl = bench.make_w2(num_seqs=3, prefix_len=16, min_own=4, max_own=8, output_len=4)
    args = argparse.Namespace(eager=True, tp=1, hf_batch_size=2)
    row = bench.run_engine(engine, bench.ENGINES[engine], tiny_model, wl, args, "cpu")
    assert row.note == "" and row.tokens_per_s > 0


def test_timeline_records_the_first_timed_run_only(tiny_model, tmp_path, monkeypatch):
    """--timeline draws one timed run: not the warm-up, nor the repeats of a short workload."""
    from nanoserve.extensions.timeline import Timeline
    drawn = []
    monkeypatch.setattr(Timeline, "plot", lambda self, path: drawn.append((self, path)))
    wl = bench.make_w2(num_seqs=3, prefix_len=16, min_own=4, max_own=8, output_len=4)
    path = str(tmp_path / "timeline.png")
    args = argparse.Namespace(eager=True, tp=1, timeline=path)
    row = bench.run_engine("nanoserve", bench.ENGINES["nanoserve"], tiny_model, wl, args, "cpu")
    assert row.note == "" and len(row.runs) > 1  # the tiny w2 is short: it was repeated
    assert len(drawn) == 1 and drawn[0][1] == path
    assert len(drawn[0][0].rows) == len(wl.prompts)  # one run's requests, not every repeat's


def test_relabeled_workload_keeps_lengths_and_shared_prefixes_with_new_ids():
    wl = bench.make_w2(6, 32, 4, 9, 3)
    new = bench.relabeled(wl, 1)
    assert [len(p) for p in new.prompts] == [len(p) for p in wl.prompts]
    assert new.output_lens == wl.output_lens and new.name == wl.name
    assert all(p[:32] == new.prompts[0][:32] for p in new.prompts)  # still one shared prefix
    assert new.prompts[0][:32] != wl.prompts[0][:32]  # which the prefix cache has not seen
    assert max(map(max, new.prompts)) <= bench.TOKEN_ID_MAX
    assert bench.relabeled(wl, 1).prompts == new.prompts  # seeded: the same on every run


# ---- where results go ------------------------------------------------------------------------
def tracked_state() -> tuple[str, dict[str, int]]:
    """`git status --porcelain` (untracked files too) and the mtime of every file in docs/."""
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    return status, {str(p): p.stat().st_mtime_ns for p in (REPO / "docs").rglob("*")}


def results_files() -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in (REPO / "results").rglob("*") if p.is_file()}


@contextlib.contextmanager
def repo_unchanged(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """Run the block in the repository's root, as a user would, and check that it changed no
    tracked file and wrote nothing into docs/; yields the list of results/ files it wrote (the
    new ones are removed afterwards: results/ is git-ignored, so git status cannot see them)."""
    monkeypatch.chdir(REPO)
    before, state = results_files(), tracked_state()
    written: list[Path] = []
    try:
        yield written
        written += sorted(p for p, t in results_files().items() if before.get(p) != t)
        assert tracked_state() == state, "a benchmark run changed the repository"
    finally:
        for path in set(results_files()) - set(before):
            path.unlink()


@pytest.mark.slow  # where bench.py writes with no output path: only the tail checks it
def test_bench_writes_into_results_not_docs(tiny_model, monkeypatch, main_logging):
    """A smoke run and a redraw with no output path: results/, never docs/ or a tracked file."""
    monkeypatch.setattr(bench, "resolve_model_dir", lambda args, cpu: tiny_model)
    with repo_unchanged(monkeypatch) as written:
        bench.main(["--tiny", "--cpu", "--engines", "nanoserve", "--workload", "w2",
                    "--num-seqs", "2", "--max-input-len", "16", "--max-output-len", "2"])
        assert json.loads((REPO / "results/bench.json").read_text())["rows"][0]["tokens_per_s"]
        bench.main(["--plot-from", "results/bench.json"])
    assert [p.relative_to(REPO).as_posix() for p in written] == ["results/bench.json",
                                                                  "results/bench.png"]


def test_tiny_is_labeled_a_smoke_test(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    assert "--tiny smoke test, not a benchmark" in " ".join(capsys.readouterr().out.split())


def test_guided_runs_with_another_tokenizer(tiny_model, monkeypatch):
    """--guided on the tiny Qwen3 (151,936 logits) with the default model's tokenizer (49,152
    tokens): every request follows the schema (the ids past the tokenizer, two thirds of the
    logits, are refused) and runs to its max_tokens; each run compiles its own grammars."""
    import xgrammar as xgr

    from nanoserve import LLM
    from nanoserve.weights import default_model_dir
    monkeypatch.setattr(bench, "model_weights_dir", lambda args, cpu: tiny_model)
    args = bench.parse_args(["--tokenizer", default_model_dir()])
    wl = bench.make_w1(4, 16, 32, 40, 60)
    with LLM(bench.resolve_model_dir(args, cpu=True), device="cpu") as llm:
        for guided, run in (("one", 0), ("each", 1)):
            params = bench.nanoserve_params(wl, guided, run)
            outs = llm.generate(wl.prompts, params, use_tqdm=False)
            for out, sp, n in zip(outs, params, wl.output_lens):
                grammar = llm.switched_on["guided"].compiler.compile_grammar(
                    xgr.Grammar.from_json_schema(sp.guided_decoding.json, any_whitespace=False))
                matcher = xgr.GrammarMatcher(grammar)
                assert len(out["token_ids"]) == n and all(map(matcher.accept_token,
                                                              out["token_ids"]))
    assert len({json.dumps(sp.guided_decoding.json) for sp in params}) == len(params)


def test_flashinfer_pages_lay_out_the_block_tables():
    """bench_micro's FlashInfer yardstick reads the same cache through FlashInfer's paged layout:
    each sequence's used blocks in order, and its last block's tokens (1..16)."""
    tables = torch.tensor([[7, 2, -1], [5, -1, -1], [0, 3, 9]], dtype=torch.int32)  # (S, max)
    indptr, indices, last = bench_micro.flashinfer_pages(tables, torch.tensor([17, 16, 33]), 16)
    assert indptr.tolist() == [0, 2, 3, 6] and indices.tolist() == [7, 2, 5, 0, 3, 9]
    assert last.tolist() == [1, 16, 1] and {t.dtype for t in (indptr, indices, last)} == {
        torch.int32}
