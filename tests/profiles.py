"""How hard the property tests look: hypothesis profiles ``ci`` (the default) and ``deep``.

``ci`` runs every property with a third of its examples, derandomized: the same
examples on every run, so a red CI is reproducible and a green one is not luck. ``deep`` runs
the full counts with fresh random examples each time, for a release or after touching what a
property guards::

    python -m pytest tests --hypothesis-profile=deep            # every property, full counts
    python -m pytest tests/delivery/test_render_bounds.py --hypothesis-profile=deep

A property's count is written once, as its ``deep`` count: ``@settings(max_examples=examples(300))``.
Properties that drive real processes or sockets per example (the ledger's) use the same rule.
"""

from __future__ import annotations

from hypothesis import settings

CI, DEEP = "ci", "deep"

settings.register_profile(CI, derandomize=True, deadline=None, print_blob=True)
settings.register_profile(DEEP, derandomize=False, deadline=None, print_blob=True)


def examples(deep: int) -> int:
    """``max_examples`` for a property: ``deep`` under the deep profile, else a third of it."""
    if settings.get_current_profile_name() == DEEP:
        return deep
    return max(1, deep // 3)
