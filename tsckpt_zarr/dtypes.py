"""zarr-python data types (``ZDType``) for bfloat16, the float8 and float4 formats and int4.

Each class reads and writes one zarr v3 ``data_type`` name exactly as TensorStore
spells it, as the ml_dtypes numpy type of the same name: chunk bytes are the
values' bytes (one byte each, bfloat16 two), so arrays come back bit for bit.

Fill values follow the zarr v3 rules for floats, and read to the same bits as
TensorStore reads them: a JSON number is rounded to the type as ml_dtypes rounds
it, ``"NaN"`` is the type's canonical NaN (the one ml_dtypes gives, which is also
the one zarr-extensions names), ``"Infinity"`` and ``"-Infinity"`` are cast like
numbers (to NaN or the largest value in types without infinities), and
``"0x..."`` gives the raw bits. Written back, a NaN other than the canonical one
keeps its bits as ``"0x..."``. int4 fill values are integers in [-8, 7]; a missing
chunk reads as that value with the upper 4 bits of each byte zero, as ml_dtypes
stores it (TensorStore sign-extends them; zarr-extensions leaves them free).

Only zarr format 3 names these types; zarr format 2 metadata has no name for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeGuard, overload

import ml_dtypes
import numpy as np
from zarr.core.common import JSON, ZarrFormat
from zarr.core.dtype import ZDType, data_type_registry
from zarr.core.dtype.common import DataTypeValidationError, DTypeJSON, HasEndianness, HasItemSize

_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_UINT: dict[int, np.dtype[Any]] = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16)}


@dataclass(frozen=True, kw_only=True)
class _MLDType(ZDType[np.dtype[Any], Any], HasItemSize):
    """One ml_dtypes type under its zarr v3 name (zarr format 3 only)."""

    scalar_type: ClassVar[type[np.generic]]
    dtype_cls: ClassVar[type[np.dtype[Any]]]
    _zarr_v3_name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "scalar_type" in cls.__dict__:
            cls.dtype_cls = type(np.dtype(cls.scalar_type))
            cls._zarr_v3_name = np.dtype(cls.scalar_type).name

    @property
    def item_size(self) -> int:
        return np.dtype(self.scalar_type).itemsize

    @classmethod
    def from_native_dtype(cls, dtype: Any) -> Any:
        if cls._check_native_dtype(dtype):
            return cls._from_native(dtype)
        raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected {np.dtype(cls.scalar_type)}")

    @classmethod
    def _from_native(cls, dtype: np.dtype[Any]) -> Any:
        return cls()

    def to_native_dtype(self) -> np.dtype[Any]:
        return np.dtype(self.scalar_type)

    @classmethod
    def _from_json_v2(cls, data: DTypeJSON) -> Any:
        raise DataTypeValidationError(f"{cls._zarr_v3_name} has no zarr format 2 name; it exists in zarr format 3 only")

    @classmethod
    def _from_json_v3(cls, data: DTypeJSON) -> Any:
        if data == cls._zarr_v3_name:
            return cls()
        raise DataTypeValidationError(f"Invalid JSON representation of {cls.__name__}: {data!r}, expected {cls._zarr_v3_name!r}")

    @overload
    def to_json(self, zarr_format: Literal[2]) -> Any: ...

    @overload
    def to_json(self, zarr_format: Literal[3]) -> str: ...

    def to_json(self, zarr_format: ZarrFormat) -> Any:
        if zarr_format == 3:
            return self._zarr_v3_name
        raise ValueError(
            f"zarr format {zarr_format} has no name for the data type {self._zarr_v3_name}; create the array with zarr_format=3"
        )

    def default_scalar(self) -> Any:
        return self.scalar_type(0)

    def _bits(self, value: Any) -> int:
        """The raw bits of one value of this type, as an unsigned integer."""
        return int(np.asarray(value, dtype=self.scalar_type).view(_UINT[self.item_size]))

    def _from_bits(self, bits: int) -> Any:
        return np.asarray(bits, dtype=_UINT[self.item_size]).view(self.scalar_type)[()]


@dataclass(frozen=True, kw_only=True)
class _MLFloat(_MLDType):
    """A floating-point ml_dtypes type: fill values as zarr v3 floats."""

    # Whether readers agree on the bits a JSON number means, so fill values are written as numbers
    _numbers_exact: ClassVar[bool] = True

    def _check_scalar(self, data: object) -> TypeGuard[Any]:
        if isinstance(data, str):
            return data in _SPECIAL
        return isinstance(data, (int, float, np.integer, np.floating)) and not isinstance(data, bool) or (
            isinstance(data, np.generic) and type(data).__module__ == "ml_dtypes"
        )

    def cast_scalar(self, data: object) -> Any:
        if not self._check_scalar(data):
            raise TypeError(f"Cannot convert {data!r} ({type(data).__name__}) to a scalar of the data type {self._zarr_v3_name}")
        if isinstance(data, str):
            data = _SPECIAL[data]
        return self.scalar_type(data)  # type: ignore[call-arg]

    def from_json_scalar(self, data: JSON, *, zarr_format: ZarrFormat) -> Any:
        if isinstance(data, str) and data.startswith("0x"):
            try:
                bits = int(data[2:], 16)
            except ValueError:
                bits = -1
            if not 0 <= bits < 256**self.item_size:
                raise TypeError(
                    f"Invalid fill value {data!r} for {self._zarr_v3_name}: expected '0x' and the raw bits, "
                    f"at most {2 * self.item_size} hex digits"
                )
            return self._from_bits(bits)
        if isinstance(data, (int, float, str)) and self._check_scalar(data):
            return self._from_json_number(data)
        raise TypeError(
            f"Invalid fill value {data!r} for {self._zarr_v3_name}: expected a number, 'NaN', 'Infinity', "
            "'-Infinity' or '0x' and the raw bits"
        )

    def _from_json_number(self, data: float | str) -> Any:
        return self.cast_scalar(data)

    def to_json_scalar(self, data: object, *, zarr_format: ZarrFormat) -> JSON:
        value = self.cast_scalar(data)
        number = float(value)
        bits = self._bits(value)
        if math.isnan(number) and bits == self._bits(math.nan):
            return "NaN"
        if math.isinf(number):
            return "Infinity" if number > 0 else "-Infinity"
        if math.isnan(number) or not self._numbers_exact:
            return f"0x{bits:0{2 * self.item_size}x}"
        return number


@dataclass(frozen=True, kw_only=True)
class _MLInt(_MLDType):
    """A signed integer ml_dtypes type: fill values as JSON integers in its range."""

    def _check_scalar(self, data: object) -> TypeGuard[Any]:
        if isinstance(data, bool):
            return False
        if isinstance(data, (float, np.floating)):
            data = int(data) if math.isfinite(data) and data == int(data) else None
        elif isinstance(data, np.generic) and type(data).__module__ == "ml_dtypes":
            data = int(data)  # type: ignore[call-overload]
        if not isinstance(data, (int, np.integer)):
            return False
        info = ml_dtypes.iinfo(self.scalar_type)
        return bool(info.min <= data <= info.max)

    def cast_scalar(self, data: object) -> Any:
        if not self._check_scalar(data):
            info = ml_dtypes.iinfo(self.scalar_type)
            raise TypeError(
                f"Cannot convert {data!r} ({type(data).__name__}) to a scalar of the data type {self._zarr_v3_name}: "
                f"expected an integer in [{info.min}, {info.max}]"
            )
        return self.scalar_type(int(data))  # type: ignore[call-overload, call-arg]

    def from_json_scalar(self, data: JSON, *, zarr_format: ZarrFormat) -> Any:
        if isinstance(data, (int, float)) and self._check_scalar(data):
            return self.cast_scalar(data)
        info = ml_dtypes.iinfo(self.scalar_type)
        raise TypeError(f"Invalid fill value {data!r} for {self._zarr_v3_name}: expected an integer in [{info.min}, {info.max}]")

    def to_json_scalar(self, data: object, *, zarr_format: ZarrFormat) -> JSON:
        return int(self.cast_scalar(data))


@dataclass(frozen=True, kw_only=True)
class BFloat16(_MLFloat, HasEndianness):
    """``bfloat16``: the upper half of an IEEE binary32 (8 exponent, 7 mantissa bits)."""

    scalar_type = ml_dtypes.bfloat16

    @classmethod
    def _from_native(cls, dtype: np.dtype[Any]) -> Any:
        return cls(endianness="big" if dtype.byteorder == ">" else "little")

    def to_native_dtype(self) -> np.dtype[Any]:
        return np.dtype(self.scalar_type).newbyteorder("<" if self.endianness == "little" else ">")


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(_MLFloat):
    """``float8_e4m3fn``: OCP FP8 E4M3, no infinities, NaN is S.1111.111."""

    scalar_type = ml_dtypes.float8_e4m3fn


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FNUZ(_MLFloat):
    """``float8_e4m3fnuz``: E4M3 with exponent bias 8, no infinities, no -0, NaN is 0x80."""

    scalar_type = ml_dtypes.float8_e4m3fnuz


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(_MLFloat):
    """``float8_e5m2``: OCP FP8 E5M2, IEEE-like with infinities and NaNs."""

    scalar_type = ml_dtypes.float8_e5m2


@dataclass(frozen=True, kw_only=True)
class Float8E5M2FNUZ(_MLFloat):
    """``float8_e5m2fnuz``: E5M2 with exponent bias 16, no infinities, no -0, NaN is 0x80."""

    scalar_type = ml_dtypes.float8_e5m2fnuz


@dataclass(frozen=True, kw_only=True)
class Float8E8M0FNU(_MLFloat):
    """``float8_e8m0fnu``: an unsigned power of two (the OCP MX block scale), NaN is 0xff.

    It has no zero: a fill value of 0 (what tsckpt writes) reads as its smallest value,
    bits 0x00, as TensorStore and torch read it and as the zero bytes tsckpt pads edge
    chunks with (ml_dtypes would round 0 to NaN). Other numbers round as ml_dtypes
    rounds them; TensorStore 0.1.86 reads and writes numbers for this type with other
    bits, so fill values are written as ``"0x.."`` bits, which every reader agrees on."""

    scalar_type = ml_dtypes.float8_e8m0fnu
    _numbers_exact = False

    def _from_json_number(self, data: float | str) -> Any:
        if not isinstance(data, str) and data == 0:
            return self._from_bits(0)
        return self.cast_scalar(data)


@dataclass(frozen=True, kw_only=True)
class Float8E3M4(_MLFloat):
    """``float8_e3m4``: IEEE-like, 3 exponent and 4 mantissa bits."""

    scalar_type = ml_dtypes.float8_e3m4


@dataclass(frozen=True, kw_only=True)
class Float8E4M3B11FNUZ(_MLFloat):
    """``float8_e4m3b11fnuz``: E4M3 with exponent bias 11, no infinities, no -0, NaN is 0x80."""

    scalar_type = ml_dtypes.float8_e4m3b11fnuz


@dataclass(frozen=True, kw_only=True)
class Float4E2M1FN(_MLFloat):
    """``float4_e2m1fn``: OCP MX FP4 E2M1, no infinities or NaN; one value per byte, in its low 4 bits."""

    scalar_type = ml_dtypes.float4_e2m1fn


@dataclass(frozen=True, kw_only=True)
class Int4(_MLInt):
    """``int4``: a signed integer in [-8, 7]; one value per byte, in its low 4 bits."""

    scalar_type = ml_dtypes.int4


# Every data type of this module, in the order docs/format.md lists them.
DATA_TYPES: tuple[type[_MLDType], ...] = (
    BFloat16,
    Float8E4M3FN,
    Float8E4M3FNUZ,
    Float8E5M2,
    Float8E5M2FNUZ,
    Float8E8M0FNU,
    Float8E3M4,
    Float8E4M3B11FNUZ,
    Float4E2M1FN,
    Int4,
)


def register() -> tuple[str, ...]:
    """Adds each data type whose name zarr-python does not know yet; returns the names added."""
    added = []
    for cls in DATA_TYPES:
        if cls._zarr_v3_name not in data_type_registry.contents:
            data_type_registry.register(cls._zarr_v3_name, cls)  # type: ignore[arg-type]
            added.append(cls._zarr_v3_name)
    return tuple(added)
