"""FreeScale's benchmark harness: one scenario file per paper figure or regression guard.

    python -m benchmarks list                      # scenarios, what they stand for, needs
    python -m benchmarks plan --gpus 2             # which ones a machine of 2 GPUs runs
    python -m benchmarks run fig8 [--smoke] [--out DIR]
    python -m benchmarks session --gpus 1 --out DIR   # every scenario this machine runs
    python -m benchmarks index                     # rewrite results/INDEX.md

A scenario (``scenarios/NAME.toml``, `scenario.py`) names a measure function
(`train.py`, `kernels.py`, `interference.py`, `comm.py`, `embedding.py`,
`sim_project.py`, `sim_validate.py`); `runner.py` runs it and `report.py`
writes the one report format. Measures use public hooks only: the training
config (``--set`` keys, all in ``scenarios/keys.toml``), a run's summary and
metrics JSON lines, and the torch profiler.

Import order (no circles; a test checks it): scenario <- report <- runner <-
measures <- __main__.
"""
