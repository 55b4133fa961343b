"""train-drafter on several processes (torch.distributed, gloo on the CPU): the one-process run's
weights, a self-sample cache that any number of processes shares, a run killed mid-way that
resumes with 1 or 2 processes, a dying process that stops the others, bad set-ups in one line."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from helpers.engine import peaked_target
from safetensors.torch import load_file

from relaxspec.cli import main
from relaxspec.models.weights import save_model
from relaxspec.models.llamagen.gpt import GPTConfig
from relaxspec.sampling import SamplingConfig
from relaxspec.training.drafter import SELF_SAMPLES, TRAIN_STATE, sample_from_target
from relaxspec.training.drafter.data import Shard

TINY = GPTConfig(dim=64, n_layer=2, n_head=4, vocab_size=64, num_classes=10, block_size=16)
# 16 self-samples, 3 held out: 13 train, so every epoch ends on a batch of 1 that one of the two
# processes has no row of; null_fraction 0.5 splits the null rows unevenly over the processes.
RECIPE = ["--self-samples", "16", "--batch-size", "4", "--classes", "1", "2", "3", "--val-fraction", "0.2",
          "--null-fraction", "0.5", "--lr", "3e-3", "--warmup-steps", "2", "--no-progress"]


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target") / "gpt"
    save_model(peaked_target(TINY, 0), folder)
    return str(folder)


def env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **{k: str(v) for k, v in extra.items()}}


def torchrun(*args, processes: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node 2 -m relaxspec ARGS`` (a free port of its own)."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(processes), "-m", "relaxspec", *args], env=env(), capture_output=True, text=True,
                          timeout=300)


def weights(out) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(out, "model.safetensors"))


def assert_same_weights(a, b, atol=1e-5) -> None:  # float rounding, grown over Adam steps
    left, right = weights(a), weights(b)
    assert left.keys() == right.keys()
    for name in left:
        torch.testing.assert_close(left[name], right[name], atol=atol, rtol=0, msg=name)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_the_one_process_weights(tmp_path, target_path) -> None:
    """Global batch 4 over 2 gloo processes (2 rows each; the epochs' last batch of 1 leaves one
    process none) gives the weights, evaluations and self-samples of the one-process run."""
    args = ["train-drafter", "--gpt-ckpt", target_path, *RECIPE, "--steps", "8", "--eval-interval", "4"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    run = torchrun(*args, "--out", str(tmp_path / "two"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count('"out"') == 1  # rank 0 prints the result
    assert_same_weights(tmp_path / "one", tmp_path / "two")
    assert_same_weights(tmp_path / "one" / "best", tmp_path / "two" / "best")
    one, two = (np.load(tmp_path / name / SELF_SAMPLES) for name in ("one", "two"))
    assert np.array_equal(one["tokens"], two["tokens"]) and int(two["done"]) == 16
    assert not list((tmp_path / "two").glob("self_samples.parts-*"))  # merged, then removed
    import json

    lines = [[json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
             for name in ("one", "two")]
    assert [r["step"] for r in lines[0]] == [r["step"] for r in lines[1]] == [0, 4, 8]
    # the run says who trained it (issue 45)
    trained = [json.loads((tmp_path / name / "best" / "config.json").read_text())["training"] for name in ("one", "two")]
    assert (trained[0]["processes"], trained[0]["devices"]) == (1, ["cpu"])
    assert (trained[1]["processes"], trained[1]["devices"]) == (2, ["cpu", "cpu"])
    assert lines[1][-1]["loss"] < lines[1][0]["loss"] - 0.01  # trained, not the initial weights
    for a, b in zip(*lines):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["accept"] == pytest.approx(b["accept"], abs=1e-6)


@pytest.mark.slow
def test_a_fused_drafter_trains_on_two_processes_as_on_one(tmp_path, target_path) -> None:
    """A fused-feature (EAGLE-3) drafter through the depths: its fuse runs on the level read from
    the target, and the depths before the last on the drafter itself, outside the one
    DistributedDataParallel call a step, and all still get the averaged gradient (the one-process
    run's weights)."""
    args = ["train-drafter", "--gpt-ckpt", target_path, *RECIPE, "--steps", "2", "--eval-interval", "2", "--fused",
            "--train-depths", "2", "--through-depths"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    run = torchrun(*args, "--out", str(tmp_path / "two"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "fuse.weight" in weights(tmp_path / "two")
    # Adam divides by the root of a second moment that is near 0 for a few weights after two steps:
    # there float rounding of the averaged gradient grows to ~1e-5
    assert_same_weights(tmp_path / "one", tmp_path / "two", atol=1e-4)


@pytest.mark.slow
def test_a_killed_run_resumes_with_one_or_two_processes_and_a_dying_one_stops_the_others(tmp_path, target_path):
    """Two processes started by hand (as torchrun starts them): rank 1 is killed mid-run; rank 0
    stops at its next collective with one line, not a hang. The folder resumes with one process to
    the weights of an uninterrupted run; a run stopped in one process resumes with two to them too."""
    steps = 120
    args = ["train-drafter", "--gpt-ckpt", target_path, *RECIPE, "--eval-interval", "40", "--checkpoint-interval", "1"]
    assert main([*args, "--steps", str(steps), "--out", str(tmp_path / "whole")]) == 0

    port = free_port()
    command = [sys.executable, "-m", "relaxspec", *args, "--steps", str(steps), "--out", str(tmp_path / "cut")]
    ranks = [subprocess.Popen(command, env=env(RANK=r, LOCAL_RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                                               MASTER_PORT=port), stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        state, deadline = tmp_path / "cut" / TRAIN_STATE, time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if torch.load(state, weights_only=True)["step"] >= 2:
                    break
            except (OSError, RuntimeError, KeyError, EOFError):
                pass
            time.sleep(0.02)
        ranks[1].send_signal(signal.SIGKILL)
        _, said = ranks[0].communicate(timeout=60)
    finally:
        for process in ranks:
            process.kill()
    lines = [line for line in said.splitlines() if line.strip() and not line.startswith("step ")]
    assert ranks[0].returncode == 2 and len(lines) == 1, said
    assert "rank 0: another process of this run stopped" in lines[0] and "--resume" in lines[0]
    stopped_at = torch.load(state, weights_only=True)["step"]
    assert 2 <= stopped_at < steps

    assert main(["train-drafter", "--resume", "--out", str(tmp_path / "cut"), "--no-progress"]) == 0
    assert_same_weights(tmp_path / "whole", tmp_path / "cut")

    assert main([*args, "--steps", "7", "--out", str(tmp_path / "grown")]) == 0
    run = torchrun("train-drafter", "--resume", "--steps", str(steps), "--out", str(tmp_path / "grown"), "--no-progress")
    assert run.returncode == 0, run.stderr[-3000:]
    assert_same_weights(tmp_path / "whole", tmp_path / "grown")


def test_self_samples_drawn_by_four_processes_are_one_process_s_cache(tmp_path) -> None:
    """Batch b is fixed by the run, not by who draws it: four processes (threads meeting at a
    barrier) draw the same samples as one, into a cache one process then reads without drawing;
    a cache of the older single-file format (rows drawn in order) is read as its batches."""
    from relaxspec.training.drafter import data as ar_module  # where the sampler looks generate_ar up

    target = peaked_target(TINY, 0)
    draw = dict(classes=[1, 2, 3], sampling=SamplingConfig(cfg_scale=2.0), seed=5, batch_size=3)
    alone = sample_from_target(target, 10, **draw)

    meet, results = threading.Barrier(4, timeout=60), {}
    copies = [peaked_target(TINY, 0) for _ in range(4)]  # a process each: decoding keeps caches in the model

    def rank(r: int) -> None:
        try:
            results[r] = sample_from_target(copies[r], 10, **draw, cache=tmp_path / "four" / SELF_SAMPLES,
                                            shard=Shard(r, 4, meet.wait))
        except BaseException as err:  # noqa: BLE001 - shown by the assertion below
            results[r] = err
            meet.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(results) == [0, 1, 2, 3], results
    assert not [r for r in results.values() if isinstance(r, BaseException)], results
    for r in range(4):
        assert torch.equal(results[r].tokens, alone.tokens) and torch.equal(results[r].labels, alone.labels)
    cache = np.load(tmp_path / "four" / SELF_SAMPLES)
    assert int(cache["done"]) == 10 and not list((tmp_path / "four").glob("self_samples.parts-*"))

    calls = []
    real = ar_module.generate_ar
    try:
        ar_module.generate_ar = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
        again = sample_from_target(target, 10, **draw, cache=tmp_path / "four" / SELF_SAMPLES)
        assert calls == [] and torch.equal(again.tokens, alone.tokens)

        old = tmp_path / "old" / SELF_SAMPLES  # the format before batches had files: 6 rows drawn in order
        old.parent.mkdir()
        tokens = np.full_like(cache["tokens"], -1)
        tokens[:6] = cache["tokens"][:6]
        np.savez(old, tokens=tokens, done=6, key=cache["key"])
        resumed = sample_from_target(target, 10, **draw, cache=old, shard=Shard(0, 1))
        assert len(calls) == 2 and torch.equal(resumed.tokens, alone.tokens)  # batches 2 and 3 only
    finally:
        ar_module.generate_ar = real


def test_a_world_size_that_does_not_divide_the_batch_is_said_once(tmp_path, target_path, monkeypatch, capsys) -> None:
    """The processes of a run make the same checks: rank 0 says the line, the others exit 2 with it
    silently; nothing is written."""
    args = ["train-drafter", "--gpt-ckpt", target_path, "--self-samples", "8", "--batch-size", "3", "--steps", "1",
            "--out", str(tmp_path / "run"), "--no-progress"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, said in ((0, 1), (1, 0)):
        monkeypatch.setenv("RANK", str(rank))
        assert main(args) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == said
    monkeypatch.setenv("RANK", "0")
    main(args)
    assert capsys.readouterr().err.strip() == ("relaxspec: error: --batch-size 3 is the global batch: it does not "
                                               "divide over the 2 processes of this run (WORLD_SIZE 2)")
    assert not (tmp_path / "run").exists()
    cuda = [word if word != "3" else "2" for word in args] + ["--device", "cuda"]  # no CUDA here
    assert main(cuda) == 2 and "CUDA is not available" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")
    assert main(cuda) == 2 and capsys.readouterr().err == ""


def test_one_named_gpu_for_every_process_is_refused(monkeypatch) -> None:
    """Under torchrun each process takes cuda:LOCAL_RANK; ``--device cuda:1`` would put them all on
    one GPU."""
    from relaxspec.errors import RelaxspecError
    from relaxspec.training.distributed import join

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RelaxspecError, match="names one GPU for every process"):
        join(torch.device("cuda", 1))
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RelaxspecError, match="start the processes with torchrun"):
        join(torch.device("cpu"))



@pytest.mark.parametrize("name, value, said", [
    ("MASTER_PORT", "99999", "MASTER_PORT must be a port number in [1, 65535], got '99999'"),
    ("MASTER_PORT", "http", "MASTER_PORT must be a port number in [1, 65535], got 'http'"),
    ("RELAXSPEC_RENDEZVOUS_SECONDS", "nan", "RELAXSPEC_RENDEZVOUS_SECONDS must be a number of seconds in (0, 86400], "
                                            "got 'nan'"),
    ("RELAXSPEC_RENDEZVOUS_SECONDS", "-5", "RELAXSPEC_RENDEZVOUS_SECONDS must be a number of seconds in (0, 86400], "
                                           "got '-5'"),
    ("MASTER_ADDR", "no.such.host.invalid", "MASTER_ADDR 'no.such.host.invalid' is not a host this machine can find"),
])
def test_torchruns_environment_is_checked_before_any_socket_opens(monkeypatch, name, value, said) -> None:
    """Issue 54: these reached c10d's store (a TypeError, or our line after pages of its frames and
    socket warnings); each is now one line, from the environment alone."""
    from relaxspec.errors import RelaxspecError
    from relaxspec.training.distributed import join

    for key, setting in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": "29511", name: value}.items():
        monkeypatch.setenv(key, setting)
    with pytest.raises(RelaxspecError) as refused:
        join(torch.device("cpu"))
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)

@pytest.mark.slow
def test_a_family_drafter_trains_on_two_processes_as_on_one(tmp_path) -> None:
    """A transformers family (Emu3: prompts with a mask, the drafter built of the model's own
    decoder layers) under DistributedDataParallel: the one-process weights."""
    pytest.importorskip("transformers")
    from helpers.emu3 import emu3_folder_at

    folder = emu3_folder_at(tmp_path / "emu3")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\nthe blue cat under the rain\na lighthouse\n")
    args = ["train-drafter", "--model-path", str(folder), "--prompts-file", str(prompts), "--image-size", "32",
            "--self-samples", "8", "--batch-size", "4", "--val-fraction", "0.25", "--steps", "3", "--lr", "3e-3",
            "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    run = torchrun(*args, "--out", str(tmp_path / "two"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert_same_weights(tmp_path / "one", tmp_path / "two")
    import json

    losses = [json.loads(line)["loss"] for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and losses[1] < losses[0]  # it trained: the same weights are not the initial ones


@pytest.mark.slow
def test_an_out_folder_in_use_is_refused_by_rank_0_alone(tmp_path, target_path) -> None:
    """Two processes given an --out another run holds: rank 0 says it in one line, rank 1 stops
    with it silently, and nothing is written there."""
    from relaxspec.runs.folder import hold_folder

    with hold_folder(tmp_path / "busy", "train-drafter"):
        run = torchrun("train-drafter", "--gpt-ckpt", target_path, *RECIPE, "--steps", "1", "--out",
                       str(tmp_path / "busy"))
    said = [line for line in run.stderr.splitlines() if line.startswith("relaxspec: error:")]
    assert run.returncode != 0 and len(said) == 1 and "is in use by another run (relaxspec train-drafter" in said[0], run.stderr
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == [".lock"]


def test_a_process_started_alone_says_what_it_waits_for_and_stops(tmp_path, target_path) -> None:
    """Issue 45: ``WORLD_SIZE=2 RANK=0 relaxspec train-drafter ...`` without the second process
    printed nothing and waited up to an hour. Rank 0 now says what it waits for once the wait is
    noticeable and stops, in one line, after RELAXSPEC_RENDEZVOUS_SECONDS (300 by default); a rank
    whose rank 0 never comes stops alike. Nothing is written."""
    args = [sys.executable, "-m", "relaxspec", "train-drafter", "--gpt-ckpt", target_path, *RECIPE, "--steps", "2",
            "--out", str(tmp_path / "run")]
    for rank in (0, 1):
        started, port = time.monotonic(), free_port()
        run = subprocess.run(args, env=env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=port, RELAXSPEC_RENDEZVOUS_SECONDS=3),
                             capture_output=True, text=True, timeout=120)
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        assert run.returncode == 2 and time.monotonic() - started < 60, run.stderr
        assert lines[-1].startswith("relaxspec: error: the 2 processes of this run did not all start within 3 s")
        if rank == 0:
            assert lines == ["relaxspec: waiting for the 2 processes of this run (WORLD_SIZE 2) at "
                             f"127.0.0.1:{port}, at most 3 s", lines[-1]]
        else:
            assert len(lines) == 1
        assert not (tmp_path / "run").exists()


def test_a_store_address_that_answers_as_something_else_is_one_line(tmp_path, target_path) -> None:
    """Issue 54: a MASTER_ADDR:MASTER_PORT that takes connections but is not the run's store (here
    a server that answers in HTTP, as a proxy did) printed 20-49 lines of c10d's C++ frames and
    socket warnings before our line. They go to a log file now, which the line names."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(30)

    def answer():
        try:
            while True:
                connection, _ = server.accept()
                with connection:
                    connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        except OSError:
            return

    threading.Thread(target=answer, daemon=True).start()
    args = [sys.executable, "-m", "relaxspec", "train-drafter", "--gpt-ckpt", target_path, *RECIPE, "--steps", "2",
            "--out", str(tmp_path / "run")]
    try:
        run = subprocess.run(args, env=env(RANK=1, LOCAL_RANK=1, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=server.getsockname()[1], RELAXSPEC_RENDEZVOUS_SECONDS=3),
                             capture_output=True, text=True, timeout=120)
    finally:
        server.close()
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith("relaxspec: error: the 2 processes of this run did not all start within 3 s")
    log = lines[0].split("(c10d's own messages: ")[1].rstrip(")")
    assert "c10d" in open(log).read()
    os.unlink(log)
