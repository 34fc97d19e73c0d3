"""guided_hook.py: the guided hook's host time alone, and its xgrammar parts (a developer tool).

No model: the Guided extension is built on a stand-in engine (the tokenizer of --tokenizer, the
GPU if there is one) and its before_sample runs on random logits, each row then taking the argmax
of its masked logits plus noise, so the outputs wander through bench.guided_schema as W1's do.
Printed, in µs, medians over the timed steps:
- before_sample at 1 row, and at --rows rows under one schema and under a schema each, for each
  file of --variants (guided.py trees: `git show REV:nanoserve/extensions/guided.py > f.py`),
  the variants taking turns --repeat times;
- at --rows rows --depth tokens into the schema: taking one token each (accept_token one by one,
  batch_accept_token), and filling the masks on the engine's thread, on a pool of 1-8 threads
  made once (rows split as the hook splits them), and on xgrammar's own pool of 8;
- on a GPU, the launches of one row's masking: the copy, an event, xgrammar's kernel.

    python tools/guided_hook.py --tokenizer DIR [--variants a.py,b.py] [--rows 256] [--repeat 2]
"""
import argparse
import functools
import importlib.util
import json
import operator
import statistics
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import guided_schema  # noqa: E402
from nanoserve.config import SamplingParams  # noqa: E402
from nanoserve.extensions.guided import GuidedDecodingParams, parse  # noqa: E402
from nanoserve.sequence import Sequence  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize() -> None:
    """Wait for the GPU's queued work, so that a timed call starts on an idle GPU."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def median_us(fn, runs: int = 30) -> float:
    times = []
    for _ in range(runs):
        synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(1e6 * statistics.median(times), 1)


def stand_in(tokenizer, rows: int) -> types.SimpleNamespace:
    """What Guided reads of an engine: its config, device, stop tokens and tokenizer."""
    cfg = types.SimpleNamespace(max_num_seqs=rows, num_speculative_tokens=0,
                                speculative_method=None,
                                hf_config=types.SimpleNamespace(vocab_size=len(tokenizer)))
    return types.SimpleNamespace(config=cfg, model_runner=types.SimpleNamespace(device=DEVICE),
                                 scheduler=types.SimpleNamespace(
                                     eos_token_ids=[tokenizer.eos_token_id]), tokenizer=tokenizer)


def run_hook(module, tokenizer, rows: int, each: bool,
             steps: int) -> tuple[list[float], list[Sequence]]:
    """before_sample's seconds at each of `steps` steps, and the sequences it guided."""
    ext = module.Guided(stand_in(tokenizer, rows))
    prompt = tokenizer.encode("Give a list of people as JSON.")
    seqs = [Sequence(prompt, SamplingParams(temperature=0, max_tokens=10_000, guided_decoding=(
        module.GuidedDecodingParams(json=guided_schema(f"k{i}" if each else "name")))), 16)
        for i in range(rows)]
    for seq in seqs:
        ext.on_request(seq, streamed=False)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    base = torch.randn(rows, len(tokenizer), device=DEVICE, generator=gen)
    times = []
    for _ in range(steps):
        logits = base + 4 * torch.rand(base.shape, device=DEVICE, generator=gen)
        synchronize()
        start = time.perf_counter()
        masked = ext.before_sample(logits, seqs)
        times.append(time.perf_counter() - start)
        for seq, token in zip(seqs, masked.argmax(-1).tolist()):
            seq.token_ids.append(token)
    return times, seqs


def hook_us(module, tokenizer, rows: int, each: bool, warm: int = 40, steps: int = 80) -> float:
    """before_sample's median over `steps` steps, after `warm` untimed ones."""
    times, _ = run_hook(module, tokenizer, rows, each, warm + steps)
    return round(1e6 * statistics.median(times[warm:]), 1)


def allowed(matcher: xgr.GrammarMatcher, vocab: int) -> np.ndarray:
    mask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(mask)
    return np.flatnonzero(np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[:vocab])


def compiler_for(tokenizer) -> xgr.GrammarCompiler:
    """A grammar compiler on the tokenizer's vocabulary and stop token, as the extension's."""
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]))


def parts_us(compiler, tokenizer, rows: int, depth: int, each: bool) -> dict:
    """xgrammar's share of a step at `rows` rows, `depth` tokens into the schema (compiled as
    the extension compiles it)."""
    sources = [GuidedDecodingParams(json=guided_schema(f"k{i}" if each else "name")).source
               for i in range(rows)]
    matchers = [xgr.GrammarMatcher(compiler.compile_grammar(parse(*source))) for source in sources]
    rng, vocab = np.random.default_rng(0), len(tokenizer)
    for matcher in matchers:
        for _ in range(depth):
            assert matcher.accept_token(int(rng.choice(allowed(matcher, vocab))))
    tokens = [int(allowed(m, vocab)[0]) for m in matchers]

    def take_one_by_one():
        for matcher, token in zip(matchers, tokens):
            matcher.accept_token(token)

    def take_batched():
        xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    bitmask, index = xgr.allocate_token_bitmask(rows, vocab), list(range(rows))
    out = {}
    for name, take in (("take_one_by_one", take_one_by_one), ("take_batched", take_batched)):
        out[name] = median_us(lambda take=take: take() or [m.rollback(1) for m in matchers])
    fillers = [xgr.BatchGrammarMatcher(max_threads=1) for _ in range(8)]
    pool = ThreadPoolExecutor(8)
    fills = {n: [functools.partial(f.batch_fill_next_token_bitmask, matchers[j::n], bitmask,
                                   index[j::n]) for j, f in enumerate(fillers[:n])]
             for n in (1, 2, 4, 8)}
    out["fill_engine_thread"] = median_us(lambda: fills[1][0]())
    for n, calls in fills.items():
        out[f"fill_pool_{n}"] = median_us(
            lambda calls=calls: list(pool.map(operator.call, calls)))
    xgr_pool = xgr.BatchGrammarMatcher(max_threads=8)
    out["fill_xgrammar_pool_8"] = median_us(
        lambda: xgr_pool.batch_fill_next_token_bitmask(matchers, bitmask, index))
    pool.shutdown()
    return out


def launches_us(vocab: int) -> dict:
    """One row's masking on the GPU: host time of each launch."""
    pinned = xgr.allocate_token_bitmask(1, vocab).pin_memory()
    logits, on_device = torch.randn(1, vocab, device=DEVICE), pinned.to(DEVICE)
    return {"copy_to_device": median_us(lambda: pinned.to(DEVICE, non_blocking=True), 200),
            "record_event": median_us(lambda: torch.cuda.current_stream().record_event(), 200),
            "xgrammar_apply": median_us(lambda: xgr.apply_token_bitmask_inplace(
                logits, on_device, vocab_size=vocab), 200)}


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"guided_variant_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True, help="a directory of tokenizer files")
    p.add_argument("--variants", default=str(Path(__file__).resolve().parents[1] /
                                            "nanoserve/extensions/guided.py"),
                   help="comma list of guided.py files (default: this tree's)")
    p.add_argument("--rows", type=int, default=256, help="guided rows of the large batch (256)")
    p.add_argument("--depth", type=int, default=30, help="tokens into the schema for the parts")
    p.add_argument("--repeat", type=int, default=2, help="turns of the variants (2)")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    modules = {path: load(path) for path in args.variants.split(",")}
    hook = {}
    for _ in range(args.repeat):
        for rows, each in ((1, False), (args.rows, False), (args.rows, True)):
            for path, module in modules.items():
                key = f"{Path(path).name} {rows} rows, {'a schema each' if each else 'one schema'}"
                hook.setdefault(key, []).append(hook_us(module, tokenizer, rows, each))
                print(key, hook[key], flush=True)
    compiler = compiler_for(tokenizer)
    figures = {"device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
               "before_sample_us": hook}
    for each in (False, True):
        key = f"parts_{'each' if each else 'one'}_{args.rows}_rows_depth_{args.depth}_us"
        figures[key] = parts_us(compiler, tokenizer, args.rows, args.depth, each)
        print(key, figures[key], flush=True)
    if DEVICE.type == "cuda":
        figures["one_row_launches_us"] = launches_us(len(tokenizer))
        print("one_row_launches_us", figures["one_row_launches_us"])
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
