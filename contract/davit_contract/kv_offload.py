"""The KV offload disk tier's file layout as far as sizing needs it: the engine writes one file
per block (a fixed header, then the block's bytes), and the operator turns a volume's size into
the tier's token capacity with the same numbers."""

from __future__ import annotations

# Bytes of the header in front of each block in a disk-tier file.
DISK_FILE_HEADER_BYTES = 64


def disk_file_bytes(block_bytes: int) -> int:
    """Bytes one disk-tier file of a block of `block_bytes` takes."""
    return DISK_FILE_HEADER_BYTES + block_bytes
