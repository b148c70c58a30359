"""testbed."""
