"""Server-side copies of objects between two checkpoints in one S3 bucket (incremental saves
on an object store: docs/incremental.md).

A copy is one CopyObject request, made with boto3 (the optional extra ``s3``), conditional
on the source object's ETag being the one its save recorded (``CopySourceIfMatch``): the
store copies the bytes itself, none passes through this process, and a source changed
since its save is refused by the store. The copy's own ETag comes back in the response.
Its result is also checked here: the new object's ETag must be the recorded one (a copy
of a single-part object keeps its ETag), so a store that ignored the condition still
never leaves a copy of other bytes taken for the file (the caller writes it instead).

The client is built from the location's own spec as TensorStore uses it: its endpoint
and region (filled from ``AWS_ENDPOINT_URL`` and ``AWS_REGION`` by
:func:`.locations.resolve`), a profile named by the spec's ``aws_credentials``, else
boto3's default credential chain (the ``AWS_ACCESS_KEY_ID``... variables first), which
is TensorStore's too.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .locations import Location

log = logging.getLogger("tsckpt")

# Connections the client keeps: copies run on a save's write threads, this many at once at most.
MAX_CONNECTIONS = 32  # the save's write threads for object stores (write.OBJECT_THREADS)
_told: set[str] = set()
_lock = threading.Lock()


def _once(why: str) -> None:
    """Log ``why`` copies are not made, once per process."""
    with _lock:
        if why in _told:
            return
        _told.add(why)
    log.info("incremental save on S3: %s; every file is written", why)


def etag_of(generation: bytes) -> str | None:
    """The ETag of an S3 object from TensorStore's generation for it (a marker byte, then the
    quoted ETag), None when it is not one."""
    text = generation[1:] if generation[:1] == b"\0" else generation
    try:
        etag = text.decode("ascii")
    except UnicodeDecodeError:
        return None
    return etag if len(etag) >= 2 and etag.startswith('"') and etag.endswith('"') else None


def _credentials(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's ``aws_credentials`` (in its context, or named by it), {} when it has none."""
    got = spec.get("context", {}).get("aws_credentials") if isinstance(spec.get("context"), dict) else None
    return got if isinstance(got, dict) else {}


def _endpoint(spec: dict[str, Any]) -> str | None:
    endpoint = spec.get("endpoint")
    return endpoint if isinstance(endpoint, str) and endpoint else None


class Copier:
    """Copies objects of checkpoint ``source`` into checkpoint ``target`` (same bucket) by
    server-side copies (:meth:`copy`); thread-safe (a boto3 client is)."""

    def __init__(self, client: Any, bucket: str, source: str, target: str, errors: tuple[type[BaseException], ...]) -> None:
        self.client, self.bucket, self.source, self.target = client, bucket, source, target
        self.errors = errors  # what a refused or failed request raises (botocore's errors)
        self.refused = 0  # copies refused or failed, each file written instead

    @classmethod
    def between(cls, source: Location, target: Location) -> Copier | None:
        """A copier from ``source`` into ``target``, None (logged once) where no copy can be made:
        not both on S3 in the same bucket through the same endpoint, or boto3 not installed."""
        s, t = source.spec, target.spec
        if s.get("driver") != "s3" or t.get("driver") != "s3":
            return None
        if s.get("bucket") != t.get("bucket") or _endpoint(s) != _endpoint(t):
            _once(f"the base {source} is not in the bucket and endpoint of {target}")
            return None
        try:
            import boto3
            import botocore.config
            import botocore.exceptions
        except ImportError:
            _once("boto3 is not installed (pip install 'tsckpt[s3]')")
            return None
        creds = _credentials(t)
        config = botocore.config.Config(
            max_pool_connections=MAX_CONNECTIONS, retries={"max_attempts": 3, "mode": "standard"},
            **({"signature_version": botocore.UNSIGNED} if creds.get("type") == "anonymous" else {}),  # type: ignore[attr-defined]
        )
        try:
            session = boto3.session.Session(profile_name=creds["profile"]) if creds.get("profile") else boto3.session.Session()
            client = session.client(
                "s3", endpoint_url=_endpoint(t), region_name=t.get("aws_region") or session.region_name or "us-east-1",
                config=config,
            )
        except (botocore.exceptions.BotoCoreError, ValueError) as e:  # a profile not found, a bad endpoint URL
            _once(f"no S3 client for {target} ({e})")
            return None
        errors = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
        return cls(client, str(t["bucket"]), str(s.get("path", "")), str(t.get("path", "")), errors)

    def copy(self, source_key: str, target_key: str, etag: str) -> str | None:
        """Copy the source checkpoint's object ``source_key`` to the target's ``target_key`` if
        its ETag is still ``etag``: the copy's ETag (``etag``), or None when the store refused
        or failed it (the source changed or is gone, access denied) or the copy's ETag is
        another (the caller then writes the file, replacing anything copied)."""
        try:
            got = self.client.copy_object(
                Bucket=self.bucket, Key=self.target + target_key, CopySourceIfMatch=etag,
                CopySource={"Bucket": self.bucket, "Key": self.source + source_key},
            )
            new = got.get("CopyObjectResult", {}).get("ETag")
        except self.errors as e:  # refused (412, 403, 404), or the store unreachable: the file is written
            log.debug("incremental save on S3: copy of %s refused (%s); written instead", source_key, e)
            new = None
        if new != etag:
            self.refused += 1
            return None
        return new
