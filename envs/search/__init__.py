"""search environment (being built)."""
