"""Builds the native libraries; everything else is declared in pyproject.toml.

- host_kernels._native: the host kernels (host_kernels/csrc/), plain C loaded with ctypes (no Python C API).
- moe_jax._xla_ffi: XLA's FFI handlers (moe_jax/csrc/): the fused expert forward and the bfloat16 decode attention,
  called from inside jitted steps, compiled against the C API header jaxlib ships (a build requirement, pyproject.toml).
Both are built in place by `pip install -e .` and both are optional: where one cannot be built, the code runs the
path without it (numpy kernels; a Python callback) and its status() says why. Each build records the hash of its
sources, so a library left from older sources is refused rather than called.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup

sys.path.insert(0, str(Path(__file__).parent / "host_kernels"))
from native_sources import SOURCES, XLA_FFI_SOURCES, source_hash, xla_ffi_source_hash  # noqa: E402


def xla_ffi_include() -> str | None:
    """jaxlib's include directory (xla/ffi/api/c_api.h), where jaxlib is installed in the build environment."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or spec.origin is None:
        return None
    include = Path(spec.origin).parent / "include"
    return str(include) if (include / "xla" / "ffi" / "api" / "c_api.h").exists() else None


extensions = [
    Extension(
        "host_kernels._native",
        sources=[f"host_kernels/csrc/{name}" for name in SOURCES],
        extra_compile_args=["-O3"],
        define_macros=[("NATIVE_SOURCE_HASH", f'"{source_hash()}"')],
        optional=True,
    )
]
include = xla_ffi_include()
if include is not None:
    extensions.append(
        Extension(
            "moe_jax._xla_ffi",
            sources=[str(path.relative_to(Path(__file__).parent)) for path in XLA_FFI_SOURCES if path.suffix == ".c"],
            include_dirs=[include, "host_kernels/csrc"],
            extra_compile_args=["-O3"],
            define_macros=[("XLA_FFI_SOURCE_HASH", f'"{xla_ffi_source_hash()}"')],
            optional=True,
        )
    )
else:
    print("moe_jax: jaxlib's headers not found; building without the XLA FFI handler", file=sys.stderr)

setup(ext_modules=extensions)
