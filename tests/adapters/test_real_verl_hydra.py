"""The documented one-line plug-in goes through verl's own Hydra entry point.

``python -m verl.trainer.main_ppo`` is ``@hydra.main(config_path="config", config_name="ppo_trainer")``:
Hydra applies its command-line overrides to verl's yaml configs and refuses to override a key that
none of them has (``agent_loop_manager_class`` is only in verl's ``RolloutConfig`` dataclass) unless
it is written ``+key=value``. The tests that build verl's config with ``OmegaConf`` never see that;
here verl's real entry point runs in a subprocess with the override exactly as the docs show it
(``docs/adapters/verl.md``'s bash block, its ``$manager`` expanded as the shell would) and Hydra's
``--cfg job`` (compose the config, print it, and stop before ``main`` runs: no Ray, no model), and
the module docstring's line is the same override. verl's own lookup of the key
(``load_class_from_fqn``, as ``TaskRunnerV1.init_agent_loop_manager`` and
``RayPPOTrainer.init_workers`` do) then finds the recording manager.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from docs_blocks import page_blocks, page_text
from frameworks import require

KEY = "actor_rollout_ref.rollout.agent.agent_loop_manager_class"
PLUGIN = "otel_rollouts.adapters.verl_loop.AgentLoopManager"


def documented_override() -> str:
    """The override word of the docs' ``python -m verl.trainer.main_ppo`` command, with the
    block's shell variables expanded."""
    (code,) = [b.code for b in page_blocks("adapters/verl.md", "bash") if "verl.trainer.main_ppo" in b.code]
    variables = dict(re.findall(r"^(\w+)=(\S+)$", code, flags=re.M))
    command = code[code.index("python -m verl.trainer.main_ppo"):].replace("\\\n", " ")
    (word,) = [w for w in command.split() if KEY in w]
    return re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], word)


def test_the_docs_module_docstring_and_index_give_one_override():
    from otel_rollouts.adapters import verl_loop

    override = documented_override()
    assert override == f"+{KEY}={PLUGIN}"
    docstring = [line.strip() for line in (verl_loop.__doc__ or "").splitlines() if f"{KEY}=" in line]
    assert docstring == [override]
    (row,) = [line for line in page_text("adapters/index.md").splitlines() if KEY in line]  # the verl row
    assert f"+{KEY}=" in row and re.search(rf"(?<!\+){re.escape(KEY)}", row) is None


@pytest.mark.matrix
def test_verl_main_ppo_accepts_the_documented_override(tmp_path):
    require("verl")
    from omegaconf import OmegaConf
    from verl.utils.import_utils import load_class_from_fqn

    override = documented_override()
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "verl.trainer.main_ppo", override, "--cfg", "job", "--package",
         "actor_rollout_ref.rollout.agent"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout[done.stdout.index("# @package"):]
    agent = OmegaConf.create(printed)
    fqn = agent.get("agent_loop_manager_class")  # verl's lookup: rollout.get("agent", {}).get(...)
    assert fqn == PLUGIN
    manager = load_class_from_fqn(fqn, "AgentLoopManager")
    from otel_rollouts.adapters import verl_loop

    assert manager is verl_loop.AgentLoopManager
