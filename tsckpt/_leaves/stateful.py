"""Stateful objects anywhere in a tree: saved as their state, restored by ``load_state_dict``.

DCP's convention: an object with ``state_dict()`` and ``load_state_dict()`` (a
module, an optimizer, an LR scheduler, a data sampler, a GradScaler) may stand
anywhere in a tree given to ``save``, ``save_async``, ``restore`` or the
manager. A save stores what its ``state_dict()`` returns at its place (stateful
objects in that state in turn); a restore takes its current state as the
target of that place, and hands what was read back to ``load_state_dict``. A
``torch.Generator`` is stored as its state (``get_state`` / ``set_state``).

A *whole state* (``tsckpt.torch.TrainState``) saves and restores itself as the
whole tree of a checkpoint: ``__tsckpt_tree__(rank)`` is the tree this rank
saves, ``__tsckpt_restore__(directory, options)`` restores it in place and
returns what the restore returns. It stands only at the root of a tree. Its
``__tsckpt_objects__()``, where it has one, lists the live objects it saves, so an
overlapped ``save_async`` can hold back their updates (tsckpt/_save/guard.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .._base.lazytorch import is_generator, is_tensor, loaded
from .._errors import StructureMismatchError
from ..tree import join, leaves, paths_of, unflatten
from .quantized import expand_leaf, is_subclass_leaf

if TYPE_CHECKING:
    import torch
else:
    from .._base.lazytorch import torch

# Leaves and containers that are never stateful objects, told apart by one isinstance check
# (and torch tensors, by :func:`_is_plain`).
_PLAIN = (np.ndarray, np.generic, dict, list, tuple, str, bytes, int, float, type(None))


def _is_plain(obj: Any) -> bool:
    return isinstance(obj, _PLAIN) or is_tensor(obj)


def is_stateful(obj: Any) -> bool:
    """Has ``state_dict()`` and ``load_state_dict()`` (or is a ``torch.Generator``)."""
    if _is_plain(obj) or isinstance(obj, Mapping):
        return False
    if is_generator(obj):
        return True
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def is_whole_state(obj: Any) -> bool:
    """Saves and restores itself as a whole checkpoint's tree (``tsckpt.torch.TrainState``)."""
    return callable(getattr(type(obj), "__tsckpt_tree__", None)) and callable(
        getattr(type(obj), "__tsckpt_restore__", None)
    )


# Types whose nodes are never objects: answered without a look at the node (a training
# state's traversal meets hundreds of them at every save); torch's Tensor and Parameter join
# once torch is imported.
_NEVER_OBJECTS: set[type] = {dict, list, tuple, str, bytes, int, float, bool, type(None), np.ndarray}


def _is_object(node: Any) -> bool:
    """A stateful object, a whole state or a tensor subclass (:mod:`.quantized`): a leaf of the
    traversal that finds them."""
    cls = type(node)
    if cls in _NEVER_OBJECTS:
        return False
    t = loaded()
    if t is not None and (cls is t.Tensor or cls is t.nn.Parameter):
        _NEVER_OBJECTS.update((t.Tensor, t.nn.Parameter))  # once torch exists: answered by the first test
        return False
    if is_subclass_leaf(node):
        return True
    return not _is_plain(node) and (is_stateful(node) or is_whole_state(node))


def state_of(obj: Any) -> Any:
    """The state a save stores for a stateful object."""
    return obj.get_state() if is_generator(obj) else obj.state_dict()


def load_state(obj: Any, state: Any) -> Any:
    """Load ``state`` into a stateful object; returns the object."""
    if is_generator(obj):
        data = state if is_tensor(state) else torch.from_numpy(np.asarray(state))
        obj.set_state(data.to(torch.uint8).cpu().contiguous())
    else:
        obj.load_state_dict(state)
    return obj


def _same(restored: Any) -> Any:
    return restored


@dataclasses.dataclass(frozen=True)
class Expanded:
    """A tree with every stateful object replaced by its state (``tree``), and how to hand a
    restore of that tree back to the objects (``load``: the restored tree with each object,
    loaded, at its place)."""

    tree: Any
    load: Callable[[Any], Any] = _same


def expand(tree: Any, *, rank: int = 0, prefix: str = "") -> Expanded:
    """``tree`` with each stateful object replaced by its state; a whole state (at the root
    only) by the tree it saves on ``rank``; a tensor subclass by the subtree of its parts
    (:func:`tsckpt._leaves.quantized.expand_leaf`). A tree without them comes back as is.
    ``prefix``: the path of ``tree`` in the whole tree, for errors."""
    if is_whole_state(tree):
        return Expanded(expand(tree.__tsckpt_tree__(rank), rank=rank).tree)
    if is_subclass_leaf(tree):
        subtree, rebuild = expand_leaf(prefix, tree)
        return Expanded(subtree, rebuild)
    if is_stateful(tree):
        inner = expand(state_of(tree), rank=rank, prefix=prefix)
        return Expanded(inner.tree, lambda restored: load_state(tree, inner.load(restored)))
    found, spec = leaves(tree, stop=_is_object)
    objects = {i: leaf for i, leaf in enumerate(found) if type(leaf) not in _NEVER_OBJECTS and _is_object(leaf)}
    if not objects:
        return Expanded(tree)
    paths = paths_of(spec)
    whole = [i for i, leaf in objects.items() if is_whole_state(leaf)]
    if whole:
        raise StructureMismatchError(
            f"at '{join([prefix, paths[whole[0]]] if prefix else [paths[whole[0]]])}': a "
            f"{type(objects[whole[0]]).__name__} is a whole checkpoint's state; give it as the "
            "whole tree (save(directory, state), restore(directory, state)), not inside another tree"
        )
    parts = {
        i: expand(obj, rank=rank, prefix=join([prefix, paths[i]]) if prefix else paths[i]) for i, obj in objects.items()
    }

    def load(restored: Any) -> Any:
        subtrees = spec.flatten_up_to(restored)
        for i, part in parts.items():
            subtrees[i] = part.load(subtrees[i])
        return unflatten(spec, subtrees)

    return Expanded(unflatten(spec, [parts[i].tree if i in parts else leaf for i, leaf in enumerate(found)]), load)
