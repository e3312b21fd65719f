"""Casts on restore: where each dtype sits in numpy's ``casting=`` order, and
which stored values a cast would lose.

Every logical dtype has a kind, ordered ``b`` (bool) < ``u`` < ``i`` < ``f``
(every float: IEEE, bfloat16, the float8 and float4 formats) < ``c`` (complex,
complex32 included), plus ``V`` for the raw-bit dtypes (bits8, float4_e2m1fn_x2,
...), which have no numeric value and cast to nothing else. A cast is *safe*
when every value of the stored dtype is exactly a value of the target (stricter
than numpy for int64 -> float64), *same_kind* when it is safe or the target's
kind is not below the stored one, and *unsafe* otherwise. :func:`check_cast`
decides which casts a ``casting=`` allows, from these facts, before anything is
read; :class:`CastCheck` checks the values a cast that may lose some reads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from .._errors import LeafTypeError, LossyCastError
from . import dtypes as _dtypes

from .lazytorch import is_dtype

CASTINGS = ("no", "equiv", "safe", "same_kind", "unsafe")
_KINDS = "buifc"
_COMPONENT = {"complex32": "float16", "complex64": "float32", "complex128": "float64"}
_KIND_NAMES = {"b": "bool", "u": "unsigned integer", "i": "integer", "f": "float", "c": "complex"}
_NUMPY_FLOATS = (np.float16, np.float32, np.float64)
_NUMPY_INTS = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
BLOCK = 1 << 18  # elements checked at a time: the check's own memory stays a few MiB


def check_casting(casting: str) -> str:
    """``casting`` itself, or a ValueError naming the choices (checked before any work)."""
    if casting not in CASTINGS:
        raise ValueError(f"casting must be one of {', '.join(map(repr, CASTINGS))}, not {casting!r}")
    return casting


@dataclasses.dataclass(frozen=True)
class Info:
    """What casting needs to know of one logical dtype."""

    name: str
    kind: str  # b u i f c, or V (raw bits)
    lo: float = 0  # ints: the range; floats: -max (0 when unsigned)
    hi: float = 0  # ints: the range; floats: the largest finite value
    bits: int = 0  # floats: significant bits (mantissa + 1)
    emin: int = 0  # floats: exponent of the smallest normal value
    signed: bool = True
    zero: bool = True  # floats: has a zero (float8_e8m0fnu has none)
    inf: bool = True
    nan: bool = True
    component: str = ""  # complex: the dtype of its real and imaginary parts


@functools.lru_cache(maxsize=None)
def info(name: str) -> Info:
    if name == "bool":
        return Info(name, "b", 0, 1)
    if name in _COMPONENT:
        return Info(name, "c", component=_COMPONENT[name])
    if _dtypes.storage_dtype(name) != name:
        return Info(name, "V")
    dt = _dtypes.numpy_dtype(name)
    if name.startswith(("int", "uint")):
        ii = ml_dtypes.iinfo(dt)
        return Info(name, "u" if name.startswith("u") else "i", int(ii.min), int(ii.max))
    fi = ml_dtypes.finfo(dt)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        probe = np.array([np.inf, np.nan, 0.0, -1.0]).astype(dt).astype(np.float64)
    signed = bool(probe[3] == -1.0)
    hi = float(fi.max)
    return Info(
        name, "f", -hi if signed else 0.0, hi, int(fi.nmant) + 1, int(fi.minexp),
        signed=signed, zero=bool(probe[2] == 0), inf=bool(np.isinf(probe[0])), nan=bool(np.isnan(probe[1])),
    )


def _safe(s: Info, d: Info) -> bool:
    """Every value of ``s`` is exactly a value of ``d``."""
    if s.name == d.name:
        return True
    if "V" in (s.kind, d.kind):
        return False
    if s.kind == "c":
        return d.kind == "c" and _safe(info(s.component), info(d.component))
    if d.kind == "c":
        return _safe(s, info(d.component))
    if d.kind == "b":
        return False
    if s.kind == "b":
        return d.zero
    if s.kind in "ui":
        if d.kind in "ui":
            return d.lo <= s.lo and s.hi <= d.hi
        return max(-s.lo, s.hi) <= min(2**d.bits, d.hi) and (d.signed or s.lo >= 0) and d.zero
    if d.kind != "f":
        return False
    # as many significant bits, and a smallest step (subnormal) no larger
    return d.bits >= s.bits and s.emin - s.bits >= d.emin - d.bits and _range_kept(s, d)


def _range_kept(s: Info, d: Info) -> bool:
    """Float to float: no value of ``s`` is beyond what ``d`` represents (up to rounding)."""
    return (
        d.hi >= s.hi
        and (d.signed or not s.signed)
        and (d.zero or not s.zero)
        and (d.inf or not s.inf)
        and (d.nan or not s.nan)
    )


def level(stored: str, target: str) -> str | None:
    """The least permissive casting that allows ``stored`` -> ``target`` ("no", "safe",
    "same_kind" or "unsafe"); None when no casting does (raw bits)."""
    if stored == target:
        return "no"
    s, d = info(stored), info(target)
    if "V" in (s.kind, d.kind):
        return None
    if _safe(s, d):
        return "safe"
    return "same_kind" if _KINDS.index(d.kind) >= _KINDS.index(s.kind) else "unsafe"


def can_lose(stored: str, target: str) -> bool:
    """Whether a cast can change a stored value beyond rounding a float to a lower precision
    (so the values read need checking)."""
    s, d = info(stored), info(target)
    if s.kind == "c" and d.kind == "c":
        s, d = info(s.component), info(d.component)
    elif d.kind == "c" and s.kind != "c":
        d = info(d.component)
    if s.kind == "f" and d.kind == "f":
        return not _range_kept(s, d)
    return not _safe(s, d)


def kind_name(name: str) -> str:
    return _KIND_NAMES.get(info(name).kind, "raw bits")


# ---- the values a cast loses ---------------------------------------------------------


def _int_mask(a: np.ndarray, d: Info) -> np.ndarray | None:
    """Integers (any int dtype) that ``d`` does not hold exactly."""
    if a.dtype.type not in _NUMPY_INTS:  # ml_dtypes' int4
        a = a.astype(np.int64)
    lo, hi = int(a.min()), int(a.max())
    if d.kind == "b":
        return None if lo >= 0 and hi <= 1 else (a != 0) & (a != 1)
    if d.kind in "ui":
        return None if d.lo <= lo and hi <= d.hi else (a < d.lo) | (a > d.hi)
    exact = min(2**d.bits, math.floor(d.hi))
    if max(-lo, hi) <= exact and (d.signed or lo >= 0) and (d.zero or lo > 0 or hi < 0):
        return None
    neg = a < 0
    u = a.astype(np.uint64)  # two's complement: the magnitude of a negative value is ~u + 1
    mag = np.where(neg, ~u + np.uint64(1), u)
    odd = mag // np.maximum(mag & (~mag + np.uint64(1)), np.uint64(1))  # without its trailing zero bits
    mask = (odd >= 2**d.bits) | (mag > math.floor(d.hi))
    if not d.signed:
        mask |= neg
    if not d.zero:
        mask |= mag == 0
    return mask


@functools.lru_cache(maxsize=None)
def _byte_floats(dtype: np.dtype) -> np.ndarray:
    """Every value of a one-byte float dtype, as float32, indexed by its bits."""
    with np.errstate(all="ignore"):
        return np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)


def _as_float32(a: np.ndarray) -> np.ndarray:
    """ml_dtypes floats as float32 (exact): numpy's reductions are many times faster there."""
    if a.dtype.itemsize == 1:  # float8, float4: a table lookup beats their casts
        return np.take(_byte_floats(a.dtype), a.view(np.uint8))
    return a.astype(np.float32)


def _float_mask(a: np.ndarray, s: Info, d: Info) -> np.ndarray | None:
    """Floats that ``d`` does not hold up to rounding (floats into floats, ints or bool)."""
    if a.dtype.type not in _NUMPY_FLOATS:
        a = _as_float32(a)
    if d.kind == "f":
        lo, hi = float(np.fmin.reduce(a)), float(np.fmax.reduce(a))  # NaN only when all are NaN
        if (
            d.lo <= lo and hi <= d.hi
            and (d.zero or lo > 0 or hi < 0)
            and (d.nan or not s.nan or not np.isnan(a).any())
        ):
            return None
    x = a.astype(np.float64)
    if d.kind == "b":
        return (x != 0) & (x != 1)
    if d.kind in "ui":
        return ~np.isfinite(x) | (x != np.trunc(x)) | (x < d.lo) | (x >= d.hi + 1)
    mask = np.isfinite(x) & ((x < d.lo) | (x > d.hi))
    if not d.zero:
        mask |= x == 0
    if not d.inf:
        mask |= np.isinf(x)
    if not d.nan:
        mask |= np.isnan(x)
    return mask


def _real_mask(a: np.ndarray, s: Info, d: Info) -> np.ndarray | None:
    if s.kind == "b":
        a, s = a.view(np.uint8), info("uint8")
    if s.kind in "ui":
        return _int_mask(a, d)
    return _float_mask(a, s, d)


def _parts(a: np.ndarray, stored: str) -> tuple[np.ndarray, np.ndarray]:
    """Real and imaginary parts of a block of a complex dtype (complex32: float16 pairs)."""
    if stored == "complex32":
        return a[:, 0], a[:, 1]
    return a.real, a.imag


def lost_mask(a: np.ndarray, stored: str, target: str) -> np.ndarray | None:
    """Which elements of ``a`` (a flat block in the storage dtype of ``stored``; complex32:
    (n, 2)) the cast to ``target`` loses; None when it loses none."""
    s, d = info(stored), info(target)
    if s.kind != "c":
        return _real_mask(a, s, info(d.component) if d.kind == "c" else d)
    re, im = _parts(a, stored)
    comp = info(s.component)
    if d.kind == "c":
        masks = [_real_mask(re, comp, info(d.component)), _real_mask(im, comp, info(d.component))]
    else:
        masks = [_real_mask(re, comp, d), im != 0]
    found = [m for m in masks if m is not None]
    return None if not found else found[0] if len(found) == 1 else found[0] | found[1]


def _why(v: Any, s: Info, d: Info) -> str:
    """Why the real value ``v`` of dtype ``s`` is lost in ``d``."""
    if d.kind == "b":
        return "is neither 0 nor 1"
    if d.kind in "ui":
        where = f"{d.name}'s range [{int(d.lo)}, {int(d.hi)}]"
        return f"is not an integer in {where}" if s.kind == "f" else f"is outside {where}"
    if isinstance(v, float) and math.isnan(v):
        return f"has no {d.name} value ({d.name} has no NaN)"
    if isinstance(v, float) and math.isinf(v):
        return f"has no {d.name} value ({d.name} has no infinity)"
    if v < 0 and not d.signed:
        return f"is negative; {d.name} has no negative values"
    if v == 0 and not d.zero:
        return f"has no {d.name} value ({d.name} has no zero)"
    if abs(v) > d.hi:
        return f"is beyond {d.name}'s largest finite value {d.hi:g}"
    return f"is not exactly representable in {d.name} ({d.bits} significant bits)"


def _value(a: np.ndarray, stored: str) -> Any:
    """One element (a block of length 1) as a Python number."""
    s = info(stored)
    if s.kind == "c":
        re, im = _parts(a, stored)
        return complex(float(re[0]), float(im[0]))
    if s.kind == "f":
        return float(a[0])
    return int(a.astype(np.int64)[0]) if a.dtype.type not in _NUMPY_INTS + (np.bool_,) else int(a[0])


def _reason(a: np.ndarray, stored: str, target: str) -> str:
    """Why the element of ``a`` (a block of length 1) is lost."""
    s, d = info(stored), info(target)
    if s.kind != "c":
        return _why(_value(a, stored), s, info(d.component) if d.kind == "c" else d)
    re, im = _parts(a, stored)
    comp, dc = info(s.component), info(d.component) if d.kind == "c" else d
    if d.kind != "c" and im[0] != 0:
        return f"has a nonzero imaginary part, which the real {d.name} target drops"
    mask = _real_mask(re, comp, dc)
    which, part = ("real", re) if mask is not None and mask.any() else ("imaginary", im)
    return f"(its {which} part) {_why(float(part[0]), comp, dc)}"


class CastCheck:
    """The value check of one leaf's cast, run on every block as it is read.

    With any casting but "unsafe" the first block holding a lost value raises
    :class:`LossyCastError`; with "unsafe" the losses are counted for one warning
    (:meth:`warning`) once the leaf is read."""

    def __init__(self, path: str, stored: str, target: str, casting: str) -> None:
        self.path, self.stored, self.target, self.casting = path, stored, target, casting
        self.checked = 0  # elements checked
        self.lost = 0
        self.first: tuple[list[int], Any, str] | None = None  # index, value, why
        self.fix = f'Pass casting="unsafe" to cast anyway, or restore into a target of the stored dtype {stored}'

    def check(self, raw: np.ndarray, offsets: Sequence[int]) -> None:
        """Check a block read in the storage dtype whose first element is at ``offsets``."""
        pairs = self.stored == "complex32"
        shape = raw.shape[:-1] if pairs else raw.shape
        flat = raw.reshape(-1, 2) if pairs else raw.reshape(-1)
        lost = 0
        with np.errstate(all="ignore"):
            for i in range(0, len(flat), BLOCK):
                mask = lost_mask(flat[i : i + BLOCK], self.stored, self.target)
                n = 0 if mask is None else int(np.count_nonzero(mask))
                if mask is not None and n and self.first is None:
                    j = i + int(np.argmax(mask))
                    one = flat[j : j + 1]
                    index = [int(o) + int(k) for o, k in zip(offsets, np.unravel_index(j, shape))]
                    self.first = (index, _value(one, self.stored), _reason(one, self.stored, self.target))
                lost += n
        self.checked += len(flat)
        self.lost += lost
        if lost and self.casting != "unsafe":
            raise LossyCastError(self.error())

    def error(self) -> str:
        index, value, why = self._first()
        return (
            f"'{self.path}': stored {self.stored} values do not fit the {self.target} target: {value!r} at index "
            f"{index} {why}; {self.lost} such value{'s' if self.lost != 1 else ''} among the first {self.checked} "
            f"read. {self.fix}"
        )

    def warning(self) -> str | None:
        """The warning of an "unsafe" cast that lost values, None when it lost none."""
        if not self.lost:
            return None
        index, value, why = self._first()
        return (
            f"'{self.path}': casting=\"unsafe\" changed {self.lost} of the {self.checked} stored {self.stored} "
            f"values read into the {self.target} target; the first, {value!r} at index {index}, {why}"
        )

    def _first(self) -> tuple[list[int], Any, str]:
        if self.first is None:
            raise RuntimeError("no lost value was recorded")
        return self.first


def _is_stored_dtype(target: Any, stored: str) -> bool:
    """``target`` is torch's dtype of the stored name itself (one lookup, no numpy dtype made)."""
    return is_dtype(target) and target is _dtypes.torch_dtypes().get(stored)


def check_cast(path: str, stored: str, target: Any, *, casting: str) -> CastCheck | None:
    """Whether ``casting`` lets a restore cast the stored dtype into ``target`` (a torch or
    numpy dtype): raises :class:`LeafTypeError` before anything is read when it does not.
    Returns the check to run on the values read when the cast may lose some, None when it
    cannot (same dtype, or a cast that keeps every value up to a float's rounding)."""
    if _is_stored_dtype(target, stored):  # the usual case: no cast
        return None
    is_torch = is_dtype(target)
    if is_torch:
        name = _dtypes.torch_name(target) if _dtypes.is_supported_torch(target) else None
        shown, swapped = str(target), False
    else:
        dt = np.dtype(target)
        name, shown, swapped = _dtypes.numpy_name(dt.newbyteorder("=")), str(dt), not dt.isnative
    if name is None:
        raise LeafTypeError(
            f"'{path}': the target dtype {shown} is not one tsckpt restores into; use a target of the "
            f"stored dtype {stored} or another dtype tsckpt stores"
        )
    storage = _dtypes.storage_dtype(stored)
    raw = storage != stored and stored != "complex32"  # raw bits: no numeric value to cast
    # torch has no copy kernels for int4, and no dtype at all for some ml_dtypes
    if is_torch and name != stored and not raw and (stored not in _dtypes.torch_dtypes() or stored == "int4"):
        raise LeafTypeError(
            f"'{path}': stored dtype {stored} cannot be cast to {target} by torch; use a {stored} tensor "
            "or a numpy array as the target"
        )
    needed = level(stored, name)
    if needed == "no" and swapped:
        needed = "equiv"
    if needed is not None and CASTINGS.index(casting) >= CASTINGS.index(needed):
        return CastCheck(path, stored, name, casting) if can_lose(stored, name) else None
    if needed is None:
        raise LeafTypeError(
            f"'{path}': stored dtype {stored} cannot be restored into the {shown} target: raw bits cast to no "
            "other dtype; use a target of the stored dtype"
        )
    if info(stored).kind == "c" and info(name).kind != "c":
        raise LeafTypeError(
            f"'{path}': stored dtype {stored} is complex but the target is {shown}; casting would drop the "
            'imaginary part. Use a complex target, or casting="unsafe" to drop it'
        )
    why = {
        "equiv": "the byte order differs",
        "safe": "the dtypes differ",
        "same_kind": "not every stored value is exactly a target value",
        "unsafe": f"{kind_name(stored)} to {kind_name(name)}",
    }[needed]
    fix = f'"{needed}"' + (" to cast and check the values read" if needed == "same_kind" else "")
    raise LeafTypeError(
        f"'{path}': casting=\"{casting}\" refuses stored {stored} into the {shown} target ({why}); restore into "
        f"a target of the stored dtype {stored}, or pass casting={fix}"
    )
