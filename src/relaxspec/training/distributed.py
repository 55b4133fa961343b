"""A recipe on many processes: ``torchrun --nproc_per_node G relaxspec train-drafter ...``.

torchrun starts ``G`` processes (times ``--nnodes``) with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; :func:`join` forms their process group
(NCCL when the run's device is CUDA, each rank on ``cuda:LOCAL_RANK``; gloo on CPUs) and
:class:`Group` is what a recipe asks of it: its rank, its rows of a global batch, a barrier, a
sum over ranks and rank 0's word on a decision. Without torchrun the group is one process and
every call is free, so a recipe has one code path.

A process that dies takes the run down, never into a hang: under torchrun its agent stops the
others (SIGTERM, which :func:`join` turns into one line); between processes started by hand, the
survivors' next collective fails at once (gloo: "connection reset by peer") and
:func:`peer_lost` names that failure, which the recipe turns into one line.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from relaxspec.errors import NotJoined, PeerLost, RelaxspecError, SaidByRankZero
from relaxspec.runs.shards import distributed

#: How long a collective waits for the slowest rank (rank 0 evaluating a 7B target's drafter
#: while the others wait is minutes; a dead rank is noticed long before, see the module's doc).
TIMEOUT = datetime.timedelta(minutes=60)
#: How long the processes of a run wait for each other to start (``RELAXSPEC_RENDEZVOUS_SECONDS``
#: sets it): a process started alone says what it waits for and stops after this, not after
#: :data:`TIMEOUT`.
RENDEZVOUS_SECONDS = 300
#: The longest rendezvous wait ``RELAXSPEC_RENDEZVOUS_SECONDS`` may ask for (a day).
MAX_RENDEZVOUS_SECONDS = 86400


@dataclass(frozen=True)
class Group:
    """The processes of one run; the default is a run of one process."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0: the process that evaluates, checkpoints, exports and prints."""
        return self.rank == 0

    def rows(self, size: int) -> slice:
        """This rank's rows of a global batch of ``size``: a contiguous ``size / world`` (an epoch's
        short last batch: as even a split as it allows, possibly none)."""
        return slice(size * self.rank // self.world, size * (self.rank + 1) // self.world)

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag``, on every rank (e.g. "stop here": the ranks must take the same steps)."""
        if self.world == 1:
            return flag
        value = torch.tensor([int(flag)], device=self.device)
        torch.distributed.broadcast(value, 0)
        return bool(value.item())

    def share(self, value: int) -> int:
        """Rank 0's integer ``value``, on every rank."""
        if self.world == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(tensor, 0)
        return int(tensor.item())

    def gather(self, value: str) -> list[str]:
        """Every rank's ``value`` (a short string), in rank order, on every rank."""
        if self.world == 1:
            return [value]
        values: list = [None] * self.world
        torch.distributed.all_gather_object(values, value)
        return [str(v) for v in values]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks (in place; returned)."""
        if self.world > 1:
            torch.distributed.all_reduce(tensor)
        return tensor

    @property
    def device(self) -> torch.device:
        """Where the group's collectives hold their tensors (NCCL's: this rank's GPU)."""
        if self.world > 1 and torch.distributed.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def join(device: torch.device) -> tuple[Group, torch.device]:
    """The group of the processes torchrun started (a one-process group without torchrun) and
    this process's device: ``device`` itself, or for a CUDA device named without an index under
    torchrun, ``cuda:LOCAL_RANK``. Forms the process group (NCCL on CUDA, gloo on CPUs) once."""
    rank, world, local = distributed()
    if world == 1:
        return Group(), device
    if device.type == "cuda" and device.index is not None:
        raise RelaxspecError(f"--device {device} names one GPU for every process of the run: give --device cuda (or "
                             "auto), and each process takes cuda:LOCAL_RANK")
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise RelaxspecError(f"LOCAL_RANK {local} but this machine has {torch.cuda.device_count()} CUDA device(s): "
                                 "start at most one process per GPU (torchrun --nproc_per_node)")
        device = torch.device("cuda", local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise RelaxspecError(f"WORLD_SIZE {world} but {' and '.join(missing)} not set: start the processes with "
                                 "torchrun (it sets them)")
        store = _rendezvous(rank, world)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                             store=store, timeout=TIMEOUT)
        signal.signal(signal.SIGTERM, _stopped_by_launcher)
    return Group(rank, world, local), device


def rendezvous_settings() -> tuple[str, int, float]:
    """torchrun's environment read as one input: ``(MASTER_ADDR, MASTER_PORT,
    RELAXSPEC_RENDEZVOUS_SECONDS)``, each checked before any socket is opened, one line each (a bad
    value reached c10d's store before: a TypeError, or pages of its frames and socket warnings)."""
    port_text = os.environ["MASTER_PORT"]
    port = int(port_text) if port_text.strip().isdigit() else 0
    if not 1 <= port <= 65535:
        raise RelaxspecError(f"MASTER_PORT must be a port number in [1, 65535], got {port_text!r}")
    text = os.environ.get("RELAXSPEC_RENDEZVOUS_SECONDS", str(RENDEZVOUS_SECONDS))
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_RENDEZVOUS_SECONDS):
        raise RelaxspecError(f"RELAXSPEC_RENDEZVOUS_SECONDS must be a number of seconds in (0, {MAX_RENDEZVOUS_SECONDS}], "
                             f"got {text!r}")
    host = os.environ["MASTER_ADDR"].strip()
    try:
        socket.getaddrinfo(host, port)
    except (socket.gaierror, UnicodeError):
        raise RelaxspecError(f"MASTER_ADDR {host!r} is not a host this machine can find (torchrun sets it from "
                             "--master-addr; one machine: leave it out)") from None
    return host, port, seconds


def _rendezvous(rank: int, world: int):
    """The run's key-value store, once every process has reached it, within
    :data:`RENDEZVOUS_SECONDS`; rank 0 says what it waits for. Under torchrun its agent holds the
    store; processes started by hand have rank 0 hold it."""
    host, port, seconds = rendezvous_settings()
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    waiting = (f"relaxspec: waiting for the {world} processes of this run (WORLD_SIZE {world}) at {host}:{port}, "
               f"at most {seconds:g} s")
    log = Path(tempfile.gettempdir()) / f"relaxspec-rendezvous-{os.getpid()}.log"
    kept = False  # the log, kept only for a rendezvous that failed and left messages in it
    try:
        with native_messages_to(log) as say:  # c10d's frames and socket warnings: the log's, not the terminal's
            if rank != 0 or agent:  # the store's own client logs every failed try at length: probe quietly first
                _wait_for_port(host, port, seconds)
            store = torch.distributed.TCPStore(host, port, world_size=world, is_master=rank == 0 and not agent,
                                               timeout=datetime.timedelta(seconds=seconds), wait_for_workers=False)
            # every process checks in, then waits for all (keys of this start: torchrun may restart)
            start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store.add(f"relaxspec/joined/{start}", 1)
            if rank == 0:
                _wait_for_count(store, f"relaxspec/joined/{start}", world, seconds, lambda: say(waiting))
                store.set(f"relaxspec/all/{start}", "1")
            else:
                store.wait([f"relaxspec/all/{start}"], datetime.timedelta(seconds=seconds))
    except (RuntimeError, TimeoutError, ConnectionError):
        kept = log.is_file() and log.stat().st_size > 0
        raise NotJoined(f"the {world} processes of this run did not all start within {seconds:g} s "
                        f"(WORLD_SIZE {world}, {host}:{port}): start them together, e.g. with torchrun "
                        "--nproc_per_node" + (f" (c10d's own messages: {log})" if kept else "")) from None
    finally:
        if not kept:
            log.unlink(missing_ok=True)
    return store


@contextlib.contextmanager
def native_messages_to(log: Path):
    """Send what native code writes to stderr (c10d's stack frames and socket warnings, which
    bypass Python) to the file ``log`` for the block; yields ``say(line)``, which still reaches the
    terminal. The terminal's stderr is back when the block ends, however it ends."""
    sys.stderr.flush()
    terminal = os.dup(2)
    try:
        with open(log, "ab") as handle:
            os.dup2(handle.fileno(), 2)

        def say(line: str) -> None:
            os.write(terminal, (line + "\n").encode())

        yield say
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)
        os.close(terminal)


def _wait_for_port(host: str, port: int, seconds: float) -> None:
    """Until ``host:port`` takes a connection (the run's store is up), for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{host}:{port}") from None
            time.sleep(0.1)


def _wait_for_count(store, key: str, count: int, seconds: float, waiting) -> None:
    """Until ``key`` counts ``count``; ``waiting()`` says so once the wait passes a few seconds."""
    started = time.monotonic()
    said = False
    while store.add(key, 0) < count:
        waited = time.monotonic() - started
        if waited > seconds:
            raise TimeoutError(key)
        if waited > min(5.0, seconds / 2) and not said:
            waiting()
            said = True
        time.sleep(0.05)


@contextlib.contextmanager
def alike(rank: int):
    """Around checks every process makes alike (settings, files all of them read): an error is
    said once, by rank 0 (the others raise :class:`~relaxspec.errors.SaidByRankZero`)."""
    try:
        yield
    except (SaidByRankZero, NotJoined):
        raise
    except RelaxspecError as err:
        if rank != 0:
            raise SaidByRankZero(str(err)) from None
        raise


def leave() -> None:
    """End the process group, if one was formed."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def peer_lost(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because another process of the group is gone."""
    if isinstance(err, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        sign in text for sign in ("Connection reset by peer", "Connection closed by peer", "gloo/transport", "NCCL"))


def _stopped_by_launcher(signum, frame) -> None:
    rank = os.environ.get("RANK", "?")
    print(f"relaxspec: error: rank {rank}: stopped by torchrun (another process of this run ended; its output says "
          "why); the last checkpoint is kept: --resume continues, with any number of processes", file=sys.stderr)
    sys.stdout.flush()
    os._exit(2)


__all__ = ["Group", "PeerLost", "TIMEOUT", "alike", "join", "leave", "peer_lost"]
