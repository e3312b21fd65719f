"""jax.Array leaves, when jax is installed (it is never imported by tsckpt itself).

A jax.Array whose shards this process holds entirely is saved as one global
array; its dtype names match tsckpt's (bfloat16 and float8 through ml_dtypes,
as in jax itself). A restore target that is a jax.Array gets a new jax.Array
with the target's sharding and dtype.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._errors import LeafTypeError
from ._format import ArrayRecord
from ._casting import check_cast
from ._kinds import LeafKind, check_shape, host_empty, region_leaf, whole
from ._types import Dest, Local


def is_jax_array(x: Any) -> bool:
    mod = sys.modules.get("jax")
    return mod is not None and isinstance(x, mod.Array)


class JaxKind(LeafKind):
    def owns(self, leaf: Any) -> bool:
        return is_jax_array(leaf)

    def describe(self, path: str, leaf: Any) -> Local:
        if not leaf.is_fully_addressable:
            raise LeafTypeError(
                f"'{path}': jax.Array spans processes (not fully addressable); tsckpt coordinates ranks "
                "through torch.distributed. Gather it (jax.experimental.multihost_utils."
                "process_allgather) or save from a single process"
            )
        data = np.asarray(leaf)
        return region_leaf(path, data, data.shape, (0,) * data.ndim, "numpy")

    def destination(self, rec: ArrayRecord, path: str, leaf: Any, inplace: bool, casting: str) -> Dest:
        import jax

        check_shape(path, tuple(leaf.shape), rec.shape)
        cast = check_cast(path, rec.dtype, leaf.dtype, casting=casting)
        buf = host_empty(rec.shape, leaf.dtype)
        sharding = leaf.sharding
        return Dest(whole(rec, path), buf, None, finish=lambda a: jax.device_put(a, sharding), cast=cast)
