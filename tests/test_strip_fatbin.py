"""validation/strip_fatbin.py (used to bring Transformer Engine's core library to the H200 in one
transfer): on a synthetic fatbin, only the kept SM's payload survives, byte offsets stay."""

import struct

import pytest

from validation import strip_fatbin


def _entry(sm: int, payload: bytes) -> bytes:
    header = bytearray(0x40)
    struct.pack_into("<HHII", header, 0, 2, 0x101, len(header), len(payload))
    struct.pack_into("<I", header, strip_fatbin._SM_OFFSET, sm)
    return bytes(header) + payload


def _fatbin(entries: bytes) -> bytes:
    return struct.pack("<IHHQ", strip_fatbin.FATBIN_MAGIC, 1, 16, len(entries)) + entries


def test_zeroes_other_sms_and_keeps_offsets():
    keep, drop = b"\x90" * 32, b"\x80" * 48
    stray = struct.pack("<I", strip_fatbin.FATBIN_MAGIC) + b"\x07" * 12  # magic by chance
    data = bytearray(b"ELF" + stray + _fatbin(_entry(80, drop) + _entry(90, keep)) + b"tail")
    original = bytes(data)
    stats = strip_fatbin.strip(data, keep_sm=90)
    assert len(data) == len(original) and data.endswith(b"tail")
    assert keep in data and drop not in data and b"\x80" * 48 not in data
    assert data.index(keep) == original.index(keep)
    assert stats == {"kept kind2 sm90": 32, "zeroed kind2 sm80": 48}


def test_entry_that_does_not_parse_is_an_error():
    bad = bytearray(_fatbin(_entry(90, b"x" * 8)))
    struct.pack_into("<I", bad, 16 + 8, 10_000)  # padded payload size past the fatbin's end
    with pytest.raises(ValueError, match="does not parse"):
        strip_fatbin.strip(bad, keep_sm=90)
