"""A slow reference of rows in parallel without drafts (ZipAR's schedule), greedy: one image at a
time, each open row's next token decided by its own target forward of one token, in the order
the engine decides them, with the visibility the engine promises (the condition, the keys cached
before the step that come earlier in raster order, and the forwarded token itself)."""

import torch

from relaxspec.decoding.target import GuidedTarget


def reference_rows(model, cond, sampling, lanes: int, lead: int, cond_mask=None) -> torch.Tensor:
    grid = model.config.grid_size
    total = grid * grid
    images = []
    for b in range(cond.shape[0]):
        target = GuidedTarget(model, cond[b : b + 1], sampling, scratch=1,
                              cond_mask=None if cond_mask is None else cond_mask[b : b + 1])
        cls, spare = target.cls, target.cls + total
        probs0, _ = target.prefill()
        token = {0: int(probs0[0].argmax())}
        fill = [1] + [0] * (grid - 1)
        cached: set[int] = set()
        lane_row = list(range(lanes))
        while sum(fill) < total:
            seen = set(cached)
            decided = []
            for lane in range(lanes):
                row = lane_row[lane]
                if row >= grid or fill[row] >= grid or (row > 0 and fill[row - 1] < min(lead, grid)):
                    continue
                k = row * grid + fill[row]
                if fill[row] == 0:  # the row above's latest token, at the position before the row
                    root, real = (row - 1) * grid + fill[row - 1] - 1, fill[row - 1] == grid
                else:
                    root, real = k - 1, True
                slot = cls + k - 1 if real and (k - 1) not in cached else spare
                mask = torch.zeros(1, 1, target.max_seq, dtype=torch.bool)
                mask[..., :cls] = True
                for j in seen:
                    if j < k - 1:
                        mask[..., cls + j] = True
                mask[..., slot] = True
                probs, _ = target.forward(torch.tensor([[token[root]]]), torch.tensor([[cls + k - 1]]),
                                          torch.tensor([[slot]]), mask)
                decided.append((lane, row, k, int(probs[0, 0].argmax()), slot != spare))
            for lane, row, k, value, keep in decided:
                token[k] = value
                fill[row] += 1
                if keep:
                    cached.add(k - 1)
                if fill[row] == grid:
                    lane_row[lane] += lanes
        images.append(torch.tensor([token[i] for i in range(total)]))
    return torch.stack(images)
