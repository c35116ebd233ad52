"""bwstack bench: the performance figures against their anchors."""

# The figures `bwstack bench` measures (what --only names).
BENCHES = ("P1", "P2", "P3", "P4", "P5", "P6", "P7")
