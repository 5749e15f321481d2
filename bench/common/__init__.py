"""What several benchmarks share: the processes they measure (``processes``), streamed chat
completions as a client sees them (``chat``), CPU use read from /proc (``procfs``) and the
figures and tables of a report (``report``).
"""
