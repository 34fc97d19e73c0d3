"""Tensor parallelism on the CPU (gloo): same greedy output as one rank, clean failure, engines side
by side, nothing left in /dev/shm after shutdown. Every engine here runs on the CPU, also on a GPU
machine (there the tiny model's KV cache would be millions of blocks); test_gpu.py has TP on GPUs.
"""
import gc
import glob
import multiprocessing
import multiprocessing.context
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest
import torch

from nanoserve import LLM, SamplingParams

# with pytest-xdist, one worker runs these and test_server's (both start processes and share
# memory): /dev/shm's entries and the live children are then this worker's alone
pytestmark = pytest.mark.xdist_group(name="processes")

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPTS = [[1, 5, 9, 200, 31], [7] * 20, list(range(40, 77))]


@pytest.fixture(autouse=True)
def one_thread_per_worker(monkeypatch):
    """Spawned ranks take their thread count from OMP_NUM_THREADS as they start: one each, so two
    or three ranks on a 2-core machine do not spin against each other in every collective (this
    process keeps its threads). Greedy output does not depend on it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def greedy_ids(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def shm_entries() -> set[str]:
    """/dev/shm's entries but loky's semaphores (joblib's process pools, which an installed
    library may start). Where loky is imported it renames every multiprocessing semaphore
    sem.loky-<pid>-..., this process's too, so there this sees only the segments: engine_shm
    names an engine's own entries wherever it runs."""
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.loky-")}


def engine_shm(llm: LLM) -> set[str]:
    """A TP engine's own /dev/shm entries: its segment and its semaphores (the wake-ups, the error
    queue's), named from the objects, so what else the process makes is never counted."""
    workers, errors = llm.workers, llm.workers.errors
    sems = [*workers.wakeups, errors._sem, errors._rlock, errors._wlock]
    return {workers.shm.name} | {"sem." + sem._semlock.name.lstrip("/") for sem in sems}


def test_tp2_matches_tp1_on_tiny_qwen3_and_shutdown_leaves_no_shm(tiny_qwen3):
    """Two ranks give one rank's greedy tokens; a second TP engine in the same process is refused
    while the first runs; shutdown removes the semaphores and the segment the ranks shared."""
    with LLM(tiny_qwen3, max_model_len=256, device="cpu") as llm:
        expected = greedy_ids(llm)
    with LLM(tiny_qwen3, max_model_len=256, device="cpu", tensor_parallel_size=2) as llm:
        ours = engine_shm(llm)
        assert len(ours) == 5 and ours <= set(os.listdir("/dev/shm"))
        assert greedy_ids(llm) == expected
        with pytest.raises(RuntimeError, match="another process"):
            LLM(tiny_qwen3, max_model_len=256, device="cpu", tensor_parallel_size=2)
    assert not ours & set(os.listdir("/dev/shm"))


# the slow tail (as the fp8 one below): speculation is the default tests' of test_speculative.py,
# TP=2 test_tp2_matches_tp1's
@pytest.mark.slow
def test_tp2_with_speculative_decoding_matches_tp1(tiny_qwen3):
    """Drafts verified on two ranks: each runs the k + 1 rows a sequence, rank 0 samples them."""
    prompts = PROMPTS + [[3, 4, 5, 6] * 8]  # a loop: the lookup proposes
    with LLM(tiny_qwen3, max_model_len=256, device="cpu") as llm:
        expected = greedy_ids(llm, prompts)
    with LLM(tiny_qwen3, max_model_len=256, device="cpu", tensor_parallel_size=2,
             speculative_method="ngram", prompt_lookup_min=1) as llm:
        assert greedy_ids(llm, prompts) == expected
        assert llm.loop.stats.num_accepted_tokens > 0


# the slow tail: guided decoding's own tests and test_tp2_matches_tp1 by default
@pytest.mark.slow
def test_tp2_with_guided_decoding_matches_tp1(tiny_qwen3):
    """Masks on rank 0 only, where the tokens are sampled: the same guided greedy tokens as one
    rank, each a full match (the vocabulary is the tokenizer's first 1,001 ids: digits and "-"
    are among them)."""
    from nanoserve import GuidedDecodingParams
    regex = r"[0-9]{3}-[0-9]{4}"
    params = SamplingParams(temperature=0, max_tokens=20,
                            guided_decoding=GuidedDecodingParams(regex=regex))
    outs = {}
    for tp in (1, 2):
        with LLM(tiny_qwen3, max_model_len=256, device="cpu", tensor_parallel_size=tp) as llm:
            outs[tp] = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o["token_ids"] for o in outs[2]] == [o["token_ids"] for o in outs[1]]
    assert all(re.fullmatch(regex, o["text"]) for o in outs[2]), outs[2]


@pytest.mark.slow
def test_tp2_fp8_kv_cache_matches_tp1(tiny_qwen3):
    """An fp8 cache under tensor parallelism: each rank holds its KV heads in e4m3, and the
    logprobs are one rank's, where the full-precision cache's differ. The ranks sum in another
    order, and a float32 difference can flip one e4m3 rounding: hence medians over positions."""
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    outs = {}
    for kv, tp in (("auto", 1), ("fp8", 1), ("fp8", 2)):
        with LLM(tiny_qwen3, max_model_len=256, device="cpu", kv_cache_dtype=kv,
                 tensor_parallel_size=tp) as llm:
            outs[kv, tp] = llm.generate(PROMPTS, params, use_tqdm=False)
            if tp == 2:  # (k/v, layers, blocks, block size, KV heads of this rank, head dim)
                cache = llm.model_runner.kv_cache
                assert cache.dtype == torch.float8_e4m3fn and cache.shape[4] == 1
    tp2, full = moved(outs["fp8", 2], outs["fp8", 1]), moved(outs["fp8", 1], outs["auto", 1])
    print(f"median |delta logprob|: TP=2 against TP=1 {tp2:.1e}, fp8 against auto {full:.1e}")
    assert tp2 < 1e-4 and full > 1e-2


def moved(outs_a: list[dict], outs_b: list[dict]) -> float:
    """The median over positions of the largest |delta logprob| of the tokens both runs list there,
    up to the position where a sequence's tokens part."""
    deltas = []
    for a, b in zip(outs_a, outs_b):
        for tok_a, tok_b, lp_a, lp_b in zip(a["token_ids"], b["token_ids"], a["logprobs"],
                                            b["logprobs"]):
            deltas.append(max((abs(lp_a[t] - lp_b[t]) for t in lp_a.keys() & lp_b.keys()),
                              default=float("inf")))
            if tok_a != tok_b:
                break
    return statistics.median(deltas)


# the slow tail: by default, the tiny Qwen3's TP=2 tests check the split and the shared memory
@pytest.mark.slow
def test_tp3_matches_tp1_on_default_model_and_leaves_no_shm():
    # SmolLM2: 9 query / 3 KV heads, so each of 3 ranks holds 3 query heads and 1 KV head
    prompts = [[1, 9519, 28, 957, 1462, 314], [504, 3575, 282, 4649, 314]]
    with LLM(max_model_len=256, device="cpu") as llm:
        expected = greedy_ids(llm, prompts)
    with LLM(max_model_len=256, device="cpu", tensor_parallel_size=3) as llm:
        ours = engine_shm(llm)
        assert len(ours) == 6 and ours <= set(os.listdir("/dev/shm"))
        assert greedy_ids(llm, prompts) == expected
    assert not ours & set(os.listdir("/dev/shm"))  # semaphores and the segment are gone


# the slow tail (with the next three): test_worker_error_reaches_rank0 checks a failed worker
@pytest.mark.slow
def test_killed_worker_raises_and_cleans_up(tiny_qwen3):
    llm = LLM(tiny_qwen3, max_model_len=4096, device="cpu", tensor_parallel_size=2)
    ours, worker = engine_shm(llm), llm.workers.procs[0]
    threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="rank 1 .* exited with code -9"):
            llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=4000, ignore_eos=True),
                         use_tqdm=False)
        assert time.monotonic() - start < 30  # seconds, not a collective's timeout
    finally:
        llm.shutdown()  # also when the assertion fails: the next tests need the group gone
    assert not ours & set(os.listdir("/dev/shm")) and llm.workers is None
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[1, 2]], GREEDY)


TWO_ENGINES_SCRIPT = """
import os, sys, time
from nanoserve import LLM, SamplingParams
model, me, other = sys.argv[1:]
with LLM(model, max_model_len=256, device="cpu", tensor_parallel_size=2) as llm:
    open(me, "w").write(llm.workers.shm.name)
    deadline = time.time() + 120
    while not os.path.exists(other) and time.time() < deadline:  # both engines are up at once
        time.sleep(0.1)
    assert os.path.exists(other), "the other engine never came up"
    params = SamplingParams(temperature=0, max_tokens=8)
    out = llm.generate([[1, 5, 9, 200, 31]], params, use_tqdm=False)
    print(out[0]["token_ids"])
"""


@pytest.mark.slow
def test_two_tp_engines_side_by_side(tiny_qwen3, tmp_path):
    """Two engines in two processes, alive at once: each has its own shared memory and port."""
    before = set(glob.glob("/dev/shm/nanoserve-*"))
    ready = [str(tmp_path / "a"), str(tmp_path / "b")]
    procs = [subprocess.Popen([sys.executable, "-c", TWO_ENGINES_SCRIPT, tiny_qwen3, me, other],
                              stdout=subprocess.PIPE, text=True)
             for me, other in (ready, ready[::-1])]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert open(ready[0]).read() != open(ready[1]).read()  # distinct shared-memory segments
    assert outs[0] == outs[1] and outs[0].startswith("[")
    assert set(glob.glob("/dev/shm/nanoserve-*")) == before


@pytest.mark.slow
def test_a_worker_that_fails_to_start_stops_the_others(monkeypatch):
    start, calls = multiprocessing.context.SpawnProcess.start, []

    def failing_start(proc):  # rank 1 starts, rank 2 does not
        calls.append(proc)
        if len(calls) == 2:
            raise OSError("simulated failure to start a process")
        start(proc)
    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", failing_start)
    before = shm_entries()
    with pytest.raises(OSError, match="simulated"):
        LLM(None, max_model_len=256, device="cpu", tensor_parallel_size=3)
    calls.clear()  # the Process objects hold the semaphores, which live until collected
    gc.collect()
    assert not multiprocessing.active_children() and shm_entries() - before == set()


UNGUARDED_SCRIPT = """
from nanoserve import LLM
# no `if __name__ == "__main__":` guard
LLM({model!r}, max_model_len=256, device="cpu", tensor_parallel_size=2)
"""


@pytest.mark.slow
def test_a_worker_that_dies_starting_fails_at_once(tiny_qwen3, tmp_path):
    """A script that starts a TP engine without the `__main__` guard: spawn runs it again in the
    worker, which dies before the rendezvous. Rank 0 raises within seconds, not after the
    rendezvous' timeout (DIST_TIMEOUT), and the worker's own traceback names the guard."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT.format(model=tiny_qwen3))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 1 and time.monotonic() - start < 60, proc.stderr[-3000:]
    assert re.search(r"worker failed.*\nrank 1 \(pid \d+\) exited with code 1", proc.stderr)
    assert "if __name__ == '__main__'" in proc.stderr  # spawn's message, from the worker


@pytest.mark.slow  # an error path, like the tail's other worker failures: only the tail runs it
def test_worker_error_reaches_rank0(tiny_qwen3):
    """A worker that raises (asked for a method it lacks) exits; rank 0 raises its traceback."""
    llm = LLM(tiny_qwen3, max_model_len=256, device="cpu", tensor_parallel_size=2)
    try:
        llm.workers.call("no_such_method")
        llm.workers.procs[0].join(timeout=30)  # the worker reports and exits at once
        with pytest.raises(RuntimeError, match="(?s)rank 1.*no_such_method"):
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert llm.workers is None
