"""Plot ``python -m ronde.bench scale --json-out FILE`` against the cost model of
docs/benchmarks.md ("Scale"): per-op time T(N) = (max(N, C) / C) * (a + b * N) on C
cores, a and b fitted by least squares to ronde's 4-byte latency points.

    python scripts/plot_scale.py scale.json docs/img/scale.png [--cores 2]

Needs matplotlib (not a dependency of ronde: ``pip install matplotlib``)."""

from __future__ import annotations

import argparse
import json

import numpy as np


def fit(ns: list[int], times: list[float], cores: int) -> tuple[float, float]:
    load = np.array([max(n, cores) / cores for n in ns])
    design = np.stack([load, load * np.array(ns)], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, np.array(times), rcond=None)
    return float(a), float(b)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("json_file")
    p.add_argument("png")
    p.add_argument("--cores", type=int, default=2)
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.load(open(args.json_file))["collectives"]
    ns = sorted(int(n) for n in data)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "latency_s", "back-to-back 4-byte allreduce"),
                           (axes[1], "1MiB_s", "1 MiB allreduce")):
        for impl, style in (("ronde-shm", "o-"), ("gloo", "s--")):
            pts = [(n, data[str(n)][impl][key]) for n in ns if key in data[str(n)].get(impl, {})]
            ax.plot([n for n, _ in pts], [t * 1e3 for _, t in pts], style, label=impl)
        if key == "latency_s":
            pts = [(n, data[str(n)]["ronde-shm"][key]) for n in ns]
            a, b = fit([n for n, _ in pts], [t for _, t in pts], args.cores)
            grid = np.arange(2, max(ns) + 1)
            model = [(max(n, args.cores) / args.cores) * (a + b * n) * 1e3 for n in grid]
            ax.plot(grid, model, ":", color="gray",
                    label=f"model (N/C)(a+bN): a={a * 1e6:.0f} us, b={b * 1e6:.1f} us")
            print(f"fit on {args.cores} cores: a = {a * 1e6:.1f} us, b = {b * 1e6:.2f} us")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"ranks N ({args.cores} cores)")
        ax.set_ylabel("time per op (ms)")
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.png, dpi=90)


if __name__ == "__main__":
    main()
