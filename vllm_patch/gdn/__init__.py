"""Gated DeltaNet on our kernels inside vLLM (issue 23): `routing` (pure: which steps our
decode ops take and what they are given) and `layer` (imports vLLM: the register_oot
subclass of its GDN layer). The plugin imports `layer` only when gdn.decode_layer is on."""
