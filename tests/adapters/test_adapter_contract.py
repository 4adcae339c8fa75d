"""Every adapter entry point follows ``adapters.kit.AdapterEntryPoint``: the framework's
objects positionally, a keyword-only ``step``, ``split``/``model`` options, a count or trace
ids back, and never an exception into the training loop."""

from __future__ import annotations

import importlib
import inspect

import pytest

from otel_rollouts.adapters.kit import AdapterEntryPoint

ADAPTERS = ["areal", "open_instruct", "skyrl", "tinker", "torchforge", "verifiers", "verl"]


def entry_points():
    for name in ADAPTERS:
        module = importlib.import_module(f"otel_rollouts.adapters.{name}")
        for attr in module.__all__:
            if attr.startswith("record_"):
                yield f"{name}.{attr}", getattr(module, attr)


@pytest.mark.parametrize("name,fn", list(entry_points()), ids=lambda v: v if isinstance(v, str) else "")
def test_entry_points_follow_the_adapter_contract(name, fn, memory):
    assert isinstance(fn, AdapterEntryPoint)
    params = inspect.signature(fn).parameters
    step = params.get("step")
    assert step is not None and step.kind is inspect.Parameter.KEYWORD_ONLY, name
    assert step.default is inspect.Parameter.empty, name  # required: the sampler keys on it
    positional = [p for p in params.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional, name  # the framework's own objects come first
    assert "model" in params, name
    if "split" in params:
        assert params["split"].default == "train", name
    # garbage in: reported and contained, a count or trace ids (or the fallback) back
    args = [object()] * len([p for p in positional if p.default is inspect.Parameter.empty])
    kwargs = {p.name: None for p in params.values()
              if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty}
    kwargs["step"] = 0
    out = fn(*args, **kwargs)
    assert out is None or isinstance(out, int) or (
        isinstance(out, list) and all(isinstance(t, str) for t in out)), (name, out)
