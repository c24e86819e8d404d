"""`manage.py export --inference-objectives POOL` (issue 24): one InferenceObjective per service class for the
llm-d inference gateway in front of a pool, named as the gateway names them, with priorities in class order."""

from __future__ import annotations

import io
from typing import Any

import pytest
import yaml
from django.core.management import CommandError, call_command, execute_from_command_line

from tests.pools.factories import make_pool

pytestmark = pytest.mark.django_db

CLASSES = ["dedicated", "guaranteed", "elastic", "spot", "preemptible"]


def _export(*args: str) -> tuple[list[Any], str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("export", *args, stdout=out, stderr=err)
    return list(yaml.safe_load_all(out.getvalue())), err.getvalue()


def test_objectives_are_named_from_the_pool_map_or_the_default(admin: Any) -> None:
    make_pool(admin, "qwen-d", backend_kind="llm-d", inference_objectives={"guaranteed": "premium", "spot": "batch"})
    docs, err = _export("--inference-objectives", "qwen-d")
    assert err == ""
    assert [d["kind"] for d in docs] == ["InferenceObjective"] * 5
    assert {d["apiVersion"] for d in docs} == {"inference.networking.x-k8s.io/v1alpha2"}
    names = {d["metadata"]["labels"]["tokenpools.io/service-class"]: d["metadata"]["name"] for d in docs}
    assert names == {"dedicated": "tokenpools-dedicated", "guaranteed": "premium", "elastic": "tokenpools-elastic",
                     "spot": "batch", "preemptible": "tokenpools-preemptible"}
    assert {d["spec"]["poolRef"]["name"] for d in docs} == {"qwen-d"}
    assert {(d["spec"]["poolRef"]["group"], d["spec"]["poolRef"]["kind"]) for d in docs} == {
        ("inference.networking.k8s.io", "InferencePool")}


def test_priorities_follow_the_classes(admin: Any) -> None:
    make_pool(admin, "qwen-d", backend_kind="llm-d")
    docs, _ = _export("--inference-objectives", "qwen-d")
    priority = {d["metadata"]["labels"]["tokenpools.io/service-class"]: d["spec"]["priority"] for d in docs}
    assert [c for c in sorted(priority, key=priority.get, reverse=True)] == CLASSES  # dedicated highest
    assert priority["dedicated"] > priority["guaranteed"] > 0
    assert priority["elastic"] == 0
    assert 0 > priority["spot"] > priority["preemptible"]  # negative: llm-d may shed them


def test_inference_pool_and_namespace_options(admin: Any, tmp_path: Any) -> None:
    make_pool(admin, "qwen-d", backend_kind="llm-d")
    target = tmp_path / "objectives.yaml"
    call_command("export", "--inference-objectives", "qwen-d", "--inference-pool", "qwen3-pool",
                 "--namespace", "llm-d", "-o", str(target), stdout=io.StringIO())
    docs = list(yaml.safe_load_all(target.read_text()))
    assert {d["spec"]["poolRef"]["name"] for d in docs} == {"qwen3-pool"}
    assert {d["metadata"]["namespace"] for d in docs} == {"llm-d"}


def test_a_pool_that_is_not_llm_d_gets_them_with_a_note(admin: Any) -> None:
    make_pool(admin, "qwen-v")
    docs, err = _export("--inference-objectives", "qwen-v")
    assert len(docs) == 5 and "not 'llm-d'" in err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--inference-objectives", "nope"], "unknown pool 'nope'"),
        (["--inference-objectives", "qwen-d", "--inference-pool", "Bad_Name"], "not a Kubernetes object name"),
        (["--inference-objectives", "qwen-d", "--tenant", "acme"], "--tenant does not go with"),
        (["--inference-pool", "x"], "go with --inference-objectives"),
    ],
)
def test_bad_arguments_fail_with_a_message(admin: Any, args: list[str], words: str) -> None:
    make_pool(admin, "qwen-d", backend_kind="llm-d")
    with pytest.raises(CommandError, match=words.replace("'", ".")):
        call_command("export", *args, stdout=io.StringIO())


def test_unknown_pool_exits_non_zero(admin: Any, capsys: Any) -> None:
    # As from the shell: the command's error is printed and the process exits with a non-zero code.
    with pytest.raises(SystemExit) as exit_:
        execute_from_command_line(["manage.py", "export", "--inference-objectives", "nope"])
    assert exit_.value.code != 0
    assert "unknown pool 'nope'" in capsys.readouterr().err
