"""host_probe.py: how steadily this machine's CPU runs Python (a developer tool, no GPU).

The engine's host schedules, prepares and postprocesses every step while the GPU runs the one
before, so a host that stalls leaves the GPU idle (docs/fp8_cache.md, "The host's share of a W1
run"). This probe times one fixed piece of Python work (building a small dict of lists, about the
kind of work a decode step's host does) over and over for a few seconds and prints its median, how
often it took more than twice that, and how much time those slow runs lost. Their thread CPU time
against their wall time tells a CPU that ran slowly (about 1.0) from a thread that was descheduled
or waited (below 1.0). Run it alone on an idle machine.

    python tools/host_probe.py [--seconds 6] [--json out.json]
"""
import argparse
import json
import statistics
import time

WORK_ITEMS = 3000  # dict entries per run of the work: about 0.4-0.8 ms of Python


def work() -> int:
    """The fixed piece of work: allocations, dict inserts, a generator over the values."""
    table = {}
    for i in range(WORK_ITEMS):
        table[i] = [i, i + 1]
    return sum(pair[0] for pair in table.values())


def probe(seconds: float) -> dict:
    """Time work() until `seconds` pass; wall and thread CPU seconds of every run."""
    runs, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        start, cpu = time.perf_counter(), time.thread_time()
        work()
        runs.append((time.perf_counter() - start, time.thread_time() - cpu))
    walls = sorted(wall for wall, _ in runs)
    median = statistics.median(walls)
    slow = [(wall, cpu) for wall, cpu in runs if wall > 2 * median]
    slow_wall = sum(wall for wall, _ in slow)
    return {"runs": len(runs), "median_ms": 1e3 * median, "max_ms": 1e3 * walls[-1],
            "p99_ms": 1e3 * walls[99 * len(walls) // 100], "slow_runs": len(slow),
            "lost_share": (slow_wall - median * len(slow)) / sum(walls),
            "slow_cpu_over_wall": sum(cpu for _, cpu in slow) / slow_wall if slow else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=6.0, help="how long to probe (6)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    r = probe(args.seconds)
    ratio = "-" if r["slow_cpu_over_wall"] is None else f"{r['slow_cpu_over_wall']:.2f}"
    print(f"{r['runs']} runs: median {r['median_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms, max "
          f"{r['max_ms']:.3f} ms; {r['slow_runs']} over twice the median, losing "
          f"{100 * r['lost_share']:.1f}% of the time; their CPU time / wall time {ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
