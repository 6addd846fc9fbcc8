"""Operator commands of the `davit` console script: `operator`, `crds` and `cluster`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys

# The fetch Jobs run the operator's image (it carries `davit fetch`); kept here so `--help`
# needs no import of the operator's modules.
DEFAULT_FETCH_IMAGE = "ghcr.io/davit-dev/davit-operator:0.1.0"
OPERATOR_USAGE = "davit operator [--namespace NS ... | --all-namespaces] [flags]"


class _QuietTimerSuccess(logging.Filter):
    """Drops kopf's "Timer 'drift' succeeded." lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO and record.getMessage().startswith("Timer "))


def _operator_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="davit operator",
        usage=OPERATOR_USAGE,
        description="Run the InferenceService operator (kopf) against the current kubeconfig.",
    )
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        metavar="NS",
        help="serve InferenceServices in NS (repeatable; glob patterns allowed)",
    )
    scope.add_argument(
        "--all-namespaces", "-A", action="store_true", help="serve the whole cluster"
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, in-cluster)")
    parser.add_argument(
        "--metrics-port", type=int, default=8080, help="Prometheus /metrics port (0: off)"
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8081/healthz",
        metavar="URL",
        help="kopf liveness endpoint ('' to disable)",
    )
    parser.add_argument(
        "--drift-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how often each InferenceService is re-checked against its children and its "
        "status refreshed (reads the watch caches only; no API request when nothing changed)",
    )
    parser.add_argument(
        "--peering",
        metavar="NAME",
        default=None,
        help="enable kopf peering (one active operator per NAME); off by default",
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        metavar="N",
        help="peering priority: the live operator with the highest priority reconciles, the "
        "others stand by (default with --peering: a random priority, so replicas never tie)",
    )
    parser.add_argument(
        "--memory-profiling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="profile engine memory once per identity with a Job before replicas start, and "
        "give every replica the measured --kv-cache-memory-bytes",
    )
    parser.add_argument(
        "--model-config-url",
        default=None,
        metavar="URL",
        help="base URL of a model hub (or mirror) serving ORG/NAME/resolve/REVISION/config.json, "
        "for the pre-flight memory check of hf:// models the shape catalog lacks (off by default)",
    )
    parser.add_argument(
        "--model-cache",
        default=None,
        metavar="CLAIM|emptyDir",
        help="the ReadWriteMany PersistentVolumeClaim (in each service's namespace) that hf:// "
        "and s3:// models are fetched into when a spec names no model.cache; 'emptyDir' opts "
        "every such service out (each pod fetches on its own). Unset: specs must name one",
    )
    parser.add_argument(
        "--fetch-image",
        default=DEFAULT_FETCH_IMAGE,
        metavar="IMAGE",
        help="image of the model fetch Jobs (runs `davit fetch`; default: the operator's own)",
    )
    parser.add_argument(
        "--hf-endpoint",
        default=None,
        metavar="URL",
        help="hub (or mirror) base URL for hf:// models without model.endpoint",
    )
    parser.add_argument(
        "--s3-endpoint",
        default=None,
        metavar="URL",
        help="S3-compatible endpoint for s3:// models without model.endpoint",
    )
    parser.add_argument(
        "--fetch-max-bytes-per-second",
        type=int,
        default=None,
        metavar="N",
        help="bandwidth limit of each model fetch (default: none)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    return parser


def run_operator(argv: list[str]) -> int:
    """Parse flags, load the catalog (fail fast), register handlers and run kopf until
    interrupted."""
    args = _operator_parser().parse_args(argv)
    if args.drift_interval <= 0:
        print(
            f"davit operator: --drift-interval must be > 0 seconds, got {args.drift_interval}",
            file=sys.stderr,
        )
        return 2
    if args.kubeconfig:
        # kopf's login goes through the kubernetes client, which reads $KUBECONFIG when it is
        # imported: set it before the first import so both clients reach the same cluster.
        os.environ["KUBECONFIG"] = args.kubeconfig
    import kopf

    # kopf installs the log handler; the children's HTTP client logs every request at INFO.
    kopf.configure(verbose=args.verbose)
    logging.getLogger("httpx").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    if not args.verbose:
        # One line per object per drift interval says nothing; failures are still logged.
        logging.getLogger("kopf.objects").addFilter(_QuietTimerSuccess())

    from davit_operator.builders.fetch_job import FetchSettings
    from davit_operator.catalog.loader import CatalogError, default_catalog
    from davit_operator.handlers import OperatorOptions, register
    from davit_operator.metrics import serve_metrics

    try:
        catalog = default_catalog()
    except CatalogError as exc:
        print(f"davit operator: the catalog is invalid: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("davit_operator").info("catalog %s loaded", catalog.version)
    options = OperatorOptions(
        drift_interval=args.drift_interval,
        kubeconfig=args.kubeconfig,
        peering=args.peering,
        profile_memory=args.memory_profiling,
        model_config_url=args.model_config_url,
        model_cache=args.model_cache or None,
        fetch=FetchSettings(
            image=args.fetch_image,
            hf_endpoint=args.hf_endpoint,
            s3_endpoint=args.s3_endpoint,
            max_bytes_per_second=args.fetch_max_bytes_per_second,
        ),
    )
    registry = kopf.OperatorRegistry()
    register(registry, options)
    if args.metrics_port:
        serve_metrics(args.metrics_port)
    asyncio.run(
        kopf.operator(
            registry=registry,
            clusterwide=bool(args.all_namespaces),
            namespaces=args.namespace or (),
            standalone=args.peering is None,
            peering_name=args.peering,
            priority=peering_priority(args.peering, args.priority),
            liveness_endpoint=args.liveness or None,
        )
    )
    return 0


def peering_priority(peering: str | None, priority: int | None) -> int:
    """The kopf peering priority of this process.

    kopf freezes every operator when two live peers share a priority, so replicas started from
    one template must not all keep the default: each draws a random one and the highest
    reconciles while the others stand by, taking over when it stops.
    """
    if priority is not None:
        return priority
    if peering is None:
        return 0
    return random.SystemRandom().randint(1, 2**31 - 1)
