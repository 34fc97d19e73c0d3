"""`python -m nanoserve.server`: the server's entry point.

`--help` lists the flags; cli.py parses them, loads the engine and runs uvicorn.
"""
from nanoserve.server.cli import main

main()
