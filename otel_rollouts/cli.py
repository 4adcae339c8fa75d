"""The ``otel-rollouts`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from otel_rollouts import conventions as c

DEBUG_ENV = "OTEL_ROLLOUTS_DEBUG"
EPILOG = f"""\
exit status: 0 ok; 1 failed (traces not delivered, an unexpected error);
  2 usage error (a bad option or value; an input file missing, a directory or unreadable)
environment:
  {DEBUG_ENV}=1  the full traceback of an unexpected error (otherwise one line)
  {c.ENV_OTLP_ENDPOINT}, ..._PROTOCOL, ..._TIMEOUT  where OTLP traces go"""


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake reported on one line of stderr (no usage block), exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("otel-rollouts")
    except PackageNotFoundError:
        import otel_rollouts

        return str(getattr(otel_rollouts, "__version__", "unknown (not installed)"))


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _policy(text: str) -> str:
    """A policy name, checked by building it (the names and '+' rules live in sampling)."""
    from otel_rollouts.sampling import make_policy

    try:
        make_policy(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


DEMO_POLICY = "errors+slowest+mismatch+top_bottom+degenerate_groups"


def _indices(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {text!r}")
    return text


def _demo(args: argparse.Namespace) -> int:
    import otel_rollouts as otr
    from otel_rollouts.delivery.defaults import otlp_exporter_from_env
    from otel_rollouts.delivery.layers import exporter_name
    from otel_rollouts.exporters import ConsoleExporter, TrackioExporter

    trackio = TrackioExporter(args.project, run=args.run, trace_ui_url=args.trace_ui_url)
    exporters: list = [trackio]
    otlp = bool(os.environ.get(c.ENV_OTLP_ENDPOINT) or os.environ.get(c.ENV_OTLP_TRACES_ENDPOINT))
    if otlp:
        exporters.append(otlp_exporter_from_env())
    if args.console:
        exporters.append(ConsoleExporter())
    otr.configure(
        service_name="otel-rollouts-demo",
        exporters=exporters,
        sampler=otr.TailSampler(max_traces_per_step=args.cap, policy=args.policy, watch=args.watch,
                                group_size=args.group_size),
        resource_attributes={c.OPENINFERENCE_PROJECT_NAME: args.project},
        # the demo's episodes take milliseconds: one open for 2 s is hanging
        hang=otr.HangOptions(floor_s=2.0),
    )
    from otel_rollouts import _demo as demo

    stats = demo.run(steps=args.steps, prompts=args.prompts, group_size=args.group_size,
                     seed=args.seed, progress=not args.no_progress, hang_s=args.hang_s,
                     hang_step=args.hang_step)
    otr.shutdown()
    # with render="process" the exporter that wrote (and named the run) lives in the renderer
    # process: what reached Trackio is read from the delivery ledger, which stays here
    delivered = otr.stats().get("delivery", {}).get(exporter_name(trackio), {}).get("delivered", 0)
    run_name = trackio.run
    totals = stats["totals"]
    print()
    watched = totals.get("kept.watch", 0)
    watch = (f"; {watched} for watched prompts {', '.join(map(str, args.watch))}, outside the cap"
             if args.watch else "")
    print(f"episodes: {totals.get('seen', 0)} seen, {totals.get('kept', 0)} kept "
          f"(cap {args.cap} per step, policy {args.policy}{watch}), "
          f"{totals.get('seen', 0) - totals.get('kept', 0)} dropped")  # by the sampler: seen = kept + dropped
    if run_name is None and not delivered:
        print(f"traces: none kept (cap {args.cap}), nothing written to Trackio")
        return 0
    trackio_dir = os.environ.get("TRACKIO_DIR") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "trackio")
    run = f"run '{run_name}'" if run_name is not None else "a run named by the renderer process"
    print(f"traces: Trackio project '{args.project}', {run} in {trackio_dir}")
    if otlp:
        endpoint = os.environ.get(c.ENV_OTLP_TRACES_ENDPOINT) or os.environ.get(c.ENV_OTLP_ENDPOINT)
        print(f"traces: also sent over OTLP to {endpoint}")
    print("open the dashboard (Traces tab):")
    print(f"  {_command('trackio')} show --project {args.project}")
    print("turn the kept episodes into a dataset (SFT chat rows; --format pairs or flat):")
    missing = _dataset_extra_missing()
    if missing:
        print(f"  first: {missing}")
    print(f"  {_command('otel-rollouts')} dataset --trackio {args.project} --out {args.project}-dataset")
    return 0


def _command(name: str) -> str:
    """How the user runs ``name`` from this shell: the bare name when it resolves to this
    interpreter's own script, else that script's path (e.g. ``.venv/bin/trackio`` from an
    environment that was not activated)."""
    import shutil
    import sysconfig

    script = os.path.join(sysconfig.get_path("scripts"), name)
    found = shutil.which(name)
    if not os.path.exists(script) or (found and os.path.realpath(found) == os.path.realpath(script)):
        return name
    relative = os.path.relpath(script)
    return relative if not relative.startswith(os.pardir) else script


def _dataset_extra_missing() -> str | None:
    """The install command for the ``[dataset]`` extra when it is missing (the dataset
    command needs pyarrow and datasets), else None."""
    import importlib.util

    if all(importlib.util.find_spec(m) is not None for m in ("pyarrow", "datasets")):
        return None
    target = "'otel-rollouts[dataset]'"
    try:
        import json
        from importlib.metadata import distribution

        direct = distribution("otel-rollouts").read_text("direct_url.json") or ""
        info = json.loads(direct) if direct else {}
        if info.get("dir_info", {}).get("editable") and info.get("url", "").startswith("file://"):
            source = os.path.relpath(info["url"][len("file://"):])
            target = f"-e '{source}[dataset]'"
    except Exception:  # noqa: BLE001 - a hint only: the plain form is right for a regular install
        pass
    return f"{_command(os.path.basename(sys.executable))} -m pip install {target}   (the [dataset] extra: pyarrow, datasets)"


def build_parser() -> argparse.ArgumentParser:
    from otel_rollouts.sampling.compose import POLICIES

    formatter = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="otel-rollouts", description=__doc__, epilog=EPILOG,
                     formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,replay,dataset}")
    demo = sub.add_parser("demo", help="run a small traced multi-turn tool-using RL rollout loop",
                          description="Run a small traced multi-turn tool-using RL rollout loop and log\n"
                          "the kept episodes to a local Trackio project (and OTLP when configured).",
                          epilog=EPILOG, formatter_class=formatter)
    demo.add_argument("--project", type=_non_empty, default="otel-rollouts-demo",
                      help="Trackio project (default: %(default)s)")
    demo.add_argument("--run", type=_non_empty, default=None,
                      help="Trackio run name (default: generated by Trackio)")
    at_least_1 = _int_at_least(1)
    demo.add_argument("--steps", type=at_least_1, default=4,
                      help="training steps, >= 1 (default: %(default)s)")
    demo.add_argument("--prompts", type=at_least_1, default=16,
                      help="prompts per step, >= 1 (default: %(default)s)")
    demo.add_argument("--group-size", type=at_least_1, default=4,
                      help="samples per prompt (GRPO group), >= 1 (default: %(default)s)")
    demo.add_argument("--cap", type=_int_at_least(0), default=20,
                      help="episodes kept per step, >= 0 (default: %(default)s)")
    demo.add_argument("--policy", type=_policy, default=DEMO_POLICY,
                      help=f"tail-sampling policy: one of {', '.join(sorted(POLICIES))}, or several "
                      "joined by '+', e.g. errors+top_bottom (default: %(default)s)")
    demo.add_argument("--watch", type=_indices, default="0,3,6",
                      help="dataset indices of prompts to follow across the run (kept every time, "
                      "outside the cap), comma-separated; '' for none (default: %(default)s)")
    demo.add_argument("--hang-s", type=_seconds, default=0.0,
                      help="one tool call of --hang-step hangs this long, then times out; watch it "
                      "as a running episode while it hangs (default: %(default)s, no hang)")
    demo.add_argument("--hang-step", type=_int_at_least(0), default=1,
                      help="the step whose tool call hangs (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    demo.add_argument("--console", action="store_true", help="also print kept episodes as trees")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--trace-ui-url", type=_url, default=None,
                      help="e.g. http://localhost:16686 to link each Trackio trace to Jaeger "
                      f"(default: ${c.ENV_TRACE_UI_URL}, else no link)")
    demo.set_defaults(func=_demo)
    from otel_rollouts.delivery import replay

    replay.add_arguments(sub.add_parser(
        "replay", help="send the traces of an OTLP/JSON-lines file to trackio, otlp or console",
        description="Send the traces of an OTLP/JSON-lines file (and its rotated backups) to\n"
        "trackio, otlp or console; report what was delivered and what failed.",
        epilog=EPILOG, formatter_class=formatter,
    )).set_defaults(func=replay.run)
    from otel_rollouts.delivery import dataset

    dataset.add_arguments(sub.add_parser(
        "dataset", help="turn kept episodes (OTLP/JSON files, spool, Trackio) into Parquet and a "
        "Hugging Face dataset",
        description="Turn a run's kept episodes into a dataset: one row per episode (messages,\n"
        "flat) or per kept group (pairs), from OTLP/JSON files, spool directories or a\n"
        "Trackio project; written as DIR/<format>.parquet and DIR/hf.",
        epilog=EPILOG, formatter_class=formatter,
    )).set_defaults(func=dataset.run)
    return parser


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = f"{parser.prog} {args.command}"
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback (unless debugging)
        if _debug():
            raise
        detail = " ".join(str(exc).split()) or "(no message)"
        print(f"{prog}: unexpected error: {type(exc).__name__}: {detail} "
              f"(set {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
