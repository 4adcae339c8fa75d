"""SkyRL: ``skyrl.RecordingGenerator`` around SkyRL's own ``SkyRLGymGenerator`` on skyrl-gym's
``gsm8k_multi_turn`` environment, the line the README puts in ``BasePPOExp.get_generator``.
2 training steps x 2 samples of one prompt; each trajectory (turns, the environment's feedback,
per-turn rewards) becomes one episode. The inference engine is scripted (no vLLM here); the
tokenizer is built in-process.

    python examples/skyrl_generator.py        # then: trackio show --project otr-example-skyrl

Output: ``$TRACKIO_DIR`` (Trackio's default when unset), project ``OTEL_ROLLOUTS_TRACKIO_PROJECT``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import typing
from typing import Any

import _tiny
import typing_extensions

if sys.version_info < (3, 12):  # SkyRL's pydantic models need this TypedDict on Python 3.11
    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
from skyrl.train.config import GeneratorConfig, SkyRLGymConfig  # noqa: E402
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator  # noqa: E402
from skyrl.train.generators.utils import prepare_generator_input  # noqa: E402

import otel_rollouts as otr  # noqa: E402
from otel_rollouts.adapters import skyrl  # noqa: E402

PROJECT = os.environ.get("OTEL_ROLLOUTS_TRACKIO_PROJECT", "otr-example-skyrl")
SCRIPT = {"q0_0": ["I think 2 + 2 = 5. #### 5", "#### 4"], "q0_1": ["The answer is #### 4"]}


class ScriptedEngine:
    """Stands in for SkyRL's inference engine client: fixed answers per trajectory."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.calls: dict[str, int] = {}

    async def generate(self, engine_input: dict[str, Any], model: str | None = None) -> dict[str, Any]:
        session = engine_input["session_ids"][0]
        k = self.calls[session] = self.calls.get(session, -1) + 1
        text = SCRIPT[session][k] + self.tok.eos_token
        ids = self.tok.encode(text, add_special_tokens=False)
        return {"responses": [text], "response_ids": [ids], "stop_reasons": ["stop"], "response_logprobs": None}

    async def finish_session(self, session_id: str) -> None:
        return None


def main() -> None:
    otr.configure(service_name="example-skyrl", trackio_project=PROJECT)
    tok = _tiny.tokenizer()
    cfg = GeneratorConfig(max_turns=3, max_input_length=4096, n_samples_per_prompt=2)
    cfg.sampling_params.logprobs = None
    for step in (1, 2):
        inner = SkyRLGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), ScriptedEngine(tok), tok)
        generator = skyrl.RecordingGenerator(inner, tokenizer=tok)  # what get_generator returns
        prompts = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "env_class": "gsm8k_multi_turn",
                    "uid": "q0", "env_extras": {"reward_spec": {"ground_truth": "4"}}}]
        batch, _ = prepare_generator_input(prompts, 2, None, "gsm8k_multi_turn", "train", step)
        asyncio.run(generator.generate(batch, disable_tqdm=True))
        otr.end_step(step)
    otr.shutdown()
    print(f"kept episodes in Trackio project {PROJECT!r}: trackio show --project {PROJECT}")


if __name__ == "__main__":
    main()
