"""The process's resources while a verb runs: memory, device copies, work in flight.

Owns:

- :mod:`.memory`: heap pages given back to the system (and kept from piling up in reading
  threads' arenas: ``bound_heap``), the cyclic collector paused
  during a save or restore, fresh destination memory faulted in on a spare CPU,
  memory a restore would write checked against the process's read-only mappings.
- :mod:`.devicecopy`: copies between CUDA and host memory through reused page-locked
  memory (the bounded ring, ``save_async``'s slab).
- :mod:`.sharedmem`: one block of host memory shared with another process (an anonymous
  memory file): ``save_async``'s staging for its writer process.
- :mod:`.window`: ``Window``, the one bound on reads, writes and probes in flight.
- :mod:`.fork`: refusing to run in a child forked after tsckpt was used.
- :mod:`.progress`: progress bars (rank 0) and each verb's closing log line.
- :mod:`.threads`: short jobs handed to kept threads (a call never waits for a thread to start).

May import: :mod:`tsckpt._storage` and the foundations.
"""
