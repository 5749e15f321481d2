"""MLX engines. OpenBLAS, where one is installed, is loaded before any module here imports mlx
(``blas.py`` says why it must come first)."""

from inference.engines.mlx.blas import use_openblas

use_openblas()
