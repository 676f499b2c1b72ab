"""Skip a test module whose frameworks are not installed, without importing them.

``pytest.importorskip("tensorflow")`` at the top of a test module imports TensorFlow in
the pytest process at collection, though the test only starts ranks that import it:
with three pytest workers that was three imports each of TensorFlow, Keras, JAX,
Lightning and transformers (about 10 s of CPU per worker) before the first test ran.
"""

from __future__ import annotations

import importlib.util


def skip_unless_installed(*modules: str) -> None:
    """At a test module's top: skip the whole module unless every one of ``modules`` can be
    imported (found on the path; nothing is imported)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        import pytest

        pytest.skip(f"needs {', '.join(missing)} (not installed)", allow_module_level=True)
