"""The one place a device name from a user (``cpu``, ``cuda:1``, ``auto``) becomes a
:class:`torch.device`."""

from __future__ import annotations

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
