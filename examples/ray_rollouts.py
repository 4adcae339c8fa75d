"""Ray: rollout work in Ray tasks and actors joins the calling episode with ``@otr.ray_remote``
(in place of ``@ray.remote``). A local Ray cluster bound to 127.0.0.1 (dashboard off) runs an
environment actor and a scoring task; 2 steps x 4 episodes; each episode's tool spans come back
from the workers into its trace, and the kept episodes go to a local Trackio project.

    python examples/ray_rollouts.py           # then: trackio show --project otr-example-ray

Output: ``$TRACKIO_DIR`` (Trackio's default when unset), project ``OTEL_ROLLOUTS_TRACKIO_PROJECT``;
Ray's session files go to a temporary directory.
"""

from __future__ import annotations

import os
import secrets
import tempfile

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported: loopback only
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))  # else Ray writes one under $HOME
import ray  # noqa: E402

import otel_rollouts as otr  # noqa: E402

PROJECT = os.environ.get("OTEL_ROLLOUTS_TRACKIO_PROJECT", "otr-example-ray")


@otr.ray_remote(max_concurrency=4)
class CalculatorEnv:
    """An environment actor; its traced method's span lands under the calling turn."""

    @otr.traced(kind="tool")
    def step(self, expression: str) -> int:
        a, b = expression.split("+")
        return int(a) + int(b)


@otr.ray_remote
@otr.traced(kind="tool")
def score(answer: int, truth: int) -> float:
    """A verifier run as a Ray task."""
    return float(answer == truth)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="ray-") as ray_dir:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=ray_dir)
        otr.configure(service_name="example-ray", trackio_project=PROJECT)
        env = CalculatorEnv.remote()  # type: ignore[attr-defined]
        for step in range(2):
            for sample in range(4):
                expression = f"{sample}+2"
                with otr.episode(step=step, group_id="g0", sample_index=sample) as ep:
                    ep.prompt([{"role": "user", "content": f"What is {expression}?"}])
                    with ep.turn():
                        result = ray.get(env.step.remote(expression))
                        reward = ray.get(score.remote(result, sample + 2 if sample % 2 == 0 else -1))
                    ep.reward(reward)
            otr.end_step(step)  # adopts the finished calls' spans, then the sampler decides
        otr.shutdown()
        ray.shutdown()
    print(f"kept episodes in Trackio project {PROJECT!r}: trackio show --project {PROJECT}")


if __name__ == "__main__":
    main()
