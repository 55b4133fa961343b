"""The decoding wing's seams (issue 52): a decode is a plan -- a schedule, a draft source, a rule
-- and a new schedule or a new draft source is a new class and (for a schedule) one registry
entry, written here, in a test file, without touching the driver or any schedule's code."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from relaxspec.acceptance import ExactRule
from relaxspec.acceptance.base import one_hot
import pickle

from relaxspec.decoding import DecodePlan, Raster, Rows, decode, register, reserve, schedule
from relaxspec.decoding.plan import unregister
from relaxspec.decoding.ar import generate_ar
from relaxspec.drafting.base import DraftTree, NoDrafts
from relaxspec.drafting.tree_tables import children_table
from relaxspec.errors import RelaxspecError
from relaxspec.methods import MethodOptions
from relaxspec.sampling import SamplingConfig
from helpers.engine import markov_pair

GREEDY = SamplingConfig(cfg_scale=2.0, temperature=0.0)


@dataclass(frozen=True)
class OneAStep(Raster):
    """A schedule that knows its step count ahead: raster order with a source that drafts nothing,
    so every step commits one token of every image and the loop reads no count."""

    name = "one-a-step"

    def fixed_steps(self, num_tokens: int) -> int:
        return num_tokens - 1


class RepeatSource:
    """A draft source written for this test: a chain of ``depth`` drafts, each the root token again
    (a point mass), as a draft source of the field's simplest kind would draft."""

    forwards_per_step, models, watch, caption_rows = 0, (), None, "upstream"

    def __init__(self, depth: int):
        self.max_depth, self.max_nodes = depth, depth + 1
        self.level_widths = (1,) * depth

    def start(self, first_tokens, first_probs, first_hidden, streams, num_tokens, generator, greedy, **_) -> None:
        rows, nodes, device = first_tokens.shape[0], self.max_nodes, first_tokens.device
        self.vocab = first_probs.shape[-1]
        self.parents = torch.arange(-1, nodes - 1, device=device).expand(rows, -1)
        self.depth = torch.arange(nodes, device=device).expand(rows, -1)
        self.valid = torch.ones(rows, nodes, dtype=torch.bool, device=device)
        self.ancestors = torch.ones(nodes, nodes, dtype=torch.bool, device=device).tril().expand(rows, -1, -1)
        self.children = children_table(self.parents[:1], self.valid[:1])

    def propose(self, roots, root_index, greedy: bool) -> DraftTree:
        tokens = roots[:, None].expand(-1, self.max_nodes)
        proposals = one_hot(tokens.reshape(-1), self.vocab).view(*tokens.shape, self.vocab)
        return DraftTree(tokens, self.parents, self.depth, proposals, self.valid,
                         self.ancestors, children=self.children, level_widths=self.level_widths, point_mass=True)

    def update(self, committed, path, count, root_index, target_probs, target_hidden) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def model():
    return markov_pair(n_layer=1)[0]


@pytest.fixture
def one_a_step():
    """The test's schedule in the registry while the test runs."""
    register(OneAStep)
    yield OneAStep
    unregister(OneAStep.name)


def test_a_new_schedule_is_a_class_and_a_registry_entry(model, one_a_step):
    cond = torch.arange(3)
    assert isinstance(schedule("one-a-step"), OneAStep)
    plan = DecodePlan(schedule("one-a-step"), NoDrafts(), ExactRule())
    result = decode(model, cond, GREEDY, plan)
    assert torch.equal(result.tokens, generate_ar(model, cond, GREEDY).tokens)
    assert result.target_forwards.tolist() == [model.config.block_size] * 3
    with pytest.raises(RelaxspecError, match="unknown schedule 'diagonal'; schedules: .*one-a-step"):
        schedule("diagonal")


@pytest.mark.parametrize("plan_schedule", [Raster(), Rows(2, 2)], ids=["raster", "rows"])
def test_a_new_draft_source_decodes_on_every_schedule(model, plan_schedule):
    """Lossless and greedy: the tokens of the same schedule without drafts (in raster order, AR's),
    whatever the source drafts."""
    cond = torch.arange(2)
    truth = decode(model, cond, GREEDY, DecodePlan(plan_schedule, NoDrafts(), ExactRule())).tokens
    result = decode(model, cond, GREEDY, DecodePlan(plan_schedule, RepeatSource(3), ExactRule()))
    assert torch.equal(result.tokens, truth)
    if isinstance(plan_schedule, Raster):
        assert torch.equal(truth, generate_ar(model, cond, GREEDY).tokens)


def test_a_plan_needs_its_parts():
    with pytest.raises(RelaxspecError, match="the raster schedule needs a draft source and an acceptance rule"):
        DecodePlan(Raster())


def test_methods_build_plans_and_refuse_another_methods_setting(model):
    plan = MethodOptions("sjd", window=4).plan(target=model, sampling=GREEDY)
    assert isinstance(plan.schedule, Raster) and plan.source.max_nodes == 5 and plan.rule.lossless
    assert MethodOptions("ar").plan(target=model).schedule.name == "ar"
    rows = MethodOptions("zipar", rows=3, row_lead=2).plan(target=model)
    assert rows.schedule == Rows(3, 2, False)
    with pytest.raises(RelaxspecError, match="--delta is not used by --method sd --draft chain "
                                             r"\(it is a setting of --method lantern\)"):
        MethodOptions("sd", delta=0.2)
    with pytest.raises(RelaxspecError, match="--cool-delta is not used by --method lantern"):
        MethodOptions("lantern", cool_delta=1.0)
    options = MethodOptions("cool", nu=0.5)
    assert type(options.own).__name__ == "CoolSettings" and options.own.nu == 0.5 and options.shared.draft == "static"
    with pytest.raises(AttributeError, match="no setting 'delta' for --method cool"):
        options.delta = 0.3


def test_a_plan_is_all_a_decode_and_a_reserve_take(model):
    source = RepeatSource(2)
    plan = DecodePlan(Raster(), source, ExactRule())
    reserve(model, plan)  # the plan's schedule and source
    with pytest.raises(RelaxspecError, match="a DecodePlan holds its parts; rule given beside it would be ignored"):
        decode(model, torch.arange(1), GREEDY, plan, rule=ExactRule())


def test_method_options_pickle_as_they_are():
    for options in (MethodOptions("lantern", delta=0.2), MethodOptions("cool", nu=0.5), MethodOptions("ar")):
        again = pickle.loads(pickle.dumps(options))
        assert again == options and again.to_dict() == options.to_dict() and type(again.own) is type(options.own)
