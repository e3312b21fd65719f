"""Saving: the save protocol and everything only a save needs.

Owns:

- :mod:`.protocol`: ``save``, the protocol's numbered steps (describe, plan, exchange,
  write, commit) and the messages between them.
- :mod:`.write`: the write engine: a rank's part of the plan executed (the exchange of
  straddling pieces, shard and chunk files, the arrays' nodes).
- :mod:`.share`: incremental saves: each file shared with the base checkpoint (a hard
  link, on S3 a server-side copy) where its content is proven unchanged, and the content hashes recorded.
- :mod:`.versions`: the content hashes known without reading: tensors torch's version
  counter shows unchanged since this process hashed them.
- :mod:`.descs`: what each rank sends rank 0 (its leaves' descriptors, packed), and rank
  0's view of them.
- :mod:`.plan`: the pure save plan (frozen dataclasses): who writes what, laid out how.
- :mod:`.regions`: the planner's checks of what ranks give for one path (agreement,
  exact cover, replicas).
- :mod:`.commit`: the root ``zarr.json`` of a save: its claim, the compact layout's
  merge, the commit, the clean-up after a failure.
- :mod:`.lease`: the pending root's lease: who is saving, whether that save may still
  run, a survivor's removal of a save whose rank 0 was lost.
- :mod:`.background`: ``save_async``: staging to host memory and the background worker.
- :mod:`.guard`: overlapped staging: the copies left until after ``save_async`` returns, and the
  optimizer step pre-hooks that hold back the updates racing them.
- :mod:`.writer`: ``save_async``'s writer process: the shared staging, the message, the
  process's lifetime, the ranks' writers' own group.

May import: :mod:`tsckpt._options`, the packages below it (``_formats`` excepted),
``tree`` and the foundations; never :mod:`tsckpt._read` (a sibling) or anything above.
The layers are contracts in ``pyproject.toml`` (import-linter).
"""
