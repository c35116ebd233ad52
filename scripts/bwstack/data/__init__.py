"""Data shipped with bwstack: the patch catalogue and the probe's helpers."""
