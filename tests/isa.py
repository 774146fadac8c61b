"""pytest parameters over a native kernel's instruction-set variants (host_kernels.native.AVX512, AVX2): each runs
where this CPU has its features and is skipped, naming what it lacks, where not. A CPU with AVX-512 runs both."""

import pytest

from host_kernels import native

ISAS = (native.AVX512, native.AVX2)


def variants(status, isas=ISAS) -> list:
    """One parameter per variant; `status(isa)` is the kernel's (usable, why not)."""
    return [
        pytest.param(isa, id=isa, marks=pytest.mark.skipif(not status(isa)[0], reason=f"{isa}: {status(isa)[1]}"))
        for isa in isas
    ]


def kernel_variants(kernels: dict, names) -> list:
    """One parameter per fused forward kernel in `names` (fused_forward.KERNELS entries), skipped where it cannot
    run here."""
    return [
        pytest.param(name, id=name, marks=pytest.mark.skipif(not kernels[name].status()[0],
                                                             reason=f"{name}: {kernels[name].status()[1]}"))
        for name in names
    ]  # fmt: skip
