"""The read verbs ``open`` and ``metadata``: a checkpoint of any format the formats
package opens, as a lazy :class:`Reader`; no process group needed."""

from __future__ import annotations

from typing import Any

from .._formats.sources import open_checkpoint
from .._options import RestoreOptions, verb
from .._storage.locations import Directory
from .reader import Reader


@verb("tsckpt.open")
def open(  # noqa: A001 - mirrors tsckpt.open
    directory: Directory, *, format: str | None = None, allow_pickle: bool = False  # noqa: A002
) -> Reader:
    """A lazy, read-only view of a committed checkpoint; no process group needed. Any format
    :func:`tsckpt.restore` reads (``format`` and ``allow_pickle`` as there); indexing an
    array reads only the region the index selects."""
    RestoreOptions.of(locals())
    ck = open_checkpoint(directory, format=format, allow_pickle=allow_pickle)
    ck.check_links()
    return Reader(ck)


@verb("tsckpt.metadata")
def metadata(directory: Directory, *, format: str | None = None, allow_pickle: bool = False) -> Any:  # noqa: A002
    """The saved tree with :class:`ArrayMetadata` in place of arrays; reads no array data.
    Any format :func:`tsckpt.restore` reads (``format`` and ``allow_pickle`` as there)."""
    RestoreOptions.of(locals())
    return Reader(open_checkpoint(directory, format=format, allow_pickle=allow_pickle)).metadata()
