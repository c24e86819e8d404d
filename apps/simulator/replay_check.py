"""Does a replay tell the truth (issue 26)? A live arm's request log replayed under the entitlements it ran
under, per entitlement beside what the gateway recorded.

`manage.py replay --format json` runs against the arm's own site database with the arm's own settings (the
debt dimension a scenario's site needs prices alike on both sides), over every record the arm left (a fresh
database per arm: the warm-up requests included, on both sides). Agreement: per entitlement, the replay's
admitted within `ADMITTED_TOLERANCE` of the recorded and its refused within `REFUSED_TOLERANCE`, each plus an
absolute slack (`ADMITTED_SLACK`, `REFUSED_SLACK`) for the requests whose fate is a coin flip either side: one
that arrives within a few milliseconds of a slot freeing is admitted or refused on whichever happens first,
and live that order is the machine's (scheduling noise of a few ms on two shared cores), in the replay the
fitted per-token model's; a flipped open-loop request flips its retry too.

The entitlements are those the window ran under at each moment: a run whose operator creates an entitlement
partway (Experiment 1's guaranteed-c joining) and deletes it again is replayed with that entitlement created
and deleted at the audit log's times (`apps.simulator.lifetimes`), not with the set left after the run.
`run_arm(static_entitlements=True)` (`experiment --static-entitlements`) still runs such a scenario with every
entitlement in place throughout, for comparison.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from apps.simulator.live_site import REPO, manage

ADMITTED_TOLERANCE = 0.10
REFUSED_TOLERANCE = 0.25
ADMITTED_SLACK = 2
REFUSED_SLACK = 3


def site_env(workdir: Path, extra: dict[str, str] | None = None, database: str = "site.sqlite3") -> dict[str, str]:
    """The environment `manage.py` needs to read an arm's site database (`live_site.prepare_site`'s) with the
    arm's own settings (`extra`: the scenario's and the store's, as the arm's `serve` had them)."""
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{workdir / database}", "LOG_LEVEL": "WARNING", **(extra or {})}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


def replay_report(env: dict[str, str], *, since: str = "1d", until: str | None = None,
                  proposed: Path | None = None, repo: Path = REPO) -> dict[str, Any]:
    """`manage.py replay --format json` against the site `env` names."""
    args = ["replay", "--since", since, "--format", "json", "--progress", "off"]
    if until is not None:
        args += ["--until", until]
    if proposed is not None:
        args += ["-f", str(proposed)]
    return dict(json.loads(manage(env, *args, repo=repo)))


def _close(got: int, want: int, tolerance: float, slack: int) -> bool:
    return abs(got - want) <= tolerance * want + slack


def agreement(report: dict[str, Any], column: str = "current") -> dict[str, dict[str, Any]]:
    """Per entitlement: the recorded and replayed admitted / refused / p99 TTFT, and whether each count agrees."""
    out: dict[str, dict[str, Any]] = {}
    for name, row in report["entitlements"].items():
        recorded, replayed = row["recorded"], row.get(column)
        if replayed is None:  # the entitlement does not exist under that column: nothing replayed
            out[name] = {"recorded": recorded, "replayed": None, "admitted_ok": False, "refused_ok": False}
            continue
        out[name] = {
            "recorded": recorded, "replayed": replayed,
            "admitted_ok": _close(replayed["admitted"], recorded["admitted"], ADMITTED_TOLERANCE, ADMITTED_SLACK),
            "refused_ok": _close(replayed["rejected"], recorded["rejected"], REFUSED_TOLERANCE, REFUSED_SLACK),
        }
    return out


def agreement_table(rows: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'entitlement':<14} {'side':<9} {'admitted':>8} {'refused':>7} {'p50 ttft':>8} {'p99 ttft':>8}  "
             f"refused by reason"]
    for name, row in sorted(rows.items()):
        for side in ("recorded", "replayed"):
            figures = row[side]
            if figures is None:
                lines.append(f"{name:<14} {side:<9} (not replayed: no such entitlement)")
                continue
            verdict = ""
            if side == "replayed":
                verdict = (f"  admitted {'ok' if row['admitted_ok'] else 'NOT within 10%'},"
                           f" refused {'ok' if row['refused_ok'] else 'NOT within 25%'}")
            lines.append(f"{name:<14} {side:<9} {figures['admitted']:>8} {figures['rejected']:>7} "
                         f"{figures['p50_ttft_s'] or 0:>8.3f} {figures['p99_ttft_s'] or 0:>8.3f}  "
                         f"{figures['rejected_by_reason']}{verdict}")
    return "\n".join(lines)
