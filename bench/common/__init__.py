"""What the benchmarks share (a benchmark imports no other benchmark and no test module): the
processes they measure (``processes``, on ``harness.processes``), the cluster of separate
processes ``bench.soak`` runs (``cluster``), llama.cpp's own server built from the engine's
source (``llama_server``), streamed chat completions as a client sees them (``chat``), one
image in (``vision``), CPU use read from /proc (``procfs``) and the figures, tables and
verdicts of a report (``report``).
"""
