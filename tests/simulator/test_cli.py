"""The command line: BLIS flags, JSON summary with the conservation invariant, exit code 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apps.simulator.cli import main

SMALL = ["--num-instances", "2", "--rate", "200", "--num-requests", "300", "--latency-model", "fixed",
         "--input-tokens", "64", "--output-tokens", "16", "--json"]  # fmt: skip


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*SMALL, *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("policy", ["always-admit", "token-bucket", "tier-shed", "gaie-legacy", "reject-all"])
def test_every_blis_policy_conserves_requests(capsys, policy):
    summary = run_json(capsys, "--admission-policy", policy)
    assert summary["num_requests"] == 300
    assert summary["num_requests"] == summary["injected_requests"] + summary["rejected_requests"]
    assert summary["conservation"]["holds"]
    assert summary["completed_requests"] == summary["injected_requests"]  # the run drains
    assert sum(summary["shed_by_tier"].values()) == summary["rejected_requests"]


def test_reject_all_rejects_everything_and_always_admit_nothing(capsys):
    assert run_json(capsys, "--admission-policy", "reject-all")["rejected_requests"] == 300
    assert run_json(capsys, "--admission-policy", "always-admit")["rejected_requests"] == 0


def test_token_bucket_admits_the_burst_then_the_refill(capsys):
    # 64-token prompts: capacity 640 admits a burst of 10, then about 1 request per 64 tokens of refill.
    summary = run_json(capsys, "--admission-policy", "token-bucket", "--token-bucket-capacity", "640",
                       "--token-bucket-refill-rate", "640")  # fmt: skip
    simulated_arrivals_s = 300 / 200
    expected = 10 + 10 * simulated_arrivals_s
    assert abs(summary["injected_requests"] - expected) <= 3
    assert summary["denials_by_reason"] == {"insufficient tokens": summary["rejected_requests"]}


def test_tier_shed_from_a_policy_bundle_sheds_batch_only(capsys, tmp_path: Path):
    bundle = tmp_path / "policies.yaml"
    bundle.write_text(
        "admission:\n  policy: tier-shed\n  tier_shed_threshold: 0\n  tier_shed_min_priority: 3\n"
    )
    batch = run_json(capsys, "--policy-config", str(bundle), "--slo-class", "batch")
    assert batch["rejected_requests"] > 0 and set(batch["shed_by_tier"]) == {"batch"}
    critical = run_json(capsys, "--policy-config", str(bundle), "--slo-class", "critical")
    assert critical["rejected_requests"] == 0


def test_flow_control_queue_limit_rejects_and_conserves(capsys):
    summary = run_json(capsys, "--flow-control", "--max-gateway-queue-depth", "5", "--max-num-seqs", "4")
    assert summary["admission"] == "flow-control"
    assert summary["rejected_requests"] > 0
    assert summary["denials_by_reason"].keys() == {"queue_full"}
    assert summary["conservation"]["holds"]


def test_same_seed_same_summary_other_seed_differs(capsys):
    first = run_json(capsys, "--seed", "5")
    again = run_json(capsys, "--seed", "5")
    other = run_json(capsys, "--seed", "6")
    for summary in (first, again, other):
        summary.pop("wall_seconds")
    assert first == again
    assert first != other


def test_roofline_h200_decodes_faster_than_a10_l4(capsys):
    base = ["--latency-model", "roofline", "--model", "qwen/qwen3-8b"]
    h200 = run_json(capsys, *base, "--gpu", "h200")
    small = run_json(capsys, *base, "--gpu", "a10-l4")
    assert h200["e2e_p50_s"] < small["e2e_p50_s"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--num-instances", "0"], "--num-instances"),
        (["--rate", "-3"], "--rate"),
        (["--admission-policy", "sometimes"], "--admission-policy"),
        (["--scenario", "/no/such/file.yaml"], "/no/such/file.yaml"),
        (["--gpu", "tpu9", "--latency-model", "roofline"], "tpu9"),
        (["--dispatch-order", "priority"], "--flow-control"),
        (["--slo-targets", "critical"], "--slo-targets"),
    ],
)
def test_bad_flags_exit_2_with_a_message_naming_the_problem(capsys, argv, needle):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_bad_scenario_files_exit_2_naming_the_field(capsys, tmp_path: Path):
    cases = {
        "tenants: []\n": "tenants",
        "tenants:\n  - {name: a, rate: 1, input: -4}\n": "input",
        "tenants:\n  - {name: a}\n": "tenants[a]",
        "tenants:\n  - {name: a, rate: 1, stop: 5, colour: red}\n": "colour",
        "horizon_s: 10\ncluster: {num_instances: 1}\ncapacity_events: [{at: 1, remove: [3]}]\ntenants:\n"
        "  - {name: a, rate: 1}\n": "instance 3",
        "horizon_s: 10\ntenants: [{name: a, rate: 1}]\nadmission: {policy: token-pools, alpha_slo: -1}\n": "alpha_slo",
        "tenants: [\n": "not valid YAML",
    }
    for index, (text, needle) in enumerate(cases.items()):
        path = tmp_path / f"bad{index}.yaml"
        path.write_text(text)
        assert main(["--scenario", str(path)]) == 2, text
        assert needle in capsys.readouterr().err, text


def test_text_summary_and_plots(capsys, tmp_path: Path):
    out = tmp_path / "plots"
    assert main([*SMALL[:-1], "--plot", str(out)]) == 0
    text = capsys.readouterr().out
    assert "num_requests=300" in text and "conservation holds: True" in text
    assert (out / "timeline.html").exists()
