"""comm layer."""
