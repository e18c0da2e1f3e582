"""Shards: how problems and pass batches split into independent jobs, so a run scales out across machines.

A shard must never change a result. Rollouts are sharded by problem: each rollout is generated alone from its
own seed, so which shard it lands in does not matter. Passes are sharded by batch, not by problem: on stock
kernels the batch a continuation shares is part of what is measured (it moves the logits), so every pass
first lays out its whole schedule exactly as an unsharded run would, and a shard runs a contiguous range of
those batches. Both rules hold for any ``shard_size``, which is why it lives beside the other resources and
stays out of the analysis hash.
"""

from __future__ import annotations

import math


def shard_count(n_problems: int, shard_size: int) -> int:
    """How many shards ``n_problems`` problems make (at least one)."""
    if shard_size < 1:
        raise ValueError(f"resources.shard_size must be at least 1, got {shard_size}")
    return max(1, math.ceil(n_problems / shard_size))


def shard_names(n_problems: int, shard_size: int) -> list[str]:
    """Zero-padded shard names, so they sort in order as file names."""
    return [shard_name(i) for i in range(shard_count(n_problems, shard_size))]


def shard_name(index: int) -> str:
    return f"{index:03d}"


def shard_index(name: str) -> int:
    """The index of a shard name; a name that is not one raises an error naming it."""
    if not name.isdigit():
        raise ValueError(f"shard name {name!r} is not a zero-padded number")
    return int(name)


def problem_range(index: int, shard_size: int, n_problems: int) -> range:
    """Row indices of the problems in shard ``index``, in the sampled order."""
    start = index * shard_size
    if start >= n_problems and not (index == 0 and n_problems == 0):
        raise ValueError(f"shard {index} starts at problem {start}, past the {n_problems} problems")
    return range(start, min(start + shard_size, n_problems))


def batch_range(index: int, n_shards: int, n_batches: int) -> range:
    """The contiguous batches shard ``index`` of ``n_shards`` runs: as even a split as whole batches allow.

    A shard may get no batch when a pass has fewer batches than there are shards.
    """
    if not 0 <= index < n_shards:
        raise ValueError(f"shard {index} is not one of the {n_shards} shards")
    return range(index * n_batches // n_shards, (index + 1) * n_batches // n_shards)
