"""Fused against final-state features, trained to a plateau: what each lets the embedded drafter reach.

The issue-53 runs trained both drafters 400-800 steps, each step paying a target forward. Here the
target's teacher-forced streams of the 6,000 self-samples (the recipe's: cfg 4, T 1, the 74
training classes, seed 1) are computed once and cached, so the drafter alone trains, long enough
to stop improving. Both start from the shipped drafter (the fused one's ``fuse`` and norms fresh,
as ``--init-from`` starts them), train draft depth 1 on the guided law's KL (the recipe's loss),
and are scored on the same 180 held-out samples every ``--eval-every`` steps: mean ``1 - TV``
of the guided laws at depth 1, exact SD's acceptance there. At the end each is scored at depths
1-4 too (:func:`deeper`; the last line of its output) and, with ``--save DIR``, saved there.

    python docs/bench/fused-drafter/converged.py cache --samples SELF_SAMPLES.npz --out CACHE
    python docs/bench/fused-drafter/converged.py train --cache CACHE --kind plain > converged-plain.jsonl &
    python docs/bench/fused-drafter/converged.py train --cache CACHE --kind fused > converged-fused.jsonl

(``SELF_SAMPLES.npz``: ``self_samples.npz`` of a ``train.sh`` run's output folder, the recipe's
6,000 self-samples.)

(``--kind`` ``plain``: the final state, EAGLE-1/2's; ``fused``: the streams entering target layers
2, 6 and 9, EAGLE-3's.) One thread a process; the two trainings run side by side, one a core.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from relaxspec import embedded
from relaxspec.drafting.eagle import EagleDrafter
from relaxspec.sampling import SamplingConfig
from relaxspec.models.weights import save_model
from relaxspec.training.drafter.maths import chain_mal, drafter_loss, drafter_targets
from relaxspec.training.drafter.passes import target_features, unrolled
from relaxspec.training.drafter.recipe import grow_drafter

CAPTURE = (2, 6, 9, 12)  # the fused drafter's three streams, then the final state (the plain one's)
SAMPLING = SamplingConfig(cfg_scale=4.0, temperature=1.0)
VALIDATION = 180  # the recipe's 3 % of 6,000


def classes() -> list[int]:
    return [c for c in range(99) if c % 4 != 1]  # 1, 5, ..., 97 stay held out


def cache(args) -> None:
    """The target's streams (``CAPTURE``, fp16) and logits (fp16) of every self-sample, both CFG
    streams, as ``.npy`` files under ``--out``."""
    from relaxspec.training.drafter.data import sample_from_target

    torch.set_num_threads(args.threads)
    target, _, _ = embedded.load()
    data = sample_from_target(target, 6000, classes=classes(), sampling=SAMPLING, seed=1, batch_size=32,
                              progress=False, cache=Path(args.samples))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    count, length = data.tokens.shape
    width = target.config.dim
    streams = np.lib.format.open_memmap(out / "streams.npy", "w+", np.float16,
                                        (count, 2, length, len(CAPTURE) * width))
    logits = np.lib.format.open_memmap(out / "logits.npy", "w+", np.float16,
                                       (count, 2, length, target.config.vocab_size))
    np.save(out / "tokens.npy", data.tokens.numpy())
    start = time.time()
    for first in range(0, count, args.batch):
        tokens, labels = data.tokens[first:first + args.batch], data.labels[first:first + args.batch]
        rows = len(tokens)
        hidden, logit = target_features(target, tokens, labels, rows, capture=CAPTURE)  # [cond; null] rows
        streams[first:first + rows] = hidden.reshape(2, rows, length, -1).transpose(0, 1).half().numpy()
        logits[first:first + rows] = logit.reshape(2, rows, length, -1).transpose(0, 1).half().numpy()
        print(f"{first + rows}/{count} in {time.time() - start:.0f} s", flush=True)
    streams.flush()
    logits.flush()


def batch(cache_dir: Path, index: np.ndarray, kind: str, target):
    """Rows ``index`` as the drafter trains on them: features ``[2B, N, k * width]`` (the plain
    drafter: the final state after the target's final norm, as decoding hands it over), tokens
    ``[2B, N]``, logits ``[2B, N, V]``, ``[cond; null]``."""
    width = target.config.dim
    streams = np.load(cache_dir / "streams.npy", mmap_mode="r")
    logits = np.load(cache_dir / "logits.npy", mmap_mode="r")
    index = np.sort(index)
    tokens = torch.from_numpy(np.load(cache_dir / "tokens.npy")[index])
    part = slice(0, 3 * width) if kind == "fused" else slice(3 * width, 4 * width)
    features = torch.from_numpy(np.ascontiguousarray(streams[index][..., part])).float()  # [B, 2, N, D]
    law = torch.from_numpy(np.ascontiguousarray(logits[index])).float()
    both = lambda t: torch.cat([t[:, 0], t[:, 1]])  # noqa: E731 - [B, 2, ...] -> [cond; null]
    features = both(features)
    if kind == "plain":
        with torch.no_grad():
            features = target.norm(features)
    return features, torch.cat([tokens, tokens]), both(law)


def depth_one(drafter: EagleDrafter, features, tokens, logits) -> dict:
    pred_features, pred_logits = unrolled(drafter, features, tokens, 1)
    _, next_logits = drafter_targets(features, logits)
    return drafter_loss(pred_features, pred_logits, None, next_logits, feature_weight=0.0, law_loss="kl",
                        sampling=SAMPLING, train_depths=1)


def train(args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target, _, shipped = embedded.load()
    fused = args.kind == "fused"
    drafter = EagleDrafter.for_target(target, fused_layers=[2, 6, 9] if fused else None)
    grow_drafter(drafter, shipped.float())
    drafter.float().train()
    for p in target.parameters():
        p.requires_grad_(False)
    cache_dir = Path(args.cache)
    count = np.load(cache_dir / "tokens.npy", mmap_mode="r").shape[0]
    order = np.random.default_rng(0).permutation(count)
    held, trained = order[:VALIDATION], order[VALIDATION:]
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + np.cos(np.pi * min(s, args.steps) / args.steps)))
    rng = np.random.default_rng(args.seed)

    def evaluate(step: int) -> None:
        drafter.eval()
        with torch.no_grad():
            accept = []
            for first in range(0, VALIDATION, 30):
                idx = held[first:first + 30]
                result = depth_one(drafter, *batch(cache_dir, idx, args.kind, target))
                accept.append(float(result["accept"][0]) * len(idx))
        print(json.dumps({"kind": args.kind, "step": step, "accept_depth1": sum(accept) / VALIDATION,
                          "seconds": round(time.time() - start)}), flush=True)
        drafter.train()

    start = time.time()
    evaluate(0)
    for step in range(1, args.steps + 1):
        idx = rng.choice(trained, args.batch_size, replace=False)
        loss = depth_one(drafter, *batch(cache_dir, idx, args.kind, target))["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if step % args.eval_every == 0 or step == args.steps:
            evaluate(step)
    if args.save:
        save_model(drafter.eval(), args.save, kind="drafter")
    deeper(drafter, cache_dir, held, args.kind, target)


@torch.no_grad()
def deeper(drafter: EagleDrafter, cache_dir: Path, held: np.ndarray, kind: str, target, depths: int = 4) -> None:
    """The trained drafter's acceptance at draft depths 1 .. ``depths`` on the held-out samples
    (each depth from its own guesses before it, as decoding drafts a chain), and the tokens a step
    of a chain of ``depths`` drafts commits at those rates."""
    drafter.eval()
    total = torch.zeros(depths)
    for first in range(0, VALIDATION, 30):
        idx = held[first:first + 30]
        features, tokens, logits = batch(cache_dir, idx, kind, target)
        pred_features, pred_logits = unrolled(drafter, features, tokens, depths)
        _, next_logits = drafter_targets(features, logits)
        total += drafter_loss(pred_features, pred_logits, None, next_logits, feature_weight=0.0, law_loss="kl",
                              sampling=SAMPLING)["accept"] * len(idx)
    accept = total / VALIDATION
    print(json.dumps({"kind": kind, "accept_by_depth": [round(float(a), 4) for a in accept],
                      "chain_mal": round(float(chain_mal(accept)), 4)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cache")
    c.add_argument("--samples", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--batch", type=int, default=50)
    c.add_argument("--threads", type=int, default=2)
    t = sub.add_parser("train")
    t.add_argument("--cache", required=True)
    t.add_argument("--kind", choices=("plain", "fused"), required=True)
    t.add_argument("--steps", type=int, default=3000)
    t.add_argument("--batch-size", type=int, default=32)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--eval-every", type=int, default=250)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--save", help="a folder for the trained drafter (relaxspec's drafter format)")
    args = parser.parse_args()
    (cache if args.command == "cache" else train)(args)


if __name__ == "__main__":
    main()
