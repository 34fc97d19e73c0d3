"""bench_serve.py: online serving latency and throughput, as vLLM's `bench serve` measures them.

A streaming aiohttp client sends /v1/completions requests from a random dataset (prompt and output
lengths drawn uniformly between a min and a max, prompt ids randint(0, 10000), a seed: bench.py's
make_w1), either all at once (--request-rate inf) or with Poisson arrivals (exponential gaps at
the rate), optionally at most --max-concurrency in flight. Each request asks for exactly its
output length (ignore_eos where the server takes it) at temperature 0.6, and records:
  TTFT  time to first token: from sending the request to its first text chunk
  ITL   inter-token latency: the gaps between its chunks (one chunk is one token, unless the
        server coalesced a late reader's tokens)
  TPOT  time per output token after the first: (E2E - TTFT) / (output tokens - 1)
  E2E   end-to-end latency: from sending to the last chunk
The report gives mean, p50 and p99 of each, request and output throughput over the run's wall
time (first send to last chunk), and goodput: the requests per second that met the SLO (TTFT <=
--slo-ttft-ms, 500, and the request's own ITL p99 <= --slo-itl-ms, 100), with the share that met
it. Over the Poisson rates, the summary names each server's highest rate at which 90% met it.

Servers. With --url the client measures a server that is already running. Without it, it starts
each of --servers in turn, waits for it, warms it up (bench.warmup_workload: as many prompts of
the same lengths, 1-16 output tokens), runs every --request-rates entry, and stops it:
  nanoserve     python -m nanoserve.server (prompts as token ids, usage in the last chunk)
  transformers  transformers serve --continuous-batching (string prompts only: with the random
                Qwen3's word-per-id tokenizer a prompt is written "<12> <345> ...")
--w1 also sends nano-vllm's W1 (bench.py) to nanoserve all at once and times its offline
LLM.generate on W1 and on the main requests, in a process of its own (the saturation references,
with the offline decode step's period as a W1 token sees it); --repeat N runs W1 and the main
requests all at once N times, each repeat relabeled so the prefix cache has not seen it, as the
offline repeats are; --sequential also sends them one at a time. With nanoserve, /metrics is
read every half second of a run: each replica's mean running requests show that all are busy.
Results go to results/ (git-ignored): results/serving.json, or the preset's file; --out PATH
(or --json PATH) writes them elsewhere, --plot PATH draws latency against request rate for every
server. The files in docs/ change only when their path is given:
  python bench_serve.py --preset cpu                    # CPU: default model, 16 requests
  python bench_serve.py --preset h100                   # GPU: random Qwen3-0.6B, both servers
  python bench_serve.py --preset cpu --out docs/serving_cpu.json   # refresh the docs' figures
  python bench_serve.py --url http://127.0.0.1:8000 --model NAME --num-prompts 64
"""
import argparse
import asyncio
import concurrent.futures
import json
import math
import multiprocessing
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter
from prometheus_client.parser import text_string_to_metric_families

import bench
from bench_utils import build_random_qwen3, git_commit, hardware_info, log

SERVER_START_TIMEOUT_S = 600  # model load and CUDA graph capture, or transformers' first load
POLL_S = 0.5
STOP_TIMEOUT_S = 60
REQUEST_TIMEOUT_S = 3 * 3600
PERCENTILES = (50, 99)
SLO_ATTAINMENT = 0.9  # the share of requests that must meet the SLO at a rate
METRICS_POLL_S = 0.5
FIRST_PORT = 8100
RESULTS_DIR = "results"  # a run's files unless a path is given (git-ignored)
OFFLINE_RUNS = 3  # offline runs of each workload, at least: their median
MIN_RATE_PROMPTS = 10  # the fewest requests of a Poisson run with --rate-seconds

# One run's settings per preset; any flag given on the command line wins. Their files go to
# RESULTS_DIR: docs/serving_*.json are refreshed only by naming them (--out docs/...).
PRESETS = {
    "cpu": dict(servers="nanoserve", num_prompts=16, min_input_len=32, max_input_len=128,
                min_output_len=32, max_output_len=128, request_rates="inf", sequential=True,
                json=f"{RESULTS_DIR}/serving_cpu.json"),
    "h100": dict(servers="nanoserve,transformers", num_prompts=64, min_input_len=100,
                 max_input_len=1024, min_output_len=100, max_output_len=512,
                 request_rates="inf,0.5,1,2", rate_prompts=20, rate_max_output_len=256,
                 w1=True, random_model="qwen3-0.6b", json=f"{RESULTS_DIR}/serving_h100.json",
                 plot=f"{RESULTS_DIR}/serving.png"),
}
PRESET_HELP = {  # one phrase per preset, for --help
    "cpu": "the default model on the CPU, 16 requests all at once, then one at a time",
    "h100": "a random Qwen3-0.6B on a GPU, nanoserve and transformers serve: W1 and offline, "
            "64 requests all at once, Poisson rates 0.5, 1, 2 (and a chart)",
}


# ----------------------------------------------------------------------------- the client
@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)

    def meets(self, slo_ttft_ms: float, slo_itl_ms: float) -> bool:
        """Done, its first token within slo_ttft_ms and its own ITL p99 within slo_itl_ms."""
        itl_p99 = float(np.percentile(self.itl, 99)) * 1e3 if self.itl else 0.0
        return self.ok and self.ttft * 1e3 <= slo_ttft_ms and itl_p99 <= slo_itl_ms


@dataclass
class Server:
    name: str  # "nanoserve" or "transformers"
    url: str
    model: str  # the `model` field of a request

    def body(self, prompt: list[int], max_tokens: int, wl: bench.Workload | None = None) -> dict:
        """A streaming /v1/completions request for max_tokens tokens (exactly, where the
        workload ignores EOS, as random ones do), at the workload's temperature."""
        temperature, ignore_eos = (wl.temperature, wl.ignore_eos) if wl else (bench.TEMPERATURE,
                                                                              True)
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": temperature,
                "stream": True}
        if self.name == "transformers":  # string prompts only; refuses unknown fields (422)
            return body | {"prompt": " ".join(f"<{i}>" for i in prompt)}
        # usage in every chunk: a chunk may carry several tokens (speculative decoding)
        return body | {"prompt": prompt, "ignore_eos": ignore_eos,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def send(session: aiohttp.ClientSession, server: Server, prompt: list[int],
               max_tokens: int, wl: bench.Workload | None = None) -> RequestResult:
    """One streamed request, timed chunk by chunk. A chunk of n tokens (the usage in every chunk
    tells, where the server gives it) spreads its gap over n inter-token latencies."""
    result, chunks, tokens = RequestResult(prompt_len=len(prompt)), 0, 0
    start = last = time.perf_counter()
    try:
        async with session.post(f"{server.url}/v1/completions",
                                json=server.body(prompt, max_tokens, wl)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                choice = (chunk.get("choices") or [{}])[0]
                if not (choice.get("text") or (choice.get("delta") or {}).get("content")):
                    continue
                now = time.perf_counter()
                new = max(1, result.output_tokens - tokens) if chunk.get("usage") else 1
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl += [(now - last) / new] * new
                chunks, last, tokens = chunks + 1, now, tokens + new
        result.e2e = last - start
        # without usage (transformers serve), count chunks: it sends one token per chunk
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: 0 for all at once, else Poisson arrivals."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return rng.exponential(1.0 / rate, size=n).tolist()


async def sample_running(session: aiohttp.ClientSession, url: str,
                         samples: dict[str, list[float]]) -> None:
    """Each replica's running requests from nanoserve's /metrics, every METRICS_POLL_S."""
    while True:
        async with session.get(f"{url}/metrics") as resp:
            for family in text_string_to_metric_families(await resp.text()):
                if family.name == "nanoserve_num_requests_running":
                    for sample in family.samples:
                        if (rank := sample.labels["replica"]) != "total":
                            samples.setdefault(rank, []).append(sample.value)
        await asyncio.sleep(METRICS_POLL_S)


async def run_load(server: Server, wl: bench.Workload, rate: float, max_concurrency: int | None,
                   seed: int) -> tuple[list[RequestResult], float, dict[str, float]]:
    """Send every request of wl at the arrival times; results in request order, wall seconds,
    and (nanoserve) each replica's mean running requests over the run."""
    limit = asyncio.Semaphore(max_concurrency or len(wl.prompts))
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)  # no pool limit: concurrency is the semaphore's

    async def limited(session: aiohttp.ClientSession, prompt: list[int], n: int) -> RequestResult:
        async with limit:
            return await send(session, server, prompt, n, wl)

    samples: dict[str, list[float]] = {}
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        poll = asyncio.create_task(sample_running(session, server.url, samples)) if (
            server.name == "nanoserve") else None
        tasks, start = [], time.perf_counter()
        for gap, prompt, n in zip(arrival_gaps(len(wl.prompts), rate, seed), wl.prompts,
                                  wl.output_lens):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(session, prompt, n)))
        results = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
        if poll is not None:
            poll.cancel()
    return list(results), seconds, {rank: round(statistics.mean(values), 1)
                                    for rank, values in sorted(samples.items())}


# ----------------------------------------------------------------------------- statistics
def stats_ms(values: list[float]) -> dict[str, float | None]:
    """mean, p50 and p99 of seconds, in milliseconds (numpy's linear-interpolated percentiles)."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values) * 1000
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p))
                                         for p in PERCENTILES}}


def summarize(results: list[RequestResult], seconds: float, slo: tuple[float, float]) -> dict:
    """One run's figures: throughput and goodput over its wall time, latency statistics."""
    done, met = [r for r in results if r.ok], sum(r.meets(*slo) for r in results)
    output_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {"completed": len(done), "failed": len(results) - len(done),
            "errors": sorted({r.error for r in results if r.error})[:3],
            "seconds": seconds, "output_tokens": output_tokens,
            "request_throughput": len(done) / seconds,
            "output_throughput": output_tokens / seconds, "goodput": met / seconds,
            "slo_attainment": met / max(len(results), 1),
            "ttft_ms": stats_ms([r.ttft for r in done]), "tpot_ms": stats_ms(tpot),
            "itl_ms": stats_ms([gap for r in done for gap in r.itl]),
            "e2e_ms": stats_ms([r.e2e for r in done])}


def fmt_ms(s: dict) -> str:
    return "/".join("-" if s[k] is None else f"{s[k]:.1f}" for k in ("mean", "p50", "p99"))


def report(label: str, s: dict) -> None:
    log(f"   {label}: {s['completed']} done, {s['failed']} failed, {s['seconds']:.2f} s, "
        f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:,.1f} output tokens/s; "
        f"ms mean/p50/p99: TTFT {fmt_ms(s['ttft_ms'])}, TPOT {fmt_ms(s['tpot_ms'])}, "
        f"ITL {fmt_ms(s['itl_ms'])}, E2E {fmt_ms(s['e2e_ms'])}; goodput {s['goodput']:.2f} "
        f"req/s ({100 * s['slo_attainment']:.0f}% met the SLO)"
        + (f"; replicas' mean running {s['replicas_running']}" if s.get("replicas_running") else "")
        + (f"; errors {s['errors']}" if s["errors"] else ""))


# ----------------------------------------------------------------------------- the servers
def server_command(name: str, model_dir: str, port: int, device: str,
                   extra: str = "") -> list[str]:
    if name == "nanoserve":  # served under its directory, as transformers serve names it
        cmd = [sys.executable, "-m", "nanoserve.server", "--model", model_dir,
               "--served-model-name", model_dir, "--port", str(port), "--log-level", "warning"]
        return cmd + (["--device", "cpu"] if device == "cpu" else []) + shlex.split(extra)
    dtype = "bfloat16" if device == "cuda" else "float32"  # what nanoserve's "auto" picks
    return [sys.executable, "-m", "transformers.cli.transformers", "serve", model_dir,
            "--continuous-batching", "--port", str(port), "--device", device, "--dtype", dtype]


def wait_until_up(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    """Until the server answers HTTP at all (transformers serve may lack /health)."""
    import urllib.error
    import urllib.request
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n"
                               f"{log_path.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=5)
            return
        except urllib.error.HTTPError:  # an answer, even a 404, means it is listening
            return
        except OSError:
            time.sleep(POLL_S)
    raise RuntimeError(f"the server did not start in {SERVER_START_TIMEOUT_S} s")


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM, as an orchestrator stops a server; SIGKILL if it does not exit in time."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# ----------------------------------------------------------------------------- the offline peer
def in_subprocess(fn, *args):
    """fn(*args) in a fresh process: its GPU memory is all returned before a server starts."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(fn, *args).result()


def offline_figures(model_dir: str, workloads: list[bench.Workload], device: str) -> dict:
    """LLM.generate on all of each workload at once, after bench.py's warm-up (one engine): the
    median wall seconds of at least OFFLINE_RUNS runs (bench.time_runs: repeats relabeled, new
    to the prefix cache), and the first workload's decode step period as its tokens see it
    (bench.FirstTokens.decode_step_ms)."""
    engine_args, figures = argparse.Namespace(eager=False, tp=1), {}
    with bench.nanoserve_engine(model_dir, workloads[0], engine_args, device) as generate:
        generate(bench.warmup_workload(workloads[0]))
        for wl in workloads:
            runs, lengths = bench.time_runs(generate, wl, device, min_runs=OFFLINE_RUNS)
            assert lengths == wl.output_lens, "offline: a request returned another token count"
            figures[f"offline_{wl.name}_tokens_per_s"] = wl.output_tokens / statistics.median(runs)
            if wl is workloads[0]:
                figures["offline_decode_step_ms"] = generate.first_tokens[-1].decode_step_ms()
    return figures


# ----------------------------------------------------------------------------- a whole run
@dataclass
class Run:
    label: str  # what the run is for: "w1", "all at once", "poisson", "one at a time"
    workload: bench.Workload
    rate: float
    max_concurrency: int | None = None


def workloads(args: argparse.Namespace) -> tuple[bench.Workload, bench.Workload]:
    """The main workload, and the (smaller) one the finite Poisson rates run: random prompts, or
    bench.py's edit or chat prompts (real text, greedy, ending at EOS) for both."""
    if args.workload != "random":
        import bench_prompts
        texts = bench_prompts.EDITING if args.workload == "edit" else bench_prompts.CHAT
        from nanoserve.weights import default_model_dir  # its tokenizer: the chat template
        main = bench.make_text(args.workload, texts, args.num_prompts, args.max_output_len,
                               getattr(args, "model_dir", None) or default_model_dir())
        return main, main
    main = bench.make_w1(args.num_prompts, args.min_input_len, args.max_input_len,
                         args.min_output_len, args.max_output_len, args.seed)
    rated = bench.make_w1(args.rate_prompts or args.num_prompts, args.min_input_len,
                          args.max_input_len, args.min_output_len,
                          args.rate_max_output_len or args.max_output_len, args.seed)
    main.name, rated.name = "main", "rated"
    return main, rated


def repeats(wl: bench.Workload, n: int) -> list[bench.Workload]:
    """wl, then n - 1 relabeled copies (bench.relabeled): prompts the prefix cache has not seen,
    as bench.time_runs repeats the offline runs."""
    return [wl] + [bench.relabeled(wl, i) for i in range(1, n)]


def plan_runs(args: argparse.Namespace, server: str) -> list[Run]:
    main, rated = workloads(args)
    w1 = bench.make_w1(args.w1_prompts) if args.w1 and server == "nanoserve" else None
    runs = [Run("w1", wl, math.inf) for wl in repeats(w1, args.repeat)] if w1 else []
    for rate in (float(r) for r in args.request_rates.split(",")):
        if math.isinf(rate):
            runs += [Run("all at once", wl, rate, args.max_concurrency)
                     for wl in repeats(main, args.repeat)]
        elif args.rate_seconds:  # as many requests as the rate brings in that time
            n = max(MIN_RATE_PROMPTS, round(rate * args.rate_seconds))
            wl = bench.make_w1(n, args.min_input_len, args.max_input_len, args.min_output_len,
                               args.rate_max_output_len or args.max_output_len, args.seed)
            runs.append(Run("poisson", wl, rate, args.max_concurrency))
        else:
            runs.append(Run("poisson", rated, rate, args.max_concurrency))
    if args.sequential:
        runs.append(Run("one at a time", main, math.inf, 1))
    return runs


def run_one(server: Server, run: Run, seed: int, slo: tuple[float, float]) -> dict:
    log(f"-- {server.name}: {run.label}, {len(run.workload.prompts)} requests, "
        f"{run.workload.output_tokens:,} output tokens, rate {run.rate} req/s, "
        f"max concurrency {run.max_concurrency or 'none'}")
    results, seconds, running = asyncio.run(run_load(server, run.workload, run.rate,
                                                     run.max_concurrency, seed))
    summary = summarize(results, seconds, slo) | {"replicas_running": running}
    report(run.label, summary)
    short = run.workload.ignore_eos and sum(
        r.ok and r.output_tokens != n for r, n in zip(results, run.workload.output_lens))
    if short:
        log(f"   {short} requests returned another token count than asked")
    return {"server": server.name, "label": run.label, "workload": run.workload.description,
            "rate": run.rate, "max_concurrency": run.max_concurrency,
            "requests_short": short, **summary}


def serve_and_measure(name: str, model_dir: str, args: argparse.Namespace, device: str,
                      port: int, record) -> None:
    """Start one server, warm it up, run its plan, stop it; record(row) after each run."""
    log_path = Path(args.log_dir) / f"serve_{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_path, "w") as out:
        cmd = server_command(name, model_dir, port, device, args.nanoserve_args)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = Server(name, f"http://127.0.0.1:{port}", model_dir)
    try:
        wait_until_up(proc, server.url, log_path)
        runs = plan_runs(args, name)
        warm = bench.warmup_workload(runs[0].workload)
        results, seconds, _ = asyncio.run(run_load(server, warm, math.inf, None, args.seed))
        log(f"== {name} up and warm in {time.perf_counter() - start:.1f} s (warm-up: "
            f"{sum(r.ok for r in results)}/{len(results)} requests in {seconds:.1f} s)")
        for run in runs:
            record(run_one(server, run, args.seed, (args.slo_ttft_ms, args.slo_itl_ms)))
    finally:
        log(f"   {name} stopped, exit code {stop(proc)}")


# ----------------------------------------------------------------------------- output
def plot(rows: list[dict], meta: dict, path: str) -> None:
    """p50 and p99 TTFT and ITL, and goodput, against the Poisson request rate, one line per
    server."""
    fig = Figure(figsize=(16, 4.5), layout="constrained")
    axes = fig.subplots(1, 3)
    for server, color in zip(dict.fromkeys(r["server"] for r in rows), ("C0", "C1", "C2")):
        points = sorted((r["rate"], r) for r in rows
                        if r["server"] == server and r["label"] == "poisson")
        rates = [rate for rate, _ in points]
        for ax, metric in zip(axes, ("ttft_ms", "itl_ms")):
            for p, style in (("p50", "-o"), ("p99", "--x")):
                ax.plot(rates, [r[metric][p] for _, r in points], style, color=color,
                        label=f"{server} {p}")
        axes[2].plot(rates, [r.get("goodput", 0) for _, r in points], "-o", color=color,
                     label=f"{server}")
    rates = sorted({r["rate"] for r in rows if r["label"] == "poisson"})
    slo = meta.get("slo", {})
    axes[2].plot(rates, rates, ":", color="gray", label="every request meets the SLO")
    axes[2].set(title=f"goodput (TTFT <= {slo.get('ttft_ms', 500):g} ms, ITL p99 <= "
                      f"{slo.get('itl_ms', 100):g} ms)", xlabel="request rate (requests/s, "
                "Poisson arrivals)", ylabel="requests/s meeting the SLO", xscale="log")
    axes[2].set_xticks(rates, [f"{r:g}" for r in rates])
    axes[2].xaxis.set_minor_formatter(NullFormatter())
    axes[2].grid(alpha=0.3, which="both")
    axes[2].legend(fontsize=8)
    for ax, title in zip(axes, ("time to first token", "inter-token latency")):
        ax.set(title=title, xlabel="request rate (requests/s, Poisson arrivals)",
               ylabel="ms (log scale)", xscale="log", yscale="log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))  # 1, 2, 5, 10, 20, 50...
        ax.yaxis.set_major_formatter(StrMethodFormatter("{x:,g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    hw = meta["hardware"]
    fig.suptitle(f"Serving latency against request rate · {hw.get('gpu', 'CPU')} · model "
                 f"{Path(meta['model']).name} · commit {hw.get('commit', '?')}", fontsize=11)
    FigureCanvasAgg(fig)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def merge_results(paths: list[str]) -> tuple[list[dict], dict]:
    """The runs of --json files, each server's taken from the last file that has it; the
    conditions (meta) of the last file."""
    by_server, meta = {}, {}
    for path in paths:
        saved = json.loads(Path(path).read_text())
        for server in dict.fromkeys(r["server"] for r in saved["runs"]):
            by_server[server] = [r for r in saved["runs"] if r["server"] == server]
        meta = saved["meta"]
    return [r for rows in by_server.values() for r in rows], meta


def print_table(rows: list[dict]) -> None:
    log(f"\n{'server':13s} {'run':14s} {'rate':>5s} {'req/s':>6s} {'out tok/s':>10s} "
        f"{'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} {'ITL p99':>8s} {'E2E p50':>9s}")
    for r in rows:
        log(f"{r['server']:13s} {r['label']:14s} {r['rate']:>5g} "
            f"{r['request_throughput']:>6.2f} {r['output_throughput']:>10,.0f} "
            + " ".join(f"{r[m][p] or 0:>{w},.1f}" for m, p, w in (
                ("ttft_ms", "p50", 9), ("ttft_ms", "p99", 9), ("itl_ms", "p50", 8),
                ("itl_ms", "p99", 8), ("e2e_ms", "p50", 9))))


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=list(PRESETS),
                   help="a whole run's settings (flags given still win): " + "; ".join(
                       f"{name}: {text}" for name, text in PRESET_HELP.items()))
    p.add_argument("--url", help="measure this running server instead of starting --servers")
    p.add_argument("--server-kind", default="nanoserve", choices=["nanoserve", "transformers"],
                   help="with --url: how to write requests for it")
    p.add_argument("--model-name", help="with --url: the requests' model (default: its first)")
    p.add_argument("--servers", default="nanoserve", help="comma list: nanoserve,transformers")
    p.add_argument("--nanoserve-args", default="",
                   help='more flags for nanoserve\'s server, e.g. "--data-parallel-size 2"')
    p.add_argument("--model", help="model directory (default: the packaged SmolLM2)")
    p.add_argument("--random-model", choices=["qwen3-0.6b", "tiny"],
                   help="build a random-weight Qwen3 (bench.py's shapes) and serve it")
    p.add_argument("--workload", default="random", choices=["random", "edit", "chat"],
                   help="random token ids (--*-len), or bench.py's edit or chat prompts (real "
                        "text, the default model's chat template; --max-output-len: max_tokens)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=100)
    p.add_argument("--max-output-len", type=int, default=512)
    p.add_argument("--request-rates", default="inf",
                   help="comma list of requests/s; inf: all at once (the main workload)")
    p.add_argument("--rate-prompts", type=int, help="requests of each finite rate's run")
    p.add_argument("--rate-seconds", type=float, help="instead: each finite rate's run sends "
                   f"rate x this many requests (at least {MIN_RATE_PROMPTS})")
    p.add_argument("--rate-max-output-len", type=int, help="output max of finite rates' runs")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight")
    p.add_argument("--sequential", action="store_true", help="also run the main requests one "
                   "at a time")
    p.add_argument("--repeat", type=int, default=1, help="runs of W1 and of the main requests "
                   "all at once (repeats relabeled: new to the prefix cache)")
    p.add_argument("--slo-ttft-ms", type=float, default=500, help="goodput's TTFT bound")
    p.add_argument("--slo-itl-ms", type=float, default=100,
                   help="goodput's bound on a request's own ITL p99")
    p.add_argument("--w1", action="store_true", help="also W1 through nanoserve, and W1 and the "
                   "main requests offline")
    p.add_argument("--w1-prompts", type=int, default=256, help="W1's first this many requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="serve on the CPU even with a GPU")
    p.add_argument("--out", "--json", dest="json", metavar="PATH",
                   default=f"{RESULTS_DIR}/serving.json",
                   help=f"write the runs and their conditions here (default: {RESULTS_DIR}/"
                        "serving.json, or the preset's file in it)")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of latency against request rate "
                   f"(--preset h100: {RESULTS_DIR}/serving.png; --plot-from: the same)")
    p.add_argument("--log-dir", default=RESULTS_DIR, help="where the servers' logs go")
    p.add_argument("--plot-from", help="run nothing: draw --plot from --json file(s), comma "
                   "separated; a server's runs come from the last file that has it")
    first, _ = p.parse_known_args(argv)
    if first.preset:  # the preset's values become defaults: flags given still win
        p.set_defaults(**PRESETS[first.preset])
    args = p.parse_args(argv)
    check_lengths(p, args)
    return args


def check_lengths(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stop before any server starts on a count below 1 or, with random prompts, a length range
    whose minimum passes its maximum (a preset sets both ends: lowering one may need the other)."""
    if args.num_prompts < 1:
        p.error(f"--num-prompts {args.num_prompts}: give at least 1")
    ranges = {"--min-input-len / --max-input-len": (args.min_input_len, args.max_input_len),
              "--min-output-len / --max-output-len": (args.min_output_len, args.max_output_len)}
    if args.rate_max_output_len is not None:
        ranges["--min-output-len / --rate-max-output-len"] = (args.min_output_len,
                                                              args.rate_max_output_len)
    bad = [f"{flags} {low} / {high}" for flags, (low, high) in ranges.items()
           if not 1 <= low <= high]
    if args.workload == "random" and bad:
        p.error(f"{'; '.join(bad)}: each range needs 1 <= min <= max (lower the minimum too)")


def resolve_model(args: argparse.Namespace, device: str) -> str:
    if args.model:
        return args.model
    if args.random_model:
        shape = bench.QWEN3_0_6B if args.random_model == "qwen3-0.6b" else bench.QWEN3_TINY
        cache = Path(os.environ.get("NANOSERVE_CACHE", Path.home() / ".cache" / "nanoserve"))
        out = cache / f"{args.random_model}-random"  # bench.py's cache too
        return in_subprocess(build_random_qwen3, out, shape, device)
    from nanoserve.weights import default_model_dir
    return default_model_dir()


def headline(rows: list[dict], meta: dict) -> dict:
    """The ratios the runs exist for: HTTP against offline (W1; the main requests, the median
    of their runs), W1's ITL p50 against the offline decode step, nanoserve against
    transformers, all at once against one at a time; each server's highest Poisson rate at which
    SLO_ATTAINMENT of the requests met the SLO (None: no rate tried)."""
    def pick(server: str, label: str) -> dict | None:
        return next((r for r in rows if r["server"] == server and r["label"] == label), None)

    def median(label: str, key: str, p: str | None = None) -> float | None:
        values = [r[key][p] if p else r[key] for r in rows
                  if r["server"] == "nanoserve" and r["label"] == label]
        return statistics.median(values) if values else None
    out = {}
    if (w1 := median("w1", "output_throughput")) and "offline_w1_tokens_per_s" in meta:
        out["w1_http_over_offline"] = w1 / meta["offline_w1_tokens_per_s"]
        out["w1_itl_p50_over_decode_step"] = (median("w1", "itl_ms", "p50")
                                              / meta["offline_decode_step_ms"])
    if (main := median("all at once", "output_throughput")) and "offline_main_tokens_per_s" in meta:
        out["main_http_over_offline"] = main / meta["offline_main_tokens_per_s"]
    for server in dict.fromkeys(r["server"] for r in rows if r["label"] == "poisson"):
        met = [r["rate"] for r in rows if r["server"] == server and r["label"] == "poisson"
               and r["slo_attainment"] >= SLO_ATTAINMENT]
        out.setdefault("max_rate_meeting_slo", {})[server] = max(met, default=None)
    nano, hf = pick("nanoserve", "all at once"), pick("transformers", "all at once")
    if nano and hf:
        out["nanoserve_over_transformers"] = nano["output_throughput"] / hf["output_throughput"]
    one = pick("nanoserve", "one at a time")
    if nano and one:
        out["one_at_a_time_over_all_at_once_seconds"] = one["seconds"] / nano["seconds"]
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot_from:
        plot(*merge_results(args.plot_from.split(",")), args.plot or f"{RESULTS_DIR}/serving.png")
        return
    import torch
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    rows: list[dict] = []
    if args.url:  # a server someone else started
        run_against_url(args, rows)
        return
    model_dir = args.model_dir = resolve_model(args, device)
    meta = {"command": "python " + " ".join(sys.argv), "model": model_dir,
            "hardware": in_subprocess(hardware_info, device == "cpu"),
            "temperature": bench.TEMPERATURE,
            "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms}}
    meta["hardware"]["commit"] = git_commit() or "?"
    log(f"{meta['hardware']}\nmodel {model_dir}")

    def record(row: dict) -> None:
        rows.append(row)
        meta["summary"] = headline(rows, meta)
        write_json(args.json, {"meta": meta, "runs": rows})

    if args.w1:
        w1 = bench.make_w1(args.w1_prompts)
        main = workloads(args)[0]
        w1.name, main.name = "w1", "main"
        meta |= in_subprocess(offline_figures, model_dir, [w1, main], device)
        log(f"-- offline LLM.generate, median of {OFFLINE_RUNS}+ runs: W1 "
            f"{meta['offline_w1_tokens_per_s']:,.0f} output tokens/s (decode step as its tokens "
            f"see it: {meta['offline_decode_step_ms']:.1f} ms), the main requests "
            f"{meta['offline_main_tokens_per_s']:,.0f}")
    for i, name in enumerate(args.servers.split(",")):
        meta.setdefault("servers", {})[name] = " ".join(
            server_command(name, model_dir, FIRST_PORT + i, device, args.nanoserve_args))
        serve_and_measure(name, model_dir, args, device, FIRST_PORT + i, record)
    print_table(rows)
    log(f"summary: {json.dumps(meta.get('summary', {}))}\nwrote {args.json}")
    if args.plot and any(r["label"] == "poisson" for r in rows):
        plot(rows, meta, args.plot)


def run_against_url(args: argparse.Namespace, rows: list[dict]) -> None:
    model = args.model_name
    if model is None:
        import urllib.request
        with urllib.request.urlopen(f"{args.url}/v1/models") as r:
            model = json.load(r)["data"][0]["id"]
    server = Server(args.server_kind, args.url.rstrip("/"), model)
    for run in plan_runs(args, args.server_kind):
        rows.append(run_one(server, run, args.seed, (args.slo_ttft_ms, args.slo_itl_ms)))
    print_table(rows)
    write_json(args.json, {"runs": rows})


def write_json(path: str, results: dict) -> None:
    """Rewritten after every run, so a run cut short still leaves the figures it has."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
