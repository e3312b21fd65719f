"""The read verbs ``open`` and ``metadata``: a checkpoint of any format the formats
package opens, as a lazy :class:`Reader`; no process group needed."""

from __future__ import annotations

from typing import Any

from .._base.mapping import Rules
from .._formats.sources import open_checkpoint
from .._options import Copy, RestoreOptions, verb
from .._storage.locations import Directory
from .mapped import MappedReader, mapped_checkpoint
from .reader import Reader


@verb("tsckpt.open")
def open(  # noqa: A001 - mirrors tsckpt.open
    directory: Directory,
    *,
    format: str | None = None,  # noqa: A002
    allow_pickle: bool = False,
    mapping: Rules | None = None,
    copy: Copy = True,
) -> Reader:
    """A lazy, read-only view of a committed checkpoint; no process group needed. Any format
    :func:`tsckpt.restore` reads (``format`` and ``allow_pickle`` as there); indexing an
    array reads only the region the index selects. With ``mapping`` the reader shows the
    target leaves the rules make (their paths, shapes and dtypes), and indexing one reads
    only the stored boxes its region needs. ``copy=False`` (or ``"read-only"``): a read whose
    region is exactly one chunk stored raw in a local file returns a view of a copy-on-write
    mapping of the file, its crc32c checked first, as :func:`tsckpt.restore` does."""
    RestoreOptions.of(locals())
    ck = open_checkpoint(directory, format=format, allow_pickle=allow_pickle)
    ck.check_links()
    return Reader(ck, copy=copy) if mapping is None else MappedReader(mapped_checkpoint(ck, mapping))


@verb("tsckpt.metadata")
def metadata(
    directory: Directory,
    *,
    format: str | None = None,  # noqa: A002
    allow_pickle: bool = False,
    mapping: Rules | None = None,
) -> Any:
    """The saved tree with :class:`ArrayMetadata` in place of arrays; reads no array data.
    Any format :func:`tsckpt.restore` reads (``format`` and ``allow_pickle`` as there); with
    ``mapping``, the tree of the target leaves the rules make."""
    RestoreOptions.of(locals())
    ck = open_checkpoint(directory, format=format, allow_pickle=allow_pickle)
    return Reader(ck if mapping is None else mapped_checkpoint(ck, mapping).view).metadata()
