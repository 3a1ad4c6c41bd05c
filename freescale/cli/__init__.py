"""The ``freescale`` command line (layer 4)."""
