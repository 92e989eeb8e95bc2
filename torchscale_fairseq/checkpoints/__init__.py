"""Sharded checkpoints: their layout (names, record, checks) and conversions. Free of
fairseq registrations."""
