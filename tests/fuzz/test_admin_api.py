"""Schemathesis against the controller's admin API, from its own OpenAPI document: every
operation, generated and mutated inputs (valid and invalid), bounded in examples; no answer may
be a 5xx or depart from the document (status codes, content types, bodies).

A real ``meridian-controller`` process with its admin port over a real etcd, with stand-in
regions in etcd so that region operations have something to act on.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi import checks as openapi_checks

from meridian_wire import keys
from meridian_wire.models import RegionStatus
from tests.faults.harness import wait_http
from tests.support import EtcdServer, start_etcd
from tests.support.ports import free_port
from tests.support.process import ServerProcess

pytestmark = pytest.mark.fuzz

TOKEN = "fuzz-admin-token"
REGIONS = ("eu-west", "eu-north")


def _toml(etcd: str, read_port: int, admin_port: int) -> str:
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    regions = "".join(
        f'[[regions]]\nid = "{r}"\ngeo = "eu"\nresidency = ["eu"]\n\n' for r in REGIONS
    )
    return f"""
[etcd]
endpoints = ["{etcd}"]
timeout_s = 1.0

[election]
id = "ctl-fuzz"
lease_ttl_s = 2

[failover]
window_s = 1.0
status_stale_s = 30.0
agent_heartbeat_s = 1.0

[server]
port = {read_port}

[api]
port = {admin_port}

[[api.tokens]]
name = "fuzzer"
role = "admin"
sha256 = "{digest}"

{regions}"""


@pytest.fixture(scope="module")
def admin_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("fuzz-admin")
    with start_etcd(work) as etcd:
        _seed(etcd)
        read_port, admin_port = free_port(), free_port()
        config = work / "controller.toml"
        config.write_text(_toml(etcd.url, read_port, admin_port))
        argv = [sys.executable, "-m", "controlplane.cli", "--config", str(config)]
        process = ServerProcess(argv, log_path=work / "controller.log")
        try:
            url = f"http://127.0.0.1:{admin_port}"
            wait_http(f"{url}/v1/health", what="the admin API", process=process)
            yield url
        finally:
            process.stop()
        print(Path(work / "controller.log").read_text()[-2000:])


def _seed(etcd: EtcdServer) -> None:
    """Stand-in agents' statuses, written once through etcd's JSON gateway."""
    import base64
    import time
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for region in REGIONS:
        status = RegionStatus(
            region=region, geo="eu", residency=["eu"], endpoints=[f"https://{region}.example"],
            nodes_healthy=2, nodes_total=2, capacity=2.0, updated_at=time.time(),
        )  # fmt: skip
        for key, value in (
            (keys.agent_status(region, "a1"), status.model_dump_json().encode()),
            (keys.agent_alive(region, "a1"), b""),
        ):
            body = json.dumps(
                {"key": base64.b64encode(key.encode()).decode(),
                 "value": base64.b64encode(value).decode()}
            ).encode()  # fmt: skip
            request = urllib.request.Request(f"{etcd.url}/v3/kv/put", data=body, method="POST")
            with opener.open(request, timeout=5) as r:
                assert r.status == 200


def test_no_input_makes_the_admin_api_fail_or_lie(admin_url: str) -> None:
    """Every operation of the document, each with generated cases (positive and negative:
    schemathesis mutates bodies, query strings and path parameters out of their schemas)."""
    api = schemathesis.openapi.from_url(f"{admin_url}/v1/openapi.json")
    api.config.base_url = admin_url
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 10  # the document lists every route
    checks = [
        schemathesis.checks.not_a_server_error,
        openapi_checks.status_code_conformance,
        openapi_checks.content_type_conformance,
        openapi_checks.response_schema_conformance,
    ]
    seen: Counter[str] = Counter()
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck),
                      database=None)  # fmt: skip
            def fuzz(case: schemathesis.Case) -> None:
                response = case.call(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
                seen[f"{response.status_code // 100}xx"] += 1
                case.validate_response(response, checks=checks)

            try:
                fuzz()
            except Unsatisfiable:  # nothing to negate (no parameters, no body): GET /v1/health
                assert mode is GenerationMode.NEGATIVE, operation.label
    print(f"admin API fuzzed: {sum(seen.values())} requests, {dict(seen)}")
    assert seen["4xx"] > 0 and seen["2xx"] > 0  # both kinds of input reached the server
