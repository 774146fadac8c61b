"""Builds the native library; everything else is declared in pyproject.toml.

host_kernels._native: every native source (host_kernels/csrc/), plain C loaded with ctypes (no Python C API): the
host kernels, and XLA's FFI handlers (the fused expert forward, the attention over the KV cache, the dense decode
products, argmax), which jitted steps on XLA:CPU call directly, compiled against the C API header jaxlib ships (a build
requirement, pyproject.toml). Optional: where it cannot be built, the code runs without it (numpy kernels; a Python
callback) and says why (`python -m moe_jax.doctor`); where jaxlib's header is missing, it is built without the
handlers; where CUDA's cuda.h is found too (CUDA_HOME, the `nvidia-cuda-runtime` wheel this build requires, or
/usr/local/cuda), the stream-ordered expert calls' CUDA handlers are built in as well (they open the CUDA driver at
run time, so the library needs no GPU to load). The build records the hash of its sources, so a library left from
older sources is refused rather than called.
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup

sys.path.insert(0, str(Path(__file__).parent / "host_kernels"))
from native_sources import (  # noqa: E402
    CUDA_SOURCES,
    HEADERS,
    SOURCES,
    XLA_FFI_HEADERS,
    XLA_FFI_SOURCES,
    source_hash,
)


def xla_ffi_include() -> str | None:
    """jaxlib's include directory (xla/ffi/api/c_api.h), where jaxlib is installed in the build environment."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or spec.origin is None:
        return None
    include = Path(spec.origin).parent / "include"
    return str(include) if (include / "xla" / "ffi" / "api" / "c_api.h").exists() else None


def cuda_include() -> str | None:
    """A directory holding CUDA's cuda.h: $CUDA_HOME's or $CUDA_PATH's, the nvidia-cuda-runtime wheel's (a build
    requirement, pyproject.toml), or /usr/local/cuda's."""
    candidates = [Path(os.environ[name]) / "include" for name in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(name)]
    spec = importlib.util.find_spec("nvidia")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(Path(location).glob("cu*/include"), reverse=True)  # nvidia/cu13/include, ...
        candidates.append(Path(location) / "cuda_runtime" / "include")  # the CUDA 12 wheels' layout
    candidates.append(Path("/usr/local/cuda/include"))
    return next((str(path) for path in candidates if (path / "cuda.h").exists()), None)


include = xla_ffi_include()
cuda = cuda_include() if include else None
if include is None:
    print(
        "moe_jax: jaxlib's headers not found; building the native library without the XLA FFI handlers", file=sys.stderr
    )
elif cuda is None:
    print("moe_jax: CUDA's cuda.h not found; building without the CUDA stream handlers", file=sys.stderr)
sources = SOURCES + (XLA_FFI_SOURCES if include else ()) + (CUDA_SOURCES if cuda else ())
native = Extension(
    "host_kernels._native",
    sources=[f"host_kernels/csrc/{name}" for name in sources],
    # a header's edit rebuilds too (build_ext compares times; the hash below would have the stale build refused)
    depends=[f"host_kernels/csrc/{name}" for name in HEADERS + XLA_FFI_HEADERS],
    include_dirs=[path for path in (include, cuda) if path],
    libraries=["dl"],  # dlopen of the CUDA driver
    extra_compile_args=["-O3"],
    define_macros=[("NATIVE_SOURCE_HASH", f'"{source_hash()}"')],
    optional=True,
)
setup(ext_modules=[native])
