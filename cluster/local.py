"""Start (or reuse) a local Ray head with explicit resources, and run specserve on it.

Ray on a small machine needs explicit logical resources: the deployments ask for
fractional CPUs, and the default (one logical CPU per core) would leave two cores
unable to place them all. ``python -m specserve.cluster.local`` is the embedded default the
README's Quickstart runs: a Ray head on 127.0.0.1, the whole application on the default
model (or ``--model-dir``), the URLs printed, Ctrl-C to stop.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

LOCAL_HOST = "127.0.0.1"
DEFAULT_LOGICAL_CPUS = 8  # fractional deployments on a 2-core machine: logical, not physical


def start_local_ray(num_cpus: int = DEFAULT_LOGICAL_CPUS, dashboard: bool = False, quiet: bool = True,
                    metrics_report_interval_ms: int | None = None) -> dict:
    """Start a local Ray head in this process (127.0.0.1 only) unless one is running.

    ``metrics_report_interval_ms`` shortens how often workers report metrics (tests)."""
    import ray

    if ray.is_initialized():
        return {"dashboard_url": ""}
    if metrics_report_interval_ms is not None:  # read by the raylet and workers at start-up
        os.environ["RAY_metrics_report_interval_ms"] = str(metrics_report_interval_ms)
    context = ray.init(num_cpus=num_cpus, num_gpus=_visible_gpus(), include_dashboard=dashboard,
                       dashboard_host=LOCAL_HOST, logging_level=logging.WARNING if quiet else logging.INFO,
                       log_to_driver=not quiet, _node_ip_address=LOCAL_HOST)
    return {"dashboard_url": getattr(context, "dashboard_url", None) or ""}


def _visible_gpus() -> int:
    try:
        import onnxruntime

        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            return 0
        import subprocess

        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        return len([line for line in out.stdout.splitlines() if line.startswith("GPU")])
    except Exception:  # noqa: BLE001 - no driver, no GPUs
        return 0


def serve_local(args: dict, port: int = 8000, host: str = LOCAL_HOST, blocking: bool = False):
    """Deploy the application on the running Ray instance; returns the app handle."""
    from ray import serve

    from specserve.deployments.builder import build_app

    serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
    return serve.run(build_app(args), name="specserve", route_prefix="/", blocking=blocking)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run specserve on a local Ray head (127.0.0.1).")
    parser.add_argument("--model-dir", default=None, help="bundle to serve (default: the default model, "
                        "SmolLM2-135M-Instruct; models/fixture is the test fixture)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default=LOCAL_HOST, help="bind address; keep 127.0.0.1 unless you mean it")
    parser.add_argument("--default-mode", default="auto",
                        choices=["auto", "none", "prompt_lookup", "draft_model", "mtp", "eagle3", "shared_kv"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--modes", default=None,
                        help="comma-separated proposer modes to deploy (default: every one the bundle provides)")
    parser.add_argument("--num-cpus", type=int, default=DEFAULT_LOGICAL_CPUS)
    parser.add_argument("--no-dashboard", action="store_true")
    options = parser.parse_args(argv)
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    started = time.monotonic()
    info = start_local_ray(options.num_cpus, dashboard=not options.no_dashboard)
    speculative = {"default_mode": options.default_mode}
    if options.modes is not None:
        speculative["load"] = [m for m in options.modes.split(",") if m]
    args = {"model_dir": options.model_dir, "engine": {"device": options.device, "speculative": speculative}}
    from specserve.deployments.settings import ServeSettings
    from specserve.engine.model.bundle import Bundle

    model = Bundle.load(ServeSettings.model_validate(args).bundle_dir()).name
    serve_local(args, options.port, options.host)
    base = f"http://{options.host}:{options.port}"
    dashboard = info.get("dashboard_url") or ""
    print(f"\nspecserve is up after {time.monotonic() - started:.0f} s", flush=True)
    print(f"  OpenAI API:     {base}/v1   (model '{model}', default mode {options.default_mode})")
    if dashboard:
        print(f"  Ray dashboard:  {dashboard if dashboard.startswith('http') else 'http://' + dashboard}")
    print("  Try:\n"
          f"    curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
          "      -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], "
          "\"max_tokens\": 40, \"temperature\": 0}'\n"
          "  Ctrl-C stops it.", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    print("\nstopping specserve ...", flush=True)
    from ray import serve
    import ray

    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
