"""Teacher backends and per-task teacher specs (being built)."""
