"""Every script in ``examples/`` run as a user runs it, and what it exported read back.

Each example runs as its own process (``sys.executable``, a temporary working directory, its
Trackio directory and project given by ``TRACKIO_DIR`` / ``OTEL_ROLLOUTS_TRACKIO_PROJECT``, no
``OTEL_*`` setting inherited); the test then reads the Trackio project the way the viewer does
(the ``traces`` table) and checks the episodes: how many, which steps, the span tree, the ``rl.*``
values the framework's adapter derives, and no chat-template markup in the conversation. The
OTLP example sends to a real Phoenix on loopback (the receiver the OTLP tests use; Jaeger cannot
run here) and the spans are read back from Phoenix's REST API.

A framework example is skipped only when its framework is not installed (``.ci/run`` installs
them; with ``CI`` set a missing framework fails the test instead). Open-Instruct and torchforge
are not installable (see their README sections): their examples declare the framework's
structures and always run. ``test_every_example_is_run_here`` keeps a new example from skipping
CI; ``test_examples_use_only_the_public_api`` keeps them off private modules and test helpers.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from otr_helpers import trackio_rows
from receivers import PhoenixReceiver, in_ci

from otel_rollouts import conventions as c

pytestmark = pytest.mark.slow  # each case runs an example script in a fresh interpreter

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TESTS = Path(__file__).resolve().parents[1]
MARKUP = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
PUBLIC = ("otel_rollouts", "otel_rollouts.adapters", "otel_rollouts.exporters", "otel_rollouts.conventions",
          "otel_rollouts.sampling")


def example_files() -> list[Path]:
    """The runnable examples (``_*.py`` are their shared helpers, not examples)."""
    return sorted(p for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))


def require_installed(module: str | None) -> None:
    """Skip (fail under CI) when ``module`` cannot be found; found is enough: the example
    imports it in its own process, and a broken import fails the run there."""
    if module is None or importlib.util.find_spec(module) is not None:
        return
    message = f"{module} is not installed here; .ci/run installs it"
    if in_ci():
        pytest.fail(f"CI is set, refusing to skip: {message}", pytrace=False)
    pytest.skip(message)


def run_example(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                env: dict[str, str] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """Run ``examples/<name>.py``; its stdout and the rows of the Trackio project it wrote."""
    project = f"example-{name}-{uuid.uuid4().hex[:6]}"
    trackio_dir = tmp_path / "trackio"
    child = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    child.update(TRACKIO_DIR=str(trackio_dir), GRADIO_ANALYTICS_ENABLED="False", **(env or {}))
    child[c.ENV_TRACKIO_PROJECT] = project
    done = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], cwd=tmp_path, env=child,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert f"trackio show --project {project}" in done.stdout  # it says where to look
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    return done.stdout, trackio_rows(project)


def names(row: dict[str, Any]) -> list[str]:
    return [str(s.get("name")) for s in row["spans"]]


def check_rows(rows: list[dict[str, Any]], count: int, steps: set[int], framework: str | None) -> None:
    """What every example's episodes share: the count, the steps, one episode root per trace,
    the framework's name, and conversations free of template markup."""
    assert len(rows) == count, [r["metadata"].get(c.RL_EPISODE_ID) for r in rows]
    assert {r["step"] for r in rows} == steps
    for row in rows:
        md = row["metadata"]
        assert md[c.RL_STEP] == row["step"] and md[c.RL_SPLIT] == "train"
        assert names(row)[0] == c.SPAN_EPISODE and names(row).count(c.SPAN_EPISODE) == 1
        assert md.get(c.RL_SYSTEM_NAME) == framework
        assert isinstance(md[c.RL_REWARD], float)
        assert all(m["role"] in ("user", "assistant", "tool") for m in row["messages"])
        assert row["messages"][0]["role"] == "user"
        assert not any(mark in str(m.get("content")) for m in row["messages"] for mark in MARKUP), row["messages"]


def check_traced_loop(rows: list[dict[str, Any]]) -> None:
    check_rows(rows, 18, {0, 1, 2}, None)  # cap 6 of 8 per step
    for row in rows:
        assert names(row) == [c.SPAN_EPISODE, c.SPAN_PROMPT, c.SPAN_TURN, f"{c.SPAN_CHAT} tiny-policy",
                              f"{c.SPAN_EXECUTE_TOOL} calculator", c.SPAN_REWARD]
        assert row["metadata"][c.RL_REWARD_COMPONENT_PREFIX + "correct"] in (0.0, 1.0)
        tool = row["messages"][2]
        assert tool["role"] == "tool" and tool["content"] in ("4", "391")


def check_trl(rows: list[dict[str, Any]]) -> None:
    check_rows(rows, 8, {1, 2}, "trl")  # 2 steps x 2 prompts x 2 generations
    for row in rows:
        md = row["metadata"]
        assert md[c.RL_STALENESS] == 0 and isinstance(md[c.RL_ADVANTAGE], float)
        assert md[c.RL_REWARD] == md[c.RL_REWARD_COMPONENT_PREFIX + "length_reward"]
        assert row["messages"][0]["content"] in ("What is 2 + 2?", "What is 17 * 23?")


def check_verl(rows: list[dict[str, Any]]) -> None:
    check_rows(rows, 8, {1, 2}, "verl")
    for row in rows:
        md, answer = row["metadata"], row["messages"][1]["content"]
        assert md[c.RL_REWARD] == float(answer in ("The answer is 4.", "The answer is 391."))
        assert (md[c.RL_ADVANTAGE] > 0) == (md[c.RL_REWARD] == 1.0)  # verl's GRPO advantage
        assert md[c.RL_GROUP_ID] in ("q0", "q1")


def check_skyrl(rows: list[dict[str, Any]]) -> None:
    check_rows(rows, 4, {1, 2}, "skyrl")
    turns = sorted(r["metadata"][c.RL_TURN_COUNT] for r in rows)
    assert turns == [1, 1, 2, 2]
    two = next(r for r in rows if r["metadata"][c.RL_TURN_COUNT] == 2)
    assert names(two).count(c.SPAN_FEEDBACK) == 1  # gsm8k's retry prompt, a user message
    assert [m["role"] for m in two["messages"]] == ["user", "assistant", "user", "assistant"]


def check_areal(rows: list[dict[str, Any]]) -> None:
    check_rows(rows, 4, {1, 2}, "areal")
    for row in rows:
        assert row["metadata"][c.RL_REWARD] == 1.0 and row["metadata"][c.RL_STALENESS] == 0
        assert row["messages"][1]["content"] in ("The answer is 4.", "The answer is 391.")


def check_tinker(rows: list[dict[str, Any]]) -> None:
    check_rows(rows, 4, {0, 1}, "tinker-cookbook")
    assert sorted(r["metadata"][c.RL_REWARD_COMPONENT_PREFIX + "correct"] for r in rows) == [0.0, 0.0, 1.0, 1.0]


def check_open_instruct(rows: list[dict[str, Any]]) -> None:
    check_rows(rows, 8, {1, 2}, "open-instruct")
    for row in rows:
        md = row["metadata"]
        assert md[c.RL_ADVANTAGE] == pytest.approx(md[c.RL_REWARD] - 0.5)


def check_torchforge(rows: list[dict[str, Any]]) -> None:
    check_rows(rows, 4, {1, 2}, "torchforge")
    for row in rows:
        md = row["metadata"]
        assert md[c.RL_REWARD_COMPONENT_PREFIX + "MathReward"] in (0.0, 1.0) and isinstance(md[c.RL_ADVANTAGE], float)


def check_ray(rows: list[dict[str, Any]]) -> None:
    check_rows(rows, 8, {0, 1}, None)
    assert sorted(r["metadata"][c.RL_REWARD] for r in rows) == [0.0] * 4 + [1.0] * 4
    for row in rows:  # the actor's and the task's spans came back into the calling turn
        assert names(row) == [c.SPAN_EPISODE, c.SPAN_PROMPT, c.SPAN_TURN, f"{c.SPAN_EXECUTE_TOOL} step",
                              f"{c.SPAN_EXECUTE_TOOL} score", c.SPAN_REWARD]


CASES: dict[str, tuple[str | None, Callable[[list[dict[str, Any]]], None]]] = {
    "traced_loop": (None, check_traced_loop),
    "trl_grpo": ("trl", check_trl),
    "verl_batch": ("verl", check_verl),
    "skyrl_generator": ("skyrl", check_skyrl),
    "areal_workflow": ("areal", check_areal),
    "tinker_groups": ("tinker_cookbook", check_tinker),
    "open_instruct": (None, check_open_instruct),
    "torchforge_episodes": (None, check_torchforge),
    "ray_rollouts": ("ray", check_ray),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_exports_its_episodes_to_trackio(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    framework, check = CASES[name]
    require_installed(framework)
    _, rows = run_example(name, tmp_path, monkeypatch)
    check(rows)


def test_otlp_example_reaches_a_real_otlp_receiver(phoenix: PhoenixReceiver, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``otlp_jaeger.py`` with ``OTEL_EXPORTER_OTLP_ENDPOINT`` at Phoenix's OTLP/HTTP port: the
    8 episodes arrive as 8 traces (and in Trackio too)."""
    project = f"example-otlp-{uuid.uuid4().hex[:6]}"
    env = {c.ENV_OTLP_ENDPOINT: phoenix.base_url, c.ENV_OTLP_PROTOCOL: "http/protobuf",
           "OTEL_RESOURCE_ATTRIBUTES": f"{c.OPENINFERENCE_PROJECT_NAME}={project}"}
    stdout, rows = run_example("otlp_jaeger", tmp_path, monkeypatch, env)
    assert f"sent to {phoenix.base_url}" in stdout
    check_rows(rows, 8, {0, 1}, None)
    spans = phoenix.wait_for_spans(project, 8 * 6)  # episode, prompt, turn, chat, execute_tool, reward
    roots = [s for s in spans if s["parent_id"] is None]
    assert len(roots) == 8 and {s["name"] for s in roots} == {c.SPAN_EPISODE}
    assert sorted(r["attributes"][c.RL_STEP] for r in roots) == [0] * 4 + [1] * 4
    tools = [s for s in spans if s["name"] == f"{c.SPAN_EXECUTE_TOOL} calculator"]
    assert len(tools) == 8 and all(t["attributes"][c.GEN_AI_TOOL_NAME] == "calculator" for t in tools)
    assert {r["context"]["trace_id"] for r in roots} == {r["metadata"]["trace_id"] for r in rows}


def test_every_example_is_run_here() -> None:
    """A new example must get a case above, so CI runs it."""
    assert {p.stem for p in example_files()} == set(CASES) | {"otlp_jaeger"}
    readme = (EXAMPLES / "README.md").read_text()
    for path in example_files():
        assert f"{path.name}" in readme, f"examples/README.md does not list {path.name}"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_examples_use_only_the_public_api(path: Path) -> None:
    """Examples import ``otel_rollouts``, its adapters, exporters, conventions and sampling
    package, never a private module or a test helper; each is short and says how to run it."""
    tree = ast.parse(path.read_text())
    helpers = {p.stem for p in TESTS.glob("*.py")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        else:
            continue
        for module in modules:
            top = module.split(".")[0]
            assert top != "tests" and top not in helpers, f"{path.name} imports test helper {module}"
            if top == "otel_rollouts":
                assert module in PUBLIC or module.startswith(("otel_rollouts.adapters.", "otel_rollouts.exporters.")), \
                    f"{path.name} imports {module}"
                assert not any(part.startswith("_") for part in module.split(".")), f"{path.name} imports {module}"
    assert len(path.read_text().splitlines()) <= 100
    if not path.name.startswith("_"):
        doc = ast.get_docstring(tree) or ""
        assert f"python examples/{path.name}" in doc, f"{path.name}'s docstring does not say how to run it"
