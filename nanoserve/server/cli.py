"""`python -m nanoserve.server`: parse the flags, load the engine, serve it with uvicorn.

Every Config field (except `model`) is a flag, generated from the dataclass, so a new engine
setting is a server flag at once; a flag left out keeps Config's default. The engine loads before
the port opens, so a client can poll GET /health. SIGTERM or SIGINT: uvicorn stops accepting,
lets in-flight requests finish (up to --shutdown-timeout, then aborts them), the lifespan stops
the engine, and the process exits 0.
"""
import argparse
import inspect
import logging
import os
import re
import signal
import sys
from dataclasses import MISSING, Field, fields

import uvicorn

from nanoserve.config import Config
from nanoserve.llm_engine import LLMEngine
from nanoserve.server.app import build_app
from nanoserve.server.engine_loop import EVENTS_PER_STEP

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
SHUTDOWN_TIMEOUT_S = 30  # how long in-flight requests may run on after SIGTERM
# A thread waiting for the GIL takes it from a busy one only after this interval (Python's
# default: 5 ms). The engine thread waits for it after every step's GPU sync, so while the event
# loop is busy streaming, the default would add up to 5 ms to a step of a few milliseconds.
GIL_SWITCH_INTERVAL_S = 0.0005


def field_comments() -> dict[str, str]:
    """Config's field comments (`name: type = default  # comment`), the flags' help text."""
    pattern = re.compile(r"^\s+(\w+): [^=]+(?:=[^#]*)?#\s*(.*)$")
    lines = inspect.getsource(Config).splitlines()
    return {m[1]: m[2] for m in map(pattern.match, lines) if m}


def add_config_flag(parser: argparse.ArgumentParser, f: Field, help_text: str) -> None:
    flag = "--" + f.name.replace("_", "-")
    default = f"(default: {f.default})" if f.default is not MISSING else ""
    kwargs = {"dest": f.name, "default": argparse.SUPPRESS, "help": f"{help_text} {default}"}
    if f.type is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
    else:  # int, float, str, or `int | None`: the first non-None type parses the value
        kind = next(t for t in getattr(f.type, "__args__", (f.type,)) if t is not type(None))
        parser.add_argument(flag, type=kind, **kwargs)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict]:
    """The server's own flags, and the Config settings given on the command line."""
    parser = argparse.ArgumentParser(prog="python -m nanoserve.server",
                                     description="An OpenAI-compatible server for nanoserve.")
    parser.add_argument("--model", default=None,
                        help="Hugging Face model directory (default: the packaged SmolLM2)")
    parser.add_argument("--host", default=DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as `model` (default: the model directory's "
                             "name, e.g. SmolLM2-135M-Instruct)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 routes")
    parser.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S,
                        help="seconds in-flight requests may finish after SIGTERM")
    parser.add_argument("--events-per-step", type=int, default=EVENTS_PER_STEP,
                        help="server-sent events per engine step, about: more requests share "
                             "them in turns, several tokens an event (0: one per output)")
    parser.add_argument("--log-level", default="info")
    config = parser.add_argument_group("engine settings (nanoserve.config.Config)")
    comments = field_comments()
    for f in fields(Config):
        if f.name != "model":
            add_config_flag(config, f, comments.get(f.name, ""))
    args = parser.parse_args(argv)
    names = {f.name for f in fields(Config)} - {"model"}
    return args, {k: v for k, v in vars(args).items() if k in names}


def exit_quietly(signum: int, frame: object) -> None:
    """uvicorn raises the signal it caught again once it has shut down; this handler is then
    in place, so a drained shutdown ends with exit code 0, not a KeyboardInterrupt or -15."""


def main(argv: list[str] | None = None) -> None:
    args, settings = parse_args(argv)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = LLMEngine(args.model, **settings)
    name = args.served_model_name or os.path.basename(os.path.normpath(engine.config.model))
    app = build_app(engine, name, args.api_key, args.events_per_step)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, exit_quietly)
    logging.getLogger("nanoserve.server").info(f"serving {engine.config.model} as '{name}'")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout)
