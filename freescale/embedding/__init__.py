"""embedding layer."""
