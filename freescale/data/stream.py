"""`SampleStream`: sources whose steps read consecutive positions of one sample stream.

Both built-in sources number their samples: sample ``p`` is a pure function of
(seed, p). Rank ``r`` of ``W`` at global step ``s`` with local batch ``B``
reads positions ``(s * W + r) * B + i`` for ``i < B``, so a run of W ranks
has consumed ``n * W * B`` samples before step ``n``.

A run resumed at another world size W' (`freescale.state.position`) must
neither skip nor repeat samples: `starting_at` (n, p) gives the same source
whose step ``s >= n`` reads from position ``p + (s - n) * W' * B`` on. With
``p = n * W' * B`` that is the unresumed numbering, position for position.
"""

from __future__ import annotations

import copy
from typing import Self


class SampleStream:
    """Mixin: the position numbering above, and its resumed form."""

    origin: tuple[int, int] = (0, 0)  # (step, stream position where that step starts)

    def starting_at(self, step: int, position: int) -> Self:
        """A copy of this source whose global step ``step`` starts at stream
        position ``position`` (samples consumed before it, over all ranks)."""
        if step < 0 or position < 0:
            raise ValueError(f"starting_at needs step, position >= 0, got {step}, {position}")
        out = copy.copy(self)
        out.origin = (step, position)
        return out

    def first_position(self, step: int, rank: int, world_size: int, batch_size: int) -> int:
        """The stream position of the first sample of ``rank``'s batch at ``step``
        (negative for a step before the origin: not in this stream)."""
        step0, position0 = self.origin
        return position0 + ((step - step0) * world_size + rank) * batch_size
