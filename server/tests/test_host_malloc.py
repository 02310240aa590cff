"""The shard's malloc settings: memory a step frees is reused by the next without page faults.

Measured with the kernel's own fault counter in a fresh process (the settings only reach threads
started after them), against the same process without the settings as the control.
"""

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import resource, sys, threading
    if sys.argv[1] == "tuned":
        from quiver_server.host_malloc import keep_freed_memory
        assert keep_freed_memory(), "glibc refused the settings"
    faults = []
    def step_like():
        # 64 MiB written and freed, ten times: a prefill's activations, over glibc's mmap limit.
        for _ in range(10):
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            buffer = bytearray(64 << 20)
            buffer[::4096] = b"x" * len(buffer[::4096])
            del buffer
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    worker = threading.Thread(target=step_like)  # the engine runs on a worker thread too
    worker.start(); worker.join()
    print(max(faults[1:]))
""")


def faults_per_repeat(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_freed_memory_is_reused_without_page_faults():
    pages = (64 << 20) // 4096
    # Control: glibc's defaults map and unmap the buffer each time, faulting every page again.
    assert faults_per_repeat("default") > pages // 2
    # Tuned: the second and later buffers reuse mapped memory.
    assert faults_per_repeat("tuned") < pages // 100
