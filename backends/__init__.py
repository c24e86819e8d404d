"""What the gateway proxies to that we ship: `engine` (our inference engine with Token-PD), `virtual_vllm`
(a vLLM look-alike timed by the instance model) and `vllm_wire` (vLLM's wire format, shared by both servers
and by the apps that talk to vLLM).

A backend knows nothing of tenants' entitlements or the control plane: nothing here imports `apps`,
`workers`, `tokenpools_site` or Django (an import-linter contract in pyproject.toml holds to that).
"""
