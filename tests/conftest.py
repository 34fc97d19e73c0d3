"""Test-suite switches. NANOSERVE_TEST_SPECULATIVE=ngram runs every engine the tests start with
speculative decoding on (unless a test sets speculative_method itself): the check that the whole
suite passes with it, `NANOSERVE_TEST_SPECULATIVE=ngram python -m pytest -q -m ""`.

The default model's fixtures that several test modules share (its directory, the chat prompts of
test_e2e.QUESTIONS, transformers' greedy outputs) live here, once per session: transformers'
outputs take seconds to compute on a CPU; so does a tiny random Qwen3 that starts in a second.
Promises about the engine's own machinery (preemption, chunks, the prefix cache, failed steps)
are checked on the tiny model, whose steps take milliseconds on a CPU where the default model's
take a tenth of a second: with its prompts and transformers' greedy tokens for them."""
import importlib.metadata
import os
import shutil

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from nanoserve.config import Config
from nanoserve.extensions.batch_invariant import CUBLAS_ENV
from nanoserve.weights import default_model_dir

# The README's command runs the tests in two pytest-xdist workers (`-n 2 --dist loadgroup`): each
# computes on its share of the cores, as do the processes its tests start, so that two workers on
# a 2-core machine do not fight over them (no result depends on the thread count)
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0))
                                                     // int(workers))))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# cuBLAS reads its workspace settings once a process, at its first product: set before any test,
# the ones batch_invariant=True needs, so its engines can be built after others in this process
for name, value in CUBLAS_ENV.items():
    os.environ.setdefault(name, value)

# Triton before 3.9 (3.6 on the GPU machines) converts a loaded scalar, a 1-element array in its
# interpreter, to a loop bound with int(), which NumPy 2.4 and later refuse; Triton 3.9 squeezes
# it first. The interpreted tests get the same fix on those versions, so they run the same there.
if os.environ.get("TRITON_INTERPRET") == "1":
    import triton
    from triton.runtime import interpreter

    if tuple(map(int, triton.__version__.split(".")[:2])) < (3, 9):
        _patch_lang_tensor = interpreter._patch_lang_tensor

        def _squeezed_index(tensor: type, scope: object) -> None:
            _patch_lang_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

        interpreter._patch_lang_tensor = _squeezed_index

if method := os.environ.get("NANOSERVE_TEST_SPECULATIVE"):
    _post_init = Config.__post_init__

    def _speculative_post_init(self: Config) -> None:
        if self.speculative_method is None:
            self.speculative_method = method
        _post_init(self)

    Config.__post_init__ = _speculative_post_init


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """With --dist loadgroup, a module's tests are an xdist group of their own unless they name
    one: one worker runs them, in order, and builds the module's fixtures (an engine, a server)
    once. Without a GPU, "gpu_memory" (the modules whose engines would share one GPU's memory)
    splits into its modules: pytest-xdist names a test's group by all its marks joined."""
    gpu = torch.cuda.is_available()
    for item in items:
        group = item.get_closest_marker("xdist_group")
        if group is None or (group.kwargs.get("name") == "gpu_memory" and not gpu):
            item.add_marker(pytest.mark.xdist_group(name=item.module.__name__))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, in the controller
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """With --dist loadgroup, stop if a worker's tests came back untagged with their groups:
    pytest-xdist would ignore the groups without a word, and split a module's tests up."""
    if node.config.getvalue("dist") == "loadgroup" and not all("@" in test_id for test_id in ids):
        pytest.exit(f"pytest-xdist {importlib.metadata.version('pytest-xdist')} did not tag the "
                    f"tests with their xdist groups under pytest {pytest.__version__} "
                    "(pytest-xdist issue 1386): install the test extra's pytest<9.2, or run "
                    "without -n", returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.fixture(scope="session")
def model_dir() -> str:
    return default_model_dir()


@pytest.fixture(scope="session")
def prompts(model_dir: str) -> list[list[int]]:
    """test_e2e.QUESTIONS as the default model's chat prompts, token ids."""
    from test_e2e import QUESTIONS
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) for q in QUESTIONS]


@pytest.fixture(scope="session")
def hf_model(model_dir: str):
    """The default model in transformers, float32: the full-precision reference."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_outputs(hf_model, prompts: list[list[int]]) -> list[list[int]]:
    """Transformers' greedy continuation of each prompt, one at a time (no padding)."""
    from test_e2e import MAX_TOKENS
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
            outs.append(out[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    """A random Qwen3-shaped model that starts in a second: 4 q / 2 KV heads, vocab 1001 (not a
    multiple of the rank count: the vocab-parallel padding is exercised), untied LM head."""
    path = str(tmp_path_factory.mktemp("tiny_qwen3"))
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1001,
                      max_position_embeddings=4096, tie_word_embeddings=False,
                      initializer_range=0.2)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(default_model_dir(), name), path)
    return path


TINY_MAX_TOKENS = 16  # the tiny model's greedy tokens per prompt, EOS ignored
# its engine on the CPU: its own max_model_len of 4,096 would size the cache to 65,536 blocks
# (256 sequences of 256 blocks), a Python object each, for seconds of start-up
TINY_ENGINE = dict(device="cpu", max_model_len=256)


@pytest.fixture(scope="session")
def tiny_prompts() -> list[list[int]]:
    """8 prompts of tiny_qwen3's token ids: a shared 32-token prefix (two blocks of 16, as the
    chat template's first blocks are for the default model's prompts), then 5 to 19 of their own
    (no special ids: 0-2)."""
    gen = torch.Generator().manual_seed(2)
    shared = torch.randint(3, 1001, (32,), generator=gen).tolist()
    return [shared + torch.randint(3, 1001, (5 + 2 * i,), generator=gen).tolist()
            for i in range(8)]


@pytest.fixture(scope="session")
def tiny_hf_outputs(tiny_qwen3: str, tiny_prompts: list[list[int]]) -> list[list[int]]:
    """Transformers' greedy TINY_MAX_TOKENS tokens of each tiny prompt, one at a time."""
    model = Qwen3ForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    with torch.no_grad():
        outs = [model.generate(torch.tensor([ids]), max_new_tokens=TINY_MAX_TOKENS,
                               min_new_tokens=TINY_MAX_TOKENS, do_sample=False)[0]
                for ids in tiny_prompts]
    return [out[len(ids):].tolist() for out, ids in zip(outs, tiny_prompts)]
