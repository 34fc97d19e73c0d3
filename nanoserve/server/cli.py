"""`python -m nanoserve.server`: parse the flags, start the engine replicas, serve with uvicorn.

Every Config field (except `model`) is a flag, generated from the dataclass, so a new engine
setting is a server flag at once; a flag left out keeps Config's default. The API server starts
--data-parallel-size engine-core processes (engine_core.py), each on GPUs of its own, or fewer
(--data-parallel-size-local) and waits for the others to connect: `--headless` runs one replica
alone, on this machine or another, connecting to the API server's --data-parallel-address and
--data-parallel-rpc-port. The engine's checks run on the parsed flags (a Config built on the
CPU), so a bad value stops there; the HTTP port is bound next (a busy one stops there too) and
listens once every replica has loaded, so a client can poll GET /health. SIGTERM or SIGINT:
uvicorn stops accepting, lets in-flight requests finish (up to --shutdown-timeout, then ends
them), the lifespan stops the replicas, and the process exits 0.
"""
import argparse
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from multiprocessing.process import BaseProcess

import torch
import uvicorn
from simple_parsing.docstring import get_attribute_docstring
from transformers import AutoTokenizer

from nanoserve.config import DTYPES, Config
from nanoserve.server import engine_core, wire
from nanoserve.server.app import build_app
from nanoserve.server.engine_client import EngineClient
from nanoserve.server.metrics import Metrics
from nanoserve.weights import default_model_dir

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
SHUTDOWN_TIMEOUT_S = 30  # how long in-flight requests may run on after SIGTERM


# ---- engine settings as flags -------------------------------------------------------------------
# Values a flag accepts beyond what its type says, checked before the model loads. (The device is
# listed here: the pre-start Config check runs on the CPU, whatever --device says.)
CHOICES = {"dtype": ("auto", *DTYPES), "device": ("auto", "cuda", "cpu")}


def parse_optional(kind: Callable[[str], object]) -> Callable[[str], object]:
    """`kind`, or None for "none": the value of an `X | None` flag."""
    def parse(text: str) -> object:
        return None if text.lower() == "none" else kind(text)
    parse.__name__ = getattr(kind, "__name__", "value")  # argparse names the type in errors
    return parse


def flag_kwargs(hint: object) -> dict:
    """argparse's type, nargs, choices or action for a field's type hint: bool, int, float, str,
    a Literal, `X | None`, list[X] or tuple[X, ...]; anything else is parsed as JSON."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if hint in (int, float, str):
        return {"type": hint}
    if origin is typing.Literal:
        return {"type": type(args[0]), "choices": args}
    if origin in (list, tuple) and args:
        return {"type": args[0], "nargs": "*"}
    if origin in (typing.Union, types.UnionType) and len(args) == 1:  # X | None
        inner = flag_kwargs(args[0])
        if "type" in inner and "nargs" not in inner:
            return {**inner, "type": parse_optional(inner["type"])}
        return inner
    return {"type": json.loads}


def add_config_flags(parser: argparse._ActionsContainer, cls: type,
                     skip: tuple[str, ...] = ()) -> list[str]:
    """One --flag per field of the dataclass cls (dashes for underscores), its help the field's
    metadata["help"], else its comment, else its name; the names of the fields added. A flag left
    out stays out of the namespace (SUPPRESS), so the dataclass's own default applies."""
    hints, names = typing.get_type_hints(cls), []
    for f in fields(cls):
        if f.name in skip or not f.init:
            continue
        default = (f.default if f.default is not MISSING else
                   f.default_factory() if f.default_factory is not MISSING else None)
        # its help: metadata["help"], else its comment as simple_parsing reads it from the
        # source, the one trailing the field's line or else the lines just above it
        doc = get_attribute_docstring(cls, f.name)
        text = (f.metadata.get("help") or doc.comment_inline or doc.comment_above
                or f.name.replace("_", " "))
        kwargs = flag_kwargs(hints[f.name])
        if choices := f.metadata.get("choices", CHOICES.get(f.name)):
            kwargs["choices"] = choices
        if "choices" in kwargs:  # listed in the help too: argparse wraps its own list badly
            text += f"; one of {', '.join(map(str, kwargs['choices']))}"
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                            default=argparse.SUPPRESS, help=f"{text} (default: {default})",
                            **kwargs)
        names.append(f.name)
    return names


@dataclass
class ServerArgs:
    """The server's own flags (the engine's are Config's)."""
    model: str | None = None  # Hugging Face model directory (None: the packaged SmolLM2)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    # the name clients pass as `model` (None: the model directory's name, SmolLM2-135M-Instruct)
    served_model_name: str | None = None
    api_key: str | None = None  # require 'Authorization: Bearer KEY' on /v1 routes
    shutdown_timeout: float = SHUTDOWN_TIMEOUT_S  # seconds in-flight requests get after SIGTERM
    log_level: typing.Literal["error", "warning", "info", "debug"] = "info"
    # engine replicas, each on GPUs of its own (--tensor-parallel-size each); a request goes to
    # the least loaded
    data_parallel_size: int = 1
    # mp: the replicas in processes of this machine; ray: as actors of a Ray cluster, on any node
    data_parallel_backend: typing.Literal["mp", "ray"] = "mp"
    # replicas this server starts (None: all); the others run --headless and connect to it
    data_parallel_size_local: int | None = None
    data_parallel_address: str = "127.0.0.1"  # where the replicas reach the API server
    # the port they connect to (None: a free one; set it for --headless replicas)
    data_parallel_rpc_port: int | None = None
    # run one engine replica, no HTTP: it connects to the API server at
    # --data-parallel-address:--data-parallel-rpc-port
    headless: bool = False
    data_parallel_rank: int = 0  # with --headless: which replica this is, 0 .. size - 1
    # the replicas' keys: the API server writes this file, a --headless replica reads it
    data_parallel_keys: str | None = None


def parse_args(argv: list[str] | None = None) -> tuple[ServerArgs, dict]:
    """The server's own flags, and the Config settings given on the command line."""
    parser = argparse.ArgumentParser(prog="python -m nanoserve.server",
                                     description="An OpenAI-compatible server for nanoserve.")
    own = add_config_flags(parser, ServerArgs)
    config = parser.add_argument_group("engine settings (nanoserve.config.Config)")
    names = add_config_flags(config, Config, skip=("model",))  # --model is the server's own
    args = vars(parser.parse_args(argv))
    settings = {k: v for k, v in args.items() if k in names}
    try:  # the engine's own checks, on the CPU (no GPU touched), before any replica starts
        Config(args.get("model") or default_model_dir(), **{**settings, "device": "cpu"})
    except ValueError as e:
        parser.error(str(e))
    return ServerArgs(**{k: v for k, v in args.items() if k in own}), settings


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def replica_processes(args: ServerArgs, model: str, settings: dict, address: str,
                      keys: wire.Keys) -> list[BaseProcess | None]:
    """The replicas' processes, not started: the first --data-parallel-size-local run here, each
    on GPUs of its own (on the CPU: on a share of the cores); None for those started elsewhere."""
    size = args.data_parallel_size
    local = size if args.data_parallel_size_local is None else args.data_parallel_size_local
    if args.data_parallel_backend == "ray":  # an optional extra: imported when asked for
        from nanoserve.server import ray_replicas
        return ray_replicas.actor_processes(size, local, model, settings, address, keys)
    tp = settings.get("tensor_parallel_size", 1)
    gpus = [] if settings.get("device") == "cpu" or not torch.cuda.is_available() else (
        os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count()))))
        .split(","))
    if gpus and local * tp > len(gpus):
        raise SystemExit(f"{local} replicas of {tp} GPUs need {local * tp} GPUs, {len(gpus)} are "
                         "visible: lower --data-parallel-size(-local) or --tensor-parallel-size")
    threads = None if gpus else max(1, torch.get_num_threads() // max(local, 1))
    spawn = mp.get_context("spawn")  # a fresh interpreter: CUDA is set up in the child
    return [spawn.Process(target=engine_core.run, name=f"nanoserve-replica-{rank}", args=(
        address, rank, model, settings, keys.for_replicas(),
        ",".join(gpus[rank * tp:(rank + 1) * tp]) or None,
        threads)) if rank < local else None for rank in range(size)]


def main(argv: list[str] | None = None) -> None:
    args, settings = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    address = f"tcp://{args.data_parallel_address}:{args.data_parallel_rpc_port or free_port()}"
    if args.headless:
        keys = wire.Keys.from_file(args.data_parallel_keys)  # else SystemExit naming the fix
        engine_core.run(address, args.data_parallel_rank, args.model, settings, keys,
                        headless=True)
        return
    keys = wire.Keys.new()  # this server's; the replicas' part goes to the file, if asked
    if args.data_parallel_keys is not None:
        keys.save(args.data_parallel_keys)
    # the HTTP port, bound before any replica loads: a busy one fails now; uvicorn listens on it
    with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own socket
        try:
            sock.bind((args.host, args.port))
        except OSError as e:
            raise SystemExit(f"cannot serve on {args.host}:{args.port} ({e.strerror}): pick "
                             "another --port") from None
        model = args.model or default_model_dir()  # the default model, converted here once
        processes = replica_processes(args, model, settings, address, keys)
        client = EngineClient(AutoTokenizer.from_pretrained(model), address, processes, Metrics(),
                              keys)
        name = args.served_model_name or os.path.basename(os.path.normpath(model))
        app = build_app(client, name, args.api_key)
        # uvicorn raises the signal it caught again once it has shut down: this handler is then
        # in place, so a drained shutdown exits 0, not with a KeyboardInterrupt or -15
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: None)
        logging.getLogger("nanoserve.server").info(
            f"serving {model} as '{name}' at http://{args.host}:{args.port} once replicas are up")
        uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                      timeout_graceful_shutdown=args.shutdown_timeout)).run([sock])
