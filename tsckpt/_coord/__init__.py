"""Coordination between the processes of one job: no I/O, no knowledge of the format.

Owns:

- :mod:`.protocol`: the ``Coordinator`` protocol, the single-process case, agreeing on a
  failure (when one rank fails, every rank raises), round trips through rank 0.
- :mod:`.torchdist`: ``torch.distributed`` coordination over a dedicated gloo group.
- :mod:`.jaxdist`: a multi-process JAX job, through the key-value store of JAX's
  coordination service.

May import: the foundations only (``_errors``, ``_base``).
"""
