"""`python -m bench.api_overhead`: what the API adds to a request (``__main__``) and its report."""
