"""Builds the host kernels' native part; everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "host_kernels._amx_bf16",
            sources=["host_kernels/csrc/amx_bf16.c"],
            extra_compile_args=[
                "-O2",
                "-mamx-tile",
                "-mamx-bf16",
                "-mavx512f",
                "-mavx512bw",
                "-mavx512vl",
                "-mavx512bf16",
            ],
            optional=True,
        )
    ]
)
