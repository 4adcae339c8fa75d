"""Every ``python`` block of the documentation runs, so that the docs cannot drift from the code.

Each block of ``README.md`` and ``docs/**.md`` is one of:

* run here, as written, in a child process (a clean interpreter, exporters at a temporary
  Trackio directory, no OTLP endpoint from the environment), after a preamble that supplies what
  a fragment takes from its surroundings (``PREAMBLES``: a tokenizer built offline, a batch, a
  loopback OpenAI-compatible server, an open episode) and followed by ``otr.shutdown()``;
* marked ``<!-- run-by: tests/test_x.py -->`` on the line before its fence: another test runs it
  as written (and reads it from that page: checked here);
* marked ``<!-- not-run: <reason> -->``: it needs what no test machine has (a framework's trainer,
  a cluster, a collector, fixed ports). The test fails on a block that is neither run nor
  marked, and prints the marked ones.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from docs_blocks import ROOT, Block, page_blocks, pages

from otel_rollouts import conventions as c

TESTS = Path(__file__).resolve().parents[1]

# What a fragment takes from its surroundings, keyed by (page, the block's first line). A
# preamble holding "{body}" wraps the block: the block is indented into its place.
_OFFLINE_TOKENIZER = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from adapter_fixtures import tokenizer as _tokenizer, ids as _ids
tokenizer = _tokenizer()
"""

# a real HTTP server on loopback that answers every POST with a fixed-shape chat completion
_CHAT_SERVER = """
import json, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class _Chat(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = json.dumps({"id": "c1", "object": "chat.completion", "created": 0, "model": "policy",
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": "4"}}],
                           "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

_server = ThreadingHTTPServer(("127.0.0.1", 0), _Chat)
threading.Thread(target=_server.serve_forever, daemon=True).start()
vllm = f"http://127.0.0.1:{_server.server_address[1]}"
"""

PREAMBLES: dict[tuple[str, str], str] = {
    ("batches.md", "summary = otr.record_token_batch("): _OFFLINE_TOKENIZER + """
import torch
step = 0
rows = [_ids("user : what is 2 + 3 ?") + _ids("the answer is 5") + [tokenizer.eos_token_id],
        _ids("user : what is 2 + 4 ?") + _ids("let me think 6")]
width = max(map(len, rows))
prompt_len = len(_ids("user : what is 2 + 3 ?"))
batch = {
    "input_ids": torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows]),
    "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]),
    "loss_mask": torch.tensor([[0] * prompt_len + [1] * (len(r) - prompt_len) + [0] * (width - len(r))
                               for r in rows]),
    "rewards": torch.tensor([1.0, 0.0]),
    "versions": torch.tensor([[3] * width, [3] * width]),
}
group_ids = ["q0", "q0"]
""",
    ("batches.md", "def record(i, ep):  # called only for the samples the sampler may keep"): """
import numpy as np
step = 0
prompts = [[{"role": "user", "content": f"What is {i} + 2?"}] for i in range(8)]
completions = [f"It is {i + 2}." for i in range(8)]
rewards = np.array([1.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.25, 0.75])
prompt_ids = [f"q{i // 4}" for i in range(8)]
statuses = ["ok"] * 7 + ["error"]
finish_reasons = ["stop"] * 7 + ["length"]
advantages = rewards - rewards.mean()
""",
    ("concepts/tail-sampling.md", "otr.configure(hang=otr.HangOptions(after_s=300))   # a fixed threshold: 5 minutes"): "",
    ("correlate.md", 'with turn.generation("policy") as gen:'): _CHAT_SERVER + """
import openai
client = openai.OpenAI(base_url=vllm + "/v1", api_key="none", max_retries=0)
msgs = [{"role": "user", "content": "2+2?"}]
otr.configure()
with otr.episode(step=0) as ep, ep.turn() as turn:
{body}
""",
    ("correlate.md", "from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor"): _CHAT_SERVER + """
import httpx
otr.configure()
step, gid = 0, "q0"
body = {"model": "policy", "messages": [{"role": "user", "content": "2+2?"}]}
""",
    ("correlate.md", "fut = otr.submit(process_pool, score, completion)  # a ThreadPool / ProcessPool"): """
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

def score(text):
    return float(len(str(text)) % 2)

otr.configure()
completion, items = "It is 4.", ["a", "bb", "ccc"]
with ProcessPoolExecutor(2) as process_pool, multiprocessing.Pool(2) as pool, otr.episode(step=0) as ep:
{body}
    assert fut.result() == score(completion) and vals == [score(i) for i in items], (fut.result(), vals)
""",
    ("exporters.md", 'TrackioExporter("my-run", trace_ui_url="http://localhost:16686")  # Jaeger: /trace/<id>'):
        "from otel_rollouts.exporters import TrackioExporter\n",
    ("exporters.md", "from otel_rollouts.exporters import OtlpJsonFileExporter, TrackioExporter"): "",
}

EPILOGUE = "\nimport otel_rollouts as _otr\n_otr.shutdown()\n"


def _python_blocks() -> list[Block]:
    return [b for page in pages() for b in page_blocks(page, "python")]


def _to_run() -> list[Block]:
    return [b for b in _python_blocks() if b.marker is None]


def _script(block: Block) -> str:
    preamble = PREAMBLES.get((block.page, block.first_line), "")
    if "{body}" in preamble:
        return "import otel_rollouts as otr\n" + preamble.replace(
            "{body}", textwrap.indent(block.code, "    ")) + EPILOGUE
    return "import otel_rollouts as otr\n" + preamble + "\n" + block.code + EPILOGUE


def test_every_python_block_is_run_or_says_why_not() -> None:
    """No block is silently skipped: each is run here, run by a named test that reads its page,
    or marked not-run with a reason; and each preamble still belongs to a block that exists."""
    found = _python_blocks()
    assert len(found) >= 20, [str(b) for b in found]
    marked = [b for b in found if b.marker == "not-run"]
    print("\nnot run (reason):\n" + "\n".join(f"  {b}: {b.marker_text}" for b in marked))
    for b in marked:
        assert len(b.marker_text) > 20, f"{b}: say why the block is not run"
        for named in re.findall(r"tests/((?:\w+/)?test_\w+)(\*)?\.py", b.marker_text):
            assert list(TESTS.glob(f"{named[0]}{named[1]}.py")), f"{b}: names {named[0]} that does not exist"
    assert len(marked) <= 16, "keep the blocks that are not run few"
    for b in (b for b in found if b.marker == "run-by"):
        test_file = ROOT / b.marker_text
        assert test_file.is_file(), f"{b}: run-by names {b.marker_text}, which does not exist"
        assert Path(b.page).name in test_file.read_text(encoding="utf-8"), (
            f"{b}: {b.marker_text} does not read {b.page}")
    keys = {(b.page, b.first_line) for b in _to_run()}
    stale = [key for key in PREAMBLES if key not in keys]
    assert not stale, f"preambles for blocks that are gone or marked: {stale}"


@pytest.mark.parametrize("block", _to_run(), ids=str)
def test_python_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("OTEL_EXPORTER_OTLP", "OTEL_TRACES_EXPORTER", "OTEL_LOGS_EXPORTER",
                                  "OTEL_METRICS_EXPORTER", "OTEL_SDK_DISABLED"))}
    env.update({"TRACKIO_DIR": str(tmp_path / "trackio"), c.ENV_SPOOL_DIR: str(tmp_path / "spool"),
                "PYTHONDONTWRITEBYTECODE": "1"})
    script = tmp_path / "block.py"
    script.write_text(_script(block), encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{block} failed:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, f"{block}:\n{done.stderr[-3000:]}"
