"""From settings to what vLLM receives: the command line, the environment, the plugin config,
the secrets file, the compile-cache key and entries, and the server process itself.

serve (which supervises the server) and warmup (which fills and verifies the compile cache)
both start vLLM through this package and never import each other. The modules are pure
unless their docstring says they touch the world (fingerprint, probes, server, port_lock,
secrets' file).
"""
