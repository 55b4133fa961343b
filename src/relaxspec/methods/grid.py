"""Rows in parallel, as settings: the plan ``--rows`` and ``--row-lead`` give on a model's token
grid (:mod:`relaxspec.decoding.rows` decodes with it)."""

from __future__ import annotations

from dataclasses import dataclass

from relaxspec.errors import RelaxspecError

#: What a token painted with rows in parallel is conditioned on, for records and reports.
ROWS_SEEN = ("each token sees the rows above as far as they were forwarded when it was decided: the row above up to "
             "its input of that step, not the token decided beside it, and a stand-in at its last slot while it is "
             "open (or, where rows end with a forced token, its end of line as it was when the row below opened)")


@dataclass(frozen=True)
class RowPlan:
    """``lanes`` rows open at once at most (more than the grid has: all of them); a row opens once
    the row above has ``lead`` tokens; ``prefix_below``: an open row below the top one commits its
    accepted drafts only (PJD's code), not also a bonus or residual token."""

    lanes: int = 2
    lead: int = 1
    prefix_below: bool = False

    def check(self, grid: int | None) -> None:
        """One line for a plan the model's grid cannot take (``grid``: its side, ``None`` without one)."""
        if grid is None:
            raise RelaxspecError("rows in parallel need a model whose image tokens lie on a square grid")
        if self.lanes < 1:
            raise RelaxspecError(f"rows must be at least 1, got {self.lanes}")
        if not 1 <= self.lead <= grid:
            raise RelaxspecError(f"row lead must lie in [1, {grid}] (the grid is {grid} tokens wide), got {self.lead}")


def row_plan(options, model) -> RowPlan:
    """The plan ``options`` (``rows``, ``row_lead``) give on ``model``'s grid, checked: the lead
    defaults to the method's (:meth:`Method.default_row_lead`: a third of the row, PJD's a fifth)."""
    grid = grid_side(model)
    lead = options.row_lead if options.row_lead is not None else options.family.default_row_lead(grid or 3)
    plan = RowPlan(options.rows, lead, options.family.prefix_below(options))
    plan.check(grid)
    return plan


def grid_side(model) -> int | None:
    """The side of ``model``'s square token grid, ``None`` when its image is not one."""
    config = model.config
    side = getattr(config, "grid_size", None)
    if not isinstance(side, int) or side * side != config.block_size:
        return None
    return side


__all__ = ["ROWS_SEEN", "RowPlan", "grid_side", "row_plan"]
