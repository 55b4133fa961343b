"""Writes tests/data/sjd_pac/official_golden.json: forwards per image and tokens committed per
forward of the OFFICIAL SJD-PAC code (github.com/KangJialiang/SJD-PAC at 4fbc099,
``scheduler/sjd_pac_iteration_lumina_mgpt.py`` and ``scheduler/logit_processor_3dim.py``, its
copy of Lumina-mGPT's model in ``lumina_mgpt/model``) sampling the tiny Lumina-mGPT replica of
tests/helpers/lumina.py (64 px: 4 x 4 codes), at its settings (64 nodes a forward, tree width 3,
depth 3, image top-k 2000, temperature 1), many seeds.

The official code is not part of relaxspec and pins transformers 4.47.1 (relaxspec's tests run a
newer one), so the script has two stages:

* stage 1 runs in relaxspec's own Python: it builds the replica in the work folder, the prompt ids
  as Lumina-mGPT's inference solver builds them (``tests/test_lumina.official_prompt``, its
  ``<racm3:break>`` and size tokens included, so the official loop is in image mode from its first
  forward), extracts the official sources with ``git archive`` and starts stage 2;
* stage 2 (``--stage2 WORKDIR``, this same file) runs in a Python with transformers 4.47.1 and
  absl-py over relaxspec's torch, e.g. ``python -m venv --system-site-packages VENV &&
  VENV/bin/pip install transformers==4.47.1 absl-py``.

    python tests/data/sjd_pac/make_official_golden.py --python VENV/bin/python \\
        --repo /work/.mirror/KangJialiang+SJD-PAC/repo --seeds 30

``--temperature 0.02 --seeds 2 --out OTHER.json`` runs it near greedy (it divides by zero at 0): it
failed on 4 of the 6 images there (NaN in its multinomial); at 0.1 it samples (docs/METHODS.md).
``--image-top-k 1 --seeds 1 --out OTHER.json`` makes its law the argmax's point mass (greedy at any
temperature): it fails on every image after its first forward, in the residual race's
``torch.multinomial`` (S:208: "probability tensor contains either inf, nan or element < 0"). A
crashed image's record names the official lines it failed in (``where``).

What was done to run the official code, none of which changes what it computes: ``torch.cuda.Event``
and ``torch.cuda.synchronize`` (its loop's own timer, S:812-817 and S:960-965) are stubbed on this
CPU-only torch; the model is loaded with its code's ``ChameleonForConditionalGeneration.
from_pretrained(..., torch_dtype=float32, attn_implementation="sdpa")`` and its classes swapped by
its ``renew_sampler`` / ``renew_backbone`` (as ``renew_pipeline_sampler`` does to the solver, which
is bypassed: it needs CUDA and a hub tokenizer); the two logits processors are built with the
arguments its ``create_logits_processor`` passes; ``model.generate`` is called with the
``GenerationConfig`` of ``FlexARInferenceSolver.generate``. The sampler's return value (tokens
committed by a forward) is recorded by wrapping ``SJDPACSpeculativeSampler.__call__``. Its
``_init_new_params`` reads ``./ckpts/chameleon/tokenizer/text_tokenizer.json``: stage 2 runs in a
folder where that path is the replica's tokenizer.

CFG: the official code crashes with CFG off (a scale of 1: S:872 unpacks a batch of one), and its
unconditional branch sees the last prompt token and the image (S:513-516, 726-737), where relaxspec's
Lumina-mGPT family (Lumina-mGPT's own generation) sees ``<racm3:break>`` and the size tokens; the
golden runs use a scale of 1.0001, at which both are the conditional law to within 1e-4 of the
logits' difference.

Keys: ``images``: one entry per (seed, prompt): ``forwards`` until the end-of-image token was
committed (the first forward, over the prompt and 63 random drafts, included), ``committed`` (tokens
committed by each forward, end-of-line and end-of-image tokens included; the last may run past the
end of the image) and ``ids`` (the image's ids up to its end-of-image token); or, where the official
code fails (its KV copy when its first forward accepts a later tree row, S:268-276: shapes of the
prompt's length and the accepted length), ``crashed`` with its error's first line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

COMMIT = "4fbc099f7f765b6b363a767da317c0fb8ad4a980"
SCALE = 1.0001
IMAGE_END = 8196


def stage1(args) -> None:
    root = Path(__file__).resolve().parents[3]
    sys.path[:0] = [str(root / "tests")]
    import test_lumina
    from helpers import lumina as lf

    work, files = lf.replica_in(args.workdir, "sjd_pac_golden_")
    prompts = [test_lumina.official_prompt(files, text, lf.IMAGE_SIZE)[0] for text in lf.PROMPTS]
    (work / "stage1.json").write_text(json.dumps({"model_path": str(files["model_path"]), "prompts": prompts,
                                                  "seeds": args.seeds, "temperature": args.temperature,
                                                  "image_top_k": args.image_top_k}))
    (work / "src").mkdir(exist_ok=True)
    git = ["git", f"--git-dir={args.repo}"] if (Path(args.repo) / "HEAD").exists() else ["git", "-C", args.repo]
    archive = subprocess.run(git + ["archive", COMMIT], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(work / "src")], input=archive, check=True)
    tokenizer = work / "cwd" / "ckpts" / "chameleon"
    tokenizer.mkdir(parents=True, exist_ok=True)
    if not (tokenizer / "tokenizer").exists():
        (tokenizer / "tokenizer").symlink_to(files["tokenizer_path"])
    log = work / "stage2.log"
    with open(log, "w") as out:
        done = subprocess.run([args.python, __file__, "--stage2", str(work)], stdout=out, stderr=out, check=False)
    if done.returncode:
        sys.exit(f"stage 2 failed, see {log}:\n" + log.read_text()[-4000:])
    images = json.loads((work / "official.json").read_text())
    result = {"commit": COMMIT, "cfg_scale": SCALE, "temperature": args.temperature, "image_top_k": args.image_top_k,
              "nodes": 64, "tree_width": 3, "tree_depth": 3, "prompts": lf.PROMPTS, "seeds": args.seeds,
              "images": images,
              "notes": "official SJD-PAC (4fbc099) on tests/helpers/lumina.py's replica, CPU float32, transformers "
                       "4.47.1; see make_official_golden.py"}
    Path(args.out).write_text(json.dumps(result) + "\n")
    forwards = [image["forwards"] for image in images if "forwards" in image]
    print(f"{len(images)} images ({len(images) - len(forwards)} crashed), forwards per image mean "
          f"{sum(forwards) / len(forwards):.3f}" if forwards else f"{len(images)} images, every one crashed")


def stage2(work: Path) -> None:
    sys.path[:0] = [str(work / "src" / "lumina_mgpt"), str(work / "src")]
    os.chdir(work / "cwd")
    import torch

    class Event:  # the loop's own timer (CUDA events) on a CPU-only torch
        def __init__(self, *args, **kwargs):
            pass

        def record(self):
            pass

        def elapsed_time(self, other):
            return 0.0

    torch.cuda.Event = Event
    torch.cuda.synchronize = lambda *args, **kwargs: None
    from model.chameleon import ChameleonForConditionalGeneration
    from scheduler import sjd_pac_iteration_lumina_mgpt as official
    from scheduler.logit_processor_3dim import MultiTokensInterleavedTopKLogitsWarper, MultiTokensVLLogitsProcessor
    from transformers import GenerationConfig
    from transformers.generation.logits_process import LogitsProcessorList

    setup = json.loads((work / "stage1.json").read_text())
    model = ChameleonForConditionalGeneration.from_pretrained(setup["model_path"], torch_dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    model.__class__ = official.renew_sampler(model.__class__)
    model._init_new_params(max_num_new_tokens=64, tree_width=3, tree_depth=3, guidance_scale=SCALE, seed=0,
                           do_cfg=True)
    model.model.__class__ = official.renew_backbone(model.model.__class__)
    committed: list[int] = []
    call = official.SJDPACSpeculativeSampler.__call__

    def recorded(self, *args, **kwargs):
        out = call(self, *args, **kwargs)
        committed.append(int(out[0]))
        return out

    official.SJDPACSpeculativeSampler.__call__ = recorded
    images = []
    for seed in range(setup["seeds"]):
        for index, prompt in enumerate(setup["prompts"]):
            model.seed = seed
            committed.clear()
            processors = LogitsProcessorList([
                MultiTokensVLLogitsProcessor(image_start_token_id=8197, image_end_token_id=IMAGE_END,
                                             image_next_line_token_id=8803, patch_size=32,
                                             voc_size=model.config.vocab_size, device="cpu"),
                MultiTokensInterleavedTopKLogitsWarper(image_top_k=setup.get("image_top_k", 2000), text_top_k=10,
                                                       image_start_token_id=8197, image_end_token_id=IMAGE_END)])
            config = GenerationConfig(max_new_tokens=64, max_length=model.config.max_position_embeddings,
                                      temperature=setup.get("temperature", 1.0), top_k=None, do_sample=True,
                                      eos_token_id=[8710])
            try:
                with torch.no_grad():
                    ids = model.generate(torch.tensor([prompt]), config, logits_processor=processors)[0][len(prompt):]
            except RuntimeError as error:  # its KV copy when the first forward accepts a later tree row (S:268-276)
                where = [f"{Path(frame.filename).name}:{frame.lineno}"  # the official lines it failed in
                         for frame in traceback.extract_tb(error.__traceback__) if "scheduler" in frame.filename]
                images.append({"seed": seed, "prompt": index, "crashed": str(error).splitlines()[0],
                               "where": where, "committed": list(committed)})
                print(seed, index, "crashed:", error, flush=True)
                continue
            ids = ids.tolist()
            end = ids.index(IMAGE_END) + 1
            total, forwards = 0, 0
            for count in committed:
                total, forwards = total + count, forwards + 1
                if total >= end:
                    break
            images.append({"seed": seed, "prompt": index, "forwards": forwards, "committed": list(committed),
                           "ids": ids[:end]})
            print(seed, index, forwards, committed, flush=True)
    (work / "official.json").write_text(json.dumps(images))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="official SJD-PAC golden data on the tiny Lumina-mGPT replica")
    parser.add_argument("--stage2", type=Path, default=None)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--repo", default="/work/.mirror/KangJialiang+SJD-PAC/repo")
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="1 for the golden distribution; near 0 (0.02: official_near_greedy.json) for its tokens, "
                             "as it divides by zero at 0")
    parser.add_argument("--image-top-k", type=int, default=2000,
                        help="the official warper's image top-k (2000 for the golden distribution; 1, the argmax's "
                             "point mass, would give its greedy tokens, but it fails on every image there)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=str(Path(__file__).with_name("official_golden.json")))
    args = parser.parse_args()
    if args.stage2 is not None:
        stage2(args.stage2)
    else:
        stage1(args)
