"""alfworld environment (being built)."""
