"""Builds the host kernels' native library; everything else is declared in pyproject.toml.

The library is plain C loaded with ctypes (no Python C API), built in place by `pip install -e .`. It is optional:
where it cannot be built, the engine runs its numpy path and host_kernels.native.status() says why.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "host_kernels._native",
            sources=["host_kernels/csrc/amx_gemm.c", "host_kernels/csrc/swiglu.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
