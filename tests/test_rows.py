"""Rows in parallel (issues 31, 42): one open row is plain decoding; several are the slow
reference's tokens (written from the official LlamaGen-ZipAR code's rules) and official
LlamaGen-ZipAR's own greedy tokens on the embedded model; the row-causal mask against a per-node
reference; bad settings."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.engine import peaked_target, tiny_drafter
from helpers.rows_reference import reference_rows

from relaxspec.acceptance.exact import ExactRule
from relaxspec.decoding.ar import generate_ar
from relaxspec.decoding.rows import Rows, generate_rows, row_causal_mask
from relaxspec.drafting.base import NoDrafts
from relaxspec.drafting.dynamic_tree import DynamicTree
from relaxspec.drafting.eagle_source import EagleSource
from relaxspec.drafting.jacobi import JacobiSource
from relaxspec.drafting.static_tree import StaticTree
from relaxspec.drafting.trees import TreeSpec
from relaxspec.errors import RelaxspecError
from relaxspec.models.llamagen.gpt import GPTConfig
from relaxspec.sampling import SamplingConfig

GRID4 = GPTConfig(dim=64, n_layer=2, n_head=4, vocab_size=64, num_classes=10, block_size=16)
GRID5 = GPTConfig(dim=64, n_layer=2, n_head=4, vocab_size=64, num_classes=10, block_size=25)
GREEDY = SamplingConfig(cfg_scale=2.0, temperature=0.0)


@pytest.fixture(scope="module")
def target():
    return peaked_target(GRID5, 0)


@pytest.mark.parametrize("source, prefix_below", [(NoDrafts, False), (lambda: JacobiSource(3), False),
                                                  (lambda: JacobiSource(3, keep_likelier=True), True)],
                         ids=["no drafts", "jacobi", "pjd's code"])
@pytest.mark.parametrize("lanes, lead", [(1, 1), (1, 5), (2, 5), (3, 5)])
def test_rows_that_never_overlap_are_plain_decoding(target, source, prefix_below, lanes, lead) -> None:
    """One open row at a time (one lane, or a lead of the whole row): greedy exact decoding is
    greedy AR token for token (PJD's acceptance too: its only open row is the top one)."""
    cond = torch.tensor([1, 4])
    result = generate_rows(target, cond, GREEDY, source=source(), rule=ExactRule(),
                           plan=Rows(lanes, lead, prefix_below))
    assert torch.equal(result.tokens, generate_ar(target, cond, GREEDY).tokens)


@pytest.mark.parametrize("lanes, lead", [(2, 1), (2, 3), (3, 2), (5, 1)])
def test_open_rows_decode_the_slow_reference_s_tokens(target, lanes, lead) -> None:
    """Several open rows without drafts (ZipAR's schedule), greedy: the tokens of a reference
    written from the official code's rules (a finished row's last token forwarded and kept, the
    row above's input seen in the same forward, a new row's first input at the slot before it),
    the lanes capping the rows open; one forward per step decides a token of every open row."""
    cond = torch.tensor([1, 4])
    result = generate_rows(target, cond, GREEDY, source=NoDrafts(), rule=ExactRule(), plan=Rows(lanes, lead))
    assert torch.equal(result.tokens, reference_rows(target, cond, GREEDY, lanes, lead))
    assert (result.target_forwards < 25).all()
    assert sum(result.accept_lengths[0]) == 25


ZIPAR_GOLDEN = Path(__file__).parent / "data" / "zipar" / "golden.json"


@pytest.fixture(scope="module")
def embedded_target():
    from relaxspec.embedded import load

    return load(with_drafter=False)[0]


@pytest.mark.slow
def test_zipar_gives_official_llamagen_zipar_s_tokens(embedded_target) -> None:
    """Greedy, on the embedded model's weights, cfg 4: relaxspec's zipar (every row open, lead W)
    gives the tokens of the official LlamaGen-ZipAR code at window W (tests/data/zipar/
    make_golden.py ran it on the same weights) for 5 classes and W = 2, 3, 5, once the official
    code's reads of never-written cache slots are masked; plain AR gives its generate.py's."""
    golden = json.loads(ZIPAR_GOLDEN.read_text())
    cond = torch.tensor(golden["classes"])
    greedy = SamplingConfig(cfg_scale=golden["cfg_scale"], temperature=0.0)
    assert generate_ar(embedded_target, cond, greedy).tokens.tolist() == golden["ar"]
    for window in golden["windows"]:
        result = generate_rows(embedded_target, cond, greedy, source=NoDrafts(), rule=ExactRule(),
                               plan=Rows(64, window))
        assert result.tokens.tolist() == golden["masked"][str(window)], window


@pytest.mark.slow
def test_the_reference_is_the_official_code_its_zero_key_reads_included(embedded_target) -> None:
    """The reference follows the official code, not the engine: reading the never-written slots of
    the rows above as zero keys (as the official mask does) it gives the official tokens as
    released; without those reads, the masked ones. The reads change 28 to 48 of the 64 tokens
    of these images (the released and masked golden tokens differ that much), so the masked run is
    the one relaxspec reproduces."""
    golden = json.loads(ZIPAR_GOLDEN.read_text())
    cond = torch.tensor(golden["classes"][:2])
    greedy = SamplingConfig(cfg_scale=golden["cfg_scale"], temperature=0.0)
    for window in golden["windows"][:2]:
        for variant, key in (("official", "masked"), ("zero-keys", "released")):
            tokens = reference_rows(embedded_target, cond, greedy, 64, window, variant=variant)
            assert tokens.tolist() == golden[key][str(window)][:2], (window, variant)
        differ = [sum(a != b for a, b in zip(x, y)) for x, y in zip(golden["released"][str(window)],
                                                                       golden["masked"][str(window)])]
        assert min(differ) >= 20, differ


@pytest.mark.slow
def test_lumina_rows_give_official_lumina_mgpt_zipar_s_tokens(tmp_path) -> None:
    """Greedy, on the tiny Lumina-mGPT replica, windows 2 and 3 (a lead of 1 and 2 codes): at CFG
    1 the tokens of the official Lumina-mGPT-ZipAR code (tests/data/zipar/make_lumina_golden.py
    ran it on the same files), for every prompt. At CFG 3 that code's unconditional branch is its
    own ([BOS, pad...] at the prompt's positions, not Lumina-mGPT's [<racm3:break>, H, W]), so the
    tokens are those of the same rules under Lumina-mGPT's own guidance, whose AR is official
    Lumina-mGPT's (equal here too)."""
    pytest.importorskip("transformers")
    from helpers.lumina import IMAGE_SIZE, lumina_folders

    from relaxspec.pipelines import open_pipeline

    golden = json.loads((ZIPAR_GOLDEN.parent / "lumina_golden.json").read_text())
    folders = lumina_folders(tmp_path)
    pipeline = open_pipeline(model_path=folders["model_path"], tokenizer_path=folders["tokenizer_path"],
                             image_size=IMAGE_SIZE)
    target, condition = pipeline.target, pipeline.conditions(prompts=golden["prompts"])
    assert target.config.grid_size == 4
    for scale in golden["cfg_scales"]:
        greedy = SamplingConfig(cfg_scale=scale, temperature=0.0)
        ar = generate_ar(target, condition.cond, greedy, cond_mask=condition.mask).tokens.tolist()
        assert ar == golden["ar"][str(scale)]
        for window in golden["windows"]:
            tokens = generate_rows(target, condition.cond, greedy, source=NoDrafts(), rule=ExactRule(),
                                   plan=Rows(4, window - 1), cond_mask=condition.mask).tokens.tolist()
            want = golden["zipar"] if scale == 1.0 else golden["rules_lumina_uncond"]
            assert tokens == want[str(scale)][str(window)], (scale, window)


def test_the_row_causal_mask_against_a_per_node_reference() -> None:
    """Node i of lane l sees the condition, cached image keys earlier in raster order, and its own
    lane's ancestors; nothing else (another lane's drafts, later rows, uncached keys)."""
    generator = torch.Generator().manual_seed(0)
    cls, n_tok, lanes, nodes, batch = 2, 9, 2, 3, 2
    max_seq = cls + n_tok + lanes * nodes
    cached = torch.rand(batch, max_seq, generator=generator) < 0.6
    cached[:, :cls] = True
    cached[:, cls + n_tok :] = False
    raster_of_slot = torch.full((max_seq,), -1)
    raster_of_slot[cls : cls + n_tok] = torch.arange(n_tok)
    raster = torch.randint(0, n_tok, (batch, lanes, nodes), generator=generator)
    ancestors = torch.rand(batch, lanes, nodes, nodes, generator=generator) < 0.5
    scratch = cls + n_tok + torch.arange(lanes)[:, None] * nodes + torch.arange(nodes)[None, :]
    mask = row_causal_mask(cached, raster_of_slot, raster, ancestors, scratch, cls, n_tok).view(batch, lanes, nodes, -1)
    for b in range(batch):
        for lane in range(lanes):
            for i in range(nodes):
                for slot in range(max_seq):
                    if slot < cls:
                        want = True
                    elif slot < cls + n_tok:
                        want = bool(cached[b, slot]) and slot - cls < raster[b, lane, i]
                    else:
                        other, j = divmod(slot - cls - n_tok, nodes)
                        want = other == lane and bool(ancestors[b, lane, i, j])
                    assert bool(mask[b, lane, i, slot]) == want, (b, lane, i, slot)


def test_sampled_rows_commit_every_token_in_fewer_forwards(target) -> None:
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0, top_k=0)
    result = generate_rows(target, torch.tensor([1, 2, 3]), sampling, source=JacobiSource(3), rule=ExactRule(),
                           plan=Rows(3, 2), generator=torch.Generator().manual_seed(0))
    assert result.tokens.shape == (3, 25) and (result.tokens >= 0).all() and (result.tokens < 64).all()
    assert (result.target_forwards < 25).all()
    assert all(sum(lengths) == 25 for lengths in result.accept_lengths)


def test_pjd_s_acceptance_commits_a_lower_row_s_prefix_and_keeps_likelier_drafts(target, monkeypatch) -> None:
    """PJD's code: a row below the top open one commits its accepted drafts only (the next step
    drafts that position again), and an old draft survives a redraw, with its old law, where
    p_new / p_old > 0.5 of it; sampled, every token is committed in fewer forwards than tokens."""
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0, top_k=0)
    cond, plan = torch.tensor([1, 2, 3]), Rows(5, 2, prefix_below=True)
    result = generate_rows(target, cond, sampling, source=JacobiSource(3, keep_likelier=True), rule=ExactRule(),
                           plan=plan, generator=torch.Generator().manual_seed(0))
    assert all(sum(lengths) == 25 for lengths in result.accept_lengths) and (result.target_forwards < 25).all()
    # the redraw rule, on a window of 3 after a step that committed a prefix of one draft, no bonus;
    # chain node 1 + j predicts the new window's position j, every fresh draw is code 3
    import relaxspec.drafting.jacobi as jacobi

    monkeypatch.setattr(jacobi, "sample_from", lambda laws, clocks=None: torch.tensor([[3, 3, 3]]))

    def redraw(third_law):
        source = JacobiSource(3, keep_likelier=True)
        source.greedy, source.vocab, source._offsets, source._chain_at = False, 4, torch.arange(3), torch.arange(4)
        source._noise, source._slots = SimpleNamespace(read=lambda slot: None), [None]
        source.drafts = torch.tensor([[0, 1, 2]])
        source.laws = torch.tensor([[[0.7, 0.1, 0.1, 0.1], [0.1, 0.6, 0.2, 0.1], [0.1, 0.1, 0.4, 0.4]]])
        probs = torch.tensor([[[0.25] * 4, [0.25] * 4, third_law, [0.1, 0.1, 0.1, 0.7]]])
        source.update(None, torch.tensor([[0, 1, -1, -1]]), torch.tensor([1]), None, probs, None)
        return source

    # position 0 (old draft 1, the one rejected or left untested): always the new draw; position 1
    # (old draft 2, p_new 0.1 / p_old 0.4 = 0.25): redrawn; position 2: past the old window
    assert redraw([0.1, 0.6, 0.1, 0.2]).drafts.tolist() == [[3, 3, 3]]
    kept = redraw([0.05, 0.05, 0.3, 0.6])  # p_new 0.3 / p_old 0.4 = 0.75 > 0.5: kept, with its old law
    assert kept.drafts.tolist() == [[3, 2, 3]]
    assert torch.equal(kept.laws[0, 1], torch.tensor([0.1, 0.1, 0.4, 0.4]))


@pytest.mark.parametrize("plan, message", [
    (Rows(2, 0), "row lead must lie in \\[1, 5\\]"),
    (Rows(2, 6), "row lead must lie in \\[1, 5\\]"),
    (Rows(0, 1), "rows must be at least 1"),
])
def test_bad_row_settings_are_one_line(target, plan, message) -> None:
    with pytest.raises(RelaxspecError, match=message):
        generate_rows(target, torch.tensor([1]), GREEDY, source=NoDrafts(), rule=ExactRule(), plan=plan)


def test_zipar_and_pjd_open_rows_at_their_papers_leads() -> None:
    """Without --row-lead: ZipAR's third of the row (its 8 of 24), PJD's fifth (its c = 6 on
    LlamaGen's 32 columns at 512 px; 10 on Lumina-mGPT's 48, between its paper's 11 and its code's
    8), with PJD's code's Jacobi window: its window_size 8 counts the root, so 7 drafts."""
    from types import SimpleNamespace

    from relaxspec.methods import MethodOptions
    from relaxspec.methods.grid import row_plan

    def lead(method, side):
        model = SimpleNamespace(config=SimpleNamespace(grid_size=side, block_size=side * side))
        return row_plan(MethodOptions(method), model).lead

    assert [lead("zipar", side) for side in (8, 24, 32, 48)] == [3, 8, 11, 16]
    assert [lead("pjd", side) for side in (8, 24, 32, 48)] == [2, 5, 6, 10]
    assert MethodOptions("pjd").window == 7
    assert lead("lantern", 24) == 8  # --rows on any other method: ZipAR's schedule
    model = SimpleNamespace(config=SimpleNamespace(grid_size=32, block_size=1024))
    assert row_plan(MethodOptions("pjd", row_lead=3), model).lead == 3


def test_a_model_without_a_grid_is_refused() -> None:
    """An image that is not a square grid of tokens (here 15 tokens said to be 4 x 4) has no rows."""
    from types import SimpleNamespace

    from relaxspec.methods.grid import grid_side

    model = SimpleNamespace(config=SimpleNamespace(grid_size=4, block_size=15))
    assert grid_side(model) is None and grid_side(peaked_target(GRID4, 0)) == 4
    with pytest.raises(RelaxspecError, match="square grid"):
        generate_rows(model, torch.tensor([1]), GREEDY, source=NoDrafts(), rule=ExactRule(), plan=Rows(2, 1))


def _family(name: str, root):
    """(target, conditions) of a tiny model folder of a transformers family, opened as every command opens it."""
    from relaxspec.pipelines import open_pipeline

    if name == "janus":
        from helpers.janus import janus_folder_at

        janus_folder_at(root / "janus")
        pipeline = open_pipeline(model_path=root / "janus")
    elif name == "anole":
        from helpers.anole import anole_folder

        pipeline = open_pipeline(model_path=anole_folder(root)["model_path"])
    elif name == "emu3":
        from helpers.emu3 import emu3_folder_at

        pipeline = open_pipeline(model_path=emu3_folder_at(root / "emu3"), image_size=32)  # a 4 x 4 grid
    else:
        from helpers.lumina import IMAGE_SIZE, lumina_folders

        folders = lumina_folders(root)
        pipeline = open_pipeline(model_path=folders["model_path"], tokenizer_path=folders["tokenizer_path"],
                                 image_size=IMAGE_SIZE)
    condition = pipeline.conditions(prompts=["a red fox", "a lighthouse"])
    return pipeline.target, condition


@pytest.mark.slow
@pytest.mark.parametrize("family", ["janus", "emu3", "lumina", "anole"])
def test_every_family_paints_rows_in_parallel(tmp_path, family) -> None:
    """Janus and Anole (1-D positions), Emu3 and Lumina-mGPT (a forced row-end token after every
    row, kept by the target's row-end companions): one open row is greedy AR; several are the
    slow reference's tokens."""
    pytest.importorskip("transformers")
    target, condition = _family(family, tmp_path)
    cond, mask = condition.cond, condition.mask
    ar = generate_ar(target, cond, GREEDY, cond_mask=mask).tokens
    grid = target.config.grid_size
    one = generate_rows(target, cond, GREEDY, source=JacobiSource(2), rule=ExactRule(), plan=Rows(2, grid),
                        cond_mask=mask)
    assert torch.equal(one.tokens, ar)
    several = generate_rows(target, cond, GREEDY, source=NoDrafts(), rule=ExactRule(), plan=Rows(3, 1),
                            cond_mask=mask)
    assert torch.equal(several.tokens, reference_rows(target, cond, GREEDY, 3, 1, cond_mask=mask))
    assert (several.target_forwards < grid * grid).all()


def test_generate_paints_rows_and_says_its_law_is_not_the_model_s(tmp_path, capsys) -> None:
    """--method zipar / pjd and --rows on a Jacobi method, on the embedded model: fewer target
    forwards than AR, a record of the rows and the lead, no TV certificate and a line saying
    why; settings a method would ignore, and rows it cannot draft for, are one line."""
    import json

    from relaxspec.cli import main

    def run(*args):
        return main(["generate", "--classes", "1,2", "--no-progress", "--out", str(tmp_path / "run"), *args])

    for method, extra in (("zipar", ["--row-lead", "2"]), ("pjd", []), ("sjd", ["--rows", "3", "--window", "2"]),
                          ("sjd-pac", ["--rows", "3", "--window", "12"]),
                          ("lantern", ["--rows", "4", "--draft", "chain", "--depth", "3"])):
        assert run("--method", method, *extra, "--out", str(tmp_path / method)) == 0, capsys.readouterr().err
        stats = json.loads((tmp_path / method / "stats.json").read_text())
        assert stats["totals"]["target_forwards_per_image"] < 64 and stats["totals"]["tv_certified"] is None
        assert "not the model's law" in stats["totals"]["law"]
        assert all(image["rows"] >= 2 and image["row_lead"] >= 1 for image in stats["images"])
    capsys.readouterr()
    for args, said in ((["--method", "ar", "--rows", "2"], "--rows is not used by --method ar"),
                       (["--method", "sjd", "--row-lead", "2"], "without --rows: it sets rows in parallel (add --rows R"),
                       (["--method", "lantern", "--row-lead", "2"], "without --rows: it sets rows in parallel"),
                       (["--method", "ar", "--row-lead", "2"], "--row-lead is not used by --method ar"),
                       (["--method", "zipar", "--rows", "1"], "--rows must be at least 2"),
                       (["--method", "pjd", "--row-lead", "9"], "row lead must lie in [1, 8]")):
        assert run(*args) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and said in err, (args, err)


@pytest.mark.parametrize("method", ["lantern", "lantern++", "cool", "gsd"])
def test_every_acceptance_rule_verifies_the_rows(method) -> None:
    """The engine knows no rule's insides: the relaxed rules (built as their methods build them,
    LANTERN's neighbours from the embedded model's codebook) verify every open row's Jacobi
    window, with their TV record, on the embedded model."""
    from relaxspec.methods import MethodOptions, build_rule
    from relaxspec.pipelines import open_pipeline

    pipeline = open_pipeline()
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0, top_k=0)
    # (LANTERN at k 64, the embedded model's preset, not the registry's 1000: its TV record costs
    # O(V k) a row and a step on the CPU)
    given = {"k": 64} if method == "lantern" else {}
    rule = build_rule(MethodOptions(method, **given), pipeline.tokenizer, horizon=3, target=pipeline.target)
    assert not rule.lossless
    result = generate_rows(pipeline.target, torch.tensor([3, 7]), sampling, source=JacobiSource(3), rule=rule,
                           plan=Rows(4, 2), generator=torch.Generator().manual_seed(0))
    assert result.tokens.shape == (2, 64) and ((result.tokens >= 0) & (result.tokens < 1024)).all()
    assert (result.target_forwards < 64).all() and result.tv_recorded and (result.step_tv >= 0).all()
    assert result.rows == 4 and result.row_lead == 2


@pytest.mark.slow
def test_bench_reports_rows_without_a_certificate(tmp_path, capsys) -> None:
    """bench times rows methods paired with AR like any other, and its report gives them no TV
    certificate and a note saying why."""
    import json

    from relaxspec.cli import main

    assert main(["bench", "--classes", "1,2", "--methods", "ar,zipar,pjd", "--no-plots", "--out",
                 str(tmp_path / "bench")]) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "bench" / "summary.json").read_text())
    rows = {row["label"]: row for row in summary["methods"]}
    for label in ("zipar", "pjd"):
        assert rows[label]["rows"] >= 2 and rows[label]["tv_certified"] is None
        assert rows[label]["target_forwards_per_image"] < 64
    assert rows["ar"].get("rows") is None and rows["ar"]["tv_certified"] == 0
    assert "zipar, pjd paint rows in parallel: not the model's law" in (tmp_path / "bench" / "summary.md").read_text()


@pytest.mark.parametrize("name, fields", [("zipar", None), ("pjd", None), ("lantern", {"rows": 4})],
                         ids=["zipar", "pjd", "lantern per row"])
def test_rows_read_the_device_about_once_per_step(name, fields) -> None:
    """As the raster engine: one lagged read of the device per step (how many tokens are done,
    copied without waiting), no blocking read in any step, the results in one copy at the end,
    and no host data copied to the device. (tests/test_fast_engine.py compiles every rows method.)"""
    from relaxspec.bench.counting import StepCounter
    from relaxspec.pipelines import open_pipeline

    pipeline = open_pipeline()
    condition = pipeline.conditions(classes="heart,time")
    options = pipeline.method(name, fields)
    pipeline.generate(condition, options, generator=torch.Generator().manual_seed(0))
    with StepCounter(pipeline.target) as counter:
        result = pipeline.generate(condition, options, generator=torch.Generator().manual_seed(1))
    steps = int(result.target_forwards.max()) - 1
    assert sum(window.lagged_reads for window in counter.windows) == steps
    assert all(window.syncs == 0 for window in counter.steps), [w.sync_sites for w in counter.steps if w.syncs]
    reads = sum(window.syncs for window in counter.windows)
    assert reads / steps <= 0.1, [window.sync_sites for window in counter.windows if window.syncs]
    assert sum(window.host_copies for window in counter.windows) == 0, [w.copy_sites for w in counter.windows]


def eagle_chain(target, depth: int, seed: int = 1) -> EagleSource:
    return EagleSource(tiny_drafter(target, seed), StaticTree(TreeSpec.chain(depth), "topk"), GREEDY)


def eagle2_tree(target, seed: int = 1, top_k: int = 3, depth: int = 3, total: int = 8) -> EagleSource:
    """EAGLE-2's dynamic tree, small by default: 3 children per beam, 3 levels, 8 nodes."""
    return EagleSource(tiny_drafter(target, seed), DynamicTree(top_k=top_k, depth=depth, total_tokens=total), GREEDY)


@pytest.mark.parametrize("tree", [lambda t: eagle_chain(t, 3), eagle2_tree,
                                  lambda t: eagle2_tree(t, top_k=2, total=59),
                                  lambda t: eagle2_tree(t, top_k=70, depth=1, total=80)],
                         ids=["chain", "eagle2", "eagle2 with fewer candidates than nodes",
                              "eagle2 with top-k above the vocabulary"])
@pytest.mark.parametrize("lanes, lead", [(1, 1), (2, 5), (3, 2)])
def test_every_row_drafts_with_the_eagle_drafter_and_exact_greedy_stays_the_rows_decode(target, tree, lanes,
                                                                                        lead) -> None:
    """Each open row drafts a chain, or grows EAGLE-2's dynamic tree, with the EAGLE drafter (over
    one drafter cache per image): rows that never overlap are greedy AR token for token, the
    drafter's cache and the target's keys kept apart per lane; overlapping rows commit every token
    once."""
    cond = torch.tensor([1, 4])
    drafted = generate_rows(target, cond, GREEDY, source=tree(target), rule=ExactRule(), plan=Rows(lanes, lead))
    if lanes == 1 or lead == 5:
        assert torch.equal(drafted.tokens, generate_ar(target, cond, GREEDY).tokens)
    assert drafted.tokens.shape == (2, 25) and all(sum(lengths) == 25 for lengths in drafted.accept_lengths)
    assert drafted.drafter_forwards.min() > 0


@pytest.mark.parametrize("lanes, lead", [(1, 1), (2, 5), (3, 2)])
def test_every_row_drafts_sjd_pac_s_proactive_tree(target, lanes, lead) -> None:
    """SJD-PAC's window (three siblings at each of its first two positions, then a chain) for every
    open row: rows that never overlap are greedy AR token for token; sampled, every token once."""
    cond = torch.tensor([1, 4])

    def source():
        return JacobiSource(12, coupled=True, width=3, depth=3)

    drafted = generate_rows(target, cond, GREEDY, source=source(), rule=ExactRule(), plan=Rows(lanes, lead))
    if lanes == 1 or lead == 5:
        assert torch.equal(drafted.tokens, generate_ar(target, cond, GREEDY).tokens)
    assert all(sum(lengths) == 25 for lengths in drafted.accept_lengths)
    sampled = generate_rows(target, cond, SamplingConfig(cfg_scale=2.0), source=source(), rule=ExactRule(),
                            plan=Rows(lanes, lead), generator=torch.Generator().manual_seed(0))
    assert all(sum(lengths) == 25 for lengths in sampled.accept_lengths) and (sampled.target_forwards < 25).all()


@pytest.mark.parametrize("grown", [4, 3], ids=["whole tree", "a growing tree"])
def test_the_lane_drafter_s_mask_against_a_per_node_reference(target, grown) -> None:
    """Node i of a lane's tree sits in the lane's scratch slot i and sees the committed pairs up to
    its root (in raster order) and its ancestors' scratch slots; never another lane's drafts,
    an uncommitted slot, or a pair after its root. ``grown``: the nodes the ancestor matrix covers
    (all of a fixed tree's; the first levels of an EAGLE-2 tree still growing)."""
    lanes, grid, depth, batch = 2, 5, 3, 2
    source = EagleSource(tiny_drafter(target), StaticTree(TreeSpec.chain(depth), "topk"), GREEDY).for_lanes(lanes, grid)
    virtual, n_tok, nodes = batch * lanes, grid * grid, depth + 1
    hidden = torch.zeros(2 * virtual, 1, target.config.dim)
    source.start(torch.zeros(virtual, dtype=torch.long), torch.full((virtual, 64), 1 / 64), hidden, 2, n_tok, None, True)
    generator = torch.Generator().manual_seed(0)
    source.cached = torch.rand(batch, source.cache_length, generator=generator) < 0.6
    source.cached[:, n_tok:] = False
    root_index = torch.randint(0, n_tok, (virtual,), generator=generator)
    ancestors = torch.rand(virtual, grown, grown, generator=generator) < 0.5
    asked = torch.tensor([1, grown - 1])
    slots, mask = source.node_inputs(root_index, ancestors, asked)
    for v in range(virtual):
        image, lane = divmod(v, lanes)
        for q, node in enumerate(asked.tolist()):
            assert int(slots[v, q]) == n_tok + lane * nodes + node
            for slot in range(source.cache_length):
                if slot < n_tok:
                    want = bool(source.cached[image, slot]) and slot <= root_index[v]
                else:
                    other, j = divmod(slot - n_tok, nodes)
                    want = other == lane and 0 < j < grown and bool(ancestors[v, node, j])
                assert bool(mask[v, q, slot]) == want, (v, node, slot)


def test_each_row_s_drafter_sees_what_the_raster_drafter_sees() -> None:
    """On the embedded model with its trained drafter, rows that never overlap (a lead of the
    whole row) accept the drafter's first guess about as often as raster decoding does (0.57 to
    0.54 here); a drafter reading the wrong pairs (every pair written three slots off) accepts
    0.46 of them, so the bound below tells the two apart."""
    from relaxspec.decoding import decode
    from relaxspec.methods import MethodOptions
    from relaxspec.pipelines import open_pipeline

    pipeline = open_pipeline()
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0, top_k=0)
    cond = torch.arange(8)

    def first_guess_rate(**rows) -> float:
        result = decode(pipeline.target, cond, sampling, MethodOptions("sd", draft="chain", depth=3, **rows),
                        drafter=pipeline.drafter, vq=pipeline.tokenizer, generator=torch.Generator().manual_seed(0))
        return float(result.rank_accepts[0].sum()) / float(result.rank_tests[0].sum())

    raster, rows = first_guess_rate(), first_guess_rate(rows=2, row_lead=8)
    assert rows >= raster - 0.04, (rows, raster)


@pytest.mark.parametrize("method", ["lantern", "cool"])
def test_relaxed_rules_verify_each_row_s_eagle_chain(method) -> None:
    """LANTERN and COOL-SD verify every open row's EAGLE chain on the embedded model (its trained
    drafter), with their TV record, in fewer forwards than ZipAR's plain rows."""
    from relaxspec.decoding import decode
    from relaxspec.methods import MethodOptions
    from relaxspec.pipelines import open_pipeline

    pipeline = open_pipeline()
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0, top_k=0)
    cond = torch.tensor([3, 7, 11, 20])
    run = lambda options: decode(pipeline.target, cond, sampling, options, drafter=pipeline.drafter,  # noqa: E731
                                 vq=pipeline.tokenizer, generator=torch.Generator().manual_seed(0))
    # (LANTERN at k 64, not its default 1000: its TV record costs O(V k) a row and a step on the CPU)
    drafted = run(MethodOptions(method, draft="chain", depth=3, rows=4, row_lead=2,
                                **({"k": 64} if method == "lantern" else {})))
    plain = run(MethodOptions("zipar", rows=4, row_lead=2))
    assert drafted.tokens.shape == (4, 64) and drafted.rows == 4 and drafted.tv_recorded
    assert (drafted.step_tv >= 0).all() and drafted.step_tv.sum() > 0
    assert drafted.target_forwards.float().mean() < plain.target_forwards.float().mean()
