"""sm70_gptq: the checkpoint's GPTQ-int8 layers served on our kernels inside vLLM.

`rules` decides per layer (pure Python, tested in CI); `sm70_gptq` is the vLLM-facing
QuantizationConfig and linear method (imports vLLM and torch, loaded by the plugin only);
`lm_head` makes the int8 copy of the output head. Importing this package imports neither.
"""
