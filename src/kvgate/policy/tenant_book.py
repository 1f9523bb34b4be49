"""Each tenant's weight and caps, where its own entry in kvgate.yaml or its Envoy route sets them.

Pure. kvgate.yaml's `fairness.tenants.NAME` sets one tenant's weight, most share of KV and quota. An
Envoy route or virtual host may name a class of settings for the tenants whose requests it carries
(route key `tenant_class`, an entry of `fairness.classes`): every tenant behind a partner's virtual
host weighs 3, say, without kvgate.yaml naming each of them. Field by field, the tenant's own entry
wins, then the class of the route its latest long request came by, then `fairness.default_*`. The
tenant's own entry wins because it is the more specific: a route's class is a default for everyone
behind it.

A weight is the tenant's, not a request's: the fair order divides the service a tenant attained, on
every replica and over its whole history, by one weight. So a tenant that comes by two routes of two
classes takes the class of the route it came by last. The book remembers the class of at most
`max_tenants` tenants; past that, it forgets the ones it learnt of longest ago, which fall back to their
own entry and the defaults until their next request.
"""

from __future__ import annotations

from collections import OrderedDict

from kvgate.config import FairnessConfig, TokenQuotaConfig

MAX_TENANTS = 10_000


class TenantBook:
    def __init__(self, config: FairnessConfig, max_tenants: int = MAX_TENANTS) -> None:
        self._config = config
        self._max_tenants = max_tenants
        self._classes: OrderedDict[str, str] = OrderedDict()  # tenant -> its latest route's class

    def learn(self, tenant: str, tenant_class: str | None) -> None:
        """`tenant`'s request came by a route that names `tenant_class` (None: names none)."""
        if tenant_class is None or tenant_class not in self._config.classes:
            self._classes.pop(tenant, None)
            return
        self._classes[tenant] = tenant_class
        self._classes.move_to_end(tenant)
        while len(self._classes) > self._max_tenants:
            self._classes.popitem(last=False)

    def tenant_class(self, tenant: str) -> str | None:
        return self._classes.get(tenant)

    def weight(self, tenant: str) -> float:
        return self._config.weight(tenant, self._classes.get(tenant))

    def max_kv_share(self, tenant: str) -> float | None:
        return self._config.max_kv_share(tenant, self._classes.get(tenant))

    def quota(self, tenant: str) -> TokenQuotaConfig | None:
        return self._config.quota(tenant, self._classes.get(tenant))
