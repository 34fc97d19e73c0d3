"""The wire between the API server and its engine replicas: typed messages, and the keys that
admit a replica.

The API server sends Add, Abort and Stop; a replica sends Ready once, then a Step after every
engine step. Each is a msgspec Struct sent as MessagePack and decoded into these types only: bytes
of any other shape (a pickle, say) do not decode, and the receiver logs and drops them, so nothing
received is ever run. The socket speaks ZMQ CURVE: the API server holds a server key pair and admits
only connections that present the replicas' key pair (zmq.auth), which the replicas it starts get
as arguments and a `--headless` one reads from the keys file that `--data-parallel-keys` names.
"""
import os
from dataclasses import dataclass, replace
from types import SimpleNamespace

import msgspec
import zmq
import zmq.auth.asyncio

from nanoserve.config import SamplingParams
from nanoserve.llm_engine import RequestOutput


@dataclass
class FinalOutput(RequestOutput):
    """A request's output as sent: with speculation's counts for it on its last (None: none)."""
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None


class Add(msgspec.Struct, tag=True):
    request_id: int
    token_ids: list[int]
    params: SamplingParams  # without its guided_decoding, which is sent as
    guided: dict | None = None  # GuidedDecodingParams' fields


def add(request_id: int, token_ids: list[int], params: SamplingParams) -> Add:
    """The Add message of a request."""
    guided = msgspec.to_builtins(params.guided_decoding) if params.guided_decoding else None
    return Add(request_id, token_ids, replace(params, guided_decoding=None), guided)


class Abort(msgspec.Struct, tag=True):
    request_id: int


class Stop(msgspec.Struct, tag=True):
    """The replica aborts what it runs, frees its engine and exits."""


class Ready(msgspec.Struct, tag=True):
    max_model_len: int


class Step(msgspec.Struct, tag=True):
    added: list[tuple[int, int | str]]  # (request id, its prompt's token count, or the refusal)
    outputs: list[FinalOutput]
    load: dict[str, int]  # the replica's queues and KV blocks (scheduler_stats)


encode = msgspec.msgpack.Encoder().encode
decode_command = msgspec.msgpack.Decoder(Add | Abort | Stop).decode
decode_reply = msgspec.msgpack.Decoder(Ready | Step).decode


class Keys(msgspec.Struct):
    """CURVE key pairs (Z85 text): the API server's, and the one every replica presents. A
    replica's copy has no server secret."""
    server_public: str
    replica_public: str
    replica_secret: str
    server_secret: str = ""

    @classmethod
    def new(cls) -> "Keys":
        (server_public, server_secret), replica = zmq.curve_keypair(), zmq.curve_keypair()
        return cls(server_public.decode(), *(k.decode() for k in replica), server_secret.decode())

    @classmethod
    def from_file(cls, path: str | None) -> "Keys":
        """The replicas' keys in path (an API server wrote it); else SystemExit naming the fix."""
        try:
            with open(path or "", "rb") as f:
                return msgspec.json.decode(f.read(), type=cls)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            raise SystemExit(f"--data-parallel-keys {path}: {e}. A --headless replica needs the "
                             "file its API server's --data-parallel-keys FILE wrote") from None

    def for_replicas(self) -> "Keys":
        """What a replica gets: all but the server's secret."""
        return msgspec.structs.replace(self, server_secret="")

    def save(self, path: str) -> None:
        """The replicas' part into path, readable by this user only (written whole, then moved
        there: a replica waiting for the file never reads half of it)."""
        with os.fdopen(os.open(f"{path}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
                       "wb") as f:
            f.write(msgspec.json.encode(self.for_replicas()))
        os.replace(f"{path}.tmp", path)


def serve_securely(socket: zmq.Socket, keys: Keys) -> zmq.auth.asyncio.AsyncioAuthenticator:
    """Make socket (the API server's, before it binds) a CURVE server that admits only the
    replicas' key; returns the authenticator, to stop with the socket."""
    authenticator = zmq.auth.asyncio.AsyncioAuthenticator(socket.context)
    authenticator.start()
    authenticator.configure_curve_callback("*", credentials_provider=SimpleNamespace(
        callback=lambda domain, key: key == keys.replica_public.encode()))  # the one admitted
    socket.curve_secretkey, socket.curve_publickey = (keys.server_secret.encode(),
                                                      keys.server_public.encode())
    socket.curve_server = True
    return authenticator


def connect_securely(socket: zmq.Socket, keys: Keys, address: str) -> None:
    """Connect a replica's socket to the API server at address, presenting the replicas' keys."""
    socket.curve_secretkey, socket.curve_publickey = (keys.replica_secret.encode(),
                                                      keys.replica_public.encode())
    socket.curve_serverkey = keys.server_public.encode()
    socket.connect(address)
