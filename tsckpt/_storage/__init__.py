"""Where bytes live, and the system calls that move them safely.

Owns:

- :mod:`.locations`: where a checkpoint lives: kvstore specs and ``resolve``, the
  process's TensorStore context, the object-store environment (endpoint, region, the
  request bound and stall limit, set when the first object-store location is resolved).
- :mod:`.faults`: the one table that classifies TensorStore's and the operating
  system's errors (``TABLE``, with the errno mapping), and storage faults raised as
  ``StorageError`` (``storage_problem``, ``storage_errors``).
- :mod:`.s3copy`: server-side copies between two checkpoints in one S3 bucket, conditional
  on the source's recorded ETag (incremental saves; boto3, the optional extra ``s3``).
- :mod:`.durable`: durable writes of small JSON objects, bulk sync before a commit,
  deletion.
- :mod:`.native`: every call into the C library (``mincore``, ``madvise``,
  ``malloc_trim``, ``mallopt``, ``syncfs``, ``sync_file_range``, ``openat2``), each declared once
  with one availability probe; the I/O limits (``ALIGN``, ``IOV_MAX``) and aligned memory.
- :mod:`.beneath`: opens below an open directory that follow no symbolic link
  (``openat2``, else ``O_NOFOLLOW`` on each component).
- :mod:`.confine`: paths inside a local checkpoint: the one check of every stored path,
  the checkpoint's directory opened once (``Root``) and its files opened from it with no
  link followed (``Confined``, ``open_read``), and the walk that finds links and special files.
- :mod:`.filemap`: copy-on-write private mappings of a checkpoint's files (zero-copy
  restores), made from a descriptor, and what a file may do under one.
- :mod:`.mirror`: a local checkpoint as TensorStore reads it: a private directory of links
  to descriptors of its files, held open (``Mirror``).
- :mod:`.hfcache`: the Hugging Face hub cache: a snapshot's files, links into their own
  repository's ``blobs/``, recognised strictly and opened there with no link followed
  (``Blob``, ``open_read``); ``hf://ORG/NAME[@REVISION]`` found in the local cache.

May import: the foundations only (``_errors``, ``_base``).
"""
