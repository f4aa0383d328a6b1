"""Fuzzing the HTTP API from its own OpenAPI schema (schemathesis): no operation ever answers 5xx.

One `python app.py` (tiny model, real vLLM CPU engine; conftest.py's studio_small, shared with
test_inputs.py). Every operation of `/v1/openapi.json` (the /v1 API, /health, /metrics) gets up to
MAX_EXAMPLES generated requests valid by the schema and as many invalid ones (schemathesis' positive
and negative modes); no answer may be a server error.
Half of the speech bodies get a real saved voice, so random text, seeds, speeds, modes and
instructions reach the synthesis itself; those are bounded (fixed_tokens <= MAX_FUZZ_TOKENS, and the
server's sampling.max_len_ratio is low) so every request answers within seconds. The last test
prints the operations, examples and status codes seen (run with `-s` to read them).
"""

from __future__ import annotations

import collections
import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from studio import save_voice

MAX_EXAMPLES = 30
MAX_FUZZ_TOKENS = 50  # speech tokens (2 s of audio) at most per fuzzed synthesis
VOICE = "fuzz"
OPERATIONS = ["GET /health", "GET /metrics", "POST /v1/audio/speech", "GET /v1/voices", "POST /v1/voices",
              "GET /v1/voices/{voice_id}", "DELETE /v1/voices/{voice_id}", "GET /v1/models",
              "GET /v1/voices/{voice_id}/export", "POST /v1/voices/import"]
STATUS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # operation -> codes


@pytest.fixture(scope="module")
def server(studio_small):
    """conftest.py's studio_small: 1 MB uploads and a low sampling.max_len_ratio (shared with test_inputs.py)."""
    base, _ = studio_small
    save_voice(base, VOICE, "The quick brown fox jumps over the lazy dog.")
    return base


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server + "/v1/openapi.json")


@pytest.fixture(scope="module")
def session(server):
    import requests

    with requests.Session() as s:
        yield s


def _steer(case) -> None:
    """Half the speech bodies speak with the saved voice (random text reaches synthesis), bounded in length."""
    body = case.body
    if case.path != "/v1/audio/speech" or not isinstance(body, dict) or "voice" not in body:
        return
    if len(json.dumps(body, default=str)) % 2 == 0:
        body["voice"] = VOICE
        if isinstance(body.get("fixed_tokens"), int) and not isinstance(body["fixed_tokens"], bool):
            body["fixed_tokens"] = min(body["fixed_tokens"], MAX_FUZZ_TOKENS)


# schemathesis' own pytest plugin (`from_fixture`) does not run under pytest 9 here, so each
# operation x generation mode is a plain hypothesis test over the operation's case strategy
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("label", OPERATIONS)
def test_no_server_error(api_schema, server, session, label, mode):
    method, path = label.split(" ", 1)
    operation = api_schema[path][method.lower()]

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case) -> None:
        _steer(case)
        response = case.call(base_url=server, session=session, timeout=60)
        STATUS[label][response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error])

    try:
        fuzz()
    except Unsatisfiable:  # nothing to make invalid (an operation without parameters)
        assert mode is GenerationMode.NEGATIVE, label


def test_fuzz_covered_every_operation(server, api_schema):
    """Every operation of the schema was fuzzed, nothing answered 5xx, and the server still serves."""
    ops = {f"{method.upper()} {path}" for path, item in api_schema.raw_schema["paths"].items() for method in item}
    assert ops == set(OPERATIONS), "the API changed: update OPERATIONS"
    summary = {op: dict(sorted(STATUS.get(op, {}).items())) for op in sorted(ops)}
    print("\nfuzz:", json.dumps({"operations": len(ops), "examples": sum(sum(c.values()) for c in STATUS.values()),
                                 "status_codes": summary}, indent=1))
    assert all(summary[op] for op in ops), summary
    assert not [op for op, codes in summary.items() if any(code >= 500 for code in codes)], summary
    assert 200 in summary["POST /v1/audio/speech"]  # some random text was spoken
    r = httpx.post(server + "/v1/audio/speech", json={"model": "cosyvoice2", "input": "Still here.", "voice": VOICE},
                   timeout=60)
    assert r.status_code == 200 and len(r.content) > 44
    health = httpx.get(server + "/health", timeout=10).json()
    assert health["ready"] and health["lm_unfinished"] == 0
