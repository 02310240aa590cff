"""The shard's OpenMP settings reach the C environment that libgomp reads when torch loads it,
and an operator's own values win. (What the settings buy is measured by `make bench`.)"""

import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import ctypes, sys
    import quiver_server.cli  # the shard's entry point: the package sets the defaults first
    import torch  # noqa: F401  (loads libgomp after the settings)
    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    print(getenv(b"OMP_WAIT_POLICY").decode(), getenv(b"GOMP_SPINCOUNT").decode())
""")


def openmp_env(**overrides: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(overrides)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=env)
    return out.stdout.split()


def test_threads_spin_briefly_then_sleep_by_default():
    assert openmp_env() == ["PASSIVE", "30000"]


def test_operator_settings_win():
    assert openmp_env(GOMP_SPINCOUNT="0") == ["PASSIVE", "0"]
    assert openmp_env(OMP_WAIT_POLICY="ACTIVE", GOMP_SPINCOUNT="1000000") == ["ACTIVE", "1000000"]
