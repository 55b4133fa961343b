"""Sharding a run over processes (``torchrun --nproc_per_node G -m relaxspec eval / bench ...``):
rank ``r`` of ``W`` (the ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` variables torchrun sets; 0 / 1
/ 0 without it) takes a contiguous slice of the work and writes it to ``OUT/shard-RR-of-WW/``
with the command's own resumable writer. No process group is needed: the process that finishes
the last shard merges (or scores) them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from relaxspec.errors import RelaxspecError

SHARD = re.compile(r"shard-(\d+)-of-(\d+)$")


def distributed() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from torchrun's environment (``0, 1, 0`` without it)."""
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise RelaxspecError("RANK / WORLD_SIZE / LOCAL_RANK must be integers") from None
    if world < 1 or not 0 <= rank < world:
        raise RelaxspecError(f"bad sharding: RANK {rank} of WORLD_SIZE {world}")
    return rank, world, local


def local_processes() -> int:
    """The run's processes on this machine (torchrun's ``LOCAL_WORLD_SIZE``; 1 without it): they
    share its CPU cores."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return int(value) if value.isdigit() and int(value) >= 1 else 1


def shard_range(total: int, rank: int, world: int) -> range:
    return range(total * rank // world, total * (rank + 1) // world)


def shard_dir(out: Path, rank: int, world: int) -> Path:
    return out / f"shard-{rank:02d}-of-{world:02d}"


def shard_folders(out: Path) -> list[Path]:
    """The shard folders of one sharding (refuses a folder that mixes world sizes)."""
    folders = sorted(p for p in out.glob("shard-*-of-*") if p.is_dir() and SHARD.search(p.name))
    worlds = {int(SHARD.search(p.name).group(2)) for p in folders}
    if len(worlds) > 1:
        raise RelaxspecError(f"{out} holds shards of different world sizes ({sorted(worlds)}); use one folder per sharding")
    return folders


__all__ = ["SHARD", "distributed", "shard_dir", "shard_folders", "shard_range"]
