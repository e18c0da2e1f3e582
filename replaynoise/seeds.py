"""Seed derivation: every random choice in the pipeline hangs off the root seed through a stable hash."""

from __future__ import annotations

import hashlib

SEED_BITS = 63


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (independent of Python's hash randomisation)."""
    blob = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "big") >> (64 - SEED_BITS)
