"""The shared libraries an ELF file needs (its DT_NEEDED entries), read from its bytes.

Only 64-bit little-endian ELF (what manylinux x86_64 wheels hold) is understood; anything else
yields no entries.
"""

from __future__ import annotations

import struct

_DT_NEEDED = 1
_SHT_DYNAMIC = 6


def needed_libraries(data: bytes) -> list[str]:
    """DT_NEEDED names of the ELF image `data`, in file order."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind != _SHT_DYNAMIC:
            continue
        strings_offset = sections[link][4]
        names: list[str] = []
        for position in range(offset, offset + size, entsize or 16):
            tag, value = struct.unpack_from("<qQ", data, position)
            if tag == 0:
                break
            if tag == _DT_NEEDED:
                start = strings_offset + value
                names.append(data[start : data.index(b"\0", start)].decode())
        return names
    return []
