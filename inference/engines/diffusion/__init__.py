"""Image generation on diffusers (PyTorch): ``engine.py``."""
