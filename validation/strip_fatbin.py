"""Shrink a CUDA shared library for transfer to one known GPU: zero the payload of every
fatbin entry not built for the kept SM (headers and file offsets stay unchanged).

The H200 test machine takes at most 64 MiB per command, and Transformer Engine's core library
is 328 MiB (264 MiB zipped; its cubins are compressed, so xz gains nothing). 251 MiB of it are
fatbins for eight SM versions; the driver loads only the entry that matches the GPU, so with
the other entries zeroed the file compresses to a fraction. Test-harness tool only: the result
runs on that one SM and nowhere else.

Usage: python3 validation/strip_fatbin.py IN.so OUT.so --keep-sm 90
"""

from __future__ import annotations

import argparse
import struct
from collections import Counter

FATBIN_MAGIC = 0xBA55ED50
_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries
_ENTRY = struct.Struct("<HHII")  # kind, version, header size, padded payload size
_SM_OFFSET = 0x1C  # uint32 SM version inside an entry header


def strip(data: bytearray, keep_sm: int) -> Counter:
    """Zero, in place, the payload of every fatbin entry whose SM is not ``keep_sm``."""
    stats: Counter = Counter()
    magic = struct.pack("<I", FATBIN_MAGIC)
    pos = 0
    while (start := data.find(magic, pos)) >= 0:
        pos = start + 4
        _, version, header_size, size = _HEADER.unpack_from(data, start)
        if version != 1 or header_size != _HEADER.size or start + header_size + size > len(data):
            continue  # the magic number by chance, not a fatbin header
        entry, end = start + header_size, start + header_size + size
        while entry < end:
            kind, _, entry_header, padded = _ENTRY.unpack_from(data, entry)
            if entry_header < _SM_OFFSET + 4 or entry + entry_header + padded > end:
                raise ValueError(f"fatbin at {start:#x}: entry at {entry:#x} does not parse")
            sm = struct.unpack_from("<I", data, entry + _SM_OFFSET)[0]
            payload = entry + entry_header
            if sm == keep_sm:
                stats[f"kept kind{kind} sm{sm}"] += padded
            else:
                data[payload:payload + padded] = bytes(padded)
                stats[f"zeroed kind{kind} sm{sm}"] += padded
            entry = payload + padded
        pos = end
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--keep-sm", type=int, required=True)
    args = parser.parse_args()
    with open(args.src, "rb") as f:
        data = bytearray(f.read())
    stats = strip(data, args.keep_sm)
    if not any(k.startswith("kept") for k in stats):
        raise SystemExit(f"no fatbin entry for sm_{args.keep_sm} in {args.src}: nothing would run")
    with open(args.dst, "wb") as f:
        f.write(data)
    for key, size in sorted(stats.items()):
        print(f"{key}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
