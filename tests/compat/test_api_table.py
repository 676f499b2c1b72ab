"""docs/compat.md's API table, its notes and its reasons stay in step with the data.

The table is generated (``python -m ronde.compat --table``) from Horovod's names and ronde's
facades; these tests fail when the document is stale, when a Horovod name ronde lacks has no
reason in :data:`ronde.compat.table.MISSING`, or when a note or reason names something the
data contradicts. They import no framework, so they run everywhere.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

from ronde._facade import FACADES
from ronde.compat import table
from ronde.compat.horovod_names import NAMES

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "compat.md"
REGENERATE = "run `python -m ronde.compat --table --write docs/compat.md`"
FRAMEWORKS = ("torch", "tensorflow", "mxnet", "jax", "keras")


def test_document_matches_generated_table() -> None:
    assert table.extract(DOC.read_text(encoding="utf-8")) == table.markdown(), \
        f"docs/compat.md's API table is stale: {REGENERATE}"


def test_every_missing_name_has_a_reason_and_no_reason_is_stale() -> None:
    lacking = {(module, name) for module, names in NAMES.items()
               for name in names if name not in table.ronde_names(module)}
    assert not lacking - set(table.MISSING), \
        f"give these Horovod names a reason in ronde.compat.table.MISSING: " \
        f"{sorted(lacking - set(table.MISSING))}"
    assert not set(table.MISSING) - lacking, \
        f"ronde has these names (or Horovod's module lacks them): drop them from MISSING: " \
        f"{sorted(set(table.MISSING) - lacking)}"


def test_every_note_names_something_both_have() -> None:
    stale = [(module, name) for module, name in table.NOTES
             if name not in table.ronde_names(module) or name not in NAMES.get(module, [])]
    assert not stale, f"NOTES keys that ronde or Horovod does not have: {sorted(stale)}"


def test_rows_cover_every_horovod_name_once() -> None:
    for module, names in NAMES.items():
        got = table.rows(module)
        assert sorted(name for name, _, _ in got) == sorted(names)
        assert {status for _, status, _ in got} <= {"same", "different", "missing"}
        assert table.ronde_module(module) in FACADES


def test_replace_needs_the_markers() -> None:
    text = f"intro\n{table.BEGIN}\nold\n{table.END}\nafter\n"
    assert table.replace(text, "new\n") == f"intro\n{table.BEGIN}\nnew\n{table.END}\nafter\n"
    try:
        table.replace("no markers here\n", "new\n")
    except ValueError:
        pass
    else:
        raise AssertionError("replace() accepted a text without markers")


def test_table_command_prints_the_table() -> None:
    done = subprocess.run([sys.executable, "-m", "ronde.compat", "--table"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == table.markdown()


def test_write_errors_out_without_markers(tmp_path: pathlib.Path) -> None:
    doc = tmp_path / "compat.md"
    doc.write_text("# no markers\n", encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "ronde.compat", "--table", "--write",
                           str(doc)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "markers" in done.stderr
    assert doc.read_text(encoding="utf-8") == "# no markers\n"


def test_table_imports_no_framework() -> None:
    code = ("import sys, ronde.compat.table as t; t.markdown(); "
            f"print([m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r}])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
