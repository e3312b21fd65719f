#!/usr/bin/env python
"""Reading safetensors: tsckpt's own reader against the safetensors library's ``safe_open``.

Workload
  many   a file of 1,000 float32 [16, 16] tensors and ``{"format": "pt"}`` metadata (1 MiB)
  big    a 512 MiB file of two float32 [16384, 4096] tensors (256 MiB each); 32 MiB of two
         [1024, 4096] with --quick

Systems
  own          ``read_header`` then ``read_box`` (positional reads of the box's byte runs
               into one new array), the reader tsckpt uses
  st-np        ``safe_open(path, framework="numpy")``, ``get_slice(name)[box]``
  st-pt        the same with ``framework="pt"`` (the one framework that holds bfloat16 and
               float8: numpy has neither)
  st-pt-pread  ``framework="pt", backend="pread"`` (safetensors >= 0.8: reads instead of a map)
  get_tensor   ``safe_open(path, framework="pt").get_tensor(name)``, whole tensors only
  Header cases: ``own`` is ``read_header``; ``st-open`` is ``safe_open(path, "pt")`` and
  ``keys()`` (the library's header validation alone, which yields no offsets);
  ``st-entries`` is what tsckpt would need from it: ``safe_open``, ``metadata()``,
  ``offset_keys()`` and each tensor's ``get_slice(name).get_dtype()`` / ``get_shape()``,
  then tsckpt's own checks of dtype and shape and the offsets summed from the sizes.

Measures
  header  per call, in one process, the systems interleaved call by call (``--header-calls``
          calls of each): median and the 10th-90th percentile range
  whole   reading both tensors of ``big`` whole (warm page cache: the file is read just
          before), each result dropped before the next; open included
  into    the same, into a float32 array already in memory (as a restore reads: ``fill``, i.e.
          ``read_box(..., out)`` for own; ``np.copyto`` of the library's result)
  slice   rows 100:200 (1.6 MiB) and columns 0:64 (4 MiB, one 256-byte run per row) of the
          first tensor of ``big``, open included; warm, and cold (the file's pages evicted
          with posix_fadvise before the case)
  Every result is made a C-contiguous numpy array and one byte of each of its pages read,
  inside the timed call: ``safe_open``'s "pt" framework returns views of its map of the file
  (zero-copy; a column box is a strided view), whose pages are read only when used.
  Each whole/slice case runs in a fresh process; the systems rotate within every round.
  time: median over rounds, and min-max. peak: VmHWM above the RSS just before the call
  (a mapped file's touched pages count). rchar: bytes returned by read calls
  (/proc/self/io; a mapped file's pages are not counted there). cached: bytes of the file
  the page cache holds after a cold case (mincore), i.e. what the read fetched with
  readahead. Every result is compared with the values written.

Strictness
  Hostile headers (as tests/test_fuzz_foreign.py makes them) through ``read_header`` and
  through ``safe_open(path, "pt")`` with every tensor read: which refuses, with what error.
  And which dtypes each framework of ``safe_open`` can return.

Usage
  python benchmarks/bench_safetensors_read.py --quick          # smoke run
  python benchmarks/bench_safetensors_read.py --write-results  # rewrite the '## Safetensors reading' section
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from typing import Any

from _common import bench_parser, evict, finish, machine_info, proc_io, reset_peak, rss, run_child

SECTION = "## Safetensors reading: own reader against safe_open"
MiB = 1 << 20
ROWS = (100, 200)
COLS = (0, 64)
HEADER_SYSTEMS = ["own", "st-open", "st-entries"]
WHOLE_SYSTEMS = ["own", "st-np", "st-pt", "st-pt-pread", "get_tensor"]
INTO_SYSTEMS = ["own", "st-np", "st-pt", "st-pt-pread"]
SLICE_SYSTEMS = ["own", "st-np", "st-pt", "st-pt-pread"]


def big_shape(quick: bool) -> tuple[int, int]:
    return (1024 if quick else 16384, 4096)


def expected(i: int, rows: Any, cols: slice, shape: tuple[int, int]) -> Any:
    """The values written to tensor ``w{i}`` at the rows ``rows`` (indices) and columns ``cols``, as float32."""
    import numpy as np

    r = np.asarray(rows, dtype=np.int64)[:, None]
    c = np.arange(cols.start, cols.stop, dtype=np.int64)[None, :]
    return (((r * shape[1] + c) % 997) * (i + 1)).astype(np.float32)


def make_files(base: str, quick: bool) -> dict[str, str]:
    import torch
    from safetensors.torch import save_file

    many = os.path.join(base, "many.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file({f"layers.{i}.w": torch.randn(16, 16, generator=g) for i in range(1000)}, many, metadata={"format": "pt"})
    big = os.path.join(base, "big.safetensors")
    shape = big_shape(quick)
    ar = torch.arange(shape[0] * shape[1], dtype=torch.int64).reshape(shape) % 997
    save_file({f"w{i}": (ar * (i + 1)).to(torch.float32) for i in range(2)}, big, metadata={"format": "pt"})
    del ar
    for f in (many, big):
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return {"many": many, "big": big}


def warm(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 * MiB)
        while f.readinto(buf):
            pass


def cached_bytes(path: str) -> int:
    from tsckpt._storage import native

    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        vec = native.page_residency(fd, 0, size)
    finally:
        os.close(fd)
    import mmap

    return sum(b & 1 for b in vec) * mmap.PAGESIZE


# ---- the header case: every system in one process, interleaved call by call -------------------


def st_entries(path: str) -> dict[str, Any]:
    """What tsckpt's reader would build from safe_open: names, dtypes, shapes and offsets
    (not exposed by the library: summed from the sizes in offset order), with tsckpt's checks."""
    import math

    from safetensors import safe_open

    from tsckpt._base import dtypes as _dtypes
    from tsckpt._formats.safetensors import DTYPES, TensorEntry
    from tsckpt._ondisk.records import dims_ok

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    pos = 8 + n
    entries = {}
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        for name in f.offset_keys():
            s = f.get_slice(name)
            dtype, shape = s.get_dtype(), s.get_shape()
            if dtype not in DTYPES or not dims_ok(shape, positive=False):
                raise ValueError(name)
            size = math.prod(shape) * _dtypes.itemsize(DTYPES[dtype])
            entries[name] = TensorEntry(name, DTYPES[dtype], tuple(shape), pos, pos + size)
            pos += size
    return {"entries": entries, "metadata": meta}


def header_child(spec: dict[str, Any]) -> dict[str, Any]:
    from safetensors import safe_open

    from tsckpt._formats.safetensors import read_header

    path = spec["path"]

    def st_open() -> Any:
        with safe_open(path, framework="pt") as f:
            return f.keys()

    fns = {"own": lambda: read_header(path).entries, "st-open": st_open, "st-entries": lambda: st_entries(path)["entries"]}
    own = read_header(path).entries
    mine = st_entries(path)["entries"]
    ok = own == mine and len(st_open()) == len(own) == 1000
    times: dict[str, list[float]] = {s: [] for s in HEADER_SYSTEMS}
    for i in range(spec["calls"]):
        order = HEADER_SYSTEMS[i % 3:] + HEADER_SYSTEMS[: i % 3]
        for s in order:
            t = time.perf_counter()
            fns[s]()
            times[s].append(time.perf_counter() - t)
    return {"times": times, "ok": ok}


# ---- whole tensors and slices: one case per fresh process --------------------------------------


def read_child(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    from safetensors import safe_open

    from tsckpt._formats.safetensors import read_box, read_header

    system, path, op = spec["system"], spec["path"], spec["op"]
    shape = tuple(spec["shape"])
    names = ["w0", "w1"] if op in ("whole", "into") else ["w0"]
    full = (slice(0, shape[0]), slice(0, shape[1]))
    box = {"whole": full, "into": full, "rows": (slice(*ROWS), slice(0, shape[1])),
           "cols": (slice(0, shape[0]), slice(*COLS))}[op]
    dest = np.ones(shape, np.float32) if op == "into" else None  # a destination already in memory
    # warm the code paths on another file, so imports and first calls are not timed
    warmup = spec["warmup"]
    read_box(read_header(warmup).entries["layers.0.w"], warmup, (slice(0, 1),))
    with safe_open(warmup, framework="pt") as f:
        f.get_slice("layers.0.w")[0:1]
    with safe_open(warmup, framework="numpy") as f:
        f.get_slice("layers.0.w")[0:1]
    if spec["cold"]:
        evict(path)
    samples: list[bool] = []

    def check(i: int, arr: Any) -> None:
        """64 rows of the box against the values written (a few ms of the timed call, the same for all)."""
        a = np.asarray(arr)
        rows, cols = box
        at = np.linspace(0, rows.stop - rows.start - 1, 64).astype(np.int64)
        want = expected(i, rows.start + at, cols, shape)
        samples.append(a.shape == (rows.stop - rows.start, cols.stop - cols.start) and bool(np.array_equal(a[at], want)))

    def use(arr: Any) -> Any:
        """The box as a C-contiguous numpy array with every page of it in memory, as a consumer
        (a copy into a destination, an encoder) gets it: a view of a mapped file is read here."""
        a = np.ascontiguousarray(arr.numpy() if hasattr(arr, "numpy") else arr)
        a.reshape(-1).view(np.uint8)[::4096].sum()
        return a

    base = rss()
    io0 = proc_io()
    reset_peak()
    start = time.perf_counter()
    if system == "own":
        h = read_header(path)
        for i, n in enumerate(names):
            arr = read_box(h.entries[n], path, box, dest) if dest is not None else use(read_box(h.entries[n], path, box))
            check(i, arr)
            del arr
    else:
        fw = "numpy" if system == "st-np" else "pt"
        kw = {"backend": "pread"} if system == "st-pt-pread" else {}
        with safe_open(path, framework=fw, **kw) as f:
            for i, n in enumerate(names):
                got = f.get_tensor(n) if system == "get_tensor" else f.get_slice(n)[box]
                if dest is not None:
                    np.copyto(dest, got.numpy() if fw == "pt" else got)
                    arr = dest
                else:
                    arr = use(got)
                del got
                check(i, arr)
                del arr
    elapsed = time.perf_counter() - start
    peak = rss("VmHWM:") - base
    io1 = proc_io()
    out = {"time": elapsed, "peak_extra": peak, "rchar": io1["rchar"] - io0["rchar"], "ok": all(samples)}
    if spec["cold"]:
        out["cached"] = cached_bytes(path)
    return out


# ---- strictness ----------------------------------------------------------------------------


def _raw(body: bytes, data: bytes, n: int | None = None) -> bytes:
    return struct.pack("<Q", len(body) if n is None else n) + body + data


def _h(header: Any, data: bytes) -> bytes:
    return _raw(json.dumps(header).encode(), data)


def _e(dtype: str, shape: Any, offsets: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def hostile() -> dict[str, bytes]:
    """Damaged files, one per kind of lie, as the fuzz tests make them."""
    one = b'{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'
    return {
        "a good file (control)": _h({"a": _e("F32", [2], [0, 8])}, bytes(8)),
        "overlapping entries": _h({"a": _e("F32", [2], [0, 8]), "b": _e("F32", [2], [4, 12])}, bytes(12)),
        "a gap before a tensor": _h({"a": _e("F32", [2], [4, 12])}, bytes(12)),
        "offsets beyond the file": _h({"a": _e("F32", [4], [0, 16])}, bytes(8)),
        "shape/byte-length mismatch": _h({"a": _e("F32", [3], [0, 8])}, bytes(8)),
        "dtype/byte-length mismatch": _h({"a": _e("F16", [2], [0, 8])}, bytes(8)),
        "reversed offsets": _h({"a": _e("F32", [2], [8, 0])}, bytes(8)),
        "offset 2**64": _h({"a": _e("F32", [2], [0, 2**64])}, bytes(8)),
        "header length 200 MB": _raw(b'{"a":1}', b"", n=200_000_000),
        "header length beyond the file": _raw(b"{}", b"", n=1000),
        "non-UTF-8 header": _raw(b'{"\xff": 1}', b""),
        "duplicate keys, same entry": _raw(b'{"a":' + one + b',"a":' + one + b"}", bytes(8)),
        "duplicate keys, other entries": _raw(
            b'{"a":' + one + b',"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}', bytes(16)),
        "trailing garbage after the data": _h({"a": _e("F32", [2], [0, 8])}, bytes(12)),
        "junk after the JSON": _raw(b'{"a":' + one + b"}xyz", bytes(8)),
        "dtype F8_E8M0": _h({"a": _e("F8_E8M0", [2], [0, 2])}, bytes(2)),
        "dtype F4 (library only)": _h({"a": _e("F4", [2], [0, 1])}, bytes(1)),
        "dtype F6_E2M3 (library only)": _h({"a": _e("F6_E2M3", [4], [0, 3])}, bytes(3)),
        "unknown dtype 'Q7'": _h({"a": _e("Q7", [2], [0, 8])}, bytes(8)),
        "1e12 elements": _h({"a": _e("F32", [10**6, 10**6], [0, 4 * 10**12])}, bytes(8)),
        "1e12 elements, 0 bytes": _h({"a": _e("F32", [10**6, 10**6], [0, 0])}, b""),
        "shape product overflows 2**64": _h({"a": _e("F32", [2**40, 2**40], [0, 8])}, bytes(8)),
        "negative dimension": _h({"a": _e("F32", [-2], [0, 0])}, b""),
        "float dimension": _h({"a": _e("F32", [2.0], [0, 8])}, bytes(8)),
        "bool dimension": _h({"a": _e("F32", [True], [0, 4])}, bytes(4)),
        "40 dimensions": _h({"a": _e("F32", [1] * 40, [0, 4])}, bytes(4)),
        "__metadata__ not strings": _h({"__metadata__": {"x": 1}}, b""),
        "__metadata__ 0": _h({"__metadata__": 0, "a": _e("F32", [2], [0, 8])}, bytes(8)),
        "__metadata__ null": _h({"__metadata__": None, "a": _e("F32", [2], [0, 8])}, bytes(8)),
        "an extra field (control)": _h({"a": {**_e("F32", [2], [0, 8]), "x": [1]}}, bytes(8)),
        "an extra field nested 126 deep": _raw(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":'
                                               + b"[" * 126 + b"]" * 126 + b"}}", bytes(8)),
        "header a JSON list": _raw(b"[1]", b""),
        "entry not an object": _h({"a": [1, 2]}, b""),
        "entry without data_offsets": _h({"a": {"dtype": "F32", "shape": [2]}}, bytes(8)),
        "JSON nested 100,000 deep": _raw(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b""),
        "space before the JSON": _raw(b" {\"a\":" + one + b"}", bytes(8)),
        "file of 2 bytes": b"\x01\x00",
    }


def _short(e: BaseException, path: str, keep: int = 95) -> str:
    text = str(e).replace(path, "FILE").replace("; the file is damaged or was not fully written, get a good copy", "")
    text = " ".join(text.split())
    return f"{type(e).__name__}: {text[:keep] + ('...' if len(text) > keep else '')}"


def strictness(base: str) -> list[dict[str, str]]:
    from safetensors import safe_open

    from tsckpt._formats.safetensors import read_header

    rows = []
    path = os.path.join(base, "hostile.safetensors")
    for case, data in hostile().items():
        with open(path, "wb") as f:
            f.write(data)
        try:
            own = f"accepted ({len(read_header(path).entries)} tensors)"
        except Exception as e:  # noqa: BLE001 - tabulated
            own = _short(e, path)
        try:
            with safe_open(path, framework="pt") as f:
                for k in f.keys():
                    f.get_slice(k)[...]
                lib = f"accepted ({len(f.keys())} tensors)"
        except BaseException as e:  # noqa: BLE001 - tabulated (pyo3 panics are BaseException)
            lib = _short(e, path)
        rows.append({"case": case, "own": own, "safetensors": lib})
    return rows


def frameworks(base: str) -> list[dict[str, str]]:
    """Which dtype each safe_open framework returns, and as what."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tsckpt._formats.safetensors import DTYPES, read_box, read_header

    from tsckpt._base import dtypes as _dtypes

    path = os.path.join(base, "dtypes.safetensors")
    ts = {}
    for code, name in DTYPES.items():
        ts[code] = torch.zeros(4, dtype=_dtypes.torch_dtype(name))
    save_file(ts, path)
    rows = []
    h = read_header(path)
    for code in DTYPES:
        row = {"dtype": code}
        try:
            row["own"] = str(read_box(h.entries[code], path, (slice(0, 4),)).dtype)
        except Exception as e:  # noqa: BLE001
            row["own"] = f"{type(e).__name__}"
        for fw in ("numpy", "pt"):
            try:
                with safe_open(path, framework=fw) as f:
                    row[fw] = str(f.get_slice(code)[0:4].dtype)
            except Exception as e:  # noqa: BLE001
                row[fw] = f"{type(e).__name__}: {' '.join(str(e).split())[:50]}"
        rows.append(row)
    return rows


# ---- orchestration and the report ------------------------------------------------------------


def main() -> None:
    p = bench_parser(__doc__, repeats=7)
    p.add_argument("--header-calls", type=int, default=200, help="calls of each header system")
    p.add_argument("--json", default=None, help="keep the raw results here")
    args = p.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(header_child(spec) if spec["op"] == "header" else read_child(spec)))
        return

    base = tempfile.mkdtemp(prefix="bench-st-read-", dir=args.dir)
    results: dict[str, Any] = {"machine": machine_info(), "quick": args.quick, "repeats": args.repeats}
    try:
        files = make_files(base, args.quick)
        shape = big_shape(args.quick)
        results["shape"] = shape
        results["strictness"] = strictness(base)
        results["frameworks"] = frameworks(base)
        spec = {"op": "header", "path": files["many"], "calls": args.header_calls}
        results["header"] = run_child(__file__, spec, args.timeout)
        runs: dict[str, list[dict[str, Any]]] = {}
        cases = [("whole", False, s) for s in WHOLE_SYSTEMS] + [("into", False, s) for s in INTO_SYSTEMS]
        cases += [(op, cold, s) for op in ("rows", "cols") for cold in (False, True) for s in SLICE_SYSTEMS]
        for r in range(args.repeats):
            rotated = cases[r % len(cases):] + cases[: r % len(cases)]
            for op, cold, s in rotated:
                if not cold:
                    warm(files["big"])
                spec = {"op": op, "cold": cold, "system": s, "path": files["big"], "shape": shape,
                        "warmup": files["many"]}
                res = run_child(__file__, spec, args.timeout)
                runs.setdefault(f"{op}|{'cold' if cold else 'warm'}|{s}", []).append(res)
                print(f"round {r} {op} {'cold' if cold else 'warm'} {s}: {res}", file=sys.stderr)
        results["runs"] = runs
    finally:
        shutil.rmtree(base, ignore_errors=True)
    finish(results, args, report, SECTION)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def report(results: dict[str, Any], args: Any) -> str:
    info = results["machine"]
    shape = results["shape"]
    big = 2 * shape[0] * shape[1] * 4
    h = results["header"]
    lines = [
        SECTION,
        "",
        f"`python benchmarks/bench_safetensors_read.py{' --quick' if results['quick'] else ''} --repeats "
        f"{results['repeats']}`: {info['date']}, {info['nproc']} CPUs ({info['cpu']}), load average "
        f"{', '.join(f'{x:.1f}' for x in info['load_avg'])} at the start, torch {info['torch']}, safetensors "
        f"{info['safetensors']}, tsckpt {info['tsckpt_rev']}.",
        "",
        f"Header of a file of 1,000 tensors ({len(h['times']['own'])} calls of each, interleaved; "
        f"{'same entries' if h['ok'] else 'ENTRIES DIFFER'}):",
        "",
        "| system | median (ms) | p10-p90 (ms) | vs own |",
        "|---|---|---|---|",
    ]
    own_h = statistics.median(h["times"]["own"])
    for s in HEADER_SYSTEMS:
        ts = h["times"][s]
        m = statistics.median(ts)
        lines.append(f"| {s} | {m * 1e3:.2f} | {_pct(ts, 0.1) * 1e3:.2f}-{_pct(ts, 0.9) * 1e3:.2f} | {m / own_h:.2f}x |")
    what = {"whole": f"both tensors whole ({big / MiB:.0f} MiB)", "into": "both whole, into a destination",
            "rows": f"rows {ROWS[0]}:{ROWS[1]} of w0",
            "cols": f"columns {COLS[0]}:{COLS[1]} of w0"}
    lines += [
        "",
        f"Reads from a {big / MiB:.0f} MiB file of two float32 {list(shape)} tensors, open included; median of "
        f"{results['repeats']} rotating rounds (min-max), each case in a fresh process:",
        "",
        "| read | cache | system | time (ms) | min-max (ms) | vs own | peak RSS above baseline (MiB) | rchar (MiB) "
        "| page cache after (MiB) | values |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    runs = results["runs"]
    for key, rs in runs.items():
        op, cache, s = key.split("|")
        ts = [x["time"] for x in rs]
        m = statistics.median(ts)
        ref = statistics.median(x["time"] for x in runs[f"{op}|{cache}|own"])
        peak = statistics.median(x["peak_extra"] for x in rs) / MiB
        rchar = statistics.median(x["rchar"] for x in rs) / MiB
        cached = f"{statistics.median(x['cached'] for x in rs) / MiB:.2f}" if "cached" in rs[0] else "-"
        ok = "exact" if all(x["ok"] for x in rs) else "WRONG"
        lines.append(f"| {what[op]} | {cache} | {s} | {m * 1e3:.1f} | {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f} | "
                     f"{m / ref:.2f}x | {peak:.1f} | {rchar:.2f} | {cached} | {ok} |")
    lines += [
        "",
        "Strictness: hostile headers through `read_header` and through `safe_open(path, \"pt\")` with every tensor "
        "read (FILE: the file's path; tsckpt's common ending 'the file is damaged...' left out):",
        "",
        "| header | own reader | safetensors |",
        "|---|---|---|",
    ]
    for row in results["strictness"]:
        lines.append(f"| {row['case']} | {row['own'].replace('|', '/')} | {row['safetensors'].replace('|', '/')} |")
    lines += [
        "",
        "Which dtypes each reader returns (`get_slice(name)[0:4]`):",
        "",
        "| dtype | own (numpy) | safe_open numpy | safe_open pt |",
        "|---|---|---|---|",
    ]
    for row in results["frameworks"]:
        lines.append(f"| {row['dtype']} | {row['own']} | {row['numpy']} | {row['pt']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
