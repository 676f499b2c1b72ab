"""The shape of the house, checked from the source (nothing is imported or run).

- the import graph of ``src/ronde`` has no cycles (imports under ``TYPE_CHECKING``
  are type hints, not dependencies, and are left out);
- no transport module imports the engine (``ronde.core``): transports sit below it;
- the backend bindings (torch, tensorflow, jax, mxnet) never import one another.
  Keras is the exception by design: it runs on a backend and uses that backend's
  binding (``ronde.keras._bridge``), and ``tf.keras`` being Keras 3,
  ``ronde.tensorflow`` exposes ronde.keras's optimizer and callbacks;
- no module reaches a private (``_name``) attribute of a module in another package,
  whether imported by name or read from the module;
- no module is over 500 lines;
- no ``_ronde_*`` attribute (ronde's state on a user's optimizer or tape) is read outside
  the module that defines it: other modules use a public object (``shard_layout``);
- ``Any`` never stands for a ronde object: no ``X = Any`` alias, and no parameter typed
  ``Any`` named after a ronde class (``engine: Any``, ``process_set: Any``): such an
  annotation hid two import cycles (exchange <-> coordinator <-> tree, autotune <->
  engine) whose modules wrote each other's attributes unseen. Where the object is
  another library's (mpi4py's ``comm``, MXNet's optimizer ``state``), ``FOREIGN`` says so.
"""

from __future__ import annotations

import ast
import os
import re
from collections import defaultdict


SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
BACKENDS = ("torch", "tensorflow", "jax", "mxnet")
MAX_LINES = 500


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(os.path.join(SRC, "ronde")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
                found[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return found


MODULES = _modules()


def _package(module: str) -> str:
    """The package a module belongs to: ``ronde.core`` for ``ronde.core.engine``,
    ``ronde`` for the top-level ``ronde._api``."""
    path = MODULES[module]
    return module if path.endswith("__init__.py") else module.rpartition(".")[0]


def _targets(module: str, node: ast.AST) -> list[tuple[str, str | None]]:
    """(module imported, name taken from it or None) for one import statement."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = module if MODULES[module].endswith("__init__.py") else module.rpartition(".")[0]
    for _ in range(max(node.level - 1, 0)):
        base = base.rpartition(".")[0]
    target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
    out: list[tuple[str, str | None]] = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append((sub, None) if sub in MODULES else (target, alias.name))
    return out


def _owner(name: str) -> str | None:
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name if name in MODULES else None


def _scan() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    graph: dict[str, set[str]] = defaultdict(set)
    private: list[tuple[str, str, str]] = []
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        hints = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                 and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in hints:
                continue
            for (target, name), alias in zip(_targets(module, node), node.names):
                owner = _owner(target) if target.startswith("ronde") else None
                if owner is None:
                    continue
                if owner != module:
                    graph[module].add(owner)
                if name is None:
                    aliases[alias.asname or alias.name.split(".")[0]] = owner
                elif name.startswith("_") and not name.startswith("__"):
                    private.append((module, owner, name))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                target = f"{aliases[node.value.id]}.{node.attr}"
                if target not in MODULES:  # a private submodule is a module, not a name
                    private.append((module, aliases[node.value.id], node.attr))
    return graph, private


GRAPH, PRIVATE = _scan()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


def test_the_scan_sees_the_imports():
    # guards the checks below against an empty graph (a broken scan passes them all)
    assert "ronde.core.engine" in GRAPH["ronde._runtime"]
    assert "ronde.transport.shm.single_copy" in GRAPH["ronde.transport.shm.communicator"]
    assert len(MODULES) > 100


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_transport_imports_the_engine():
    bad = [(m, t) for m, ts in GRAPH.items() if m.startswith("ronde.transport")
           for t in ts if t.startswith("ronde.core")]
    assert bad == []


def test_the_executor_never_reaches_the_engine():
    # issue #34: the executor is given what it works with (each response carries its
    # requests, members and communicator, resolved by the dispatcher; failed()/fail())
    # and holds no engine: no import of it, no ``engine`` attribute or name, in it, in
    # the dispatcher or in the inline reductions and planning they run
    bad = []
    for module in ("ronde.core.executor", "ronde.core.dispatch", "ronde.core.inline",
                   "ronde.core.planner"):
        if any(t == "ronde.core.engine" for t in GRAPH[module]):
            bad.append(f"{module} imports the engine")
        with open(MODULES[module], encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        bad += [f"{module}:{n.lineno} {ast.unparse(n)}" for n in ast.walk(tree)
                if (isinstance(n, ast.Attribute) and n.attr in ("engine", "eng"))
                or (isinstance(n, ast.Name) and n.id in ("engine", "eng"))]
    assert bad == []


def _backend(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in BACKENDS else None


def test_no_backend_binding_imports_another():
    bad = [(m, t) for m, ts in GRAPH.items() for t in ts
           if _backend(m) and _backend(t) and _backend(m) != _backend(t)]
    assert bad == []


def test_no_private_name_crosses_a_package():
    bad = [f"{m} uses {t}.{n}" for m, t, n in PRIVATE if _package(m) != _package(t)
           and not _package(m).startswith(_package(t) + ".")]
    assert bad == []


def _ronde_attributes() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``_ronde_*`` attributes (what ronde hangs on the user's optimizers and tapes): the
    modules that define each (assign it, declare it in a class, ``setattr`` it) and the
    modules that read it (``x._ronde_a``, ``getattr(x, "_ronde_a")``)."""
    defined: dict[str, set[str]] = defaultdict(set)
    read: dict[str, set[str]] = defaultdict(set)
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Attribute) and node.attr.startswith("_ronde_"):
                (read if isinstance(node.ctx, ast.Load) else defined)[node.attr].add(module)
            elif isinstance(node, ast.FunctionDef):
                names = [node.name]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.Call) and len(node.args) > 1 \
                    and isinstance(node.args[1], ast.Constant) \
                    and str(node.args[1].value).startswith("_ronde_"):
                func = ast.unparse(node.func)
                names = [] if func in ("getattr", "hasattr") else [node.args[1].value]
                if not names:
                    read[node.args[1].value].add(module)
            for name in names:
                if name.startswith("_ronde_"):
                    defined[name].add(module)
    return defined, read


def test_no_ronde_attribute_is_read_outside_the_module_that_defines_it():
    """The state ronde keeps on a user's optimizer is its module's own: other modules go
    through a public object (``shard_layout``, ``gradient_buckets``, ``relayout()``), so
    a layout bug is fixed in one place (issue #52: 22 such reads from 5 modules)."""
    defined, read = _ronde_attributes()
    bad = sorted(f"{m} reads {a} (defined in {', '.join(sorted(defined[a])) or 'no module'})"
                 for a, where in read.items() for m in where - defined[a])
    assert bad == []


def test_the_attribute_check_sees_a_read_from_elsewhere():
    defined, read = _ronde_attributes()
    assert "ronde.torch._sharded_mixin" in defined["_ronde_buckets"]
    assert "ronde.keras.sharded" in defined["_ronde_cfg"]
    assert read["_ronde_cfg"] == {"ronde.keras.sharded"}


def test_module_size():
    """One test for every module (it was one item per module: 183 of the suite's items)."""
    too_long = []
    for module, path in sorted(MODULES.items()):
        with open(path, encoding="utf-8") as fh:
            lines = sum(1 for _ in fh)
        if lines > MAX_LINES:
            too_long.append(f"{module} has {lines} lines")
    assert not too_long, "; ".join(too_long) + f" (at most {MAX_LINES}): split along a seam"


#: (module, function, parameter) typed ``Any`` whose name is a ronde class's but whose
#: object is another library's
FOREIGN = {
    ("ronde._api", "init", "comm"),  # an mpi4py communicator
    ("ronde.transport.mpi", "__init__", "comm"),  # an mpi4py communicator
    ("ronde.mxnet.optimizer", "update", "state"),  # MXNet's optimizer state
    ("ronde.mxnet.optimizer", "update_multi_precision", "state"),
    ("ronde.jax.optimizer", "update", "state"),  # an optax optimizer state
    ("ronde.torch.huggingface", "on_step_end", "state"),  # transformers' TrainerState
    ("ronde.torch.huggingface", "on_epoch_end", "state"),
}


def _any_standing_for_ronde() -> list[str]:
    trees = {}
    classes = set()
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as fh:
            trees[module] = ast.parse(fh.read(), path)
        classes |= {re.sub(r"(?<!^)(?=[A-Z])", "_", n.name).lower()
                    for n in ast.walk(trees[module])
                    if isinstance(n, ast.ClassDef) and not n.name.startswith("_")}

    def is_any(a: ast.AST | None) -> bool:
        return a is not None and ast.unparse(a).strip("'\"") in ("Any", "typing.Any")

    bad = []
    for module, tree in sorted(trees.items()):
        bad += [f"{module}:{n.lineno} {ast.unparse(n)}" for n in tree.body
                if isinstance(n, (ast.Assign, ast.AnnAssign)) and is_any(n.value)]
        for f in ast.walk(tree):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = f.args
                bad += [f"{module}:{f.lineno} {f.name}({p.arg}: Any)"
                        for p in a.posonlyargs + a.args + a.kwonlyargs
                        if is_any(p.annotation) and p.arg in classes
                        and (module, f.name, p.arg) not in FOREIGN]
    return bad


def test_any_never_stands_for_a_ronde_object():
    assert _any_standing_for_ronde() == []
