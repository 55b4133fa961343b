"""The CPU threads a run takes when ``--threads`` is not given (:mod:`relaxspec.threads`): the
cores no other process is using, never more threads than free cores on a busy machine; one for
the embedded model; the launcher's passive OpenMP wait. The machine's load is faked through
``/proc/stat``'s counters, so nothing here depends on what else runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from relaxspec import threads
from relaxspec.cli import build_parser, main

from helpers.cli import generate_args


class FakeLoad:
    """``/proc/stat`` of a machine with ``cpus`` CPUs of which ``busy`` are kept busy by others:
    each read advances every CPU's counters by 100 ticks, busy ones' all in user time."""

    def __init__(self, cpus: int, busy: int):
        self.cpus, self.busy, self.reads = cpus, busy, 0

    def __call__(self) -> dict[int, tuple[int, int]]:
        self.reads += 1
        ticks = 100 * self.reads
        return {cpu: (ticks if cpu < self.busy else 0, ticks) for cpu in range(self.cpus)}


@pytest.fixture
def machine(monkeypatch):
    """``machine(cpus, busy)``: this process may use ``cpus`` CPUs, torch's own default is one a
    CPU, ``busy`` of them are taken by other processes; torch starts on ``cpus`` threads."""

    def make(cpus: int, busy: int) -> FakeLoad:
        load = FakeLoad(cpus, busy)
        monkeypatch.setattr(threads, "cpu_times", load)
        monkeypatch.setattr(threads, "usable_cpu_ids", lambda: set(range(cpus)))
        monkeypatch.setattr(threads, "usable_cpus", lambda: cpus)
        monkeypatch.setattr(threads, "TORCH_DEFAULT", cpus)
        monkeypatch.setattr(threads, "WINDOW_SECONDS", 0.0)
        monkeypatch.setattr("relaxspec.inputs.usable_cpus", lambda: cpus)
        torch.set_num_threads(min(cpus, os.cpu_count() or 1))
        return load

    return make


def test_the_default_is_the_cores_no_one_else_is_using(machine):
    machine(8, 3)
    assert threads.default_threads("cpu") == 5
    machine(8, 8)
    assert threads.default_threads("cpu") == 1  # never zero
    machine(8, 0)
    assert threads.default_threads("cpu") == 8
    machine(8, 2)
    assert threads.default_threads("cpu", processes=3) == 2  # torchrun's processes share the free cores


def test_small_models_run_on_one_thread_and_a_gpu_run_keeps_torchs_choice(machine):
    machine(8, 0)
    assert threads.default_threads("cpu", small=True) == 1
    assert threads.default_threads("cuda:0") is None


def test_proc_stat_is_read_as_busy_and_total_ticks_per_cpu(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 70 10 0 0 0 0 0\n"
                    "cpu0 5 0 5 30 10 0 0 0 0 0\n"
                    "cpu1 5 0 5 40 0 0 0 0 0 0\n"
                    "intr 12345\nctxt 99\n")
    monkeypatch.setattr(threads, "STAT", stat)
    assert threads.cpu_times() == {0: (10, 50), 1: (10, 50)}  # idle and iowait are not busy
    monkeypatch.setattr(threads, "STAT", tmp_path / "none")
    assert threads.cpu_times() == {}  # no /proc: nothing counts as taken
    assert threads.taken_cpus(0.0) == 0


def test_generate_on_a_busy_machine_takes_one_thread(machine, tiny_ckpts, tmp_path):
    """A LlamaGen file with no --threads: before, torch's choice (a thread a core, whatever else
    ran: 17x slower an image on a busy 2-core machine); now the free cores."""
    machine(2, 2)
    assert main(generate_args(tiny_ckpts["c2i"], str(tmp_path / "busy"), "--classes", "1")) == 0
    assert torch.get_num_threads() == 1
    machine(2, 0)
    assert main(generate_args(tiny_ckpts["c2i"], str(tmp_path / "idle"), "--classes", "1")) == 0
    assert torch.get_num_threads() == min(2, os.cpu_count() or 1)
    machine(2, 0)
    assert main(generate_args(tiny_ckpts["c2i"], str(tmp_path / "given"), "--classes", "1", "--threads", "1")) == 0
    assert torch.get_num_threads() == 1  # a count given is the count taken


def test_train_drafter_on_a_busy_machine_takes_one_thread(machine, tiny_ckpts, tmp_path, capsys):
    machine(2, 2)
    argv = ["train-drafter", *tiny_ckpts["c2i"]["args"], "--self-samples", "2", "--steps", "0", "--batch-size", "2",
            "--device", "cpu", "--no-progress", "--out", str(tmp_path / "drafter")]
    assert main(argv) == 0, capsys.readouterr().err
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("command", ["generate", "demo", "train-drafter", "train-gpt", "train-vq", "train-classifier"])
def test_threads_help_says_the_default(command):
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    help_text = next(a.help for a in sub._actions if "--threads" in a.option_strings)
    assert threads.DEFAULT_HELP in help_text


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_timing_commands_say_why_they_pin_one_thread(command):
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    action = next(a for a in sub._actions if "--threads" in a.option_strings)
    assert action.default == 1 and "default 1: timings on one thread are steady" in action.help


@pytest.mark.parametrize("given", [None, "ACTIVE"])
def test_the_command_sleeps_its_waiting_openmp_threads_unless_told_otherwise(given):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    code = ("import os, sys; sys.argv = ['relaxspec', '--version']; from relaxspec.launch import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "import torch; print(os.environ.get('OMP_WAIT_POLICY'))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().splitlines()[-1] == (given or "PASSIVE"), done.stderr
