"""The one training loop (relaxspec.training.common.run_training): schedules, the per-epoch data
order, hooks at intervals, early stop, gradient clipping, and exact resumption from a middle step
(on a toy model and on a real recipe, the drafter, interrupted by Ctrl-C)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from relaxspec.models.llamagen.gpt import GPTConfig, Transformer
from relaxspec.sampling import SamplingConfig
from relaxspec.training import common
from relaxspec.training.common import Every, run_training, shuffled, warmup_constant, warmup_cosine

# ---------------------------------------------------------------------------------- schedules


def test_warmup_cosine_ramps_then_decays_to_min_lr() -> None:
    rates = [warmup_cosine(step, 20, 1.0, 4, 0.1) for step in range(22)]
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warm-up, reaching lr at its last step
    assert rates[4] == 1.0 and rates[12] == pytest.approx(0.55)  # cosine: halfway down at mid-decay
    assert all(a > b for a, b in zip(rates[4:20], rates[5:20]))
    assert rates[20] == rates[21] == 0.1  # past the end: min_lr
    assert warmup_cosine(0, 10, 2.0, 0, 0.0) == 2.0  # no warm-up


def test_warmup_constant_ramps_then_holds() -> None:
    assert [warmup_constant(step, 2.0, 4) for step in range(6)] == [0.5, 1.0, 1.5, 2.0, 2.0, 2.0]
    assert warmup_constant(10**6, 2.0, 4) == 2.0  # no dependence on the run's length
    assert warmup_constant(0, 2.0, 0) == 2.0


# ---------------------------------------------------------------------------------- a toy recipe


class Toy:
    """Linear regression with per-step noise from ``(seed, step)``: a recipe in miniature that
    records what the loop hands it."""

    def __init__(self, size: int = 10, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(size, 3, generator=gen), torch.randn(size, generator=gen)
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(3, 1)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1.0)
        self.seed, self.batches, self.rates = seed, [], []

    def loss(self, step: int, index: torch.Tensor):
        self.batches.append(index.tolist())
        self.rates.append(self.optimizer.param_groups[0]["lr"])
        noise = torch.randn(len(index), generator=torch.Generator().manual_seed(common.mix(self.seed + 1, step)))
        loss = (self.model(self.x[index]).squeeze(1) - self.y[index] + 0.1 * noise).pow(2).mean()
        return loss, {"loss": loss, "examples": len(index)}

    def run(self, steps: int = 12, **options):
        options = {"size": len(self.y), "batch_size": 4, "seed": self.seed, "grad_clip": 0.5, "progress": False,
                   "lr": lambda step: warmup_cosine(step, steps, 0.05, 2, 0.005), **options}
        return run_training(self.loss, self.optimizer, steps=steps, **options)


def test_each_epoch_visits_its_seeded_permutation_in_batches() -> None:
    toy = Toy(size=10)
    result = toy.run(steps=7)  # 3 steps an epoch (4 + 4 + 2): epochs 0, 1 and the first step of 2
    assert [len(b) for b in toy.batches] == [4, 4, 2, 4, 4, 2, 4]
    for epoch in range(2):
        visited = sum(toy.batches[3 * epoch : 3 * epoch + 3], [])
        expected = torch.randperm(10, generator=torch.Generator().manual_seed(common.mix(toy.seed, epoch)))
        assert visited == expected.tolist() == shuffled(10, toy.seed)(epoch).tolist()
    assert toy.batches[6] == shuffled(10, toy.seed)(2)[:4].tolist()
    assert sum(toy.batches[:3], []) != sum(toy.batches[3:6], [])  # a new order every epoch
    # the schedule's rate is on the optimizer when the step's loss is computed
    assert toy.rates == [warmup_cosine(step, 7, 0.05, 2, 0.005) for step in range(7)]
    assert result.step == 7 and result.examples == 24 and not result.stopped
    assert result.seconds > 0 and result.per_second == pytest.approx(24 / result.seconds)


def test_a_custom_order_is_drawn_once_per_epoch_before_that_epoch_s_batches() -> None:
    """The classifier's convention: one generator draws an epoch's order, then its batches'
    augmentation; the loop must draw in exactly the sequence of a nested epoch / batch loop."""

    def nested(epochs: int, size: int, batch_size: int) -> list:
        generator, draws = torch.Generator().manual_seed(3), []
        for _ in range(epochs):
            order = torch.randperm(size, generator=generator)
            for start in range(0, size, batch_size):
                index = order[start : start + batch_size]
                draws.append((index.tolist(), torch.rand(len(index), generator=generator).tolist()))
        return draws

    generator, draws, calls = torch.Generator().manual_seed(3), [], []

    def order(epoch: int) -> torch.Tensor:
        calls.append(epoch)
        return torch.randperm(10, generator=generator)

    model = torch.nn.Linear(1, 1)

    def loss(step: int, index: torch.Tensor):
        draws.append((index.tolist(), torch.rand(len(index), generator=generator).tolist()))
        return model.weight.sum() * 0, {}

    run_training(loss, torch.optim.SGD(model.parameters()), steps=9, size=10, batch_size=4, order=order,
                 lr=lambda step: 0.1, progress=False)
    assert calls == [0, 1, 2] and draws == nested(3, 10, 4)


def test_hooks_run_at_their_intervals_and_after_the_last_step_in_order() -> None:
    toy, calls, seen = Toy(), [], []
    toy.run(steps=10, on_step=lambda step, metrics: seen.append((step, sorted(metrics), type(metrics["loss"]))),
            hooks=[Every(4, lambda done: calls.append(("eval", done))),
                   Every(3, lambda done: calls.append(("ckpt", done)))])
    assert calls == [("ckpt", 3), ("eval", 4), ("ckpt", 6), ("eval", 8), ("ckpt", 9), ("eval", 10), ("ckpt", 10)]
    assert seen == [(step, ["examples", "loss"], float) for step in range(10)]  # every step, metrics as floats


def test_a_hook_stops_the_run_and_the_hooks_after_it_wait() -> None:
    toy, calls = Toy(), []

    def evaluate(done: int) -> bool:
        calls.append(("eval", done))
        return done == 6

    result = toy.run(steps=20, hooks=[Every(2, evaluate), Every(3, lambda done: calls.append(("ckpt", done)))])
    assert result.step == 6 and result.stopped and len(toy.batches) == 6
    assert calls == [("eval", 2), ("ckpt", 3), ("eval", 4), ("eval", 6)]  # no checkpoint at 6 after the stop


def test_nothing_left_to_train() -> None:
    toy, calls = Toy(), []
    result = toy.run(steps=5, first=5, hooks=[Every(1, calls.append)])
    assert (result.step, result.examples, result.seconds, result.per_second, result.stopped) == (5, 0, 0.0, 0.0, False)
    assert toy.batches == [] and calls == []


def test_gradient_clipping_bounds_the_update() -> None:
    def step_once(grad_clip: float) -> torch.Tensor:
        weight = torch.nn.Parameter(torch.zeros(4))
        run_training(lambda step, index: ((weight * 100).sum(), {}), torch.optim.SGD([weight]), steps=1, size=1,
                     batch_size=1, lr=lambda step: 1.0, grad_clip=grad_clip, progress=False)
        return weight.detach()

    assert torch.equal(step_once(0.0), torch.full((4,), -100.0))  # off: the raw gradient step
    assert float(step_once(1.0).norm()) == pytest.approx(1.0, rel=1e-5)  # the optimizer's parameters by default


def test_resuming_at_a_middle_step_continues_bit_for_bit() -> None:
    whole, saved = Toy(), {}

    def checkpoint(done: int) -> None:
        if done == 5:  # mid-epoch (3 steps an epoch), mid-warm-up-to-cosine
            saved.update(model=copy.deepcopy(whole.model.state_dict()),
                         optimizer=copy.deepcopy(whole.optimizer.state_dict()))

    whole.run(hooks=[Every(5, checkpoint)])
    resumed = Toy()
    with torch.no_grad():
        resumed.model.weight.fill_(math.nan)  # whatever it held is replaced by the checkpoint
    resumed.model.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(saved["optimizer"])
    result = resumed.run(first=5)
    assert result.step == 12 and resumed.batches == whole.batches[5:] and resumed.rates == whole.rates[5:]
    for name, value in whole.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name


# ---------------------------------------------------------------------------------- a real recipe


def test_an_interrupted_drafter_run_resumes_bit_for_bit(tmp_path, monkeypatch) -> None:
    from relaxspec.training.drafter import TRAIN_STATE, DrafterTrainConfig, sample_from_target, train_drafter

    torch.manual_seed(0)
    target = Transformer(GPTConfig(dim=32, n_layer=1, n_head=2, vocab_size=32, num_classes=4, block_size=16)).eval()
    dataset = sample_from_target(target, 10, sampling=SamplingConfig(cfg_scale=1.0), seed=0)

    def config(out: str) -> DrafterTrainConfig:  # 8 train sequences, 3 steps an epoch; evaluations interleave
        return DrafterTrainConfig(out=str(tmp_path / out), steps=10, batch_size=3, lr=3e-3, warmup_steps=2,
                                  val_fraction=0.2, eval_interval=4, checkpoint_interval=3, progress=False)

    whole = train_drafter(config("whole"), target=target, dataset=dataset)
    real = common.warmup_constant

    def ctrl_c(step, *args):
        if step == 7:  # step 6 ran after the checkpoint at 6 (the next is at 9): it is redone on resume
            raise KeyboardInterrupt
        return real(step, *args)

    monkeypatch.setattr(common, "warmup_constant", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(config("split"), target=target, dataset=dataset)
    monkeypatch.setattr(common, "warmup_constant", real)
    assert torch.load(tmp_path / "split" / TRAIN_STATE, weights_only=True)["step"] == 6
    resumed = train_drafter(config("split"), target=target, dataset=dataset, resume=True)
    assert resumed.step == whole.step == 10 and resumed.history == whole.history
    for name, value in whole.drafter.state_dict().items():
        assert torch.equal(value, resumed.drafter.state_dict()[name]), name


def test_a_drafter_run_interrupted_with_the_default_intervals_redoes_at_most_100_steps(tmp_path, monkeypatch) -> None:
    """The loop saves nothing on a Ctrl-C (it may land inside an optimizer step): what an interrupt
    costs is the checkpoint interval, whose default is 100 steps (it was 1,000)."""
    from relaxspec.training.drafter import TRAIN_STATE, DrafterTrainConfig, sample_from_target, train_drafter

    torch.manual_seed(0)
    target = Transformer(GPTConfig(dim=32, n_layer=1, n_head=2, vocab_size=32, num_classes=4, block_size=16)).eval()
    dataset = sample_from_target(target, 6, sampling=SamplingConfig(cfg_scale=1.0), seed=0)
    config = DrafterTrainConfig(out=str(tmp_path / "run"), steps=130, batch_size=3, val_fraction=0.0, eval_sequences=2,
                                eval_depths=1, progress=False)  # the default checkpoint and evaluation intervals
    assert config.checkpoint_interval == 100
    real = common.warmup_constant

    def ctrl_c(step, *args):
        if step == 120:
            raise KeyboardInterrupt
        return real(step, *args)

    monkeypatch.setattr(common, "warmup_constant", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(config, target=target, dataset=dataset)
    monkeypatch.setattr(common, "warmup_constant", real)
    assert torch.load(tmp_path / "run" / TRAIN_STATE, weights_only=True)["step"] == 100
    assert train_drafter(config, target=target, dataset=dataset, resume=True).step == 130
