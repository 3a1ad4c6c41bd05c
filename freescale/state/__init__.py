"""A run's state on disk: checkpoints (written whole or not at all, verified
before they load), resume at any world size, the data position, RNG state,
and the trained model as one unsharded state dict."""
