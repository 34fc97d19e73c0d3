"""EngineLoop: the one thread that drives the engine, and the queues between it and HTTP handlers.

The engine is not thread-safe, so exactly one thread calls it. Handlers (on the asyncio event loop)
put commands in `inbox` (add a request, abort one, stop); the loop thread takes them between steps,
runs `engine.stream_step()` while anything is unfinished, and hands each step's outputs back to the
event loop in one `call_soon_threadsafe`, which puts them into per-request asyncio queues (a
large batch's in turns: EVENTS_PER_STEP). A handler reads its queue through RequestStream;
leaving it early (the client went away) aborts the request, which frees its KV blocks before the
next step. Invariant: a request is in `requests` from its add until its last output (or its
abort); only the loop thread touches the engine.
"""
import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from nanoserve.config import SamplingParams
from nanoserve.llm_engine import LLMEngine, RequestOutput
from nanoserve.sequence import Sequence
from nanoserve.server.metrics import Metrics
from nanoserve.server.protocol import Delta, OpenAIError

logger = logging.getLogger("nanoserve.server")
# Server-sent events per engine step, about: when more requests advance in a step, each one's
# outputs are held and sent every few steps, several tokens per event. Every event is Python work
# on the event loop under the GIL, which the engine thread needs too: hundreds per step slow each
# step down, a few dozen cost little, and a light load (fewer requests than this) is unaffected.
EVENTS_PER_STEP = 32


@dataclass(eq=False)
class Request:
    """One request as both sides see it: the handler waits on `added` then reads `outputs`."""
    prompt: str | list[int]
    params: SamplingParams
    added: asyncio.Future  # set to the request's Sequence, or to the ValueError that refused it
    outputs: asyncio.Queue  # lists of the engine's RequestOutputs, then None if aborted
    arrival: float = field(default_factory=time.perf_counter)
    seq: Sequence | None = None  # the engine's sequence, once added (loop thread only)
    pending: list[RequestOutput] = field(default_factory=list)  # not sent yet (loop thread only)
    last_token: float | None = None  # when the last output arrived (TTFT, then ITL)


@dataclass
class FinalOutput(RequestOutput):
    """A request's last output, with what speculative decoding drafted and accepted for it."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class Abort:
    request: Request


class Stop:
    pass


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: Metrics,
                 events_per_step: int = EVENTS_PER_STEP) -> None:
        self.engine, self.metrics = engine, metrics
        self.events_per_step = events_per_step or None  # None: every output is sent at once
        self.inbox: queue.SimpleQueue[Request | Abort | Stop] = queue.SimpleQueue()
        self.requests: dict[int, Request] = {}  # request id -> Request; loop thread only
        self.thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False
        self.num_steps = 0

    # ---- the event loop's side ------------------------------------------------------------------
    def start(self, event_loop: asyncio.AbstractEventLoop) -> None:
        self.event_loop = event_loop
        self.thread.start()

    async def submit(self, prompt: str | list[int], params: SamplingParams) -> "RequestStream":
        """Queue a request; raise the engine's ValueError if it refuses the prompt."""
        if self.stopping or not self.thread.is_alive():
            raise OpenAIError(503, "the server is shutting down: retry on another replica")
        request = Request(prompt, params, self.event_loop.create_future(), asyncio.Queue())
        self.inbox.put(request)
        try:
            seq = await request.added
        except asyncio.CancelledError:  # the client left before the loop thread took it
            self.abort(request)
            raise
        return RequestStream(self, request, seq.num_prompt_tokens)

    def abort(self, request: Request) -> None:
        self.inbox.put(Abort(request))

    def stop(self) -> None:
        """Abort what is left, stop the thread and the engine (TP workers, shared memory)."""
        self.inbox.put(Stop())
        self.thread.join()
        self.engine.shutdown()

    # ---- the loop thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:  # a bug here must not leave clients waiting forever
            logger.exception("the engine loop failed; ending every request")
            self.stopping = True
            for request in self.requests.values():
                self._call(request.outputs.put_nowait, None)
            while not self.inbox.empty():
                if isinstance(command := self.inbox.get(), Request):
                    self._call(_settle, command.added, RuntimeError("the engine loop failed"))
            raise

    def _serve(self) -> None:
        while not self.stopping:
            busy = self.engine.has_unfinished()
            # idle: block until a command comes; busy: take what is there and step
            while not self.inbox.empty() or not busy:
                self._handle(self.inbox.get())
                busy = self.engine.has_unfinished()
                if self.stopping:
                    return
            try:
                outputs = self.engine.stream_step()
            except Exception:  # a broken step must not hang its clients: end them all
                logger.exception("engine step failed; aborting every request")
                self._abort_all()
                continue
            self._deliver(outputs)

    def _handle(self, command: Request | Abort | Stop) -> None:
        if isinstance(command, Request):
            self._add(command)
        elif isinstance(command, Abort):
            self._abort(command.request)
        else:
            self._abort_all()
            self.stopping = True
        self.metrics.observe_engine(self.engine)

    def _add(self, request: Request) -> None:
        try:
            seq = self.engine.add_request(request.prompt, request.params, stream=True)
        except ValueError as e:  # bad prompt: back to its own handler, the engine unchanged
            self._call(_settle, request.added, e)
            return
        request.seq = seq
        self.requests[seq.seq_id] = request
        self._call(_settle, request.added, seq)

    def _abort(self, request: Request) -> None:
        seq = request.seq
        if seq is None or self.requests.pop(seq.seq_id, None) is None:
            return  # refused, or already finished (its last output raced the abort)
        self.engine.abort_request(seq)
        self.metrics.num_aborted.inc()
        self._call(request.outputs.put_nowait, None)

    def _abort_all(self) -> None:
        for request in list(self.requests.values()):
            self._abort(request)

    def _final(self, out: RequestOutput, request: Request) -> RequestOutput:
        """A request's last output, with speculative decoding's counts for it when it ran."""
        spec = self.engine.extensions.get("speculative")
        if spec is None or (counts := spec.requests.get(request.seq)) is None:
            return out
        return FinalOutput(**vars(out), num_draft_tokens=counts.num_draft_tokens,
                           num_accepted_tokens=counts.num_accepted_tokens)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their handlers: at most about events_per_step requests'
        worth per step, each request in turn (first and last outputs at once)."""
        now, self.num_steps = time.perf_counter(), self.num_steps + 1
        # a request's turn comes every this many steps
        every = -(-len(outputs) // self.events_per_step) if self.events_per_step else 1
        batches = []
        for out in outputs:
            request = self.requests.get(out.request_id)
            if request is None:  # aborted while its step was in flight
                continue
            first = request.last_token is None
            self.metrics.observe_output(out, now - (request.last_token or request.arrival), first)
            request.last_token = now
            request.pending.append(self._final(out, request) if out.finish_reason else out)
            if out.finish_reason is not None:
                del self.requests[out.request_id]
                self.metrics.observe_finish(out.finish_reason, now - request.arrival)
            elif not first and (self.num_steps + out.request_id) % every:
                continue  # not its turn: sent with a later step's
            batches.append((request.outputs, request.pending))
            request.pending = []
        self.metrics.observe_step(len(outputs), self.engine)
        if batches:  # one wake-up of the event loop per step, however many requests advanced
            self._call(_put_all, batches)

    def _call(self, fn: Callable[..., object], *args: object) -> None:
        """Run fn(*args) on the event loop; asyncio objects may only be touched from there."""
        self.event_loop.call_soon_threadsafe(fn, *args)


def _settle(future: asyncio.Future, result: object) -> None:
    """Resolve a handler's future with a result or an exception, unless its client left."""
    if future.cancelled():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _put_all(batches: list[tuple[asyncio.Queue, list]]) -> None:
    for outputs, batch in batches:
        outputs.put_nowait(batch)


class RequestStream:
    """A handler's view of its request: `async for delta in stream` until it finishes."""

    def __init__(self, loop: EngineLoop, request: Request, num_prompt_tokens: int) -> None:
        self.loop, self.request, self.num_prompt_tokens = loop, request, num_prompt_tokens
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[Delta]:
        outputs = self.request.outputs
        try:
            while not self.finished:
                delta = Delta(num_prompt_tokens=self.num_prompt_tokens)
                batch = await outputs.get()
                # a reader that fell behind takes everything waiting as one delta (one event)
                while batch is not None:
                    for out in batch:
                        delta.add(out)
                    if delta.finish_reason is not None or outputs.empty():
                        break
                    batch = outputs.get_nowait()
                if batch is None:  # aborted by the server (shutdown, or a failed step)
                    delta.finish_reason = "abort"
                self.finished = delta.finish_reason is not None
                yield delta
        finally:
            if not self.finished:  # the handler left early: its client went away
                self.loop.abort(self.request)
