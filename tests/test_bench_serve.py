"""CPU tests of bench_serve.py's client and statistics: a request timed against a canned SSE
stream, the summary's throughput and percentiles, the arrival schedule, the request bodies; and
where a preset's results go (results/, not docs/), with the servers faked."""
import asyncio
import json
import math
import sys
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_bench import REPO, repo_unchanged  # noqa: E402

import bench_serve  # noqa: E402

GAP_S = 0.05  # between the canned stream's chunks


async def canned_stream(request: web.Request) -> web.StreamResponse:
    """Three text chunks GAP_S apart, one empty chunk, the usage chunk, [DONE]."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i, text in enumerate(["a", "b", "c", ""]):
        if i:
            await asyncio.sleep(GAP_S)
        chunk = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    usage = {"choices": [], "usage": {"completion_tokens": 5}}
    await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return resp


def test_send_times_the_chunks():
    async def run() -> bench_serve.RequestResult:
        app = web.Application()
        app.router.add_post("/v1/completions", canned_stream)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        server = bench_serve.Server("nanoserve", f"http://127.0.0.1:{port}", "m")
        try:
            async with aiohttp.ClientSession() as session:
                return await bench_serve.send(session, server, [1, 2, 3], 5)
        finally:
            await runner.cleanup()

    r = asyncio.run(run())
    assert r.ok and r.output_tokens == 5 and r.prompt_len == 3  # usage wins over the chunks
    assert len(r.itl) == 2 and all(GAP_S * 0.8 < gap < GAP_S * 4 for gap in r.itl)
    assert r.e2e == pytest.approx(r.ttft + sum(r.itl))  # the empty chunk is no token


def test_summary():
    results = [bench_serve.RequestResult(True, "", 10, n, ttft, ttft + 0.01 * (n - 1),
                                         [0.01] * (n - 1))
               for n, ttft in [(11, 0.1), (21, 0.3), (31, 0.2)]]
    results.append(bench_serve.RequestResult(error="HTTP 400: bad"))
    s = bench_serve.summarize(results, seconds=2.0, slo=(250, 100))
    assert (s["completed"], s["failed"], s["errors"]) == (3, 1, ["HTTP 400: bad"])
    assert s["slo_attainment"] == 0.5 and s["goodput"] == 1.0  # TTFT 300 ms misses, 1 failed
    assert bench_serve.summarize(results, 2.0, slo=(500, 5))["goodput"] == 0  # ITL 10 ms > 5
    assert s["output_tokens"] == 63 and s["output_throughput"] == 31.5
    assert s["request_throughput"] == 1.5
    assert s["ttft_ms"]["p50"] == pytest.approx(200) and s["ttft_ms"]["mean"] == pytest.approx(200)
    assert s["ttft_ms"]["p99"] == pytest.approx(np.percentile([100, 300, 200], 99))
    assert s["tpot_ms"]["mean"] == pytest.approx(10) and s["itl_ms"]["p99"] == pytest.approx(10)
    assert bench_serve.summarize([], 1.0, (500, 100))["ttft_ms"]["p50"] is None


def test_headline_finds_the_highest_rate_meeting_the_slo():
    rows = [{"server": "a", "label": "poisson", "rate": rate, "slo_attainment": share}
            for rate, share in [(1, 1.0), (2, 0.95), (4, 0.5), (8, 0.92)]]
    rows += [{"server": "b", "label": "poisson", "rate": 1, "slo_attainment": 0.2}]
    assert bench_serve.headline(rows, {})["max_rate_meeting_slo"] == {"a": 8, "b": None}


def test_decode_step_as_tokens_see_it():
    """A token-weighted median: 3 steps of 100 sequences at 10 ms outweigh 5 of 1 at 50 ms."""
    first = bench_serve.bench.FirstTokens()
    first.decode = [(100, 0.010)] * 3 + [(1, 0.050)] * 5
    assert first.decode_step_ms() == pytest.approx(10)


def test_arrivals_and_bodies():
    assert bench_serve.arrival_gaps(4, math.inf, 0) == [0.0] * 4
    gaps = bench_serve.arrival_gaps(4000, 2.0, 0)
    assert np.mean(gaps) == pytest.approx(0.5, rel=0.05)  # Poisson: exponential gaps
    assert gaps == bench_serve.arrival_gaps(4000, 2.0, 0)  # seeded
    nano = bench_serve.Server("nanoserve", "u", "m").body([5, 6], 7)
    assert nano["prompt"] == [5, 6] and nano["ignore_eos"] and nano["max_tokens"] == 7
    hf = bench_serve.Server("transformers", "u", "m").body([5, 6], 7)
    assert hf["prompt"] == "<5> <6>" and "ignore_eos" not in hf  # it refuses unknown fields


def fake_serve_and_measure(name: str, model_dir: str, args, device: str, port: int,
                           record) -> None:
    """Each planned run recorded with canned figures: no server, no model."""
    timed = [bench_serve.RequestResult(True, "", 3, 5, 0.1, 0.2, [0.025] * 4)]
    for run in bench_serve.plan_runs(args, name):
        record({"server": name, "label": run.label, "rate": run.rate,
                **bench_serve.summarize(timed, 1.0, (500, 100))})


def test_presets_write_into_results_not_docs(monkeypatch):
    """--preset cpu and --preset h100 used to rewrite docs/serving_*.json and docs/serving.png:
    a user's run goes to results/, and the repository is left as it was."""
    monkeypatch.setattr(bench_serve, "serve_and_measure", fake_serve_and_measure)
    monkeypatch.setattr(bench_serve, "resolve_model", lambda args, device: "some/model")
    offline = {"offline_w1_tokens_per_s": 9.0, "offline_main_tokens_per_s": 8.0,
               "offline_decode_step_ms": 10.0}
    monkeypatch.setattr(bench_serve, "in_subprocess", lambda fn, *args: (
        {"cpu": "test"} if fn is bench_serve.hardware_info else offline))
    with repo_unchanged(monkeypatch) as written:
        for preset in ("cpu", "h100"):
            bench_serve.main(["--preset", preset, "--cpu"])
        saved = json.loads((REPO / "results/serving_h100.json").read_text())
        assert {r["label"] for r in saved["runs"]} == {"w1", "all at once", "poisson"}
        bench_serve.main(["--plot-from", "results/serving_h100.json"])
    assert [p.relative_to(REPO).as_posix() for p in written] == [
        "results/serving.png", "results/serving_cpu.json", "results/serving_h100.json"]


@pytest.mark.parametrize("argv, message", [
    (["--preset", "cpu", "--max-output-len", "16"],
     "--min-output-len / --max-output-len 32 / 16: each range needs 1 <= min <= max"),
    (["--min-input-len", "0"], "--min-input-len / --max-input-len 0 / 1024"),
    (["--rate-max-output-len", "50"], "--min-output-len / --rate-max-output-len 100 / 50"),
    (["--num-prompts", "0"], "--num-prompts 0: give at least 1")])
def test_bad_lengths_stop_before_any_server_starts(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_serve.parse_args(argv)
    assert message in capsys.readouterr().err


def test_preset_help_lists_each_preset(capsys):
    with pytest.raises(SystemExit):
        bench_serve.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "see PRESETS" not in text
    for name, phrase in bench_serve.PRESET_HELP.items():
        assert f"{name}: {phrase}" in text
