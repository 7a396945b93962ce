"""Clef beside chat: the CPU-side pieces (issue 25), pure Python, no torch or vLLM import
(except `head_forward`, the head's torch forward pass, and `runner_hook`, the worker-side
hook (torch; vLLM when installed), which nothing else here imports).

- `model_dims`: the base model's shapes, read from its `config.json` dict;
- `layout`: which linears of decoder layers 40-63 carry a correction, with their A/B shapes;
- `sharding`: what one tensor-parallel rank keeps of each A and B;
- `safetensors_header`: a bounded reader of a `.safetensors` header (no torch);
- `head`: the scoring head's config and tensors;
- `manifest`, `validate`: `clef.json` and the whole `SM70_CLEF_DIR` check;
- `routing`: which requests are Clef, its context limit, no speculative decoding;
- `scoring`: the scoring endpoint's request validation and response shape;
- `rows`: which rows of a batch are Clef's and which path a corrected layer takes;
- `head_forward` (torch): the scoring head's forward pass;
- `batch`: which requests of a step are Clef's (extra_args) and which rows the head reads;
- `render`: a scoring request as one prompt and the head's positions in it;
- `api`: the API server's ASGI middleware (the scoring route, the refusals);
- `runner_hook` (torch): runtime patch R6, the runner marking Clef rows and gathering rows;
- `worker_ext`: the worker methods the API process calls through `collective_rpc`.

The correction inside our linear methods is vllm_patch/quantization/clef_correction.py
(docs/clef.md says what is done and what is not).
"""
