"""Malloc benchmark: the CPU of a step's kind of allocations with the coordinator's malloc
settings (kernels/malloc.py) against glibc's defaults; and the volunteer's large buffers in
huge pages (`malloc.empty_bytes`) against `np.empty`, both under the volunteer's setting.

Run:  .venv/bin/python benchmarks/malloc.py [--rounds N]

A process makes, fills and drops arrays of 4 and 16 MiB (panels, tiles, report bodies) on its
main thread and on a worker thread at once, 1.25 GiB each, as a coordinator does in a step of
the larger project; the first arrays of each size find no freed memory either way. Each round
runs it once tuned and once with glibc's defaults, in fresh processes, alternately; the
figures are the medians of the rounds' CPU seconds (user and system, the child's own) and of
its minor page faults.

The volunteer's rows: a process under `return_freed_memory` receives bodies of 2, 4 and 16
MiB (each a fresh buffer, filled as a body read from the network is) and has its kernel
write 4 MiB tiles into fresh buffers (0.6 GiB of bodies, 1 GiB of tiles), its buffers from
`empty_bytes` or from `np.empty`, alternately in fresh processes; then from `empty_bytes`
with freed buffers kept for reuse (`recycle_within`, as the daemon does within its memory
budget) or unmapped when freed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from benchmarks.report import Row, run_alone  # noqa: E402

# What each script (below) prints once its work since `before` is done: `once` appends it.
FIGURES = """
after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({
    "took": took,
    "user": after.ru_utime - before.ru_utime,
    "system": after.ru_stime - before.ru_stime,
    "faults": after.ru_minflt - before.ru_minflt,
}))
"""

ALLOCATIONS = """
import json, resource, sys, threading
import numpy as np
from kernels.malloc import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "tuned" else False
source = np.ones(4 << 20, np.float32)
def churn():
    for _ in range(16):  # 16 x (4 x 16 MiB + 4 x 4 MiB): 1.25 GiB a thread
        arrays = [np.empty(4 << 20, np.float32) for _ in range(4)]
        arrays += [np.empty(1 << 20, np.float32) for _ in range(4)]
        for a in arrays:
            np.copyto(a, source[: a.size])
before = resource.getrusage(resource.RUSAGE_SELF)
worker = threading.Thread(target=churn)
worker.start(); churn(); worker.join()
"""


# {choice}: how the script below takes its buffers in each mode.
HUGE_PAGES = 'fresh = empty_bytes if sys.argv[1] == "tuned" else (lambda n: np.empty(n, np.uint8))'
RECYCLED = 'recycle_within((256 << 20) if sys.argv[1] == "tuned" else 0); fresh = empty_bytes'

VOLUNTEER_BUFFERS = """
import json, resource, sys
import numpy as np
import kernels
from kernels.malloc import empty_bytes, recycle_within, return_freed_memory
took = return_freed_memory()
{choice}
HEADER = 32  # a blob's header before its array (kernels.hashing)
body = np.ones(16 << 20, np.uint8)
a, b = np.ones((1024, 256), np.float32), np.ones((256, 1024), np.float32)
before = resource.getrusage(resource.RUSAGE_SELF)
for _ in range(16):  # bodies of 2, 4 and 16 MiB (0.6 GiB) and 4 MiB tiles (1 GiB)
    for size in (2 << 20, 4 << 20, 16 << 20, 2 << 20, 4 << 20, 4 << 20, 2 << 20, 4 << 20):
        np.copyto(fresh(HEADER + size)[HEADER:], body[:size])
    for _ in range(16):
        tile = fresh(HEADER + (4 << 20))[HEADER:].view(np.float32).reshape(1024, 1024)
        kernels.gemm(a, b, out=tile)
"""


def once(mode: str, script: str = ALLOCATIONS) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    env["PYTHONPATH"] = os.path.dirname(_HERE)
    done = subprocess.run(
        [sys.executable, "-c", script + FIGURES, mode],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    figures = json.loads(done.stdout)
    figures["cpu"] = figures["user"] + figures["system"]
    return figures


def run(rounds: int = 5) -> list[Row]:
    rows = []
    for script, measure in (
        (
            ALLOCATIONS,
            "CPU of making and dropping 2.5 GiB of 4-16 MiB arrays on two threads: "
            "the coordinator's malloc / glibc's defaults",
        ),
        (
            VOLUNTEER_BUFFERS.format(choice=HUGE_PAGES),
            "CPU of a volunteer's fresh bodies and tiles of 2-16 MiB, 1.6 GiB in all, under its "
            "malloc: in huge pages (empty_bytes) / np.empty",
        ),
        (
            VOLUNTEER_BUFFERS.format(choice=RECYCLED),
            "the same bodies and tiles in huge pages: freed ones kept for reuse within 256 MiB "
            "(recycle_within, as the daemon within its budget) / each unmapped when freed",
        ),
    ):
        runs: dict[str, list[dict]] = {"tuned": [], "default": []}
        for _ in range(rounds):
            for mode in ("default", "tuned"):
                runs[mode].append(once(mode, script))
        if not all(r["took"] for r in runs["tuned"]):
            return [Row("malloc", "not glibc's malloc: nothing to tune", "-")]
        cpu, system, faults = (
            {mode: statistics.median(r[key] for r in runs[mode]) for mode in runs}
            for key in ("cpu", "system", "faults")
        )
        rows.append(
            Row(
                "malloc",
                measure,
                f"{cpu['tuned'] / cpu['default']:.2f}x",
                note=f"{cpu['tuned']:.2f} against {cpu['default']:.2f} CPU-s, of it system "
                f"{system['tuned']:.2f} against {system['default']:.2f}; minor page faults "
                f"{faults['tuned']:,.0f} against {faults['default']:,.0f}; medians of "
                f"{rounds} alternating rounds",
            )
        )
    return rows


def main() -> None:
    run_alone(__doc__, run, rounds=5)


if __name__ == "__main__":
    main()
