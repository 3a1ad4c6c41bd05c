import os

import torch
from hypothesis import settings

from freescale.testing.multirank import THREADS_ENV, rank_threads

# CI runs derandomized so a red run is reproducible; locally examples vary.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# scripts/numeric_matrix.sh: this process's intra-op threads, explicitly (torch
# caps OMP_NUM_THREADS at the cores it sees); run_ranks' ranks take the same.
if os.environ.get(THREADS_ENV):
    torch.set_num_threads(rank_threads())
