"""nanoserve.server: an OpenAI-compatible HTTP server on top of the engine (FastAPI + uvicorn).

Read in this order: cli.py (flags, start-up, shutdown), app.py (routes, streaming), engine_loop.py
(the one thread that calls the engine, and the queues to and from the handlers), protocol.py (the
OpenAI JSON shapes), metrics.py (GET /metrics). `python -m nanoserve.server --help` lists the flags;
docs/serving.md is the chapter.
"""
from nanoserve.server.app import build_app

__all__ = ["build_app"]
