"""Builds the GIL-free allocation shim (plain C; no CUDA headers or libraries needed at build time)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("um_lab.cuda._shim", ["um_lab/cuda/_shim.c"], extra_compile_args=["-O2"])])
