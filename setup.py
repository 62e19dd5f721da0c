"""Package discovery: every subpackage of mlx_flash is found, so none can be forgotten, and the
top-level kernels/ folder (Metal/CUDA sources beside the package, see DESIGN.md) ships inside the
wheel as mlx_flash.kernels. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["mlx_flash", "mlx_flash.*"]) + ["mlx_flash.kernels"],
    package_dir={"mlx_flash.kernels": "kernels"},
)
