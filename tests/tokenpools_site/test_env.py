"""The strict environment readers behind the settings: what each accepts, and how it refuses the rest."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from tokenpools_site.env import env_bool, env_choice, env_float, env_int, env_list, env_names, env_str


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", "on", " On "])
def test_env_bool_true_words(raw: str) -> None:
    assert env_bool("FLAG", False, environ={"FLAG": raw}) is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "NO", "off"])
def test_env_bool_false_words(raw: str) -> None:
    assert env_bool("FLAG", True, environ={"FLAG": raw}) is False


@pytest.mark.parametrize("raw", ["maybe", "ture", "2", "y", "enabled"])
def test_env_bool_refuses_anything_else_naming_the_variable(raw: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=f"FLAG must be a boolean .*got '{raw}'"):
        env_bool("FLAG", False, environ={"FLAG": raw})


@pytest.mark.parametrize("environ", [{}, {"FLAG": ""}, {"FLAG": "   "}])
def test_unset_or_blank_takes_the_default(environ: dict[str, str]) -> None:
    assert env_bool("FLAG", True, environ=environ) is True
    assert env_int("FLAG", 7, environ=environ) == 7
    assert env_float("FLAG", 0.5, environ=environ) == 0.5
    assert env_str("FLAG", "x", environ=environ) == "x"
    assert env_choice("FLAG", "a", ("a", "b"), environ=environ) == "a"
    assert env_list("FLAG", ["d"], environ=environ) == ["d"]


def test_env_int_parses_whole_numbers_within_bounds() -> None:
    assert env_int("N", 0, environ={"N": " 1_048_576 "}) == 1_048_576
    assert env_int("N", 0, at_least=0, environ={"N": "0"}) == 0
    for raw, message in [("2.5", "a whole number"), ("abc", "a whole number"), ("-1", "at least 0"),
                         ("11", "at most 10")]:
        with pytest.raises(ImproperlyConfigured, match=f"N must be {message}, got '{raw}'"):
            env_int("N", 1, at_least=0, at_most=10, environ={"N": raw})
    with pytest.raises(ImproperlyConfigured, match="N must be above 0, got '0'"):
        env_int("N", 1, above=0, environ={"N": "0"})


def test_env_float_refuses_junk_non_finite_and_out_of_bounds() -> None:
    assert env_float("T", 1.0, above=0, environ={"T": "2.5e-1"}) == 0.25
    assert env_float("T", 1.0, at_least=0, environ={"T": "0"}) == 0.0
    for raw, message in [("abc", "a number"), ("inf", "a finite number"), ("nan", "a finite number"),
                         ("0", "above 0"), ("-3", "above 0")]:
        with pytest.raises(ImproperlyConfigured, match=f"T must be {message}, got '{raw}'"):
            env_float("T", 1.0, above=0, environ={"T": raw})
    with pytest.raises(ImproperlyConfigured, match="T must be at most 1, got '1.5'"):
        env_float("T", 0.5, at_least=0, at_most=1, environ={"T": "1.5"})


def test_env_choice_matches_without_case_and_returns_the_canonical_spelling() -> None:
    assert env_choice("LEVEL", "INFO", ("DEBUG", "INFO", "WARNING"), environ={"LEVEL": "warning"}) == "WARNING"
    with pytest.raises(ImproperlyConfigured, match="LEVEL must be one of DEBUG, INFO, WARNING, got 'loud'"):
        env_choice("LEVEL", "INFO", ("DEBUG", "INFO", "WARNING"), environ={"LEVEL": "loud"})


def test_env_list_and_env_names() -> None:
    assert env_list("HOSTS", [], environ={"HOSTS": " a, ,b ,c"}) == ["a", "b", "c"]
    environ = {"TOKENPOOLS_TICK_EWMA_S": "1", "TOKENPOOLS_TICKS": "off", "TOKENPOOLS_TICK_PERIODS": "x"}
    assert env_names(r"TOKENPOOLS_TICK_\w+_S", environ=environ) == ["TOKENPOOLS_TICK_EWMA_S"]
