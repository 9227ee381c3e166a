"""Packed per-token arrays round-trip bit-exactly (hypothesis is not installed: seeded random cases)."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy.dialects import postgresql, sqlite

from storage.packing import (
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
