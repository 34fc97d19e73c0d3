"""tools/soak.py: a soak of the OpenAI-compatible server, with every kind of request at once.

Sends --requests completions (2,000) through HTTP with Poisson arrivals at --rate (50 a second: more
than a CPU engine serves, so the queue grows), each of one kind, drawn with a fixed seed:
  bad          10%: refused with a 4xx (max_tokens -1, an empty prompt, temperature "hot", another
               model's name)
  disconnect   10%: streamed, one or two samples (n), and the client closes after the first chunk
               (the server aborts every sample)
  stop         stop strings that end the text early
  guided       guided_choice ["yes", "no"]: the text is one of them
  seeded       temperature 0.8 with a seed
  samples      10%: n = 3 samples at temperature 0.8 (seeded half the time): three choices
  plain        greedy or temperature 0.7
half of the last five streamed. Meanwhile GET /health is polled every half second. Then, once the
server is idle, it checks what must hold: no request hung (each has --timeout seconds), every
answer is its kind's (a 200 for a good request, a 4xx for a bad one; a guided text is one of its
choices), /health answered 200 throughout, every replica's KV cache is free again (no request
running or waiting, usage 0), and the server's resident memory (API server and replicas) is within
10% of where it was after a warm-up. It prints one JSON line of figures and exits 1 if any check
fails.

  python tools/soak.py                               # starts the server: default model, CPU
  python tools/soak.py --url http://127.0.0.1:8000 --model NAME --server-pid PID
tests/test_server.py runs a short soak against its server in CI.
"""
import argparse
import asyncio
import collections
import json
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp

KINDS = {"bad": 0.1, "disconnect": 0.1, "stop": 0.2, "guided": 0.15, "seeded": 0.2, "samples": 0.1,
         "plain": 0.15}
BAD = ({"max_tokens": -1}, {"prompt": ""}, {"temperature": "hot"}, {"model": "no-such-model"})
RSS_GROWTH = 1.10  # the resident memory after the soak may be at most this times the warm one


def request(kind: str, i: int, model: str, rng: random.Random) -> dict:
    """The completion request of one soak request of this kind."""
    body = {"model": model, "prompt": f"Request {i}: tell me about the number {i}.",
            "max_tokens": rng.randint(1, 16), "temperature": 0, "stream": rng.random() < 0.5}
    if kind == "bad":
        body |= rng.choice(BAD)
    elif kind == "disconnect":
        body |= {"stream": True, "max_tokens": 32, "n": rng.choice([1, 2])}
    elif kind == "stop":
        body |= {"stop": [" the", "."], "temperature": 0.7}
    elif kind == "guided":  # room for either answer
        body |= {"guided_choice": ["yes", "no"], "max_tokens": 16}
    elif kind == "seeded":
        body |= {"temperature": 0.8, "seed": i}
    elif kind == "samples":
        body |= {"temperature": 0.8, "n": 3} | ({"seed": i} if rng.random() < 0.5 else {})
    elif rng.random() < 0.5:
        body["temperature"] = 0.7
    return body


async def send(session: aiohttp.ClientSession, url: str, kind: str, body: dict,
               timeout: float) -> str:
    """One request's outcome: "ok", "refused" (a 4xx), "disconnected", or what went wrong."""
    try:
        return await asyncio.wait_for(exchange(session, url, kind, body), timeout)
    except asyncio.TimeoutError:
        return "hung"
    except aiohttp.ClientError as e:
        return f"client error {type(e).__name__}"


async def exchange(session: aiohttp.ClientSession, url: str, kind: str, body: dict) -> str:
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status >= 400:
            return "refused" if response.status < 500 else f"status {response.status}"
        if kind == "disconnect":
            await response.content.readline()  # the first chunk, then go away
            response.close()
            return "disconnected"
        if not body["stream"]:
            choices = (await response.json())["choices"]
        else:  # the chunks' choices; the last chunk (usage) has none
            choices = [choice async for line in response.content if line.startswith(b"data: {")
                       for choice in json.loads(line[6:])["choices"]]
        if {c["index"] for c in choices} != set(range(body.get("n", 1))):
            return f"choices {sorted({c['index'] for c in choices})} for n={body.get('n', 1)}"
        text = "".join(c["text"] for c in choices if c["index"] == 0)
        return "ok" if kind != "guided" or text in ("yes", "no") else f"guided text {text!r}"


def watch_health(url: str, done: threading.Event, failures: list) -> None:
    """Every /health answer that was no 200 in 5 s (or none), until done: in a thread of its own,
    so the soak's own busy event loop does not delay the probes."""
    while not done.wait(0.5):
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status != 200:
                    failures.append(response.status)
        except (OSError, urllib.error.URLError) as e:
            failures.append(type(e).__name__)


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """/metrics' gauges of the replicas' queues and KV cache, summed over replicas."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    sums = collections.Counter()
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in ("nanoserve_num_requests_running", "nanoserve_num_requests_waiting",
                    "nanoserve_kv_cache_usage_perc"):
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


def rss_bytes(pid: int) -> int:
    """Resident memory of pid and its children (the replicas), from /proc."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    total = 0
    for p in [pid, *map(int, children)]:
        status = Path(f"/proc/{p}/status").read_text()
        total += int(next(line for line in status.splitlines() if line.startswith("VmRSS:"))
                     .split()[1]) * 1024
    return total


async def soak(url: str, model: str, num_requests: int, rate: float, timeout: float,
               pid: int | None, api_key: str | None = None, seed: int = 0) -> dict:
    """Warm up, soak, wait for idle; the figures and each check's result."""
    rng = random.Random(seed)
    # every kind at least once (a short soak too), the rest drawn by KINDS' shares
    kinds = list(KINDS)[:num_requests] + rng.choices(list(KINDS), weights=list(KINDS.values()),
                                                     k=max(0, num_requests - len(KINDS)))
    rng.shuffle(kinds)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(headers=headers) as session:
        warm = [send(session, url, "plain", request("plain", -i, model, rng), timeout)
                for i in range(1, 9)]
        await asyncio.gather(*warm)
        rss_warm = rss_bytes(pid) if pid else None
        done, health_failures, start = threading.Event(), [], time.perf_counter()
        health = threading.Thread(target=watch_health, args=(url, done, health_failures))
        health.start()
        tasks = []
        for i, kind in enumerate(kinds):
            tasks.append(asyncio.create_task(
                send(session, url, kind, request(kind, i, model, rng), timeout)))
            await asyncio.sleep(rng.expovariate(rate))
        outcomes = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
        deadline = time.monotonic() + timeout  # the aborted requests' blocks are freed by then
        while (load := await metrics(session, url)) and any(load.values()) and \
                time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        done.set()
        health.join()
        rss_after = rss_bytes(pid) if pid else None
    expected = {kind: {"bad": "refused", "disconnect": "disconnected"}.get(kind, "ok")
                for kind in KINDS}
    wrong = collections.Counter(f"{kind}: {out}" for kind, out in zip(kinds, outcomes)
                                if out != expected[kind])
    checks = {"every request answered as its kind": not wrong,
              "no request hung": "hung" not in outcomes,
              "/health answered 200 throughout": not health_failures,
              "the KV cache free, no request left": not any(load.values()),
              "memory within 10% of the warm server's": rss_warm is None
              or rss_after <= RSS_GROWTH * rss_warm}
    return {"requests": num_requests, "seconds": round(seconds, 1), "rate": rate,
            "kinds": dict(collections.Counter(kinds)),
            "outcomes": dict(collections.Counter(outcomes)), "wrong": dict(wrong),
            "health_failures": dict(collections.Counter(health_failures)),
            "load_after": dict(load),
            "rss_warm_mb": rss_warm and round(rss_warm / 2**20),
            "rss_after_mb": rss_after and round(rss_after / 2**20), "checks": checks}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="its model's name")
    parser.add_argument("--server-pid", type=int, help="with --url: its process, for the memory")
    parser.add_argument("--api-key", help="with --url: the server's --api-key")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=50.0, help="requests per second")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take")
    parser.add_argument("--server-args", default="--device cpu --data-parallel-size 2",
                        help="flags of the server this starts")
    args = parser.parse_args(argv)
    proc, url, pid = None, args.url, args.server_pid
    if url is None:  # a server of its own, started and stopped as bench_serve.py does
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from bench_serve import stop, wait_until_up
        with socket.socket() as s:  # a free port
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = Path(tempfile.mkdtemp()) / "server.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "nanoserve.server", "--port", str(port),
                                     "--log-level", "warning", *args.server_args.split()],
                                    stdout=out, stderr=subprocess.STDOUT)
        url, pid = f"http://127.0.0.1:{port}", proc.pid
        wait_until_up(proc, url, log)
    try:
        result = asyncio.run(soak(url, args.model, args.requests, args.rate, args.timeout, pid,
                                  args.api_key))
    finally:
        if proc is not None:
            stop(proc)
    print(json.dumps(result))
    sys.exit(0 if all(result["checks"].values()) else 1)


if __name__ == "__main__":
    main()
