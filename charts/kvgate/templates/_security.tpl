{{/*
Trust at Envoy's edge (docs/helm.md, "Identity and tenants"; docs/operations.md, "Security model"): the
headers a client may not send, the identity Envoy derives, and the bounds that keep Envoy deciding.
*/}}

{{/*
Identity headers a client may not choose: the tenant and priority (the gate's admission.priority_header)
Envoy sets after authentication, the tenant class a route sets for the queue (x-kvgate-tenant-class), and
the tenant names older set-ups read (the queue's x-tenant,
envoy/rate-limit.yaml's x-tenant-id). Removed early with the gate's own headers, as
kvgate.envoyconfig.identity.strip_client_headers does.
*/}}
{{- define "kvgate.identityHeaders" -}}
{{ include "kvgate.tenantHeader" . }},{{ include "kvgate.priorityHeader" . }},x-kvgate-tenant-class,x-tenant,x-tenant-id
{{- end -}}

{{/* Every header the early header mutation removes from client requests, in order. */}}
{{- define "kvgate.strippedHeaders" -}}
{{ include "kvgate.gateHeaders" . }},{{ include "kvgate.identityHeaders" . }}
{{- end -}}

{{- define "kvgate.tenantHeader" -}}x-kvgate-tenant{{- end -}}
{{- define "kvgate.priorityHeader" -}}
{{- dig "admission" "priority_header" "x-kvgate-priority" (.Values.gate.config | default dict) | lower -}}
{{- end -}}
{{- define "kvgate.anonymousTenant" -}}anonymous{{- end -}}

{{/*
Fails the render, naming the value, for identity settings the chart cannot wire, and for a queue that
would serve every client's data to every other (issue 27: the queue's API is open without identity).
*/}}
{{- define "kvgate.auth.check" -}}
{{- $auth := .Values.auth -}}
{{- $mode := .Values.envoy.mode -}}
{{- if eq $auth.method "jwt" -}}
{{- $jwks := $auth.jwt.jwks -}}
{{- if eq (empty $jwks.remoteUri) (empty $jwks.inline) -}}
{{- fail "auth.method jwt needs exactly one of auth.jwt.jwks.remoteUri and auth.jwt.jwks.inline: the keys Envoy checks each token's signature with" -}}
{{- end -}}
{{- $_ := required "auth.jwt.issuer is required with auth.method jwt: a token from any other issuer is refused" $auth.jwt.issuer -}}
{{- else if eq $auth.method "extAuthz" -}}
{{- if eq $mode "istio" -}}
{{- $_ := required "auth.extAuthz.istioProvider is required with auth.method extAuthz and envoy.mode istio: the name of the extensionProvider in your mesh config" $auth.extAuthz.istioProvider -}}
{{- else if ne $mode "none" -}}
{{- $_ := required (printf "auth.extAuthz.address is required with auth.method extAuthz and envoy.mode %s: the authorization service Envoy asks" $mode) $auth.extAuthz.address -}}
{{- end -}}
{{- else if eq $auth.method "mtls" -}}
{{- if eq $mode "standalone" -}}
{{- $_ := required "auth.mtls.secretName is required with auth.method mtls and envoy.mode standalone: Envoy's serving certificate (tls.crt, tls.key)" $auth.mtls.secretName -}}
{{- $_ := required "auth.mtls.clientCaSecretName is required with auth.method mtls and envoy.mode standalone: the Secret whose ca.crt signs the clients' certificates" $auth.mtls.clientCaSecretName -}}
{{- else if eq $mode "envoy-gateway" -}}
{{- $_ := required "auth.mtls.clientCaSecretName is required with auth.method mtls and envoy.mode envoy-gateway: the Secret (in the Gateway's namespace) whose ca.crt signs the clients' certificates" $auth.mtls.clientCaSecretName -}}
{{- end -}}
{{- end -}}
{{- if and .Values.queue.enabled (eq $auth.method "none") (not .Values.queue.unauthenticated) -}}
{{- fail "queue.enabled needs an authentication method (auth.method jwt, extAuthz or mtls): without one every client is the tenant anonymous and can list, download and delete the others' files, batches and jobs. Set queue.unauthenticated=true to run the queue open anyway" -}}
{{- end -}}
{{- end -}}

{{/*
The request headers the standalone and Istio Envoy set once authentication has run (an HTTP
header_mutation filter: envoy.extensions.filters.http.header_mutation.v3.HeaderMutation). With mTLS the
tenant is the client certificate's URI SAN; then any request still without a tenant is `anonymous`. A value
that formats empty (no URI SAN) is not added (source/common/http/header_mutation.cc, AppendMutation,
envoyproxy/envoy v1.40.0).
*/}}
{{- define "kvgate.identityFilter" -}}
name: envoy.filters.http.header_mutation
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation
  mutations:
    request_mutations:
      {{- if eq .Values.auth.method "mtls" }}
      - append:
          header:
            key: {{ include "kvgate.tenantHeader" . }}
            value: "%DOWNSTREAM_PEER_URI_SAN%"
          append_action: OVERWRITE_IF_EXISTS_OR_ADD
      {{- end }}
      - append:
          header:
            key: {{ include "kvgate.tenantHeader" . }}
            value: {{ include "kvgate.anonymousTenant" . }}
          append_action: ADD_IF_ABSENT
{{- end -}}

{{/* jwt: the claims copied into the gate's headers, in jwt_authn's claim_to_headers form. */}}
{{- define "kvgate.jwt.claimHeaders" -}}
- header_name: {{ include "kvgate.tenantHeader" . }}
  claim_name: {{ .Values.auth.jwt.tenantClaim }}
- header_name: {{ include "kvgate.priorityHeader" . }}
  claim_name: {{ .Values.auth.jwt.priorityClaim }}
{{- end -}}

{{/* The JWKS host of auth.jwt.jwks.remoteUri: (dict "host" "port" "scheme"). */}}
{{- define "kvgate.jwt.remote" -}}
{{- $url := urlParse .Values.auth.jwt.jwks.remoteUri -}}
{{- $parts := splitList ":" $url.host -}}
{{- $port := ternary 443 80 (eq $url.scheme "https") -}}
{{- if gt (len $parts) 1 -}}
{{- $port = int (index $parts 1) -}}
{{- end -}}
{{- toJson (dict "host" (first $parts) "port" $port "scheme" $url.scheme) -}}
{{- end -}}

{{/*
The standalone Envoy's authentication filter, before the identity filter and ext_proc (so neither the
gate nor the decompressor works for a request that is refused): jwt_authn
(envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication) or ext_authz
(envoy.extensions.filters.http.ext_authz.v3.ExtAuthz). Renders nothing for none and mtls (the listener's
TLS context checks client certificates).
*/}}
{{- define "kvgate.auth.standaloneFilter" -}}
{{- $auth := .Values.auth -}}
{{- if eq $auth.method "jwt" }}
{{- $jwt := $auth.jwt }}
- name: envoy.filters.http.jwt_authn
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication
    providers:
      kvgate:
        issuer: {{ $jwt.issuer | quote }}
        {{- with $jwt.audiences }}
        audiences:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        {{- if $jwt.jwks.remoteUri }}
        remote_jwks:
          http_uri:
            uri: {{ $jwt.jwks.remoteUri | quote }}
            cluster: kvgate_jwks
            timeout: 5s
          cache_duration: {{ printf "%ds" (int $jwt.jwks.cacheSeconds) }}
        {{- else }}
        local_jwks:
          inline_string: {{ $jwt.jwks.inline | quote }}
        {{- end }}
        forward: {{ $jwt.forwardToken }}
        # Set after the early header mutation removed any client copy of them.
        claim_to_headers:
          {{- include "kvgate.jwt.claimHeaders" . | nindent 10 }}
    rules:
      - match:
          prefix: /
        requires:
          {{- if $jwt.allowMissing }}
          # A missing token passes (the tenant anonymous); a bad one is refused.
          requires_any:
            requirements:
              - provider_name: kvgate
              - allow_missing: {}
          {{- else }}
          provider_name: kvgate
          {{- end }}
{{- else if eq $auth.method "extAuthz" }}
{{- $authz := $auth.extAuthz }}
- name: envoy.filters.http.ext_authz
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz
    transport_api_version: V3
    # An unreachable authorization service refuses requests (503) rather than admitting them unchecked.
    failure_mode_allow: false
    status_on_error:
      code: ServiceUnavailable
    {{- if eq $authz.protocol "grpc" }}
    grpc_service:
      envoy_grpc:
        cluster_name: kvgate_authz
      timeout: {{ printf "%.3fs" (divf (int $authz.timeoutMs) 1000.0) }}
    # The service may set only these request headers (mutation_rules.proto: allow_expression overrides
    # everything but disallow_expression).
    decoder_header_mutation_rules:
      disallow_all: true
      allow_expression:
        regex: {{ printf "^(%s)$" (join "|" $authz.headers) | quote }}
    {{- else }}
    http_service:
      server_uri:
        uri: {{ printf "http://%s:%d" $authz.address (int $authz.port) | quote }}
        cluster: kvgate_authz
        timeout: {{ printf "%.3fs" (divf (int $authz.timeoutMs) 1000.0) }}
      authorization_response:
        allowed_upstream_headers:
          patterns:
            {{- range $authz.headers }}
            - exact: {{ . }}
            {{- end }}
    {{- end }}
{{- end }}
{{- end -}}

{{/* The clusters the standalone Envoy's authentication filter calls. */}}
{{- define "kvgate.auth.standaloneClusters" -}}
{{- $auth := .Values.auth -}}
{{- if and (eq $auth.method "jwt") $auth.jwt.jwks.remoteUri }}
{{- $remote := include "kvgate.jwt.remote" . | fromJson }}
# The JWKS host, over TLS checked against the image's CA bundle: a forged key set would let anyone in.
- name: kvgate_jwks
  type: STRICT_DNS
  connect_timeout: 2s
  load_assignment:
    cluster_name: kvgate_jwks
    endpoints:
      - lb_endpoints:
          - endpoint:
              address:
                socket_address:
                  address: {{ $remote.host }}
                  port_value: {{ int $remote.port }}
  {{- if eq $remote.scheme "https" }}
  transport_socket:
    name: envoy.transport_sockets.tls
    typed_config:
      "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
      sni: {{ $remote.host }}
      common_tls_context:
        validation_context:
          trusted_ca:
            filename: {{ $auth.jwt.jwks.caFile }}
          match_typed_subject_alt_names:
            - san_type: DNS
              matcher:
                exact: {{ $remote.host }}
  {{- end }}
{{- else if eq $auth.method "extAuthz" }}
- name: kvgate_authz
  type: STRICT_DNS
  connect_timeout: 1s
  per_connection_buffer_limit_bytes: 1048576
  {{- if eq $auth.extAuthz.protocol "grpc" }}
  typed_extension_protocol_options:
    envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
      "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
      explicit_http_config:
        http2_protocol_options: {}
  {{- end }}
  load_assignment:
    cluster_name: kvgate_authz
    endpoints:
      - lb_endpoints:
          - endpoint:
              address:
                socket_address:
                  address: {{ $auth.extAuthz.address }}
                  port_value: {{ int $auth.extAuthz.port }}
{{- end }}
{{- end -}}

{{/*
auth.method mtls on the standalone listener: TLS with Envoy's certificate, and a client certificate from
the clients' CA required in the handshake, both through file-based SDS so renewed Secrets load without a
restart (the ConfigMap keys of kvgate.envoy.clientSdsFiles).
*/}}
{{- define "kvgate.auth.downstreamTls" -}}
transport_socket:
  name: envoy.transport_sockets.tls
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
    require_client_certificate: true
    common_tls_context:
      tls_certificate_sds_secret_configs:
        - name: kvgate_listener
          sds_config:
            path_config_source:
              path: /etc/envoy/listener-certificate.yaml
            resource_api_version: V3
      validation_context_sds_secret_config:
        name: kvgate_clients_ca
        sds_config:
          path_config_source:
            path: /etc/envoy/clients-ca.yaml
          resource_api_version: V3
{{- end -}}

{{- define "kvgate.envoy.clientSdsFiles" -}}
{{- $dir := include "kvgate.tls.dir" "clients" -}}
listener-certificate.yaml: |
  resources:
    - "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret
      name: kvgate_listener
      tls_certificate:
        certificate_chain:
          filename: {{ $dir }}/tls.crt
        private_key:
          filename: {{ $dir }}/tls.key
        watched_directory:
          path: {{ $dir }}
clients-ca.yaml: |
  resources:
    - "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret
      name: kvgate_clients_ca
      validation_context:
        trusted_ca:
          filename: {{ $dir }}/ca.crt
        watched_directory:
          path: {{ $dir }}
{{- end -}}

{{/*
The slow-client bounds of Envoy's HTTP connection manager (http_connection_manager.proto, Envoy v1.40):
request_headers_timeout runs from the first byte of the headers to the last; request_timeout from the
start of the request until its last byte is sent upstream or the response starts, so the gate's decision
is inside it and a held or streaming response is not. The Host is normalized before routing: a trailing
dot and any port are removed, so `strict.local.` and `strict.local:80` reach strict.local's policy.
*/}}
{{- define "kvgate.envoy.hcmBounds" -}}
{{- $envoy := .Values.envoy -}}
{{- if gt (int $envoy.requestHeadersTimeoutSeconds) 0 }}
request_headers_timeout: {{ printf "%ds" (int $envoy.requestHeadersTimeoutSeconds) }}
{{- end }}
{{- if gt (int $envoy.requestTimeoutSeconds) 0 }}
request_timeout: {{ printf "%ds" (int $envoy.requestTimeoutSeconds) }}
{{- end }}
strip_trailing_host_dot: true
strip_any_host_port: true
{{- end -}}

{{/*
Fails the render when request_timeout would cut the gate's own answer short, or when the standalone
Envoy's heap could hold more open requests than the gate cluster's circuit breaker admits: the breaker
must never overflow first, since overflow makes ext_proc fail open (an open request costs Envoy about
45 KiB of heap, measured on Envoy 1.40: envoyconfig/limits.py).
*/}}
{{- define "kvgate.envoy.checkBounds" -}}
{{- $envoy := .Values.envoy -}}
{{- $timeout := int $envoy.requestTimeoutSeconds -}}
{{- if and (gt $timeout 0) (le (mul $timeout 1000) (int $envoy.messageTimeoutMs)) -}}
{{- fail (printf "envoy.requestTimeoutSeconds (%d) must exceed envoy.messageTimeoutMs (%d ms): the whole request, the gate's answer included, must arrive within it" $timeout (int $envoy.messageTimeoutMs)) -}}
{{- end -}}
{{- if eq $envoy.mode "standalone" -}}
{{- $open := div (include "kvgate.envoy.maxHeapBytes" . | int64) 46080 -}}
{{- if le (int64 $envoy.gateCircuitBreaker.maxRequests) $open -}}
{{- fail (printf "envoy.gateCircuitBreaker.maxRequests (%d) must exceed the requests Envoy's heap budget holds open (%d at about 45 KiB each): past the breaker every request skips the gate, where the heap monitor would answer 503" (int64 $envoy.gateCircuitBreaker.maxRequests) $open) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Fails the render when Envoy would give up on the gate's answer before the gate gives it, the rule of
`kvgate envoy-config` (kvgate.envoyconfig.settings, _check_message_timeout and _max_message_timeout_ms;
tests/test_chart_envoy.py checks that both refuse the same values). The gate answers a long request
within admission.max_wait_s or, when it holds requests (max_hold_s > max_wait_s), asks Envoy for more
time at half of it (at least 50 ms; kvgate.gate.holding): that answer and 0.5 s of margin must fit
messageTimeoutMs. Envoy honours the ask up to its ext_proc max_message_timeout, which must cover
max_hold_s + 5 s; Envoy Gateway's EnvoyExtensionPolicy sets none (0 turns the ask off:
api/envoy/extensions/filters/http/ext_proc/v3/ext_proc.proto), so there the gate must not hold.
Called with (list $ $config), the gate's config as the chart renders it.
*/}}
{{- define "kvgate.envoy.checkGateAnswer" -}}
{{- $root := index . 0 -}}
{{- $envoy := $root.Values.envoy -}}
{{- if ne $envoy.mode "none" -}}
{{- $admission := (index . 1).admission | default dict -}}
{{- $wait := dig "max_wait_s" 2.0 $admission | float64 -}}
{{- $hold := dig "max_hold_s" 30.0 $admission | float64 -}}
{{- $holds := gt $hold $wait -}}
{{- $answer := $wait -}}
{{- if $holds -}}
{{- $answer = maxf 0.05 (divf $wait 2) -}}
{{- end -}}
{{- $neededMs := ceil (mulf (addf $answer 0.5) 1000) | int -}}
{{- if lt (int $envoy.messageTimeoutMs) $neededMs -}}
{{- $when := ternary "asks Envoy for more time at half of gate.config.admission.max_wait_s" "answers a long request within gate.config.admission.max_wait_s" $holds -}}
{{- fail (printf "envoy.messageTimeoutMs (%d) must be at least %d ms: the gate %s (%g s), and Envoy fails the request open if that answer comes later; raise envoy.messageTimeoutMs or lower the wait" (int $envoy.messageTimeoutMs) $neededMs $when $wait) -}}
{{- end -}}
{{- if $holds -}}
{{- if eq $envoy.mode "envoy-gateway" -}}
{{- fail (printf "gate.config.admission.max_hold_s (%g s) holds requests past max_wait_s (%g s), which Envoy Gateway cannot honour: its EnvoyExtensionPolicy sets no ext_proc max_message_timeout, so Envoy ignores the gate's ask and fails the request open; set max_hold_s to 0" $hold $wait) -}}
{{- end -}}
{{- $holdMs := ceil (mulf (addf $hold 5) 1000) | int -}}
{{- if lt (int $envoy.maxMessageTimeoutMs) $holdMs -}}
{{- fail (printf "envoy.maxMessageTimeoutMs (%d) must be at least %d ms: the gate holds a long request up to gate.config.admission.max_hold_s (%g s) plus 5 s of margin, and Envoy ignores a longer ask; raise envoy.maxMessageTimeoutMs or lower max_hold_s" (int $envoy.maxMessageTimeoutMs) $holdMs $hold) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A Kubernetes memory quantity (Ki, Mi, Gi, Ti, k, M, G, T or plain bytes) in bytes. */}}
{{- define "kvgate.bytes" -}}
{{- $text := toString . -}}
{{- $units := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 -}}
{{- $bytes := 0 -}}
{{- $matched := false -}}
{{- range $suffix := list "Ki" "Mi" "Gi" "Ti" "k" "M" "G" "T" -}}
{{- if and (not $matched) (hasSuffix $suffix $text) -}}
{{- $bytes = mulf (float64 (trimSuffix $suffix $text)) (index $units $suffix) -}}
{{- $matched = true -}}
{{- end -}}
{{- end -}}
{{- if not $matched -}}
{{- $bytes = float64 $text -}}
{{- end -}}
{{- int64 $bytes -}}
{{- end -}}

{{/* The heap the standalone Envoy's fixed_heap monitor measures against: the value, or 80% of its memory limit. */}}
{{- define "kvgate.envoy.maxHeapBytes" -}}
{{- $standalone := .Values.envoy.standalone -}}
{{- $explicit := int64 $standalone.overload.maxHeapBytes -}}
{{- if gt $explicit 0 -}}
{{- $explicit -}}
{{- else -}}
{{- $limit := dig "limits" "memory" "" ($standalone.resources | default dict) -}}
{{- if not $limit -}}
{{- fail "envoy.standalone.overload.maxHeapBytes is required when envoy.standalone.resources.limits.memory is not set: the heap Envoy's overload manager measures against" -}}
{{- end -}}
{{- int64 (mulf (include "kvgate.bytes" $limit | float64) 0.8) -}}
{{- end -}}
{{- end -}}
