"""models layer."""
