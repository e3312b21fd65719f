"""What the benchmark scripts share: a description of the machine and code they ran on."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def _first(path: str, prefix: str) -> str | None:
    with open(path) as f:
        for line in f:
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    return None


def machine_info() -> dict[str, Any]:
    """Date, CPU, memory, library versions, tsckpt commit, and load average."""
    import torch

    mem_kib = (_first("/proc/meminfo", "MemTotal:") or "0 kB").split()[0]
    try:
        rev = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--", "../tsckpt"], capture_output=True, text=True).stdout.strip()
        rev = rev + (" + uncommitted changes to tsckpt/" if dirty else "")
    except OSError:
        rev = "unknown"
    try:
        st_version = version("safetensors")
    except PackageNotFoundError:
        st_version = "not installed"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "nproc": os.cpu_count(),
        "mem_gib": int(mem_kib) * 1024 / (1 << 30),
        "cpu": _first("/proc/cpuinfo", "model name") or "unknown",
        "python": platform.python_version(),
        "kernel": platform.release(),
        "torch": torch.__version__,
        "tensorstore": version("tensorstore"),
        "safetensors": st_version,
        "tsckpt": _tsckpt_version(),
        "tsckpt_rev": rev,
        "load_avg": os.getloadavg(),
    }


def _tsckpt_version() -> str:
    """The installed distribution's version, or the package's own where it runs from a checkout."""
    try:
        return version("tsckpt")
    except PackageNotFoundError:
        import tsckpt

        return tsckpt.__version__


RESULTS_MD = os.path.join(HERE, "RESULTS.md")
NOTES = "### Notes"  # kept verbatim when a section is regenerated


def finish(results: dict[str, Any], args: Any, report: Any, title: str) -> None:
    """Keep the raw results (``--json``), print the section, and write it (``--write-results``)."""
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    section = report(results, args)
    print(section)
    if args.write_results:
        write_section(title, section)


def write_section(title: str, body: str) -> None:
    """Replace (or append) the ``title`` section of RESULTS.md, keeping its hand-written Notes."""
    text = open(RESULTS_MD).read() if os.path.exists(RESULTS_MD) else "# Benchmark results\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == title), None)
    notes = ""
    if start is None:
        head, tail = text.rstrip("\n") + "\n\n", ""
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        old = "".join(lines[start:end])
        k = old.find("\n" + NOTES)
        if k >= 0:
            notes = old[k + 1 :].rstrip("\n") + "\n"
        head, tail = "".join(lines[:start]), "".join(lines[end:])
    new = body.rstrip("\n") + "\n" + ("\n" + notes if notes else "")
    with open(RESULTS_MD, "w") as f:
        f.write(head + new + ("\n" + tail if tail else ""))


# ---- measuring one case in a fresh process ---------------------------------------------------


def rss(field: str = "VmRSS:") -> int:
    """Bytes of a /proc/self/status memory field (VmRSS: now, VmHWM: peak since reset_peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    """Restart VmHWM from the current RSS, so a peak measures one call."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def drop_caches() -> bool:
    """Drop the whole page cache (needs root); False when not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def evict(path: str) -> None:
    """Drop one file's or directory tree's pages from the page cache (no root needed:
    clean pages of a file can always be given up with posix_fadvise)."""
    files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_child(script: str, spec: dict[str, Any], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``script --child SPEC`` in a fresh interpreter (``env`` added to the environment);
    its last stdout line is the JSON result."""
    import json
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    r = subprocess.run([sys.executable, script, "--child", json.dumps(spec)], capture_output=True, text=True,
                       timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError(f"{spec}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench_parser(doc: str | None, repeats: int) -> "argparse.ArgumentParser":
    """The options every interop benchmark takes (``--child`` runs one case)."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small workload, a smoke run")
    p.add_argument("--repeats", "--rounds", type=int, default=repeats, help="rounds (each case once per round)")
    p.add_argument("--dir", default=None, help="where to write (a temporary directory below it)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per case")
    p.add_argument("--write-results", action="store_true", help="rewrite this script's section of RESULTS.md")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters (rchar: bytes returned by read calls; read_bytes:
    bytes fetched from the block device; syscr/syscw: read/write calls)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def dir_stats(path: str) -> tuple[int, int]:
    """(number of files, total bytes) under ``path``."""
    files = size = 0
    for root, _, names in os.walk(path):
        for n in names:
            files += 1
            size += os.path.getsize(os.path.join(root, n))
    return files, size


# ---- multi-rank runs ---------------------------------------------------------------------


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(script: str, job: dict[str, Any], world: int, timeout: float,
              env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``script --rank-job JOB`` as ``world`` gloo ranks (fresh processes, torchrun's
    environment variables); each rank prints one ``RESULT <json>`` line. Returns them by rank."""
    import json
    import sys

    port = free_port()
    procs = []
    for r in range(world):
        penv = dict(os.environ, **(env or {}), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                    WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, script, "--rank-job", json.dumps(job)], env=penv,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      stdin=subprocess.DEVNULL))
    outs = []
    deadline = time.time() + timeout
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.time())))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for r, (out, err) in enumerate(outs):
        line = next((l for l in out.splitlines()[::-1] if l.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"{job.get('op', '')} {job.get('system', '')}: rank {r} failed:\n{out[-2000:]}\n{err[-4000:]}")
        results.append(json.loads(line[len("RESULT "):]))
    return results


def rank_entry(fn: Any, job: dict[str, Any]) -> None:
    """Run ``fn(job)`` in a rank process, print its result as the ``RESULT`` line run_ranks reads,
    and leave without interpreter teardown (gloo's destructors can abort at exit)."""
    import json
    import sys

    try:
        print("RESULT " + json.dumps(fn(job)), flush=True)
    except BaseException:
        import traceback

        traceback.print_exc()  # before the exit below, which would drop it
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# ---- a local S3 server --------------------------------------------------------------------


class LocalS3:
    """moto's S3 server on 127.0.0.1 in a thread of this process, with one bucket, counting the
    requests it serves by method under the current ``phase`` (None: not counted).

    A client can switch the phase itself with a GET of ``<url>/_bench/phase/<name>`` (answered
    here, never passed to the server), so a multi-rank job can separate its save from its restore.
    ``delay``: seconds added before serving each request, as the round trip to a store in another
    zone would (requests are served concurrently, each in its own thread). ``ranges``: serve
    unconditional ranged GETs here, from moto's stored object, reading just the range: moto
    itself reads the whole object for each one and then slices it, so a ranged read of a large
    object costs the server the object's size (a real store reads the range).
    """

    BUCKET = "bench"
    CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}

    def __init__(self, delay: float = 0.0, ranges: bool = False) -> None:
        import logging
        import threading

        from moto.server import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.phase: str | None = None
        self.counts: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()
        app = DomainDispatcherApplication(create_backend_app)

        def counting(environ: dict[str, Any], start_response: Any) -> Any:
            path = environ.get("PATH_INFO", "")
            if path.startswith("/_bench/phase/"):
                name = path[len("/_bench/phase/"):]
                self.set_phase(None if name == "none" else name)
                start_response("200 OK", [("Content-Length", "0")])
                return [b""]
            with self._lock:
                if self.phase is not None:
                    c = self.counts.setdefault(self.phase, {})
                    c[environ["REQUEST_METHOD"]] = c.get(environ["REQUEST_METHOD"], 0) + 1
            if delay:
                time.sleep(delay)
            if ranges:
                served = _serve_range(environ, start_response)
                if served is not None:
                    return served
            return app(environ, start_response)

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = make_server("127.0.0.1", self.port, counting, threaded=True)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.client().create_bucket(Bucket=self.BUCKET)

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name=self.CREDS["AWS_REGION"],
                            aws_access_key_id=self.CREDS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.CREDS["AWS_SECRET_ACCESS_KEY"])

    def env(self) -> dict[str, str]:
        """The AWS environment variables a client process needs to reach this server."""
        return {"AWS_ENDPOINT_URL": self.url, **self.CREDS}

    def set_phase(self, name: str | None) -> None:
        with self._lock:
            self.phase = name

    def take_counts(self) -> dict[str, dict[str, int]]:
        """The counts so far, by phase and method; starts new counts."""
        with self._lock:
            out, self.counts = self.counts, {}
        return out

    def objects(self, prefix: str) -> tuple[int, int]:
        """(number of objects, total bytes) under ``prefix`` in the bucket."""
        n = size = 0
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=self.BUCKET, Prefix=prefix):
            for o in page.get("Contents", []):
                n += 1
                size += o["Size"]
        return n, size

    def delete(self, prefix: str) -> None:
        c = self.client()
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=self.BUCKET, Prefix=prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                c.delete_objects(Bucket=self.BUCKET, Delete={"Objects": keys})

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join()


_CONDITIONS = ("HTTP_IF_MATCH", "HTTP_IF_NONE_MATCH", "HTTP_IF_MODIFIED_SINCE", "HTTP_IF_UNMODIFIED_SINCE")


def _serve_range(environ: dict[str, Any], start_response: Any) -> Any:
    """An unconditional path-style GET of ``bytes=a-b`` or ``bytes=a-`` answered from moto's
    stored object, reading only the range; None for anything else (moto answers it)."""
    import re
    import urllib.parse

    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    m = re.fullmatch(r"bytes=(\d+)-(\d*)", environ.get("HTTP_RANGE", ""))
    if (environ["REQUEST_METHOD"] != "GET" or m is None or environ.get("QUERY_STRING")
            or any(h in environ for h in _CONDITIONS)):
        return None
    bucket, _, name = urllib.parse.unquote(environ.get("PATH_INFO", "")).lstrip("/").partition("/")
    try:
        key = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_object(bucket, name)
    except Exception:  # noqa: BLE001 - no such bucket or key: moto answers
        return None
    if key is None or int(m.group(1)) >= key.size:
        return None
    begin = int(m.group(1))
    end = min(int(m.group(2)) if m.group(2) else key.size - 1, key.size - 1)
    with key.lock:
        key._value_buffer.seek(begin)
        body = key._value_buffer.read(end - begin + 1)
    start_response("206 Partial Content", [
        ("Content-Type", "binary/octet-stream"), ("Content-Length", str(len(body))),
        ("Content-Range", f"bytes {begin}-{end}/{key.size}"), ("Accept-Ranges", "bytes"),
        ("ETag", key.etag), ("Last-Modified", key.last_modified_RFC1123),
    ])
    return [body]


def make_resident(path: str, buf: bytearray) -> int:
    """Read every file under ``path`` into ``buf`` (overwritten, nothing kept), so that their
    pages are in the page cache; returns the bytes read."""
    n = 0
    for root, _, names in os.walk(path):
        for name in sorted(names):
            with open(os.path.join(root, name), "rb", buffering=0) as f:
                while k := f.readinto(buf):
                    n += k
    return n


def save_load_rows(med: dict[str, dict[str, float]], peer: str) -> list[str]:
    """Markdown rows of a framework benchmark: save, load, their sum, and the sum against the
    framework's own checkpointing (``peer``), for ``peer`` and then tsckpt."""
    base = med[peer]["save"] + med[peer]["load"]
    rows = []
    for s in (peer, "tsckpt"):
        total = med[s]["save"] + med[s]["load"]
        rows.append(f"| {s} | {med[s]['save']:.2f} | {med[s]['load']:.2f} | {total:.2f} | {total / base:.2f}x |")
    return rows


def framework_main(doc: str | None, run: Any, report: Any, section: str) -> None:
    """The command line every framework benchmark shares (bench_lightning, bench_torchtitan,
    bench_accelerate): the model's size, rounds, where, ``--quick`` and ``--write-results``."""
    import argparse

    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: the system's temp directory)")
    p.add_argument("--quick", action="store_true", help="2 layers of 256, 1 round")
    p.add_argument("--write-results", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.layers, args.width, args.rounds = 2, 256, 1
    body = report(run(args), args)
    print(body)
    if args.write_results:
        write_section(section, body)
