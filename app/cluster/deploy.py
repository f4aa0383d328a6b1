"""The Ray Serve application: `build_app(cfg)` = the ingress bound to the replica deployment, options from `[cluster]`.

Design notes: docs/cluster.md.
"""

from __future__ import annotations

from typing import Any

from app.config import Config

APP_NAME = "studio"
INGRESS_MAX_ONGOING = 4096  # the ingress only relays; the replicas' limits are the real ones
REPLICA_SHUTDOWN_S = 60.0  # a replica being removed finishes its streams this long, then closes its engine


def replica_options(cfg: Config) -> dict[str, Any]:
    """`StudioReplica`'s Serve deployment options from `[cluster]` (and `[server]` for the request limit)."""
    c, s = cfg.cluster, cfg.server
    return {"name": "StudioReplica",
            "ray_actor_options": {"num_gpus": c.num_gpus, "num_cpus": c.num_cpus},
            "max_ongoing_requests": c.max_ongoing_requests or s.concurrency_limit + s.queue_max_size,
            "autoscaling_config": {"min_replicas": c.min_replicas, "max_replicas": c.max_replicas,
                                   "initial_replicas": c.min_replicas,
                                   "target_ongoing_requests": c.target_ongoing_requests,
                                   "upscale_delay_s": c.upscale_delay_s, "downscale_delay_s": c.downscale_delay_s},
            "graceful_shutdown_timeout_s": REPLICA_SHUTDOWN_S}


def build_app(cfg: Config) -> Any:
    """The `serve.Application` `python -m app.cluster` runs (route prefix "/")."""
    from ray import serve

    from app.cluster.ingress import ingress_class
    from app.cluster.replica import StudioReplica

    replica = serve.deployment(StudioReplica).options(**replica_options(cfg))
    ingress = serve.deployment(ingress_class(cfg)).options(
        name="StudioIngress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_MAX_ONGOING)
    return ingress.bind(replica.bind(cfg))
