"""Where bytes live, and the system calls that move them safely.

Owns:

- :mod:`.store`: locations (kvstore specs, the object-store environment), durable
  writes, bulk sync, deletion, storage faults as ``StorageError``.
- :mod:`.native`: every call into the C library (``mincore``, ``madvise``,
  ``malloc_trim``, ``syncfs``, ``sync_file_range``, ``openat2``), each declared once
  with one availability probe; the I/O limits (``ALIGN``, ``IOV_MAX``) and aligned memory.
- :mod:`.confine`: paths inside a local checkpoint: the one check of every stored path,
  confinement with no symbolic link on the way, opens the kernel refuses to resolve
  through a link (``openat2``), and the walk that finds links and special files.

May import: the foundations only (``_errors``, ``_base``).
"""
