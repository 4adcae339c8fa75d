"""The ``otel-rollouts`` command line."""

from __future__ import annotations

import argparse
import os
import sys

from otel_rollouts import conventions as c


def _demo(args: argparse.Namespace) -> int:
    import otel_rollouts as otr
    from otel_rollouts.configuration import otlp_exporter_from_env
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
        sampler=otr.TailSampler(max_traces_per_step=args.cap, policy=args.policy),
        resource_attributes={c.OPENINFERENCE_PROJECT_NAME: args.project},
    )
    from otel_rollouts import demo

    stats = demo.run(steps=args.steps, prompts=args.prompts, group_size=args.group_size,
                     seed=args.seed, progress=not args.no_progress)
    run_name = trackio.run
    otr.shutdown()
    totals = stats["totals"]
    print()
    print(f"episodes: {totals.get('seen', 0)} seen, {totals.get('kept', 0)} kept "
          f"(cap {args.cap} per step, policy {args.policy}), "
          f"{sum(v for k, v in totals.items() if k.startswith('dropped.'))} dropped")
    trackio_dir = os.environ.get("TRACKIO_DIR") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "trackio")
    print(f"traces: Trackio project '{args.project}', run '{run_name}' in {trackio_dir}")
    if otlp:
        endpoint = os.environ.get(c.ENV_OTLP_TRACES_ENDPOINT) or os.environ.get(c.ENV_OTLP_ENDPOINT)
        print(f"traces: also sent over OTLP to {endpoint}")
    print("open the dashboard (Traces tab):")
    print(f"  trackio show --project {args.project}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="otel-rollouts", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a small traced multi-turn tool-using RL rollout loop")
    demo.add_argument("--project", default="otel-rollouts-demo", help="Trackio project")
    demo.add_argument("--run", default=None, help="Trackio run name (default: generated)")
    demo.add_argument("--steps", type=int, default=4)
    demo.add_argument("--prompts", type=int, default=8, help="prompts per step")
    demo.add_argument("--group-size", type=int, default=4, help="samples per prompt (GRPO group)")
    demo.add_argument("--cap", type=int, default=8, help="episodes kept per step")
    demo.add_argument("--policy", default="top_bottom", help="sampling policy")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--console", action="store_true", help="also print kept episodes as trees")
    demo.add_argument("--no-progress", action="store_true")
    demo.add_argument("--trace-ui-url", default=None,
                      help="e.g. http://localhost:16686 to link each Trackio trace to Jaeger")
    demo.set_defaults(func=_demo)
    from otel_rollouts import replay

    replay.add_arguments(sub.add_parser(
        "replay", help="send the traces of an OTLP/JSON-lines file to trackio, otlp or console",
    )).set_defaults(func=replay.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
