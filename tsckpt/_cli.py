"""The ``tsckpt`` command: ls, show, verify, diff and convert checkpoints.

Exit status: 0 success, 1 a problem with the data (a corrupt, incomplete or
missing checkpoint, a failed verification, a dtype a format cannot hold), 2 a
usage error (bad arguments, a path that is not a leaf, a malformed slice).
``diff`` answers as cmp and diff do: 0 equal, 1 different, 2 any error.
Every error prints one line on stderr, never a traceback (one tsckpt did not expect
says it is a bug in tsckpt).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._base import dtypes as _dtypes
from ._base.casting import CASTINGS
from ._base.leafnames import did_you_mean, listed, spelled, under
from ._convert import TARGETS, parse_size
from ._errors import CheckpointExistsError, TsckptError
from ._formats.dcp import PICKLE_WARNING
from ._formats.sources import FORMATS, open_checkpoint
from ._manager import StepListing, list_steps
from ._ondisk.records import LAYOUT_PLAIN, LAYOUTS
from ._options import READ_WINDOW_BYTES
from ._read.mapped import mapped_checkpoint
from ._read.open import open as open_reader
from ._read.reader import LazyArray, normalize_index
from ._runtime.progress import human_bytes
from ._version import __version__
from .mappings import load as load_rules

if TYPE_CHECKING:
    import torch
else:
    from ._base.lazytorch import torch

if TYPE_CHECKING:
    from ._read.diff import LeafDiff
    from ._read.verify import VerifyReport

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2

# `show` refuses to read more than this without a slice (numpy would only print the corners).
SHOW_MAX_BYTES = 256 << 20


class UsageError(Exception):
    """Bad arguments: exit status 2."""


class Problem(Exception):
    """A data problem found by the command itself: exit status 1."""


# ---- small helpers -----------------------------------------------------------


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _short(value: Any, width: int = 60) -> str:
    return _clip(repr(value), width)


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def resolve_leaf(leaves: Sequence[str], name: str) -> str:
    """The leaf ``name`` names: itself when it is a leaf path; else the one leaf equal to it
    with ``/`` and ``.`` alike, or else the one leaf below it. Several: a usage error listing
    them. None: ``name`` as given, for the reader to say it is missing."""
    if name in leaves:
        return name
    same = [p for p in leaves if spelled(p) == spelled(name)]
    if len(same) > 1:
        raise UsageError(f"'{name}' may name {len(same)} leaves ({listed(same)}); give the path of one as ls writes it")
    below = same or [p for p in leaves if under(p, name)]
    if len(below) > 1:
        raise UsageError(
            f"'{name}' is not a leaf; {len(below)} leaves below it ({listed(below)}); give the full path of one"
        )
    return below[0] if below else name


# ---- slice text --------------------------------------------------------------

_INT = re.compile(r"[+-]?[0-9]+")


def _int(text: str, whole: str) -> int:
    text = text.strip()
    if not _INT.fullmatch(text):
        raise UsageError(f"bad index {text!r} in {whole!r}: expected an integer, a slice like 2:8 or 1:-1:2, or ...")
    return int(text)


def parse_target(text: str) -> tuple[str, tuple[Any, ...] | None, str]:
    """``'model/w[5:9, :3]'`` -> (``'model/w'``, ``(slice(5, 9), slice(None, 3))``, ``'[5:9, :3]'``).

    Only integers, ``start:stop:step`` slices and ``...`` are accepted; the text
    is parsed by hand, never evaluated. Leaf paths cannot contain ``[`` (it is
    escaped as ``%5B``), so the first ``[`` starts the index.
    """
    text = text.strip()
    if "[" not in text:
        if "]" in text:
            raise UsageError(f"unbalanced ']' in {text!r}")
        return text, None, ""
    path, _, rest = text.partition("[")
    if not rest.endswith("]") or "[" in rest[:-1] or "]" in rest[:-1]:
        raise UsageError(f"bad index in {text!r}: write PATH[i, a:b, ...] with one pair of brackets at the end")
    body = rest[:-1].strip()
    if not body:
        raise UsageError(f"empty index in {text!r}; leave the brackets off to show the whole array")
    items = [p.strip() for p in body.split(",")]
    if items[-1] == "" and len(items) > 1:  # numpy allows a trailing comma: w[0,]
        items.pop()
    index: list[Any] = []
    for item in items:
        if item == "...":
            index.append(Ellipsis)
        elif ":" in item:
            parts = item.split(":")
            if len(parts) > 3:
                raise UsageError(f"bad slice {item!r} in {text!r}: at most start:stop:step")
            nums = [None if p.strip() == "" else _int(p, text) for p in parts]
            index.append(slice(*nums))
        elif item == "":
            raise UsageError(f"empty index position in {text!r}")
        else:
            index.append(_int(item, text))
    return path.strip(), tuple(index), "[" + ", ".join(_index_text(i) for i in index) + "]"


def _index_text(i: Any) -> str:
    if i is Ellipsis:
        return "..."
    if isinstance(i, slice):
        parts = ["" if v is None else str(v) for v in (i.start, i.stop)]
        if i.step is not None:
            parts.append(str(i.step))
        return ":".join(parts)
    return str(i)


# ---- printable numpy arrays ---------------------------------------------------

_INT_LIKE_ML = {"int4": np.int8, "uint4": np.uint8, "int2": np.int8, "uint2": np.uint8}


def printable(arr: LazyArray, index: tuple[Any, ...]) -> tuple[np.ndarray, str]:
    """Read ``arr[index]`` as an array numpy can print, and a note on any conversion."""
    dtype = arr.dtype
    if dtype == "complex32":
        with warnings.catch_warnings():  # "ComplexHalf support is experimental"
            warnings.simplefilter("ignore", UserWarning)
            return arr.torch[index].to(torch.complex64).numpy(), "printed as complex64"
    data = np.asarray(arr[index])
    if data.dtype.type.__module__.startswith("ml_dtypes"):
        target = _INT_LIKE_ML.get(dtype, np.float32)
        return data.astype(target), f"printed as {np.dtype(target).name}"
    if _dtypes.storage_dtype(dtype) != dtype:  # raw-bit dtypes (bits8, float4_e2m1fn_x2, ...)
        return data, f"raw bits, printed as {data.dtype.name}"
    return data, ""


# ---- commands ----------------------------------------------------------------


def _manager_steps(args: argparse.Namespace) -> list[StepListing] | None:
    """The steps under DIR when it is a CheckpointManager's root rather than one checkpoint."""
    if args.from_format not in (None, "tsckpt"):
        return None
    return list_steps(args.dir)


def _step_path(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}"


def _not_one_checkpoint(args: argparse.Namespace, steps: list[StepListing], *rest: str | None) -> UsageError:
    """A command that reads one checkpoint was given a manager's root: name a step to give instead."""
    complete = [s for s in steps if s.state == "complete"]
    if not complete:
        return UsageError(
            f"{args.dir} is a CheckpointManager root with no complete step yet, not one checkpoint; "
            f"`tsckpt ls {shlex.quote(args.dir)}` lists its step directories"
        )
    example = " ".join(shlex.quote(a) for a in (_step_path(args.dir, complete[-1].name), *rest) if a)
    return UsageError(
        f"{args.dir} is a CheckpointManager root ({_count(len(complete), 'complete step')}, the latest "
        f"{complete[-1].step}), not one checkpoint; give a step's directory, e.g. tsckpt {args.command} {example}"
    )


def _ls_steps(args: argparse.Namespace, steps: list[StepListing]) -> int:
    """`tsckpt ls` of a manager's root: its step directories and their states (it writes nothing)."""
    rows = [["DIRECTORY", "STEP", "STATE", "LEAVES", "SIZE", "NOTE"]]
    for s in steps:
        leaves = size = ""
        note = s.note
        if s.state == "complete":
            try:
                ck = open_checkpoint(s.directory)
                leaves = str(len(ck.leaves))
                size = human_bytes(sum(ck.array_metadata(p).nbytes for p in ck.arrays))
            except TsckptError as e:
                leaves, note = "?", _one_line(e)
        rows.append([s.name, str(s.step), s.state, leaves, size, note])
    for line in _table(rows):
        print(line)
    counts: dict[str, int] = {"complete": 0}
    for s in steps:
        counts[s.state] = counts.get(s.state, 0) + 1
    complete = [s for s in steps if s.state == "complete"]
    latest = f" (latest: tsckpt ls {shlex.quote(_step_path(args.dir, complete[-1].name))})" if complete else ""
    states = ", ".join(f"{n} {state}" + (latest if state == "complete" else "") for state, n in counts.items())
    print(f"{args.dir}: a CheckpointManager root, {_count(len(steps), 'step directory', 'step directories')}: {states}")
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    steps = _manager_steps(args)
    if steps is not None:
        if args.prefix:
            raise _not_one_checkpoint(args, steps, args.prefix)
        return _ls_steps(args, steps)
    ck = open_checkpoint(args.dir, **_opened(args))
    mapped = None
    if args.map is not None:
        try:
            rules = load_rules(args.map)
        except ValueError as e:
            raise UsageError(str(e)) from e
        mapped = mapped_checkpoint(ck, rules)
        ck = mapped.view
    paths = [p for p in ck.leaves if under(p, args.prefix)]
    if args.prefix and not paths:
        raise UsageError(
            f"no leaf at or below '{args.prefix}' in {ck.location}; "
            + did_you_mean(args.prefix, list(ck.leaves), args.dir, prefixes=True)
        )
    header = ["PATH", "DTYPE", "SHAPE", "SIZE"] + (["CHUNK", "SHARD"] if args.long else []) + ["VALUE"]
    header += [] if mapped is None else ["FROM"]
    rows = [header]
    total = 0
    n_arrays = 0
    for p in paths:
        if ck.is_array(p):
            md = ck.array_metadata(p)
            stored = ck.aliases.get(p)
            if stored is None:  # a tied leaf's bytes are stored (and counted) once
                total += md.nbytes
            n_arrays += 1
            row = [p, md.dtype, _shape_text(md.shape), human_bytes(md.nbytes)]
            if args.long:
                row += [_shape_text(md.chunk_shape), _shape_text(md.shard_shape)]
            row += ["" if stored is None else f"(tied: stored as {stored})"]
        else:
            v = ck.values[p]
            row = [p, type(v).__name__, "", ""] + (["", ""] if args.long else []) + [_short(v)]
        rows.append(row + ([] if mapped is None else [mapped.leaves[p].origin()]))
    for line in _table(rows):
        print(line)
    print(
        f"total {_count(len(paths), 'leaf', 'leaves')}: {_count(n_arrays, 'array')} ({human_bytes(total)}), "
        f"{_count(len(paths) - n_arrays, 'value')}"
    )
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    name, index, index_text = parse_target(args.target)
    steps = _manager_steps(args)
    if steps is not None:
        raise _not_one_checkpoint(args, steps, args.target)
    reader = open_reader(args.dir, **_opened(args))
    path = resolve_leaf(list(reader), name)
    try:
        leaf = reader[path]
    except KeyError:
        where = reader.checkpoint.location
        raise UsageError(f"'{path}' is not a leaf of {where}; {did_you_mean(path, list(reader), args.dir)}") from None
    if not isinstance(leaf, LazyArray):
        if index is not None:
            raise UsageError(f"'{path}' is a plain {type(leaf).__name__} value, not an array; it cannot be indexed")
        print(leaf if isinstance(leaf, str) else repr(leaf))
        return EXIT_OK
    try:
        box, _ = normalize_index(index if index is not None else (), leaf.shape)
    except (IndexError, TypeError, ValueError) as e:
        raise UsageError(f"{args.target}: {e} (array shape {_shape_text(leaf.shape)})") from None
    nbytes = math.prod(s.stop - s.start for s in box) * _dtypes.itemsize(leaf.dtype)
    if nbytes > SHOW_MAX_BYTES:
        raise UsageError(
            f"'{path}'{index_text} selects {human_bytes(nbytes)}, more than show reads "
            f"({human_bytes(SHOW_MAX_BYTES)}); give a smaller slice, e.g. '{path}[:4]'"
        )
    try:
        data, note = printable(leaf, index if index is not None else ())
    except (IndexError, ValueError) as e:
        if isinstance(e, TsckptError):
            raise
        raise UsageError(f"{args.target}: {e}") from None
    shown = (path or "%root") + index_text
    print(f"{shown}: {leaf.dtype} {_shape_text(data.shape)}" + (f" ({note})" if note else ""))
    threshold = sys.maxsize if args.full else 1000
    with np.printoptions(threshold=threshold):
        print(data)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from ._read.verify import verify

    steps = _manager_steps(args)
    if steps is not None:
        raise _not_one_checkpoint(args, steps)
    report = verify(args.dir, progress=False if args.verbose else None, **_opened(args))
    if args.verbose:
        for p in report.leaves:
            if p not in report.bad:
                print(f"ok    {p}")
    for p, why in report.bad.items():
        print(f"FAIL  {p}: {why}")
    for problem in report.group_problems:
        print(f"FAIL  {problem}")
    if report.tree_problem is not None:
        print(f"FAIL  {report.tree_problem}")
    if not report.ok:
        unread = [p for p in report.bad if p in report.unread]
        arrays = [p for p in report.bad if p in report.arrays and p not in report.unread]
        others = [p for p in report.bad if p not in report.arrays and p not in report.unread]
        parts = (
            [f"{len(arrays)} of {report.n_arrays} arrays bad ({listed(arrays)})"] if arrays or not (others or unread)
            else []
        )
        if others:
            parts.append(f"{_count(len(others), 'other leaf', 'other leaves')} bad ({listed(others)})")
        if unread:
            parts.append(
                f"{len(unread)} not read, as their files include a symbolic link (never followed) or a special "
                f"file ({listed(unread)})"
            )
        if report.group_problems:
            parts.append(f"{len(report.group_problems)} group node(s) bad")
        if report.tree_problem is not None:
            parts.append("the tree structure is invalid")
        raise Problem(f"verification failed for {report.location}: " + ", ".join(parts))
    print(f"OK: {report.location}: {_verified(report)}")
    return EXIT_OK


def _verified(report: VerifyReport) -> str:
    """What a passing verify checked, as the format allowed: checksums are claimed only where
    the format stores them."""
    leaves = f"all {_count(len(report.leaves), 'leaf', 'leaves')} present"
    arrays, values = _count(report.n_arrays, "array"), _count(report.n_values, "value")
    if report.checksums:
        return (
            f"committed, {leaves}; {arrays} ({human_bytes(report.bytes_read)} read from "
            f"{_count(report.files_read, 'stored shard')}, all checksums match), {values}"
        )
    return (
        f"{report.format} checkpoint, committed, {leaves}; {arrays} read ({human_bytes(report.bytes_read)} in "
        f"{_count(report.files_read, 'chunk read', 'chunk reads')}), no checksums in this format: damage that still "
        f"decodes is not detected; {values}"
    )


# ---- diff --------------------------------------------------------------------


def cmd_diff(args: argparse.Namespace) -> int:
    from ._read.diff import diff

    try:
        window = parse_size(args.max_inflight_bytes, "--max-inflight-bytes")
        given: dict[str, Any] = {} if window is None else {"max_inflight_bytes": window}
        report = diff(
            args.a, args.b, atol=args.atol, rtol=args.rtol, paths=args.paths, allow_pickle=args.allow_pickle,
            progress=False if args.json else None, **given,
        )
    except (ValueError, TypeError) as e:
        if isinstance(e, TsckptError):
            raise
        raise UsageError(e.args[0] if e.args else str(e)) from None
    if args.json:
        print(report.to_json())
        return EXIT_OK if report.equal else EXIT_PROBLEM
    for leaf in report.differences:
        print(_diff_line(leaf))
    tolerance = f" within atol={args.atol:g}, rtol={args.rtol:g}" if args.atol or args.rtol else ""
    n = _count(len(report.leaves), "leaf", "leaves")
    read = f"{human_bytes(report.bytes_read)} read, {human_bytes(report.bytes_known_equal)} known equal unread"
    if report.equal:
        print(f"equal{tolerance}: {report.a} and {report.b}, {n} ({read})")
        return EXIT_OK
    print(f"different: {len(report.differences)} of {n} differ{tolerance} ({read})")
    return EXIT_PROBLEM


def _diff_line(leaf: LeafDiff) -> str:
    """One line for a leaf that differs."""
    def kind(dtype: str | None, shape: tuple[int, ...] | None) -> str:
        return f"{dtype}" + ("" if shape is None else " " + _shape_text(shape))

    path = leaf.path if leaf.path_b is None else f"{leaf.path} (B: {leaf.path_b})"
    if leaf.status == "only_in_a":  # an empty part of the tree (None, {}) shows as what it is
        return f"only in A  {path}  {leaf.value_a if leaf.dtype_a is None else kind(leaf.dtype_a, leaf.shape_a)}"
    if leaf.status == "only_in_b":
        return f"only in B  {path}  {leaf.value_b if leaf.dtype_b is None else kind(leaf.dtype_b, leaf.shape_b)}"
    if leaf.how == "structure":
        return f"container  {path}  {leaf.value_a} -> {leaf.value_b}"
    if leaf.status in ("dtype_changed", "shape_changed"):
        what = "dtype" if leaf.status == "dtype_changed" else "shape"
        return f"{what:<9}  {path}  {kind(leaf.dtype_a, leaf.shape_a)} -> {kind(leaf.dtype_b, leaf.shape_b)}"
    if leaf.how == "value":
        return f"value      {path}  {_clip(leaf.value_a or '')} -> {_clip(leaf.value_b or '')}"
    first = "" if leaf.first_index is None else _shape_text(leaf.first_index)
    largest = str(leaf.max_abs) if isinstance(leaf.max_abs, int) else f"{leaf.max_abs:.6g}"  # integers: exact
    if leaf.rel_l2 is None:
        relative = "rel L2 not known (A's part read is zero, the rest left unread)"
    else:
        relative = f"rel L2 {'<= ' if leaf.rel_l2_bound else ''}{leaf.rel_l2:.3g}"
    return (
        f"changed    {path}  {leaf.changed_chunks} of {_count(leaf.chunks, 'chunk')}, "
        f"{_count(leaf.changed_elements, 'element')}; max |a-b| {largest}, {relative}, "
        f"first at {first}"
    )


# ---- convert -----------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
    from ._convert import convert

    try:
        window = parse_size(args.max_inflight_bytes, "--max-inflight-bytes")
        given: dict[str, Any] = {} if window is None else {"max_inflight_bytes": window}  # else convert's default
        if args.map is not None:
            given["mapping"] = load_rules(args.map)
        report = convert(
            args.src, args.dst, from_format=args.from_format, to_format=args.to_format, subtree=args.subtree,
            strip_prefix=args.strip_prefix, add_prefix=args.add_prefix, max_shard_size=args.max_shard_size,
            dtype=args.dtype, overwrite=args.overwrite, layout=args.layout, inner_chunks=not args.no_inner_chunks,
            casting=args.casting,
            copy_from=args.copy_from, allow_pickle=args.allow_pickle, **given,
        )
    except CheckpointExistsError:
        raise Problem(f"{args.dst} already exists; pass --overwrite to replace it") from None
    except (ValueError, KeyError) as e:
        if isinstance(e, TsckptError):
            raise
        raise UsageError(e.args[0] if e.args else str(e)) from None
    tied = f", {_count(report.n_tied, 'tied leaf', 'tied leaves')}" if report.n_tied else ""
    files = f" in {_count(len(report.files), 'file')}" if len(report.files) > 1 else ""
    print(
        f"converted {report.src} ({report.src_format}) -> {report.dst} ({report.dst_format}): "
        f"{_count(report.n_arrays, 'array')} ({human_bytes(report.nbytes)}){files}, "
        f"{_count(report.n_values, 'value')}{tied}"
    )
    return EXIT_OK


# ---- entry point -------------------------------------------------------------


def _source_options(p: argparse.ArgumentParser) -> None:
    """The options ls, show and verify share with restore: which format DIR holds, and whether
    a pickled one may be read."""
    p.add_argument("--from", dest="from_format", choices=FORMATS,
                   help="the checkpoint's format (default: detected, as convert detects it)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read a checkpoint whose metadata is a Python pickle (a torch.distributed.checkpoint "
                   "directory); unpickling can run arbitrary code: only for a checkpoint from a trusted source")


def _opened(args: argparse.Namespace) -> dict[str, Any]:
    """The read options of ls, show and verify, as the library's read verbs take them."""
    return {"format": args.from_format, "allow_pickle": args.allow_pickle}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tsckpt",
        description="Inspect, verify, compare and convert tsckpt checkpoints (zarr v3 directories).",
        epilog="Exit status: 0 ok, 1 data problem (corrupt, incomplete, unreadable), 2 usage error; "
        "diff: 0 equal, 1 different, 2 error.",
    )
    parser.add_argument("--version", action="version", version=f"tsckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("ls", help="list leaves: path, dtype, shape, size, and plain values")
    p.add_argument("dir", metavar="DIR", help="checkpoint directory (or kvstore URL), or another format's file or directory")
    p.add_argument("prefix", metavar="PREFIX", nargs="?",
                   help="only leaves at or below this path; '/' and '.' both separate its parts (model.layers.0)")
    p.add_argument("-l", "--long", action="store_true", help="also show chunk and shard shapes")
    p.add_argument("--map", metavar="RULES",
                   help="list the leaves a mapping would make (as restore(..., mapping=) reads them), each with "
                   "the stored leaves and views it comes from: flax-to-torch, torch-to-flax, or a JSON file of rules")
    _source_options(p)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "show",
        help="print an array (or a slice of it) or a value",
        description="Print one leaf. PATH may end in a numpy-style index such as 'model/w[5:9, :3]', "
        "'w[-1]' or 'w[..., 0]'; only the chunks it touches are read. Quote it for the shell.",
    )
    p.add_argument("dir", metavar="DIR", help="checkpoint directory (or kvstore URL), or another format's file or directory")
    p.add_argument("target", metavar="PATH[INDEX]",
                   help="leaf path ('/' or '.' between its parts, or a prefix of one leaf), optionally followed by an index")
    p.add_argument("--full", action="store_true", help="print every element instead of a summary")
    _source_options(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser(
        "verify",
        help="read every chunk, check every checksum (where the format has them) and node; exit 1 naming each bad "
        "leaf",
    )
    p.add_argument("dir", metavar="DIR", help="checkpoint directory (or kvstore URL), or another format's file or directory")
    p.add_argument("-v", "--verbose", action="store_true", help="also list the leaves that are fine")
    _source_options(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "diff",
        help="compare two checkpoints leaf by leaf (any formats); exit 0 equal, 1 different, 2 error",
        description="Compare A and B, checkpoints of any formats tsckpt reads, leaf by leaf: leaves only in one, "
        "a changed dtype or shape, and for arrays that differ the changed chunks (of A's stored chunk grid), "
        "the largest |a-b|, the relative L2 difference ||a-b||/||a|| and the first differing index. Elements are "
        "equal when |a-b| <= atol + rtol*|b|; NaNs at the same index are equal. Data is read block by block "
        "within --max-inflight-bytes; regions both sides keep in the same file (a hard link) are not read.",
    )
    p.add_argument("a", metavar="A", help="checkpoint directory (or kvstore URL), or another format's file or directory")
    p.add_argument("b", metavar="B", help="the checkpoint to compare A with, of any format")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default: 0, exact)")
    p.add_argument("--rtol", type=float, default=0.0, help="tolerance relative to |b| (default: 0, exact)")
    p.add_argument("--paths", metavar="GLOB", nargs="+",
                   help="compare only the leaves at or below a match of one of these paths or glob patterns, '/' "
                   "and '.' alike between their parts, as ls takes them (e.g. 'model/*', 'model.layers.0'); quote "
                   "them; one that selects no leaf of A or B is an error (exit 2)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (non-finite numbers as strings)")
    p.add_argument("--max-inflight-bytes", metavar="SIZE",
                   help=f"reads and work in memory at once, e.g. 64MiB (default: {human_bytes(READ_WINDOW_BYTES)})")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read a checkpoint whose metadata is a Python pickle (a torch.distributed.checkpoint "
                   "directory); unpickling can run arbitrary code: only for a checkpoint from a trusted source")
    p.set_defaults(func=cmd_diff, failed=EXIT_USAGE)

    p = sub.add_parser(
        "convert",
        help="write a checkpoint of any format as tsckpt or safetensors (reads tsckpt, safetensors, torch.save, "
        "DCP and Orbax)",
        description="Stream SRC into DST, reading and writing piece by piece (memory stays bounded). SRC is "
        "detected: a tsckpt checkpoint, a .safetensors file or Hugging Face directory (model.safetensors, or "
        "shards and model.safetensors.index.json), a torch.save file or a Hugging Face directory of them "
        "(pytorch_model.bin, or shards and pytorch_model.bin.index.json; loaded with weights_only=True), a "
        "torch.distributed.checkpoint directory, or an Orbax checkpoint. DST is a tsckpt checkpoint (the "
        "default) or safetensors: a .safetensors file, or (--to safetensors) a Hugging Face directory, sharded "
        "at --max-shard-size; convert writes no torch.save, DCP or Orbax checkpoint. Tied leaves stay tied "
        "(stored once). Warning: " + PICKLE_WARNING,
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--from", dest="from_format", choices=FORMATS, help="source format (default: detected)")
    p.add_argument("--to", dest="to_format", choices=TARGETS,
                   help="destination format (default: safetensors if DST ends in .safetensors, else tsckpt)")
    p.add_argument("--subtree", metavar="PATH", help="convert only the leaves below PATH (e.g. model)")
    p.add_argument("--strip-prefix", metavar="TEXT", help="remove TEXT from the start of every leaf name")
    p.add_argument("--add-prefix", metavar="TEXT", help="put TEXT in front of every leaf name (e.g. 'model.')")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="largest safetensors file of a directory destination, e.g. 5GB, 500MB, 2GiB (default: one file)")
    p.add_argument("--dtype", metavar="DTYPE",
                   help="cast floating-point arrays, e.g. bfloat16 or float16 (a copied config.json names the dtype "
                   "written)")
    p.add_argument("--casting", choices=CASTINGS, default="same_kind",
                   help="what --dtype may do: same_kind fails on a value beyond the new dtype's range, unsafe "
                   "casts it anyway with a warning (default: same_kind)")
    p.add_argument("--layout", choices=LAYOUTS, default=LAYOUT_PLAIN,
                   help="tsckpt destination layout: plain (a file per shard, readable by any zarr v3 tool) or "
                   "compact (a few files per rank, readable by TensorStore) (default: plain)")
    p.add_argument("--no-inner-chunks", action="store_true",
                   help="tsckpt destination: each shard file one chunk (no inner chunks), so restore(copy=False) "
                   "maps whole arrays; give a --max-inflight-bytes above the largest array")
    p.add_argument("--max-inflight-bytes", metavar="SIZE",
                   help="source data read and not yet written to a tsckpt DST, e.g. 64MiB; bounds the memory "
                   f"convert needs, and the size of its shard files (default: {human_bytes(READ_WINDOW_BYTES)})")
    p.add_argument("--copy-from", metavar="DIR",
                   help="Hugging Face directory DST: also copy config.json, generation_config.json and the "
                   "tokenizer files found in DIR (regular files only); config.json's torch_dtype/dtype is set to "
                   "the dtype of the weights written (several floating-point dtypes: pass --dtype)")
    p.add_argument("--map", metavar="RULES",
                   help="write the leaves a mapping makes of the source's (renamed, transposed, split, joined; "
                   "before --subtree and the prefixes): flax-to-torch, torch-to-flax (NAME:PREFIX reads the "
                   "source's leaves under PREFIX), or a JSON file of rules")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--allow-pickle", action="store_true",
                   help="read a source whose metadata is a Python pickle (a torch.distributed.checkpoint "
                   "directory); unpickling can run arbitrary code: only for a checkpoint from a trusted source")
    p.set_defaults(func=cmd_convert)
    return parser


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help/--version (0) or a usage error (2)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    failed = int(getattr(args, "failed", EXIT_PROBLEM))  # the status of an error (diff: 2, as cmp)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
            return int(args.func(args))
    except UsageError as e:
        print(f"tsckpt {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except (TsckptError, Problem) as e:
        print(f"tsckpt {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return failed
    except KeyboardInterrupt:
        print("tsckpt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `tsckpt ls DIR | head`
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_PROBLEM
    except OSError as e:  # unreadable or unwritable files, named by the message
        print(f"tsckpt {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return failed
    except Exception as e:  # noqa: BLE001 - a bug in tsckpt: still one line, never a traceback
        print(
            f"tsckpt {args.command}: error: unexpected {type(e).__name__}: {_one_line(e)} "
            "(this is a bug in tsckpt; please report it)",
            file=sys.stderr,
        )
        return failed


__all__ = ["main", "build_parser", "parse_target", "human_bytes"]
