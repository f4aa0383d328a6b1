"""Scale-out on Ray Serve (optional: requirements-ray.txt): `python -m app.cluster --replicas N`."""
