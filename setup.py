"""Builds the native library; everything else is declared in pyproject.toml.

host_kernels._native: every native source (host_kernels/csrc/), plain C loaded with ctypes (no Python C API): the
host kernels, and XLA's FFI handlers (the fused expert forward, the decode attention, the dense decode products,
argmax), which jitted steps on XLA:CPU call directly, compiled against the C API header jaxlib ships (a build
requirement, pyproject.toml). Optional: where it cannot be built, the code runs without it (numpy kernels; a Python
callback) and says why (`python -m moe_jax.doctor`); where jaxlib's header is missing, it is built without the
handlers. The build records the hash of its sources, so a library left from older sources is refused rather than
called.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup

sys.path.insert(0, str(Path(__file__).parent / "host_kernels"))
from native_sources import HEADERS, SOURCES, XLA_FFI_HEADERS, XLA_FFI_SOURCES, source_hash  # noqa: E402


def xla_ffi_include() -> str | None:
    """jaxlib's include directory (xla/ffi/api/c_api.h), where jaxlib is installed in the build environment."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or spec.origin is None:
        return None
    include = Path(spec.origin).parent / "include"
    return str(include) if (include / "xla" / "ffi" / "api" / "c_api.h").exists() else None


include = xla_ffi_include()
if include is None:
    print(
        "moe_jax: jaxlib's headers not found; building the native library without the XLA FFI handlers", file=sys.stderr
    )
sources = SOURCES + (XLA_FFI_SOURCES if include else ())
native = Extension(
    "host_kernels._native",
    sources=[f"host_kernels/csrc/{name}" for name in sources],
    # a header's edit rebuilds too (build_ext compares times; the hash below would have the stale build refused)
    depends=[f"host_kernels/csrc/{name}" for name in HEADERS + XLA_FFI_HEADERS],
    include_dirs=[include] if include else [],
    extra_compile_args=["-O3"],
    define_macros=[("NATIVE_SOURCE_HASH", f'"{source_hash()}"')],
    optional=True,
)
setup(ext_modules=[native])
