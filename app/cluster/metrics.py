"""The ingress's /health and /metrics: every replica's own answer, labelled, plus cluster totals.

Design notes: docs/cluster.md.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

PREFIX, CLUSTER_PREFIX = "cosyvoice_", "cosyvoice_cluster_"
NOT_SUMMED = frozenset({"cosyvoice_info"})  # a constant 1 with descriptive labels
STATES = ("ready", "not_ready", "unreachable")  # a replica's state in cosyvoice_cluster_replicas


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _line(name: str, labels: dict[str, str], value: float) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {floatToGoString(value)}" if inner else f"{name} {floatToGoString(value)}"


def _family(name: str, kind: str, doc: str, lines: list[str]) -> list[str]:
    if kind == "counter":  # the text format names a counter family by its samples' `_total` name
        name += "_total"
    return [f"# HELP {name} {_escape(doc)}", f"# TYPE {name} {kind}", *lines]


def merge_metrics(texts: dict[str, str], states: dict[str, str]) -> str:
    """One exposition from {replica id: its /metrics text}; `states` = {replica id: one of STATES}."""
    families: dict[str, dict[str, Any]] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            f = families.setdefault(fam.name, {"type": fam.type, "doc": fam.documentation, "samples": []})
            for s in fam.samples:
                f["samples"].append((s.name, {**s.labels, "replica": replica}, s.value))
    out: list[str] = []
    for name, f in families.items():
        out += _family(name, f["type"], f["doc"], [_line(n, labels, v) for n, labels, v in f["samples"]])
    for name, f in families.items():  # the sums
        if (not name.startswith(PREFIX) or name in NOT_SUMMED or name.endswith("_created")  # a start time
                or f["type"] not in ("counter", "gauge", "histogram")):
            continue
        sums: dict[tuple, float] = defaultdict(float)
        for sample_name, labels, value in f["samples"]:
            if sample_name.endswith("_created"):
                continue
            rest = tuple(sorted((k, v) for k, v in labels.items() if k != "replica"))
            sums[sample_name, rest] += value
        total = CLUSTER_PREFIX + name[len(PREFIX):]
        out += _family(total, f["type"], f"{f['doc']} Summed over replicas.",
                       [_line(CLUSTER_PREFIX + n[len(PREFIX):], dict(rest), v) for (n, rest), v in sums.items()])
    counts = {s: sum(1 for v in states.values() if v == s) for s in STATES}
    out += _family("cosyvoice_cluster_replicas", "gauge", "Replicas by state: ready (answering and ready to "
                   "synthesise), not_ready (answering, e.g. its engine restarting), unreachable (no answer).",
                   [_line("cosyvoice_cluster_replicas", {"state": s}, n) for s, n in counts.items()])
    return "\n".join(out) + "\n"


def _sum_numbers(items: list[Any]) -> Any:
    """Element-wise sum of equally shaped JSON values (numbers summed, dicts by key, anything else: the first)."""
    first = items[0]
    if isinstance(first, bool) or not isinstance(first, (int, float, dict)):
        return first
    if isinstance(first, dict):
        keys = {k for d in items if isinstance(d, dict) for k in d}
        return {k: _sum_numbers([d[k] for d in items if isinstance(d, dict) and k in d]) for k in sorted(keys)}
    return sum(x for x in items if isinstance(x, (int, float)) and not isinstance(x, bool))


SUMMED_HEALTH = ("active_streams", "http_waiting", "lm_unfinished", "requests", "faults")


def merge_health(answers: list[dict[str, Any] | BaseException]) -> dict[str, Any]:
    """GET /health of the cluster from `broadcast("call")`'s answers (an exception = a replica that did not
    answer): ready when at least one replica is; each replica's own body under "replicas"; totals."""
    replicas: list[dict[str, Any]] = []
    for a in answers:
        if isinstance(a, BaseException):
            replicas.append({"ready": False, "state": "unreachable", "status": f"no answer: {type(a).__name__}: {a}"})
            continue
        body = json.loads(a["body"])
        replicas.append({**a["replica"], "state": "ready" if body.get("ready") else "not_ready", **body})
    ready = [r for r in replicas if r["ready"]]
    answering = [r for r in replicas if r["state"] != "unreachable"]
    totals = {k: _sum_numbers([r[k] for r in answering if r.get(k) is not None])
              for k in SUMMED_HEALTH if any(r.get(k) is not None for r in answering)}
    return {"ready": bool(ready), "status": f"{len(ready)} of {len(replicas)} replicas ready",
            "replicas_ready": len(ready), **totals, "replicas": replicas}
