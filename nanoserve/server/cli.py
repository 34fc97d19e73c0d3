"""`python -m nanoserve.server`: parse the flags, load the engine, serve it with uvicorn.

Every Config field (except `model`) is a flag, generated from the dataclass, so a new engine
setting is a server flag at once; a flag left out keeps Config's default. The engine loads before
the port opens, so a client can poll GET /health. SIGTERM or SIGINT: uvicorn stops accepting,
lets in-flight requests finish (up to --shutdown-timeout, then aborts them), the lifespan stops
the engine, and the process exits 0.
"""
import argparse
import ast
import inspect
import io
import json
import logging
import os
import signal
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields

import uvicorn

from nanoserve.config import DTYPES, Config
from nanoserve.llm_engine import LLMEngine
from nanoserve.server.app import build_app
from nanoserve.server.engine_loop import EVENTS_PER_STEP

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
SHUTDOWN_TIMEOUT_S = 30  # how long in-flight requests may run on after SIGTERM
# A thread waiting for the GIL takes it from a busy one only after this interval (Python's
# default: 5 ms). The engine thread waits for it after every step's GPU sync, so while the event
# loop is busy streaming, the default would add up to 5 ms to a step of a few milliseconds.
GIL_SWITCH_INTERVAL_S = 0.0005


# ---- engine settings as flags -------------------------------------------------------------------
# Values a flag accepts beyond what its type says, checked before the model loads.
CHOICES = {"dtype": ("auto", *DTYPES)}


def field_comments(cls: type) -> dict[str, str]:
    """The comment of each field of a dataclass, read with ast and tokenize: the one trailing
    the field's line (`name: type = default  # comment`), else the comment lines just above it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a frozen app): the flags go without help
        return {}
    lines = source.splitlines()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    # comment lines of their own, not the trailing comment of the field above
    alone = {n: text for n, text in comments.items() if lines[n - 1].lstrip().startswith("#")}
    found = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above = []
            while node.lineno - len(above) - 1 in alone:
                above.insert(0, alone[node.lineno - len(above) - 1])
            text = comments.get(node.end_lineno) or " ".join(above)
            if text:
                found[node.target.id] = text
    return found


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
    hints, comments, names = typing.get_type_hints(cls), field_comments(cls), []
    for f in fields(cls):
        if f.name in skip or not f.init:
            continue
        default = (f.default if f.default is not MISSING else
                   f.default_factory() if f.default_factory is not MISSING else None)
        text = f.metadata.get("help") or comments.get(f.name) or f.name.replace("_", " ")
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
    names = add_config_flags(config, Config, skip=("model",))  # --model is the server's own
    args = parser.parse_args(argv)
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
