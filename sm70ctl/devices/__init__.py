"""The machine's GPUs: the one NVML probe (nvml.py) and the one SM70_GPUS resolver
(selection.py). Below every feature package; imports nothing of sm70ctl but errors."""
