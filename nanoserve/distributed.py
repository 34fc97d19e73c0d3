"""Tensor parallelism's processes: the worker ranks, the shared-memory calls to them, their loop.

Rank 0 runs in the user's process; ranks 1..N-1 are processes started with spawn (`Workers`).
Every step rank 0 pickles the call ("forward", inputs) into one shared-memory segment and wakes
each worker with a semaphore (an Event's set() blocks forever if a waiter was killed); every rank
then runs the same forward pass and meets the others in the collectives (NCCL on GPUs, gloo on
CPUs; each rank's ModelRunner joins the process group at the port Workers picked). Each worker
first releases its semaphore once, which rank 0 waits for before the rendezvous, so a worker that
dies as it starts fails the engine at once. A worker that fails later reports its traceback
through a queue; rank 0 checks every step.
Invariant: after Workers.shutdown() no process, shared-memory segment or semaphore is left.
"""
import contextlib
import gc
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Semaphore
from typing import Any

import torch.distributed as dist

from nanoserve.config import Config

SHM_BYTES = 1 << 24  # shared-memory segment for rank 0's calls: 16 MiB of pickled arguments
DIST_TIMEOUT = timedelta(seconds=120)  # a collective waiting longer for a silent peer raises
WORKER_JOIN_SECONDS = 5  # how long shutdown waits for a worker before killing it
WORKER_ERROR_WAIT_SECONDS = 0.5  # how long a failure waits for the workers' own error reports
PEER_EXIT_WAIT_SECONDS = 5  # after a collective fails, how long to wait for a dying worker


class Workers:
    """Rank 0's handle on ranks 1..N-1: start them, call them, check them, stop them."""

    def __init__(self, config: Config, make_runner: Callable[[Config, int, int], Any]) -> None:
        """make_runner(config, rank, port): what each worker serves calls on (a ModelRunner;
        passed in, so this module never imports the model runner, which imports it)."""
        if dist.is_initialized():
            raise RuntimeError("this process already runs a tensor-parallel engine (one process "
                               "group per process): shut it down first, or use another process")
        ctx = mp.get_context("spawn")
        with socket.socket() as s:  # a TCP port nobody listens on: each engine's own rendezvous
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.shm = SharedMemory(f"nanoserve-{os.urandom(8).hex()}", create=True, size=SHM_BYTES)
        self.errors = ctx.Queue()
        self.wakeups = [ctx.Semaphore(0) for _ in range(1, config.tensor_parallel_size)]
        self.procs: list[mp.Process] = []
        try:
            for rank, wakeup in enumerate(self.wakeups, start=1):
                args = (make_runner, config, rank, self.shm.name, wakeup, self.port, self.errors)
                proc = ctx.Process(target=worker_main, args=args, daemon=True)
                proc.start()
                self.procs.append(proc)
            # each worker releases its semaphore once as it starts (worker_main): one that dies
            # first (spawn runs the main script again) fails here, not at the rendezvous' timeout
            for wakeup in self.wakeups:
                while not wakeup.acquire(timeout=0.1):  # ten looks a second
                    self.check()
        except BaseException:  # a worker that failed to start: those already started stop
            self.shutdown()
            raise

    def call(self, method: str, *args: object) -> None:
        """Have every worker run ModelRunner.<method>(*args), as rank 0 does meanwhile: the call
        goes into shared memory as its length (4 bytes), then its pickle."""
        data = pickle.dumps((method, args))
        assert len(data) + 4 <= SHM_BYTES, "call arguments exceed the shared-memory segment"
        self.shm.buf[:4 + len(data)] = len(data).to_bytes(4, "little") + data
        for wakeup in self.wakeups:
            wakeup.release()

    def check(self, wait_seconds: float = 0.0) -> None:
        """Raise a RuntimeError with the workers' errors if any worker died. wait_seconds: after a
        broken collective a peer is dying but may not be reaped yet, so wait for it."""
        exited = mp.connection.wait([p.sentinel for p in self.procs], timeout=wait_seconds)
        for p in [p for p in self.procs if p.sentinel in exited]:
            p.join(WORKER_JOIN_SECONDS)  # the sentinel closes just before the exit
        if not (lines := [f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                          for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]):
            return  # every worker alive
        # what the workers reported before exiting (a SIGKILLed one reports nothing): read
        # until the queue stays empty
        with contextlib.suppress(queue.Empty):
            while True:
                lines.append(self.errors.get(timeout=WORKER_ERROR_WAIT_SECONDS))
        raise RuntimeError("a tensor-parallel worker failed; shut this engine down and start a "
                           "new one.\n" + "\n".join(lines))

    def shutdown(self) -> None:
        """Join (or kill) the workers, then free the segment and the semaphores."""
        for proc in self.procs:
            proc.join(WORKER_JOIN_SECONDS)
            proc.kill()  # a no-op for one that exited (join reaped it)
            proc.join()
            proc.close()  # a Process keeps its arguments, the semaphores among them
        self.errors.close()
        self.errors.join_thread()
        self.shm.close()
        self.shm.unlink()
        # a spawn-context semaphore lives in /dev/shm until its last Python reference goes
        self.procs, self.errors, self.wakeups = [], None, []
        gc.collect()


def worker_main(make_runner: Callable[[Config, int, int], Any], config: Config, rank: int,
                shm_name: str, wakeup: Semaphore, port: int, errors: mp.Queue) -> None:
    """Entry point of ranks 1..N-1: build the same model shard, then serve rank 0's calls."""
    # a daemon process may not start children, and torch.compile's compile pool is one
    import torch._inductor.config
    torch._inductor.config.compile_threads = 1
    try:
        wakeup.release()  # "started": rank 0 takes it before the rendezvous this worker waits in
        runner, shm = make_runner(config, rank, port), SharedMemory(shm_name)
        while True:
            wakeup.acquire()
            method, args = pickle.loads(shm.buf[4:4 + int.from_bytes(shm.buf[:4], "little")])
            if method == "exit":
                break
            getattr(runner, method)(*args)
        shm.close()
        runner.shutdown()
    except BaseException:  # report any failure to rank 0 instead of dying silently
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        errors.close()
        errors.join_thread()  # the report is in the pipe now
        os._exit(1)  # skip atexit hooks (the compile pool can block there): rank 0 sees us die
