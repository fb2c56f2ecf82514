"""Attention backends, one file each."""
