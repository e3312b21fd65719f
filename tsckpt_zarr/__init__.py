"""zarr-python data types for the arrays tsckpt writes that zarr-python lacks.

TensorStore and tsckpt store bfloat16, the float8 and float4 formats and int4 under
their own zarr v3 ``data_type`` names (docs/format.md lists them); zarr-python 3 has
no data type for them and refuses those arrays. This package gives it one per name,
reading each as the matching ml_dtypes array, bit for bit.

zarr-python 3.4 and newer load the classes by themselves, through the ``zarr.data_type``
entry points of the installed tsckpt. zarr-python 3.1 to 3.3 collect those entry points
but never load them: there, :func:`register` adds the classes.

It is a package of its own, beside :mod:`tsckpt`, because zarr-python imports it (at
its first data type lookup, in any process where tsckpt is installed, whatever array
it reads): that must cost no more than zarr, numpy and ml_dtypes, never torch or
TensorStore. Importing tsckpt never imports it, nor zarr.

Owns:

- :mod:`.dtypes`: the data type classes and :func:`register` (needs zarr-python 3.1+).

May import: zarr, numpy and ml_dtypes only (never :mod:`tsckpt`).
"""

from __future__ import annotations


def register() -> tuple[str, ...]:
    """Registers the data types with zarr-python and returns the names added.

    Needed with zarr-python 3.1 to 3.3, or where tsckpt is not installed (a source
    checkout on ``sys.path``); with an installed tsckpt, zarr-python 3.4+ loads them by
    itself. Names zarr-python already knows are left to it."""
    from .dtypes import register as _register

    return _register()
