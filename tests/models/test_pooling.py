"""`segment_mean` against a per-segment loop, empty segments and an empty batch included."""

import torch

from freescale import segment_mean


def test_segment_mean_matches_a_loop_over_segments():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        lengths = torch.randint(0, 4, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        values = torch.randn(int(offsets[-1]), 3, generator=g)
        want = torch.stack(
            [values[a:b].mean(0) if b > a else torch.zeros(3) for a, b in
             zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]
        ) if lengths.numel() else torch.zeros(0, 3)  # fmt: skip
        torch.testing.assert_close(segment_mean(values, offsets), want)
