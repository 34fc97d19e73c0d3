"""nanoserve.server: an OpenAI-compatible HTTP server (FastAPI, uvicorn; ZMQ to engines).

Two kinds of process: the API server (HTTP, tokenizer, text) and one engine core per
data-parallel replica, talking over ZMQ. Read in this order: cli.py (flags, start-up, shutdown),
app.py (routes, streaming), engine_client.py (the API server's side: routing, text, faults),
engine_core.py (a replica's process around the engine), protocol.py (the OpenAI JSON shapes),
metrics.py (GET /metrics). `python -m nanoserve.server --help` lists the flags; docs/serving.md is
the chapter.
"""
from nanoserve.server.app import build_app as build_app  # the package's one export
