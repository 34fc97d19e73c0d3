"""Guided decoding (extensions/guided.py): JSON schemas, regular expressions, choices and
grammars through xgrammar, on the default model.

Each kind of constraint gives output that its checker accepts (json.loads and jsonschema, a full
regex match, one of the choices); bad constraints raise a ValueError before anything runs; and
the rest holds with it: an unguided seeded request next to guided ones, overlap scheduling on and
off, speculative decoding, preemption, max_tokens, logprobs and streaming."""
import json
import re
import threading

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from bench import guided_schema
from nanoserve import LLM, GuidedDecodingParams, SamplingParams
from nanoserve.extensions.guided import Guided, parse
from nanoserve.sequence import Sequence

# on a GPU its engine takes a share of the memory sized beside no other: in test_e2e's
# pytest-xdist group, one engine after another
pytestmark = pytest.mark.xdist_group(name="gpu_memory")

# strings and numbers are bounded, so a small model cannot run on until max_tokens
NAME, BOOL = {"type": "string", "minLength": 1, "maxLength": 20}, {"type": "boolean"}


def obj(**properties) -> dict:  # an object whose properties are all required
    return {"type": "object", "properties": properties, "required": list(properties)}


def integer(low: int, high: int, kind: str = "integer") -> dict:
    return {"type": kind, "minimum": low, "maximum": high}


def array(items: dict, low: int, high: int) -> dict:
    return {"type": "array", "items": items, "minItems": low, "maxItems": high}


def enum(*values) -> dict:
    return {"enum": list(values)}


SCHEMAS = [  # nested objects, arrays, enums, numbers, required fields
    obj(name=NAME, age=integer(0, 120)),
    obj(city=NAME, population=integer(0, 99999999), capital=BOOL),
    obj(title=NAME, year=integer(1900, 2030), genres=array(enum("drama", "comedy", "war"), 1, 3)),
    obj(sentiment=enum("positive", "negative", "neutral"), confidence=integer(0, 1, "number")),
    obj(user=obj(id=integer(1, 9999), email=NAME), active=BOOL),
    obj(items=array(obj(sku=NAME, qty=integer(1, 99)), 1, 2)),
    obj(color=enum("red", "green", "blue"), rgb=array(integer(0, 255), 3, 3)),
    obj(question=NAME, answer=BOOL),
    obj(lat=integer(-90, 90, "number"), lon=integer(-180, 180, "number")),
    obj(book=obj(author=NAME, pages=integer(1, 5000)), rating=enum(1, 2, 3, 4, 5)),
    obj(tags=array({"type": "string", "maxLength": 12}, 1, 4)),
    obj(status=enum("open", "closed"), priority=integer(1, 5),
        assignee={"anyOf": [NAME, {"type": "null"}]}),
    obj(temperature=integer(-50, 60, "number"), unit=enum("C", "F")),
    obj(first=NAME, last=NAME,
        address=obj(street=NAME, zip={"type": "string", "pattern": "^[0-9]{5}$"})),
    obj(matrix=array(array(integer(0, 9), 2, 2), 2, 2)),
    obj(language=enum("python", "rust", "go"), typed=BOOL,
        version={"type": "string", "pattern": "^[0-9]+\\.[0-9]+$"}),
]
TOPICS = ["a person", "a city", "a movie", "the sentiment of 'great food, slow service'",
          "a user account", "a shopping cart", "a color", "a yes/no question", "a place on earth",
          "a book review", "tags for a blog post about cooking", "a bug ticket", "today's weather",
          "a customer with an address", "a 2x2 matrix", "a programming language"]
REGEXES = {  # question -> the regular expression its answer must match in full
    "When did Apollo 11 land on the moon? Give the date.": r"\d{4}-\d{2}-\d{2}",
    "When is Christmas 2024?": r"(0[1-9]|1[0-2])/(0[1-9]|[12]\d|3[01])/\d{4}",
    "When did the Berlin wall fall?": r"\d{1,2} (January|February|March|April|May|June|July|"
                                      r"August|September|October|November|December) \d{4}",
    "What is the date of New Year's Day 2025?": r"\d{4}/\d{2}/\d{2}",
    "When was the first iPhone released?": r"(19|20)\d{2}",
    "Give an e-mail address for John Smith.": r"[a-z]{2,10}\.[a-z]{2,10}@[a-z]{2,8}\.(com|org)",
    "Write the support e-mail of a shop.": r"[a-z0-9]{2,12}@[a-z]{2,10}\.(com|net)",
    "Make up an e-mail address.": r"[a-zA-Z]{1,12}@example\.com",
    "Give a university e-mail address.": r"[a-z]{3,10}@[a-z]{2,10}\.edu",
    "A phone number for a pizza place:": r"\(\d{3}\) \d{3}-\d{4}",
    "Give a toll-free number.": r"\+1-\d{3}-\d{3}-\d{4}",
    "What is the emergency number in the US?": r"\d{3}",
    "Write a London phone number.": r"\+44 20 \d{4} \d{4}",
    "Write a phone number with dots.": r"\d{3}\.\d{3}\.\d{4}",
    "What time is lunch?": r"[01]\d:[0-5]\d",
    "Write a hex color for sky blue.": r"#[0-9a-f]{6}",
}


@pytest.fixture(scope="module")
def llm(model_dir):
    # on a GPU, a third of its memory: the tests that build engines of their own beside it get
    # the rest
    with LLM(model_dir, gpu_memory_utilization=0.3) as llm:
        yield llm


@pytest.fixture(scope="module")
def chat(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    return lambda q: tok.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, tokenize=False)


def guided(max_tokens: int = 100, temperature: float = 0, seed: int | None = None,
           **constraint) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                          guided_decoding=GuidedDecodingParams(**constraint))


def test_json_schemas(llm, chat):
    outs = llm.generate([chat(f"Describe {t} as JSON.") for t in TOPICS],
                        [guided(json=s) for s in SCHEMAS])
    for out, schema in zip(outs, SCHEMAS):
        assert out["finish_reason"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)


def test_regexes(llm, chat):
    outs = llm.generate([chat(q) for q in REGEXES], [guided(40, regex=r) for r in REGEXES.values()])
    for out, regex in zip(outs, REGEXES.values()):
        assert out["finish_reason"] == "stop" and re.fullmatch(regex, out["text"]), out


def test_choice_greedy_and_sampled(llm, chat):
    choices = ["Positive", "Negative", "Mixed \"feelings\""]
    reviews = ["I loved it!", "Terrible, never again.", "Good food, rude staff."]
    prompts = [chat(f"Is this review positive or negative? {r}") for r in reviews] * 2
    params = [guided(20, choice=choices)] * 3 + [guided(20, 1.0, seed, choice=choices)
                                                  for seed in range(3)]
    for out in llm.generate(prompts, params):
        assert out["text"] in choices and out["finish_reason"] == "stop", out


def test_a_grammar_that_ended_leaves_the_rows_after_it_unmasked(llm, chat):
    """ignore_eos runs a request past the stop token that ended its grammar: a choice, that
    token, then rows no mask holds back (the grammar allows nothing more), to max_tokens."""
    choice = GuidedDecodingParams(choice=["yes", "no"])
    seq = llm.add_request(chat("Yes or no?"), SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, guided_decoding=choice))
    while llm.has_unfinished():
        llm.step()
    ids, eos = seq.output_token_ids, llm.scheduler.eos_token_ids
    end = next(i for i, token in enumerate(ids) if token in eos)
    assert llm.tokenizer.decode(ids[:end]) in ("yes", "no") and len(ids) == 12
    assert llm.switched_on["guided"].guides[seq].done


def test_choices_and_enums_past_ascii(llm, chat):
    choices = ["😀 ok", "🙂 café"]  # past the BMP: surrogate pairs when escaped
    outs = llm.generate([chat("Pick one.")] * 2,
                        [guided(20, choice=choices), guided(20, json={"enum": choices})])
    assert outs[0]["text"] in choices and json.loads(outs[1]["text"]) in choices, outs


def test_json_object_and_grammar(llm, chat):
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    outs = llm.generate([chat("Give a JSON object with a cat's name and age."),
                         chat("What is 6 times 7?")],
                        [guided(json_object=True), guided(20, grammar=grammar)])
    assert isinstance(json.loads(outs[0]["text"]), dict)
    assert re.fullmatch(r"The answer is [0-9]+\.", outs[1]["text"]), outs[1]


def test_cut_by_max_tokens_is_length(llm, chat):
    out, = llm.generate([chat("Describe a person as JSON.")], guided(5, json=SCHEMAS[0]))
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 5


@pytest.mark.parametrize("constraint, reason", [
    ({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
    ({"regex": "a", "choice": ["a"]}, "got ['regex', 'choice']"),
    ({"json": "{bad"}, "bad guided_decoding json: Failed to parse JSON"),
    ({"json": {"type": "objekt"}}, 'bad guided_decoding json: Unsupported type "objekt"'),
    ({"regex": "(["}, "bad guided_decoding regex: Regex parsing error at position 3"),
    ({"grammar": "root ::= foo"}, 'bad guided_decoding grammar: EBNF parser error at line 1, '
                                  'column 10: Rule "foo" is not defined'),
    ({"choice": "ab"}, "choice must list 1+ non-empty strings"),
    ({"choice": ["a", ""]}, "choice must list 1+ non-empty strings"),
    ({"choice": []}, "choice must list 1+ non-empty strings"),
])
def test_bad_constraints_raise_a_value_error(constraint, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        GuidedDecodingParams(**constraint)


def test_not_a_guided_decoding_params_raises_before_scheduling(llm):
    with pytest.raises(ValueError, match="guided_decoding must be a GuidedDecodingParams"):
        llm.generate(["hi"], SamplingParams(guided_decoding={"json": {}}))
    assert not llm.has_unfinished()


def test_one_schema_is_parsed_and_compiled_once(llm, chat):
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                      "maximum": 9}}, "required": ["id"]}
    parsed, cache = parse.cache_info().misses, llm.switched_on["guided"].compiler
    outs = llm.generate([chat(f"Give item {i} as JSON.") for i in range(8)],
                        [guided(json=schema)] * 8)  # a GuidedDecodingParams per request
    assert parse.cache_info().misses == parsed + 1
    size = cache.get_cache_size_bytes()
    llm.generate([chat("Give item 9 as JSON.")], guided(json=json.dumps(schema)))
    assert cache.get_cache_size_bytes() == size  # the same text: compiled already
    assert all(json.loads(o["text"])["id"] in range(10) for o in outs)


def test_unguided_seeded_request_keeps_its_tokens_in_a_mixed_batch(llm, chat):
    plain = SamplingParams(temperature=1.0, seed=7, max_tokens=30)
    alone, = llm.generate([chat("Tell me about owls.")], plain)
    outs = llm.generate([chat("Describe a city as JSON."), chat("Tell me about owls."),
                         chat("A phone number:")],
                        [guided(json=SCHEMAS[1]), plain, guided(40, regex=r"\d{3}-\d{4}")])
    assert outs[1]["token_ids"] == alone["token_ids"]
    jsonschema.validate(json.loads(outs[0]["text"]), SCHEMAS[1])
    assert re.fullmatch(r"\d{3}-\d{4}", outs[2]["text"])


# the slow tail: test_speculative.py and test_e2e.py check each of these by default
@pytest.mark.slow
def test_same_tokens_with_overlap_speculation_and_preemption(model_dir, chat):
    """Greedy and seeded guided requests give the same tokens with overlap scheduling on (the
    default) and off, with speculative decoding (drafts checked by the grammar), and with a KV
    cache so small that sequences are preempted and recomputed while prompts are prefilled in
    chunks (one engine for both: each changes when a request's steps run). On the CPU, also on a
    machine with a GPU: there the same tokens in any batch are batch_invariant's (test_gpu.py)."""
    prompts = [chat(f"Describe {t} as JSON. Repeat the keys exactly.") for t in TOPICS[:4]]
    # up to 24 tokens of each answer (a whole one takes 15-34): the runs are compared token by token
    params = [guided(24, json=s, temperature=t, seed=0) for s, t in zip(SCHEMAS, [0, 0.8] * 2)]
    runs = {}
    for name, settings in {"overlap": {}, "plain": dict(overlap_scheduling=False),
                           "speculative": dict(speculative_method="ngram",
                                               num_speculative_tokens=4, prompt_lookup_min=1),
                           "preempted_and_chunked": dict(max_model_len=128, num_kvcache_blocks=10,
                                                         max_num_batched_tokens=32)}.items():
        with LLM(model_dir, device="cpu", **settings) as llm:
            runs[name] = [o["token_ids"] for o in llm.generate(prompts, params)]
            if name == "speculative":
                assert llm.loop.stats.num_accepted_tokens > 0
            if name == "preempted_and_chunked":  # and some prompt longer than a step's tokens
                assert llm.scheduler.num_preemptions > 0
                assert max(len(llm.tokenizer.encode(p)) for p in prompts) > 32
    for name, tokens in runs.items():
        assert tokens == runs["overlap"], name


def test_logprobs_and_streaming(llm, chat):
    params = SamplingParams(temperature=0, max_tokens=60, logprobs=2,
                            guided_decoding=GuidedDecodingParams(json=SCHEMAS[6]))
    out, = llm.generate([chat("Describe a color as JSON.")], params)
    assert len(out["logprobs"]) == len(out["token_ids"])
    streamed = list(llm.stream(chat("Describe a color as JSON."), params))
    assert "".join(o.text for o in streamed) == out["text"]
    assert streamed[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(out["text"]), SCHEMAS[6])


def test_masks_fill_on_threads_and_into_buffers_made_once(llm, chat, monkeypatch):
    """With rows_per_filler rows or more a filler, the masks fill on the filling pool, each run
    of rows on one thread (xgrammar's own pool starts and joins its threads at every call). The
    threads and the pinned buffers are made once: 20 steps start at most the pool's threads, make
    no BatchGrammarMatcher and pin no memory (on CUDA a fresh pinned buffer would), and the pool's
    masks are the engine thread's. 16 sequences (every fourth unguided, so the masked rows are an
    index) step on random logits, each row taking its argmax."""
    made, started, pinned = [], [], []

    class Recorded(xgr.BatchGrammarMatcher):
        def __init__(self, max_threads="auto"):
            made.append(max_threads)
            super().__init__(max_threads)

    def counted(calls: list, real):
        return lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)

    monkeypatch.setattr(xgr, "BatchGrammarMatcher", Recorded)
    prompts = [llm.tokenizer.encode(chat(f"Describe {t} as JSON.")) for t in TOPICS[:16]]
    params = [SamplingParams(temperature=0) if i % 4 == 3  # a schema each, longer than 20 tokens
              else guided(json=guided_schema(f"key_{i}")) for i in range(16)]
    tokens = {}
    for rows_per_filler in [16, 1]:  # 12 guided rows: on the engine's thread, on the pool
        ext = Guided(llm)
        ext.rows_per_filler, made_first = rows_per_filler, len(made)
        seqs = [Sequence(p, sp, llm.config.kvcache_block_size) for p, sp in zip(prompts, params)]
        logits = torch.Generator().manual_seed(0)
        with monkeypatch.context() as m:
            for step in range(20):
                if step == 1:  # after the first, which started the grammars' compiles
                    m.setattr(threading.Thread, "start", counted(started, threading.Thread.start))
                    m.setattr(torch.Tensor, "pin_memory", counted(pinned, torch.Tensor.pin_memory))
                scores = torch.randn(16, llm.config.hf_config.vocab_size, generator=logits)
                masked = ext.before_sample(scores.to(ext.device), seqs)
                for seq, token in zip(seqs, masked.argmax(-1).tolist()):
                    seq.token_ids.append(token)
        tokens[rows_per_filler] = [seq.output_token_ids for seq in seqs]
        assert len(made) == made_first and set(made) == {1}  # one thread each, made before
        assert len(started) <= len(ext.fillers) and not pinned
    assert tokens[1] == tokens[16]
    assert all(llm.tokenizer.decode(tokens[1][i]).startswith('[{') for i in range(16) if i % 4 < 3)
