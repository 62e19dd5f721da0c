"""Kernel sources (Metal, CUDA) shipped inside the wheel; see README.md in this folder."""
