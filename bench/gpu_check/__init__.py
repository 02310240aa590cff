"""`make gpu-bundle` (`python -m bench.gpu_check.bundle`) and `make gpu-check`
(`python -m bench.gpu_check.run`): the prepared, offline check on one NVIDIA GPU, one process per
phase (phase_*.py); families.sh is the model families' own GPU run."""
