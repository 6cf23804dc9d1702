"""Passes, one file each, and the named phases that string them together."""
