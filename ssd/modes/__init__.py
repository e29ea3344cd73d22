"""Decoding modes: each runs one speculation round for the running batch."""
