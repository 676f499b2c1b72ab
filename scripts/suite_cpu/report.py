"""Sum a ``SUITE_CPU_LOG`` (see sitecustomize.py here) by framework, test file and test."""

from __future__ import annotations

import collections
import sys


def main(path: str, top: int = 25) -> None:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) >= 6:
                rows.append((float(parts[1]), parts[3], parts[4], parts[5]))
    print(f"{len(rows)} processes, {sum(r[0] for r in rows):.0f} s of CPU")
    for title, key in (("by first framework imported", lambda r: r[1].split(",")[0] or "none"),
                       ("by test file", lambda r: r[2].split("::")[0] or r[3][:60]),
                       ("by test", lambda r: r[2] or r[3][:60])):
        cpu: collections.Counter[str] = collections.Counter()
        count: collections.Counter[str] = collections.Counter()
        for r in rows:
            cpu[key(r)] += r[0]
            count[key(r)] += 1
        print(f"\n{title}:")
        for k, v in cpu.most_common(top):
            print(f"  {v:7.1f} s  {count[k]:4d} processes  {k}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25)
