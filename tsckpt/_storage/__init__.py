"""Where bytes live, and the system calls that move them safely.

Owns:

- :mod:`.locations`: where a checkpoint lives: kvstore specs and ``resolve``, the
  process's TensorStore context, the object-store environment (endpoint, region, the
  request bound and stall limit, set when the first object-store location is resolved).
- :mod:`.faults`: the one table that classifies TensorStore's and the operating
  system's errors (``TABLE``, with the errno mapping), and storage faults raised as
  ``StorageError`` (``storage_problem``, ``storage_errors``).
- :mod:`.durable`: durable writes of small JSON objects, bulk sync before a commit,
  deletion.
- :mod:`.native`: every call into the C library (``mincore``, ``madvise``,
  ``malloc_trim``, ``syncfs``, ``sync_file_range``, ``openat2``), each declared once
  with one availability probe; the I/O limits (``ALIGN``, ``IOV_MAX``) and aligned memory.
- :mod:`.confine`: paths inside a local checkpoint: the one check of every stored path,
  confinement with no symbolic link on the way, opens the kernel refuses to resolve
  through a link (``openat2``), and the walk that finds links and special files.
- :mod:`.hfcache`: the Hugging Face hub cache: a snapshot's files, links into their own
  repository's ``blobs/``, recognised strictly and opened there with no link followed
  (``Blob``, ``open_read``); ``hf://ORG/NAME[@REVISION]`` found in the local cache.

May import: the foundations only (``_errors``, ``_base``).
"""
