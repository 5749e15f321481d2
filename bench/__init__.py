"""Shoal's benchmarks, each run as a module from the repository root, as ``make bench`` runs
them: ``.venv/bin/python -m bench.NAME [--help]``. What several of them share is
``bench.common``.
"""
