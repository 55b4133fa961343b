"""How many CPU threads torch runs with when the user does not say (``--threads`` not given).

torch's own default is one thread per physical core, right on an idle machine and ruinous on a
busy one: an OpenMP team waits at every op's barrier for its slowest thread, and a thread that
shares its core with another busy process is the slowest by a scheduler's time slice. On the
2-core machine this project is built on, with another torch process busy on each core, a
4.8M-parameter LlamaGen took twice as long an image on two threads as on one, and a drafter
training's start five times as long (a user's report, with more processes busy: 17x). So the
default is the cores nobody else is using now (measured from ``/proc/stat`` over a
fraction of a second), at most torch's own count, at least one; a model as small as the embedded
one always runs on one thread (thread hand-offs, not arithmetic, are its cost). On a CUDA device
the CPU threads are torch's choice: the work is on the GPU.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from relaxspec.inputs import check_threads, usable_cpu_ids, usable_cpus

#: torch's own thread count (one per physical core), read before any command sets it.
TORCH_DEFAULT = torch.get_num_threads()

#: How long the other processes' CPU use is watched before a run picks its threads.
WINDOW_SECONDS = 0.2

#: A CPU counts as taken when others kept it busy at least this share of the window.
TAKEN = 0.5

STAT = Path("/proc/stat")

#: What ``--threads``' help says of the default, in every command that has one.
DEFAULT_HELP = ("default: the CPU cores no other process is using when the run starts (watched for "
                f"{WINDOW_SECONDS:g} s), at most torch's one per physical core, at least 1; one for the embedded "
                "model; torch's choice on a GPU")


def cpu_times() -> dict[int, tuple[int, int]]:
    """Each CPU's (busy, total) clock ticks since boot, from ``/proc/stat`` (empty where the
    platform has none)."""
    try:
        lines = STAT.read_text().splitlines()
    except OSError:
        return {}
    times = {}
    for line in lines:
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit()):
            continue
        ticks = [int(v) for v in fields[:8]]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        times[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return times


def taken_cpus(window: float = WINDOW_SECONDS) -> int:
    """How many of the CPUs this process may use other processes kept busy over ``window``
    seconds (this process sleeps meanwhile, so what is busy is someone else's)."""
    before = cpu_times()
    if not before:
        return 0
    time.sleep(window)
    after = cpu_times()
    taken = 0
    for cpu in usable_cpu_ids() & set(before) & set(after):
        busy = after[cpu][0] - before[cpu][0]
        total = after[cpu][1] - before[cpu][1]
        if total > 0 and busy / total >= TAKEN:
            taken += 1
    return taken


def default_threads(device: torch.device | str = "cpu", *, small: bool = False, processes: int = 1) -> int | None:
    """The thread count a run on ``device`` uses when none is given (the module's rule); ``None``
    leaves torch's choice (a GPU's run). ``small``: a model whose steps are too short to share.
    ``processes``: the run's processes on this machine (torchrun's), which share the free cores."""
    if torch.device(device).type != "cpu":
        return None
    if small:
        return 1
    return max(1, min(TORCH_DEFAULT, usable_cpus() - taken_cpus()) // max(1, processes))


def set_threads(threads: int | None, device: torch.device | str = "cpu", *, small: bool = False,
                processes: int = 1, name: str = "--threads") -> int:
    """Set torch's CPU threads: ``threads`` (checked, one line) or the default for ``device``;
    returns the count torch now runs with."""
    if threads is not None:
        torch.set_num_threads(check_threads(threads, name))
    else:
        chosen = default_threads(device, small=small, processes=processes)
        if chosen is not None:
            torch.set_num_threads(chosen)
    return torch.get_num_threads()


__all__ = ["DEFAULT_HELP", "TORCH_DEFAULT", "cpu_times", "default_threads", "set_threads", "taken_cpus"]
