"""The virtual vLLM's command line: its flags, their checks, and the uvicorn that serves it.

    python -m backends.virtual_vllm --port 8100 --max-num-seqs 16 --latency-model fixed
    python manage.py virtual_vllm --port 8100 ...            (the same, through Django)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from backends.virtual_vllm.server import ServerConfig, VirtualVllm
from backends.virtual_vllm.spec import LATENCY_MODELS, InstanceSpec, build_latency


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--served-model-name", "--model", dest="model", default="virtual-vllm")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--default-max-tokens", type=int, default=128)
    parser.add_argument("--latency-model", choices=LATENCY_MODELS, default="fixed")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument(
        "--roofline-model", default="qwen/qwen3-8b", help="geometry for the roofline latency model"
    )
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.1)
    parser.add_argument("--decode-ms-per-token", type=float, default=20.0)
    parser.add_argument("--kv-blocks", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--time-scale", type=float, default=1.0, help="virtual seconds per real second")
    parser.add_argument("--log-level", default="warning")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The server's configuration; ValueError naming every bad flag (the latency model is checked too)."""
    problems = []
    if not 0 < args.port < 65536:
        problems.append(f"--port must be between 1 and 65535, got {args.port}")
    for name in ("max_num_seqs", "max_model_len", "default_max_tokens", "block_size"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.kv_blocks is not None and args.kv_blocks < 1:
        problems.append(f"--kv-blocks must be positive, got {args.kv_blocks}")
    if not args.time_scale > 0:
        problems.append(f"--time-scale must be positive, got {args.time_scale}")
    if args.prefill_ms_per_token < 0 or args.decode_ms_per_token < 0:
        problems.append("per-token times must be >= 0")
    if problems:
        raise ValueError("; ".join(problems))
    kv_blocks = args.kv_blocks
    if kv_blocks is None and args.latency_model == "fixed":
        # Room for every slot to hold 2,048 tokens: enough that KV usage reads like a real server's.
        kv_blocks = -(-args.max_num_seqs * 2048 // args.block_size)
    spec = InstanceSpec(
        latency_model=args.latency_model,
        gpu=args.gpu,
        model=args.roofline_model,
        prefill_ms_per_token=args.prefill_ms_per_token,
        decode_ms_per_token=args.decode_ms_per_token,
        max_num_seqs=args.max_num_seqs,
        kv_blocks=kv_blocks,
        block_size=args.block_size,
    )
    build_latency(spec)  # an unknown GPU or model is a bad flag too
    return ServerConfig(args.model, args.max_model_len, args.default_max_tokens, args.time_scale, spec)


def banner(config: ServerConfig, host: str, port: int) -> str:
    return f"virtual vLLM ({config.model}, {config.instance.max_num_seqs} slots) on http://{host}:{port}/"


def serve(config: ServerConfig, host: str, port: int, log_level: str = "warning") -> None:
    import uvicorn

    uvicorn.run(VirtualVllm(config), host=host, port=port, log_level=log_level, lifespan="off")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backends.virtual_vllm", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as error:
        print(f"virtual_vllm: error: {error}", file=sys.stderr)
        return 2
    print(banner(config, args.host, args.port), flush=True)
    serve(config, args.host, args.port, args.log_level)
    return 0
