"""Allreduce across simulated hosts: is the tcp ring at the link's limit?

``python -m ronde.bench.multihost [--hosts 2,3,4] [--slots 1] [--rate 1gbit] [--mib 16]``
builds network namespaces joined by a bridge, each host's egress rate-limited with
``tc`` (see :mod:`ronde.testing.netns`; needs root), runs an in-place allreduce of
``--mib`` MiB float32 through ``ronderun -H``, and compares the median time with
the bandwidth bound of the algorithm:

* flat ring (one rank per host): every host sends 2(n-1)/n * size, so the bound is
  2(n-1)/n * size / link rate;
* hierarchical (``--slots`` > 1): every host's link carries 2(H-1)/H * size in all
  (split over its ranks), so the bound is 2(H-1)/H * size / link rate.

Prints one JSON line per point and a table. Everything it creates is removed on exit.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from typing import Any

from ..testing import netns

_WORKER = r"""
import json, time
import numpy as np
import ronde
ronde.init()
x = np.ones({count}, np.float32)
for _ in range(2):
    ronde.allreduce_async(x, name="w", op=ronde.Sum, out=x).wait()
times = []
for _ in range({repeats}):
    ronde.barrier()
    t = time.perf_counter()
    ronde.allreduce_async(x, name="w", op=ronde.Sum, out=x).wait()
    times.append(time.perf_counter() - t)
worst = ronde.allreduce(np.array(times), op=ronde.Max, name="times")
one = np.ones(1, np.float32)
for _ in range(20):
    ronde.allreduce(one, name="lat")
ronde.barrier()
t = time.perf_counter()
for _ in range({lat_ops}):
    ronde.allreduce(one, name="lat")
lat = ronde.allreduce(np.array([(time.perf_counter() - t) / {lat_ops}]), op=ronde.Max,
                      name="lat_s")
if ronde.rank() == 0:
    print("RESULT", json.dumps({{"transport": ronde.active_transport(),
                                "median_s": float(np.median(worst)),
                                "latency_s": float(lat[0])}}), flush=True)
"""


def _rate_bits(rate: str) -> float:
    m = re.fullmatch(r"([0-9.]+)\s*([kmg]?)bit", rate.lower())
    if not m:
        raise SystemExit(f"--rate {rate!r}: write e.g. 1gbit or 500mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def run_point(hosts: int, slots: int, rate: str, mib: int, repeats: int,
              delay: str | None = None, lat_ops: int = 200) -> dict[str, Any]:
    count = mib * (1 << 20) // 4
    code = _WORKER.format(count=count, repeats=repeats, lat_ops=lat_ops)
    with netns.SimulatedHosts(hosts, rate=rate, delay=delay) as sim:
        proc = subprocess.run([sys.executable, "-m", "ronde.run", "-H", sim.spec(slots),
                               sys.executable, "-c", code], capture_output=True, text=True,
                              env=sim.env(), timeout=600)
        delayed = sim.delay_applied
    if proc.returncode != 0:
        raise SystemExit(f"job failed:\n{proc.stderr[-3000:]}")
    line = next(l for l in proc.stdout.splitlines() if "RESULT " in l)
    result = json.loads(line.split("RESULT ", 1)[1])
    nbytes = count * 4
    bound = 2 * (hosts - 1) / hosts * nbytes / (_rate_bits(rate) / 8)
    return {"case": "multihost_allreduce", "hosts": hosts, "slots": slots, "np": hosts * slots,
            "rate": rate, "bytes": nbytes, "transport": result["transport"],
            "median_s": result["median_s"], "bound_s": bound,
            "ratio_to_bound": result["median_s"] / bound,
            "latency_s": result["latency_s"], "delay": delay if delayed else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ronde.bench.multihost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="2,3,4")
    parser.add_argument("--slots", default="1,2", help="ranks per host (comma list)")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--delay", default=None, help="one-way delay per host's egress "
                        "(tc netem, e.g. 0.1ms; left out where the kernel lacks netem)")
    args = parser.parse_args(argv)
    if not netns.available():
        print("needs root, ip and tc (iproute2)", file=sys.stderr)
        return 2
    rows = []
    for slots in [int(s) for s in args.slots.split(",")]:
        for hosts in [int(h) for h in args.hosts.split(",")]:
            point = run_point(hosts, slots, args.rate, args.mib, args.repeats, args.delay)
            print(json.dumps(point), flush=True)
            rows.append(point)
    delay = next((p["delay"] for p in rows if p["delay"]), None)
    print(f"\nallreduce of {args.mib} MiB float32 across simulated hosts, egress {args.rate} "
          f"per host{f', delay {delay}' if delay else ''}; bound = 2(H-1)/H * size / rate;"
          " latency = back-to-back 4-byte allreduces\n")
    print("| hosts x ranks | transport | median | bound | time / bound | 4 B latency |")
    print("|---|---|---|---|---|---|")
    for p in rows:
        print(f"| {p['hosts']} x {p['slots']} | {p['transport']} | {p['median_s'] * 1e3:.1f} ms "
              f"| {p['bound_s'] * 1e3:.1f} ms | {p['ratio_to_bound']:.3f} | "
              f"{p['latency_s'] * 1e6:.0f} us |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
