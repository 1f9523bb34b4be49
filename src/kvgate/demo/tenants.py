"""The fairness scenario's tenants as a real deployment identifies them: each signs its requests with a
token whose claims Envoy verifies and copies into the tenant and priority headers (envoy/envoy-jwt.yaml's
jwt_authn filter, set before the one-trip Envoy's own filters, with this run's keys). A client's own
`x-kvgate-tenant` is removed by Envoy, so the gate charges each request to the tenant its token names.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvgate.demo.capacity import node_capacity_tokens_per_s
from kvgate.demo.scenario import Scenario, long_shape
from kvgate.harness.jwt import Signer
from kvgate.harness.processes import checkout_path

JWT_ENVOY = "envoy/envoy-jwt.yaml"
ISSUER = "https://id.example.com"  # what envoy/envoy-jwt.yaml's provider accepts
AUDIENCE = "kvgate"
# Past the longest run: a token that expires mid-run would turn its tenant anonymous.
TOKEN_LIFETIME_S = 24 * 3600


@dataclass(frozen=True, slots=True)
class TenantIdentities:
    jwks: str
    tokens: Mapping[str, str]  # tenant name -> its bearer token


def identities(scenario: Scenario, work_dir: Path) -> TenantIdentities:
    """A key of this run's own and a token per tenant, carrying its name and priority."""
    signer = Signer.create(work_dir, kid="demo-tenants")
    tokens = {
        t.name: signer.token(
            ISSUER, TOKEN_LIFETIME_S, aud=AUDIENCE, tenant=t.name, kvgate_priority=t.priority
        )
        for t in scenario.tenants
    }
    return TenantIdentities(signer.jwks(), tokens)


def verifying(envoy_config: Path, jwks: str) -> None:
    """Put envoy/envoy-jwt.yaml's jwt_authn filter, with `jwks` as its keys, first in the rendered
    Envoy config's HTTP filters (where envoy-jwt.yaml has it)."""
    shipped = yaml.safe_load(checkout_path(JWT_ENVOY).read_text(encoding="utf-8"))
    (jwt,) = [f for f in _http_filters(shipped) if f["name"] == "envoy.filters.http.jwt_authn"]
    jwt = copy.deepcopy(jwt)
    jwt["typed_config"]["providers"]["kvgate"]["local_jwks"] = {"inline_string": jwks}
    config = yaml.safe_load(envoy_config.read_text(encoding="utf-8"))
    _http_filters(config).insert(0, jwt)
    envoy_config.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")


def _http_filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    listener = config["static_resources"]["listeners"][0]
    filters: list[dict[str, Any]] = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    return filters


def fair_request_rate(scenario: Scenario) -> float:
    """A sixth (one tenant's part) of the requests a second the baseline's nodes serve: the long
    requests they fit back to back at the tenants' typical size (kvgate.demo.capacity), plus the chat.
    What a team that caps tenants with Envoy's rate limit would give each, knowing only request counts."""
    prompt, output = long_shape(scenario)
    per_node = node_capacity_tokens_per_s(scenario.node, prompt, output) / (prompt + output)
    served = scenario.layout.baseline_nodes * per_node + scenario.short.rate_per_s
    return served / len(scenario.tenants)
