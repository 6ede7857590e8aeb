"""Byte counts read and written as people write them (`lightning_smp.units`)."""

import pytest

from lightning_smp.units import format_bytes, parse_bytes


def test_sizes_are_read_in_binary_and_decimal_units():
    assert parse_bytes("40GiB") == 40 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("141G") == 141 * 2**30
    assert parse_bytes("1.5 MiB") == 3 * 2**19
    assert parse_bytes("1024") == 1024
    with pytest.raises(ValueError, match="'40 gigs' is not a size; give a number with a unit"):
        parse_bytes("40 gigs")


def test_sizes_are_written_in_binary_units():
    assert format_bytes(3 * 2**29) == "1.5 GiB"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(2**50) == "1024.0 TiB"
