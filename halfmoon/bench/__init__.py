"""Benchmarks behind `halfmoon bench <name>`: each runs Halfmoon and its baseline in the same
process run, on the same token ids, and prints the figures and the ratio (see docs/ARCHITECTURE.md,
"Measuring"). `report` holds what they share: figures, the table, the machine, progress."""
