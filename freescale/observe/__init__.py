"""Observing a run: step timing, metrics, profiler traces and their reports,
FLOPs and MFU, TensorBoard scalars, and the rank-agreement debug check."""
