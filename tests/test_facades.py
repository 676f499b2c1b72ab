"""Every facade's ``__all__`` is its list in ``ronde._facade``, and every name exists."""

from __future__ import annotations

import importlib

import pytest

from ronde import _facade

#: the framework each facade needs (skipped where it is not installed)
NEEDS = {"ronde": None, "ronde.torch": "torch", "ronde.tensorflow": "tensorflow",
         "ronde.tensorflow.keras": "tensorflow", "ronde.keras": "keras", "ronde.jax": "jax",
         "ronde.mxnet": "mxnet"}


def test_every_facade_is_declared():
    assert set(_facade.FACADES) == set(NEEDS)
    for module, names in _facade.FACADES.items():
        assert len(names) == len(set(names)), (module, "declares a name twice")


@pytest.mark.parametrize("module", sorted(NEEDS))
def test_facade_exports_exactly_its_declared_names(module):
    if NEEDS[module]:
        pytest.importorskip(NEEDS[module])
    mod = importlib.import_module(module)
    assert list(mod.__all__) == _facade.FACADES[module]
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{module} declares but lacks {missing}"
