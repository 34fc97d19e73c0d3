"""The OpenAI-compatible server against the official `openai` client, on the CPU.

One server (`python -m nanoserve.server` in a subprocess, the default model, two data-parallel
replicas, an API key) is shared by the module; requests are greedy and short. The fault tests
start servers on a tiny random Qwen3: one whose replica is killed mid-request, one with a replica
started on its own (headless) that connects over TCP, two replicas as actors of a local Ray
cluster (one killed, and restarted by Ray), and one with two tensor-parallel ranks, so
that shutdown has worker processes and shared memory to clean up, sent SIGTERM mid-stream: the
stream must still finish, the process exit 0, and no child process or /dev/shm file be left.
"""
import argparse
import asyncio
import contextlib
import dataclasses
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from nanoserve.config import Config
from nanoserve.server import cli
from nanoserve.server.app import until_disconnect
from nanoserve.weights import default_model_dir

# with pytest-xdist, test_tp's worker (processes and shared memory): one module server, and
# test_metrics after the requests it counts
pytestmark = pytest.mark.xdist_group(name="processes")

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"  # the served name of the default model: its directory's name
START_TIMEOUT_S = 180
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NUM_STREAMS = 10  # concurrent streams, 5 per replica; the test wants steps that batched 5
GREEDY = dict(model=MODEL, temperature=0, max_tokens=12)
TOTAL = '{"replica": "total"}'  # the label of a gauge's sum over the replicas


def replica(rank: int) -> str:
    return json.dumps({"replica": str(rank)})


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Every sample of GET /metrics by name and labels, e.g. 'x_bucket{le="8.0"}'."""
        text = httpx.get(f"{self.url}/metrics").text
        return {s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else ""): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*flags: str, tries: int = 3) -> Server:
    """`python -m nanoserve.server` on a free port, once GET /health answers. The server binds
    the port a few seconds after it was found free (once Python and torch have loaded), and a
    client's own connection may take it meanwhile: then it starts again on another port."""
    port, log = free_port(), Path(tempfile.mkdtemp()) / "server.log"
    cmd = [sys.executable, "-m", "nanoserve.server", "--port", str(port), "--api-key", API_KEY,
           "--device", "cpu", "--log-level", "warning", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None and "cannot serve on" in log.read_text() and tries > 1:
            return start_server(*flags, tries=tries - 1)
        assert proc.poll() is None, f"the server exited at start:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"the server did not start:\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.5)
    return Server(proc, url, log)


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        server.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Two replicas; the RPC port and the replicas' keys file known (server.rpc, server.keys)."""
    rpc, keys = free_port(), tmp_path_factory.mktemp("server") / "keys.json"
    server = start_server("--data-parallel-size", "2", "--data-parallel-rpc-port", str(rpc),
                          "--data-parallel-keys", str(keys))
    server.rpc, server.keys = f"tcp://127.0.0.1:{rpc}", keys
    yield server
    stop_server(server)  # SIGTERM: drained and stopped, the server exits 0
    assert server.proc.returncode == 0, server.log.read_text()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


# ---- requests ----------------------------------------------------------------------------------
def test_models_and_completion(server, tokenizer):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.completions.create(prompt=PROMPT, **GREEDY)
    assert out.choices[0].text.strip() and out.choices[0].finish_reason == "length"
    ids = tokenizer.encode(PROMPT)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 12
    by_ids = client.completions.create(prompt=ids, **GREEDY)  # a prompt of token ids
    assert by_ids.choices[0].text == out.choices[0].text


def test_chat(server):
    out = server.client().chat.completions.create(messages=QUESTION, **GREEDY)
    message = out.choices[0].message
    assert message.role == "assistant" and "Paris" in message.content
    assert out.usage.completion_tokens <= 12 and out.usage.prompt_tokens > 10


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stream_equals_non_stream(server, kind):
    client = server.client()
    if kind == "chat":
        create, args, text = client.chat.completions.create, {"messages": QUESTION}, (
            lambda choice: choice.delta.content or "")
        full = create(**args, **GREEDY).choices[0].message.content
    else:
        create, args, text = client.completions.create, {"prompt": PROMPT}, (
            lambda choice: choice.text)
        full = create(**args, **GREEDY).choices[0].text
    chunks = list(create(**args, **GREEDY, stream=True, stream_options={"include_usage": True}))
    deltas = [text(c.choices[0]) for c in chunks if c.choices]
    assert len(deltas) > 2 and "".join(deltas) == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_concurrent_streams_are_batched(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"{i} little pigs went", max_tokens=16, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def all_at_once() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                                      max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_STREAMS)))

    bucket = 'nanoserve_iteration_num_requests_bucket{"le": "4.0"}'
    before = server.metrics()
    results = asyncio.run(all_at_once())
    after = server.metrics()
    assert all(text and n == 16 for text, n in results)
    # steps in which more than 4 requests advanced together: +Inf's count minus le=4's
    big_steps = [m['nanoserve_iteration_num_requests_bucket{"le": "+Inf"}'] - m[bucket]
                 for m in (before, after)]
    assert big_steps[1] - big_steps[0] >= 8, "the streams were not decoded in one batch"


def open_streams(server: Server, n: int) -> list:
    """n long streams, each read until its first chunk: all n are running."""
    client, streams = server.client(), []
    for i in range(n):
        streams.append(client.completions.create(model=MODEL, prompt=[i + 1, 2, 3],
                                                 max_tokens=1000, stream=True,
                                                 extra_body={"ignore_eos": True}))
        next(iter(streams[-1]))
    return streams


def streams_on_each_replica(server: Server, per_replica: int) -> list:
    """Twice per_replica long streams, which the least-loaded routing spreads over the two
    replicas: per_replica run on each."""
    streams = open_streams(server, 2 * per_replica)
    m = server.metrics()
    assert m["nanoserve_num_requests_running" + replica(0)] == per_replica
    assert m["nanoserve_num_requests_running" + replica(1)] == per_replica
    return streams


def test_both_replicas_serve(server):
    """Requests go to the least loaded replica: four at once run two on each; closing the
    streams aborts them in their replicas."""
    aborted = server.metrics()["nanoserve_num_aborted_requests_total"]
    streams = streams_on_each_replica(server, 2)
    assert server.metrics()["nanoserve_num_requests_running" + TOTAL] == 4
    for stream in streams:
        stream.close()
    m = wait_until_idle(server, aborted + 3)
    assert m["nanoserve_num_aborted_requests_total"] == aborted + 4


def test_stop_strings(server):
    client = server.client()
    full = client.completions.create(prompt=PROMPT, **GREEDY).choices[0].text
    stop = full.split()[1]  # the second word: something comes before it
    out = client.completions.create(prompt=PROMPT, stop=[stop, "never seen"], **GREEDY)
    assert out.choices[0].text == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    chunks = client.completions.create(prompt=PROMPT, stop=stop, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    # each token's text_offset is the same streamed or not, though the stream holds text back
    whole = client.completions.create(prompt=PROMPT, stop=stop, logprobs=1, **GREEDY).choices[0]
    chunks = client.completions.create(prompt=PROMPT, stop=stop, logprobs=1, stream=True, **GREEDY)
    offsets = [o for c in chunks if (lp := c.choices[0].logprobs) for o in lp.text_offset]
    assert offsets == whole.logprobs.text_offset and offsets[1] == len(whole.logprobs.tokens[0])


SAMPLED = dict(model=MODEL, temperature=1.0, max_tokens=8, seed=7, extra_body={"ignore_eos": True})


def test_n_samples_share_the_prompt_streamed_or_not(server, tokenizer):
    client = server.client()
    prompt = ("Write a short story about a lighthouse keeper who finds a message in a bottle, "
              "and give the story a title of its own.")  # 26 tokens: one full block
    one = client.completions.create(prompt=prompt, **SAMPLED)
    hits = server.metrics()["nanoserve_prefix_cache_hit_tokens_total"]
    three = client.completions.create(prompt=prompt, n=3, **SAMPLED)
    texts = [c.text for c in three.choices]
    assert [c.index for c in three.choices] == [0, 1, 2] and texts[0] == one.choices[0].text
    assert len(set(texts)) == 3  # seeded by (seed, i): three draws, sample 0 the n=1 answer
    assert three.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert three.usage.completion_tokens == 3 * 8
    # one replica holds the three: two hit the full blocks the first registered
    full_blocks = three.usage.prompt_tokens // 16 * 16
    assert server.metrics()["nanoserve_prefix_cache_hit_tokens_total"] >= hits + 2 * full_blocks
    assert [c.text for c in client.completions.create(prompt=prompt, n=3, **SAMPLED).choices] == (
        texts)  # seeded: the same three again
    chunks = list(client.completions.create(prompt=prompt, n=3, stream=True, **SAMPLED,
                                            stream_options={"include_usage": True}))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]
    assert streamed == texts and chunks[-1].usage.completion_tokens == 3 * 8
    greedy = client.chat.completions.create(messages=QUESTION, n=2, **GREEDY)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    chat = client.chat.completions.create(messages=QUESTION, n=2, **SAMPLED)
    chunks = list(client.chat.completions.create(messages=QUESTION, n=2, stream=True, **SAMPLED))
    assert [(c.index, c.delta.role) for c in chunks[0].choices] == [(0, "assistant"),
                                                                    (1, "assistant")]
    assert ["".join(c.choices[0].delta.content or "" for c in chunks[1:]
                    if c.choices[0].index == i) for i in range(2)] == [
        c.message.content for c in chat.choices]


def test_best_of_answers_with_the_likeliest_samples(server):
    client = server.client()
    three = client.completions.create(prompt=PROMPT, n=3, logprobs=0, **SAMPLED).choices
    likeliest = sorted(three, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(prompt=PROMPT, n=2, best_of=3, **SAMPLED)
    assert [c.text for c in best.choices] == [c.text for c in likeliest[:2]]
    assert best.choices[0].logprobs is None  # ranked by logprobs it was not asked for
    assert best.usage.completion_tokens == 3 * 8  # every sample ran


def test_logprobs(server, tokenizer):
    client = server.client()
    out = client.completions.create(prompt=PROMPT, logprobs=3, **GREEDY).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert "".join(lp.tokens) == out.text
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and logprob <= 0
        assert logprob == pytest.approx(max(top.values()))  # greedy takes the likeliest
    chat = client.chat.completions.create(messages=QUESTION, logprobs=True, top_logprobs=2,
                                          **GREEDY).choices[0]
    content = chat.logprobs.content
    # the tokens' texts spell the message, then the end-of-turn token it leaves out
    assert "".join(t.token for t in content).startswith(chat.message.content)
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
               for t in content)


# ---- flags -------------------------------------------------------------------------------------
def test_every_config_field_is_a_flag():
    help_text = " ".join(cli_help().split())  # argparse wraps lines
    for f in dataclasses.fields(Config):
        if f.name != "model":
            assert f"--{f.name.replace('_', '-')}" in help_text, f.name
    assert "one of auto, float32, float16, bfloat16 (default: auto)" in help_text
    assert "tokens per KV block (the paging unit) (default: 16)" in help_text  # the comment
    args, settings = cli.parse_args(["--device", "cpu", "--no-enable-prefix-caching",
                                     "--tensor-parallel-size", "3", "--enforce-eager",
                                     "--num-kvcache-blocks", "256", "--dtype", "bfloat16"])
    assert settings == {"device": "cpu", "enable_prefix_caching": False, "tensor_parallel_size": 3,
                        "enforce_eager": True, "num_kvcache_blocks": 256, "dtype": "bfloat16"}
    assert args.port == cli.DEFAULT_PORT and cli.parse_args([])[1] == {}  # Config's defaults
    # refused before any replica starts, each in one line that names the fix
    for argv, message in ((["--dtype", "float64"], "invalid choice: 'float64'"),
                          (["--log-level", "loud"], "invalid choice: 'loud'"),
                          (["--device", "gpu"], "invalid choice: 'gpu'"),
                          (["--max-model-len", "0"], "max_model_len must be an integer >= 1"),
                          (["--kv-cache-dtype", "fp4"], "kv_cache_dtype must be 'auto'"),
                          (["--model", "/no/such/model"], "is no model directory")):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
            cli.parse_args(argv)
        assert "error: " in err.getvalue() and message in err.getvalue(), argv


def test_a_busy_port_fails_before_any_replica_starts(monkeypatch):
    """The HTTP port is bound before the replicas are built: a busy one fails in one line that
    names the fix, not after every replica has loaded the model."""
    monkeypatch.setattr(cli, "replica_processes", lambda *args: pytest.fail("a replica was built"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit, match=rf"cannot serve on 127\.0\.0\.1:{port} \(.+\): "
                                             "pick another --port"):
            cli.main(["--port", str(port), "--device", "cpu"])


def cli_help() -> str:
    with pytest.raises(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:
        cli.parse_args(["--help"])
    return out.getvalue()


@dataclasses.dataclass
class FutureConfig:
    """Fields of kinds Config may grow: each must become a flag with no change to cli.py."""
    cascade_attention: bool = True  # one attention pass over a prefix the batch shares
    # the drafter: "ngram" or None (off)
    speculative_method: str | None = None
    mode: Literal["fast", "exact"] = "fast"  # how drafts are checked
    num_speculative_tokens: int | None = 4
    sizes: list[int] = dataclasses.field(default_factory=list, metadata={"help": "batch sizes"})


def test_flags_follow_any_dataclass():
    parser = argparse.ArgumentParser()
    names = cli.add_config_flags(parser, FutureConfig)
    assert names == [f.name for f in dataclasses.fields(FutureConfig)]
    args = vars(parser.parse_args(["--no-cascade-attention", "--speculative-method", "ngram",
                                   "--num-speculative-tokens", "none", "--mode", "exact",
                                   "--sizes", "1", "8"]))
    assert args == {"cascade_attention": False, "speculative_method": "ngram",
                    "num_speculative_tokens": None, "mode": "exact", "sizes": [1, 8]}
    assert vars(parser.parse_args(["--cascade-attention", "--num-speculative-tokens", "2"])) == {
        "cascade_attention": True, "num_speculative_tokens": 2}
    help_text = " ".join(parser.format_help().split())
    assert "one attention pass over a prefix the batch shares (default: True)" in help_text
    assert "the drafter: \"ngram\" or None (off) (default: None)" in help_text  # comment above
    assert "num speculative tokens (default: 4)" in help_text  # no comment: the name
    assert "how drafts are checked; one of fast, exact (default: fast)" in help_text
    assert "batch sizes (default: [])" in help_text  # metadata["help"] first
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "slow"])


# ---- faults ------------------------------------------------------------------------------------
BAD_REQUESTS = [  # the request, the error the client raises, words of the message, param, code
    (dict(prompt=PROMPT, temperature=-1), openai.BadRequestError, "temperature", "temperature",
     "invalid_value"),
    (dict(prompt=""), openai.BadRequestError, "empty prompt", "prompt", "invalid_value"),
    (dict(prompt=[10**9]), openai.BadRequestError, "vocabulary", "prompt", "invalid_value"),
    (dict(prompt=PROMPT, max_tokens=10**5), openai.BadRequestError, "max_model_len", "prompt",
     "context_length_exceeded"),
    (dict(prompt=PROMPT, max_tokens=0), openai.BadRequestError, "max_tokens", "max_tokens",
     "invalid_value"),
    (dict(prompt=PROMPT, logprobs=99), openai.BadRequestError, "logprobs", "logprobs",
     "invalid_value"),
    (dict(prompt=PROMPT, model="gpt-4"), openai.NotFoundError, MODEL, "model", "model_not_found"),
    # fields nanoserve does not implement: refused, not served as if they were not there
    (dict(prompt=PROMPT, n=0), openai.BadRequestError, "n must be", "n", "invalid_value"),
    (dict(prompt=PROMPT, n=129), openai.BadRequestError, "less than or equal to 128", "n",
     "invalid_type"),
    (dict(prompt=PROMPT, n=2, best_of=1), openai.BadRequestError, ">= n=2", "best_of",
     "invalid_value"),
    (dict(prompt=PROMPT, best_of=2, stream=True), openai.BadRequestError, "cannot be streamed",
     "best_of", "invalid_value"),
    (dict(prompt=PROMPT, extra_body={"use_beam_search": True}), openai.BadRequestError,
     "use_beam_search", "use_beam_search", "unsupported_parameter"),
    (dict(prompt=PROMPT, presence_penalty=0.5), openai.BadRequestError, "presence_penalty 0.5",
     "presence_penalty", "unsupported_parameter"),
    (dict(prompt=PROMPT, logit_bias={"5": 10}), openai.BadRequestError, "leave it out",
     "logit_bias", "unsupported_parameter"),
    (dict(prompt=PROMPT, extra_body={"repetition_penalty": 1.2}), openai.BadRequestError,
     "repetition_penalty", "repetition_penalty", "unsupported_parameter"),
]
ERROR_KEYS = {"message", "type", "param", "code"}


def assert_openai_error(error: dict, param: str | None) -> None:
    """OpenAI's error object: these four keys, a `type` ending in "error", `param` naming the
    field at fault, `code` a string or None (never the HTTP status)."""
    assert set(error) == ERROR_KEYS and error["type"].endswith("error"), error
    assert error["param"] == param and (error["code"] is None or isinstance(error["code"], str))


def test_bad_input_gets_an_openai_error(server):
    client = server.client()
    for kwargs, error, words, param, code in BAD_REQUESTS:
        with pytest.raises(error) as e:
            client.completions.create(**{"model": MODEL, "max_tokens": 4, **kwargs})
        assert words in e.value.body["message"] and e.value.body["type"].endswith("error"), kwargs
        assert_openai_error(e.value.body, param)
        assert e.value.body["code"] == code, kwargs
    with pytest.raises(openai.BadRequestError, match="messages") as e:
        client.chat.completions.create(model=MODEL, messages=[])
    assert_openai_error(e.value.body, "messages")
    with pytest.raises(openai.BadRequestError) as e:  # chat's k is top_logprobs
        client.chat.completions.create(messages=QUESTION, logprobs=True, top_logprobs=99,
                                       **GREEDY)
    assert_openai_error(e.value.body, "top_logprobs")
    assert e.value.body["message"].startswith("top_logprobs must be")  # the request's name
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI's newer name for max_tokens
        client.chat.completions.create(messages=QUESTION, model=MODEL, max_completion_tokens=0)
    assert_openai_error(e.value.body, "max_completion_tokens")
    assert e.value.body["message"].startswith("max_completion_tokens must be an integer >= 1")
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"model": "', headers=headers)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert_openai_error(r.json()["error"], None)
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL}, headers=headers)
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    assert_openai_error(r.json()["error"], "prompt")
    assert client.completions.create(prompt=PROMPT, **GREEDY).choices[0].text  # still serving
    no_ops = dict(n=1, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, extra_body={
        "repetition_penalty": 1, "min_p": None, "best_of": 1, "use_beam_search": False})
    assert client.completions.create(prompt=PROMPT, **no_ops, **GREEDY).choices[0].text
    three = {**GREEDY, "max_tokens": 3.0, "n": 1.0}  # integers, as JSON Schema counts them
    assert client.completions.create(prompt=PROMPT, **three).usage.completion_tokens == 3
    weather = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    for refused, param in ((dict(frequency_penalty=1), "frequency_penalty"),  # chat refuses them
                           (dict(tools=weather), "tools"),  # no tool is ever called
                           (dict(tool_choice="required"), "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(messages=QUESTION, **refused, **GREEDY)
        assert_openai_error(e.value.body, param)
        assert e.value.body["code"] == "unsupported_parameter"
        assert f"{param} " in e.value.body["message"] and len(e.value.body["message"]) < 120
    assert client.chat.completions.create(messages=QUESTION, tool_choice="none", tools=[],
                                          **GREEDY).choices[0].message.content
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as e:  # not dropped: the model reads text only
        client.chat.completions.create(messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"}, image]}], **GREEDY)
    assert "Input should be 'text'" in e.value.body["message"], e.value.body


@pytest.mark.parametrize("body, param, code", [
    ({"model": MODEL}, "prompt", "missing_required_parameter"),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": "many"}, "max_tokens", "invalid_type"),
    ({"model": MODEL, "prompt": PROMPT, "temperature": [1]}, "temperature", "invalid_type"),
    # strict, as OpenAI: a number or a bool in a string is refused, not read
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": "3"}, "max_tokens", "invalid_type"),
    ({"model": MODEL, "prompt": PROMPT, "stream": "yes"}, "stream", "invalid_type"),
    ({"model": MODEL, "prompt": PROMPT, "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "invalid_type"),
])
def test_validation_error_is_a_400_naming_the_field(server, body, param, code):
    """FastAPI's 422 {"detail": [...]} becomes OpenAI's 400 with the field as `param`."""
    r = httpx.post(f"{server.url}/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and "detail" not in r.json()
    assert_openai_error(r.json()["error"], param)
    assert r.json()["error"]["code"] == code and param in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:  # the official client reads it too
        server.client().post("/completions", body=body, cast_to=object)
    assert e.value.body["param"] == param and e.value.body["code"] == code


def test_unknown_route_and_wrong_method_are_openai_errors(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.get(f"{server.url}/v1/nothing-here", headers=headers)
    assert r.status_code == 404 and "detail" not in r.json()
    assert_openai_error(r.json()["error"], None)
    assert r.json()["error"]["code"] == "unknown_url"
    assert "/v1/nothing-here" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/completions", headers=headers)  # a POST route
    assert r.status_code == 405 and "detail" not in r.json() and r.headers["allow"] == "POST"
    assert_openai_error(r.json()["error"], None)
    assert r.json()["error"]["code"] == "method_not_allowed"
    with pytest.raises(openai.NotFoundError) as e:  # the official client on an unknown route
        server.client().get("/nothing-here", cast_to=httpx.Response)
    assert_openai_error(e.value.body, None)


def test_api_key(server):
    with pytest.raises(openai.AuthenticationError, match="API key"):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key


def wait_until_idle(server: Server, aborted_before: float) -> dict[str, float]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = server.metrics()
        if (m["nanoserve_num_aborted_requests_total"] > aborted_before
                and m["nanoserve_num_requests_running" + TOTAL] == 0):
            return m
        time.sleep(0.05)
    raise AssertionError(f"the request was not aborted: {m}")


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_the_request(server, stream):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True,
            "stream": stream, "n": 2}  # both samples end
    headers = {"Authorization": f"Bearer {API_KEY}"}
    aborted = server.metrics()["nanoserve_num_aborted_requests_total"]
    if stream:  # read three events, then hang up
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          headers=headers) as r:
            events = r.iter_lines()
            assert [next(events) for _ in range(5)][4].startswith("data: ")
            assert server.metrics()["nanoserve_kv_cache_usage_perc" + TOTAL] > 0
    else:  # give up waiting for the whole answer
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=1.0)
    m = wait_until_idle(server, aborted)
    assert m["nanoserve_kv_cache_usage_perc" + TOTAL] == 0  # the blocks are free


def test_metrics(server):
    m = server.metrics()
    for name in ("nanoserve_num_requests_waiting" + TOTAL, 'nanoserve_replica_up{"replica": "1"}',
                 "nanoserve_prefix_cache_hit_tokens_total",
                 "nanoserve_generation_tokens_total",
                 "nanoserve_time_to_first_token_seconds_count",
                 "nanoserve_inter_token_latency_seconds_count"):
        assert name in m
    assert m["nanoserve_generation_tokens_total"] >= 12 * NUM_STREAMS
    assert m["nanoserve_time_to_first_token_seconds_count"] > NUM_STREAMS
    assert m["nanoserve_prefix_cache_hit_tokens_total"] > 0  # the chat prompt fills 2 blocks


# the slow tail: a second server; test_speculative.py checks speculation by default
@pytest.mark.slow
def test_speculative_decoding_through_the_server(server):
    """A server with speculation on: the same greedy text as the module's (speculation off), the
    drafts in the usage (OpenAI's prediction-token fields) and in /metrics."""
    messages = [{"role": "user", "content": "Repeat the following paragraph exactly:\n\nThe "
                 "library opens at nine in the morning and closes at six in the evening."}]
    params = dict(model=MODEL, temperature=0, max_tokens=40, messages=messages)
    plain = server.client().chat.completions.create(**params)
    spec = start_server("--speculative-method", "ngram", "--num-speculative-tokens", "4")
    try:
        out = spec.client().chat.completions.create(**params)
        chunks = list(spec.client().chat.completions.create(
            **params, stream=True, stream_options={"include_usage": True}))
        m = spec.metrics()
    finally:
        stop_server(spec)
    assert out.choices[0].message.content == plain.choices[0].message.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        plain.choices[0].message.content
    for usage in (out.usage, chunks[-1].usage):
        details = usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
    assert m["nanoserve_spec_decode_num_accepted_tokens_total"] >= \
        2 * out.usage.completion_tokens_details.accepted_prediction_tokens
    assert m["nanoserve_spec_decode_num_draft_tokens_total"] >= \
        m["nanoserve_spec_decode_num_accepted_tokens_total"] > 0


def test_guided_decoding(server):
    """OpenAI's response_format and vLLM's guided_* extras, on chat and completions, streamed or
    not; a bad constraint is a 400 naming its field."""
    client = server.client()
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                             "maximum": 120}},
        "required": ["name", "age"]}
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    params = dict(model=MODEL, temperature=0, max_tokens=60, messages=ask)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    out = client.chat.completions.create(**params, response_format=fmt)
    text = out.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    assert out.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(**params, response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    cat = [{"role": "user", "content": "Give a JSON object with a cat's name and age."}]
    out = client.chat.completions.create(**params | {"messages": cat},
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    for extra, check in [({"guided_regex": r"\d{4}-\d{2}-\d{2}"},
                          lambda t: re.fullmatch(r"\d{4}-\d{2}-\d{2}", t)),
                         ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                         ({"guided_json": schema}, lambda t: json.loads(t)["age"] <= 120),
                         ({"guided_grammar": 'root ::= "Paris" | "Lyon"'},
                          lambda t: t in ("Paris", "Lyon"))]:
        out = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                        max_tokens=40, extra_body=extra)
        assert check(out.choices[0].text), (extra, out.choices[0].text)
    for kwargs, param in [({"response_format": {"type": "xml"}}, "response_format"),
                          ({"response_format": {"type": "json_schema"}}, "response_format"),
                          ({"extra_body": {"guided_regex": "(["}}, "guided_regex"),
                          ({"extra_body": {"guided_json": '{"type": "objekt"}'}}, "guided_json"),
                          ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}},
                           "guided_regex")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**params, **kwargs)
        assert_openai_error(e.value.body, param)


# ---- shutdown (last: it stops the module's server) -------------------------------------------
def shm_files(pid: int) -> set[str]:
    """/dev/shm files that a process or its descendants have mapped or open."""
    pids = [pid, *descendants(pid)]
    found = set()
    for p in pids:
        try:
            found |= {line.split(maxsplit=5)[-1] for line in Path(f"/proc/{p}/maps").read_text()
                      .splitlines() if "/dev/shm/" in line}
            found |= {os.readlink(fd) for fd in Path(f"/proc/{p}/fd").iterdir()
                      if os.readlink(fd).startswith("/dev/shm/")}
        except (FileNotFoundError, PermissionError):
            pass
    return {f.removesuffix(" (deleted)") for f in found}


def descendants(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [d for c in map(int, children.split()) for d in (c, *descendants(c))]


def replica_pids(server: Server) -> list[int]:
    """The replicas' processes (spawned: not multiprocessing's resource tracker)."""
    return [pid for pid in descendants(server.proc.pid)
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]


# the slow tail (with the next): the module's server checks that SIGTERM exits 0 by default
@pytest.mark.slow
def test_a_killed_replica_fails_its_requests_at_once(tiny_qwen3):
    """A replica killed mid-request: its stream ends with an error event and its plain request
    with a 500, within a second; new requests get a 503, /health fails; SIGTERM still exits 0."""
    server = start_server("--model", tiny_qwen3, "--served-model-name", MODEL)
    try:
        [stream] = open_streams(server, 1)
        errors = {}

        def plain() -> None:
            try:
                server.client().completions.create(model=MODEL, prompt=[4, 5], max_tokens=2000,
                                                   extra_body={"ignore_eos": True})
            except openai.APIStatusError as e:
                errors["plain"] = (e.status_code, e.body, time.monotonic())

        waiting = threading.Thread(target=plain)
        waiting.start()
        deadline = time.monotonic() + 30
        while server.metrics()["nanoserve_num_requests_running" + TOTAL] < 2:
            assert time.monotonic() < deadline, "the plain request never started"
            time.sleep(0.05)
        [pid] = replica_pids(server)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError, match="replica 0"):
            for _ in stream:
                pass
        waiting.join(5)
        status, body, when = errors["plain"]
        assert status == 500 and "replica 0" in body["message"] and when - killed < 1.0
        assert time.monotonic() - killed < 1.5
        with pytest.raises(openai.APIStatusError) as e:
            server.client().completions.create(model=MODEL, prompt=[4, 5], max_tokens=4)
        assert e.value.status_code == 503
        assert_openai_error(e.value.body, None)
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert server.metrics()['nanoserve_replica_up{"replica": "0"}'] == 0
    finally:
        stop_server(server)
    assert server.proc.returncode == 0, server.log.read_text()


@pytest.mark.slow
def test_a_headless_replica_connects_over_tcp(tiny_qwen3, tmp_path):
    """`--headless` runs one replica on its own; the API server (one replica of its own, two in
    all) waits for it at its TCP port, routes to both, and stops both on SIGTERM."""
    model, port, keys = tiny_qwen3, free_port(), tmp_path / "keys.json"
    dp = ["--data-parallel-size", "2", "--data-parallel-rpc-port", str(port),
          "--data-parallel-keys", str(keys)]
    started = []

    def start_headless() -> None:  # once the API server has written the replicas' keys
        while not keys.exists():
            time.sleep(0.1)
        with open(tmp_path / "headless.log", "w") as out:
            started.append(subprocess.Popen(
                [sys.executable, "-m", "nanoserve.server", "--headless", "--data-parallel-rank",
                 "1", "--model", model, "--device", "cpu", *dp], stdout=out,
                stderr=subprocess.STDOUT))
    threading.Thread(target=start_headless, daemon=True).start()
    try:
        server = start_server("--model", model, "--served-model-name", MODEL,
                              "--data-parallel-size-local", "1", *dp)
        streams = streams_on_each_replica(server, 1)
        for stream in streams:
            stream.close()
        stop_server(server)
        assert server.proc.returncode == 0, server.log.read_text()
        assert started[0].wait(timeout=30) == 0, (tmp_path / "headless.log").read_text()
    finally:
        for headless in started:
            headless.kill()


def ray_actor_pids() -> list[int]:
    """The replicas' Ray workers: Ray names each process after its actor's running call."""
    return [int(pid) for pid in os.listdir("/proc") if pid.isdigit()
            and b"ray::ReplicaActor" in Path(f"/proc/{pid}/cmdline").read_bytes()]


# the slow tail: a Ray cluster's start; the wire and keys it uses are the default tests' (above)
@pytest.mark.slow
def test_replicas_on_a_ray_cluster(tiny_qwen3):
    """`--data-parallel-backend ray`: the server starts a local Ray cluster and two replicas as
    actors in its placement group; requests go to both. A killed actor's stream fails at once (a
    5xx error event within 10 s), the other replica's stream runs on, and Ray's restart brings
    the replica back: the server routes to it again, and SIGTERM still exits 0."""
    pytest.importorskip("ray")
    server = start_server("--model", tiny_qwen3, "--served-model-name", MODEL,
                          "--data-parallel-size", "2", "--data-parallel-backend", "ray")
    try:
        streams = streams_on_each_replica(server, 1)
        assert len(pids := ray_actor_pids()) == 2
        os.kill(pids[0], signal.SIGKILL)
        killed, failed = time.monotonic(), []
        for stream in streams:
            try:
                for i, _ in enumerate(stream):
                    if i == 50:  # this replica serves on
                        stream.close()
                        break
            except openai.APIError as e:
                failed.append((str(e), time.monotonic() - killed))
        [(message, seconds)] = failed
        assert re.search("engine replica [01] exited", message) and seconds < 10
        assert httpx.get(f"{server.url}/health").status_code == 503
        deadline = time.monotonic() + START_TIMEOUT_S  # Ray restarts the actor; it loads again
        while httpx.get(f"{server.url}/health").status_code != 200:
            assert time.monotonic() < deadline, server.log.read_text()
            time.sleep(0.5)
        assert len(ray_actor_pids()) == 2 and pids[0] not in ray_actor_pids()
        streams = streams_on_each_replica(server, 1)
        for stream in streams:
            stream.close()
    finally:
        stop_server(server)
    assert server.proc.returncode == 0, server.log.read_text()


@pytest.fixture
def tp_server(tiny_qwen3):
    """The tiny Qwen3 served by two tensor-parallel ranks: they talk through shared memory."""
    server = start_server("--model", tiny_qwen3, "--served-model-name", MODEL,
                          "--tensor-parallel-size", "2")
    yield server
    stop_server(server)


# the slow tail (its own TP server); the module's server exits 0 on SIGTERM by default
@pytest.mark.slow
def test_sigterm_drains_and_exits_0(tp_server):
    server = tp_server
    shm, children = shm_files(server.proc.pid), descendants(server.proc.pid)
    assert shm, "TP ranks talk through shared memory: the check below would see nothing"
    assert len(children) >= 3, "a replica and its TP worker: the check below would see nothing"
    client, started, result = server.client(), threading.Event(), {}

    def stream() -> None:
        chunks = client.completions.create(prompt=[1, 2, 3], stream=True, max_tokens=64,
                                           model=MODEL, extra_body={"ignore_eos": True})
        for chunk in chunks:
            started.set()
            result["text"] = result.get("text", "") + chunk.choices[0].text
            result["finish_reason"] = chunk.choices[0].finish_reason

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(30)
    server.proc.send_signal(signal.SIGTERM)
    reader.join(60)
    assert result["finish_reason"] == "length"  # the stream was drained, not cut
    assert server.proc.wait(timeout=60) == 0, server.log.read_text()
    assert not [f for f in shm if os.path.exists(f)], "shared memory left behind"
    deadline = time.monotonic() + 5  # multiprocessing's resource trackers exit after their parents
    while (left := [pid for pid in children if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in left]


def test_a_cancelled_handler_cancels_its_request():
    """uvicorn cancels the handlers still running when a shutdown outlasts --shutdown-timeout:
    the request's work and the disconnect watch end with it, nothing is left to fail unseen."""
    class SilentClient:  # a request whose client neither sends nor leaves
        async def receive(self) -> dict:
            await asyncio.Event().wait()

    async def main() -> tuple[bool, list[asyncio.Task]]:
        work = asyncio.ensure_future(asyncio.Event().wait())  # a request that never ends
        handler = asyncio.ensure_future(until_disconnect(work, SilentClient()))
        await asyncio.sleep(0.01)
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler
        await asyncio.sleep(0)
        return work.cancelled(), [t for t in asyncio.all_tasks()
                                  if t is not asyncio.current_task() and not t.done()]

    work_cancelled, running = asyncio.run(main())
    assert work_cancelled and not running, running


def alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---- the wire between the API server and its replicas -----------------------------------------
class Canary:
    """Unpickled, it would create its file: a stand-in for code a forged message would run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return open, (str(self.path), "w")


def test_the_wire_decodes_its_own_types_only(tmp_path):
    """Every message round-trips as its type (a guided request's constraint too); a pickle, or a
    message of the other direction, raises a ValueError when decoded and runs nothing."""
    import pickle

    from nanoserve import GuidedDecodingParams, SamplingParams
    from nanoserve.llm_engine import RequestOutput
    from nanoserve.server import wire
    params = SamplingParams(temperature=0, seed=3, stop_token_ids=[7],
                            guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    add = wire.decode_command(wire.encode(wire.add(5, [1, 2, 3], params)))
    assert (add.request_id, add.token_ids, add.params) == (5, [1, 2, 3], dataclasses.replace(
        params, guided_decoding=None))
    assert GuidedDecodingParams(**add.guided) == params.guided_decoding
    out = RequestOutput(5, "", [9], [{9: -0.5}], "stop", 3, 0, 1)
    step = wire.decode_reply(wire.encode(wire.Step([(5, 3), (6, "empty prompt")], [out],
                                                   {"num_running": 1})))
    assert step.outputs[0].token_ids == [9] and step.outputs[0].num_draft_tokens is None
    assert step.load == {"num_running": 1}
    assert step.added == [(5, 3), (6, "empty prompt")]
    for decode, data in ((wire.decode_command, pickle.dumps(Canary(tmp_path / "canary"))),
                         (wire.decode_reply, wire.encode(wire.Abort(5)))):
        with pytest.raises(ValueError):
            decode(data)
    assert not (tmp_path / "canary").exists()


@pytest.mark.slow  # decoding: test_the_wire_decodes_its_own_types_only; the keys: the tail only
def test_a_forged_message_runs_nothing_and_a_stranger_is_refused(server, tmp_path):
    """At the replicas' port: a peer without keys, one with keys of its own, and one with the
    replicas' keys but a pickle for a message: none makes the canary. Meanwhile a short soak
    (tools/soak.py: bad requests, disconnects, stop strings, guided, seeded and n = 3 requests at
    once, every kind) gets its kinds' answers, /health answers throughout, and every block is
    free after."""
    import pickle

    import msgspec
    import zmq

    from nanoserve.server import wire
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import soak
    keys, context = wire.Keys.from_file(str(server.keys)), zmq.Context()
    other = msgspec.structs.replace(wire.Keys.new(), server_public=keys.server_public)
    for own in (None, other, keys):  # None: no CURVE at all
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"7")  # no replica's rank
        if own is None:
            sock.connect(server.rpc)
        else:
            wire.connect_securely(sock, own, server.rpc)
        sock.send(pickle.dumps(Canary(tmp_path / "canary")))
        sock.close(linger=1000)  # sent, or refused, within a second
    context.term()
    result = asyncio.run(soak.soak(server.url, MODEL, 24, 20.0, 60.0, server.proc.pid, API_KEY))
    assert all(result["checks"].values()), result
    assert not (tmp_path / "canary").exists()
    assert "dropped a message from b'7'" in server.log.read_text()  # the replicas' keys got in


# ---- the API against its own schema ------------------------------------------------------------
def test_the_api_holds_to_its_own_schema(server):
    """Every operation of /openapi.json driven with requests that schemathesis makes from the
    schema (10 each, by hypothesis): no 5xx, no hang (30 s each), every status, content type and
    body as the schema documents them. docs/serving.md gives a deeper run."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 5  # health, metrics, models, completions, chat completions
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=10, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # the same requests every run
        def check(case) -> None:
            case.call_and_validate(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        check()
