"""What every decoding method returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DecodeResult:
    """Tokens and the measurements that come with them, per image.

    ``tokens [B, N]`` int64; ``target_forwards [B]`` target forwards each image needed (the
    condition prefill included, so plain AR gives ``N``); ``drafter_forwards [B]``;
    ``step_tv [B, N]`` the certified one-step TV distance recorded for each committed token
    (0 for lossless steps); ``accept_lengths`` per image, tokens committed by each target forward.
    ``seconds`` is the decode's wall time. In profile mode (``profile=True``) the parts are timed
    apart: ``seconds`` minus the two ``*_forward_seconds`` is the engine's own time (sampling,
    tree walk, cache moves, masks, Python), :attr:`overhead_seconds`; otherwise those times are
    ``None`` (a step compiled as one graph has no parts to time, issue 41).
    """

    tokens: torch.Tensor
    target_forwards: torch.Tensor
    drafter_forwards: torch.Tensor
    step_tv: torch.Tensor
    accept_lengths: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    # profile mode only (None otherwise):
    drafter_seconds: float | None = None  # in the draft source: drafter forwards + drafting bookkeeping
    target_forward_seconds: float | None = None  # inside the target model's forward calls
    drafter_forward_seconds: float | None = None  # inside the drafter model's forward calls
    rank_tests: torch.Tensor | None = None  # [depth, rank] sibling tests, summed over the batch
    rank_accepts: torch.Tensor | None = None  # [depth, rank] of those, accepted
    tv_recorded: bool = True  # False: a relaxed method ran with the record off (step_tv is zero, not measured)
    rows: int = 1  # image rows painted at once: above 1 the law is not the model's, whatever the rule
    row_lead: int = 0  # with rows above 1: the tokens a row had before the row below opened
    #: with rows above 1, ``[B, N]``: how many tokens the step that committed each token committed
    #: (``accept_lengths`` are in step order, which is not raster order there)
    token_step_sizes: torch.Tensor | None = None

    @property
    def profiled(self) -> bool:
        """Whether the parts were timed apart (profile mode)."""
        return self.target_forward_seconds is not None

    @property
    def overhead_seconds(self) -> float | None:
        """The engine's own time (profile mode; ``None`` otherwise)."""
        if not self.profiled:
            return None
        return max(self.seconds - self.target_forward_seconds - (self.drafter_forward_seconds or 0.0), 0.0)

    def acceptance_rates(self) -> torch.Tensor | None:
        """Measured P(accept | depth, rank, elder siblings rejected) ``[depth, rank]`` (0 where
        never tested): the input of :func:`relaxspec.drafting.trees.build_tree`."""
        if self.rank_tests is None:
            return None
        return self.rank_accepts.double() / self.rank_tests.clamp(min=1).double()

    @property
    def mean_accepted_length(self) -> torch.Tensor:
        """MAL per image: tokens committed per target forward, bonus included (AR = 1.0)."""
        return self.tokens.shape[1] / self.target_forwards.float()

    @property
    def tv_sum(self) -> torch.Tensor:
        """Per image ``[B]``: the sum of its tokens' one-step TV records. By the hybrid argument its
        *expectation* bounds the TV distance between the method's and the model's image law; one
        image's sum can exceed 1 (docs/METHODS.md, "The TV certificate")."""
        return self.step_tv.sum(dim=1)

    @property
    def tv_per_token(self) -> torch.Tensor:
        """Per image ``[B]``: :attr:`tv_sum` over the image's tokens."""
        return self.tv_sum / max(self.step_tv.shape[1], 1)

    def tv_record(self, row: int) -> dict[str, float | None]:
        """Image ``row``'s TV record as stats.json and the bench records keep it: the sum of its
        one-step TVs and that sum per token (``None`` when the record was switched off). The
        batch-level certificate is :func:`certified_tv` over the sums, never a per-image cap."""
        if not self.tv_recorded:
            return {"tv_sum": None, "tv_per_token": None}
        return {"tv_sum": float(self.tv_sum[row]), "tv_per_token": float(self.tv_per_token[row])}


    def image_record(self, row: int) -> dict:
        """What every run records of image ``row`` of this decode (generate's ``stats.json``, bench's
        ``records.jsonl``): its share of the batch's times, its target and drafter forwards, its
        accepted length per target forward and its TV record."""
        rows = self.tokens.shape[0]
        share = lambda seconds: None if seconds is None else seconds / rows  # noqa: E731 (profile mode only)
        return {"seconds": self.seconds / rows, "drafter_seconds": share(self.drafter_seconds),
                "target_forward_seconds": share(self.target_forward_seconds),
                "drafter_forward_seconds": share(self.drafter_forward_seconds),
                "target_forwards": int(self.target_forwards[row]), "drafter_forwards": int(self.drafter_forwards[row]),
                "mean_accepted_length": float(self.mean_accepted_length[row]), **self.tv_record(row),
                **({"rows": self.rows, "row_lead": self.row_lead} if self.rows > 1 else {})}


def watched_seconds(source) -> float:
    """Seconds a draft source spent in model forwards, in profile mode (0 for a source with no
    model calls to time)."""
    return float(source.watch.seconds) if source.watch is not None else 0.0


def read_once(*parts: torch.Tensor) -> list[torch.Tensor]:
    """A decode's results, brought to the host in one copy (issue 22: a decode's reads are its
    steps'): integer tensors as they are and float32 ones (the TV record) by their bits, each
    returned in its shape and dtype."""
    packed = [part.float().contiguous().view(torch.int32) if part.is_floating_point() else part for part in parts]
    host = torch.cat([part.reshape(-1).long() for part in packed]).cpu()
    chunks = host.split([part.numel() for part in packed])
    return [chunk.view(part.shape).int().view(torch.float32) if original.is_floating_point() else chunk.view(part.shape)
            for chunk, part, original in zip(chunks, packed, parts)]


def certified_tv(tv_sums) -> float:
    """The run's certificate from per-image :attr:`DecodeResult.tv_sum` values:
    ``min(1, mean tv_sum)``, a bound on the TV distance between the method's and the model's law
    of one image (estimated from these images). The mean of per-image ``min(1, tv_sum)`` is *not*
    a bound in general (docs/METHODS.md gives a counterexample), so the cap comes last."""
    values = [float(v) for v in tv_sums]
    return min(1.0, sum(values) / len(values)) if values else 0.0


def record_tv_sum(record: dict) -> float:
    """A stats / bench record's per-image TV sum; NaN where the record was off. Old files are read
    too: records written before the sum had its own name keep it under ``"tv_bound"`` (then the
    uncapped sum), and later ones carry a capped ``"tv_bound"`` next to ``"tv_sum"``."""
    value = record["tv_sum"] if "tv_sum" in record else record.get("tv_bound", 0.0)
    return float("nan") if value is None else float(value)


def add_counts(total: torch.Tensor | None, counts: torch.Tensor) -> torch.Tensor:
    """``[depth, rank]`` count tables added, the smaller padded with zeros: the one way running
    acceptance counts are summed (per step in the engine, per batch in stats.json, per file in
    ``relaxspec build-tree``). No device sync: shapes are Python numbers."""
    if total is None or total.numel() == 0:
        return counts.clone()
    if total.shape == counts.shape:
        return total + counts
    rows, cols = max(total.shape[0], counts.shape[0]), max(total.shape[1], counts.shape[1])
    grown = torch.nn.functional.pad(total, (0, cols - total.shape[1], 0, rows - total.shape[0]))
    return grown + torch.nn.functional.pad(counts, (0, cols - counts.shape[1], 0, rows - counts.shape[0]))


def total_rank_counts(tables) -> dict:
    """The sum of ``{"tests": [[...]], "accepts": [[...]]}`` ``[depth, rank]`` count tables (as
    stats.json keeps them, one per batch) with :func:`add_counts`: what ``relaxspec build-tree``
    reads."""
    total: dict = {"tests": [], "accepts": []}
    for key in total:
        summed = None
        for table in tables:
            if table[key]:
                summed = add_counts(summed, torch.tensor(table[key], dtype=torch.long))
        total[key] = [] if summed is None else summed.tolist()
    return total
