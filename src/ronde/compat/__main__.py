"""``python -m ronde.compat [-m module | script.py] [args...]``: run with the alias on.

Runs the script or module exactly as ``python`` would (``sys.argv`` and ``__main__``
as usual), with ``import horovod...`` answered by ronde (see :mod:`ronde.compat`).

``python -m ronde.compat --table [--write FILE]`` prints docs/compat.md's generated table
of Horovod's API against ronde (:mod:`ronde.compat.table`), or puts it between the
markers in ``FILE``.
"""

from __future__ import annotations

import runpy
import sys

from . import install

USAGE = ("usage: python -m ronde.compat [-m module | script.py] [args...]\n"
         "       python -m ronde.compat --table [--write FILE]")


def table(argv: list[str]) -> int:
    """``--table [--write FILE]``: print the API table, or write it into ``FILE``.

    Args:
        argv: the arguments after ``--table``.

    Returns:
        The exit status (2: bad arguments, or ``FILE`` lacks the markers or can't be read).
    """
    from . import table as api_table  # only here: running a script needs none of it

    if not argv:
        sys.stdout.write(api_table.markdown())
        return 0
    if len(argv) != 2 or argv[0] != "--write":
        print(USAGE, file=sys.stderr)
        return 2
    path = argv[1]
    try:
        with open(path, encoding="utf-8") as f:
            text = api_table.replace(f.read())
    except (OSError, ValueError) as e:
        print(f"python -m ronde.compat --table: {path}: {e}", file=sys.stderr)
        return 2
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


def main(argv: list[str]) -> int:
    """Run ``argv`` (``python -m ronde.compat``'s arguments); return the exit status."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--table":
        return table(argv[1:])
    install()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
