"""A slow reference of rows in parallel without drafts, written from the official LlamaGen-ZipAR
code's rules (github.com/ThisisBillhe/ZipAR at 2a5695c,
``LlamaGen-ZipAR/autoregressive/models/generate_zipar.py``), not from relaxspec's engine:

* row 0 is decoded alone; row 1 opens once row 0 is complete, row ``r + 1`` (``r >= 1``) once
  row ``r`` has ``lead`` tokens (its ``zipar_window_size``);
* every forward feeds, each at its own cache slot and position, first the last token of a row
  that finished in the forward before (its output unused), then the latest token of every open
  row in row order; a newly opened row's first input is the latest token of the row two above it,
  at the slot before the row (the row above's last slot, which it holds until that row's last
  token is forwarded there), or the row above's real last token when that row is complete;
* attention is causal by cache slot, over the slots written so far, this forward's included.

On a target whose rows end with a forced token (``row_end_companions``: Emu3, Lumina-mGPT) the
official rules are Lumina-mGPT-ZipAR's (its ``modeling_chameleon.py``, ``_sample``): row 1 opens at
the lead as every row does, and a new row's first input is the real end of line after the row
above, seeing what was forwarded before it in raster order; here that is the row-end companion
of a token written to a parking slot no query sees, and that end of line's keys are the ones
every later row sees, even after the row above's last token is forwarded (its own end of line is
then computed again and not kept). Every key is computed once.

Two departures, both relaxspec's: the official mask also lets a query attend never-written slots
of the rows above (zero keys and values; ``tests/data/zipar/make_golden.py`` names it), which
this reference does only as ``variant="zero-keys"`` (a LlamaGen model: its cache is zeroed
first); and ``lanes`` caps the rows open at once (the official code opens every row it may): a
row waits for a free lane, and opens then as above.

``variant="before"`` is relaxspec's rows engine until 2026-11-27, for measurements only: row 1
opens at the lead as every row does, a finished row's last token is never forwarded, a query sees
only the keys cached before its forward (never another row's input of the same forward), and a
new row's first input is the row above's latest token, whose keys are never kept.

With a ``generator`` the tokens are sampled from the guided law (else its argmax);
``reference_rows_laws`` also returns each token's law ``[B, N, V]`` (what decided it).
"""

import torch

from relaxspec.decoding.target import GuidedTarget

VARIANTS = ("official", "zero-keys", "before")


def reference_rows(model, cond, sampling, lanes: int, lead: int, cond_mask=None, variant: str = "official",
                   generator: torch.Generator | None = None) -> torch.Tensor:
    return reference_rows_laws(model, cond, sampling, lanes, lead, cond_mask, variant, generator)[0]


def reference_rows_laws(model, cond, sampling, lanes: int, lead: int, cond_mask=None, variant: str = "official",
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    assert variant in VARIANTS, variant
    grid = model.config.grid_size
    total = grid * grid
    images, laws = [], []

    def before_row(row):
        return row * grid - 1

    def draw(probs):
        if generator is None:
            return int(probs.argmax())
        return int(torch.multinomial(probs.double(), 1, generator=generator))

    for b in range(cond.shape[0]):
        target = GuidedTarget(model, cond[b : b + 1], sampling, scratch=3 * grid + 1,
                              cond_mask=None if cond_mask is None else cond_mask[b : b + 1])
        cls, spare = target.cls, target.cls + total
        ends = variant == "official" and bool(getattr(model, "row_end_companions", False))
        parking = spare + grid + 1 if ends else target.max_seq  # a slot per row: a new row's end of line
        if variant == "zero-keys":
            model._kv_store.zero_()
        probs0, _ = target.prefill()
        token = {0: draw(probs0[0])}
        law = {0: probs0[0]}
        count = [1] + [0] * (grid - 1)
        written = set(range(cls))  # slots whose keys a later query may see
        ongoing, opened = [0], 0
        first_input: dict[int, tuple[int, int]] = {}  # a new row's first input: (token, slot)
        tail = None  # raster index of the last token of a row finished in the forward before
        row_end_kept: dict[int, int] = {}  # row -> the slot whose companion keeps its row end
        while sum(count) < total:
            new = opened + 1
            above_done = new < grid and count[new - 1] == grid
            may_open = above_done or ((new >= 2 or variant == "before" or ends) and new < grid and count[new - 1] >= lead)
            if new < grid and len(ongoing) < lanes and may_open:
                before = new * grid - 1  # the raster index before the row
                if above_done:
                    first_input[new] = (token[before], cls + before)
                    if tail == before:  # forwarded once, as the new row's input
                        tail = None
                elif variant == "before":
                    first_input[new] = (token[(new - 1) * grid + count[new - 1] - 1], cls + before)
                elif ends:  # the row above's end of line: its token is written to the row's parking slot, unseen
                    first_input[new] = (token[(new - 1) * grid + count[new - 1] - 1], parking + new - 1)
                else:
                    first_input[new] = (token[(new - 2) * grid + count[new - 2] - 1], cls + before)
                ongoing.append(new)
                opened = new
            feed = [] if tail is None else [(token[tail], cls + tail, None)]
            for row in ongoing:
                if row in first_input:
                    value, slot = first_input.pop(row)
                else:
                    last = row * grid + count[row] - 1
                    value, slot = token[last], cls + last
                feed.append((value, slot, row))
            positions = [cls + before_row(row) if slot >= parking else slot for _, slot, row in feed]
            if variant == "before":  # the keys of an input already cached, and of a stand-in, are not kept
                slots = [spare + i if slot in written or (row is not None and count[row] == 0 and count[row - 1] < grid)
                         else slot for i, (_, slot, row) in enumerate(feed)]
                seen_before = set(written)
            else:
                slots = [slot for _, slot, _ in feed]
                written |= {slot for slot in slots if slot < parking}
            mask = torch.zeros(1, len(feed), target.max_seq, dtype=torch.bool)
            for i, (position, slot) in enumerate(zip(positions, slots)):
                if variant == "before":
                    for seen in seen_before:
                        mask[0, i, seen] = seen < cls or seen < position
                    mask[0, i, slot] = True
                else:
                    for seen in range(position + 1) if variant == "zero-keys" else written:
                        mask[0, i, seen] = seen <= position
            companions = None
            if ends:  # a row's end of line is seen from the next row on, where it was kept
                companions = torch.zeros(1, len(feed), target.max_seq, dtype=torch.bool)
                for i, position in enumerate(positions):
                    for row, slot in row_end_kept.items():
                        companions[0, i, slot] = (row + 1) * grid - 1 < position - cls
            probs, _ = target.forward(torch.tensor([[value for value, _, _ in feed]]), torch.tensor([positions]),
                                      torch.tensor([slots]), mask, companions)
            if ends:  # the row ends computed now: a new row's (its end of line), a row's last token's
                for (_, slot, row), position in zip(feed, positions):
                    end_of = (position - cls + 1) // grid - 1
                    if (position - cls) % grid == grid - 1 and end_of not in row_end_kept:
                        row_end_kept[end_of] = slot
            if variant == "before":
                written |= {slot for slot in slots if slot < spare}
            tail = None
            for i, (_, _, row) in enumerate(feed):
                if row is None:
                    continue
                k = row * grid + count[row]
                token[k], law[k] = draw(probs[0, i]), probs[0, i]
                count[row] += 1
                if count[row] == grid and variant != "before":
                    tail = k
            ongoing = [row for row in ongoing if count[row] < grid]
        images.append(torch.tensor([token[i] for i in range(total)]))
        laws.append(torch.stack([law[i] for i in range(total)]))
    return torch.stack(images), torch.stack(laws)
