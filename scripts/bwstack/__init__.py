"""bwstack: one pinned LLM-serving stack for Blackwell (SM120) nodes, provisioned, snapshotted and verified."""

__version__ = "0.1.0"
