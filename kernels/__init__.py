"""Triton kernels of the course (shipped as ``attnlab.kernels``)."""
