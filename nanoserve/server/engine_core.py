"""The engine core: one replica's LLMEngine in a process of its own, driven over ZMQ.

It feeds the API server's commands (`add`, `abort`, `stop`) to the engine through its streaming
API (add_request, stream_step, abort_request) and after every step sends back one message: the
requests it took or refused, each request's new tokens (no text: the API server detokenizes) and
the replica's load. Typed messages (wire.py) on a DEALER socket named by the replica's rank, which
presents the replicas' CURVE keys. A replica the API server started exits when told to stop, when
its parent is gone or when a step fails; a `--headless` one serves until SIGTERM. docs/serving.md
draws the message flow.
"""
import logging
import os
import signal
import sys
from dataclasses import replace

import msgspec
import torch
import zmq

from nanoserve.config import extension
from nanoserve.extensions.stats import scheduler_stats
from nanoserve.llm_engine import LLMEngine, RequestOutput, TextStream
from nanoserve.sequence import Sequence
from nanoserve.server import wire

logger = logging.getLogger("nanoserve.server")
HEARTBEAT_S = 0.5  # an idle replica still reports this often: its sign of life


class TokenStream(TextStream):
    """A streamed request's outputs without text: the API server detokenizes."""

    def update(self, token_ids: list[int], finished: bool) -> None:
        """Nothing to decode here."""


class EngineCore:
    def __init__(self, engine: LLMEngine, socket: zmq.Socket, parent: int | None) -> None:
        self.engine, self.socket, self.parent = engine, socket, parent
        self.seqs: dict[int, Sequence] = {}  # the API server's request id -> its sequence
        self.ids: dict[int, int] = {}  # seq_id -> request id
        self.added: list[tuple[int, int | str]] = []  # (id, prompt tokens, or the refusal) to send

    def serve(self) -> None:
        """Take every command waiting (when idle: wait for one, HEARTBEAT_S at most), step,
        report; until told to stop, or until the parent API server is gone."""
        while self.parent is None or os.getppid() == self.parent:
            timeout_ms = 0 if self.engine.has_unfinished() else HEARTBEAT_S * 1000
            while self.socket.poll(timeout_ms):
                try:
                    command = wire.decode_command(self.socket.recv())
                except (msgspec.DecodeError, msgspec.ValidationError) as e:  # run nothing
                    logger.error(f"dropped a message that is no command ({e})")
                    continue
                if isinstance(command, wire.Stop):
                    return
                if isinstance(command, wire.Add):
                    self.add(command)
                else:
                    self.abort(command.request_id)
                timeout_ms = 0
            outputs = self.step() if self.engine.has_unfinished() else []
            load = scheduler_stats(self.engine.scheduler)._asdict()  # queues and KV blocks
            self.socket.send(wire.encode(wire.Step(self.added, outputs, load)))
            self.added = []

    def add(self, command: wire.Add) -> None:
        request_id = command.request_id
        try:  # guided decoding comes as GuidedDecodingParams' fields
            guided = command.guided and extension("guided").GuidedDecodingParams(**command.guided)
            params = replace(command.params, guided_decoding=guided)
            seq = self.engine.add_request(command.token_ids, params)  # its stream: a TokenStream
        except (ValueError, TypeError) as e:  # bad prompt: back to its request, engine unchanged
            self.added.append((request_id, str(e)))
            return
        self.engine.streams[seq.seq_id] = TokenStream(self.engine.tokenizer, streamed=True)
        self.seqs[request_id], self.ids[seq.seq_id] = seq, request_id
        self.added.append((request_id, seq.num_prompt_tokens))

    def abort(self, request_id: int) -> None:
        if (seq := self.seqs.pop(request_id, None)) is not None:  # else: finished already
            del self.ids[seq.seq_id]
            self.engine.abort_request(seq)

    def step(self) -> list[RequestOutput]:
        """One step's outputs, named by the API server's request ids. A step that raises ends
        the process (`run` frees the engine): the API server fails its requests at once."""
        outputs = self.engine.stream_step()
        for i, out in enumerate(outputs):
            out.request_id = self.ids[out.request_id]
            if out.finish_reason is not None:  # its last: with speculation's counts, if it ran
                seq = self.seqs.pop(out.request_id)
                del self.ids[seq.seq_id]
                outputs[i] = wire.FinalOutput(**vars(out), **self.engine.loop.counts(seq))
        return outputs


def run(address: str, rank: int, model: str | None, settings: dict, keys: wire.Keys,
        devices: str | None = None, num_threads: int | None = None, headless: bool = False) -> None:
    """A replica's process: load the engine on `devices` (CUDA_VISIBLE_DEVICES), connect to the
    API server at `address` with the replicas' keys, say ready, serve until stopped, shut the
    engine down."""
    if devices is not None:  # before anything touches CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    if num_threads:  # replicas sharing the CPU share its cores
        torch.set_num_threads(num_threads)
    # headless, SIGTERM leaves the loop through `finally`, which frees the engine; else the API
    # server drains and stops its replicas itself (Ctrl-C reaches the whole process group)
    for signum in (signal.SIGTERM,) if headless else (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, (lambda *_: sys.exit(0)) if headless else signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s replica {rank}: %(message)s")
    parent = None if headless else os.getppid()
    engine = LLMEngine(model, **settings)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, str(rank).encode())
    wire.connect_securely(socket, keys, address)
    try:
        socket.send(wire.encode(wire.Ready(engine.config.max_model_len)))
        logger.info(f"engine loaded, connected to {address}")
        EngineCore(engine, socket, parent).serve()
    finally:
        engine.shutdown()
        socket.close(linger=0)
        context.term()
