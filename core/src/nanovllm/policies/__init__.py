"""Sparse policies that ship with the core."""
