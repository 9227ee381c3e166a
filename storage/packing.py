"""Pack per-token arrays as little-endian numpy buffers for BLOB/bytea columns, and back, bit-exactly."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

INT32 = np.dtype("<i4")
FLOAT32 = np.dtype("<f4")
MASK = np.dtype("u1")

IntArray = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float32]
BoolArray = npt.NDArray[np.bool_]

IntsLike = Sequence[int] | npt.NDArray[np.integer[Any]]
FloatsLike = Sequence[float] | npt.NDArray[np.floating[Any]]
MaskLike = Sequence[bool] | Sequence[int] | npt.NDArray[np.bool_] | npt.NDArray[np.integer[Any]]

_INT32_MIN, _INT32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max

_PYTHON_INT_TYPES = frozenset((int, bool))


def _int32_bytes_of_python_ints(values: IntsLike) -> bytes | None:
    """`<i4` bytes of a plain list/tuple of Python ints via struct: much faster than numpy for the short
    lists most calls carry (numpy's min/max reductions dominate there), level for long ones. None wherever
    numpy must decide, so that its results and errors stay the only ones: ndarrays and other inputs;
    any element type but exact int or bool (struct also takes numpy scalars and anything with
    __index__, which numpy promotes or rejects differently); an all-bool list (numpy: dtype bool,
    TypeError; mixed with ints it is int64, as here); a value outside int32 (numpy: ValueError, or
    TypeError where a huge int makes its dtype object)."""
    if type(values) is not list and type(values) is not tuple:
        return None
    types = set(map(type, values))
    if not types <= _PYTHON_INT_TYPES or types == {bool}:
        return None
    try:
        return struct.pack(f"<{len(values)}i", *values)
    except struct.error:
        return None


def _one_dimensional(values: object, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    return array


def pack_int32(values: IntsLike) -> bytes:
    """Token ids or policy versions → `<i4` bytes. Values outside int32 are an error, never wrapped."""
    packed = _int32_bytes_of_python_ints(values)
    if packed is not None:
        return packed
    array = _one_dimensional(values, "int32 array")
    if array.size == 0:
        return b""
    if array.dtype.kind == "b" or array.dtype.kind not in "iu":
        raise TypeError(f"int32 array needs integers, got dtype {array.dtype}")
    if array.min() < _INT32_MIN or array.max() > _INT32_MAX:
        raise ValueError("value outside the int32 range")
    return array.astype(INT32, copy=False).tobytes()


def unpack_int32(buffer: bytes) -> IntArray:
    """`<i4` bytes → a writable native int32 array."""
    return np.frombuffer(buffer, dtype=INT32).astype(np.int32)


def pack_float32(values: FloatsLike) -> bytes:
    """Logprobs → `<f4` bytes. float32 input keeps its exact bits (NaN payloads, ±inf, -0.0);
    float64 input is rounded to the nearest float32, which is exact for values that were float32."""
    # No stdlib fast path here, unlike pack_int32: this path has no min/max reductions, and numpy's
    # discovery of a float list costs less than an exact-type check plus array('f') for long lists and
    # barely more for short ones, so a fast path would not pay for itself.
    array = _one_dimensional(values, "float32 array")
    if array.size == 0:
        return b""
    if array.dtype.kind not in "fiu":
        raise TypeError(f"float32 array needs numbers, got dtype {array.dtype}")
    return array.astype(FLOAT32, copy=False).tobytes()


def unpack_float32(buffer: bytes) -> FloatArray:
    """`<f4` bytes → a writable native float32 array with the stored bits."""
    return np.frombuffer(buffer, dtype=FLOAT32).astype(np.float32)


def pack_mask(values: MaskLike) -> bytes:
    """A loss mask (bools, or integers that are all 0 or 1) → one `u1` byte per token."""
    array = _one_dimensional(values, "mask")
    if array.size == 0:
        return b""
    if array.dtype.kind == "b":
        return array.astype(MASK).tobytes()
    if array.dtype.kind not in "iu":
        raise TypeError(f"mask needs bools or 0/1 integers, got dtype {array.dtype}")
    if not np.isin(array, (0, 1)).all():
        raise ValueError("mask values must be 0 or 1")
    return array.astype(MASK).tobytes()


def unpack_mask(buffer: bytes) -> BoolArray:
    """`u1` bytes → a bool array."""
    array = np.frombuffer(buffer, dtype=MASK)
    if array.size and array.max() > 1:
        raise ValueError("stored mask has a byte other than 0 or 1")
    return array.astype(np.bool_)
