"""JAX's pytree registry, followed when jax is imported (tsckpt never imports it itself).

Containers registered with JAX (flax ``nnx.State``, flax.struct dataclasses, optax
states, a Flax ``TrainState``) flatten and rebuild through JAX's own registry, one
level at a time, so their children are what JAX says they are: static fields
(functions, an optax ``tx``) stay in the node's auxiliary data, not leaves. Each
child's key path entry names its path component (a dict key, an attribute, an
index); a node whose only child is its attribute ``value`` (a Flax ``Variable``)
is a box around that value and adds no component, so paths read as the state's
own names (``linear/kernel``, not ``linear/kernel/value``).

tsckpt.tree asks :func:`node_type` about every node it meets, and registers the
types this module owns with optree (see ``tree._register_dataclasses``).
"""

from __future__ import annotations

import collections
import sys
from typing import Any


class _Box:
    """The key of a box's one child: no path component (see the module docstring)."""

    def __repr__(self) -> str:
        return "BOX"

    def __reduce__(self) -> str:
        return "BOX"


BOX = _Box()


class DictIndex(int):
    """An int dict key of a JAX node (an ``nnx.State`` of an ``nnx.List``), told apart from
    a sequence index: tsckpt names both by the number, Orbax names a dict key as a string."""

    __slots__ = ()

# optree's own node types, which it flattens as JAX does: never handed to JAX
_OPTREE_TYPES = (type(None), tuple, list, dict, collections.OrderedDict, collections.defaultdict, collections.deque)
_nodes: dict[type, bool] = {}


def node_type(node: Any) -> bool:
    """Whether ``node``'s type is a container of JAX's registry that optree does not know
    (answered once per type; False when jax is not imported)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    cls = type(node)
    known = _nodes.get(cls)
    if known is None:
        if isinstance(node, _OPTREE_TYPES) or (isinstance(node, tuple) and hasattr(node, "_fields")):
            known = False
        else:
            _, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
            known = not jax.tree_util.treedef_is_leaf(treedef)
        _nodes[cls] = known
    return known


def _key(entry: Any) -> Any:
    """The str or int a JAX key path entry names."""
    import jax

    tu = jax.tree_util
    if isinstance(entry, tu.DictKey):
        return DictIndex(entry.key) if type(entry.key) is int else entry.key
    if isinstance(entry, tu.GetAttrKey):
        return entry.name
    if isinstance(entry, tu.SequenceKey):
        return entry.idx
    if isinstance(entry, tu.FlattenedIndexKey):
        return entry.key
    return str(entry)


def flatten_one(node: Any) -> tuple[list[Any], Any, list[Any]]:
    """One level of ``node`` through JAX's registry: (children, aux, keys) as optree wants them;
    aux is JAX's treedef of that level, which holds the static fields."""
    import jax

    pairs, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    keys = [_key(path[0]) for path, _ in pairs]
    if keys == ["value"] and isinstance(pairs[0][0][0], jax.tree_util.GetAttrKey):
        keys = [BOX]
    return [child for _, child in pairs], treedef, keys


def unflatten_one(treedef: Any, children: Any) -> Any:
    """The node that :func:`flatten_one` gave ``treedef`` for, with new children."""
    import jax

    return jax.tree_util.tree_unflatten(treedef, list(children))
