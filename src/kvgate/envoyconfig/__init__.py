"""The Envoy side of kvgate, rendered outside Helm: `kvgate envoy-config`.

`settings` derives what Envoy must know from the gate's own config (buffer limits, pool names) plus
the few facts only the operator knows (pool addresses, listener); `bootstrap` turns that into a
static Envoy bootstrap with envoy-data-plane's typed classes, with `identity` (who a request is from:
jwt_authn, ext_authz or client certificates, else the anonymous tenant) and `limits` (Envoy's own
bounds: timeouts, the gate cluster's circuit breakers, the overload manager). The Helm chart's
standalone bootstrap is the same document; a test keeps the two equal. Nothing here is on the
request path.
"""
