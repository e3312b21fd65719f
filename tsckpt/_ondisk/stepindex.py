"""The step index of a CheckpointManager's root on an object store.

Object stores have no directories, and listing every key of every step to
find the step names would read thousands of keys per step. So a manager's
root holds an index: an empty marker object ``.tsckpt-steps/<step>`` per step
directory, written before anything of the step is, and deleted last when the
step goes; listing the steps lists only the markers (one small key range).
The manager writes ``.tsckpt-steps/.root`` when it is created, and any save
(``tsckpt.save`` too) into a numbered directory right under such a root marks
its step first, so a step saved without the manager is listed as well. A
marker is only a hint: each step's root ``zarr.json`` says whether it is complete.
:func:`step_names` lists a root's step directories, on any storage, reading only.
"""

from __future__ import annotations

import os
import re

import tensorstore as ts

from .._storage.faults import storage_errors
from .._storage.locations import Location, resolve

STEP = re.compile(r"[0-9]+")
INDEX = ".tsckpt-steps/"
_ROOT_MARK = f"{INDEX}.root"  # this root is a manager's: saves into its step directories mark their step


def adopt(root: Location) -> None:
    """Mark ``root`` (an object store location) as a manager's root."""
    with storage_errors(root):
        root.kvstore().write(_ROOT_MARK, b"").result()


def mark(root: Location, name: str) -> None:
    """List step directory ``name`` in ``root``'s index (before anything of it is written)."""
    with storage_errors(root):
        root.kvstore().write(f"{INDEX}{name}", b"").result()


def mark_if_managed(loc: Location) -> None:
    """A save into ``loc`` on an object store: if ``loc`` is a step directory right under a
    manager's root, list it in that root's index (one read, and one write when it is)."""
    if loc.local is not None:
        return
    parent, _, name = str(loc.spec.get("path", "")).rstrip("/").rpartition("/")
    if not STEP.fullmatch(name):
        return
    root = resolve({**loc.spec, "path": parent})
    with storage_errors(root):
        managed = root.kvstore().read(_ROOT_MARK).result().state == "value"
    if managed:
        mark(root, name)


def step_names(root: Location) -> list[str]:
    """The names of the step directories right under ``root`` (numbered, :data:`STEP`): on a
    local disk its subdirectories, elsewhere its index's markers; sorted. Reads only."""
    if root.local is not None:
        if not os.path.isdir(root.local):
            return []
        return sorted(e.name for e in os.scandir(root.local) if e.is_dir() and STEP.fullmatch(e.name))
    markers = ts.KvStore.KeyRange(INDEX, INDEX[:-1] + "0")  # '0' follows '/'
    with storage_errors(root):
        keys = root.kvstore().list(markers, strip_prefix_length=len(INDEX)).result()
    return sorted(n for n in (k.decode("utf-8", "replace") for k in keys) if STEP.fullmatch(n))
