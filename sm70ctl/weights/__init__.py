"""Model weights: pinned fetch (resumable), offline verify, quantisation-config checks.

pins.py (lock file [models] tables) -> fetch.py (hub client, partial files, hashes) ->
manifest.py (what the folder should hold) -> verify.py (offline re-check); quant.py is the
pure quantization_config validator that `serve` pre-flight also calls; command.py wires
`sm70ctl weights fetch|verify|check-quant`.
"""
