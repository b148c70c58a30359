"""The job coordinator: barriers, key-value publish/subscribe and routed id exchange per session."""
