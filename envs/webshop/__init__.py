"""webshop environment (being built)."""
