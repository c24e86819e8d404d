"""The virtual vLLM: vLLM's HTTP API and metrics, timed in real time by an instance model, with no model and
no GPU. The same instance model (`instance`, `latency`, `spec`) runs in the simulator in virtual time.

| module | what it holds |
|---|---|
| `latency.py` | step times: `FixedLatency` (given per-token times), `RooflineLatency` (FLOPs and bytes per step from a model's geometry on a named GPU; overrides from a YAML hardware file) |
| `instance.py` | one vLLM-like instance: `max_num_seqs` slots, paged KV blocks, preemption by recompute, decode advanced in step batches; `SimRequest` |
| `spec.py` | `InstanceSpec` (latency model and limits of one instance) and `build_latency` |
| `server.py` | the ASGI app: OpenAI endpoints, `/tokenize`, `/health`, `/metrics` over a real-time loop |
| `cli.py` | flags, their checks, uvicorn (`python -m backends.virtual_vllm`, `manage.py virtual_vllm`) |
"""
