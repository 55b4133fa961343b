"""Rows in parallel, as settings: the :class:`~relaxspec.decoding.rows.Rows` schedule ``--rows``
and ``--row-lead`` give on a model's token grid (:mod:`relaxspec.decoding.rows` decodes with it)."""

from __future__ import annotations

from relaxspec.decoding.rows import Rows, grid_side

#: What a token painted with rows in parallel is conditioned on, for records and reports.
ROWS_SEEN = ("each token sees the rows above as far as they were forwarded when it was decided: the row above up to "
             "its input of that step, not the token decided beside it, and a stand-in at its last slot while it is "
             "open (or, where rows end with a forced token, its end of line as it was when the row below opened)")


def row_plan(options, model) -> Rows:
    """The schedule ``options`` (``rows``, ``row_lead``) give on ``model``'s grid, checked: the lead
    defaults to the method's (:meth:`Method.default_row_lead`: a third of the row, PJD's a fifth)."""
    grid = grid_side(model)
    lead = options.row_lead if options.row_lead is not None else options.family.default_row_lead(grid or 3)
    plan = Rows(options.rows, lead, options.family.prefix_below(options))
    plan.check(grid)
    return plan


__all__ = ["ROWS_SEEN", "grid_side", "row_plan"]
