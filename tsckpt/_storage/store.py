"""The names of :mod:`.locations`, :mod:`.faults` and :mod:`.durable` under their former
home, for the modules not yet moved to those (``_manager.py``, ``_save/commit.py``,
``_save/lease.py``, owned by other work in progress). Nothing is defined here: each name
is looked up in its home when it is used, so a test that patches a home patches these
callers too. New code imports from the homes; this module goes once those three do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import durable, faults, locations

if TYPE_CHECKING:
    from .durable import delete_all as delete_all
    from .durable import durable_kvstore as durable_kvstore
    from .durable import encode_json as encode_json
    from .durable import fsync_path as fsync_path
    from .durable import has_any_key as has_any_key
    from .durable import sync_paths as sync_paths
    from .durable import write_durable as write_durable
    from .faults import storage_errors as storage_errors
    from .faults import storage_problem as storage_problem
    from .locations import CONTEXT as CONTEXT
    from .locations import Directory as Directory
    from .locations import resolve as resolve

# Each name, and the module that defines it.
_HOMES = {
    **dict.fromkeys(("CONTEXT", "Directory", "resolve"), locations),
    **dict.fromkeys(("storage_errors", "storage_problem"), faults),
    **dict.fromkeys(
        ("delete_all", "durable_kvstore", "encode_json", "fsync_path", "has_any_key", "sync_paths", "write_durable"),
        durable,
    ),
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(home, name)
