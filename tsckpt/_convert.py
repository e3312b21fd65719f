"""convert(): stream a checkpoint from one format into another.

1. Open the source as a tree of lazy sources (``open_source``), format detected or given.
   A tsckpt or Orbax source may be a kvstore spec dict (or URL), like a tsckpt destination.
2. Select the subtree and rename its leaves (prefixes): :func:`select`.
3. Wrap each stored array once (tied leaves share it) to cast and count progress.
4. Write: ``tsckpt.save`` (shard by shard, a bounded window in flight) or the
   safetensors writer (block by block). Memory stays bounded by the window, never
   by the model.
5. On failure remove the partial output, so nothing half-written is left behind.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from ._base import dtypes as _dtypes
from ._base.casting import CastCheck, check_cast
from ._base.lazytorch import is_dtype, is_tensor
from ._base.mapping import Rules
from ._base.types import LazySource, Local
from ._coord.torchdist import THIS_PROCESS
from ._errors import LeafTypeError, NotACheckpointError
from ._formats import safetensors
from ._formats.sources import FORMATS, KVSTORE_FORMATS, detect, open_checkpoint, unknown_format
from ._leaves.quantized import FLOAT8_BLOCKS, SUBCLASS_KEY, Subclass
from ._leaves.registry import describe, memory
from ._ondisk.checkpoint import Checkpoint
from ._ondisk.records import LAYOUT_PLAIN, ArrayRecord, encode_value
from ._options import READ_WINDOW_BYTES, RestoreOptions, SaveOptions, verb
from ._read.mapped import MappedArray, MappedCheckpoint, mapped_checkpoint
from ._read.reader import LazyArray
from ._read.restore import warn_lost_values
from ._runtime.progress import Progress
from ._save.protocol import save
from ._storage import hfcache
from ._storage.confine import link_refused
from ._storage.locations import Directory, resolve
from .tree import child, flatten, from_paths, own_order, structure_from_json, structure_to_json

if TYPE_CHECKING:
    import torch
else:
    from ._base.lazytorch import torch

TARGETS = ("tsckpt", "safetensors")
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
# The files of a Hugging Face model directory besides its weights that copy_from copies.
HF_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
)
# The largest side file copied (the largest tokenizer.json files are tens of MB).
MAX_SIDE_FILE_BYTES = 256 << 20
# The keys of config.json naming the weights' dtype: transformers 4.x's and 5.x's.
CONFIG_DTYPE_KEYS = ("torch_dtype", "dtype")


@dataclasses.dataclass(frozen=True)
class ConvertReport:
    """What :func:`convert` wrote."""

    src: str
    dst: str
    src_format: str
    dst_format: str
    n_arrays: int  # arrays stored (tied leaves count once)
    nbytes: int  # bytes of array data written
    n_values: int
    n_tied: int  # leaves stored as a tie to another leaf
    files: tuple[str, ...] = ()  # files written: safetensors, index, copied side files (empty for tsckpt)


@dataclasses.dataclass(frozen=True)
class Selected:
    """Step 2's result: the leaves to write, under their output names."""

    names: list[str]
    leaves: list[Any]
    structure: Any  # JSON structure of the selected subtree; None after renaming
    order: list[int]  # positions in names/leaves, in the source tree's own order (see own_order)


def parse_size(size: int | str | None, what: str = "max_shard_size") -> int | None:
    """``"5GB"`` -> 5_000_000_000, ``"2GiB"`` -> 2**31 (units as in transformers); ``what``
    names the option in the error."""
    if size is None or isinstance(size, int):
        return size
    m = _SIZE.fullmatch(size)
    if not m:
        raise ValueError(f"{what} {size!r}: expected a byte count such as 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def parse_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or is_dtype(dtype):
        return dtype
    candidate = getattr(torch, str(dtype), None)
    if not is_dtype(candidate) or not candidate.is_floating_point:
        raise ValueError(f"dtype {dtype!r}: expected a floating-point torch dtype such as bfloat16 or float16")
    return candidate


def select(tree: Any, subtree: str | None, strip_prefix: str | None, add_prefix: str | None) -> Selected:
    """The leaves at or below ``subtree``, named by their path below it, then renamed:
    ``strip_prefix`` removed (every name must start with it) and ``add_prefix`` put in front."""
    node = tree
    for component in (c for c in (subtree or "").strip("/").split("/") if c):
        try:
            node = child(node, component)
        except (KeyError, IndexError, TypeError):
            raise KeyError(f"no subtree '{subtree}' in the source (no '{component}' there)") from None
    flat = flatten(node)
    if not flat.paths:
        raise KeyError(f"the subtree '{subtree or ''}' holds no leaves")
    names = list(flat.paths)
    if strip_prefix:
        outside = [n for n in names if not n.startswith(strip_prefix)]
        if outside:
            raise ValueError(
                f"strip_prefix {strip_prefix!r}: {len(outside)} leaves do not start with it (e.g. {outside[0]!r}); "
                "select the part that does with subtree"
            )
        names = [n[len(strip_prefix):] for n in names]
    if add_prefix:
        names = [add_prefix + n for n in names]
    renamed = bool(strip_prefix or add_prefix)
    structure = structure_to_json(flat.spec)
    return Selected(names, flat.leaves, None if renamed else structure, own_order(structure))


# The Hugging Face name of a block-scaled fp8 weight's scales: ``<weight>`` + this
# (DeepSeek-V3's layout; transformers' FineGrainedFP8 reads it).
HF_SCALE_SUFFIX = "_scale_inv"


@dataclasses.dataclass(frozen=True)
class HfFp8:
    """Block-scaled fp8 weights renamed as Hugging Face checkpoints carry them."""

    names: frozenset[str]  # output names of the fp8 weights and their scales
    block_size: tuple[int, ...] | None  # the one block size of them all (None: no such weight)


def hf_fp8_names(sel: Selected) -> tuple[Selected, HfFp8]:
    """A torchao ``Float8Tensor`` of 2-D blocks stored at ``W`` (``W/qdata``, ``W/scale``,
    ``W/subclass``, tsckpt/_leaves/quantized.py) written as ``W`` (float8) and
    ``W_scale_inv`` (float32, one per block: dequantized = weight * scale_inv), its
    metadata left out; every other leaf as it is."""
    index = {n: i for i, n in enumerate(sel.names)}
    renamed: dict[str, str] = {}
    dropped: set[str] = set()
    blocks: set[tuple[int, ...]] = set()
    for name, leaf in zip(sel.names, sel.leaves):
        base, _, last = name.rpartition("/")
        if last != SUBCLASS_KEY or not isinstance(leaf, str) or f"{base}/qdata" not in index:
            continue
        try:
            info = Subclass.from_json(base, leaf)
        except LeafTypeError:  # a value of that name that is no metadata of tsckpt's: a plain leaf
            continue
        block = info.attributes.get("block_size")
        if info.cls != FLOAT8_BLOCKS or not isinstance(block, dict) or len(block.get("list", ())) != 2:
            continue
        blocks.add(tuple(int(b) for b in block["list"]))
        renamed[f"{base}/qdata"], renamed[f"{base}/scale"] = base, base + HF_SCALE_SUFFIX
        dropped.add(name)
    if not renamed:
        return sel, HfFp8(frozenset(), None)
    if len(blocks) > 1:
        raise ValueError(
            f"the block-scaled fp8 weights have {len(blocks)} block sizes ({sorted(blocks)}); a Hugging Face "
            "config names one weight_block_size: quantize them all with one block size"
        )
    keep = [i for i, n in enumerate(sel.names) if n not in dropped]
    names = [renamed.get(sel.names[i], sel.names[i]) for i in keep]
    position = {i: k for k, i in enumerate(keep)}
    order = [position[i] for i in sel.order if i in position]
    out = Selected(names, [sel.leaves[i] for i in keep], None, order)
    return out, HfFp8(frozenset(renamed.values()), next(iter(blocks)))


def _reader(
    local: Local, cast: torch.dtype | None, casting: str, count: Callable[[int], None]
) -> tuple[LazySource, str, CastCheck | None]:
    """A lazy source over one stored array that casts floating-point data to ``cast`` (its
    values checked as ``casting`` says) and counts what it reads; returns it with its
    (output) logical dtype and the check."""
    stored = local.desc.dtype
    out = stored
    check = None
    if cast is not None and _dtypes.torch_dtype(stored).is_floating_point:
        out = _dtypes.torch_name(cast)
        check = check_cast(local.desc.path, stored, cast, casting=casting)
        if check is not None:
            check.fix = 'Pass casting="unsafe" (--casting unsafe) to cast anyway, or convert without a dtype'
    data = local.data

    def read(box: tuple[slice, ...]) -> np.ndarray:
        block = data[box]
        arr: np.ndarray
        if is_tensor(block):
            arr = _dtypes.tensor_to_numpy(block.detach().cpu().contiguous())
        else:
            arr = np.asarray(block)
        count(arr.nbytes)
        if check is not None:
            check.check(arr, [b.start for b in box])
        if out != stored:
            arr = _dtypes.tensor_to_numpy(_dtypes.numpy_to_tensor(np.ascontiguousarray(arr), stored).to(cast))
        return arr

    kind = local.desc.kind
    dtype: Any = _dtypes.torch_dtype(out) if kind == "torch" else _dtypes.numpy_dtype(out)
    return LazySource(local.desc.global_shape, dtype, read, kind=kind), out, check


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """Step 3's result: the leaves to write (sources wrapped once per stored array)."""

    leaves: list[Any]
    dtypes: dict[str, str]  # stored name -> output logical dtype
    aliases: dict[str, str]  # tied name -> stored name
    nbytes_in: int
    checks: list[CastCheck]  # of the casts that may lose values


def _prepare(sel: Selected, cast: torch.dtype | None, casting: str, count: Callable[[int], None]) -> _Prepared:
    """Wrap each stored array once. Of tied leaves (one memory or source under several
    names) the one first in the source tree's own order is stored, the others are its
    aliases: transformers, too, keeps the input embedding (written before ``lm_head``),
    and loads a tied model whose embedding is missing without a warning, then fails."""
    first: dict[Any, tuple[str, LazySource]] = {}
    leaves: list[Any] = list(sel.leaves)
    dtypes: dict[str, str] = {}
    aliases: dict[str, str] = {}
    checks: list[CastCheck] = []
    nbytes = 0
    for i in sel.order:
        name, leaf = sel.names[i], sel.leaves[i]
        local = describe(name, leaf)
        if local.desc.kind == "value":
            continue
        mem = memory(leaf)
        key = mem if mem is not None else ("leaf", id(leaf))
        if key in first:  # tied: the same memory (or source) as a leaf before it
            aliases[name] = first[key][0]
            leaves[i] = first[key][1]
            continue
        src, out, check = _reader(local, cast, casting, count)
        if check is not None:
            checks.append(check)
        first[key] = (name, src)
        dtypes[name] = out
        nbytes += math.prod(src.shape) * _dtypes.itemsize(local.desc.dtype)
        leaves[i] = src
    return _Prepared(leaves, dtypes, aliases, nbytes, checks)


def _write_tsckpt(dst: Directory, sel: Selected, prep: _Prepared, options: SaveOptions) -> None:
    tree: Any
    if sel.structure is not None:
        tree = structure_from_json(sel.structure, prep.leaves)
    else:
        tree = from_paths(sel.names, prep.leaves)
    # a failed save removes what it wrote itself (save()'s step 8), never another's checkpoint; convert is one
    # process's verb: under torch.distributed, it saves alone (no group made, no other rank waited for)
    save(dst, tree, **dataclasses.replace(options, group=THIS_PROCESS).kwargs())


def _write_safetensors(dst: str, sel: Selected, prep: _Prepared, *, max_shard_size: int | None,
                       overwrite: bool, side_files: list[safetensors.SideFile]) -> list[str]:
    tensors, values, kinds = [], {}, {}
    for name, leaf in zip(sel.names, prep.leaves):
        if not isinstance(leaf, LazySource):
            values[name] = encode_value(leaf)
            continue
        kinds[name] = leaf.kind
        if name in prep.aliases:
            continue
        tensors.append(safetensors.OutTensor(name, prep.dtypes[name], leaf.shape, leaf.__getitem__))
    info = {
        "format_version": 1,
        "structure": sel.structure,
        "leaves": sel.names,
        "kinds": kinds,
        "values": values,
        **({"aliases": prep.aliases} if prep.aliases else {}),
    }
    directory = not dst.endswith(".safetensors")
    return safetensors.write(
        dst, tensors, info, directory=directory, max_shard_size=max_shard_size, overwrite=overwrite,
        side_files=side_files,
    )


def _regular_file(path: str) -> os.stat_result:
    """``path``'s status, refused unless it is a regular file (a link: LinkRefusedError) of at
    most :data:`MAX_SIDE_FILE_BYTES`; a Hugging Face cache snapshot's file (:class:`hfcache.Blob`):
    its blob's, opened as every read of one is."""
    if isinstance(path, hfcache.Blob):
        fd = hfcache.open_read(path)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
    else:
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        raise link_refused(f"copy_from: {path} is a symbolic link (to {target})", path, target)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"copy_from: {path} is not a regular file")
    if st.st_size > MAX_SIDE_FILE_BYTES:
        raise ValueError(
            f"copy_from: {path} holds {st.st_size} bytes, more than the {MAX_SIDE_FILE_BYTES} a model's "
            "config or tokenizer file has; copy it yourself if it is right"
        )
    return st


def _open_side(path: str) -> BinaryIO:
    """A side file open for reading, without following a link, checked again once open
    (it may have been replaced since :func:`_regular_file` looked)."""
    if isinstance(path, hfcache.Blob):
        fd = hfcache.open_read(path)
    else:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise ValueError(f"copy_from: {path} is not a regular file")
    return f


def _read_side(path: str, out: BinaryIO | None = None) -> bytes:
    """A side file's bytes, or with ``out``, copied to it in blocks (returns b""); at most
    :data:`MAX_SIDE_FILE_BYTES`, however the file grows while it is read."""
    kept, n = [], 0
    with _open_side(path) as f:
        while block := f.read(1 << 20):
            n += len(block)
            if n > MAX_SIDE_FILE_BYTES:
                raise ValueError(f"copy_from: {path} grew past {MAX_SIDE_FILE_BYTES} bytes while it was copied")
            if out is None:
                kept.append(block)
            else:
                out.write(block)
    return b"".join(kept)


def _config_naming(path: str, dtype: str | None, fp8: HfFp8) -> bytes | None:
    """config.json with its dtype key(s) naming ``dtype``, the one floating-point dtype of the
    weights written: those of :data:`CONFIG_DTYPE_KEYS` already there (``torch_dtype`` if none is), so
    transformers loads the weights as written; with block-scaled fp8 weights (``fp8``) its
    ``quantization_config`` as it is, or else one naming them (transformers' ``fp8``
    method, ``weight_block_size``). None when it needs no change (the file is copied
    byte for byte)."""
    data = _read_side(path)
    try:
        config = json.loads(data)
    except ValueError as e:  # UnicodeDecodeError too
        raise ValueError(
            f"copy_from: {path} is not valid JSON ({e}), so its dtype cannot be set to the weights' ({dtype}); "
            "fix it, or convert without copy_from (--copy-from)"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"copy_from: {path} is not a JSON object, as a model's config.json is")
    keys = [k for k in CONFIG_DTYPE_KEYS if k in config]
    quantized = fp8.block_size is not None and "quantization_config" not in config
    if (dtype is None or (keys and all(config[k] == dtype for k in keys))) and not quantized:
        return None
    if dtype is not None:
        for key in keys or [CONFIG_DTYPE_KEYS[0]]:
            config[key] = dtype
    if quantized:
        config["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(fp8.block_size or ()),
        }
    return (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()


def floating_dtype(path: str, dtypes: dict[str, str]) -> str | None:
    """The one floating-point dtype of the weights written (``dtypes``: stored name -> dtype),
    which the config at ``path`` is to name; None when none is floating. Several: ValueError,
    as no config can name them (transformers would load every weight as the config's one)."""
    by_dtype: dict[str, list[str]] = {}
    for name, dt in dtypes.items():
        tdt = _dtypes.torch_dtypes().get(dt)
        if tdt is not None and tdt.is_floating_point:
            by_dtype.setdefault(dt, []).append(name)
    if len(by_dtype) <= 1:
        return next(iter(by_dtype), None)
    parts = "; ".join(
        f"{dt}: {len(names)} array{'s' if len(names) > 1 else ''}, e.g. {names[0]!r}"
        for dt, names in sorted(by_dtype.items(), key=lambda kv: (len(kv[1]), kv[0]))
    )
    named = _config_dtype(path)
    loads = f" (transformers would load them all as {named})" if named else ""
    raise ValueError(
        f"copy_from: the floating-point weights written are of {len(by_dtype)} dtypes ({parts}), so {path} "
        f"cannot name one dtype for them{loads}; pass --dtype (dtype=) to cast them to one, or convert without "
        "--copy-from and write the config yourself"
    )


def _config_dtype(path: str) -> str | None:
    """The dtype config.json names now, for a message (None: none, or it cannot be read)."""
    try:
        config = json.loads(_read_side(path))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    named = [config[k] for k in CONFIG_DTYPE_KEYS if isinstance(config.get(k), str)]
    return named[0] if named else None


def _side_writer(path: str, data: bytes | None) -> Callable[[BinaryIO], None]:
    """Writes ``data``, or else copies the file at ``path`` block by block."""

    def write(out: BinaryIO) -> None:
        if data is not None:
            out.write(data)
        else:
            _read_side(path, out)

    return write


def side_path(copy_from: str, name: str) -> str:
    """The path of the side file ``name`` of ``copy_from``: for a Hugging Face cache snapshot
    whose file links into its own repository's blobs/, a :class:`hfcache.Blob` (read there,
    never through the link); any other link is refused when it is checked."""
    path = os.path.join(copy_from, name)
    if os.path.islink(path):
        return hfcache.blob(copy_from, name, os.readlink(path)) or path
    return path


def copy_dir(copy_from: str | os.PathLike[str]) -> str:
    """The directory ``copy_from`` names: a path, or ``hf://ORG/NAME[@REVISION]`` (a snapshot of
    the local Hugging Face cache)."""
    text = os.fspath(copy_from)
    return hfcache.snapshot_path(text) if text.startswith(hfcache.SCHEME) else text


def hf_side_names(copy_from: str) -> list[str]:
    """The Hugging Face side files (:data:`HF_SIDE_FILES`) in the directory ``copy_from``,
    each checked (a regular file, no link, not too large) before anything is read or written."""
    if not os.path.isdir(copy_from):
        raise ValueError(f"copy_from: {copy_from} is not a directory; give the model directory holding config.json")
    names = []
    for name in HF_SIDE_FILES:
        path = side_path(copy_from, name)
        if not os.path.lexists(path):
            continue
        _regular_file(path)
        names.append(name)
    if not names:
        raise ValueError(f"copy_from: {copy_from} holds none of the files it copies ({', '.join(HF_SIDE_FILES)})")
    return names


def hf_side_files(
    copy_from: str, names: list[str], dtypes: dict[str, str], fp8: HfFp8 = HfFp8(frozenset(), None)
) -> list[safetensors.SideFile]:
    """The side files ``names`` of ``copy_from`` (:func:`hf_side_names`) to write beside the
    weights, whose dtypes ``dtypes`` gives (stored name -> dtype): config.json names their one
    floating-point dtype (:func:`floating_dtype`; several are refused), the others are copied
    byte for byte."""
    sides = []
    for name in names:
        path = side_path(copy_from, name)
        data = None
        if name == "config.json":  # the fp8 weights and their scales are the quantization's
            dtype = floating_dtype(path, {n: d for n, d in dtypes.items() if n not in fp8.names})
            data = _config_naming(path, dtype, fp8)
        sides.append(safetensors.SideFile(name, _side_writer(path, data)))
    return sides


def _name(where: Directory) -> str:
    """How a report names a source or destination: its path, or its location for a spec dict."""
    return str(resolve(where)) if isinstance(where, dict) else os.fspath(where)


def _destination_format(dst: Directory, to_format: str | None) -> str:
    """The destination format: given, or safetensors for a path ending in .safetensors, else tsckpt."""
    path = None if isinstance(dst, dict) else os.fspath(dst)
    to = to_format or ("safetensors" if path is not None and path.endswith(".safetensors") else "tsckpt")
    if to not in TARGETS:
        raise ValueError(f"unknown destination format {to!r}; choose one of {', '.join(TARGETS)}")
    if to != "tsckpt" and path is None:
        raise ValueError(
            f"a {to} destination is a local path (a .safetensors file or a directory), not a kvstore spec "
            "dict; a spec dict is a tsckpt destination only"
        )
    return to


def _copied(copy_from: str | os.PathLike[str] | None, to: str, dst: str) -> list[str]:
    """The names of the side files ``copy_from`` asks for, refused unless the destination is
    a Hugging Face directory (a .safetensors file or a tsckpt checkpoint holds no side files)."""
    if copy_from is None:
        return []
    if to != "safetensors" or dst.endswith(".safetensors"):
        raise ValueError("copy_from applies to a Hugging Face directory destination (--to safetensors, not a file)")
    return hf_side_names(copy_dir(copy_from))


def checkpoint_tree(ck: Checkpoint, mapped: MappedCheckpoint | None = None) -> Any:
    """An opened checkpoint's tree, arrays as lazy sources read chunk by chunk; with ``mapped``
    the tree of the mapping's target leaves, each read from the stored boxes it needs."""
    made: dict[str, LazySource] = {}
    made_mapped: dict[str, LazySource] = {}

    def leaf(path: str) -> Any:
        if mapped is not None:
            target = mapped.leaves[path]
            if target.rule is not None and not target.is_value:
                if path not in made_mapped:
                    made_mapped[path] = _lazy(mapped.view.arrays[path], MappedArray(mapped, path).read_box)
                return made_mapped[path]
            path = target.sources[0]
        stored = ck.aliases.get(path, path)
        if stored in ck.values:
            return ck.values[stored]
        if stored not in made and ck.sources is not None:  # another format's: its own source
            made[stored] = ck.sources[stored]
        if stored not in made:
            made[stored] = _lazy(ck.arrays[stored], LazyArray(ck, stored).read_box)
        return made[stored]

    view = ck if mapped is None else mapped.view
    return view.build([leaf(p) for p in view.leaves])


def _lazy(rec: ArrayRecord, read: Callable[[tuple[slice, ...]], np.ndarray]) -> LazySource:
    """A stored array as a source read region by region, in the kind it was saved as."""
    dtype: Any = _dtypes.torch_dtype(rec.dtype) if rec.kind == "torch" else _dtypes.numpy_dtype(rec.dtype)
    return LazySource(rec.shape, dtype, read, kind=rec.kind)


def open_source(
    src: Directory, fmt: str | None = None, *, allow_pickle: bool = False, mapping: Rules | None = None
) -> tuple[str, Any]:
    """(format, source tree) of ``src``: a path or URL (any format), or a kvstore spec dict (a
    format read through TensorStore); ``fmt`` overrides detection and is checked. The tree is
    the one the read verbs read (:func:`sources.open_checkpoint`, then :func:`checkpoint_tree`).
    ``allow_pickle``: a format whose metadata is a pickle (DCP) may be unpickled, which can run
    code; without it such a source is refused, saying how to opt in. ``mapping``: the tree of
    the target leaves its rules make of the source's."""
    if isinstance(src, dict):
        if fmt is not None and fmt not in KVSTORE_FORMATS:
            raise ValueError(
                f"a kvstore spec source must be a tsckpt or Orbax checkpoint, not {fmt}: {fmt} sources are read "
                "from a local path; pass the path instead of the spec"
            )
        return _checkpoint_source(src, fmt, allow_pickle, mapping)
    path = os.fspath(src)
    fmt = fmt or detect(path) or unknown_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown source format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return _checkpoint_source(path, fmt, allow_pickle, mapping)


def _checkpoint_source(
    src: str | dict[str, Any], fmt: str | None, allow_pickle: bool, mapping: Rules | None
) -> tuple[str, Any]:
    """(format, source tree) of a checkpoint, which must be of ``fmt`` when given (a path is
    opened as ``fmt``; a spec dict is detected, then compared)."""
    ck = open_checkpoint(src, format=None if isinstance(src, dict) else fmt, allow_pickle=allow_pickle)
    if fmt is not None and ck.format != fmt:
        if isinstance(src, dict):
            where, hint = str(ck.location), f"from_format={ck.format!r}"
        else:
            where, hint = src, f"--from {ck.format}"
        raise NotACheckpointError(f"{where}: a {ck.format} checkpoint, not {fmt}; pass {hint}")
    ck.check_links()
    return ck.format, checkpoint_tree(ck, None if mapping is None else mapped_checkpoint(ck, mapping))


@verb("tsckpt.convert")
def convert(
    src: Directory,
    dst: Directory,
    *,
    from_format: str | None = None,
    to_format: str | None = None,
    subtree: str | None = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    max_shard_size: int | str | None = None,
    dtype: Any = None,
    overwrite: bool = False,
    progress: bool | None = None,
    layout: str = LAYOUT_PLAIN,
    inner_chunks: bool = True,
    casting: str = "same_kind",
    max_inflight_bytes: int = READ_WINDOW_BYTES,
    allow_pickle: bool = False,
    copy_from: str | os.PathLike[str] | None = None,
    mapping: Rules | None = None,
) -> ConvertReport:
    """Copy a checkpoint into another format, streaming (memory stays bounded).

    ``src`` may be a tsckpt checkpoint, a safetensors file or Hugging Face directory
    (``model.safetensors`` or shards with ``model.safetensors.index.json``), a
    ``torch.save`` file or a Hugging Face directory of them (``pytorch_model.bin``, or
    shards with ``pytorch_model.bin.index.json``; loaded with ``weights_only=True``), a
    torch.distributed.checkpoint directory (its metadata is a pickle, which can run code
    when read: refused unless ``allow_pickle=True``, for a checkpoint from a trusted
    source) or an Orbax checkpoint; ``from_format`` overrides detection.
    ``dst`` is a tsckpt checkpoint, or safetensors (``to_format="safetensors"``, or a
    path ending in ``.safetensors``): one file, or a Hugging Face directory sharded at
    ``max_shard_size`` (e.g. ``"5GB"``). A tsckpt or Orbax source and a tsckpt
    destination may be given as anything :func:`tsckpt.save` accepts (a path, a
    kvstore URL or a kvstore spec dict); the other formats are local paths.
    ``subtree`` picks the leaves below a path;
    ``strip_prefix``/``add_prefix`` rename them; ``dtype`` casts floating-point arrays,
    with their values checked as ``casting`` says (see :func:`tsckpt.restore`).
    Tied leaves stay tied. ``progress`` shows a bar (default: when stderr is a terminal).
    ``max_inflight_bytes`` bounds the source data read and not yet written to a tsckpt
    destination (default 32 MiB, as for :func:`tsckpt.restore`; no shard file is larger).
    ``overwrite``, ``layout`` and ``inner_chunks`` are as for :func:`tsckpt.save` (a tsckpt destination's;
    ``inner_chunks=False`` with a ``max_inflight_bytes`` above the largest array gives each array one
    chunk file, which ``restore(copy=False)`` maps).
    ``copy_from`` (a Hugging Face directory destination) names a model directory whose
    config.json, generation_config.json and tokenizer files are written beside the
    weights, in the same all-or-nothing write; the copied config.json names the dtype of
    the floating-point weights written (``torch_dtype``/``dtype``, those it has), so
    transformers loads them as written; weights of several such dtypes need ``dtype``.
    A torchao ``Float8Tensor`` of 2-D blocks (block-scaled fp8) is written to safetensors
    as Hugging Face checkpoints carry it: ``W`` (float8_e4m3fn) and ``W_scale_inv``
    (float32 per block), the copied config's ``quantization_config`` kept (one naming
    the block size added where it has none).
    ``mapping`` (:mod:`tsckpt.mappings`) writes the target leaves its rules make of the
    source's (renamed, transposed, split, joined) before ``subtree`` and the prefixes apply:
    a Flax checkpoint becomes a torch state dict's safetensors, region by region.
    """
    RestoreOptions.of(locals())  # a bad option raises here, before any work
    # the bar counts the source bytes read, so the save shows none of its own
    writing = SaveOptions(
        overwrite=overwrite, layout=layout, inner_chunks=inner_chunks, max_inflight_bytes=max_inflight_bytes,
        progress=False,
    )
    src_name, dst_name = _name(src), _name(dst)
    if resolve(src).spec == resolve(dst, write=True).spec:
        raise ValueError(f"convert: source and destination are the same ({src_name}); convert writes a new copy")
    to = _destination_format(dst, to_format)
    if layout != LAYOUT_PLAIN and to != "tsckpt":
        raise ValueError(f"layout={layout!r} applies to a tsckpt destination, not {to}")
    if not inner_chunks and to != "tsckpt":
        raise ValueError(f"inner_chunks=False applies to a tsckpt destination, not {to}")
    shard_limit = parse_size(max_shard_size)
    if shard_limit is not None and (to != "safetensors" or dst_name.endswith(".safetensors")):
        what = (
            "one .safetensors file: give a directory path to write shards" if to == "safetensors"
            else "a tsckpt checkpoint, whose shard files max_inflight_bytes (--max-inflight-bytes) bounds"
        )
        raise ValueError(
            "max_shard_size (--max-shard-size) applies to a Hugging Face directory destination (--to safetensors); "
            f"{dst_name} is to be {what}"
        )
    cast = parse_dtype(dtype)
    side_names = _copied(copy_from, to, dst_name)
    fmt, tree = open_source(src, from_format, allow_pickle=allow_pickle, mapping=mapping)
    sel = select(tree, subtree, strip_prefix, add_prefix)
    fp8 = HfFp8(frozenset(), None)
    if to == "safetensors":
        sel, fp8 = hf_fp8_names(sel)
    with Progress("convert", dst_name, show=progress) as counter:
        prep = _prepare(sel, cast, casting, counter.update)
        counter.set_total(prep.nbytes_in)
        sides = hf_side_files(copy_dir(copy_from), side_names, prep.dtypes, fp8) if copy_from is not None else []
        files: list[str] = []
        if to == "tsckpt":
            _write_tsckpt(dst, sel, prep, writing)
        else:
            files = _write_safetensors(
                dst_name, sel, prep, max_shard_size=shard_limit, overwrite=overwrite, side_files=sides
            )
    warn_lost_values(list(prep.checks))
    n_values = sum(not isinstance(x, LazySource) for x in prep.leaves)
    nbytes = sum(
        math.prod(x.shape) * _dtypes.itemsize(prep.dtypes[n])
        for n, x in zip(sel.names, prep.leaves) if isinstance(x, LazySource) and n not in prep.aliases
    )
    return ConvertReport(src_name, dst_name, fmt, to, len(prep.dtypes), nbytes, n_values, len(prep.aliases), tuple(files))
