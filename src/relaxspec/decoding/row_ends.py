"""How rows in parallel treat the end of a row (:mod:`relaxspec.decoding.rows`): one strategy
object a rows step asks at each point where the two kinds of target differ.

* :class:`PlainRowEnds` -- a target whose rows simply end (LlamaGen; LlamaGen-ZipAR's rules): row
  1 opens once row 0 is complete, a new row's first token is predicted from an auxiliary token,
  the latest of the row two above, at the slot before the row.
* :class:`KeptRowEnds` -- a target whose rows end with a forced token (Emu3, Lumina-mGPT:
  ``row_end_companions``; Lumina-mGPT-ZipAR's rules): row 1 opens at the lead too; a new row's
  first token is predicted from the real end of line after the row above, the row-end companion
  of a root nobody sees (its keys parked at a slot of the row above), and the row ends a row has
  seen are kept: ``row_end_kept [B, max_seq]`` says which slots' companions are, seen by the
  rows after them (``row_end_raster [max_seq]``: the raster index each one follows).
"""

from __future__ import annotations

import torch


class PlainRowEnds:
    """Rows that simply end (LlamaGen-ZipAR)."""

    first_row_at_lead = 2  # the first row that opens at the lead (row 1 waits for row 0 to complete)
    hides_root = False  # a new row's first root is a token of the row two above, seen as it is
    extra_slots = 0  # cache slots past the lanes' scratch

    def stand_row(self, row: torch.Tensor) -> torch.Tensor:
        """The row whose latest token stands in for a new row's first root (unclamped)."""
        return row - 2

    def tables(self, kept_copy, target, grid: int, lanes: int, nodes: int) -> dict:
        return {}

    def state(self, kept, target) -> dict:
        return {}

    def forward_mask(self, state, lanes, raster, tail):
        """The companions mask of the forward (:meth:`GuidedTarget.forward`): none here."""
        return None

    def tail_written(self, state, written, tail_row) -> None:
        pass

    def land_roots(self, grid_slot, lanes, tables) -> None:
        pass

    def after_move(self, state, moving, dst) -> None:
        pass


class KeptRowEnds:
    """Rows that end with a forced token whose keys are kept (Lumina-mGPT-ZipAR)."""

    first_row_at_lead = 0
    hides_root = True

    def __init__(self, grid: int):
        self.extra_slots = grid  # a parking slot per row: where a new row's start keeps its row end

    def stand_row(self, row: torch.Tensor) -> torch.Tensor:
        return row - 1

    def tables(self, kept_copy, target, grid: int, lanes: int, nodes: int) -> dict:
        device = target.device
        return {"row_end_raster": kept_copy("row_end_raster", _row_end_raster(target.max_seq, target.cls, grid,
                                                                             lanes * nodes).to(device)),
                "lane_eye": kept_copy("lane_eye", torch.eye(lanes, dtype=torch.bool, device=device))}

    def state(self, kept, target) -> dict:
        return {"row_end_kept": kept("row_end_kept", (target.batch, target.max_seq), torch.bool)}

    def forward_mask(self, state, lanes, raster, tail) -> torch.Tensor:
        """``[B, L * T + 1, max_seq]``: the row ends kept, each seen from the next row on; a row's
        first root's by its own lane; the tail's."""
        tables = state.tables
        batch = raster.shape[0]
        kept = state.row_end_kept
        companions = kept[:, None, None, :] & (tables.row_end_raster < raster[..., None])
        companions[..., tables.scratch[:, 0]] |= (lanes.fill == 0)[:, None, None, :] & tables.lane_eye[None, :, None, :]
        tail_companions = kept & (tables.row_end_raster < tail.at[:, None])
        return torch.cat([companions.view(batch, tables.lanes * tables.nodes, -1), tail_companions[:, None, :]], 1)

    def tail_written(self, state, written, tail_row) -> None:
        """The tail's row end is kept, unless the row below kept one when it opened."""
        parked = state.row_end_kept.gather(1, (state.tables.parking + tail_row)[:, None])
        state.row_end_kept |= written & ~parked

    def land_roots(self, grid_slot, lanes, tables) -> None:
        """A hidden root's keys go to the parking slot of the row above: its row end is kept there."""
        grid_slot[:, :, 0] = torch.where(lanes.hidden_root, tables.parking + (lanes.row - 1).clamp(min=0),
                                         grid_slot[:, :, 0])

    def after_move(self, state, moving, dst) -> None:
        """Row ends kept: a hidden root's (parked), a token's landing at a row end unless one is parked."""
        tables = state.tables
        batch, grid, cls, n_tok = dst.shape[0], tables.grid, tables.cls, tables.grid * tables.grid
        row_of = ((dst - cls).clamp(min=0, max=n_tok - 1) // grid).view(batch, -1)
        at_end = ((dst - cls) % grid == grid - 1).view(batch, -1) & (dst < cls + n_tok).view(batch, -1)
        parked = state.row_end_kept.gather(1, tables.parking + row_of)
        keep_end = moving.view(batch, -1) & ((at_end & ~parked) | (dst >= tables.parking).view(batch, -1))
        flat = dst.view(batch, -1)
        state.row_end_kept.scatter_(1, flat, keep_end | state.row_end_kept.gather(1, flat))


def row_ends(model, grid: int):
    """The strategy of ``model``'s rows: kept row ends on a target whose rows end with a forced token."""
    return KeptRowEnds(grid) if getattr(model, "row_end_companions", False) else PlainRowEnds()


def _row_end_raster(max_seq: int, cls: int, grid: int, scratch: int) -> torch.Tensor:
    """``[max_seq]``: the raster index a slot's row-end companion follows (a grid slot's own, a
    parking slot's row's last; ``grid * grid`` elsewhere: never seen)."""
    n_tok = grid * grid
    raster = torch.full((max_seq,), n_tok, dtype=torch.long)
    raster[cls : cls + n_tok] = torch.arange(n_tok)
    raster[cls + n_tok + scratch : cls + n_tok + scratch + grid] = torch.arange(grid) * grid + grid - 1
    return raster


__all__ = ["KeptRowEnds", "PlainRowEnds", "row_ends"]
