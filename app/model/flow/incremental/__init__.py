"""The incremental flow (the packed O(chunk) path): per-stream encoder and estimator state kept between hops, in paged
KV blocks, so a hop costs its own chunk; the re-solve in app/model/flow/flow.py is the base path it matches."""
