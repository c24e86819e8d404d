"""``python manage.py replay --since 1h [--until T] [--pool NAME] [-f proposed.yaml] [--format table|json]``:
what if (issue 26): replay a recorded window of the request log in the simulator under the current
entitlements and, with ``-f``, under a proposed manifest (validated and applied exactly as ``apply`` does, inside
a transaction that is rolled back: never persisted), per entitlement beside what really happened.

Exit codes: 0 replayed; 1 nothing recorded in the window; 2 bad input (a --since/--until that is not a time, a
proposed manifest ``apply`` would refuse: its errors name document, kind, name and field).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from apps.pools.manifests import ManifestError
from apps.pools.manifests.sources import SourceError, describe_issues, read_sources
from apps.simulator.replay_site import (
    COLUMNS,
    EmptyWindow,
    ReplayInputError,
    parse_window,
    read_records,
    whatif_report,
)
from apps.tenancy.services import SYSTEM

SERVICE_TIMES = ("Service times: a per-token latency model fitted to the pool's recorded TTFT and per-token times "
                 "(decode: the served records' median; prefill: what the fastest first tokens took beyond one "
                 "decode step), not each record's own times: those are what a request took under "
                 "the load it met, and a replay under another manifest changes that load; a request refused when "
                 "recorded has no times at all.")


class Command(BaseCommand):
    help = ("Replay a recorded window of the request log in the simulator under the current entitlements and, with "
            "-f, a proposed manifest (never applied), per entitlement beside what was recorded. " + SERVICE_TIMES)

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--since", required=True, help="window start: a duration before now (90s, 30m, 1h, 2d) "
                            "or an ISO 8601 time")
        parser.add_argument("--until", help="window end, as --since (default: now)")
        parser.add_argument("--pool", help="only this pool's records (default: every pool in the window)")
        parser.add_argument("-f", "--filename", action="append", help="a proposed manifest (file, directory or -), "
                            "as apply reads it; repeatable")
        parser.add_argument("--format", choices=("table", "json"), default="table")
        parser.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                            help="progress bar on stderr (auto: on a terminal, for 100,000 records or more)")

    def handle(self, *args: Any, **options: Any) -> None:
        from apps.gateway.selectors import request_log_oldest
        from apps.tenancy.models import Tenant

        try:
            since, until = parse_window(options["since"], options["until"], now=timezone.now())
        except ReplayInputError as exc:
            raise CommandError(str(exc), returncode=2) from exc
        documents, origins = None, None
        if options["filename"]:
            try:
                merged = read_sources(options["filename"])
            except SourceError as exc:
                raise CommandError("\n".join(exc.problems), returncode=2) from exc
            documents, origins = merged.documents, merged.origins
        records = read_records(user=SYSTEM, since=since, until=until, pool=options["pool"])
        bar = self._bar(len(records), options["progress"], 2 if documents is not None else 1)
        try:
            report = whatif_report(
                records=records, since=since, until=until, proposed_documents=documents, actor=SYSTEM,
                pool=options["pool"], progress=None if bar is None else bar.update,
                oldest=request_log_oldest(user=SYSTEM),
                tenant_slugs=dict(Tenant.objects.values_list("id", "slug")))
        except EmptyWindow as exc:
            raise CommandError(str(exc), returncode=1) from exc
        except ManifestError as exc:
            raise CommandError("the proposed manifest is not valid (nothing replayed):\n"
                               + "\n".join(describe_issues(exc.issues, origins or {})), returncode=2) from exc
        finally:
            if bar is not None:
                bar.close()
        report.pop("ttft_s", None)  # every request's TTFT: the REST endpoint's charts, not a terminal's
        if options["format"] == "json":
            self.stdout.write(json.dumps(report, indent=2))
        else:
            self.stdout.write(format_table(report))

    @staticmethod
    def _bar(records: int, mode: str, columns: int) -> Any:
        if mode == "off" or (mode == "auto" and not (sys.stderr.isatty() and records >= 100_000)):
            return None
        from tqdm import tqdm

        return tqdm(total=records * columns, unit="req", file=sys.stderr, desc="replaying", mininterval=0.5)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def format_table(report: dict[str, Any]) -> str:
    window = report["window"]
    lines = [f"window {window['since']} .. {window['until']}: {window['records']} records, pools "
             f"{', '.join(window['pools'])}; replayed {window['replayed_requests']} requests in "
             f"{window['wall_seconds']} s"]
    for pool, times in window["service_times"].items():
        lines.append(f"service times ({pool}): fitted from {times['fitted_from']} served records: prefill "
                     f"{times['prefill_ms_per_token']} ms/token, decode {times['decode_ms_per_token']} ms/token")
    header = (f"{'entitlement':<24} {'column':<9} {'offered':>8} {'admitted':>8} {'refused':>8} {'waited':>7} "
              f"{'p50 ttft':>9} {'p99 ttft':>9} {'throttle':>8} {'peak debt':>9}  refused by reason")
    lines += ["", header, "-" * len(header)]
    rows = [(name, row) for name, row in report["entitlements"].items()]
    rows += [(f"[pool {name}]", row) for name, row in report["pools"].items()]
    for name, row in rows:
        for column in COLUMNS:
            if column not in row:
                continue
            figures = row[column]
            label = name if column == "recorded" else ""
            if figures is None:
                lines.append(f"{label:<24} {column:<9} (does not exist)")
                continue
            reasons = ", ".join(f"{k}={v}" for k, v in figures["rejected_by_reason"].items())
            lines.append(
                f"{label:<24} {column:<9} {figures['offered']:>8} {figures['admitted']:>8} {figures['rejected']:>8} "
                f"{figures['waited']:>7} {_cell(figures['p50_ttft_s']):>9} {_cell(figures['p99_ttft_s']):>9} "
                f"{_cell(figures['throttle']):>8} {_cell(figures['peak_debt']):>9}  {reasons}")
    lines += ["", "peak debt is not recorded by the gateway ('-' under recorded); TTFT in seconds.", "caveats:"]
    lines += [f"  - {caveat}" for caveat in report["caveats"]]
    return "\n".join(lines)
