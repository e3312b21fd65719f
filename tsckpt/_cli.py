"""The ``tsckpt`` command: ls, show, verify and convert checkpoints.

Exit status: 0 success, 1 a problem with the data (a corrupt, incomplete or
missing checkpoint, a failed verification, a dtype a format cannot hold), 2 a
usage error (bad arguments, a path that is not a leaf, a malformed slice).
Errors tsckpt raises on purpose print one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import sys
import urllib.parse
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import __version__, _dtypes
from ._errors import CheckpointExistsError, LeafTypeError, TsckptError
from ._format import ROOT_KEY, decode_value, encode_value
from ._leaves import ArraySpec
from ._reader import Checkpoint, LazyArray, load

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2

# `show` refuses to read more than this without a slice (numpy would only print the corners).
SHOW_MAX_BYTES = 256 << 20
# `verify` keeps at most this many bytes of reads in flight.
VERIFY_WINDOW_BYTES = 256 << 20
# Metadata key under which `convert` stores the tree in an exported .safetensors file.
SAFETENSORS_KEY = "tsckpt"


class UsageError(Exception):
    """Bad arguments: exit status 2."""


class Problem(Exception):
    """A data problem found by the command itself: exit status 1."""


# ---- small helpers -----------------------------------------------------------


def human_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'``; bytes below 1 KiB are exact."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _under(path: str, prefix: str | None) -> bool:
    if not prefix:
        return True
    prefix = prefix.rstrip("/")
    return path == prefix or path.startswith(prefix + "/")


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


def cmd_ls(args: argparse.Namespace) -> int:
    ck = load(args.dir)
    paths = [p for p in ck.leaves if _under(p, args.prefix)]
    if args.prefix and not paths:
        raise UsageError(f"no leaf at or below '{args.prefix}' in {ck.location}")
    header = ["PATH", "DTYPE", "SHAPE", "SIZE"] + (["CHUNK", "SHARD"] if args.long else []) + ["VALUE"]
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
            rows.append(row + ["" if stored is None else f"(tied: stored as {stored})"])
        else:
            v = ck.values[p]
            rows.append([p, type(v).__name__, "", ""] + (["", ""] if args.long else []) + [_short(v)])
    for line in _table(rows):
        print(line)
    print(
        f"total {_count(len(paths), 'leaf', 'leaves')}: {_count(n_arrays, 'array')} ({human_bytes(total)}), "
        f"{_count(len(paths) - n_arrays, 'value')}"
    )
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    from . import open as open_checkpoint
    from ._reader import _normalize

    path, index, index_text = parse_target(args.target)
    reader = open_checkpoint(args.dir)
    try:
        leaf = reader[path]
    except KeyError as e:
        raise UsageError(e.args[0] if e.args else str(e)) from None
    if not isinstance(leaf, LazyArray):
        if index is not None:
            raise UsageError(f"'{path}' is a plain {type(leaf).__name__} value, not an array; it cannot be indexed")
        print(leaf if isinstance(leaf, str) else repr(leaf))
        return EXIT_OK
    try:
        box, _ = _normalize(index if index is not None else (), leaf.shape)
    except (IndexError, TypeError, ValueError) as e:
        raise UsageError(f"{args.target}: {e} (array shape {_shape_text(leaf.shape)})") from None
    itemsize = _itemsize(leaf.dtype)
    nbytes = math.prod(s.stop - s.start for s in box) * itemsize
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


def _array_node_problem(node: Any, expected: dict[str, Any]) -> str | None:
    if not isinstance(node, dict) or node.get("node_type") != "array":
        return "its zarr.json is not a zarr array node"
    for key in ("zarr_format", "shape", "data_type", "chunk_grid", "chunk_key_encoding", "fill_value", "codecs"):
        if node.get(key) != expected[key]:
            return f"its zarr.json disagrees with the root metadata on '{key}' ({node.get(key)!r} != {expected[key]!r})"
    return None


def _check_nodes(ck: Checkpoint) -> tuple[dict[str, str], list[str]]:
    """zarr.json of every array and group below the root: (bad array -> why, group problems)."""
    from ._arrays import array_node

    kv = ck.location.kvstore()
    groups = sorted({"/".join(p.split("/")[:i]) for p in ck.arrays for i in range(1, len(p.split("/")))})
    futures = {p: kv.read(f"{p}/{ROOT_KEY}") for p in ck.arrays}
    group_futures = {g: kv.read(f"{g}/{ROOT_KEY}") for g in groups}
    bad: dict[str, str] = {}
    for p, fut in futures.items():
        r = fut.result()
        if r.state != "value":
            bad[p] = "its zarr.json is missing (zarr readers cannot open this array)"
            continue
        try:
            node = json.loads(r.value)
        except ValueError as e:
            bad[p] = f"its zarr.json is not valid JSON ({e})"
            continue
        why = _array_node_problem(node, array_node(ck.arrays[p]))
        if why:
            bad[p] = why
    group_problems = []
    for g, fut in group_futures.items():
        r = fut.result()
        try:
            ok = r.state == "value" and json.loads(r.value).get("node_type") == "group"
        except (ValueError, AttributeError):
            ok = False
        if not ok:
            group_problems.append(f"group '{g}': zarr.json is missing or not a zarr group node")
    return bad, group_problems


def _describe_read_error(err: Exception) -> str:
    if isinstance(err, TsckptError):
        return str(err)
    msg = " ".join(str(err).split())
    low = msg.lower()
    if "digest mismatch" in low or "crc32c" in low or "checksum" in low:
        what = "checksum mismatch: stored bytes were altered"
    elif "not_found" in low or "missing" in low or "not found" in low:
        what = "a chunk file is missing"
    else:
        what = "stored data could not be decoded (truncated or damaged file)"
    return f"{what} ({msg})"


def _itemsize(dtype: str) -> int:
    return 4 if dtype == "complex32" else _dtypes.numpy_dtype(dtype).itemsize


def cmd_verify(args: argparse.Namespace) -> int:
    from ._arrays import open_array
    from ._plan import shard_boxes

    ck = load(args.dir)
    bad, group_problems = _check_nodes(ck)
    read_bad: dict[str, str] = {}
    pending: collections.deque[tuple[Any, str, int]] = collections.deque()
    in_flight = 0
    total_bytes = 0
    n_pieces = 0

    def drain() -> None:
        nonlocal in_flight
        fut, path, n = pending.popleft()
        in_flight -= n
        try:
            fut.result()
        except Exception as e:  # noqa: BLE001 - every failure is reported per leaf
            read_bad.setdefault(path, _describe_read_error(e))

    progress = _progress(len(ck.arrays), args)
    for path, rec in ck.arrays.items():
        if path in bad:  # its zarr.json is missing or wrong: no reader can open it
            progress.update(1)
            continue
        itemsize = _itemsize(rec.dtype)
        try:
            store = open_array(ck.location, rec)
        except Exception as e:  # noqa: BLE001
            read_bad[path] = f"cannot open the array ({' '.join(str(e).split())})"
            progress.update(1)
            continue
        for off, ln in shard_boxes((0,) * len(rec.shape), rec.shape, rec.layout):
            if path in read_bad:
                break
            view = store[tuple(slice(o, o + n) for o, n in zip(off, ln))] if off else store
            nbytes = math.prod(ln) * itemsize
            pending.append((view.read(), path, nbytes))
            in_flight += nbytes
            total_bytes += nbytes
            n_pieces += 1
            while in_flight > VERIFY_WINDOW_BYTES and pending:
                drain()
        progress.update(1)
    while pending:
        drain()
    progress.close()

    for path, why in read_bad.items():
        bad[path] = why if path not in bad else f"{bad[path]}; {why}"
    if args.verbose:
        for p in ck.leaves:
            if p not in bad:
                print(f"ok    {p}")
    for p in sorted(bad):
        print(f"FAIL  {p}: {bad[p]}")
    for problem in group_problems:
        print(f"FAIL  {problem}")
    n_arrays, n_values = len(ck.arrays), len(ck.values)
    if bad or group_problems:
        names = ", ".join(f"'{p}'" for p in sorted(bad)) or "none"
        raise Problem(
            f"verification failed for {ck.location}: {len(bad)} of {n_arrays} arrays bad ({names})"
            + (f", {len(group_problems)} group node(s) bad" if group_problems else "")
        )
    print(
        f"OK: {ck.location}: committed, all {_count(len(ck.leaves), 'leaf', 'leaves')} present; "
        f"{_count(n_arrays, 'array')} ({human_bytes(total_bytes)} read from {_count(n_pieces, 'shard file')}, "
        f"all checksums match), {_count(n_values, 'value')}"
    )
    return EXIT_OK


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, args: argparse.Namespace) -> Any:
    if args.verbose or not sys.stderr.isatty():
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, unit="array", desc="verify", file=sys.stderr, leave=False)


# ---- convert -----------------------------------------------------------------


def _unescape(component: str) -> Any:
    """Inverse of tsckpt.tree path escaping for one component (int-like means an int key)."""
    if component == "%":
        return ""
    if re.fullmatch(r"-?[0-9]+", component):
        return int(component)
    return urllib.parse.unquote(component, errors="strict")


def _tree_from_paths(paths: Sequence[str], leaves: Sequence[Any]) -> Any:
    """Nested dicts whose flattened paths are exactly ``paths`` (used when no structure was stored)."""
    from .tree import ROOT_LEAF_PATH

    if list(paths) == [ROOT_LEAF_PATH]:
        return leaves[0]
    out: dict[Any, Any] = {}
    for path, leaf in zip(paths, leaves):
        node = out
        *parents, last = [_unescape(c) for c in path.split("/")]
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return out


def _arrange(structure: Any, paths: Sequence[str], leaves: list[Any]) -> Any:
    from .tree import structure_from_json

    if structure is not None:
        return structure_from_json(structure, leaves)
    return _tree_from_paths(paths, leaves)


def _read_checkpoint(src: str) -> tuple[Any, Checkpoint]:
    """The saved tree, each array as the kind it was saved as (torch tensor, numpy array or scalar)."""
    from ._restore import restore

    ck = load(src)
    target = []
    for p in ck.leaves:
        if p in ck.values:
            target.append(ck.values[p])
            continue
        rec = ck.arrays[ck.aliases.get(p, p)]
        if rec.kind == "torch":
            target.append(ArraySpec(rec.shape, _dtypes.torch_dtype(rec.dtype)))
        elif rec.kind == "numpy_scalar":
            target.append(np.zeros((), _dtypes.numpy_dtype(rec.dtype))[()])
        else:
            target.append(ArraySpec(rec.shape, _dtypes.numpy_dtype(rec.dtype)))
    return restore(src, _arrange(ck.structure, ck.leaves, target)), ck


def _read_safetensors(src: str) -> Any:
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(src, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:
        raise Problem(f"{src}: not a readable safetensors file ({e})") from None
    info = meta.get(SAFETENSORS_KEY)
    if info is None:
        return dict(sorted(tensors.items()))  # a plain file: a flat dict, names kept as keys
    try:
        info = json.loads(info)
        leaves: list[Any] = []
        for p in info["leaves"]:
            if p in info["values"]:
                leaves.append(decode_value(info["values"][p]))
                continue
            t: torch.Tensor = tensors[p]
            kind = info["kinds"].get(p, "torch")
            if kind in ("numpy", "numpy_scalar"):
                a = _dtypes.tensor_to_numpy(t).copy()
                leaves.append(a[()] if kind == "numpy_scalar" else a)
            else:
                leaves.append(t)
        return _arrange(info.get("structure"), info["leaves"], leaves)
    except (KeyError, TypeError, ValueError) as e:
        raise Problem(f"{src}: its '{SAFETENSORS_KEY}' metadata is malformed ({type(e).__name__}: {e})") from None


def _write_safetensors(dst: str, tree: Any, overwrite: bool) -> tuple[int, int, int]:
    import torch
    from safetensors import SafetensorError
    from safetensors import torch as st

    from ._leaves import describe
    from .tree import flatten, structure_to_json

    if os.path.exists(dst) and not overwrite:
        raise Problem(f"{dst} already exists; pass --overwrite to replace it")
    flat = flatten(tree)
    supported = set(getattr(st, "_TYPES", {}).values())
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    nbytes = 0
    for path, leaf in zip(flat.paths, flat.leaves):
        local = describe(path, leaf)
        if local.desc.kind == "value":
            values[path] = local.desc.value
            continue
        data = local.data
        if not isinstance(data, torch.Tensor):  # np.ascontiguousarray would make 0-d arrays 1-d
            data = _dtypes.numpy_to_tensor(np.require(data, requirements="C"), local.desc.dtype)
        t = data
        if supported and t.dtype not in supported:
            raise LeafTypeError(f"'{path}': dtype {local.desc.dtype} has no safetensors equivalent; keep it in a tsckpt checkpoint")
        tensors[path] = t.detach().cpu().contiguous()
        kinds[path] = local.desc.kind
        nbytes += t.numel() * t.element_size()
    info = {
        "format_version": 1,
        "structure": structure_to_json(flat.spec),
        "leaves": flat.paths,
        "kinds": kinds,
        "values": values,
    }
    tmp = dst + ".tmp"
    try:
        st.save_file(tensors, tmp, metadata={SAFETENSORS_KEY: json.dumps(info, separators=(",", ":"))})
        os.replace(tmp, dst)
    except SafetensorError as e:
        raise Problem(f"{dst}: cannot write ({e})") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return len(tensors), nbytes, len(values)


def cmd_convert(args: argparse.Namespace) -> int:
    from ._save import save

    src, dst = args.src, args.dst
    if os.path.abspath(src) == os.path.abspath(dst):
        raise UsageError("SRC and DST are the same; convert writes a new copy")
    if src.endswith(".safetensors") and not os.path.isdir(src):
        if not os.path.isfile(src):
            raise Problem(f"{src}: no such file")
        tree = _read_safetensors(src)
    else:
        tree, _ = _read_checkpoint(src)
    if dst.endswith(".safetensors"):
        n_arrays, nbytes, n_values = _write_safetensors(dst, tree, args.overwrite)
    else:
        try:
            save(dst, tree, overwrite=args.overwrite)
        except CheckpointExistsError:
            raise Problem(f"{dst} already exists; pass --overwrite to replace it") from None
        ck = load(dst)
        n_arrays, n_values = len(ck.arrays), len(ck.values)
        nbytes = sum(ck.array_metadata(p).nbytes for p in ck.arrays)
    print(f"converted {src} -> {dst}: {_count(n_arrays, 'array')} ({human_bytes(nbytes)}), {_count(n_values, 'value')}")
    return EXIT_OK


# ---- entry point -------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tsckpt",
        description="Inspect, verify and convert tsckpt checkpoints (zarr v3 directories).",
        epilog="Exit status: 0 ok, 1 data problem (corrupt, incomplete, unreadable), 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"tsckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("ls", help="list leaves: path, dtype, shape, size, and plain values")
    p.add_argument("dir", metavar="DIR", help="checkpoint directory (or kvstore URL)")
    p.add_argument("prefix", metavar="PREFIX", nargs="?", help="only leaves at or below this path")
    p.add_argument("-l", "--long", action="store_true", help="also show chunk and shard shapes")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "show",
        help="print an array (or a slice of it) or a value",
        description="Print one leaf. PATH may end in a numpy-style index such as 'model/w[5:9, :3]', "
        "'w[-1]' or 'w[..., 0]'; only the chunks it touches are read. Quote it for the shell.",
    )
    p.add_argument("dir", metavar="DIR", help="checkpoint directory (or kvstore URL)")
    p.add_argument("target", metavar="PATH[INDEX]", help="leaf path, optionally followed by an index")
    p.add_argument("--full", action="store_true", help="print every element instead of a summary")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser(
        "verify",
        help="read every chunk, check every checksum and node; exit 1 naming each bad leaf",
    )
    p.add_argument("dir", metavar="DIR", help="checkpoint directory (or kvstore URL)")
    p.add_argument("-v", "--verbose", action="store_true", help="also list the leaves that are fine")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "convert",
        help="copy a checkpoint; SRC or DST may be a .safetensors file",
        description="Re-save SRC as DST. Either may be a checkpoint directory or a file ending in "
        ".safetensors (a plain safetensors file becomes a flat dict of tensors). The whole tree is held "
        "in memory.",
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
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
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")
            return int(args.func(args))
    except UsageError as e:
        print(f"tsckpt {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except (TsckptError, Problem) as e:
        print(f"tsckpt {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_PROBLEM
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
        return EXIT_PROBLEM


__all__ = ["main", "build_parser", "parse_target", "human_bytes"]
