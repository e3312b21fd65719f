"""An opened checkpoint, whatever its format: the leaves, array records and plain values
every read verb works from, and how each array is opened.

A :class:`Checkpoint` is made by a format's opener (tsckpt's own root metadata in
``_root.py``, another library's metadata in ``_formats/``); readers never parse a
format themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import tensorstore as ts

from .._base import dtypes as _dtypes
from .._errors import CorruptCheckpointError
from .._storage import faults as _faults
from .._storage import locations as _locations
from .._storage.confine import confined_opens, refuse_links
from .._storage.locations import Location
from .._storage.mirror import Mirror
from ..tree import TSCKPT_NAMES, from_paths, structure_from_json
from .arrays import (
    CACHED,
    chunk_size_problem,
    data_spec,
    node_problem,
    open_array_future,
    parse_node,
    stored_files,
    stored_size,
)
from .bounds import NODE_BYTES, file_problem, refused
from .records import LAYOUT_PLAIN, ROOT_KEY, ArrayRecord

# Files of an array, at most, that TensorStore's read of it opens by their names (the
# record's); an array said to have more is walked for the files it really has.
_NAMED_FILES = 64
# The format of a checkpoint tsckpt wrote; any other is another library's.
TSCKPT = "tsckpt"


@dataclasses.dataclass(frozen=True)
class ArrayMetadata:
    """What is known about a stored array without reading its data."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]  # unit of partial reads
    shard_shape: tuple[int, ...]  # one file per shard
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The parsed metadata of a committed checkpoint."""

    location: Location
    leaves: tuple[str, ...]
    arrays: Mapping[str, ArrayRecord]
    values: Mapping[str, Any]  # path -> decoded plain value
    structure: Any
    raw: Mapping[str, Any]  # the root metadata as stored (empty for another library's checkpoint)
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)  # alias path -> stored array path
    # arrays of a checkpoint written by another library (Orbax): path -> TensorStore spec
    specs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # opened with keep_bad=True (verify): leaves left out because their entry in the root metadata is invalid
    bad: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tree_problem: str | None = None  # and why the structure cannot rebuild the tree
    # "tsckpt", or the library that wrote a checkpoint tsckpt reads directly ("orbax"); set by
    # the opener that parsed it, never read from the stored metadata
    format: str = TSCKPT
    # how a restore names the target's leaves to match these (tree.flatten's ``names``): Orbax's
    # own rules for a checkpoint Orbax wrote, tsckpt's for every other
    names: str = TSCKPT_NAMES
    # arrays of another format read from its own files region by region (safetensors, torch.save,
    # DCP): stored array path -> its LazySource (tsckpt._formats.lazy); None for the formats
    # whose arrays open through TensorStore
    sources: Mapping[str, Any] | None = None
    # the generation of the root zarr.json that was opened (tsckpt's format): readers check that
    # it is still the root after reading (readfaults.unchanged); None for another library's
    root_generation: bytes | None = dataclasses.field(default=None, compare=False)
    # what :attr:`specs` read through (another library's local checkpoint: a Mirror), kept as long as they are
    held: Any = dataclasses.field(default=None, compare=False, repr=False)
    # the arrays whose files were found to back their records (see _backing.py)
    backed: set[str] = dataclasses.field(default_factory=set, compare=False, repr=False)
    _cache: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)  # the kvstore

    @property
    def foreign(self) -> bool:
        """Written by another library: its arrays open through their own specs, and its files
        (nodes, shards, links) are that library's to check. The one place this is asked."""
        return self.format != TSCKPT

    @property
    def lazy(self) -> bool:
        """Its arrays are read through :attr:`sources`, not TensorStore: every reader (restore,
        ``open``, verify) asks the source for the regions it needs and nothing more."""
        return self.sources is not None

    def context(self) -> ts.Context:
        """The TensorStore context its arrays are read in: one of its own, made once
        (:func:`_locations.reader_context`: the replaced database of a checkpoint saved again
        in its place is never read for it, nor it for the replaced one)."""
        if "context" not in self._cache:
            self._cache["context"] = _locations.reader_context()
        return cast(ts.Context, self._cache["context"])

    def kvstore(self) -> ts.KvStore:
        """The kvstore of :meth:`read_data`, opened once. Every read of the checkpoint's files
        by TensorStore goes through it or follows it (:class:`Opening`), so a walk for links
        put off by :meth:`check_links` runs here, before TensorStore reads anything. Before
        reading a key of a local checkpoint through it, :meth:`hold` the key."""
        if self._cache.get("links") == "deferred":
            self.check_links()
        if "kv" not in self._cache:
            self._cache["kv"] = ts.KvStore.open(self.read_data(), context=self.context()).result()
        return cast(ts.KvStore, self._cache["kv"])

    def _mirror(self) -> Mirror | None:
        """The :class:`Mirror` TensorStore reads a local checkpoint of tsckpt's format through,
        made once (a compact one whole: its database's few files); None for any other."""
        if self.location.local is None or self.foreign:
            return None
        if "mirror" not in self._cache:
            mirror = Mirror(self.location.local, str(self.location))
            if self.layout != LAYOUT_PLAIN:
                mirror.add_tree("")
            self._cache.setdefault("mirror", mirror)  # made by two threads at once: one is kept, by both
        return cast(Mirror, self._cache["mirror"])

    def read_data(self) -> dict[str, Any]:
        """kvstore spec TensorStore reads the array nodes and chunks through: :meth:`data`, but
        for a local checkpoint its :class:`Mirror` (links to descriptors of files opened with
        no link followed), so that a file swapped for a link is never read through the link."""
        mirror = self._mirror()
        if mirror is None:
            return self.data()
        if self.layout == LAYOUT_PLAIN:
            return mirror.spec()
        return {**self.data(), "base": mirror.spec()}

    def hold(self, keys: Iterable[str], *, leaf: str) -> None:
        """Open the files ``keys`` of array ``leaf`` of a local checkpoint, with no link
        followed, for reads of them through :meth:`kvstore` (:meth:`Mirror.add`); nothing
        for any other checkpoint."""
        mirror = self._mirror()
        if mirror is not None and self.layout == LAYOUT_PLAIN:
            with self._storage_faults(leaf):
                mirror.add(keys, field=f"leaf {leaf!r}: the file")

    def hold_tree(self, path: str) -> None:
        """:meth:`hold` every file below array ``path`` (:meth:`Mirror.add_tree`)."""
        mirror = self._mirror()
        if mirror is not None and self.layout == LAYOUT_PLAIN:
            with self._storage_faults(path):
                mirror.add_tree(path, field=f"leaf {path!r}: the file")

    @property
    def held_sizes(self) -> bool:
        """Whether the sizes of the files held for TensorStore's reads (:meth:`hold`) are known
        from their descriptors (:meth:`Mirror.size`): a local checkpoint of tsckpt's plain layout."""
        return self.location.local is not None and not self.foreign and self.layout == LAYOUT_PLAIN

    def chunk_size_problem(self, path: str) -> str | None:
        """Why a chunk file held (:meth:`hold`) of the unsharded array ``path`` is not of the size
        its record gives it (:func:`.arrays.chunk_size_problem`: TensorStore reads a chunk file
        with bytes after its crc32c, which zarr readers refuse), from the size each had when
        opened (no system call); None when each is, or where sizes are not known here
        (:attr:`held_sizes`; a missing file or one not held ends the check: its read says
        why). A sharded array is left to its readers: its index lies at the end of the file."""
        rec = self.arrays[path]
        mirror = self._cache.get("mirror") if self.held_sizes else None
        if mirror is None or rec.chunking.chunk_shape is not None:
            return None
        for key, _ in stored_files(rec):
            size = cast(Mirror, mirror).size(key)
            if size is None:
                return None
            problem = chunk_size_problem(rec, key, size)
            if problem is not None:
                return problem
        return None

    def damaged(self, path: str, what: str, detail: str) -> CorruptCheckpointError:
        """The error of damaged data of array ``path`` that tsckpt's own checks found: ``what``
        (a fault's phrase, :mod:`tsckpt._storage.faults`) and ``detail``, worded as
        :func:`.readfaults.corrupt_error` words TensorStore's."""
        where = f"'{path}' in {self.location}"
        return CorruptCheckpointError(f"{where}: {what}; restore from another checkpoint. ({detail})")

    @contextlib.contextmanager
    def _storage_faults(self, leaf: str) -> Iterator[None]:
        """An operating-system error of opening a file of ``leaf`` (permission denied, an I/O
        error) raised as the StorageError every read raises for it, naming the file's full path."""
        try:
            yield
        except OSError as e:
            if self.location.local is not None and e.filename and not os.path.isabs(str(e.filename)):
                e.filename = os.path.join(self.location.local, str(e.filename))
            problem = _faults.storage_problem(self.location, e, leaf=leaf, doing="reading")
            if problem is None:
                raise
            raise problem from e

    @property
    def layout(self) -> str:
        """Where the array data lives: "plain" (a file per shard) or "compact" (OCDBT)."""
        return str(self.raw.get("layout", LAYOUT_PLAIN))

    def data(self) -> dict[str, Any]:
        """kvstore spec holding the array nodes and chunks."""
        return data_spec(self.location, self.layout)

    def open_array_future(self, path: str) -> Opening:
        """Open a stored array for reading; its zarr.json is checked against the root metadata."""
        return Opening(self, path)

    def node_file_problem(self, path: str) -> str | None:
        """Why the zarr.json of array ``path`` is not read (:mod:`.bounds`: on a local disk, a
        file of the plain layout that is no regular file, or larger than :data:`NODE_BYTES`),
        as a phrase after its name; None when it may be read."""
        if self.location.local is None or self.layout != LAYOUT_PLAIN or self.foreign:
            return None
        return file_problem(os.path.join(self.location.local, path, ROOT_KEY), NODE_BYTES, "an array's zarr.json")

    def read_node(self, path: str) -> Any:
        """The read of array ``path``'s zarr.json (a future of a kvstore ReadResult) through
        :meth:`kvstore`; one that is not read (:meth:`node_file_problem`) reads as missing,
        and opening the array then says why."""
        kv = self.kvstore()  # first: a deferred walk for links and special files names them all
        if self.node_file_problem(path) is not None:
            return _NOT_READ
        self.hold([f"{path}/{ROOT_KEY}"], leaf=path)
        return kv.read(f"{path}/{ROOT_KEY}", staleness_bound=CACHED)

    def check_links(self, *, deferred: bool = False) -> None:
        """Refuse a local checkpoint that holds a symbolic link before reading its data
        (docs/security.md), naming every link at once; another library's checkpoint (Orbax)
        is left to that library. The walk is what names links up front: what keeps a read
        from following one, however late it is planted, is that every file is opened with
        no link followed (tsckpt's own readers; TensorStore through :meth:`read_data`).

        ``deferred`` (restore): where tsckpt's own readers open files refusing links
        (:func:`tsckpt._storage.confine.confined_opens`) and the checkpoint is of the plain layout, the walk
        waits until TensorStore is about to read (:meth:`kvstore`).
        A restore that the own readers read whole then needs no walk: for 10,000 small
        leaves the walk took 0.13-0.16 s of a 0.9 s restore. A link met by an own reader
        fails its open, and that leaf goes to TensorStore's path, so the walk runs and
        names it, as it would have up front."""
        if self.foreign or self._cache.get("links") == "checked":
            return
        if deferred and self.location.local is not None and self.layout == LAYOUT_PLAIN and confined_opens():
            self._cache["links"] = "deferred"
            return
        refuse_links(self.location.local, str(self.location), tuple(self.arrays))
        self._cache["links"] = "checked"

    def is_array(self, path: str) -> bool:
        return path in self.arrays or path in self.aliases

    def array_metadata(self, path: str) -> ArrayMetadata:
        rec = self.arrays[self.aliases.get(path, path)]
        return ArrayMetadata(
            path=path,
            shape=rec.shape,
            dtype=rec.dtype,
            chunk_shape=rec.chunking.chunk_shape or rec.chunking.shard_shape,
            shard_shape=rec.chunking.shard_shape,
            nbytes=math.prod(rec.shape) * _dtypes.itemsize(rec.dtype),
        )

    def build(self, leaves: list[Any]) -> Any:
        """Arrange per-leaf objects (in ``self.leaves`` order) into the saved tree."""
        if self.structure is not None:
            return structure_from_json(self.structure, leaves)
        return from_paths(self.leaves, leaves)  # saved by ranks with different trees


class Opening:
    """A stored array being opened (``result()`` is the TensorStore). Its zarr.json is read
    and parsed here first, as TensorStore crashes the process on JSON nested deeply enough;
    a node that agrees with the record is then not read again, and any other is left to
    TensorStore, which names what differs. Reads start at once, so arrays open concurrently."""

    def __init__(self, ck: Checkpoint, path: str) -> None:
        self._ck, self._path = ck, path
        self._node = None if ck.foreign else ck.read_node(path)

    def result(self) -> ts.TensorStore:
        ck, path = self._ck, self._path
        if ck.lazy:
            raise TypeError(f"'{path}' in {ck.location}: a {ck.format} array is read through its source, not TensorStore")
        if self._node is None:
            return ts.open(ck.specs[path], read=True, context=_locations.CONTEXT).result()
        problem = ck.node_file_problem(path)
        if problem is not None:  # never left to TensorStore, which would read it whole (or wait)
            raise refused(f"'{path}' in {ck.location}: {path}/zarr.json", problem, "restore from another checkpoint")
        found = self._node.result()
        rec = ck.arrays[path]
        if found.state == "value":
            try:
                node = parse_node(found.value)
            except ValueError as e:
                raise CorruptCheckpointError(
                    f"'{path}' in {ck.location}: {path}/zarr.json is not valid JSON ({e}); "
                    "restore from another checkpoint"
                ) from None
            if node_problem(node, rec) is None:  # its files are the record's: a few are opened by name
                if stored_size(rec).files <= _NAMED_FILES:
                    ck.hold((key for key, _ in stored_files(rec)), leaf=path)
                else:  # as many as exist (a record may claim any number)
                    ck.hold_tree(path)
                problem = ck.chunk_size_problem(path)
                if problem is not None:
                    raise ck.damaged(path, _faults.UNDECODABLE, problem)
                return open_array_future(ck.read_data(), rec, checked=True, context=ck.context()).result()
        # missing or different: TensorStore says how, from whatever files the array has
        ck.hold_tree(path)
        return open_array_future(ck.read_data(), rec, context=ck.context()).result()


class _NotRead:
    """The read of a zarr.json that is not read (:meth:`Checkpoint.read_node`): missing."""

    state = "missing"
    value = b""

    def result(self) -> _NotRead:
        return self


_NOT_READ = _NotRead()
