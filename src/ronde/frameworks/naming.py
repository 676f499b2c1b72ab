"""Tensor names for gradients and state, and cross-rank consistency reports.

ronde matches collectives by name, so every rank must give a gradient the same
name. Names come from the user's ``named_parameters`` or, without them, from the
parameter's position (group ``i``, index ``j``): stable as long as every rank builds
the same model. :func:`parameter_differences` turns the per-rank parameter tables
(gathered once with ``allgather_object``) into an error message naming the
parameters that differ.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Mapping, Sequence

from ..process_sets import ProcessSet

#: one parameter's signature: (dtype name, shape)
Signature = tuple[str, tuple[int, ...]]


def auto_parameter_name(group: int, index: int) -> str:
    """The name of parameter ``index`` of parameter group ``group`` when none is given."""
    return f"noname.{group}.{index}"


def gradient_name(param_name: str) -> str:
    """The collective name of a parameter's gradient (Horovod's ``allreduce.<name>``)."""
    return f"allreduce.{param_name}"


def presence_name(param_name: str) -> str:
    """The collective name of an optimizer's per-step count of the ranks that have each
    gradient, after the optimizer's first parameter (one count per optimizer)."""
    return f"{gradient_name(param_name)}.presence"


def check_unique(names: Iterable[str], what: str = "named_parameters") -> None:
    """Raise ``ValueError`` listing the names that occur more than once."""
    dups = sorted(n for n, c in Counter(names).items() if c > 1)
    if dups:
        raise ValueError(f"parameter names in {what} must be unique; duplicates: "
                         f"{', '.join(map(repr, dups[:10]))}"
                         f"{' ...' if len(dups) > 10 else ''}")


def name_parameters(param_groups: Sequence[Mapping[str, Any]],
                    named_parameters: Iterable[tuple[str, Any]] | None) -> dict[int, str]:
    """``id(parameter) -> name`` for every parameter of an optimizer's groups: from
    ``named_parameters`` (checked: pairs, unique names, every parameter named), or by
    position without it (:func:`auto_parameter_name`)."""
    all_params = [(gi, j, p) for gi, g in enumerate(param_groups)
                  for j, p in enumerate(g["params"])]
    if named_parameters is None:
        return {id(p): auto_parameter_name(gi, j) for gi, j, p in all_params}
    named = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) "
                         "tuples, usually model.named_parameters()")
    check_unique([n for n, _ in named])
    names = {id(p): n for n, p in named}
    unnamed = [f"group {gi} index {j} {tuple(p.shape)}" for gi, j, p in all_params
               if id(p) not in names]
    if unnamed:
        raise ValueError(f"named_parameters was given, but {len(unnamed)} of the optimizer's "
                         f"parameters are not in it ({', '.join(unnamed[:5])}); pass the "
                         "named_parameters() of the model the optimizer was built from")
    return names


def _fmt(sig: Signature) -> str:
    return f"{sig[0]}[{', '.join(map(str, sig[1]))}]"


def parameter_differences(tables: Sequence[Mapping[str, Signature]],
                          ranks: Sequence[int] | None = None, limit: int = 8) -> str | None:
    """Describe how per-rank parameter tables differ, or None if they agree.

    Args:
        tables: one ``{name: (dtype, shape)}`` per rank, in rank order.
        ranks: the global ranks of ``tables`` (default 0..n-1).
        limit: at most this many differing names are described.
    """
    ranks = list(ranks) if ranks is not None else list(range(len(tables)))
    names = sorted(set().union(*[set(t) for t in tables])) if tables else []
    problems: list[str] = []
    for name in names:
        present = [r for r, t in zip(ranks, tables) if name in t]
        missing = [r for r in ranks if r not in present]
        if missing:
            problems.append(f"{name!r} exists on {_ranks(present)} but not on "
                            f"{_ranks(missing)}")
            continue
        sigs: dict[Signature, list[int]] = {}
        for r, t in zip(ranks, tables):
            sigs.setdefault((t[name][0], tuple(t[name][1])), []).append(r)
        if len(sigs) > 1:
            problems.append(f"{name!r} is " + "; ".join(
                f"{_fmt(s)} on {_ranks(rs)}" for s, rs in sigs.items()))
    if not problems:
        return _order_difference(tables, ranks)
    more = f" (and {len(problems) - limit} more)" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


def _order_difference(tables: Sequence[Mapping[str, Signature]], ranks: Sequence[int]
                      ) -> str | None:
    """Where the same parameters come in another order on some ranks (positions pair
    the ranks' gradients: the presence counts, the buckets), the first position that
    differs and what each rank has there; None if every rank's order is rank 0's."""
    orders = [list(t) for t in tables]
    for i, names in enumerate(zip(*orders)):
        if len(set(names)) > 1:
            by_name: dict[str, list[int]] = {}
            for r, n in zip(ranks, names):
                by_name.setdefault(n, []).append(r)
            return (f"the same parameters come in another order: position {i} is "
                    + "; ".join(f"{n!r} on {_ranks(rs)}" for n, rs in by_name.items())
                    + " (the order must be the same on every rank)")
    return None


def _ranks(rs: Sequence[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def as_table(items: Iterable[tuple[str, Any, Sequence[int]]]) -> dict[str, Signature]:
    """Build a ``{name: (dtype, shape)}`` table from ``(name, dtype, shape)`` triples."""
    return {name: (str(dtype), tuple(int(d) for d in shape)) for name, dtype, shape in items}


def require_same_parameters(entries: Iterable[tuple[str, Any, Sequence[int]]], name: str,
                            process_set: ProcessSet, what: str, fix: str) -> None:
    """Compare ``(name, dtype, shape)`` entries across the ranks of ``process_set`` (one
    ``allgather_object`` called ``name``); where they differ, raise
    ``TensorMismatchError``: ``what`` (e.g. "DistributedOptimizer: the parameters differ
    across ranks"), the differences, then ``fix``."""
    from .. import _objects
    from .._errors import TensorMismatchError

    tables = _objects.allgather_object(as_table(entries), name, process_set)
    diff = parameter_differences(tables, process_set.ranks)
    if diff:
        raise TensorMismatchError(f"{what}: {diff}; {fix}")
