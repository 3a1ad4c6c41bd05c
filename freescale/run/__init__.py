"""Starting a run and watching it: the launcher, the checks before any rank
starts, the run directory, and the watch over the ranks' processes."""
