"""Drafter training: the pairing, that the loss falls, exact resume, the saved format, bad input."""

import argparse
import json

import numpy as np
import pytest
import torch

from helpers.engine import peaked_target
from relaxspec.cli.train import add_train_drafter_parser, run_train_drafter
from relaxspec.models.weights import save_model
from relaxspec.drafting.eagle import EagleDrafter, load_drafter
from relaxspec.errors import RelaxspecError
from relaxspec.models.llamagen.gpt import GPTConfig, Transformer
from relaxspec.models.llamagen.vq import VQConfig, VQModel
from relaxspec.sampling import SamplingConfig
from relaxspec.training.drafter import (
    TRAIN_STATE,
    DrafterDataset,
    DrafterTrainConfig,
    drafter_inputs,
    drafter_loss,
    drafter_targets,
    encode_images,
    evaluate_drafter,
    load_token_file,
    sample_from_target,
    target_features,
    train_drafter,
)

TINY = GPTConfig(dim=64, n_layer=2, n_head=4, vocab_size=64, num_classes=10, block_size=16)



def make_target(config: GPTConfig = TINY, seed: int = 0) -> Transformer:
    return peaked_target(config, seed)  # peaked distributions, so the CE has something to learn


@pytest.fixture(scope="module")
def target() -> Transformer:
    return make_target()


@pytest.fixture(scope="module")
def dataset(target: Transformer) -> DrafterDataset:
    return sample_from_target(target, 16, sampling=SamplingConfig(cfg_scale=1.0), seed=0)


def quick(out, **overrides) -> DrafterTrainConfig:
    fields = dict(out=str(out), steps=10, batch_size=4, lr=3e-3, warmup_steps=2, val_fraction=0.0,
                  progress=False, eval_interval=1000, checkpoint_interval=1000)
    return DrafterTrainConfig(**{**fields, **overrides})


# ---------------------------------------------------------------------------------- pairing


@torch.no_grad()
def test_pairing_matches_incremental_decoding(target: Transformer, dataset: DrafterDataset) -> None:
    """An oracle that runs the target token by token with its KV cache — as decoding does — and
    outputs the hidden state after consuming ``t_j`` gets zero feature loss: pair ``j`` must
    predict exactly that."""
    tokens, labels = dataset.tokens[:3], dataset.labels[:3]
    batch, n = tokens.shape
    for cond in (labels, target.null_condition(labels)):
        cls = target.config.cls_token_num
        target.setup_caches(batch, cls + n)
        try:
            slots = torch.arange(cls).expand(batch, -1)
            logits, hidden = target(cond=cond, positions=slots, cache_slots=slots, return_hidden=True)
            before, before_logits = [hidden[:, -1]], [logits[:, -1]]  # what predicted t_j
            for j in range(n - 1):
                where = torch.full((batch, 1), cls + j)
                logits, hidden = target(tokens[:, j : j + 1], where, cache_slots=where, return_hidden=True)
                before.append(hidden[:, 0])
                before_logits.append(logits[:, 0])
        finally:
            target.clear_caches()
        incremental = torch.stack(before, dim=1)  # [B, N, dim]: row j predicts t_j
        incremental_logits = torch.stack(before_logits, dim=1)

        null_rows = 0 if cond is labels else batch
        features, logits = target_features(target, tokens, labels, null_rows)
        features, logits = features[-batch:], logits[-batch:]
        in_features, in_tokens, positions = drafter_inputs(features, tokens)
        next_features, next_logits = drafter_targets(features, logits)
        next_probs = next_logits.softmax(dim=-1)
        assert in_features.shape == next_features.shape == (batch, n - 1, TINY.dim)
        assert next_logits.shape == (batch, n - 1, TINY.vocab_size)
        torch.testing.assert_close(in_features, incremental[:, :-1], atol=1e-5, rtol=1e-5)
        assert torch.equal(in_tokens, tokens[:, :-1])
        assert torch.equal(positions, torch.arange(n - 1).expand(batch, -1))

        oracle_features = incremental[:, 1:, None].transpose(1, 2)  # [B, 1 depth, T, dim]: the state after t_j
        oracle_logits = incremental_logits[:, 1:, None].transpose(1, 2)
        plain = SamplingConfig(cfg_scale=1.0)
        losses = drafter_loss(oracle_features, oracle_logits, next_features, next_logits, sampling=plain)
        assert float(losses["feature_loss"]) < 1e-9
        entropy = -(next_probs * next_probs.clamp_min(1e-30).log()).sum(-1).mean()
        torch.testing.assert_close(losses["ce"], entropy, atol=1e-4, rtol=1e-4)
        assert float(losses["accuracy"]) == 1.0
        torch.testing.assert_close(losses["accept"], torch.ones(1), atol=1e-5, rtol=0)
        # The test can tell: an oracle one position off is far from zero.
        shifted = drafter_loss(incremental[:, None, :-1], incremental_logits[:, None, :-1], next_features,
                               next_logits, sampling=plain)
        assert float(shifted["feature_loss"]) > 1e-3


def test_target_features_stack_class_then_null_rows(target: Transformer, dataset: DrafterDataset) -> None:
    tokens, labels = dataset.tokens[:4], dataset.labels[:4]
    features, logits = target_features(target, tokens, labels, null_rows=2)
    assert features.shape == (6, 16, TINY.dim) and logits.shape == (6, 16, TINY.vocab_size)
    with torch.no_grad():
        null_logits = target.forward_train(target.null_condition(labels[:2]), tokens[:2])
    torch.testing.assert_close(logits[4:], null_logits)


# ---------------------------------------------------------------------------------- training


def test_loss_falls_and_draft_accuracy_rises(tmp_path, target: Transformer, dataset: DrafterDataset) -> None:
    config = quick(tmp_path / "run", steps=120, eval_interval=60)
    result = train_drafter(config, target=target, dataset=dataset)
    first, last = result.history[0], result.history[-1]
    assert first["step"] == 0 and last["step"] == 120
    assert last["ce"] < 0.7 * first["ce"]
    assert last["feature_loss"] < 0.5 * first["feature_loss"]
    chance = 1 / TINY.vocab_size
    assert first["accuracy"] < 5 * chance < 0.3 < last["accuracy"]
    again = evaluate_drafter(result.drafter, dataset, config)
    assert again["accuracy"] == pytest.approx(last["accuracy"])
    assert result.sequences_per_second > 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 60, 120]


def test_resume_continues_exactly(tmp_path, target: Transformer, dataset: DrafterDataset) -> None:
    # 4 steps per epoch: the split run crosses an epoch boundary after resuming.
    straight = train_drafter(quick(tmp_path / "a", steps=10), target=target, dataset=dataset)
    train_drafter(quick(tmp_path / "b", steps=6), target=target, dataset=dataset)
    state = torch.load(tmp_path / "b" / TRAIN_STATE, weights_only=True)
    assert state["step"] == 6
    resumed = train_drafter(quick(tmp_path / "b", steps=10), target=target, dataset=dataset, resume=True)
    assert resumed.step == 10
    a, b = straight.drafter.state_dict(), resumed.drafter.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_save_load_round_trip(tmp_path, target: Transformer, dataset: DrafterDataset) -> None:
    result = train_drafter(quick(tmp_path / "run", steps=3), target=target, dataset=dataset)
    loaded = load_drafter(tmp_path / "run", target)
    meta = json.loads((tmp_path / "run" / "config.json").read_text())
    assert meta["kind"] == "drafter" and meta["training"]["step"] == 3
    features, logits = target_features(target, dataset.tokens[:2], dataset.labels[:2], null_rows=2)
    inputs = drafter_inputs(features, torch.cat([dataset.tokens[:2]] * 2))
    with torch.no_grad():
        want = result.drafter(*inputs)
        got = loaded(*inputs)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_init_from_starts_at_the_given_drafter(tmp_path, target: Transformer, dataset: DrafterDataset) -> None:
    first = train_drafter(quick(tmp_path / "first", steps=3), target=target, dataset=dataset)
    warm = train_drafter(quick(tmp_path / "warm", steps=0, init_from=str(tmp_path / "first")), target=target,
                         dataset=dataset)
    for name, value in first.drafter.state_dict().items():
        assert torch.equal(value, warm.drafter.state_dict()[name]), name
    cold = train_drafter(quick(tmp_path / "cold", steps=0), target=target, dataset=dataset)
    assert not torch.equal(cold.drafter.fc.weight, first.drafter.fc.weight)
    # A deeper drafter grows from it: the new block starts as the identity, the same function.
    grown = train_drafter(quick(tmp_path / "two", steps=0, n_layer=2, init_from=str(tmp_path / "first")),
                          target=target, dataset=dataset)
    features, _ = target_features(target, dataset.tokens[:2], dataset.labels[:2], null_rows=0)
    inputs = drafter_inputs(features, dataset.tokens[:2])
    with torch.no_grad():
        torch.testing.assert_close(grown.drafter(*inputs)[1], first.drafter(*inputs)[1], atol=1e-5, rtol=1e-5)
    assert not grown.drafter.layers[1].attention.wo.weight.detach().any()
    with pytest.raises(RelaxspecError, match="keeps or adds blocks"):
        train_drafter(quick(tmp_path / "one", steps=0, n_layer=1, init_from=str(tmp_path / "two")), target=target,
                      dataset=dataset)


def test_cli_trains_and_resumes(tmp_path, target: Transformer, dataset: DrafterDataset) -> None:
    save_model(target, tmp_path / "target")
    np.savez(tmp_path / "data.npz", tokens=dataset.tokens.numpy(), labels=dataset.labels.numpy())
    parser = argparse.ArgumentParser()
    add_train_drafter_parser(parser.add_subparsers(dest="command"))
    common = ["train-drafter", "--gpt-ckpt", str(tmp_path / "target"), "--out", str(tmp_path / "run"), "--no-progress"]
    args = parser.parse_args(common + ["--data", str(tmp_path / "data.npz"), "--steps", "3", "--batch-size", "4",
                                       "--lr", "1e-3", "--self-samples", "4", "--classes", "1,2", "3"])
    assert args.handler(args) == 0
    assert torch.load(tmp_path / "run" / TRAIN_STATE, weights_only=True)["step"] == 3
    # Resuming needs only the run length: the recipe comes from the saved state ...
    args = parser.parse_args(common + ["--resume", "--steps", "5"])
    assert run_train_drafter(args) == 0
    state = torch.load(tmp_path / "run" / TRAIN_STATE, weights_only=True)
    assert state["step"] == 5 and state["config"]["lr"] == 1e-3 and state["config"]["classes"] == [1, 2, 3]
    # ... and may not change it.
    args = parser.parse_args(common + ["--resume", "--steps", "7", "--lr", "5e-4"])
    with pytest.raises(RelaxspecError, match="different recipe: lr"):
        run_train_drafter(args)


def test_two_runs_may_not_share_an_out_folder(tmp_path, target: Transformer, dataset: DrafterDataset) -> None:
    """While a run holds --out, another is refused in one line (naming the holder) before it reads
    or writes anything there; once the holder ends (or is killed: the lock is the OS's), the
    folder is free again."""
    import subprocess
    import sys

    from relaxspec.cli import main
    from relaxspec.runs.folder import LOCK_FILE

    save_model(target, tmp_path / "target")
    np.savez(tmp_path / "data.npz", tokens=dataset.tokens.numpy(), labels=dataset.labels.numpy())
    out = tmp_path / "run"
    argv = ["train-drafter", "--gpt-ckpt", str(tmp_path / "target"), "--data", str(tmp_path / "data.npz"), "--steps",
            "2", "--batch-size", "4", "--no-progress", "--out", str(out)]
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from relaxspec.runs.folder import hold_folder\n"
                               "with hold_folder(sys.argv[1], 'train-drafter'):\n    print('held', flush=True); "
                               "time.sleep(60)", str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RelaxspecError, match=rf"--out {out} is in use by another run \(relaxspec train-drafter, "
                                                 rf"pid {holder.pid}\); wait for it to end or choose another folder"):
            train_drafter(DrafterTrainConfig(out=str(out), steps=2, batch_size=4, progress=False),
                          target=target, dataset=dataset)
        assert not (out / TRAIN_STATE).exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(argv) == 0  # the killed holder's lock went with it
    assert (out / LOCK_FILE).is_file() and torch.load(out / TRAIN_STATE, weights_only=True)["step"] == 2


# ---------------------------------------------------------------------------------- data


def test_token_files_and_their_labels(tmp_path) -> None:
    tokens = np.arange(32).reshape(2, 16) % 64
    (tmp_path / "a").mkdir()
    np.save(tmp_path / "a" / "tokens.npy", tokens)
    # as `relaxspec generate` writes it; only the images it records (as done) are used
    (tmp_path / "a" / "stats.json").write_text(json.dumps({"images": [{"index": 1, "class": 4, "file": "0001.png"}]}))
    data = load_token_file(tmp_path / "a" / "tokens.npy")
    assert data.labels.tolist() == [4] and data.tokens.tolist() == tokens[1:].tolist()
    (tmp_path / "b").mkdir()
    np.save(tmp_path / "b" / "tokens.npy", tokens)
    with pytest.raises(RelaxspecError, match="--label"):
        load_token_file(tmp_path / "b" / "tokens.npy")
    assert load_token_file(tmp_path / "b" / "tokens.npy", label=7).labels.tolist() == [7, 7]
    np.save(tmp_path / "b" / "labels.npy", np.array([1, 2]))
    assert load_token_file(tmp_path / "b" / "tokens.npy").labels.tolist() == [1, 2]
    np.savez(tmp_path / "c.npz", tokens=tokens, labels=np.array([5, 6]))
    data = load_token_file(tmp_path / "c.npz")
    assert data.tokens.dtype == torch.long and data.labels.tolist() == [5, 6]


def test_image_folder_is_encoded_with_class_folders(tmp_path) -> None:
    from PIL import Image

    torch.manual_seed(0)
    vq = VQModel(VQConfig(codebook_size=64, codebook_embed_dim=8, z_channels=16, ch=32, ch_mult=(1, 2),
                          num_res_blocks=1, norm_groups=8)).eval()
    rng = np.random.default_rng(0)
    for name, count in (("3", 2), ("5", 1)):
        (tmp_path / name).mkdir()
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)).save(tmp_path / name / f"{i}.png")
    data = encode_images(tmp_path, vq, image_size=8)  # 8 px / downsample 2 = 4x4 = TINY's grid
    assert data.tokens.shape == (3, 16) and data.labels.tolist() == [3, 3, 5]
    data.check_for(make_target())
    # a target in memory: the family's VQ input alone encodes them (the target is not opened again)
    save_model(vq, tmp_path / "vq")
    config = quick(tmp_path / "run", steps=1, images=str(tmp_path), inputs={"vq_ckpt": str(tmp_path / "vq")})
    with pytest.raises(RelaxspecError, match="give --vq-ckpt PATH"):
        train_drafter(quick(tmp_path / "bad", steps=1, images=str(tmp_path), inputs={"t5_path": "t5"}),
                      target=make_target())
    assert train_drafter(config, target=make_target()).step == 1


# ---------------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors(tmp_path, target: Transformer, dataset: DrafterDataset) -> None:
    with pytest.raises(RelaxspecError, match="no training data"):
        train_drafter(quick(tmp_path / "x"), target=target)
    with pytest.raises(RelaxspecError, match="no such token file"):
        train_drafter(quick(tmp_path / "x", data=[str(tmp_path / "missing.npy")]), target=target)
    with pytest.raises(RelaxspecError, match="grid"):
        train_drafter(quick(tmp_path / "x"), target=target, dataset=DrafterDataset(dataset.tokens[:, :9], dataset.labels))
    with pytest.raises(RelaxspecError, match="classes"):
        train_drafter(quick(tmp_path / "x"), target=target, dataset=DrafterDataset(dataset.tokens, dataset.labels + 10))
    with pytest.raises(RelaxspecError, match="no training state"):
        train_drafter(quick(tmp_path / "x"), target=target, dataset=dataset, resume=True)
    for bad in (dict(lr=0), dict(noise=-1), dict(null_fraction=1.5), dict(batch_size=0), dict(images="imgs")):
        with pytest.raises(RelaxspecError):
            quick(tmp_path / "x", **bad)

    train_drafter(quick(tmp_path / "run", steps=1), target=target, dataset=dataset)
    with pytest.raises(RelaxspecError, match="already holds a training run"):
        train_drafter(quick(tmp_path / "run", steps=1), target=target, dataset=dataset)
    with pytest.raises(RelaxspecError, match="different recipe: lr"):
        train_drafter(quick(tmp_path / "run", steps=2, lr=1e-2), target=target, dataset=dataset, resume=True)

    other = make_target(GPTConfig(dim=32, n_layer=1, n_head=2, vocab_size=64, num_classes=10, block_size=16))
    with pytest.raises(RelaxspecError, match="different target"):
        load_drafter(tmp_path / "run", other)
    save_model(target, tmp_path / "gpt")
    with pytest.raises(RelaxspecError, match="not a drafter"):
        load_drafter(tmp_path / "gpt", target)
    with pytest.raises(RelaxspecError, match="no such file"):
        load_drafter(tmp_path / "nowhere", target)
    t2i = Transformer(GPTConfig(dim=64, n_layer=1, n_head=4, vocab_size=64, model_type="t2i", cls_token_num=2,
                                caption_dim=8, block_size=16))
    with pytest.raises(RelaxspecError, match="this target is t2i"):
        train_drafter(quick(tmp_path / "y"), target=t2i, dataset=dataset)
    assert isinstance(load_drafter(tmp_path / "run", target), EagleDrafter)


# ---------------------------------------------------------------------------------- hostile input


@pytest.mark.parametrize("option", [["--epochs", "inf"], ["--epochs", "nan"], ["--epochs=-inf"], ["--lr", "inf"],
                                    ["--ce-weight", "nan"]])
def test_cli_refuses_endless_and_not_a_number_settings_in_one_line(tmp_path, refused, target: Transformer,
                                                                  dataset: DrafterDataset, option) -> None:
    """``--epochs inf`` used to end in an OverflowError traceback (ceil(inf x steps an epoch));
    every setting is now checked with the config, before any model is loaded."""
    save_model(target, tmp_path / "target")
    np.savez(tmp_path / "data.npz", tokens=dataset.tokens.numpy(), labels=dataset.labels.numpy())
    name = option[0].split("=")[0].lstrip("-").replace("-", "_")
    refused(["train-drafter", "--gpt-ckpt", str(tmp_path / "target"), "--data", str(tmp_path / "data.npz"), "--out",
             str(tmp_path / "run"), "--no-progress", *option], f"{name} must be a finite number")


def test_run_length_is_bounded(tmp_path, target: Transformer, dataset: DrafterDataset) -> None:
    with pytest.raises(RelaxspecError, match=r"steps must lie in \[0, 1,000,000,000\]"):
        quick(tmp_path / "run", steps=10**30)
    with pytest.raises(RelaxspecError, match="a run takes at most 1,000,000,000"):  # epochs x steps an epoch
        train_drafter(quick(tmp_path / "run", steps=None, epochs=1e300), target=target, dataset=dataset)


def test_cli_refuses_a_loss_weight_the_law_loss_never_reads(tmp_path, refused) -> None:
    common = ["train-drafter", "--gpt-ckpt", str(tmp_path / "none"), "--out", str(tmp_path / "run")]
    refused(common + ["--law-loss", "kl", "--ce-weight", "0.5"],
            "--ce-weight goes with --law-loss ce; --law-loss kl reads --distill-weight")
    refused(common + ["--law-loss", "ce", "--distill-weight", "2"], "--distill-weight goes with --law-loss kl")
    refused(common + ["--distill-weight", "2"], "--law-loss ce reads --ce-weight")  # ce is the default
    # the config's defaults (ce_weight 0.1, distill_weight 1.0) are not given: no complaint about them
    from relaxspec.cli.train import check_law_weight

    parser = argparse.ArgumentParser()
    add_train_drafter_parser(parser.add_subparsers(dest="command"))
    for law, given in (("kl", ["--distill-weight", "2"]), ("tv", []), ("ce", ["--ce-weight", "0.2"])):
        check_law_weight(parser.parse_args(common + ["--law-loss", law, *given]), law)


@pytest.mark.parametrize("content", ["random bytes", "an object"])
def test_an_unreadable_train_state_is_refused_without_torch_s_advice(tmp_path, capsys, content) -> None:
    """Never pass on torch's "load with weights_only=False": that would run the pickle's code."""
    from fractions import Fraction

    from relaxspec.cli import main

    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / TRAIN_STATE
    if content == "random bytes":
        path.write_bytes(np.random.default_rng(0).bytes(300))
    else:
        torch.save({"format_version": 1, "config": {}, "step": Fraction(1, 2)}, path)
    for argv in (["--resume"], ["--resume", "--steps", "3"]):
        assert main(["train-drafter", "--out", str(tmp_path / "run"), *argv]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert "not a relaxspec training state" in err and "cannot be read safely" in err
        assert "weights_only" not in err
    with pytest.raises(RelaxspecError, match="already holds a training run"):  # a fresh run does not overwrite it
        train_drafter(quick(tmp_path / "run"), target=make_target())


def test_resume_continues_a_run_stopped_while_drawing_self_samples(tmp_path, target: Transformer, monkeypatch):
    """The self-samples are drawn (and cached batch by batch) before training: --resume alone
    continues a run stopped there, with its recipe, drawing only the batches it had not."""
    from relaxspec.cli import main
    from relaxspec.training.drafter import data as ar_module  # where the sampler looks generate_ar up
    from relaxspec.training.drafter import SELF_SAMPLES

    save_model(target, tmp_path / "target")
    out = ["--out", str(tmp_path / "run"), "--no-progress"]
    real, calls = ar_module.generate_ar, []

    def ctrl_c_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ar_module, "generate_ar", ctrl_c_on_second)
    assert main(["train-drafter", "--gpt-ckpt", str(tmp_path / "target"), "--self-samples", "8", "--batch-size", "4",
                 "--classes", "1", "2", "--steps", "2", "--lr", "1e-3", *out]) == 130
    assert not (tmp_path / "run" / SELF_SAMPLES).exists()  # written whole once every batch is drawn
    assert len(list((tmp_path / "run").glob("self_samples.parts-*/batch-*.npy"))) == 1  # the first batch is kept
    calls.clear()
    monkeypatch.setattr(ar_module, "generate_ar", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    assert main(["train-drafter", "--resume", *out]) == 0
    assert len(calls) == 1  # only the unfinished batch
    assert int(np.load(tmp_path / "run" / SELF_SAMPLES)["done"]) == 8
    assert not list((tmp_path / "run").glob("self_samples.parts-*"))
    state = torch.load(tmp_path / "run" / TRAIN_STATE, weights_only=True)
    assert state["step"] == 2 and state["config"]["lr"] == 1e-3 and state["config"]["classes"] == [1, 2]


def test_one_metrics_row_per_evaluated_step_across_a_resume(tmp_path, target: Transformer, dataset: DrafterDataset,
                                                            monkeypatch) -> None:
    from relaxspec.training import common

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0}\n')  # left by a run stopped before saving a state
    real = common.warmup_constant

    def ctrl_c(step, *args):
        if step == 5:  # before the first checkpoint after the baseline (interval 1000)
            raise KeyboardInterrupt
        return real(step, *args)

    monkeypatch.setattr(common, "warmup_constant", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(quick(tmp_path / "run"), target=target, dataset=dataset)
    monkeypatch.setattr(common, "warmup_constant", real)
    assert torch.load(tmp_path / "run" / TRAIN_STATE, weights_only=True)["step"] == 0  # the baseline is saved
    resumed = train_drafter(quick(tmp_path / "run"), target=target, dataset=dataset, resume=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [r["step"] for r in resumed.history] == [0, 10]


def test_best_holds_trained_weights_never_the_baseline(tmp_path, target: Transformer, dataset: DrafterDataset) -> None:
    """No scheduled evaluation in 3 steps (interval 1000): the last step's weights are evaluated and
    kept in out/best, not the untrained ones of step 0 (a baseline, not a candidate)."""
    from relaxspec.training.drafter import BEST

    result = train_drafter(quick(tmp_path / "run", steps=3), target=target, dataset=dataset)
    assert [(r["step"], r["best"]) for r in result.history] == [(0, False), (3, True)]
    assert result.best["step"] == 3
    best = load_drafter(tmp_path / "run" / BEST, target)
    for name, value in result.drafter.state_dict().items():
        assert torch.equal(value, best.state_dict()[name]), name
    # a learning rate that makes every trained evaluation worse than the baseline still keeps a trained one
    wild = train_drafter(quick(tmp_path / "wild", steps=4, eval_interval=2, lr=3.0, warmup_steps=0), target=target,
                         dataset=dataset)
    assert wild.best["step"] in (2, 4) and not wild.history[0]["best"]
    assert wild.best["chain_mal"] == max(r["chain_mal"] for r in wild.history if r["step"] > 0)


# ---------------------------------------------------------------------------------- family inputs


def test_family_inputs_are_one_checked_field_and_old_runs_map_into_it() -> None:
    """``inputs`` holds what the target's family opens it with (names it declares); an older run's
    ``t5_path`` / ``tokenizer_path`` / ``negative_prompt`` fields read back as its inputs."""
    from pathlib import Path

    assert DrafterTrainConfig().inputs == {}
    assert DrafterTrainConfig(inputs={"t5_path": Path("t5"), "negative_prompt": None}).inputs == {"t5_path": "t5"}
    with pytest.raises(RelaxspecError, match="nope is not an input of any model family"):
        DrafterTrainConfig(inputs={"nope": "x"})
    with pytest.raises(RelaxspecError, match="--negative-prompt is text, got int"):
        DrafterTrainConfig(inputs={"negative_prompt": 3})
    old = {**DrafterTrainConfig().to_dict(), "t5_path": "t5", "tokenizer_path": None, "negative_prompt": "blurry"}
    del old["inputs"]
    assert DrafterTrainConfig.from_dict(old).inputs == {"t5_path": "t5", "negative_prompt": "blurry"}


def test_a_run_saved_with_llamagens_own_fields_reads_them_as_its_inputs() -> None:
    """Runs saved before LlamaGen became a family like the others kept its files and sizes as
    fields of their own (``gpt_ckpt``, ``gpt_model``, ``vq_ckpt``, ``vq_model``, ``downsample``):
    they read back as the family's inputs (the values every run saved by default left out), so such
    a run resumes, moved files included, and a changed size is still a different recipe."""
    from relaxspec.training.drafter.config import check_resume

    old = {**DrafterTrainConfig().to_dict(), "gpt_ckpt": "gpt.pt", "gpt_model": "GPT-B", "vq_ckpt": None,
           "vq_model": "VQ-16", "downsample": 16}
    del old["inputs"]
    assert DrafterTrainConfig.from_dict(old).inputs == {"gpt_ckpt": "gpt.pt", "gpt_model": "GPT-B"}
    check_resume(old, DrafterTrainConfig(inputs={"gpt_ckpt": "moved/gpt.pt", "gpt_model": "GPT-B"}))
    with pytest.raises(RelaxspecError, match=r"gpt_model \(saved 'GPT-B', now 'GPT-L'\)"):
        check_resume(old, DrafterTrainConfig(inputs={"gpt_ckpt": "gpt.pt", "gpt_model": "GPT-L"}))
    eight = {**old, "downsample": 8}
    assert DrafterTrainConfig.from_dict(eight).inputs["downsample"] == 8


def test_a_resume_compares_inputs_one_by_one(tmp_path) -> None:
    """A path input may move (like --gpt-ckpt); a text input is the recipe. An older run's saved
    fields compare with today's inputs."""
    from relaxspec.training.drafter.config import check_resume

    old = {**DrafterTrainConfig().to_dict(), "t5_path": "t5", "tokenizer_path": None, "negative_prompt": "blurry"}
    del old["inputs"]
    check_resume(old, DrafterTrainConfig(inputs={"t5_path": "t5", "negative_prompt": "blurry"}))
    check_resume(old, DrafterTrainConfig(inputs={"t5_path": "moved/t5", "negative_prompt": "blurry"}))
    with pytest.raises(RelaxspecError, match=r"different recipe: negative_prompt \(saved 'blurry', now 'dark'\)"):
        check_resume(old, DrafterTrainConfig(inputs={"t5_path": "t5", "negative_prompt": "dark"}))
    with pytest.raises(RelaxspecError, match=r"negative_prompt \(saved 'blurry', now None\)"):
        check_resume(old, DrafterTrainConfig(inputs={"t5_path": "t5"}))


def test_an_old_run_resumes_from_the_command_line(tmp_path, target: Transformer, dataset: DrafterDataset) -> None:
    """A train state written before ``inputs`` (the old fields, all unset) continues with ``--resume``
    and keeps its recipe; a family input the target's family does not take is refused in one line."""
    from relaxspec.cli import main

    save_model(target, tmp_path / "target")
    np.savez(tmp_path / "data.npz", tokens=dataset.tokens.numpy(), labels=dataset.labels.numpy())
    out = ["--out", str(tmp_path / "run"), "--no-progress"]
    assert main(["train-drafter", "--gpt-ckpt", str(tmp_path / "target"), "--data", str(tmp_path / "data.npz"),
                 "--steps", "1", "--batch-size", "4", *out]) == 0
    state = torch.load(tmp_path / "run" / TRAIN_STATE, weights_only=True)
    inputs = state["config"].pop("inputs")  # an old state: the target's files were fields of their own
    state["config"].update(t5_path=None, tokenizer_path=None, negative_prompt=None, gpt_model=None, vq_ckpt=None,
                           vq_model="VQ-16", downsample=16, **inputs)
    torch.save(state, tmp_path / "run" / TRAIN_STATE)
    assert main(["train-drafter", "--resume", "--steps", "2", *out]) == 0
    state = torch.load(tmp_path / "run" / TRAIN_STATE, weights_only=True)
    assert state["step"] == 2 and state["config"]["inputs"] == {"gpt_ckpt": str(tmp_path / "target")}
    assert "t5_path" not in state["config"] and "gpt_ckpt" not in state["config"]


def test_another_family_s_input_is_refused_before_the_target_loads(tmp_path, refused) -> None:
    common = ["train-drafter", "--gpt-ckpt", str(tmp_path / "none"), "--self-samples", "2", "--out",
              str(tmp_path / "run")]
    refused(common + ["--negative-prompt", "blurry"],
            "--negative-prompt goes with --model-path (Emu3); this model is a LlamaGen checkpoint")
    refused(common + ["--tokenizer-path", "tok"], "--tokenizer-path goes with --model-path (")


def test_a_checkpoint_pair_opens_as_every_command_opens_it(tmp_path, tiny_ckpts, capsys, refused) -> None:
    """``--gpt-ckpt`` with ``--vq-ckpt`` opens through ``open_pipeline`` (the pair checked), and
    ``--images`` are encoded with that VQ; a c2i checkpoint refuses a t2i one's input."""
    from PIL import Image

    from relaxspec.cli import main

    (tmp_path / "images").mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(tmp_path / "images" / f"{i}.png")
    pair = tiny_ckpts["c2i"]["args"]
    out = tmp_path / "run"
    assert main(["train-drafter", *pair, "--images", str(tmp_path / "images"), "--label", "1", "--steps", "1",
                 "--batch-size", "2", "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    assert (out / "model.safetensors").is_file()
    refused(["train-drafter", *pair, "--t5-path", str(tmp_path), "--self-samples", "2", "--out", str(tmp_path / "x")],
            "this is a class-conditional (c2i) model")


def test_an_evaluation_under_cfg_measures_every_row_s_law(target: Transformer, dataset: DrafterDataset) -> None:
    """Decoding guides every row: with null_fraction 0.5 an evaluation batch of one row once had
    no null row, so no law to measure (NaN chain MAL, and no evaluation could become the best)."""
    drafter = EagleDrafter.for_target(target).float().attach(target)
    one = dataset.subset(torch.arange(1))
    half = evaluate_drafter(drafter, one, DrafterTrainConfig(null_fraction=0.5, cfg_scale=4.0))
    whole = evaluate_drafter(drafter, one, DrafterTrainConfig(null_fraction=1.0, cfg_scale=4.0))
    assert np.isfinite(half["chain_mal"]) and half == whole
