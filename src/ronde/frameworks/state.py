"""Broadcasting nested state whose leaves include tensors (framework-neutral).

An optimizer's state dict is a tree of dicts/lists/tuples holding tensors and plain
Python values. :func:`broadcast_state` sends it from the root in two parts: the
tree with every tensor replaced by a :class:`TensorSlot` (shape and dtype) goes by
``broadcast_object`` (small), then each tensor goes by a buffer broadcast into a
tensor the receiver allocates from the slot (zero-copy on the wire). Non-root
ranks get a tree of their own tensors; the root gets its own tree back.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence


class TensorSlot(NamedTuple):
    """Stands for tensor number ``position`` of the tree while the structure travels."""

    position: int
    dtype: str
    shape: tuple[int, ...]


def split_tensors(tree: Any, is_tensor: Callable[[Any], bool],
                  describe: Callable[[Any], tuple[str, Sequence[int]]]) -> tuple[Any, list[Any]]:
    """Replace every tensor leaf by a :class:`TensorSlot`; return (skeleton, tensors)."""
    tensors: list[Any] = []

    def walk(node: Any) -> Any:
        if is_tensor(node):
            dtype, shape = describe(node)
            tensors.append(node)
            return TensorSlot(len(tensors) - 1, dtype, tuple(int(d) for d in shape))
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, tuple) and not hasattr(node, "_fields"):
            return tuple(walk(v) for v in node)
        return node

    return walk(tree), tensors


def fill_tensors(skeleton: Any, tensors: Sequence[Any]) -> Any:
    """Inverse of :func:`split_tensors`: put ``tensors[slot.position]`` back in place."""

    def walk(node: Any) -> Any:
        if isinstance(node, TensorSlot):
            return tensors[node.position]
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, tuple) and not hasattr(node, "_fields"):
            return tuple(walk(v) for v in node)
        return node

    return walk(skeleton)


def slots(skeleton: Any) -> list[TensorSlot]:
    """Every :class:`TensorSlot` of a skeleton, ordered by index."""
    found: list[TensorSlot] = []

    def walk(node: Any) -> None:
        if isinstance(node, TensorSlot):
            found.append(node)
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(skeleton)
    return sorted(found, key=lambda s: s.position)


def broadcast_state(tree: Any, root_rank: int, is_root: bool, *,
                    is_tensor: Callable[[Any], bool],
                    describe: Callable[[Any], tuple[str, Sequence[int]]],
                    empty: Callable[[TensorSlot], Any],
                    broadcast_tensors: Callable[[list[Any]], None],
                    broadcast_object: Callable[[Any], Any]) -> Any:
    """Send ``tree`` from the root to every rank (see the module docstring).

    Args:
        tree: the state on the root (ignored elsewhere).
        root_rank: the sending rank (for the caller's collectives).
        is_root: True on the root.
        is_tensor: whether a leaf is a tensor of the framework.
        describe: a tensor's ``(dtype name, shape)``.
        empty: allocates a receive tensor for a slot (non-root ranks).
        broadcast_tensors: broadcasts the list of tensors in place from the root.
        broadcast_object: broadcasts a picklable object from the root, returns it.

    Returns:
        The root's tree: on the root ``tree`` itself, elsewhere a rebuilt copy.
    """
    if is_root:
        skeleton, tensors = split_tensors(tree, is_tensor, describe)
        broadcast_object(skeleton)
        broadcast_tensors(tensors)
        return tree
    skeleton = broadcast_object(None)
    tensors = [empty(s) for s in slots(skeleton)]
    broadcast_tensors(tensors)
    return fill_tensors(skeleton, tensors)
