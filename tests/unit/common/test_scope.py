"""common/scope.py: a key's model scope, the one matching rule and the internal
hop's field, strict: a field that fails its checks allows nothing."""
import json

import pytest

from common import scope


def test_matching_is_by_id_or_alias_case_sensitive_globs():
    assert scope.matches(("qwen-*",), ("qwen-35b", "qwen-moe"))
    assert scope.matches(("qwen-moe",), ("qwen-35b", "qwen-moe")), "an alias"
    assert not scope.matches(("Qwen-*",), ("qwen-35b",))
    assert not scope.matches(("smollm2",), ("qwen-35b", "qwen-moe"))
    assert scope.matches(("*",), ())


def test_the_field_round_trips_and_every_model_sends_none():
    assert scope.header_value(["*"]) is None
    assert scope.header_value(["qwen-*", "smol"]) == '["qwen-*","smol"]'
    assert scope.parse(scope.header_value(["qwen-*", "a,b", "ü"])) == ("qwen-*", "a,b", "ü")
    assert scope.parse(None) is None, "no field: every model (a box without keys)"


@pytest.mark.parametrize("bad", [
    "", "qwen-*", "{}", "[]", '"x"', "[1]", '[""]', '["a", null]', "[" * 5000,
    json.dumps(["m"] * (scope.MAX_ENTRIES + 1)), json.dumps(["m" * scope.MAX_FIELD]),
])
def test_a_field_that_fails_the_checks_allows_nothing(bad):
    assert scope.parse(bad) == ()
    assert not scope.matches(scope.parse(bad), ("anything",))
