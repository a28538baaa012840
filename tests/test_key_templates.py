"""Key templates of ``@locked``: what looks like a placeholder but is not one is
refused when the decorator is applied, with a hint."""

from __future__ import annotations

import pytest

from django_syncguard import InvalidArgument, locked

HINT = "placeholders are written <name> or <name.attribute>"


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("invoice:{pk}", r"\{pk\} is not a placeholder; " + HINT + r" \(here <pk>\)"),
        ("invoice:{invoice.pk}", r"\{invoice.pk\} is not a placeholder"),
        ("invoice:<pk", "has an unbalanced or malformed '<'; " + HINT),
        ("invoice:pk>", "has an unbalanced or malformed '>'; " + HINT),
        ("invoice:<pk>>", "has an unbalanced or malformed '>'"),
        ("invoice:<>", "has an empty <>; " + HINT),
        ("invoice:< pk >", "has an unbalanced or malformed '<'"),
        ("invoice:<1pk>", "has an unbalanced or malformed '<'"),
    ],
)
def test_malformed_placeholders_are_refused_when_decorating(template, problem):
    with pytest.raises(InvalidArgument, match=problem):

        @locked(template)
        def pay(pk): ...


def test_a_malformed_template_is_refused_for_a_with_block_too():
    with pytest.raises(InvalidArgument, match="not a placeholder"):
        locked("invoice:{pk}")


@pytest.mark.parametrize(
    "template", ["invoice:<pk>", "a:<x>:<y.z>", "plain", "json:{}", "set:{1, 2}", "x:<a_1.b_2>"]
)
def test_well_formed_templates_are_accepted(template):
    @locked(template)
    def fn(pk=1, x=1, y=None, a_1=None): ...

    assert fn.__name__ == "fn"
