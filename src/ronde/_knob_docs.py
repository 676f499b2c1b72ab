"""The tables of docs/configuration.md, generated from :data:`ronde._knobs.KNOBS`.

``python -m ronde._knob_docs --write docs/configuration.md`` regenerates every
``<!-- NAME:start -->...<!-- NAME:end -->`` block of the file; a test keeps them fresh.
"""

from __future__ import annotations

import re
import sys

from ._knobs import KNOBS


def env_table() -> str:
    """The markdown table of every variable (docs/configuration.md)."""
    rows = ["| variable | Horovod fallback | default | unit | accepted | meaning |",
            "|---|---|---|---|---|---|"]
    for k in KNOBS:
        horovod = k.horovod_shown or (", ".join(f"`{v}`" for v in k.horovod) or "-")
        accepted = str(k.accepted) if k.accepted else "-"
        rows.append(f"| `{k.var}` | {horovod} | {k.default} | {k.unit} | {accepted} | {k.doc} |")
    return "\n".join(rows)


def flag_table() -> str:
    """The markdown table of the ``ronderun`` flags that set knobs."""
    rows = ["| flag | sets | note |", "|---|---|---|"]
    rows += [f"| `{k.flag}` | `{k.var}` | {k.flag_note} |" for k in KNOBS if k.flag]
    return "\n".join(rows)


_BLOCKS = {"knobs": env_table, "flags": flag_table}


def render(text: str) -> str:
    """``text`` with every ``<!-- NAME:start -->...<!-- NAME:end -->`` block regenerated."""
    for name, make in _BLOCKS.items():
        pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(\n<!-- {name}:end -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"no <!-- {name}:start/end --> block in the file")
        text = pattern.sub(lambda m: m.group(1) + make() + m.group(2), text)
    return text


if __name__ == "__main__":  # python -m ronde._knob_docs --write docs/configuration.md
    if len(sys.argv) != 3 or sys.argv[1] != "--write":
        sys.exit("usage: python -m ronde._knob_docs --write docs/configuration.md")
    with open(sys.argv[2], encoding="utf-8") as fh:
        old = fh.read()
    with open(sys.argv[2], "w", encoding="utf-8") as fh:
        fh.write(render(old))
