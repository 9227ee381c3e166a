"""Portable column types: JSON (`json` on Postgres), 64-bit keys, and packed per-token arrays."""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Dialect, Integer, LargeBinary
from sqlalchemy.types import TypeDecorator

from storage.packing import (
    BoolArray,
    FloatArray,
    FloatsLike,
    IntArray,
    IntsLike,
    MaskLike,
    pack_float32,
    pack_int32,
    pack_mask,
    unpack_float32,
    unpack_int32,
    unpack_mask,
)

# SQL NULL, never the JSON literal null, for absent values. Postgres gets `json`, not `jsonb`: jsonb
# rejects the escape \u0000, and model output (hence request/response JSON) may contain NUL characters.
JsonType = JSON(none_as_null=True)

# SQLite only autoincrements an INTEGER PRIMARY KEY.
BigIntKey = BigInteger().with_variant(Integer(), "sqlite")


class Int32Array(TypeDecorator[IntArray]):
    """Token ids or versions, stored as `<i4` bytes (BLOB/bytea); reads back as an int32 array."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: IntsLike | None, dialect: Dialect) -> bytes | None:
        return None if value is None else pack_int32(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> IntArray | None:
        return None if value is None else unpack_int32(bytes(value))


class Float32Array(TypeDecorator[FloatArray]):
    """Logprobs, stored as `<f4` bytes (BLOB/bytea); reads back as a float32 array."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: FloatsLike | None, dialect: Dialect) -> bytes | None:
        return None if value is None else pack_float32(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> FloatArray | None:
        return None if value is None else unpack_float32(bytes(value))


class MaskArray(TypeDecorator[BoolArray]):
    """A loss mask, one byte per token (BLOB/bytea); reads back as a bool array."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: MaskLike | None, dialect: Dialect) -> bytes | None:
        return None if value is None else pack_mask(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> BoolArray | None:
        return None if value is None else unpack_mask(bytes(value))
