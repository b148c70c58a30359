"""The job coordinator's wire protocol, record formats and client (shared by operator and node agent)."""
