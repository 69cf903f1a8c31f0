"""CUDA page-copy kernels (hicache.cu) and their nvcc/ctypes loader."""
