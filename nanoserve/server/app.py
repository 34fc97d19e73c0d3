"""The FastAPI app: OpenAI's routes on top of an EngineClient.

A handler checks the key and the model name, turns the body into SamplingParams and prompt token
ids (protocol.py, the tokenizer), submits them to a replica through the engine client and then
either streams its deltas as server-sent events (`data: {chunk}` lines, then `data: [DONE]`) or
gathers them into one response. Every client error leaves as an OpenAI error body with a 4xx; a
replica that goes down mid-request ends it with a 500 body (in a stream: an `error` event). The
lifespan starts the replicas and waits for them before the port opens and, after uvicorn has
drained the connections, stops them.
"""
import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import PreTrainedTokenizerBase

from nanoserve.extensions.samples import cumulative_logprob
from nanoserve.server import protocol
from nanoserve.server.engine_client import EngineClient, RequestStream
from nanoserve.server.protocol import Delta, OpenAIError


def build_app(client: EngineClient, model_name: str, api_key: str | None = None) -> FastAPI:
    """The server's routes around the engine client's replicas, served under `model_name`."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        yield
        await client.stop()

    app = FastAPI(title="nanoserve", lifespan=lifespan, responses=protocol.ERRORS)
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        if down := [r.rank for r in client.replicas if not r.up]:  # a 503 in OpenAI's shape
            raise OpenAIError(503, f"engine replicas {down} of {len(client.replicas)} are down")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(client.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(openai_routes(client, model_name, api_key))
    return app


def openai_routes(client: EngineClient, model_name: str, api_key: str | None) -> APIRouter:
    """/v1/models, /v1/completions and /v1/chat/completions, behind the API key if one is set."""
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(key_check(api_key))])

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                "owned_by": "nanoserve", "max_model_len": client.max_model_len}]}

    @v1.post("/completions", responses=protocol.STREAMS)
    async def completions(body: protocol.CompletionRequest, request: Request) -> Response:
        check_model(body.model, model_name)
        max_tokens = protocol.COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        stream = await submit(client, body, body.single_prompt(), max_tokens, body.logprobs)
        head = protocol.ResponseHead("completion", model_name)
        return await respond(Completion(head, client.tokenizer, body.logprobs), stream, body,
                             request)

    @v1.post("/chat/completions", responses=protocol.STREAMS)
    async def chat_completions(body: protocol.ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model, model_name)
        prompt = chat_prompt(client.tokenizer, body)
        limit = body.max_tokens if body.max_completion_tokens is None else (
            body.max_completion_tokens)
        # default: what the context has left (at least 1: a full one is the engine's refusal)
        max_tokens = max(1, client.max_model_len - len(prompt)) if limit is None else limit
        logprobs = (body.top_logprobs or 0) if body.logprobs else None  # the engine's k
        stream = await submit(client, body, prompt, max_tokens, logprobs)
        chat = ChatCompletion(protocol.ResponseHead("chat", model_name), client.tokenizer, logprobs)
        return await respond(chat, stream, body, request)

    return v1


# ---- errors ------------------------------------------------------------------------------------
def add_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape, FastAPI's own (404, 405, 422) included."""
    @app.exception_handler(OpenAIError)  # and ValueError: the engine's refusals name the fix
    @app.exception_handler(ValueError)
    async def openai_error(request: Request, e: OpenAIError | ValueError) -> JSONResponse:
        e = e if isinstance(e, OpenAIError) else OpenAIError(400, str(e))
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)  # malformed JSON, missing or mistyped fields
    async def invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error(e.errors()).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)  # routing: no such route, or wrong method
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(e.status_code)
        error = OpenAIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}; "
                                           "GET /openapi.json lists the routes", None, code)
        return JSONResponse(error.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)  # a bug: still a body an OpenAI client can read
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        message = f"internal error ({type(e).__name__}: {e}); the server log has the traceback"
        return JSONResponse(OpenAIError(500, message).body(), status_code=500)


def validation_error(errors: list[dict]) -> OpenAIError:
    """pydantic's errors as one 400: every problem ("field: what is wrong") in the message, the
    first one's field as `param`, and OpenAI's code for a missing or a mistyped field."""
    def where(err: dict) -> str:
        return ".".join(str(part) for part in err["loc"] if part != "body")

    first = errors[0] if errors else {"type": "", "loc": ()}
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        return OpenAIError(400, f"the body is not valid JSON ({reason})")
    message = "; ".join(f"{where(err) or 'body'}: {err['msg']}" for err in errors)
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_type"
    return OpenAIError(400, message, where(first) or None, code)


# ---- checks --------------------------------------------------------------------------------------
def key_check(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A dependency of every /v1 route, checked before the body is: with --api-key, a request
    must carry `Authorization: Bearer <api_key>`."""
    async def check(request: Request) -> None:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            raise OpenAIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                   "with the server's --api-key", None, "invalid_api_key")
    return check


def check_model(asked: str, served: str) -> None:
    if asked != served:
        raise OpenAIError(404, f"the model '{asked}' does not exist: this server serves "
                               f"'{served}' (see GET /v1/models)", "model", "model_not_found")


def chat_prompt(tokenizer: PreTrainedTokenizerBase,
                body: protocol.ChatCompletionRequest) -> list[int]:
    """The messages through the model's chat template, ending where the assistant's turn starts."""
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


async def submit(client: EngineClient, body: protocol.SamplingRequest, prompt: str | list[int],
                 max_tokens: int, logprobs: int | None) -> RequestStream:
    """The request's samples (each with its SamplingParams), tokenized, into a replica; the
    engine's refusal of the prompt (empty, outside the vocabulary, past max_model_len) is a 400
    that blames the prompt's field."""
    samples = body.sampling_params(max_tokens, logprobs)
    if isinstance(prompt, str):
        prompt = client.tokenizer.encode(prompt)
    try:
        return await client.submit(prompt, samples)
    except ValueError as e:  # a prompt too long for the context gets OpenAI's code for it
        code = "context_length_exceeded" if "max_model_len" in str(e) else "invalid_value"
        raise OpenAIError(400, str(e), body.prompt_param, code) from e


# ---- responses -----------------------------------------------------------------------------------
class Completion:
    """/v1/completions: a choice is {"index", "text", "logprobs", "finish_reason"}."""

    def __init__(self, head: protocol.ResponseHead, tokenizer: PreTrainedTokenizerBase,
                 logprobs: int | None) -> None:
        self.head, self.tokenizer, self.k = head, tokenizer, logprobs
        self.text_offset = {}  # by choice: the sent tokens' characters, the next token's offset

    def choice(self, index: int, delta: Delta, chunk: bool) -> dict:
        logprobs, offset = None, self.text_offset.get(index, 0)
        if self.k is not None and delta.logprobs is not None:
            logprobs = protocol.completion_logprobs(self.tokenizer, delta, self.k, offset)
            self.text_offset[index] = offset + sum(map(len, logprobs["tokens"]))  # stops cut text
        return {"index": index, "text": delta.text, "logprobs": logprobs,
                "finish_reason": delta.finish_reason}


class ChatCompletion(Completion):
    """/v1/chat/completions: a choice holds a "message" (or, in a stream, a "delta")."""

    def choice(self, index: int, delta: Delta, chunk: bool) -> dict:
        wanted = self.k is not None and delta.logprobs is not None
        logprobs = protocol.chat_logprobs(self.tokenizer, delta, self.k) if wanted else None
        message = {"content": delta.text} if chunk else {"role": "assistant", "content": delta.text}
        return {"index": index, "delta" if chunk else "message": message, "logprobs": logprobs,
                "finish_reason": delta.finish_reason}

    def first_chunk(self, n: int) -> dict:  # OpenAI opens a chat stream with the role alone
        return self.head.wrap([{"index": i, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None} for i in range(n)],
                              chunk=True)


async def respond(shape: Completion, stream: RequestStream, body: protocol.SamplingRequest,
                  request: Request) -> Response:
    if body.stream:
        options = body.stream_options or protocol.StreamOptions()
        return StreamingResponse(sse(shape, stream, options), media_type="text/event-stream")
    totals = await until_disconnect(gather(stream), request)
    if totals is None:
        return Response(status_code=499)  # nginx's status for a client that left: nobody reads it
    chosen = totals if body.best_of is None else sorted(  # the n likeliest, likeliest first
        totals, key=lambda d: -cumulative_logprob(d.token_ids, d.logprobs))[:body.n]
    choices = [shape.choice(i, total, chunk=False) for i, total in enumerate(chosen)]
    return JSONResponse(shape.head.wrap(choices, protocol.usage(totals)))


async def sse(shape: Completion, stream: RequestStream,
              options: protocol.StreamOptions) -> AsyncIterator[str]:
    """Server-sent events: one `data:` line per delta of a sample. A client that leaves cancels
    this generator (Starlette watches the socket), and leaving RequestStream aborts the request.
    A replica that goes down ends the stream with an `error` event (the status went out
    already)."""
    if isinstance(shape, ChatCompletion):  # a completion stream opens with its first delta
        yield event(shape.first_chunk(len(stream.requests)))
    last = [Delta() for _ in stream.requests]
    try:
        async for i, delta in stream:  # its counts are sample i's so far
            last[i] = delta
            usage = protocol.usage(last) if options.continuous_usage_stats else None
            yield event(shape.head.wrap([shape.choice(i, delta, chunk=True)], usage, chunk=True))
    except OpenAIError as e:
        yield event(e.body())
        return
    if options.include_usage:
        yield event(shape.head.wrap([], protocol.usage(last), chunk=True))
    yield "data: [DONE]\n\n"


def event(chunk: dict) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


async def gather(stream: RequestStream) -> list[Delta]:
    totals = [Delta() for _ in stream.requests]
    async for i, delta in stream:
        totals[i].add(delta)
    return totals


async def until_disconnect(work: Awaitable[list[Delta]], request: Request) -> list[Delta] | None:
    """work's result, or None if the client disconnects first (work is then cancelled, which
    aborts its request): a plain response has no stream whose writes would notice."""
    work_task, watch_task = map(asyncio.ensure_future, (work, wait_disconnect(request)))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        return work_task.result() if work_task.done() else None
    finally:  # both end with the handler, also when uvicorn cancels it (a shutdown's timeout)
        watch_task.cancel()
        work_task.cancel()


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
