"""The read verbs ``open`` and ``metadata``: a checkpoint of any format the formats
package opens, as a lazy :class:`Reader`; no process group needed."""

from __future__ import annotations

from typing import Any

from ._formats.sources import open_checkpoint
from ._reader import Reader
from ._store import Directory


def open(directory: Directory) -> Reader:  # noqa: A001 - mirrors tsckpt.open
    """A lazy, read-only view of a committed checkpoint; no process group needed."""
    ck = open_checkpoint(directory)
    ck.check_links()
    return Reader(ck)


def metadata(directory: Directory) -> Any:
    """The saved tree with :class:`ArrayMetadata` in place of arrays; reads no array data."""
    return Reader(open_checkpoint(directory)).metadata()
