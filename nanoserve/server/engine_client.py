"""EngineClient: the API server's side of its engine-core processes, one per data-parallel replica.

One ZMQ ROUTER socket, bound here, talks to every replica (engine_core.py) in typed messages, and
admits only replicas that present their CURVE keys (wire.py). A request goes to the
live replica with the least load under an id unique across replicas; one task receives every
replica's messages: it settles the handlers' futures (taken, or refused with the engine's error),
detokenizes the new tokens, matches stop strings (a hit aborts the request in its replica) and
fills each request's queue, which RequestStream reads. A replica whose process ends (or, headless,
that is silent SILENCE_S) is down: its requests fail at once, new ones go elsewhere or get a 503.
"""
import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from multiprocessing.process import BaseProcess

import msgspec
import zmq
import zmq.asyncio
from transformers import PreTrainedTokenizerBase

from nanoserve.config import SamplingParams, extension
from nanoserve.llm_engine import RequestOutput, TextStream
from nanoserve.server import wire
from nanoserve.server.metrics import Metrics
from nanoserve.server.protocol import Delta, OpenAIError

logger = logging.getLogger("nanoserve.server")
SILENCE_S = 10.0  # a replica started on its own that says nothing this long is down
WATCH_S = 0.1  # how often the replicas' processes are checked
STOP_TIMEOUT_S = 30  # how long a replica may take to stop before it is killed
WAITING_WEIGHT = 4  # a waiting request loads a replica this many times a running one


@dataclass(eq=False)
class Request:
    """One request in the API server: its text so far, its queue of outputs for the handler."""
    id: int
    replica: "Replica"
    text: TextStream  # the detokenizer (a StopStringStream with stop strings)
    # RequestOutputs, or an OpenAIError last if its replica went down (or the server stopped);
    # the samples of one client request share it
    outputs: asyncio.Queue
    # the prompt's token count once a replica took it, or its refusal
    added: asyncio.Future = field(default_factory=asyncio.Future)
    arrival: float = field(default_factory=time.perf_counter)
    token_ids: list[int] = field(default_factory=list)  # the output tokens so far
    last_token: float | None = None  # when the last output arrived (TTFT, then ITL)


@dataclass(eq=False)
class Replica:
    rank: int
    # a process, or a Ray actor with a process's verbs (ray_replicas.ActorProcess); None: started
    # on its own (headless)
    process: BaseProcess | None
    up: bool = False
    requests: dict[int, Request] = field(default_factory=dict)  # by request id
    load: dict = field(default_factory=dict)  # its last report: queues and KV blocks
    num_unseen: int = 0  # requests sent that its last report did not count yet
    last_heard: float = 0.0

    def score(self) -> int:
        """The replica's load: (waiting + sent but not yet seen) * 4 + running."""
        waiting = self.load.get("num_waiting", 0) + self.num_unseen
        return waiting * WAITING_WEIGHT + self.load.get("num_running", 0)


class EngineClient:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, address: str,
                 processes: list[BaseProcess | None], metrics: Metrics, keys: wire.Keys) -> None:
        """keys: the API server's and the replicas' (wire.Keys.new())."""
        self.tokenizer, self.address, self.metrics, self.keys = tokenizer, address, metrics, keys
        self.replicas = [Replica(rank, process) for rank, process in enumerate(processes)]
        self.ids = itertools.count()
        self.max_model_len = 0  # from the replicas' ready messages
        self.stopping = False
        self.tasks: list[asyncio.Task] = []

    # ---- lifetime -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind the socket, start the receiving and watching tasks, wait for every replica."""
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a replica that reconnects takes over
        self.authenticator = wire.serve_securely(self.socket, self.keys)
        self.socket.bind(self.address)
        self.tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]
        for process in filter(None, (r.process for r in self.replicas)):
            process.start()
        while not all(r.up for r in self.replicas):
            if dead := [f"{r.rank} exited with code {code}" for r in self.replicas  # one read each
                        if r.process and (code := r.process.exitcode) is not None]:
                raise RuntimeError(f"engine replica {dead[0]} while loading: its error is above")
            await asyncio.sleep(WATCH_S)

    async def stop(self) -> None:
        """Stop every replica (each aborts what it still runs and frees its engine), then the
        tasks and the socket: no process, socket or shared memory is left."""
        self.stopping = True
        for replica in self.replicas:
            self._send(replica, wire.Stop())
            self._down(replica, "stopped", status=503)
        for process in filter(None, (r.process for r in self.replicas)):
            await asyncio.to_thread(process.join, STOP_TIMEOUT_S)
            if process.exitcode is None:
                process.kill()
        for task in self.tasks:
            task.cancel()
        self.authenticator.stop()
        self.socket.close(linger=0)
        self.context.term()

    # ---- requests -------------------------------------------------------------------------------
    async def submit(self, prompt: list[int], samples: list[SamplingParams]) -> "RequestStream":
        """Send a request's samples (one SamplingParams each) to the least-loaded replica, where
        they share the prompt's blocks; raise the engine's ValueError if it refuses the prompt,
        OpenAIError(503) if no replica is up."""
        up = [r for r in self.replicas if r.up]
        if self.stopping or not up:
            raise OpenAIError(503, "no engine replica is up (see GET /health): retry later")
        replica, outputs = min(up, key=Replica.score), asyncio.Queue()
        requests = [self._add(replica, prompt, params, outputs) for params in samples]
        try:
            await asyncio.gather(*(r.added for r in requests))
        except BaseException:  # refused (one prompt: every sample), or the client left first
            for request in requests:
                self.abort(request)
            raise
        return RequestStream(self, requests)

    def _add(self, replica: Replica, prompt: list[int], params: SamplingParams,
             outputs: asyncio.Queue) -> Request:
        text = (extension("stop_strings").StopStringStream(self.tokenizer, params.stop,
                streamed=True) if params.stop else TextStream(self.tokenizer, streamed=True))
        request = Request(next(self.ids), replica, text, outputs)
        replica.requests[request.id] = request
        replica.num_unseen += 1
        self._send(replica, wire.add(request.id, prompt, replace(params, stop=())))
        return request

    def abort(self, request: Request) -> None:
        """End a request whose client left: its replica frees its blocks before its next step."""
        if request.replica.requests.pop(request.id, None) is not None:
            self._send(request.replica, wire.Abort(request.id))
            self.metrics.num_aborted.inc()

    def _send(self, replica: Replica, command: wire.Add | wire.Abort | wire.Stop) -> None:
        if replica.up:  # a down replica's messages would wait for it in the socket
            self.socket.send_multipart([str(replica.rank).encode(), wire.encode(command)])

    # ---- what the replicas send -----------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            try:
                await self._receive_one()
            except Exception:  # a bug here must not stop every request's outputs
                logger.exception("a replica's message could not be handled")

    async def _receive_one(self) -> None:
        rank, data = await self.socket.recv_multipart()
        try:  # decoded into the wire's types only: anything else is dropped, never run
            replica, message = self.replicas[int(rank)], wire.decode_reply(data)
        except (ValueError, IndexError, msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.error(f"dropped a message from {rank!r} that is no replica's ({e})")
            return
        replica.last_heard = time.monotonic()
        if isinstance(message, wire.Ready):
            self.max_model_len = message.max_model_len
            replica.up = not self.stopping
            logger.info(f"engine replica {replica.rank} is up")
            return
        replica.load = message.load
        replica.num_unseen -= len(message.added)
        for request_id, result in message.added:  # taken (its prompt's token count) or refused
            request = replica.requests.get(request_id)
            if request is None or request.added.done():  # its client left meanwhile
                continue
            if isinstance(result, str):
                del replica.requests[request_id]
                request.added.set_exception(ValueError(result))
            else:
                request.added.set_result(result)
        self._deliver(replica, message.outputs)
        self.metrics.observe_load(self.replicas)

    def _deliver(self, replica: Replica, outputs: list[RequestOutput]) -> None:
        """Text for each output, its stop strings matched, into its request's queue."""
        now = time.perf_counter()
        for out in outputs:
            request = replica.requests.get(out.request_id)
            if request is None:  # aborted, or stopped by a stop string, meanwhile
                continue
            request.token_ids += out.token_ids
            request.text.update(request.token_ids, out.finish_reason is not None)
            if getattr(request.text, "stopped", False):  # a stop string: the end, whatever came
                if out.finish_reason is None:
                    self._send(replica, wire.Abort(request.id))
                out.finish_reason = "stop"
            out.text = request.text.delta(out.finish_reason is not None)
            self.metrics.observe_output(out, now, request.arrival, request.last_token)
            request.last_token = now
            if out.finish_reason is not None:
                del replica.requests[out.request_id]
            request.outputs.put_nowait(out)
        if outputs:
            self.metrics.step_size.observe(len(outputs))

    # ---- faults ---------------------------------------------------------------------------------
    async def _watch(self) -> None:
        """A replica is down once its process has ended, or (headless) it has been silent."""
        while True:
            await asyncio.sleep(WATCH_S)
            for r in self.replicas:
                if r.up and r.process is not None and (code := r.process.exitcode) is not None:
                    self._down(r, f"exited with code {code}")
                elif r.up and r.process is None and time.monotonic() - r.last_heard > SILENCE_S:
                    self._down(r, f"was silent for {SILENCE_S:.0f} s")

    def _down(self, replica: Replica, why: str, status: int = 500) -> None:
        """Mark a replica down and end its requests with an error body at once."""
        if replica.up and not self.stopping:
            logger.error(f"engine replica {replica.rank} {why}: its requests fail")
        replica.up, replica.load, replica.num_unseen = False, {}, 0
        error = OpenAIError(status, f"engine replica {replica.rank} {why} while serving this "
                                    "request: retry it")
        for request in replica.requests.values():
            if not request.added.done():
                request.added.set_exception(error)
            request.outputs.put_nowait(error)
        replica.requests.clear()
        self.metrics.observe_load(self.replicas)


class RequestStream:
    """A handler's view of its request's samples: `async for i, delta in stream`, sample i's new
    output, until every sample has finished."""

    def __init__(self, client: EngineClient, requests: list[Request]) -> None:
        self.client, self.requests = client, requests
        self.unfinished = {r.id: i for i, r in enumerate(requests)}  # request id -> sample index

    async def __aiter__(self) -> AsyncIterator[tuple[int, Delta]]:
        outputs = self.requests[0].outputs  # the samples' one queue
        try:
            while self.unfinished:
                # a reader that fell behind takes everything waiting: one delta (event) a sample
                waiting, deltas = [await outputs.get()], {}  # deltas by request id
                waiting += [outputs.get_nowait() for _ in range(outputs.qsize())]
                for out in waiting:
                    if isinstance(out, OpenAIError):  # the replica went down (and forgot them)
                        raise out
                    deltas.setdefault(out.request_id, Delta()).add(out)  # counts: the last's
                for request_id, delta in deltas.items():
                    index = self.unfinished[request_id]
                    if delta.finish_reason is not None:
                        del self.unfinished[request_id]
                    yield index, delta
        finally:  # the handler left early: its client went away
            for request in self.requests:
                if request.id in self.unfinished:
                    self.client.abort(request)
