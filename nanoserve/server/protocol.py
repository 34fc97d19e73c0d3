"""The OpenAI wire format: request models (pydantic), response and chunk shapes, error bodies.

Owns the translation between JSON and the engine's types: a request body becomes SamplingParams
(whose constructor validates the values), an engine output becomes a completion, a chat completion
or one of their stream chunks, with `usage` and OpenAI-shaped `logprobs`. It knows no HTTP and no
engine client (app.py, engine_client.py). Unknown fields are ignored, as OpenAI's clients send
extras, but for the sampling and tool fields nanoserve does not implement (UNSUPPORTED): those are
refused unless left at their no-op values, so no request is served as if they held.
"""
import time
import uuid
from dataclasses import dataclass, field, fields
from itertools import accumulate
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from transformers import PreTrainedTokenizerBase

from nanoserve.config import SamplingParams, extension
from nanoserve.llm_engine import RequestOutput

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what fits


class OpenAIError(Exception):
    """An error the client caused, sent with `status` as OpenAI's body: {"error": {"message",
    "type", "param", "code"}}. `param` names the request field at fault (None: no one field);
    `code` is OpenAI's machine-readable string, e.g. "model_not_found", or None."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "param": self.param, "code": self.code,
                          "type": self.TYPES.get(self.status, "server_error")}}


class ErrorBody(BaseModel):  # OpenAIError's body: {"error": {"message", "type", "param", "code"}}
    error: dict[str, str | None]


# the error statuses every route may answer, for the OpenAPI schema (a refusal, a missing key,
# another model, no replica up, a bug); a completion streams as server-sent events
ERRORS = {status: {"model": ErrorBody} for status in (400, 401, 404, 500, 503)}
STREAMS = {200: {"content": {"application/json": {}, "text/event-stream": {}}}}


# ---- requests ----------------------------------------------------------------------------------
class Strict(BaseModel):
    """A request model: values of the wrong JSON type are refused ("max_tokens": "3" is a 400, as
    OpenAI answers), not coerced; unknown fields are kept (model_extra) and read only if in
    UNSUPPORTED."""
    model_config = ConfigDict(extra="allow", strict=True)


# OpenAI's and vLLM's fields that change the output and that nanoserve does not implement (tool
# calls among them), with their no-op values: any other value is a 400, not a request served as if
# the field were absent
UNSUPPORTED = dict(presence_penalty=0, frequency_penalty=0, repetition_penalty=1, min_p=0,
                   logit_bias={}, use_beam_search=False, tools=[], tool_choice="none")


def whole(value: object) -> object:
    """3.0 as 3, an integer as JSON Schema counts it; "3" stays a string, which is refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(whole)]  # a request's integer field
# n and best_of: at most 128 (OpenAI's limit of n), so one request is not a flood
NumSamples = Annotated[int, Field(le=128), BeforeValidator(whole)]


class StreamOptions(Strict):
    include_usage: bool = False  # one more chunk before [DONE], with usage and no choices
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk as well


class SamplingRequest(Strict):
    """The fields /v1/completions and /v1/chat/completions share; None means the default."""
    model: str
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: NumSamples = 1  # samples of the prompt, the answer's choices
    best_of: NumSamples | None = None  # run this many, answer with the n likeliest (not streamed)
    # vLLM's extras
    top_k: Int | None = None  # 0 or -1: off
    ignore_eos: bool = False
    stop_token_ids: list[Int] | None = None
    # guided decoding: OpenAI's response_format ({"type": "json_object"} or {"type":
    # "json_schema", "json_schema": {"name": ..., "schema": {...}}}), or one of vLLM's extras
    response_format: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_param: ClassVar[str] = "prompt"  # the field an engine refusal of the prompt blames

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> list[SamplingParams]:
        """The engine's SamplingParams of each sample to run (samples.sample_params); a bad value
        is a 400 whose `param` names its field."""
        for name, no_op in UNSUPPORTED.items():
            if (value := self.model_extra.get(name)) not in (no_op, None):
                raise OpenAIError(400, f"{name} {value!r:.40} is not supported: leave it out or "
                                       f"send {no_op!r}", name, "unsupported_parameter")
        if self.stream and (self.best_of or self.n) > self.n:
            raise OpenAIError(400, "best_of > n cannot be streamed: which samples are the "
                                   "likeliest is known at their end", "best_of", "invalid_value")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        try:
            return extension("samples").sample_params(SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k in (None, -1) else self.top_k,
                max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                stop_token_ids=self.stop_token_ids or [], seed=self.seed, stop=stop,
                logprobs=logprobs, guided_decoding=self.guided_decoding(), n=self.n,
                best_of=self.best_of))
        except ValueError as e:  # SamplingParams' checks name the field first
            # the SamplingParams field the refusal starts with ("temperature must be ..."), if any
            name = next((f.name for f in fields(SamplingParams)
                         if str(e).startswith(f.name + " ")), None)
            param = self.param_name(name)  # the message names the request's field
            message = str(e) if name is None else param + str(e)[len(name):]
            raise OpenAIError(400, message, param, "invalid_value") from e

    def param_name(self, name: str | None) -> str | None:
        """The request field behind a SamplingParams field (they differ in chat)."""
        return name

    def guided_decoding(self) -> object:
        """The GuidedDecodingParams the request asks for, or None; a bad one is a 400."""
        given = {name: value for name in ("json", "regex", "choice", "grammar")
                 if (value := getattr(self, f"guided_{name}")) is not None}
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            given["json_object"] = True
        elif kind == "json_schema":
            schema = (self.response_format.get("json_schema") or {}).get("schema")
            if not isinstance(schema, (dict, str)):
                raise OpenAIError(400, "response_format of type json_schema needs json_schema."
                                       "schema, a JSON schema", "response_format", "invalid_value")
            given["json"] = schema
        elif kind != "text":
            raise OpenAIError(400, f"response_format's type {kind!r} is not 'text', 'json_object'"
                                   " or 'json_schema'", "response_format", "invalid_value")
        if not given:
            return None
        param = "response_format" if kind != "text" else f"guided_{next(iter(given))}"
        try:
            return extension("guided").GuidedDecodingParams(**given)  # imported when used
        except ValueError as e:
            raise OpenAIError(400, str(e), param, "invalid_value") from e


class CompletionRequest(SamplingRequest):
    prompt: str | list[Int] | list[str] | list[list[Int]]
    logprobs: Int | None = None  # k: the sampled token's log-probability and the k likeliest

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request (text or token ids): a batch of prompts is refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise OpenAIError(400, f"send one prompt per request, got a list of "
                                       f"{len(prompt)}", "prompt", "invalid_value")
            prompt = prompt[0]
        return prompt


class ContentPart(Strict):
    type: Literal["text"]  # the models read text: an image or audio part is a 400, not dropped
    text: str = ""


class ChatMessage(Strict):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The message as one string: its content parts (text) joined."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)  # an empty list: a 400
    logprobs: bool = False
    top_logprobs: Int | None = None  # with logprobs: how many likeliest tokens per position
    max_completion_tokens: Int | None = None  # OpenAI's newer name for max_tokens

    prompt_param: ClassVar[str] = "messages"

    def param_name(self, name: str | None) -> str | None:
        # chat's k is top_logprobs; its max_tokens may come as OpenAI's newer name
        limit = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        return {"logprobs": "top_logprobs", "max_tokens": limit}.get(name, name)


# ---- responses ---------------------------------------------------------------------------------
@dataclass
class Delta:
    """What a request produced since the client last heard from it (one or more engine steps)."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_draft_tokens: int | None = None  # with speculative decoding, on the last output
    num_accepted_tokens: int | None = None

    def add(self, out: "RequestOutput | Delta") -> None:
        """Append one engine RequestOutput; the counts are running totals, so the last wins."""
        self.text += out.text
        self.token_ids += out.token_ids
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(out.logprobs)
        self.finish_reason = out.finish_reason
        self.num_prompt_tokens, self.num_cached_tokens, self.num_output_tokens = (
            out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens)
        if (drafts := getattr(out, "num_draft_tokens", None)) is not None:
            self.num_draft_tokens, self.num_accepted_tokens = drafts, out.num_accepted_tokens


def usage(samples: list[Delta]) -> dict:
    """OpenAI's usage of a request's samples (each one's counts so far): the prompt once, every
    sample's output; with speculative decoding also the draft tokens, in the fields OpenAI gives a
    prediction's tokens (accepted_prediction_tokens, rejected_prediction_tokens)."""
    started = max(samples, key=lambda d: d.num_prompt_tokens)  # one that has output (the prompt)
    num_prompt, num_output = started.num_prompt_tokens, sum(d.num_output_tokens for d in samples)
    usage = {"prompt_tokens": num_prompt, "completion_tokens": num_output,
             "total_tokens": num_prompt + num_output,
             "prompt_tokens_details": {"cached_tokens": started.num_cached_tokens}}
    if drafted := [d for d in samples if d.num_draft_tokens is not None]:
        accepted = sum(d.num_accepted_tokens for d in drafted)
        rejected = sum(d.num_draft_tokens for d in drafted) - accepted
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                              "rejected_prediction_tokens": rejected}
    return usage


class ResponseHead:
    """id, object, created and model: the fields every response and chunk of a request repeats."""

    def __init__(self, kind: str, model: str) -> None:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id, self.model, self.created = f"{prefix}-{uuid.uuid4().hex}", model, int(time.time())
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def wrap(self, choices: list[dict], usage: dict | None = None, chunk: bool = False) -> dict:
        obj = "chat.completion.chunk" if chunk and self.object == "chat.completion" else self.object
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices} | ({} if usage is None else {"usage": usage})


def top_k_items(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k likeliest (token id, log-probability) pairs of one position, likeliest first."""
    return sorted(logprobs.items(), key=lambda item: item[1], reverse=True)[:k]


def completion_logprobs(tokenizer: PreTrainedTokenizerBase, delta: Delta, k: int,
                        text_offset: int) -> dict:
    """The legacy completions shape: parallel lists, top_logprobs keyed by token text."""
    tokens = [tokenizer.decode([t]) for t in delta.token_ids]
    offsets = list(accumulate(map(len, tokens), initial=text_offset))[:-1]  # each token's start
    return {"tokens": tokens, "text_offset": offsets,
            "token_logprobs": [lp[t] for t, lp in zip(delta.token_ids, delta.logprobs)],
            "top_logprobs": [{tokenizer.decode([i]): v for i, v in top_k_items(lp, k)}
                             for lp in delta.logprobs]}


def chat_logprobs(tokenizer: PreTrainedTokenizerBase, delta: Delta, k: int) -> dict:
    """The chat shape: one entry per token with its text, bytes and top_logprobs."""
    def entry(token_id: int, logprob: float) -> dict:
        token = tokenizer.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    return {"content": [{**entry(t, lp[t]), "top_logprobs": [entry(*i) for i in top_k_items(lp, k)]}
                        for t, lp in zip(delta.token_ids, delta.logprobs)]}
