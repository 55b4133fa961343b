"""The method registry: one meaning per method name in generate, bench and the Python API, on a
model with presets (the embedded one) and without; a new family plugs in with its file and one
registry entry."""

from __future__ import annotations

import sys
import types

import pytest

from relaxspec import embedded, methods
from relaxspec.bench.config import expand_methods
from relaxspec.cli import build_parser
from relaxspec.cli.imagerun import given_settings
from relaxspec.errors import RelaxspecError
from relaxspec.methods import registry
from relaxspec.methods.base import Method, Preset, Setting

NAMES = [name for name in methods.presets()]


@pytest.fixture(scope="module")
def embedded_pipeline():
    from relaxspec.pipelines import open_pipeline

    return open_pipeline()


def generate_settings(name: str, user_model: bool, *flags: str) -> dict:
    """What ``relaxspec generate`` resolves: the flags the user set over the model's preset."""
    args = build_parser().parse_args(["generate", "--out", "x", "--method", name, *flags])
    presets = {} if user_model else embedded.defaults()["presets"]
    return methods.resolve(args.method, given_settings(args), presets).to_dict()


@pytest.mark.parametrize("user_model", [False, True], ids=["embedded", "user-model"])
@pytest.mark.parametrize("name", NAMES)
def test_a_name_means_the_same_settings_everywhere(name, user_model, embedded_pipeline):
    presets = {} if user_model else embedded.defaults()["presets"]
    from_generate = generate_settings(name, user_model)
    [spec] = [s for s in expand_methods([name], None, presets) if s.label == name]
    assert spec.to_dict()["options"] == from_generate
    if not user_model:  # the pipeline (relaxspec.generate, the demo) reads the same presets
        options = methods.resolve(name)
        if not options.needs_drafter or embedded_pipeline.drafter is not None:
            assert embedded_pipeline.method(name).to_dict() == from_generate


def test_the_embedded_model_tunes_its_method_names():
    tuned = generate_settings("lantern", False)
    assert (tuned["draft"], tuned["tree"], tuned["k"], tuned["delta"]) == ("static", "emoji-lantern", 64, 0.5)
    plain = generate_settings("lantern", True)  # the paper's setting: EAGLE-2's tree, k 1000, delta 0.1
    assert (plain["draft"], plain["k"], plain["delta"]) == ("dynamic", 1000, 0.1)
    # Flags win over the preset, and a flag that replaces the preset's alternative drops it.
    assert generate_settings("lantern", False, "--lam", "3")["lam"] == 3.0
    assert "delta" not in generate_settings("lantern", False, "--lam", "3")
    assert generate_settings("lantern", False, "--lam", "3")["k"] == 10  # k is tuned with the bound it goes with
    assert generate_settings("lantern", False, "--draft", "static", "--tree", "emoji-relaxed", "--lam", "5") == \
        generate_settings("lantern++", False)
    assert generate_settings("lantern", True, "--draft", "chain")["depth"] == 4  # a chain is 4 deep, any preset
    chain = generate_settings("lantern", False, "--draft", "chain", "--depth", "2")
    assert (chain["draft"], chain["depth"], chain["k"]) == ("chain", 2, 64) and "tree" not in chain
    with pytest.raises(RelaxspecError, match="--group-p-gap is not used by --method lantern"):
        generate_settings("lantern", False, "--group-p-gap", "0.1")
    with pytest.raises(RelaxspecError, match="--k is not used by --method gsd --draft jacobi"):
        generate_settings("gsd", False, "--k", "5")


@pytest.mark.parametrize("name, given, message", [
    ("gsd", {"group_ranks": 2.5}, "group_ranks must be an int, got 2.5"),
    ("gsd", {"window": "8"}, "window must be an int, got '8'"),
    ("sd", {"depth": True}, "depth must be an int, got True"),
    ("ar-compiled", {"compile": False}, "--method ar-compiled means compile=True; use --method ar"),
    ("lantern++", {"draft": "chain"}, "for another value use --method lantern --draft chain --lam 5.0"),
    ("sjd-pac-official", {"rows": 2}, "--sjd-pac-rules official paints in raster order"),
    ("sjd-pac", {"sjd_pac_rules": "paper"}, "sjd_pac_rules must be one of 'exact', 'official', got 'paper'"),
])
def test_settings_are_typed_and_names_explain_themselves(name, given, message):
    with pytest.raises(RelaxspecError) as err:
        methods.resolve(name, given)
    assert message in str(err.value)


def test_a_plain_bench_of_the_embedded_model_runs_its_presets():
    bench = embedded.defaults()["bench"]
    specs = expand_methods(bench["methods"], None, embedded.defaults()["presets"])
    assert [s.label for s in specs] == bench["methods"]
    by_label = {s.label: s.to_dict()["options"] for s in specs}
    assert by_label["sd"]["tree"] == "emoji-exact" and by_label["lantern"]["delta"] == 0.5


class Toy(Method):
    name = "toy"
    summary = "a method added by one file and one registry entry"
    settings = (Setting("toy_strength", float, 0.5, "how strong", minimum=0),)
    drafts = ("jacobi",)
    relaxed = True
    presets = {"toy-strong": Preset({"toy_strength": 2.0}, "a strong toy")}


@pytest.fixture
def toy_family(monkeypatch):
    module = types.ModuleType("relaxspec.methods.toy")
    module.METHODS = (Toy(),)
    monkeypatch.setitem(sys.modules, "relaxspec.methods.toy", module)
    monkeypatch.setattr(registry, "FAMILIES", registry.FAMILIES + ("toy",))
    for cached in (registry.methods, registry.settings, registry.presets, registry.spellings):
        cached.cache_clear()
    yield
    monkeypatch.undo()
    for cached in (registry.methods, registry.settings, registry.presets, registry.spellings):
        cached.cache_clear()


def test_a_new_family_needs_only_its_file_and_a_registry_entry(toy_family):
    options = methods.resolve("toy-strong", {"window": 4})
    assert options.to_dict() == {"method": "toy", "window": 4, "compile": False, "record_tv": True,
                                 "toy_strength": 2.0}
    args = build_parser().parse_args(["generate", "--out", "x", "--method", "toy", "--toy-strength", "0.25"])
    assert methods.resolve(args.method, given_settings(args)).toy_strength == 0.25
    [_, spec] = expand_methods(["toy"], ["toy:toy_strength=1,3"])[:2]
    assert spec.label == "toy[toy_strength=1]" and spec.method_options().toy_strength == 1.0
    with pytest.raises(RelaxspecError, match="toy_strength must be >= 0"):
        methods.resolve("toy", {"toy_strength": -1.0})


RELAXED = [name for name in NAMES if methods.resolve(name).family.relaxed]


@pytest.mark.slow
@pytest.mark.parametrize("name", RELAXED)
def test_no_relaxed_method_commits_a_token_outside_the_users_top_k(name):
    """Issue 20: at --top-k 50 on the embedded model the LANTERN preset committed 63 of 512 tokens
    outside the target's top-50. Every committed token must have mass under the target's processed
    law at its position: its guided logits (teacher-forced), then top-k."""
    import torch

    import relaxspec
    from relaxspec.sampling import SamplingConfig, process_logits

    assert {"lantern", "lantern++", "cool", "gsd"} <= set(RELAXED)
    target = embedded.load()[0]
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0, top_k=50)
    classes = embedded.defaults()["classes"]
    images, result = relaxspec.generate(classes, name, sampling=sampling, seed=0)
    tokens = result.tokens
    cond = torch.tensor([target.class_names.index(c) for c in classes.split(",")])
    with torch.no_grad():
        logits = target.forward_train(torch.cat([cond, target.null_condition(cond)]), torch.cat([tokens, tokens]))
    probs = process_logits(logits, sampling)
    committed = probs.gather(2, tokens[..., None])[..., 0]
    assert tokens.numel() == 8 * 64 and int((committed == 0).sum()) == 0


def float_settings():
    """Every float setting of the registry, with a method that reads it."""
    owners = {}
    for method in registry.methods().values():
        for setting in method.settings:
            if setting.kind is float:
                owners.setdefault(setting.name, method.name)
    return sorted(owners.items())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field, method", float_settings())
def test_nan_and_inf_are_refused_for_every_float_setting(field, method, value):
    """Issue 54: ``--group-p-gap nan`` ran (a bound compares false with nan), ``--lam inf`` was
    refused only once the rule was built. Every float setting refuses both when it is given."""
    with pytest.raises(RelaxspecError, match=f"^{field} must be a finite number, got {value}$"):
        methods.resolve(method, {field: value})


def test_a_nan_setting_is_one_line_before_the_settings_line(tmp_path, capsys):
    from helpers.cli import assert_one_line_error, outcome

    code, out, err = outcome(["generate", "--method", "gsd", "--group-p-gap", "nan", "--classes", "heart",
                              "--out", tmp_path / "out", "--no-progress"], capsys)
    assert_one_line_error(code, out, err, "group_p_gap must be a finite number, got nan")
    assert out == "" and not (tmp_path / "out").exists()
