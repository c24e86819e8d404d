"""`tokenpools-sim` / `python manage.py simulate`: BLIS's command line over our simulator.

Flags follow BLIS where BLIS has them (`--model`, `--num-instances`, `--rate`, `--num-requests`, `--seed`,
`--input-tokens`, `--output-tokens`, `--admission-policy`, `--token-bucket-*`, `--policy-config`, flow
control flags, `--slo-targets`, ...); ours are `--scenario`, `--token-pools`, `--json` and `--plot`.
Flags given explicitly override the scenario file. Bad flags or files: a message and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from apps.policy.errors import PolicyConfigError
from apps.simulator.scenario import Scenario, ScenarioError, load_scenario, read_yaml
from apps.simulator.simulation import SimConfig, Simulation
from apps.simulator.workload import LengthSpec, TenantSpec
from backends.virtual_vllm.latency import HardwareConfigError

PROG = "tokenpools-sim"
ADMISSION_CHOICES = ("always-admit", "token-bucket", "tier-shed", "gaie-legacy", "reject-all")


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _int_at_least(minimum: int, kind: str) -> Callable[[str], int]:
    """An argparse type for whole numbers >= `minimum`; `kind` names the range in the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a {kind} integer, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1, "positive")
_non_negative_int = _int_at_least(0, "non-negative")


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _slo_targets(text: str) -> dict[str, float]:
    """`critical=100000,standard=500000` (microseconds, as BLIS)."""
    targets: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"expected class=microseconds pairs, got {part!r}")
        targets[name.strip()] = _positive_float(value)
    if not targets:
        raise argparse.ArgumentTypeError("expected at least one class=microseconds pair")
    return targets


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, description="Simulate token-pool admission over a vLLM-like cluster in virtual time."
    )
    add = parser.add_argument
    add("--scenario", metavar="FILE", help="YAML scenario (tenants, cluster, admission, capacity events)")
    add("--model", default=None, help="model for the roofline latency model (default qwen/qwen3-8b)")
    add("--gpu", default=None, help="h100, h200 or a10-l4 (default h100)")
    add(
        "--hardware-file",
        metavar="FILE",
        help="YAML overriding GPU, model geometry and efficiency coefficients",
    )
    add("--latency-model", choices=("roofline", "fixed"), default=None)
    add(
        "--prefill-ms-per-token",
        type=_non_negative_float,
        default=None,
        help="fixed model: prefill time per token",
    )
    add(
        "--decode-ms-per-token",
        type=_non_negative_float,
        default=None,
        help="fixed model: time per decode step",
    )
    add("--num-instances", type=_positive_int, default=None)
    add("--max-num-seqs", type=_positive_int, default=None, help="continuous-batching slots per instance")
    add(
        "--kv-blocks",
        type=_positive_int,
        default=None,
        help="KV blocks per instance (default: from the roofline)",
    )
    add("--block-size", type=_positive_int, default=None)
    add("--routing-policy", choices=("round-robin", "least-loaded", "kv-aware"), default=None)
    add("--admission-latency", type=_non_negative_float, default=None, help="microseconds")
    add("--routing-latency", type=_non_negative_float, default=None, help="microseconds")
    add(
        "--rate", type=_positive_float, default=None, help="requests/s (one tenant, Poisson) when no scenario"
    )
    add("--num-requests", type=_positive_int, default=None)
    add("--horizon", type=_positive_float, default=None, help="stop at this virtual time (seconds)")
    add("--seed", type=int, default=None)
    add("--input-tokens", type=_positive_int, default=None)
    add("--output-tokens", type=_positive_int, default=None)
    add("--slo-class", default=None, help="SLO class of the flag-built tenant (default standard)")
    add("--admission-policy", choices=ADMISSION_CHOICES, default=None)
    add("--token-bucket-capacity", type=_non_negative_float, default=None)
    add("--token-bucket-refill-rate", type=_non_negative_float, default=None)
    add("--policy-config", metavar="FILE", help="BLIS policy bundle YAML (admission: ...)")
    add(
        "--token-pools",
        action="store_true",
        help="seed-000 token-pool admission (entitlements from the scenario)",
    )
    add("--flow-control", action="store_true")
    add("--dispatch-order", choices=("fifo", "priority", "slo-deadline"), default=None)
    add("--fairness-policy", choices=("global-strict", "round-robin"), default=None)
    add("--per-band-capacity", type=_non_negative_int, default=None)
    add("--max-gateway-queue-depth", type=_non_negative_int, default=None)
    add("--queue-shedding", action="store_true")
    add("--dispatch-tick-interval", type=_non_negative_float, default=None, help="microseconds")
    add("--slo-targets", type=_slo_targets, default=None, help="class=microseconds,...")
    add("--in-flight-eviction", action="store_true")
    add("--json", action="store_true", help="machine-readable summary on stdout")
    add("--plot", metavar="DIR", help="write Plotly HTML (and PNG when kaleido works) into DIR")
    add("--progress", choices=("auto", "on", "off"), default="auto", help="progress bar on stderr")
    return parser


def _flag_tenant(args: argparse.Namespace) -> TenantSpec:
    return TenantSpec(
        name="default",
        slo_class=args.slo_class or "standard",
        rate=args.rate or 10.0,
        input=LengthSpec("fixed", args.input_tokens or 512),
        output=LengthSpec("fixed", args.output_tokens or 128),
        entitlement={"service_class": "elastic"},
    )


def build_run(args: argparse.Namespace) -> tuple[Scenario, dict[str, Any]]:
    """The scenario (file or flags) with explicit flags applied, and the admission spec."""
    if args.scenario:
        scenario = load_scenario(args.scenario)
    else:
        scenario = Scenario("flags", SimConfig(tenants=[]))
        scenario.config.tenants = [_flag_tenant(args)]
        if args.num_requests is None and args.horizon is None:
            scenario.config.num_requests = 1000
    config = scenario.config
    if args.scenario and (args.rate or args.input_tokens or args.output_tokens or args.slo_class):
        # Fixed lengths and rate from flags apply to every tenant of the scenario.
        updated = []
        for tenant in config.tenants:
            changes: dict[str, Any] = {}
            if args.rate:
                changes["rate"] = args.rate
            if args.input_tokens:
                changes["input"] = LengthSpec("fixed", args.input_tokens)
            if args.output_tokens:
                changes["output"] = LengthSpec("fixed", args.output_tokens)
            if args.slo_class:
                changes["slo_class"] = args.slo_class
            updated.append(_replace_tenant(tenant, changes))
        config.tenants = updated
    simple = {
        "model": "model", "gpu": "gpu", "hardware_file": "hardware_file", "latency_model": "latency_model",
        "prefill_ms_per_token": "prefill_ms_per_token", "decode_ms_per_token": "decode_ms_per_token",
        "num_instances": "num_instances", "max_num_seqs": "max_num_seqs", "kv_blocks": "kv_blocks",
        "block_size": "block_size", "routing_policy": "routing", "num_requests": "num_requests",
        "horizon": "horizon_s", "seed": "seed",
    }  # fmt: skip
    for flag, attribute in simple.items():
        value = getattr(args, flag)
        if value is not None:
            setattr(config, attribute, value)
    if args.admission_latency is not None:
        config.admission_latency_s = args.admission_latency / 1e6
    if args.routing_latency is not None:
        config.routing_latency_s = args.routing_latency / 1e6
    for event in config.capacity_events:
        for index in event.instances:
            if index >= config.num_instances:
                raise ScenarioError(
                    f"capacity event at {event.at}s names instance {index}; --num-instances is {config.num_instances}"
                )

    admission: dict[str, Any] = dict(scenario.admission)
    if args.policy_config:
        bundle = read_yaml(args.policy_config, "policy config")
        section = bundle.get("admission", {})
        if not isinstance(section, dict):
            raise ScenarioError(f"policy config {args.policy_config}: admission must be a mapping")
        admission.update(section)
        if isinstance(bundle.get("flow_control"), dict):
            admission.setdefault("flow_control", {}).update(bundle["flow_control"])
    if args.admission_policy:
        admission["policy"] = args.admission_policy
    if args.token_bucket_capacity is not None:
        admission["token_bucket_capacity"] = args.token_bucket_capacity
    if args.token_bucket_refill_rate is not None:
        admission["token_bucket_refill_rate"] = args.token_bucket_refill_rate
    if args.token_pools:
        admission["policy"] = "token-pools"
    if args.slo_targets:
        admission["slo_targets"] = {k: v / 1e6 for k, v in args.slo_targets.items()}
    flow = dict(admission.get("flow_control") or {})
    if args.flow_control:
        flow["enabled"] = True
    for flag in ("dispatch_order", "fairness_policy", "per_band_capacity", "max_gateway_queue_depth",
                 "dispatch_tick_interval"):  # fmt: skip
        if getattr(args, flag) is not None:
            flow[flag] = getattr(args, flag)
    if args.queue_shedding:
        flow["queue_shedding"] = True
    if args.in_flight_eviction:
        flow["in_flight_eviction"] = True
    if flow:
        if not flow.get("enabled"):
            raise ScenarioError(
                "flow-control options need --flow-control (or flow_control.enabled in a file)"
            )
        admission["flow_control"] = flow
    if args.plot:
        config.sample_interval_s = config.sample_interval_s or 1.0
    return scenario, admission


def _replace_tenant(tenant: TenantSpec, changes: dict[str, Any]) -> TenantSpec:
    from dataclasses import replace

    return replace(tenant, **changes)


def format_text(summary: dict[str, Any]) -> str:
    lines = [
        f"admission: {summary['admission']}",
        f"num_requests={summary['num_requests']} injected_requests={summary['injected_requests']} "
        f"rejected_requests={summary['rejected_requests']} completed_requests={summary['completed_requests']}",
        f"conservation holds: {summary['conservation']['holds']}  breakdown: "
        f"{summary['conservation']['injected_breakdown']}",
        f"shed by tier: {summary['shed_by_tier']}  denials: {summary['denials_by_reason']}",
        f"simulated {summary['simulated_seconds']} s in {summary['wall_seconds']} s wall; "
        f"utilization {summary['utilization']}; Jain (output tokens) {summary['jain_index_output_tokens']}",
        f"{'tenant':<20} {'done':>7} {'rej':>6} {'ttft p50':>9} {'ttft p99':>9} {'e2e p50':>9} {'e2e p99':>9} "
        f"{'wait p99':>9} {'q-timeout':>9}",
    ]
    for name, tenant in summary["tenants"].items():

        def show(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        lines.append(
            f"{name:<20} {tenant['completed']:>7} {tenant['rejected']:>6} {show(tenant['ttft_p50_s']):>9} "
            f"{show(tenant['ttft_p99_s']):>9} {show(tenant['e2e_p50_s']):>9} {show(tenant['e2e_p99_s']):>9} "
            f"{show(tenant['queue_wait_p99_s']):>9} {tenant.get('queue_timeouts', 0):>9}"
        )
    return "\n".join(lines)


def run_simulation(scenario: Scenario, admission_spec: dict[str, Any], progress: str = "off") -> Simulation:
    from apps.simulator.factory import build_admission

    config = scenario.config
    adapter = build_admission(admission_spec, config)
    bar = None
    callback = None
    total = config.num_requests
    wants_bar = progress == "on" or (progress == "auto" and sys.stderr.isatty() and (total or 0) >= 100_000)
    if wants_bar:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="req", file=sys.stderr, desc="simulating", mininterval=0.5)
        callback = bar.update
    try:
        return Simulation(config, adapter, progress=callback).run()
    finally:
        if bar is not None:
            bar.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        scenario, admission = build_run(args)
        simulation = run_simulation(scenario, admission, args.progress)
    except UsageError as error:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except (ScenarioError, PolicyConfigError, HardwareConfigError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    summary = simulation.summary()
    if args.plot:
        from apps.simulator.report import write_plots

        written = write_plots(simulation, args.plot, title=scenario.name)
        summary["plots"] = written
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=False))
    else:
        print(format_text(summary))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
