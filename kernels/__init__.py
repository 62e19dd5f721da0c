"""Kernels shipped inside the wheel (Metal and CUDA sources, the compiled CPU kernel and its Python
binding); see README.md in this folder."""
