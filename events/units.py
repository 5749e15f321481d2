"""Sizes in bytes, written once."""

KiB = 1024
MiB = 1024**2
GiB = 1024**3
