"""The streaming API on the packaged default model (CPU): requests added while others run, text
deltas that add up to the non-streamed text (multi-byte characters, leading spaces), stop strings,
logprobs against transformers, and aborts that free blocks at once."""
import pytest
import torch
from transformers import AutoTokenizer

from nanoserve import LLM, SamplingParams
from nanoserve.llm_engine import TextStream
from nanoserve.weights import default_model_dir

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Say hello in Japanese and Chinese characters.",  # multi-byte characters span tokens
    "List three primary colors.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, logprobs=3)


@pytest.fixture(scope="module")
def llm():
    with LLM(None, device="cpu", num_kvcache_blocks=128, max_model_len=512) as llm:
        yield llm


@pytest.fixture(scope="module")
def prompts(llm) -> list[str]:
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                              add_generation_prompt=True, tokenize=False)
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def greedy_outputs(llm, prompts) -> list[dict]:
    """generate()'s GREEDY outputs of the prompts, which the streamed runs must add up to."""
    return llm.generate(prompts, GREEDY, use_tqdm=False)


def stream_all(llm, prompts, params) -> dict:
    """Add every prompt as a streamed request, step until done; per request: its outputs."""
    seqs = [llm.add_request(p, params, stream=True) for p in prompts]
    outs = {seq.seq_id: [] for seq in seqs}
    while llm.scheduler.has_unfinished():
        for out in llm.stream_step():
            outs[out.request_id].append(out)
    return [outs[seq.seq_id] for seq in seqs]


def test_text_stream_adds_up_to_the_decoded_text():
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    for text in ["Hello world, leading  spaces", "naïve café 東京タワー 🙂🚀 ok", " \n\tx"]:
        ids, stream, parts = tok.encode(text), TextStream(tok, True), []
        for n in range(1, len(ids) + 1):
            stream.update(ids[:n], n == len(ids))
            parts.append(stream.delta(n == len(ids)))
        assert "".join(parts) == tok.decode(ids, skip_special_tokens=True) == text
        assert "\ufffd" not in "".join(parts[:-1])  # never half a character
    # a request that ends inside a character ends with U+FFFD, once, however often it is seen
    ids = tok.encode("東")[:-1]
    stream = TextStream(tok, True)
    for _ in range(2):
        stream.update(ids, finished=True)
    assert stream.text == tok.decode(ids) == "\ufffd"


def test_streamed_deltas_equal_the_generated_text(llm, prompts, greedy_outputs):
    outs = greedy_outputs
    streamed = stream_all(llm, prompts, GREEDY)
    assert llm.stream_step() == []  # an idle engine runs no step
    assert any(ord(c) > 0x3000 for c in outs[2]["text"])  # the multi-byte case is exercised
    for out, parts in zip(outs, streamed):
        assert "".join(p.text for p in parts) == out["text"]
        assert sum((p.token_ids for p in parts), []) == out["token_ids"]
        assert [p.finish_reason for p in parts[:-1]] == [None] * (len(parts) - 1)
        assert parts[-1].finish_reason == out["finish_reason"] in ("stop", "length")
        assert parts[-1].num_output_tokens == len(out["token_ids"])
        logprobs = sum((p.logprobs for p in parts), [])
        assert [list(d) for d in logprobs] == [list(d) for d in out["logprobs"]]
        for mine, theirs in zip(logprobs, out["logprobs"]):  # the prefix cache hits here
            assert max(abs(mine[t] - theirs[t]) for t in mine) < 1e-4


def test_logprobs_match_transformers(llm, prompts, hf_model):
    params = SamplingParams(temperature=0.8, max_tokens=12, seed=3, logprobs=5)
    out = llm.generate(prompts[:1], params, use_tqdm=False)[0]
    ids = llm.tokenizer.encode(prompts[0]) + out["token_ids"]
    with torch.no_grad():  # conftest's float32 transformers model
        ref = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)  # (T, V)
    n = len(out["token_ids"])
    assert len(out["logprobs"]) == n
    for i, (token, lp) in enumerate(zip(out["token_ids"], out["logprobs"])):
        row = ref[len(ids) - n - 1 + i]
        top = row.topk(5).indices.tolist()
        assert list(lp)[0] == token and len(lp) == 5 + (token not in top)
        assert [t for t in lp if t != token] == [t for t in top if t != token]  # likeliest first
        for t, value in lp.items():
            assert value == pytest.approx(row[t].item(), abs=2e-3)


def test_stop_strings_cut_the_text_streamed_or_not(llm, prompts, greedy_outputs):
    full = greedy_outputs
    stop = SamplingParams(temperature=0, max_tokens=32, stop=("Paris", "sea,", "Blue"))
    cut = llm.generate(prompts, stop, use_tqdm=False)
    for whole, out in zip(full, cut):
        hits = [whole["text"].find(s) for s in stop.stop if s in whole["text"]]
        assert out["text"] == whole["text"][:min(hits)] if hits else whole["text"]
        assert out["finish_reason"] == ("stop" if hits else whole["finish_reason"])
    assert sum("stop" == o["finish_reason"] for o in cut) >= 3 and "Paris" not in cut[0]["text"]
    streamed = stream_all(llm, prompts, stop)
    assert ["".join(p.text for p in parts) for parts in streamed] == [o["text"] for o in cut]
    assert [parts[-1].finish_reason for parts in streamed] == [o["finish_reason"] for o in cut]


def test_requests_join_a_running_batch_and_abort_frees_blocks_at_once(llm, prompts,
                                                                     greedy_outputs):
    solo = greedy_outputs[1:3]  # ~40 tokens each
    first = llm.add_request(prompts[1], GREEDY, stream=True)
    early = [out.text for _ in range(4) for out in llm.stream_step()]
    second = llm.add_request(prompts[2], GREEDY, stream=True)  # arrives while `first` decodes
    victim = llm.add_request(prompts[3], SamplingParams(max_tokens=40), stream=True)
    together, texts = 0, {first.seq_id: "".join(early), second.seq_id: ""}
    bm = llm.scheduler.block_manager
    while llm.scheduler.has_unfinished():
        outs = llm.stream_step()
        if victim.num_output_tokens == 3 and not victim.is_finished:
            held = bm.num_free_blocks
            llm.abort_request(victim)
            assert victim.finish_reason == "abort" and bm.num_free_blocks > held
        together += {o.request_id for o in outs} >= {first.seq_id, second.seq_id}
        for out in outs:
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
    assert together >= 20  # they decoded in the same steps
    assert [texts[first.seq_id], texts[second.seq_id]] == [o["text"] for o in solo]
    assert bm.num_free_blocks == len(bm.blocks) and not llm.streams
    parts = list(llm.stream(prompts[2], GREEDY))  # the one-request generator
    assert "".join(p.text for p in parts) == solo[1]["text"]


@pytest.mark.parametrize("field, value", [("logprobs", -1), ("logprobs", 21), ("stop", [""]),
                                          ("stop", "end")])
def test_bad_streaming_fields_raise(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_every_public_method_of_a_shut_down_engine_raises_one_clear_error():
    """The README's first snippet leaves `with LLM(...) as llm:` and later uses llm: whatever it
    calls then says what happened and what to do, instead of an AttributeError from inside."""
    # on the CPU on every machine: the errors are the API's, whatever device the engine had
    with LLM(None, device="cpu", num_kvcache_blocks=64, max_model_len=256) as llm:
        seq = llm.add_request("Hi", SamplingParams(max_tokens=2))
    calls = {"add_request": lambda: llm.add_request("Hi", SamplingParams()),
             "stream_step": llm.stream_step, "step": llm.step,
             "has_unfinished": llm.has_unfinished, "abort_request": lambda: llm.abort_request(seq),
             "generate": lambda: llm.generate(["Hi"]),
             "stream": lambda: next(llm.stream("Hi"))}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="this engine was shut down: create a new LLM"):
            call()
            pytest.fail(f"{name} ran on a shut-down engine")
    llm.shutdown()  # twice is fine
