"""Packed per-token arrays round-trip bit-exactly (hypothesis is not installed: seeded random cases)."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy.dialects import postgresql, sqlite

from storage.packing import (
    _int32_bytes_of_python_ints,
    pack_float32,
    pack_int32,
    pack_mask,
    unpack_float32,
    unpack_int32,
    unpack_mask,
)
from storage.types import Float32Array, Int32Array, MaskArray

I32 = np.iinfo(np.int32)
SEEDS = range(20)


def _bits(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize(
    "values",
    [[], [0], [1, -1, 2], [I32.min, I32.max], list(range(-5, 50_000, 7))],
)
def test_int32_round_trip(values: list[int]) -> None:
    packed = pack_int32(values)
    assert len(packed) == 4 * len(values)
    out = unpack_int32(packed)
    assert out.dtype == np.int32
    assert out.tolist() == values


@pytest.mark.parametrize("seed", SEEDS)
def test_int32_random_round_trip(seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = rng.integers(I32.min, I32.max, size=int(rng.integers(0, 2000)), dtype=np.int64, endpoint=True)
    assert np.array_equal(unpack_int32(pack_int32(values)), values)


def test_int32_is_little_endian_whatever_the_input_byte_order() -> None:
    big = np.array([1, 256], dtype=">i4")
    assert pack_int32(big) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert unpack_int32(pack_int32(big)).tolist() == [1, 256]


@pytest.mark.parametrize("values", [[I32.max + 1], [I32.min - 1], [2**40]])
def test_int32_out_of_range_is_an_error_not_a_wrap(values: list[int]) -> None:
    with pytest.raises(ValueError, match="int32 range"):
        pack_int32(values)


@pytest.mark.parametrize("values", [[0.5], [True, False], [[1, 2], [3, 4]]])
def test_int32_rejects_non_integers_and_shapes(values: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        pack_int32(values)  # type: ignore[arg-type]


def test_float32_special_values_keep_their_bits() -> None:
    quiet_nan = np.uint32(0x7FC00000)
    payload_nan = np.uint32(0x7FA00001)  # signalling NaN with a payload
    negative_nan = np.uint32(0xFFC00123)
    specials = np.array(
        [quiet_nan, payload_nan, negative_nan, 0xFF800000, 0x7F800000, 0x80000000, 0x00000001],
        dtype=np.uint32,
    ).view(np.float32)  # NaN, NaN, NaN, -inf, +inf, -0.0, smallest subnormal
    out = unpack_float32(pack_float32(specials))
    assert out.dtype == np.float32
    assert np.array_equal(_bits(out), _bits(specials))


@pytest.mark.parametrize("seed", SEEDS)
def test_float32_random_bit_patterns_round_trip(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, size=int(rng.integers(0, 2000)), dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)  # every pattern, NaNs with payloads included
    assert np.array_equal(_bits(unpack_float32(pack_float32(values))), bits)


def test_float32_from_python_floats_that_were_float32() -> None:
    logprobs = np.array([-0.125, -3.0e-8, -17.25, float("-inf")], dtype=np.float32)
    as_python = [float(x) for x in logprobs]  # what a JSON response carries
    assert np.array_equal(_bits(unpack_float32(pack_float32(as_python))), _bits(logprobs))


def test_empty_arrays_round_trip() -> None:
    assert pack_int32([]) == pack_float32([]) == pack_mask([]) == b""
    assert unpack_int32(b"").shape == unpack_float32(b"").shape == unpack_mask(b"").shape == (0,)
    assert unpack_mask(b"").dtype == np.bool_


@pytest.mark.parametrize("mask", [[True, False, True], [1, 0, 0, 1], np.array([0, 1], dtype=np.uint8)])
def test_mask_round_trip(mask: object) -> None:
    out = unpack_mask(pack_mask(mask))  # type: ignore[arg-type]
    assert out.dtype == np.bool_
    assert out.tolist() == [bool(x) for x in mask]  # type: ignore[attr-defined]
    assert len(pack_mask(mask)) == len(out)  # type: ignore[arg-type]


def test_mask_rejects_values_other_than_zero_and_one() -> None:
    with pytest.raises(ValueError, match="0 or 1"):
        pack_mask([0, 2])
    with pytest.raises(ValueError, match="0 or 1"):
        unpack_mask(b"\x00\x02")


@pytest.mark.parametrize("dialect", [sqlite.dialect(), postgresql.dialect()])
def test_column_types_pack_on_bind_and_unpack_on_read(dialect: object) -> None:
    ids, logprobs, mask = [5, -1, I32.max], np.array([-0.5, np.nan], dtype=np.float32), [True, False]
    for column_type, value, check in (
        (Int32Array(), ids, lambda out: out.tolist() == ids),
        (Float32Array(), logprobs, lambda out: np.array_equal(_bits(out), _bits(logprobs))),
        (MaskArray(), mask, lambda out: out.tolist() == mask),
    ):
        stored = column_type.process_bind_param(value, dialect)  # type: ignore[arg-type]
        assert isinstance(stored, bytes)
        assert check(column_type.process_result_value(memoryview(stored), dialect))  # type: ignore[arg-type]
        assert column_type.process_bind_param(None, dialect) is None  # type: ignore[arg-type]


# --- plain Python lists: pack_int32's struct fast path must agree with the numpy path, bytes and errors ---

F32 = np.finfo(np.float32)
INT_EDGES = [0, 1, -1, 255, 256, -256, 2**15, -(2**15), 2**24 + 1, I32.max, I32.min, I32.max - 1, I32.min + 1]
FLOAT_EDGES = [
    0.0,
    -0.0,
    float("inf"),
    float("-inf"),
    float("nan"),
    -float("nan"),
    float(F32.max),
    float(F32.max) * (1 + 2**-25),  # rounds down to the largest float32
    float(F32.max) * (1 + 2**-23),  # overflows to inf, as numpy's cast does
    1e39,
    -1e39,
    2.0**-149,  # smallest float32 subnormal
    2.0**-150,  # half of it: a tie, rounds to even (0.0)
    3 * 2.0**-150,  # 1.5x the smallest subnormal: a tie, rounds to even (2x)
    1e-46,
    float(F32.tiny),
    1.0 + 2**-24,  # halfway between two float32: rounds to even (1.0)
    1.0 + 3 * 2**-24,  # halfway: rounds to even (1.0 + 2**-22)
    0.1,
    -17.25,
]


def _outcome(pack: object, values: object) -> tuple[str, object]:
    """The bytes a packer returns, or the type and message of what it raises."""
    try:
        return ("bytes", pack(values))  # type: ignore[operator]
    except Exception as error:
        return (type(error).__name__, str(error))


def _random_ints(rng: np.random.Generator) -> list[int]:
    size = int(rng.choice([0, 1, 5, 12, 300, int(rng.integers(0, 600))]))
    picks = rng.integers(0, 3, size=size)
    values: list[int] = []
    for pick in picks:
        if pick == 0:
            values.append(int(rng.choice(INT_EDGES)))
        elif pick == 1:
            values.append(int(rng.integers(0, 200_000)))
        else:
            values.append(int(rng.integers(I32.min, I32.max, endpoint=True)))
    return values


def _random_floats(rng: np.random.Generator) -> list[float]:
    size = int(rng.choice([0, 1, 5, 12, 300, int(rng.integers(0, 600))]))
    picks = rng.integers(0, 4, size=size)
    bit_patterns = rng.integers(0, 2**64, size=size, dtype=np.uint64)
    values: list[float] = []
    for pick, bits in zip(picks, bit_patterns, strict=True):
        if pick == 0:
            values.append(float(rng.choice(FLOAT_EDGES)))
        elif pick == 1:
            values.append(float(rng.uniform(-30.0, 0.0)))  # a logprob
        elif pick == 2:
            values.append(float(np.uint64(bits).view(np.float64)))  # any float64, NaN payloads included
        else:
            scale = 2.0 ** int(rng.integers(-160, 140))  # float32 subnormals to float32 overflow
            values.append(float(rng.uniform(-1, 1)) * scale)
    return values


@pytest.mark.parametrize("seed", range(200))
def test_int32_plain_lists_take_the_fast_path_and_match_numpy(seed: int) -> None:
    values = _random_ints(np.random.default_rng(seed))
    reference = np.asarray(values).astype("<i4").tobytes() if values else b""
    fast = _int32_bytes_of_python_ints(values)
    assert fast is not None  # the comparison below would be vacuous if the fast path were skipped
    assert fast == reference
    as_array = np.asarray(values, dtype=np.int64)
    assert pack_int32(values) == pack_int32(tuple(values)) == pack_int32(as_array) == reference


@pytest.mark.parametrize("seed", range(200))
def test_float32_plain_lists_match_numpy_rounding(seed: int) -> None:
    values = _random_floats(np.random.default_rng(seed))
    with np.errstate(over="ignore", invalid="ignore"):
        reference = np.asarray(values).astype("<f4").tobytes() if values else b""
        assert pack_float32(values) == pack_float32(tuple(values)) == reference


def test_float32_edge_values_round_to_nearest_even() -> None:
    with np.errstate(over="ignore"):
        packed = dict(zip(FLOAT_EDGES[1:], unpack_float32(pack_float32(FLOAT_EDGES))[1:], strict=True))
    assert packed[1e39] == np.inf and packed[-1e39] == -np.inf
    assert packed[float(F32.max) * (1 + 2**-25)] == F32.max
    assert packed[2.0**-150] == 0.0 and packed[3 * 2.0**-150] == 2.0**-148
    assert packed[1.0 + 2**-24] == 1.0 and packed[1.0 + 3 * 2**-24] == 1.0 + 2**-22
    assert np.signbit(unpack_float32(pack_float32([-0.0]))[0])


class _Index:
    """Not an int, but struct would take it through __index__; numpy sees an object."""

    def __index__(self) -> int:
        return 7


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([True, False], ("TypeError", "int32 array needs integers, got dtype bool")),
        ((True,), ("TypeError", "int32 array needs integers, got dtype bool")),
        ([1.0], ("TypeError", "int32 array needs integers, got dtype float64")),
        ([1, 2.0], ("TypeError", "int32 array needs integers, got dtype float64")),
        ([1, "2"], ("TypeError", "int32 array needs integers, got dtype <U21")),
        ([_Index()], ("TypeError", "int32 array needs integers, got dtype object")),
        ([np.uint64(1), -1], ("TypeError", "int32 array needs integers, got dtype float64")),
        ([I32.max + 1], ("ValueError", "value outside the int32 range")),
        ([5, I32.min - 1], ("ValueError", "value outside the int32 range")),
        ([2**40], ("ValueError", "value outside the int32 range")),
        ([2**64], ("TypeError", "int32 array needs integers, got dtype object")),
        ([[1, 2], [3, 4]], ("ValueError", "int32 array must be one-dimensional, got shape (2, 2)")),
        ([1, True], ("bytes", b"\x01\x00\x00\x00\x01\x00\x00\x00")),
        ([np.int64(5), 6], ("bytes", b"\x05\x00\x00\x00\x06\x00\x00\x00")),
        ([np.int8(-1)], ("bytes", b"\xff\xff\xff\xff")),
    ],
)
def test_int32_lists_keep_the_numpy_path_results_and_errors(values: list[object], expected: object) -> None:
    assert _outcome(pack_int32, values) == _outcome(pack_int32, np.asarray(values)) == expected
    fast = _int32_bytes_of_python_ints(values)  # type: ignore[arg-type]
    assert fast is None or ("bytes", fast) == expected  # every error is numpy's own


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([True, False], ("TypeError", "float32 array needs numbers, got dtype bool")),
        (["0.5"], ("TypeError", "float32 array needs numbers, got dtype <U3")),
        ([1, 2], ("bytes", b"\x00\x00\x80?\x00\x00\x00@")),
        ([0.5, 2], ("bytes", b"\x00\x00\x00?\x00\x00\x00@")),
        ([2**24 + 1], ("bytes", np.array([2**24 + 1], "<f4").tobytes())),
        ([np.float32(0.1), 0.5], ("bytes", np.array([np.float32(0.1), 0.5], "<f4").tobytes())),
    ],
)
def test_float32_list_contract(values: list[object], expected: object) -> None:
    assert _outcome(pack_float32, values) == expected
