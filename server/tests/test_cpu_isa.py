"""QUIVER_CPU_ISA: which vector width the C++ kernels are built for, and that the loaded build is
that one (`make test` runs the kernel tests once per ISA the host runs)."""

from __future__ import annotations

import os

import pytest

from quiver_server.kernels import cpu_ops

FLOATS_PER_VECTOR = {"avx512": 16, "avx2": 8}


def test_the_loaded_build_is_the_requested_isa() -> None:
    assert cpu_ops.available()
    runnable = cpu_ops.host_isas()
    isa = cpu_ops.loaded_isa()
    assert isa == cpu_ops.selected_isa()
    if runnable:  # x86-64 with AVX2 at least: native means the widest
        assert isa in runnable
        requested = os.environ.get("QUIVER_CPU_ISA", "native")
        assert isa == (runnable[0] if requested == "native" else requested)
        assert cpu_ops.vector_width() == FLOATS_PER_VECTOR[isa]


def test_an_isa_the_cpu_cannot_run_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_ops, "host_isas", lambda: ["avx2"])
    monkeypatch.setenv("QUIVER_CPU_ISA", "avx512")
    with pytest.raises(ValueError, match="cannot run it"):
        cpu_ops.selected_isa()
    monkeypatch.setenv("QUIVER_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="expected one of native, avx512, avx2"):
        cpu_ops.selected_isa()
    monkeypatch.setenv("QUIVER_CPU_ISA", "AVX2")
    assert cpu_ops.selected_isa() == "avx2"
    monkeypatch.setenv("QUIVER_CPU_ISA", "native")
    assert cpu_ops.selected_isa() == "avx2"
    monkeypatch.setattr(cpu_ops, "host_isas", lambda: ["avx512", "avx2"])
    assert cpu_ops.selected_isa() == "avx512"
