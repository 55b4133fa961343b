"""The checks a user's inputs get, one function each: ``relaxspec generate`` (and the other
commands), ``relaxspec.generate`` and the demo call the same function, so a value is refused the
same way, with the same one-line message, wherever it is given."""

from __future__ import annotations

import math
import numbers
import os

from relaxspec.errors import RelaxspecError

#: Seeds are whole numbers in [0, 2^40): batch b of a run is seeded seed * 1000003 + b, which then
#: stays far inside the 64 bits a torch generator takes.
SEED_LIMIT = 2 ** 40
#: The largest side of an output image in pixels (upscale included): 8192 x 8192 RGB is 192 MiB.
MAX_OUTPUT_SIDE = 8192
#: The most images one run of generate, eval or bench makes. A run lists every image in one record
#: (stats.json, a bench's settings.json) read and written whole at its start and end, and a bench
#: keeps every decode's record for its report; a million is twenty 50,000-image FID runs. More
#: is several runs (or shards: torchrun).
MAX_IMAGES = 1_000_000


def _whole(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_finite(name: str, value) -> None:
    """A real number a user gave that must be one: ``nan`` and ``inf`` refused in one line (a
    comparison with nan is false, so a bound alone lets it through)."""
    if isinstance(value, numbers.Real) and not math.isfinite(value):
        raise RelaxspecError(f"{name} must be a finite number, got {value}")


def check_seed(seed) -> int:
    """A seed: a whole number in ``[0, 2^40)``."""
    if not _whole(seed) or not 0 <= seed < SEED_LIMIT:
        raise RelaxspecError(f"seed must be a whole number in [0, 2^40), got {seed!r}")
    return int(seed)


def check_at_least(name: str, value, minimum: int) -> int:
    """A whole number ``>= minimum`` (a count, a size)."""
    if not _whole(value) or value < minimum:
        raise RelaxspecError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def check_upscale(upscale, side: int | None = None) -> int:
    """How many times each image is enlarged: a whole number >= 1 whose output side, for images
    of ``side`` pixels (when known), stays within :data:`MAX_OUTPUT_SIDE`."""
    upscale = check_at_least("upscale", upscale, 1)
    if side is not None and side * upscale > MAX_OUTPUT_SIDE:
        raise RelaxspecError(f"upscale {upscale} makes {side * upscale}-px images; the output side is capped at "
                             f"{MAX_OUTPUT_SIDE} px (upscale {max(1, MAX_OUTPUT_SIDE // side)} at most for these "
                             f"{side}-px images)")
    return upscale


def check_image_count(count: int, how: str) -> int:
    """An image count a user's options multiply to (``how`` says how, e.g. ``--images-per-class
    1000 x 20 classes``), refused past :data:`MAX_IMAGES` before any list of them is made."""
    if count > MAX_IMAGES:
        raise RelaxspecError(f"{how} is {count:,} images: one run makes at most {MAX_IMAGES:,} (its record lists every "
                             "image; a 50,000-image FID run is 5% of it); split the work into runs")
    return count


def usable_cpu_ids() -> set[int]:
    """The CPUs this process may run on (its affinity mask where the platform has one, else all)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """How many CPUs this process may run on."""
    return len(usable_cpu_ids())


def check_threads(threads, name: str = "--threads") -> int:
    """A torch CPU thread count: a whole number from 1 to the CPUs this process may use. More
    threads than CPUs only slow every op down; far more (``--threads 100000``) make OpenMP abort
    or crash the process without a word."""
    cpus = usable_cpus()
    if not _whole(threads) or not 1 <= threads <= cpus:
        raise RelaxspecError(f"{name} must be a whole number >= 1 and at most {cpus} (the CPUs this process may use "
                             f"here), got {threads!r}")
    return int(threads)
