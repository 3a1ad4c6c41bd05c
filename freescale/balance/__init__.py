"""balance layer."""
