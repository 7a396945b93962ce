"""`sm70ctl doctor`: can this machine run the Volta serving stack?

probes.py touches the world (NVML, subprocesses, files) and returns plain dataclasses;
checks.py turns those into verdicts with pure functions; command.py renders them.
"""
