"""Statistics: a read-only view of queues and KV blocks (trace, timeline, server metrics).

The scheduler's queues and the KV blocks as the trace, the timeline and the server's metrics
read them.

The core keeps the counts as it works (Scheduler.num_preemptions; BlockManager.num_allocated,
num_freed, num_hits); `scheduler_stats(scheduler)` reads them with the queue lengths and the free
blocks into one SchedulerStats, without changing anything. Where it plugs in: nowhere of its
own; the extensions that observe a step's outputs, and the server, call it.
"""
from typing import NamedTuple

from nanoserve.scheduler import Scheduler


class SchedulerStats(NamedTuple):
    """The queues and the KV blocks now; the counts (num_preemptions and after) run since
    start-up."""
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    num_allocated: int  # blocks handed out fresh
    num_freed: int  # blocks back in the pool
    num_hits: int  # blocks served by the prefix cache


def scheduler_stats(scheduler: Scheduler) -> SchedulerStats:
    bm = scheduler.block_manager
    return SchedulerStats(len(scheduler.waiting), len(scheduler.running), bm.num_free_blocks,
                          len(bm.blocks), scheduler.num_preemptions, bm.num_allocated,
                          bm.num_freed, bm.num_hits)
