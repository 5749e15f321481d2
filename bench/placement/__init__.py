"""`python -m bench.placement`: the planner's placement at scale (``__main__``), its cases and
the clusters they run on."""
