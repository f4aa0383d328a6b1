"""Scale-out on Ray Serve (optional: requirements-ray.txt): `python -m app.cluster --replicas N` serves the
studio page, /v1, /health and /metrics from one ingress in front of N engine replicas."""
