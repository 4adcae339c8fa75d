"""The tokens that disagree (issue 33) in a real Phoenix: a batch where a few samples are made to
diverge on purpose (``test_trackio_mismatch.batch``: real tokenizer, ``otr.record_token_batch``)
is kept by the ``mismatch`` policy part and sent over OTLP/HTTP; a kept episode's generation span
carries the ``rl.mismatch.*`` statistics and its worst tokens, and the filters the README gives
find the diverging episodes. Phoenix's span list runs the filter condition over GraphQL as its
filter box does.

What Phoenix's filter accepts for a span attribute (checked here): the bare dotted path
(``rl.mismatch.kl > 0.1``) or the nested subscript (``attributes['rl']['mismatch']['kl']``), and
the root's ``metadata['mismatch.kl']``. ``attributes['rl.mismatch.kl']`` is accepted but matches
nothing: Phoenix stores dotted attribute names nested.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from receivers import PhoenixReceiver
from test_phoenix_integration import _graphql
from test_trackio_mismatch import DIVERGING, batch, record
from tokenizer_fixture import build_tokenizer

import otel_rollouts as otr
from otel_rollouts import conventions as c

KEPT = 3  # the diverging samples, and the largest of the noise
_SPANS = """query($id: ID!, $filter: String) { node(id: $id) { ... on Project {
  spans(first: 100, filterCondition: $filter) { edges { node {
    name spanKind parentId context { traceId } attributes } } } } } }"""


def _spans(phoenix: PhoenixReceiver, gid: str, condition: str) -> list[dict[str, Any]]:
    """(name, kind, trace id, parent id, attributes as Phoenix nests them) of the matching spans."""
    data = _graphql(phoenix, _SPANS, id=gid, filter=condition)
    return [{"name": e["node"]["name"], "kind": e["node"]["spanKind"], "trace_id": e["node"]["context"]["traceId"],
             "parent_id": e["node"]["parentId"], "attributes": json.loads(e["node"]["attributes"])}
            for e in data["node"]["spans"]["edges"]]


def _get(attributes: dict[str, Any], name: str) -> Any:
    """An attribute by its OpenTelemetry name from Phoenix's nested form (``rl.mismatch.kl`` is
    ``{"rl": {"mismatch": {"kl": ...}}}``)."""
    value: Any = attributes
    for part in name.split("."):
        value = value[part]
    return value


def _meta(name: str) -> str:
    """A root attribute's key in the episode's ``metadata`` (``rl.`` dropped)."""
    return name.removeprefix("rl.")


@pytest.fixture(scope="module")
def recorded(phoenix: PhoenixReceiver) -> tuple[PhoenixReceiver, str, dict[str, Any], dict[int, str]]:
    """(Phoenix, its project's id, the batch, trace id by sample index of the kept episodes)."""
    project = f"otr-mismatch-{uuid.uuid4().hex[:8]}"
    tokenizer = build_tokenizer()
    otr.configure(service_name="otr-phoenix-mismatch",
                  exporters=[HttpSpanExporter(endpoint=phoenix.http_endpoint, timeout=10)],
                  sampler=otr.TailSampler(KEPT, "mismatch"),
                  resource_attributes={c.OPENINFERENCE_PROJECT_NAME: project})
    data = batch(tokenizer)
    try:
        record(tokenizer, 0, data)
        assert otr.flush(60)
    finally:
        otr.shutdown(60)
    phoenix.wait_for_spans(project, 5 * KEPT)  # episode, prompt, turn, chat, reward
    gid = phoenix.project_id(project)
    deadline = time.monotonic() + 60
    while len(roots := _spans(phoenix, gid, "parent_id is None")) < KEPT and time.monotonic() < deadline:
        time.sleep(0.5)
    traces = {_get(r["attributes"], c.RL_SAMPLE_INDEX): r["trace_id"] for r in roots}
    assert len(traces) == KEPT and set(DIVERGING) <= set(traces), traces
    return phoenix, gid, data, traces


def test_a_kept_generation_span_carries_its_worst_tokens_and_statistics(recorded) -> None:
    phoenix, gid, data, traces = recorded
    generations = {s["trace_id"]: s for s in _spans(phoenix, gid, "span_kind == 'LLM'")}
    assert set(generations) == set(traces.values())
    for sample in DIVERGING:
        attrs = generations[traces[sample]]["attributes"]
        expected = sorted(data["expected"][sample], key=lambda e: -abs(e[3] - e[2]))
        positions = _get(attrs, c.RL_MISMATCH_WORST_POSITION)
        tokens = _get(attrs, c.RL_MISMATCH_WORST_TOKEN)
        rollout = _get(attrs, c.RL_MISMATCH_WORST_ROLLOUT)
        trainer = _get(attrs, c.RL_MISMATCH_WORST_TRAINER)
        assert len(positions) == len(tokens) == len(rollout) == len(trainer) == len(data["responses"][sample])
        for i, (position, text, lp_rollout, lp_trainer) in enumerate(expected):  # largest |Δ| first
            assert (positions[i], tokens[i]) == (position, text)
            assert rollout[i] == pytest.approx(lp_rollout, abs=1e-6)
            assert trainer[i] == pytest.approx(lp_trainer, abs=1e-6)
        assert _get(attrs, c.RL_MISMATCH_TOKENS) == len(data["responses"][sample])
        assert _get(attrs, c.RL_MISMATCH_ABS_MAX) == pytest.approx(abs(expected[0][3] - expected[0][2]), abs=1e-4)
        assert _get(attrs, c.RL_MISMATCH_OUTSIDE) == len(expected)
        assert _get(attrs, c.RL_MISMATCH_KL) > 0.1
        for name in (c.RL_MISMATCH_ABS_MEAN, c.RL_MISMATCH_RATIO_MIN, c.RL_MISMATCH_RATIO_MAX, c.RL_MISMATCH_BAND):
            assert _get(attrs, name) is not None
        # the same tokens as a table a person reads on the span's Info tab (its metadata), worst first
        metadata = _get(attrs, c.OI_METADATA)  # Phoenix stores the JSON text parsed
        table = (json.loads(metadata) if isinstance(metadata, str) else metadata)["mismatch.worst"]
        assert len(table) == len(positions)
        for line, position, text, lp_rollout, lp_trainer in zip(table, positions, tokens, rollout, trainer,
                                                                 strict=True):
            assert line == (f"'{text}' at {position}: Δ {lp_trainer - lp_rollout:+.3f} "
                            f"(rollout {lp_rollout:.3f}, trainer {lp_trainer:.3f})")
    worst = _get(generations[traces[DIVERGING[-1]]]["attributes"], c.RL_MISMATCH_WORST_TOKEN)[0]
    assert worst == " retry"  # sample 5's worst token, its leading space kept (decoded alone)


def test_the_readme_filters_find_the_diverging_episodes(recorded) -> None:
    phoenix, gid, _, traces = recorded
    diverging = {traces[sample] for sample in DIVERGING}
    kl = c.RL_MISMATCH_KL
    # the episodes: by the root's metadata, or by the attribute's dotted path
    for condition in (f"metadata['{_meta(kl)}'] > 0.1", f"{kl} > 0.1 and parent_id is None",
                      f"metadata['{_meta(c.RL_MISMATCH_OUTSIDE)}'] > 0",
                      f"metadata['{_meta(c.RL_KEEP_REASON)}'] == '{c.REASON_MISMATCH}'"
                      f" and metadata['{_meta(c.RL_MISMATCH_ABS_MAX)}'] > 1"):
        found = _spans(phoenix, gid, condition)
        assert {s["trace_id"] for s in found} == diverging, condition
        assert all(s["parent_id"] is None for s in found), condition
    # their generations, where the worst tokens are
    found = _spans(phoenix, gid, f"span_kind == 'LLM' and {c.RL_MISMATCH_ABS_MAX} > 1")
    assert {s["trace_id"] for s in found} == diverging and {s["kind"] for s in found} == {"llm"}
    nested = "".join(f"['{part}']" for part in c.RL_MISMATCH_ABS_MAX.split("."))
    assert {s["trace_id"] for s in _spans(phoenix, gid, f"span_kind == 'LLM' and attributes{nested} > 1")} == diverging
    # the pitfall the README warns of: a dotted name as one key matches nothing (stored nested)
    assert _spans(phoenix, gid, f"attributes['{kl}'] > 0.1") == []
