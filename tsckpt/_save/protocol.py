"""save(): the protocol's sequence of numbered steps (see :func:`save`), and the messages
between them.

Each step's pieces live in their own modules: the descriptors ranks send rank 0 in
:mod:`.descs`, the plan in :mod:`.plan`, the exchange of straddling pieces and the writes
in :mod:`.write`, the root's claim, commit and clean-up in :mod:`.commit` (with the lease
in :mod:`.lease`).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._base.types import Local
from .._codec.route import setting as codec_setting
from .._coord.protocol import ask_root, phase, refuse
from .._coord.torchdist import coordinator_for
from .._errors import DistributedError, LayoutError
from .._leaves.kinds import checksum
from .._leaves.registry import describe, memory
from .._leaves.stateful import expand
from .._ondisk import chunking as _chunking
from .._ondisk.arrays import OCDBT_PREFIX, data_spec
from .._ondisk.records import LAYOUT_COMPACT, LAYOUT_PLAIN, ArrayRecord, ContentEntry, content_field
from .._ondisk.stepindex import mark_if_managed
from .._options import WRITE_WINDOW_BYTES, BaseDirectory, Incremental, SaveOptions, verb
from .._runtime.memory import collector_paused
from .._runtime.progress import Progress
from .._storage import durable as _durable
from .._storage import faults as _faults
from .._storage import locations as _locations
from .._storage.locations import Directory, Location, resolve
from ..tree import flatten, node_children, node_kind, structure_to_json
from . import lease as _lease
from . import share as _share

# steps 4 (claim), 7 (commit) and 8 (clean-up) of save()'s protocol, private to this module
from .commit import abandon as _abandon
from .commit import begin as _begin
from .commit import commit as _commit_root
from .commit import merge_databases
from .commit import pending_root as _pending_root
from .descs import AGREED, ChecksumRequest, Gathered, Payload, gather_descs, shared_regions, with_checksums, without
from .plan import RankPlan, plan_aliases, plan_save, split_plan
from .write import exchange as _exchange
from .write import node_files as _node_files
from .write import write_context
from .write import write_nodes as _write_nodes
from .write import write_regions as _write_regions


def _ties(local: list[Local]) -> dict[str, str]:
    """Path -> the smallest other path of this rank whose leaf is the same memory (tied weights)."""
    groups: dict[tuple[Any, ...], list[str]] = collections.defaultdict(list)
    for lf in local:
        mem = memory(lf.data) if lf.desc.kind != "value" and math.prod(lf.desc.lengths) > 0 else None
        if mem is not None:  # empty regions prove nothing
            groups[(lf.desc.kind, lf.desc.global_shape, lf.desc.offsets) + mem].append(lf.desc.path)
    return {p: min(paths) for paths in groups.values() if len(paths) > 1 for p in paths if p != min(paths)}


@verb("tsckpt.save")
def save(
    directory: Directory,
    tree: Any,
    *,
    overwrite: bool = False,
    group: Any = None,
    check_replicas: bool = True,
    timeout: datetime.timedelta | None = None,
    max_inflight_bytes: int = WRITE_WINDOW_BYTES,
    layout: str = LAYOUT_PLAIN,
    inner_chunks: bool = True,
    progress: bool | None = None,
    incremental: Incremental = True,
    base: BaseDirectory = None,
) -> None:
    """Save a pytree as a committed zarr v3 checkpoint.

    Under torch.distributed every rank of ``group`` (default: the default group)
    calls save with its local tree; leaves are DTensors, ShardedArrays, plain
    tensors (replicas when several ranks give the same path) or values.
    ``check_replicas`` compares replica contents by checksum; ``timeout`` (a
    :class:`datetime.timedelta`, default 10 minutes) bounds every wait on other
    ranks. ``overwrite=True`` replaces an existing checkpoint (never one whose
    save is still running). ``max_inflight_bytes`` bounds the source data
    handed to storage but not yet written (host memory a save needs beyond the
    state itself, e.g. when the leaves are read lazily from another file); no
    shard file is made larger than the smallest window of any rank.
    ``layout="compact"`` stores the arrays in one OCDBT database per writing
    rank, merged at the commit, so the file count does not grow with the
    number of leaves (docs/format.md, "Layouts"); every rank must pass the same.
    ``progress`` shows a bar of bytes written on rank 0 (default: when stderr is
    a terminal); each rank logs bytes, files and throughput at the end.
    ``incremental`` (plain layout on a local file system or S3) records a content hash
    of every file, and shares with ``base``, a previous committed checkpoint, by
    hard links (on S3: server-side copies), every file whose content is proven unchanged: each rank decides
    for the files it writes (docs/incremental.md). Every checkpoint stays
    complete on its own: deleting ``base`` later breaks nothing.

    Protocol (every rank calls save with its local tree; rank 0 coordinates):

    1. Describe (all ranks): each rank flattens its tree and describes each leaf
       (path, global shape, dtype, local region) and sends the descriptors, its
       tree paths, tied-leaf links, write window and layout to rank 0 only.
    2. Plan (rank 0): finds tied leaves (written once), the regions several
       ranks hold, and either
       a. when no region has several holders (or check_replicas=False), goes
          straight to step 4, or
       b. sends each rank the paths of its replicated regions to checksum.
    3. Replica checksums (all ranks, only in 2b): each rank checksums those
       regions and sends the checksums to rank 0.
    4. Rank 0 validates and plans the whole save (errors such as overlapping
       regions or differing replicas are sent to every rank, which raises the
       same error), refuses or clears an existing checkpoint (never one whose
       save is still running) and writes the root ``zarr.json`` with state
       "pending" and its claim, whose lease a thread of rank 0 renews until
       the save ends (tsckpt/_save/lease.py). It then sends each rank only its
       part of the plan: its writes, the records of the arrays it writes and
       the transfers it sends or receives.
    5. Exchange (ranks with transfers; skipped by all when there are none):
       pieces of shards that straddle irregular regions go to their writer.
    6. Write (all ranks): every rank writes its planned regions; rank 0 also
       the array and group ``zarr.json`` nodes. Each rank syncs its files.
       (Compact layout: each rank writes into its own database.)
    7. Commit (rank 0): once all ranks report success, rank 0 (compact
       layout: after merging the ranks' databases into the root one) rewrites
       the root ``zarr.json`` with state "committed" and the tree metadata: a
       single atomic object write, conditional on the pending root being still
       this save's, so readers see either no checkpoint or a complete one.
    8. Clean-up (rank 0, only after a failure once every rank knows of it;
       the lowest surviving rank when rank 0 was lost): the partial checkpoint
       is removed (the pending root first, if still this save's), so saving
       again needs no ``overwrite=True``.

    Every step ends with every rank knowing the outcome (steps 1-4 through the
    replies of rank 0, the others by exchanging a status), so a failure on one
    rank makes every rank raise and nothing is committed. Storage faults raise
    StorageError (an OSError with ``errno``, ``filename`` and ``leaf``).
    """
    options, refused = SaveOptions.checked(locals())  # a bad option raises in step 1, on every rank
    save_with(directory, tree, options, refused=refused)


def save_with(
    directory: Directory, tree: Any, options: SaveOptions, *, before_claim: Callable[[], None] | None = None,
    refused: Exception | None = None,
) -> None:
    """:func:`save` with its options gathered. ``before_claim`` (a CheckpointManager's clearing
    of its step) runs on rank 0 right before the claim (step 4), so that what it judges and
    removes is judged as late as possible, and its failure reaches every rank as any other
    failure of rank 0's planning does. ``refused``: a bad option's error (SaveOptions.checked),
    raised in step 1 on every rank, before any work, as is a bad directory or TSCKPT_CODEC."""
    overwrite, group, check_replicas, timeout = options.overwrite, options.group, options.check_replicas, options.timeout
    max_inflight_bytes, layout, progress = options.max_inflight_bytes, options.layout, options.progress
    coord = coordinator_for(group, timeout)
    try:
        if refused is not None:
            raise refused
        codec_setting()  # a bad TSCKPT_CODEC is refused before the claim
        loc = resolve(directory, write=True)
    except Exception as e:  # noqa: BLE001 - every rank raises, in step 1
        refuse(coord, "save (describe)", e, through_root=True)
    lease = _lease.Lease(loc, _pending_root(layout)) if coord.rank == 0 else None
    own: list[BaseException] = []  # this rank's own failures, re-raised by phase() once every rank knows

    def mine(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            try:
                return fn()
            except BaseException as e:
                own.append(e)
                raise

        return run

    with collector_paused():  # why: see there
        job: _Job | None = None
        try:
            job = _plan_job(
                coord, loc, tree, overwrite, check_replicas, max_inflight_bytes, layout, lease, before_claim,
                lambda: _share.check_base(options.base, loc, incremental=options.incremental),
                inner_chunks=options.inner_chunks,
            )
            received: dict[int, np.ndarray] = {}
            if job.plan.exchange:  # every rank's part says whether any rank exchanges: all skip together
                received = phase(coord, "save (exchange)", mine(lambda: _exchange(coord, job.plan, job.local))) or {}
            with Progress("save", loc, show=progress, rank=coord.rank) as bar:
                mine_files = phase(
                    coord, "save (write)", mine(lambda: _write(loc, coord.rank, job, received, layout, bar, options))
                )
                files = _gather_files(coord, mine_files, layout)
                phase(
                    coord, "save (commit)", mine(lambda: _commit(loc, coord.world_size, job, layout, lease, files)),
                    ranks={0},
                )
        except BaseException as e:
            if lease is not None and lease.generation is not None:
                agreed = coord.world_size == 1 or isinstance(e, DistributedError) or any(e is o for o in own)
                _abandon(loc, lease, e, agreed)
            elif job is not None and job.save_id and isinstance(e, DistributedError) and _cleans_for_rank_0(coord, e.lost):
                _lease.abandon_lost(loc, job.save_id, e)
            raise
        finally:
            if lease is not None:
                lease.end()


def _cleans_for_rank_0(coord: Any, lost: tuple[int, ...]) -> bool:
    """Whether this rank cleans up after a save whose rank 0 was lost: the lowest rank not lost."""
    return 0 in lost and coord.rank == min(r for r in range(coord.world_size) if r not in lost)


@dataclasses.dataclass(frozen=True)
class _Commit:
    """What rank 0 records in the committed root."""

    arrays: tuple[ArrayRecord, ...]
    values: tuple[tuple[str, Any], ...]
    leaves: list[str]
    structure: Any  # None when ranks gave different trees
    aliases: dict[str, str]
    writers: tuple[int, ...]  # ranks with data to write (the compact layout's databases)

    def metadata(self, world_size: int) -> dict[str, Any]:
        """The committed root's tsckpt metadata, beyond its state and version."""
        return {
            "structure": self.structure,
            "leaves": self.leaves,
            "arrays": [a.to_json() for a in self.arrays],
            "values": dict(self.values),
            **({"aliases": self.aliases} if self.aliases else {}),
            "world_size": world_size,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }


@dataclasses.dataclass(frozen=True)
class Part:
    """Rank 0 to one rank (step 4): its part of the plan."""

    plan: RankPlan
    window: int  # bytes of source data in flight while writing: the least of any rank's
    commit: _Commit | None = None  # rank 0 only; never sent
    save_id: str | None = None  # its claim's: a survivor removes the pending root if rank 0 is lost


@dataclasses.dataclass(frozen=True)
class _Described:
    """What rank 0 knows after step 2: every rank's payload, the tied leaves (stored once,
    under another path), and the descriptors gathered without them."""

    payloads: tuple[Payload, ...]
    aliases: dict[str, str]
    gathered: Gathered


@dataclasses.dataclass(frozen=True)
class _Job:
    """This rank's leaves and its part of the plan."""

    plan: RankPlan
    local: dict[str, Local]  # this rank's leaves, by path
    window: int
    commit: _Commit | None
    save_id: str | None = None  # the save's claim (Part.save_id)


class Staged:
    """A tree given already flattened: its leaf paths, leaves and structure (JSON), as
    save_async's writer process receives it from the process that staged it, whose tree's
    node types (dataclasses, registered classes) need not exist in the writer."""

    __slots__ = ("paths", "leaves", "structure")

    def __init__(self, paths: list[str], leaves: list[Any], structure: Any) -> None:
        self.paths = paths
        self.leaves = leaves
        self.structure = structure


def _describe(
    tree: Any, window: int, layout: str, target: str = "", inner_chunks: bool = True, *, overwrite: bool = False,
    check_replicas: bool = True,
) -> tuple[dict[str, Local], Payload]:
    """Step 1, every rank: this rank's leaves by path, and what rank 0 needs of them."""
    if isinstance(tree, Staged):
        paths, leaves, structure = tree.paths, tree.leaves, tree.structure
    else:
        flat = flatten(tree)
        paths, leaves, structure = flat.paths, flat.leaves, structure_to_json(flat.spec)
    local = [describe(p, leaf) for p, leaf in zip(paths, leaves)]
    descs = [lf.desc for lf in local]
    payload = Payload.of(
        descs, paths, structure, _ties(local), window, layout, target, inner_chunks, overwrite=overwrite,
        check_replicas=check_replicas,
    )
    return {lf.desc.path: lf for lf in local}, payload


def _gather(payloads: Sequence[Payload]) -> _Described:
    """Step 2, rank 0: every rank's descriptors grouped by path, without the tied leaves.
    Ranks saving different checkpoints (a loop whose ranks fell out of step: one's save of a
    step failed in its call, or was refused as busy, and the next was paired with it) are
    refused first: planned together, each checkpoint would miss the other ranks' regions."""
    targets = [p.target for p in payloads]
    if len(set(targets)) > 1:
        odd = [r for r, t in enumerate(targets) if t != targets[0]]
        raise LayoutError(
            f"the ranks are saving different checkpoints: rank 0 saves {targets[0]}, rank {odd[0]} saves "
            f"{targets[odd[0]]}{f' (and {len(odd) - 1} other ranks)' if len(odd) > 1 else ''}; every rank "
            "must save the same checkpoint in the same call: the ranks fell out of step (a save that failed or "
            "was refused on some ranks only): save again on every rank, or restart from the last complete step"
        )
    for name in AGREED:
        values = [getattr(p, name) for p in payloads]
        other = next((r for r, v in enumerate(values) if v != values[0]), None)
        if other is not None:
            raise LayoutError(
                f"ranks passed different {name} options (rank 0 {values[0]!r}, rank {other} {values[other]!r}); "
                "every rank must save with the same"
            )
    _check_nesting(payloads)
    per_rank = [p.descs for p in payloads]
    aliases = plan_aliases(per_rank, [p.links for p in payloads])
    return _Described(tuple(payloads), aliases, without(gather_descs(per_rank), aliases))


def _check_nesting(payloads: Sequence[Payload]) -> None:
    """Ranks whose trees differ (per-rank state) save the union of their trees: refused where
    they disagree on what a path is, which no tree could restore (the step would be listed,
    and unreadable or another tree): a leaf on one rank and holds leaves on another (a tensor
    against a list of them), containers of other kinds (a list against a dict, a tuple against
    a list), or a leaf, ``None`` or an empty container against another of those."""
    if all(p.paths == payloads[0].paths and p.structure == payloads[0].structure for p in payloads):
        return
    union = {q for p in payloads for q in p.paths}
    for q in union:
        parts = q.split("/")
        for k in range(1, len(parts)):
            above = "/".join(parts[:k])
            if above in union:
                leaf = [r for r, p in enumerate(payloads) if above in p.paths]
                inner = [r for r, p in enumerate(payloads) if q in p.paths]
                raise LayoutError(
                    f"'{above}' is a leaf on rank(s) {leaf} but holds leaves on rank(s) {inner} ('{q}'): the ranks "
                    "give different trees at that path (e.g. a tensor on one, a list or dict of them on another); "
                    "give it the same kind of node on every rank, or distinct names per rank"
                )
    kinds: dict[str, tuple[str, int]] = {}  # path -> (what it is, the first rank where it is that)
    first: dict[str, Any] = {}  # path -> the subtree first walked there
    seen: set[str] = set()
    for r, p in enumerate(payloads):
        if p.structure not in seen:  # ranks of one structure (most): walked once
            seen.add(p.structure)
            _walk_kinds(json.loads(p.structure), "", r, kinds, first)


def _walk_kinds(
    node: Any, path: str, rank: int, kinds: dict[str, tuple[str, int]], first: dict[str, Any]
) -> None:
    """Record what each path of rank ``rank``'s tree structure is in ``kinds``, refusing one a
    rank before made another thing (:func:`_check_nesting`). A subtree equal to the one first
    walked at its path (compared in C: the model's part of per-rank trees) is not walked again:
    at 1,024 ranks of per-rank state, a walk of every rank's tree took longer than planning."""
    if path in first and first[path] == node:
        return
    first.setdefault(path, node)
    if not isinstance(node, dict):
        kind = "leaf"
    else:
        kind = _MAPPINGS.get(node_kind(node), node_kind(node))
        for name, child in node_children(node):
            _walk_kinds(child, f"{path}/{name}" if path else name, rank, kinds, first)
    was = kinds.setdefault(path, (kind, rank))
    if was[0] != kind:
        where = f"'{path}'" if path else "the tree's root"
        raise LayoutError(
            f"{where} is {_shown(was[0])} on rank {was[1]} but {_shown(kind)} on rank {rank}: the ranks give "
            "different trees at that path, which no tree restores; give it the same kind of node on every rank, or "
            "distinct names per rank"
        )


# Kinds of node that ranks may give alike at one path: mappings (a stage's state_dict(), an
# OrderedDict, against a dict filtered from it) join into one.
_MAPPINGS = {"ordereddict": "dict"}


def _shown(kind: str) -> str:
    """A node's kind (:func:`tsckpt.tree.node_kind`, or "leaf") as a message says it."""
    return "None" if kind == "none" else f"a {kind}"


def _parts(d: _Described) -> list[Part]:
    """Step 4, rank 0: plan the save and split it into every rank's part (rank 0's with
    what it records at the commit)."""
    least = min(p.window for p in d.payloads)
    plan = plan_save(d.gathered, shard_bytes=min(_chunking.SHARD_BYTES, least), inner=d.payloads[0].inner_chunks)
    paths, structure = d.payloads[0].paths, d.payloads[0].structure
    same_tree = all(p.paths == paths and p.structure == structure for p in d.payloads)
    parts = split_plan(plan)
    commit = _Commit(
        plan.arrays, plan.values, list(paths) if same_tree else sorted({q for p in d.payloads for q in p.paths}),
        json.loads(structure) if same_tree else None, d.aliases,
        tuple(r for r, part in enumerate(parts) if part.writes_anything),
    )
    return [Part(part, least, commit if r == 0 else None) for r, part in enumerate(parts)]


def _plan_job(
    coord: Any, loc: Location, tree: Any, overwrite: bool, check_replicas: bool, window: int, layout: str,
    lease: _lease.Lease | None = None, before_claim: Callable[[], None] | None = None,
    check: Callable[[], None] | None = None, *, inner_chunks: bool = True,
) -> _Job:
    """Steps 1-4 of the protocol: one round trip through rank 0, two when replicas are checked.
    ``check`` runs on every rank first (a bad base is refused there, before the claim)."""
    described: _Described | None = None  # rank 0, between the two round trips

    def first(payloads: list[Payload]) -> list[ChecksumRequest] | list[Part]:
        nonlocal described
        described = _gather(payloads)
        shared = shared_regions(described.gathered) if check_replicas and coord.world_size > 1 else []
        if any(shared):  # step 2b
            return [ChecksumRequest(tuple(paths)) for paths in shared]
        return finish(described)

    def second(sums: list[dict[str, int]]) -> list[Part]:
        if described is None:
            raise RuntimeError("replica checksums arrived before the descriptors")
        return finish(dataclasses.replace(described, gathered=with_checksums(described.gathered, sums)))

    def finish(d: _Described) -> list[Part]:
        parts = _parts(d)
        if before_claim is not None:
            before_claim()
        mark_if_managed(loc)  # a manager's step on an object store: listed before anything is written
        _begin(loc, overwrite, layout, lease)
        return [dataclasses.replace(p, save_id=lease.save_id) for p in parts] if lease is not None else parts

    def describe_mine() -> tuple[dict[str, Local], Payload]:
        if check is not None:
            check()
        return _describe(
            tree if isinstance(tree, Staged) else expand(tree, rank=coord.rank).tree, window, layout, str(loc),
            inner_chunks, overwrite=overwrite, check_replicas=check_replicas,
        )

    local, reply = ask_root(coord, "save (describe)", describe_mine, first)
    if isinstance(reply, ChecksumRequest):  # step 3
        asked = reply.paths

        def sums() -> tuple[None, dict[str, int]]:
            return None, {p: checksum(local[p].data) for p in asked}

        _, reply = ask_root(coord, "save (replica checksums)", sums, second)
    return _Job(reply.plan, local, reply.window, reply.commit, reply.save_id)


def _write(
    loc: Location, rank: int, job: _Job, received: dict[int, np.ndarray], layout: str, progress: Progress,
    options: SaveOptions,
) -> Recorded | None:
    """Write this rank's regions (rank 0 also the zarr.json nodes), then sync them to storage.
    An incremental save (plain layout, on a local file system or S3) shares what it can with
    its base, and returns its files' content entries and ETags (None when it records none)."""
    compact = layout == LAYOUT_COMPACT
    data = _write_spec(loc, layout, writer=rank)
    context = write_context()  # this save's own: see there
    with _faults.storage_errors(loc, doing="writing"):
        sharer = _share.sharer_for(loc, layout, options.incremental, options.base)
        made: set[str] = set()  # directories made for the own codec's files, by both steps
        nodes = {} if job.commit is None else _node_files(job.commit.arrays)  # rank 0's
        node_keys = list(nodes)
        try:
            keys = _write_regions(
                data, job.plan, job.local, received, job.window, compact=compact, progress=progress, made=made,
                context=context, sharer=sharer, nodes=nodes,
            )
        finally:
            if sharer is not None:
                sharer.close()
        _write_nodes(data, nodes, compact=compact, made=made, context=context)  # those the regions' writes left
        keys += node_keys
        if compact:
            _durable.sync_paths(loc, [f"{OCDBT_PREFIX}{rank}"])
        else:
            shared = set() if sharer is None else set(sharer.shared)
            _durable.sync_data(loc, [k for k in keys if k not in shared], linked=shared)
        return None if sharer is None else (sharer.recorded(), sharer.etags, sharer.chunks)


# A rank's content entries, its objects' ETags (object stores; else empty) and its shard
# files' inner chunks' hashes.
Recorded = tuple[dict[str, ContentEntry], dict[str, str], dict[str, tuple[str, ...]]]


def _gather_files(coord: Any, mine: Recorded | None, layout: str) -> Recorded | None:
    """Every rank's content entries and ETags, on rank 0 (one round trip, plain layout under
    torch.distributed: every rank takes it, whatever it recorded); None when no rank recorded any."""
    if coord.world_size == 1 or layout != LAYOUT_PLAIN:
        return mine
    everyone: list[Any] = []

    def collect(payloads: list[Any]) -> list[None]:
        everyone.extend(payloads)
        return [None] * len(payloads)

    ask_root(coord, "save (content hashes)", lambda: (None, mine), collect)
    recorded = [p for p in everyone if p is not None]
    if not recorded:
        return None
    return (
        {k: v for p in recorded for k, v in p[0].items()}, {k: v for p in recorded for k, v in p[1].items()},
        {k: v for p in recorded for k, v in p[2].items()},
    )


def _write_spec(loc: Location, layout: str, writer: int | None = None) -> dict[str, Any]:
    """:func:`data_spec` for writing: a compact database through the cache pool that keeps
    nothing between saves (see _locations.CONTEXT)."""
    spec = data_spec(loc, layout, writer=writer)
    return {**spec, "cache_pool": _locations.WRITE_CACHE_POOL} if layout == LAYOUT_COMPACT else spec


def _commit(
    loc: Location, world_size: int, job: _Job, layout: str, lease: _lease.Lease | None = None,
    files: Recorded | None = None,
) -> None:
    """Step 7, rank 0: merge the ranks' databases (compact layout), then the one atomic
    write that makes the checkpoint visible, if the pending root is still this save's
    (``lease``: its renewals stop first). ``files``: the content entries recorded, if any."""
    c = job.commit
    if c is None:
        raise RuntimeError("only rank 0 commits a save")
    if layout == LAYOUT_COMPACT:
        databases = [_write_spec(loc, layout, writer=rank) for rank in sorted({0, *c.writers})]
        with _faults.storage_errors(loc):
            merge_databases(loc, _write_spec(loc, layout), databases, write_context())
    meta = c.metadata(world_size)
    if files is not None:
        meta["content"] = content_field(*files)
    _commit_root(loc, meta, layout, lease)
