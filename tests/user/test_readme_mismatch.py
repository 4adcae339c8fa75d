"""The docs' train–inference mismatch example, extracted from docs/mismatch.md and run verbatim in
a child process against the default local Trackio, then read back from Trackio's storage."""

from __future__ import annotations

import os
import subprocess
import sys

from docs_blocks import first_block
from otr_helpers import trackio_rows

from otel_rollouts import conventions as c


def mismatch_code() -> str:
    """The first ``python`` block of docs/mismatch.md."""
    return first_block("mismatch.md", "python")


def test_the_readme_example_keeps_the_diverging_sample_with_its_worst_token(tmp_path, monkeypatch):
    trackio_dir = tmp_path / "trackio"
    script = tmp_path / "mismatch.py"
    script.write_text(mismatch_code())
    env = {**os.environ, "TRACKIO_DIR": str(trackio_dir)}
    env.pop(c.ENV_OTLP_TRACES_ENDPOINT, None)
    done = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    rows = trackio_rows("otel-rollouts")
    assert {r["step"] for r in rows} == {0, 1}
    for step in (0, 1):
        kept = [r for r in rows if r["step"] == step]
        assert len(kept) == 4  # the cap
        diverging = [r for r in kept if r["metadata"].get(c.RL_SAMPLE_INDEX) == 5]
        assert len(diverging) == 1, [r["metadata"].get(c.RL_SAMPLE_INDEX) for r in kept]
        row = diverging[0]
        assert row["metadata"][c.RL_KEEP_REASON] == c.REASON_MISMATCH
        assert row["metadata"][c.RL_MISMATCH_ABS_MAX] > 2.9
        chat = [s for s in row["spans"] if s["name"].startswith("chat")]
        (attrs,) = [s["metadata"] for s in chat]
        assert attrs[c.RL_MISMATCH_WORST_POSITION][0] == 17
        assert attrs[c.RL_MISMATCH_WORST_TOKEN][0] == "tok17"
