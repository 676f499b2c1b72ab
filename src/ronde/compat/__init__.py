"""Opt-in alias: ``import horovod.torch as hvd`` (and every ``horovod.*``) gives ronde.

For running Horovod code that you do not want to edit (Horovod's own test suites, a
colleague's script) without installing Horovod::

    python -m ronde.compat train.py --epochs 3          # a script
    python -m ronde.compat -m pytest test_torch.py      # a module, as python -m does
    ronderun -np 2 python -m ronde.compat train.py      # under the launcher

or, in code, ``import ronde.compat; ronde.compat.install()`` before the first
``import horovod...``. Nothing happens unless you ask: importing ``ronde`` never
installs the alias, and a real Horovod installation is shadowed only while it is
installed (:func:`uninstall` removes it).

``horovod.X`` resolves to ``ronde.X`` (``horovod.torch`` -> ``ronde.torch``,
``horovod.tensorflow.keras`` -> ``ronde.tensorflow.keras``, ...), the very module
objects, so ``isinstance`` checks and module state are shared. A few of Horovod's
helper modules that test suites import are mapped to small equivalents here
(:data:`ALIASES`), and importing a TensorFlow or Keras module through the alias
adds the Keras 2 spelling ``variable.ref()`` to Keras 3 (:mod:`.keras2`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Sequence

#: Horovod modules whose ronde counterpart has another name
ALIASES = {
    "horovod.runner.util.threads": "ronde.compat.threads",
    "horovod.common.exceptions": "ronde._errors",
    "horovod.torch.mpi_ops": "ronde.torch",  # Horovod's ops module: the same functions
    "horovod.common.util": "ronde.compat.helpers",
    "horovod.runner.common.util.env": "ronde.compat.helpers",
}


def target_of(fullname: str) -> str | None:
    """The ronde module that stands for Horovod module ``fullname`` (None: not Horovod's)."""
    if fullname != "horovod" and not fullname.startswith("horovod."):
        return None
    if fullname in ALIASES:
        return ALIASES[fullname]
    return "ronde" + fullname[len("horovod"):]


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        if self.target.startswith(("ronde.tensorflow", "ronde.keras")):
            from . import keras2

            keras2.install()
        return module

    def exec_module(self, module: ModuleType) -> None:
        pass  # the ronde module ran when it was imported


class _EmptyPackage(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = ModuleType(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: ModuleType) -> None:
        pass


class HorovodAlias(importlib.abc.MetaPathFinder):
    """The meta-path finder that answers ``horovod.*`` imports with ronde modules."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        name = target_of(fullname)
        if name is None:
            return None
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            found = None
        if found is None:
            if any(key.startswith(fullname + ".") for key in ALIASES):
                # a parent of an alias that ronde has no module for: an empty package
                return importlib.machinery.ModuleSpec(fullname, _EmptyPackage(),
                                                      is_package=True)
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(name),
                                              is_package=found.submodule_search_locations
                                              is not None)


_FINDER = HorovodAlias()


def install() -> None:
    """Make ``import horovod...`` give ronde's modules (idempotent)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Remove the alias; ``horovod.*`` modules imported meanwhile are forgotten too."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")]:
        del sys.modules[name]

