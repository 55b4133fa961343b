"""Writes tests/data/zipar/lumina_golden.json: greedy image codes from the OFFICIAL Lumina-mGPT-ZipAR
code (github.com/ThisisBillhe/ZipAR at 2a5695c, folder Lumina-mGPT-ZipAR/lumina_mgpt) and from the
official Lumina-mGPT code (github.com/Alpha-VLLM/Lumina-mGPT at 104abe4, folder lumina_mgpt), run on
the tiny Lumina-mGPT replica of tests/helpers/lumina.py (64 px: a 4 x 4 grid of codes, W = 4).

Neither code base is part of relaxspec, and both need transformers 4.44 (relaxspec's tests run a
newer one), so the script has two stages:

* stage 1 runs in relaxspec's own Python: it builds the replica (``lumina_folders``) in a temporary
  folder, the prompt ids (``tests/test_lumina.official_prompt``) and the reading's greedy AR
  (``tests/test_lumina.official_greedy``), then starts stage 2 twice with the other Python, maps the
  ids it gets back to image codes (``vocabulary()``'s id -> code) and writes the JSON;
* stage 2 (``--stage2 zipar|lumina WORKDIR``, this same file) runs in a Python with transformers
  4.44.2, torch and safetensors, e.g. a venv made by
  ``python -m venv --system-site-packages VENV && VENV/bin/pip install transformers==4.44.2``.

The command (from the repository root; the two paths are bare git mirrors or checkouts of the repos)::

    python tests/data/zipar/make_lumina_golden.py --python /tmp/zvenv/bin/python \
        --zipar /work/.mirror/ThisisBillhe+ZipAR/repo --lumina /work/.mirror/Alpha-VLLM+Lumina-mGPT/repo

The sources are read with ``git archive`` at the pinned commits into the work folder (the git
directories are not touched) and imported from there. Everything runs on the CPU, in float32.

Patches made to run the official code. None changes what it computes:

1. ZipAR ``model/chameleon/modeling_chameleon.py`` L1584-1587: ``torch.tensor([8803|8196|8710|1],
   device='cuda')`` (the EOL/EOI/end/pad constants of ``ChameleonForConditionalGeneration.__init__``)
   -> ``device='cpu'``: a CPU-only torch cannot build the model otherwise. The only edit of a model file.
2. The logits processors are the official classes, taken verbatim from ``inference_solver.py``
   (by ``ast``, since importing the module pulls in the training/item-processor stack), with
   ``device="cuda"`` -> ``device="cpu"`` in their constructors: ZipAR's ``MultiModalLogitsProcessor_ZIPAR``
   and ``InterleavedTopKLogitsWarper`` (the list ZipAR's ``create_logits_processor`` builds, L484-515:
   its unbatched CFG processor is commented out there, CFG being batched inside ``_sample``);
   Lumina's ``LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor``,
   ``MultiModalLogitsProcessor`` and ``InterleavedTopKLogitsWarper`` (its ``create_logits_processor``;
   ``guidance_scale`` = the CFG scale, ``patch_size=32``, image top-k 2000, text top-k 10).
3. ``FlexARInferenceSolver`` is bypassed (``device_map="cuda"``, ``torch.cuda.amp.autocast``, a
   hard-coded tokenizer/VQGAN path): the model is loaded with the code's own
   ``ChameleonForConditionalGeneration.from_pretrained(model_path, torch_dtype=torch.float32,
   attn_implementation=...)`` and ``model.generate(prompt, GenerationConfig(do_sample=False,
   top_k=None, eos_token_id=[8710], max_new_tokens=..., max_length=max_position_embeddings),
   logits_processor=...)`` is called as the solver calls it, with ``do_sample=False`` (the code's own
   argmax branch) instead of sampling. The prompt is the solver's: ``[BOS] + template + [8710]``
   (``official_prompt`` without its last three ids).
4. A random model does not write ``<racm3:break>`` and the size tokens itself, so a processor appended
   LAST to the official list forces 8197, then 8806 (= 8804 + 64/32) twice, and returns the scores
   untouched at every later step. They are not put in the prompt: ZipAR's ``_sample`` would open
   row 0 during the prefill and index its row list out of range.
5. ZipAR only: ``attention_mask=torch.ones(1, P)`` is passed to ``generate`` (``prepare_ZIPAR_inputs_
   for_generation`` L1779 reads it; pad == eos, so HF does not make one), and, as the ZipAR
   ``generate_examples/generate.py`` does by hand, ``model.cfg = scale``, ``model.prompt_len = P``,
   ``model.zipar_window_size = n``, plus ``model.tokens_per_row = W + 1`` (hard-coded 49 = 768 px)
   and ``model.reset_zipar()`` before every image (the row state lives on the model).
6. ZipAR is loaded with ``attn_implementation="eager"`` for the golden tokens: its decoder layer
   hard-wires the eager attention class (L636-637), so under the HF default ``"sdpa"``,
   ``_update_causal_mask`` returns no mask at the prefill and the prompt (and the unconditional
   prompt) attend both ways. That released behaviour is recorded under ``zipar_sdpa``.
   Lumina-mGPT (which picks its class by the config) runs as released (sdpa) for ``ar``.

Keys of the JSON (codes, not ids; raster order, end-of-line tokens removed; one list of 16 per prompt):

* ``zipar[cfg][n]``: official ZipAR, eager, window n (it counts the leading w/EOL token: row r+1
  opens once row r has n-1 image codes); ``zipar_sdpa``: the same as released (non-causal prefill).
* ``ar[cfg]``: official Lumina-mGPT plain AR (HF ``_sample`` + its processors; CFG with the
  unconditional context ``[8197, H, W]`` alone at positions 0, 1, 2 ...).
* ``ar_zipar_code[cfg]``: ZipAR's code at window W + 1, which is plain AR under ZipAR's CFG: its
  unconditional prompt is ``[BOS, pad(1) x (P-1)]`` then the same tokens as the conditional one, at
  the same positions, and CFG starts at the first image code (8197/H/W come from the conditional
  logits alone). At CFG 3 this differs from Lumina-mGPT's unconditional context.
* ``rules_lumina_uncond[cfg][n]``: NOT official: the rule set checked in ``checks`` (which reproduces
  official ZipAR) run with Lumina-mGPT's unconditional context ``[8197, H, W]`` at positions 0, 1, 2,
  image slot (r, j) at 2 + r*(W+1) + j; equal to ``zipar`` at CFG 1.
* ``checks``: ``rules`` = :func:`rules_decode` (the rule set, written here independently of ZipAR's
  code and run on Lumina-mGPT's model class) against official ZipAR: images equal, and the largest
  difference of the guided image scores at every forwarded position (official scores are read by a
  forward hook on the ZipAR model, which only records); ``rules_released_sdpa_prefill`` the same
  against ``zipar_sdpa``; ``wrong_*`` variants of the rules that must NOT match (so the check
  discriminates); ``ar_official_equals_reading``: ``ar`` against ``tests/test_lumina.official_greedy``;
  ``forwards_per_image``: model calls per ZipAR image (prefill, 8197, H, then the row steps).

The work folder (``--workdir``, default a new temporary folder) keeps the replica, the extracted
sources, each stage 2's log and raw ids; it is not removed. It takes about 4 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import subprocess
import sys
from pathlib import Path

ZIPAR_COMMIT = "2a5695ca2525872ac6ee38c9d62be38f0c9e985b"
LUMINA_COMMIT = "104abe453ec1acca5863698629c4db2111b0b3fc"
CFG_SCALES = (1.0, 3.0)
WINDOWS = (2, 3)
IMAGE_START, IMAGE_END, NEW_LINE, SEPARATOR = 8197, 8196, 8803, 8710
FIRST_IMAGE_ID, LAST_IMAGE_ID = 4, 8195


# ------------------------------------------------------------------------------------------ stage 1
def stage1(args) -> None:
    root = Path(__file__).resolve().parents[3]
    sys.path[:0] = [str(root / "tests")]
    import test_lumina  # official_prompt, official_greedy
    from helpers import lumina as lf

    work, files = lf.replica_in(args.workdir, "lumina_golden_")
    grid = lf.IMAGE_SIZE // 16
    prompts = []
    for text in lf.PROMPTS:
        cond, uncond = test_lumina.official_prompt(files, text, lf.IMAGE_SIZE)
        assert cond[-3:] == uncond and cond[-4] == SEPARATOR
        prompts.append(cond[:-3])
    header = uncond
    assert header == [IMAGE_START, 8804 + lf.IMAGE_SIZE // 32, 8804 + lf.IMAGE_SIZE // 32]
    setup = {"model_path": str(files["model_path"]), "prompts": prompts, "header": header, "H": grid,
             "W": grid, "cfg_scales": list(CFG_SCALES), "windows": list(WINDOWS)}
    (work / "stage1.json").write_text(json.dumps(setup))

    for name, repo, commit, sub in (("zipar", args.zipar, ZIPAR_COMMIT, "Lumina-mGPT-ZipAR"),
                                    ("lumina", args.lumina, LUMINA_COMMIT, "")):
        dest = work / name
        dest.mkdir(exist_ok=True)
        path = f"{sub}/lumina_mgpt" if sub else "lumina_mgpt"
        git = ["git", f"--git-dir={repo}"] if (Path(repo) / "HEAD").exists() and not (Path(repo) / ".git").exists() \
            else ["git", "-C", repo]
        archive = subprocess.run(git + ["archive", commit, path], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        log = work / f"{name}.log"
        with open(log, "w") as out:
            done = subprocess.run([args.python, __file__, "--stage2", name, str(work)], stdout=out, stderr=out, check=False)
        if done.returncode:
            sys.exit(f"stage 2 ({name}) failed, see {log}:\n" + log.read_text()[-4000:])
    zipar = json.loads((work / "zipar.json").read_text())
    lumina = json.loads((work / "lumina.json").read_text())

    to_codes = files["id_to_code"]

    def codes(images):
        return [[to_codes[t] for t in image] for image in images]

    def by_window(table):
        return {c: {n: codes(v) for n, v in row.items()} for c, row in table.items()}

    reading = {str(c): [test_lumina.official_greedy(files, text, c) for text in lf.PROMPTS] for c in CFG_SCALES}
    result = {
        "image_size": lf.IMAGE_SIZE, "prompts": lf.PROMPTS, "cfg_scales": list(CFG_SCALES),
        "windows": list(WINDOWS),
        "zipar": by_window(zipar["eager"]),
        "ar": {c: codes(v) for c, v in lumina["ar"].items()},
        "zipar_sdpa": by_window(zipar["sdpa"]),
        "ar_zipar_code": {c: codes(v) for c, v in zipar["ar_eager"].items()},
        "rules_lumina_uncond": by_window(lumina["rules_lumina_uncond"]),
    }
    checks = dict(lumina["checks"])
    checks["ar_official_equals_reading"] = {c: result["ar"][c] == reading[c] for c in reading}
    checks["ar_lumina_eager_equals_sdpa"] = {c: lumina["ar_eager"][c] == lumina["ar"][c] for c in lumina["ar"]}
    checks["ar_zipar_code_equals_ar"] = {c: result["ar_zipar_code"][c] == result["ar"][c] for c in result["ar"]}
    checks["rules_lumina_uncond_equals_zipar"] = {
        c: {n: result["rules_lumina_uncond"][c][n] == result["zipar"][c][n] for n in result["zipar"][c]}
        for c in result["zipar"]}
    checks["zipar_sdpa_equals_zipar"] = {
        c: {n: result["zipar_sdpa"][c][n] == result["zipar"][c][n] for n in result["zipar"][c]} for c in result["zipar"]}
    checks["forwards_per_image"] = zipar["forwards"]
    result["checks"] = checks
    result["notes"] = NOTES
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(checks, indent=1))


NOTES = (
    "Golden greedy codes (image codes via vocabulary()'s id->code, raster order, EOL removed) from the "
    "official Lumina-mGPT-ZipAR code (ZipAR 2a5695c) and the official Lumina-mGPT code (104abe4) on "
    "tests/helpers/lumina.py's replica, CPU float32, transformers 4.44.2; see make_lumina_golden.py for the "
    "patches (none changes the computation). zipar: eager attention (causal prefill); zipar_sdpa: as released "
    "(non-causal prefill under the sdpa default). ZipAR's CFG uses its own unconditional prompt [BOS, pad x (P-1)] "
    "at the conditional positions, not Lumina-mGPT's [8197, H, W]: at CFG 3 zipar/ar_zipar_code follow it, ar "
    "(Lumina-mGPT) does not; rules_lumina_uncond is NOT official (the checked rule set with Lumina's "
    "unconditional context). checks.rules: the rule set (row 0 opens with the w token; row r+1 opens once row r "
    "has n-1 codes; each forward feeds the last token of the row finished the step before, output unused, then "
    "each open row's latest token, a new row's being the real EOL; causal by raster position over the tokens "
    "forwarded so far, this forward's included; keys never refreshed) against the official tokens.")


# ------------------------------------------------------------------------------------------ stage 2
def official_classes(path: Path, names, namespace: dict) -> dict:
    """The named classes of ``path``, verbatim but ``device="cuda"`` -> ``device="cpu"``, executed in
    ``namespace``."""
    source = path.read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in names:
            code = ast.get_source_segment(source, node)
            code = compile(code.replace('device="cuda"', 'device="cpu"'), str(path), "exec")
            exec(code, namespace)  # noqa: S102 (the official classes, verbatim)
    assert all(name in namespace for name in names)
    return namespace


def processor_namespace() -> dict:
    import copy
    import typing

    import torch
    import transformers
    from transformers.generation.logits_process import (
        LogitsProcessor,
        LogitsProcessorList,
        LogitsWarper,
    )

    return {"torch": torch, "transformers": transformers, "copy": copy, "math": math, "List": list,
            "Optional": typing.Optional, "Union": typing.Union, "LogitsProcessor": LogitsProcessor,
            "LogitsProcessorList": LogitsProcessorList, "LogitsWarper": LogitsWarper}


def header_forcer(header):
    """Patch 4: forces ``header`` (8197, H, W) as the first three tokens after the prompt."""
    import torch
    from transformers.generation.logits_process import LogitsProcessor

    class ForceHeader(LogitsProcessor):
        def __init__(self, prompt_len):
            self.prompt_len = prompt_len

        def __call__(self, input_ids, scores):
            made = input_ids.shape[1] - self.prompt_len
            if made >= len(header):
                return scores
            forced = torch.full_like(scores, -math.inf)
            forced[:, header[made]] = 0
            return forced

    return ForceHeader


def split_image(generated, header, H, W):
    """Ids after the prompt -> the H*W image ids in raster order (checks the layout)."""
    assert generated[:3] == header, generated[:3]
    body = generated[3:3 + H * (W + 1)]
    rows = [body[r * (W + 1):(r + 1) * (W + 1)] for r in range(H)]
    assert all(row[-1] == NEW_LINE for row in rows), generated
    assert generated[3 + H * (W + 1)] == IMAGE_END, generated
    image = [t for row in rows for t in row[:-1]]
    assert all(FIRST_IMAGE_ID <= t <= LAST_IMAGE_ID for t in image), image
    return image


def stage2_zipar(work: Path, setup: dict) -> dict:
    src = work / "zipar" / "Lumina-mGPT-ZipAR" / "lumina_mgpt"
    modeling = src / "model" / "chameleon" / "modeling_chameleon.py"
    text = modeling.read_text()
    assert text.count("device='cuda')") == 4
    modeling.write_text(text.replace("device='cuda')", "device='cpu')"))  # patch 1
    sys.path.insert(0, str(src))
    import torch
    from model.chameleon import ChameleonForConditionalGeneration
    from transformers import GenerationConfig
    from transformers.generation.logits_process import LogitsProcessorList

    ns = official_classes(src / "inference_solver.py", ("MultiModalLogitsProcessor_ZIPAR",
                                                        "InterleavedTopKLogitsWarper"), processor_namespace())
    header, H, W = setup["header"], setup["H"], setup["W"]
    ForceHeader = header_forcer(header)
    out, saved = {"forwards": {}}, {}
    seen = {"calls": 0, "scores": {}}  # what the hook records for the current image

    def hook(module, args, kwargs, output):  # records, leaves the computation alone
        seen["calls"] += 1
        positions = kwargs.get("position_ids")
        if positions is not None:
            for i, pos in enumerate(positions[0].tolist()):
                seen["scores"][pos] = guided(output.logits[:, i], module.cfg)

    for attn in ("eager", "sdpa"):
        model = ChameleonForConditionalGeneration.from_pretrained(setup["model_path"], torch_dtype=torch.float32,
                                                                  attn_implementation=attn).eval()
        assert model.config._attn_implementation == attn
        model.register_forward_hook(hook, with_kwargs=True)
        windows = [str(n) for n in setup["windows"]] + ["ar"]
        table = {str(c): {n: [] for n in windows} for c in setup["cfg_scales"]}
        for scale in setup["cfg_scales"]:
            for n in windows:
                for prompt in setup["prompts"]:
                    P = len(prompt)
                    model.cfg, model.prompt_len = scale, P  # patch 5
                    model.zipar_window_size = W + 1 if n == "ar" else int(n)
                    model.tokens_per_row = W + 1
                    model.reset_zipar()
                    processors = LogitsProcessorList([
                        ns["MultiModalLogitsProcessor_ZIPAR"](image_start_token_id=IMAGE_START,
                                                              image_end_token_id=IMAGE_END,
                                                              image_next_line_token_id=NEW_LINE, patch_size=32,
                                                              voc_size=model.config.vocab_size),
                        ns["InterleavedTopKLogitsWarper"](image_top_k=2000, text_top_k=10,
                                                          image_start_token_id=IMAGE_START,
                                                          image_end_token_id=IMAGE_END),
                        ForceHeader(P)])
                    config = GenerationConfig(max_new_tokens=3 + H * (W + 1) + 8, do_sample=False, top_k=None,
                                              eos_token_id=[SEPARATOR],
                                              max_length=model.config.max_position_embeddings)
                    seen["calls"], seen["scores"] = 0, {}
                    with torch.no_grad():
                        ids = model.generate(torch.tensor([prompt]), config, logits_processor=processors,
                                             attention_mask=torch.ones(1, P, dtype=torch.long))[0].tolist()
                    generated = ids[P:]
                    assert generated[-2:] == [IMAGE_END, SEPARATOR], generated
                    table[str(scale)][n].append(split_image(generated, header, H, W))
                    out["forwards"][f"{attn} cfg {scale} window {n}"] = seen["calls"]
                    saved[(attn, str(scale), n, len(table[str(scale)][n]) - 1)] = {
                        p: v for p, v in seen["scores"].items() if p >= P + 2}
        out[attn] = {c: {n: v for n, v in row.items() if n != "ar"} for c, row in table.items()}
        out[f"ar_{attn}"] = {c: row["ar"] for c, row in table.items()}
    torch.save(saved, work / "zipar_scores.pt")
    return out


def guided(logits, scale):
    """``[batch, vocab]`` raw logits (cond, then uncond when ``scale > 1``) -> the guided image
    scores ``u + (c - u)*scale`` over ids 4..8195, as ZipAR's ``_sample`` mixes them."""
    logits = logits.float()
    mixed = logits[1] + (logits[0] - logits[1]) * scale if scale > 1.0 else logits[0]
    return mixed[FIRST_IMAGE_ID:LAST_IMAGE_ID + 1].clone()


# ---------------------------------------------------------------- the rule set, written independently
def rules_decode(model, prompt, header, H, W, n, scale, *, uncond="zipar", causal_prefill=True,
                 see_same_forward=True, refresh=False, record=None):
    """Greedy parallel-row decoding by the rule set, on ``model`` (Lumina-mGPT's class, eager),
    with an insertion-order cache and an explicit mask "key raster position <= query raster position"
    over the tokens forwarded so far (this forward's included). Returns the H*W image ids.

    Branches: the conditional one feeds ``prompt + [8197, H]`` then the blocks; block (r, j) (j = 0 is
    the w token for r = 0 and the EOL 8803 ending row r-1 for r >= 1; x(r, c) is j = c + 1) sits at
    ``base + r*(W+1) + j``. ``uncond="zipar"``: ``[BOS, 1 x (P-1), 8197, H]`` at the same positions;
    ``"lumina"``: ``[8197, H]`` at 0, 1. CFG ``u + (c - u)*scale`` on raw logits from x(0,0) on, then
    ids 4..8195 only, argmax. Variants that must not match official ZipAR: ``see_same_forward=False``
    (a query does not see the other inputs of its own forward), ``refresh=True`` (every step recomputes
    all tokens forwarded so far, i.e. keys refreshed), ``causal_prefill=False`` (the released sdpa
    prefill: the prompt attends both ways)."""
    import torch
    from transformers import DynamicCache

    T = W + 1
    P = len(prompt)
    pre = {"c": prompt + header[:2]}
    if scale > 1.0:
        pre["u"] = ([0] + [1] * (P - 1) + header[:2]) if uncond == "zipar" else header[:2]
    branches = list(pre)
    base = {b: len(pre[b]) for b in branches}
    cache = {b: DynamicCache() for b in branches}
    seen = {b: [] for b in branches}  # positions of the cached entries, in cache order
    history = {b: [] for b in branches}  # (token, position) forwarded so far (for refresh)
    neg = torch.finfo(torch.float32).min

    def forward(b, tokens, positions, *, first=False):
        q = torch.tensor(positions)
        if refresh and not first:
            everything = history[b] + list(zip(tokens, positions))
            toks = [t for t, _ in everything]
            k = torch.tensor([p for _, p in everything])
            allowed = k[None, :] <= k[:, None]
            mask = torch.zeros(len(k), len(k)).masked_fill(~allowed, neg)
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([toks]), position_ids=k[None], attention_mask=mask[None, None],
                               use_cache=False).logits[0, -len(tokens):]
            history[b] = everything
            return logits
        k = torch.tensor(seen[b] + positions)
        allowed = k[None, :] <= q[:, None]
        if first and not causal_prefill:
            allowed[:] = True
        if not see_same_forward:
            new = torch.zeros(len(k), dtype=torch.bool)
            new[len(seen[b]):] = True
            allowed &= ~new[None, :] | (torch.arange(len(k))[None, :] == len(seen[b]) + torch.arange(len(q))[:, None])
        mask = torch.zeros(len(q), len(k)).masked_fill(~allowed, neg)
        with torch.no_grad():
            output = model(input_ids=torch.tensor([tokens]), position_ids=q[None], attention_mask=mask[None, None],
                           past_key_values=cache[b], use_cache=True,
                           cache_position=torch.arange(len(seen[b]), len(k)))
        cache[b] = output.past_key_values
        seen[b] += positions
        history[b] += list(zip(tokens, positions))
        return output.logits[0]

    for b in branches:  # as the official plain phase: the prompt, then 8197, then H, one by one
        if len(pre[b]) > 2:
            forward(b, pre[b][:-2], list(range(len(pre[b]) - 2)), first=True)
        forward(b, [pre[b][-2]], [len(pre[b]) - 2], first=len(pre[b]) == 2)
        forward(b, [pre[b][-1]], [len(pre[b]) - 1])

    blocks = [[header[2]] + [None] * W] + [[NEW_LINE] + [None] * W for _ in range(H - 1)]
    opens = [r * (n - 1) for r in range(H)]
    last_step = opens[-1] + W - 1
    for step in range(last_step + 1):
        fed = []  # (row, element)
        for r in range(H):  # a row whose last code was made the step before: its last token, output unused
            if opens[r] + W == step:
                fed.append((r, W))
        skip = len(fed)
        for r in range(H):
            if opens[r] <= step <= opens[r] + W - 1:
                fed.append((r, step - opens[r]))
        logits = {}
        for b in branches:
            logits[b] = forward(b, [blocks[r][j] for r, j in fed], [base[b] + r * T + j for r, j in fed])
        if record is not None:
            for i, (r, j) in enumerate(fed):
                stacked = torch.stack([logits[b][i] for b in branches])
                record[base["c"] + r * T + j] = guided(stacked, scale)
        for i, (r, j) in enumerate(fed[skip:], start=skip):
            scores = logits["c"][i]
            if scale > 1.0:
                scores = logits["u"][i] + (scores - logits["u"][i]) * scale
            masked = torch.full_like(scores, -math.inf)
            masked[FIRST_IMAGE_ID:LAST_IMAGE_ID + 1] = scores[FIRST_IMAGE_ID:LAST_IMAGE_ID + 1]
            assert blocks[r][j + 1] is None
            blocks[r][j + 1] = int(masked.argmax())
    return [t for row in blocks for t in row[1:]]


def stage2_lumina(work: Path, setup: dict) -> dict:
    src = work / "lumina" / "lumina_mgpt"
    sys.path.insert(0, str(src))
    import torch
    from model.chameleon import ChameleonForConditionalGeneration
    from transformers import GenerationConfig
    from transformers.generation.logits_process import LogitsProcessorList

    ns = official_classes(src / "inference_solver.py",
                          ("LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor",
                           "MultiModalLogitsProcessor", "InterleavedTopKLogitsWarper"), processor_namespace())
    header, H, W = setup["header"], setup["H"], setup["W"]
    ForceHeader = header_forcer(header)
    out = {}
    for attn, key in (("sdpa", "ar"), ("eager", "ar_eager")):
        model = ChameleonForConditionalGeneration.from_pretrained(setup["model_path"], torch_dtype=torch.float32,
                                                                  attn_implementation=attn).eval()
        assert model.config._attn_implementation == attn
        out[key] = {}
        for scale in setup["cfg_scales"]:
            images = []
            for prompt in setup["prompts"]:
                P = len(prompt)
                kw = {"image_start_token_id": IMAGE_START, "image_end_token_id": IMAGE_END,
                      "image_next_line_token_id": NEW_LINE, "patch_size": 32}
                processors = LogitsProcessorList([
                    ns["LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor"](
                        guidance_scale=scale, model=model, **kw),
                    ns["MultiModalLogitsProcessor"](**kw, voc_size=model.config.vocab_size),
                    ns["InterleavedTopKLogitsWarper"](image_top_k=2000, text_top_k=10,
                                                      image_start_token_id=IMAGE_START,
                                                      image_end_token_id=IMAGE_END),
                    ForceHeader(P)])
                config = GenerationConfig(max_new_tokens=3 + H * (W + 1) + 1, do_sample=False, top_k=None,
                                          eos_token_id=[SEPARATOR], max_length=model.config.max_position_embeddings)
                with torch.no_grad():
                    ids = model.generate(torch.tensor([prompt]), config, logits_processor=processors)[0].tolist()
                images.append(split_image(ids[P:], header, H, W))
            out[key][str(scale)] = images

    # the rule set, on Lumina's model class (eager), against the official ZipAR tokens
    zipar = json.loads((work / "zipar.json").read_text())
    official_scores = torch.load(work / "zipar_scores.pt")
    windows = setup["windows"]
    checks, lumina_uncond = {}, {}
    variants = {"rules": {}, "rules_released_sdpa_prefill": {"causal_prefill": False},
                "wrong_no_same_forward": {"see_same_forward": False}, "wrong_refreshed_keys": {"refresh": True}}
    for name, extra in variants.items():
        checks[name] = {}
        for scale in setup["cfg_scales"]:
            for n in list(windows) + ["ar"]:
                window = W + 1 if n == "ar" else n
                attn = "sdpa" if name == "rules_released_sdpa_prefill" else "eager"
                mine, worst = [], 0.0
                for k, p in enumerate(setup["prompts"]):
                    record = {}
                    mine.append(rules_decode(model, p, header, H, W, window, scale, record=record, **extra))
                    official = official_scores[(attn, str(scale), str(n), k)]
                    assert sorted(official) == sorted(record), (sorted(official), sorted(record))
                    worst = max(worst, max(float((official[q] - record[q]).abs().max()) for q in record))
                theirs = zipar[f"ar_{attn}"][str(scale)] if n == "ar" else zipar[attn][str(scale)][str(n)]
                same = [a == b for a, b in zip(mine, theirs)]
                checks[name][f"cfg {scale} window {n}"] = (f"{sum(same)}/{len(same)} images equal, "
                                                          f"max |scores - official| {worst:.2g}")
    for scale in setup["cfg_scales"]:
        lumina_uncond[str(scale)] = {str(n): [rules_decode(model, p, header, H, W, n, scale, uncond="lumina")
                                              for p in setup["prompts"]] for n in windows}
    # the rule set at window W+1 with Lumina's unconditional context is plain AR: it must give ``ar``
    checks["rules_lumina_uncond_window_W+1_equals_ar"] = {
        str(s): [rules_decode(model, p, header, H, W, W + 1, s, uncond="lumina") for p in setup["prompts"]]
        == out["ar_eager"][str(s)] for s in setup["cfg_scales"]}
    out["checks"] = checks
    out["rules_lumina_uncond"] = lumina_uncond
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", help="a Python with transformers 4.44.2 (stage 2)")
    parser.add_argument("--zipar", help="ThisisBillhe/ZipAR: a bare git mirror or a checkout")
    parser.add_argument("--lumina", help="Alpha-VLLM/Lumina-mGPT: a bare git mirror or a checkout")
    parser.add_argument("--out", default=str(Path(__file__).with_name("lumina_golden.json")))
    parser.add_argument("--workdir", help="scratch folder (default: a new temporary one)")
    parser.add_argument("--stage2", nargs=2, metavar=("WHICH", "WORKDIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage2:
        which, work = args.stage2[0], Path(args.stage2[1])
        setup = json.loads((work / "stage1.json").read_text())
        result = (stage2_zipar if which == "zipar" else stage2_lumina)(work, setup)
        (work / f"{which}.json").write_text(json.dumps(result))
        return
    if not (args.python and args.zipar and args.lumina):
        parser.error("--python, --zipar and --lumina are required")
    stage1(args)


if __name__ == "__main__":
    main()
