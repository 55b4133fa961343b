"""The one place a device name from a user (``cpu``, ``cuda:1``, ``auto``) becomes a
:class:`torch.device`."""

from __future__ import annotations

import platform

import torch

from relaxspec.errors import RelaxspecError


def resolve_device(name: str, what: str = "device") -> torch.device:
    """``auto`` is CUDA when present, else CPU; a CUDA device on a machine without one is refused
    here, with a clear message, rather than deep inside the first forward. ``what`` names the
    setting in messages (the CLI passes ``--device``)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise RelaxspecError(f"{what} {name!r} is not a device torch knows (try cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RelaxspecError(f"{what} {name}: CUDA is not available on this machine (this torch build: {torch.__version__})")
    return device


def free_memory(device: torch.device | str = "cpu") -> int | None:
    """Bytes ``device`` can still give: CUDA's free memory, or the memory the kernel says is
    available (``MemAvailable`` of ``/proc/meminfo``); ``None`` where it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(what: str, needed: float, device: torch.device | str = "cpu") -> None:
    """Refuse, in one line naming ``what`` and both sizes, work that needs more than ``device``
    has free (``needed`` bytes; nothing is refused where free memory cannot be read)."""
    free = free_memory(device)
    if free is not None and needed > free:
        where = "this machine" if torch.device(device).type == "cpu" else str(device)
        raise RelaxspecError(f"{what} needs about {size_text(needed)} and {where} has {size_text(free)} free")


def size_text(count: float) -> str:
    """A byte count as people read it: ``4.1 PB``, ``24.6 GB``, ``512 B`` (powers of 1000)."""
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if count < 1000 or unit == "PB":
            return f"{count:,.0f} {unit}" if unit == "B" else f"{count:,.1f} {unit}"
        count /= 1000
    return f"{count:,.1f} PB"


def machine_identity(device: torch.device | str = "cpu") -> dict:
    """What kind of machine ``device`` is, for a timing result that only holds there (a tuned
    preset): the device type and its name (the CPU model from ``/proc/cpuinfo``, or CUDA's
    device name), and the torch build. Threads are a setting of the run, not of the machine."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as handle:
                for line in handle:
                    if line.lower().startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
    return {"device_type": device.type, "name": name, "torch": torch.__version__}


def machine_kind(identity: dict) -> str:
    """One line naming a :func:`machine_identity`: ``cpu: Intel(R) Xeon(R) ...``."""
    return f"{identity.get('device_type', '?')}: {identity.get('name', '?')}"
