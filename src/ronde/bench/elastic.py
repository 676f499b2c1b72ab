"""Elastic training's two costs: recovering from a lost worker, and ``commit()``.

    python -m ronde.bench.elastic [--width 1024] [--repeats 3]

* **recovery**: three workers on loopback hosts (127.0.0.1..3, one slot each) train an
  MLP (``--width``); the worker on 127.0.0.3 is SIGKILLed at step 20, every step
  commits. Reported: the time from the kill to the first training step completed at
  the new size (2 ranks), i.e. detecting the loss, restoring, re-forming the job
  (shutdown, rendezvous, new mesh) and syncing the state from rank 0.
* **commit cost**: two workers, 60 steps, committing every step against never; the
  ratio of step times (a commit copies the model's and the optimizer's state dicts and
  checks for host changes: one small broadcast).

Needs torch. Prints one JSON line per measurement, then a table; docs/benchmarks.md
quotes a run.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_elastic_worker.py")


def _run(env: dict[str, str], hosts: str, np: int, min_np: int) -> dict:
    from ..runner.elastic import run_elastic

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        res = run_elastic([sys.executable, WORKER], np, min_np, None, hosts=hosts,
                          env={**env, "BENCH_OUT": out}, start_timeout_s=30.0,
                          elastic_timeout_s=30.0, timeout_s=300.0, stdout=io.StringIO(),
                          stderr=io.StringIO())
        if res.returncode != 0:
            raise SystemExit(f"elastic bench job failed: {res.summary or res.cause}")
        with open(out) as f:
            data = json.load(f)
        killed = out + ".killed"
        if os.path.exists(killed):
            with open(killed) as f:
                data["killed_at"] = float(f.read())
        return data


def recovery(width: int) -> float:
    data = _run({"BENCH_MODE": "recovery", "BENCH_KILL_HOST": "127.0.0.3",
                 "BENCH_KILL_STEP": "20", "BENCH_COMMIT_EVERY": "1", "BENCH_STEPS": "40",
                 "BENCH_WIDTH": str(width)}, "127.0.0.1:1,127.0.0.2:1,127.0.0.3:1", 3, 2)
    after = [t for t, size in data["log"] if size == 2]
    return after[0] - data["killed_at"]


def step_time(width: int, commit_every: int) -> float:
    data = _run({"BENCH_MODE": "commit", "BENCH_COMMIT_EVERY": str(commit_every),
                 "BENCH_STEPS": "60", "BENCH_WIDTH": str(width)},
                "127.0.0.1:2", 2, 2)
    times = [t for t, _ in data["log"]][10:]  # after warm-up
    return (times[-1] - times[0]) / (len(times) - 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    rec, plain, committed = [], [], []
    for _ in range(args.repeats):
        rec.append(recovery(args.width))
        plain.append(step_time(args.width, 0))
        committed.append(step_time(args.width, 1))
        print(json.dumps({"recovery_s": rec[-1], "step_s": plain[-1],
                          "step_commit_every_step_s": committed[-1]}), flush=True)
    params = (args.width * args.width + args.width) + (args.width * 10 + 10)
    print(f"\nelastic, MLP of {params:,} parameters ({params * 4 / 2**20:.1f} MiB), "
          f"median of {args.repeats}\n")
    print("| measurement | value |\n|---|---|")
    print(f"| recovery: SIGKILL of 1 of 3 workers -> training again at 2 | "
          f"{statistics.median(rec):.2f} s (min {min(rec):.2f}, max {max(rec):.2f}) |")
    print(f"| step time, np=2, no commit | {statistics.median(plain) * 1e3:.1f} ms |")
    print(f"| step time, np=2, commit every step | "
          f"{statistics.median(committed) * 1e3:.1f} ms "
          f"({statistics.median(committed) / statistics.median(plain):.2f}x) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
