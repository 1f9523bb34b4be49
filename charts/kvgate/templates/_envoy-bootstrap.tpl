{{/*
The standalone Envoy bootstrap. `kvgate envoy-config` renders the same document from Python; a test
keeps the two equal. An early header mutation strips the gate's and the identity headers from client
requests (when ext_proc fails open the route must not follow a client's header; no client names its own
tenant), the operator's authentication (auth.method) and the identity filter set the tenant, a
decompressor inflates gzip request bodies, ext_proc asks the gate, the router routes on its decision,
and the route table copies the decision from the gate's metadata into the x-kvgate-pool/-tokens/-reason
response headers; Envoy's own bounds (kvgate.envoy.hcmBounds, the overload manager, the gate cluster's
circuit breakers) keep it deciding. envoy.standalone.roundTrips 2: the gate sees the headers, then the body, and
routes match the x-kvgate-pool header it sets. 1: the gate sees the body alone, with the headers it
reads as request attributes; it answers with dynamic metadata, a buffer filter holds the request until
then, routes match the metadata and the route table copies it into the x-kvgate-* upstream headers.
*/}}
{{- define "kvgate.envoy.bootstrap" -}}
{{- $envoy := .Values.envoy -}}
{{- $standalone := $envoy.standalone -}}
{{- $oneTrip := eq (int $standalone.roundTrips) 1 -}}
{{- /* The gate's server.metadata_namespace: the chart writes server itself and keeps the default. */ -}}
{{- $namespace := "kvgate" -}}
{{- $priorityHeader := include "kvgate.priorityHeader" . -}}
{{- $bufferLimit := include "kvgate.envoy.bufferLimitBytes" . | int -}}
{{- $gateTls := .Values.tls.gate -}}
{{- $pools := include "kvgate.pools" . | fromJson -}}
{{- $layout := include "kvgate.routePolicies" . | fromJson -}}
{{- $clientTls := eq .Values.auth.method "mtls" -}}
{{- $scraped := .Values.metrics.serviceMonitor.enabled -}}
{{- if or $gateTls.enabled $clientTls -}}
# File-based SDS (the certificates below) needs a node identity; no management server uses it.
node:
  id: {{ include "kvgate.envoy.fullname" . }}
  cluster: {{ include "kvgate.envoy.fullname" . }}
{{ end -}}
admin:
  address:
    socket_address:
      address: 127.0.0.1
      port_value: {{ $standalone.adminPort }}
# Past the connection limit Envoy accepts no more connections; as its heap fills it returns memory to the
# system, then answers new requests 503, rather than being OOM-killed with every request in flight
# (overload_manager.proto, downstream_connections.proto, fixed_heap.proto, Envoy v1.40; the thresholds
# are Envoy Gateway's, internal/xds/bootstrap/bootstrap.yaml.tpl, envoyproxy/gateway
# d32f28294245e454d20f81d323d626a90e660c1e).
overload_manager:
  refresh_interval: 0.25s
  resource_monitors:
    - name: envoy.resource_monitors.fixed_heap
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig
        max_heap_size_bytes: {{ include "kvgate.envoy.maxHeapBytes" . }}
    # Checked as each connection is accepted: needs no action.
    - name: envoy.resource_monitors.global_downstream_max_connections
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig
        max_active_downstream_connections: {{ int64 $standalone.overload.maxDownstreamConnections }}
  actions:
    - name: envoy.overload_actions.shrink_heap
      triggers:
        - name: envoy.resource_monitors.fixed_heap
          threshold:
            value: 0.95
    - name: envoy.overload_actions.stop_accepting_requests
      triggers:
        - name: envoy.resource_monitors.fixed_heap
          threshold:
            value: 0.98
static_resources:
  listeners:
    - name: ingress
      address:
        socket_address:
          address: {{ $standalone.listenAddress }}
          port_value: {{ $standalone.listenPort }}
      per_connection_buffer_limit_bytes: {{ $bufferLimit }}
      filter_chains:
        {{- if $clientTls }}
        # auth.method mtls: only clients with a certificate from the clients' CA get through.
        - {{- include "kvgate.auth.downstreamTls" . | nindent 10 }}
          filters:
        {{- else }}
        - filters:
        {{- end }}
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: ingress
                {{- include "kvgate.envoy.hcmBounds" . | trim | nindent 16 }}
                # Envoy's edge settings (docs/root/configuration/best_practices/edge.rst): a connection
                # opens at most 100 streams, and `x_kvgate_tenant` cannot reach an upstream that reads `_`
                # as `-` past the removal of `x-kvgate-tenant`.
                http2_protocol_options:
                  max_concurrent_streams: 100
                common_http_protocol_options:
                  headers_with_underscores_action: DROP_HEADER
                # Before the first route selection: when ext_proc fails open, no client-sent gate header
                # can pick the pool or the pinned endpoint, and no client names its own tenant or priority.
                early_header_mutation_extensions:
                  {{- include "kvgate.stripGateHeaders" . | nindent 18 }}
                route_config:
                  name: pools
                  # The gate's decision, for the client.
                  response_headers_to_add:
                    {{- include "kvgate.responseHeadersToAdd" . | indent 20 }}
                  {{- if $oneTrip }}
                  # The gate's decision, from its metadata, for the upstream (and the pinned cluster,
                  # which reads x-kvgate-endpoint). Absent metadata adds nothing.
                  request_headers_to_add:
                    {{- range $header := splitList "," (include "kvgate.gateHeaders" .) }}
                    - header:
                        key: {{ $header }}
                        value: {{ printf "%%DYNAMIC_METADATA(%s:%s)%%" $namespace (trimPrefix "x-kvgate-" $header) | quote }}
                      append_action: OVERWRITE_IF_EXISTS_OR_ADD
                    {{- end }}
                    # The gate's reservation id, for the engine's KV events: it replaces a client's own.
                    - header:
                        key: x-session-id
                        value: {{ printf "%%DYNAMIC_METADATA(%s:session)%%" $namespace | quote }}
                      append_action: OVERWRITE_IF_EXISTS_OR_ADD
                    # The priority the gate admitted with (the identity's, capped by the route), for the queue.
                    - header:
                        key: {{ $priorityHeader }}
                        value: {{ printf "%%DYNAMIC_METADATA(%s:priority)%%" $namespace | quote }}
                      append_action: OVERWRITE_IF_EXISTS_OR_ADD
                  {{- end }}
                  virtual_hosts:
                    - name: pools
                      domains: ["*"]
                      routes:
                        {{- include "kvgate.envoy.routes" (dict "root" . "paths" $layout.paths "hostClass" "" "oneTrip" $oneTrip "namespace" $namespace) | nindent 24 }}
                    {{- range $host := $layout.hosts }}
                    - name: {{ printf "policy-%s" $host.name }}
                      # The HCM strips a port and a trailing dot from the Host before matching
                      # (strip_any_host_port, strip_trailing_host_dot): a policy host's requests
                      # never fall through to the catch-all, whatever port they name.
                      domains:
                        {{- range $host.hosts }}
                        - {{ . | quote }}
                        {{- end }}
                      {{- with $host.metadata }}
                      typed_per_filter_config:
                        {{- include "kvgate.routePolicies.extProcPerRoute" . | nindent 24 }}
                      {{- end }}
                      routes:
                        {{- include "kvgate.envoy.routes" (dict "root" $ "paths" $host.paths "hostClass" (include "kvgate.routePolicies.tenantClass" $host.metadata) "oneTrip" $oneTrip "namespace" $namespace) | nindent 24 }}
                    {{- end }}
                {{- include "kvgate.envoy.upstreamFailureReplies" . | nindent 16 }}
                http_filters:
                  {{- include "kvgate.auth.standaloneFilter" . | nindent 18 }}
                  - {{- include "kvgate.identityFilter" . | nindent 20 }}
                  - {{- include "kvgate.decompressorFilter" . | nindent 20 }}
                  - name: envoy.filters.http.ext_proc
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
                      grpc_service:
                        envoy_grpc:
                          cluster_name: kvgate_gate
                      failure_mode_allow: {{ $envoy.failOpen }}
                      {{- if $oneTrip }}
                      # The headers the gate reads (kvgate.gate.processor.request_attributes), sent
                      # with the body; a missing header is left out.
                      request_attributes:
                        - request.path
                        - request.method
                        - request.id
                        {{- range $header := list "content-type" "content-encoding" $priorityHeader (include "kvgate.tenantHeader" $) "prefer" "traceparent" "tracestate" }}
                        - {{ printf "request.headers['%s']" $header | quote }}
                        {{- end }}
                      {{- else }}
                      # The gate skips the body of a request it decided on the headers alone.
                      allow_mode_override: true
                      {{- end }}
                      message_timeout: {{ printf "%.3fs" (divf (int $envoy.messageTimeoutMs) 1000.0) }}
                      # How long the gate may hold a request waiting for room (override_message_timeout).
                      max_message_timeout: {{ printf "%.3fs" (divf (int $envoy.maxMessageTimeoutMs) 1000.0) }}
                      processing_mode:
                        request_header_mode: {{ ternary "SKIP" "SEND" $oneTrip }}
                        request_body_mode: BUFFERED
                        response_header_mode: SKIP
                      metadata_options:
                        receiving_namespaces:
                          untyped: [{{ $namespace }}]
                  {{- if $oneTrip }}
                  # Holds the request (headers included) until ext_proc has the gate's answer, so the
                  # route is chosen on it.
                  - name: envoy.filters.http.buffer
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer
                      max_request_bytes: {{ $bufferLimit }}
                  {{- end }}
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
    - name: ready
      address:
        socket_address:
          address: {{ $standalone.listenAddress }}
          port_value: {{ $standalone.readyPort }}
      # The liveness probe still connects when clients hold every connection the overload manager allows
      # (a readiness probe fails while it sheds requests: the pod leaves the Service until it recovers).
      ignore_global_conn_limit: true
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: ready
                route_config:
                  name: ready
                  {{- if $scraped }}
                  # Monitoring on: admin's Prometheus page, and only it, for the PodMonitor (admin itself
                  # stays on 127.0.0.1).
                  virtual_hosts:
                    - name: stats
                      domains: ["*"]
                      routes:
                        - match:
                            path: /stats/prometheus
                          route:
                            cluster: kvgate_admin
                  {{- end }}
                http_filters:
                  - name: envoy.filters.http.health_check
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.health_check.v3.HealthCheck
                      pass_through_mode: false
                      headers:
                        - name: :path
                          string_match:
                            exact: /ready
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: kvgate_gate
      type: STRICT_DNS
      connect_timeout: 1s
      # The buffered body travels to the gate in one gRPC message.
      per_connection_buffer_limit_bytes: {{ $bufferLimit }}
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config:
            http2_protocol_options: {}
      # A request holds an ext_proc stream while decided, and while in flight when it holds a
      # reservation; past Envoy's default 1,024 streams every further request would fail open
      # (cluster/v3/circuit_breaker.proto, Envoy v1.40).
      circuit_breakers:
        thresholds:
          - max_connections: {{ int64 $envoy.gateCircuitBreaker.maxConnections }}
            max_pending_requests: {{ int64 $envoy.gateCircuitBreaker.maxPendingRequests }}
            max_requests: {{ int64 $envoy.gateCircuitBreaker.maxRequests }}
            # ext_proc streams are not retried: Envoy's default.
            max_retries: 3
      {{- if $gateTls.enabled }}
      # As envoy/envoy-tls.yaml, with the files delivered by file-based SDS: Envoy reloads them when the
      # Secret volume changes, where `filename` sources are read once at start.
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
          sni: {{ $gateTls.serverName }}
          common_tls_context:
            # gRPC over TLS negotiates HTTP/2 by ALPN.
            alpn_protocols: [h2]
            {{- if $gateTls.clientAuth }}
            tls_certificate_sds_secret_configs:
              - name: kvgate_gate_client
                sds_config:
                  path_config_source:
                    path: /etc/envoy/gate-client-certificate.yaml
                  resource_api_version: V3
            {{- end }}
            combined_validation_context:
              default_validation_context:
                # Without a name to match, any certificate from the CA would pass for the gate.
                match_typed_subject_alt_names:
                  - san_type: DNS
                    matcher:
                      exact: {{ $gateTls.serverName }}
              validation_context_sds_secret_config:
                name: kvgate_gate_ca
                sds_config:
                  path_config_source:
                    path: /etc/envoy/gate-ca.yaml
                  resource_api_version: V3
      {{- end }}
      load_assignment:
        cluster_name: kvgate_gate
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address:
                      address: {{ $standalone.gateAddress | default (include "kvgate.gate.headlessHost" .) }}
                      port_value: {{ .Values.gate.port }}
    # The gate pins an admitted long request to the node holding its KV reservation, by address;
    # the early header mutation strips a client's header, so it comes from the gate (one round trip:
    # from the route table, out of the gate's metadata).
    - name: kvgate_pinned
      type: ORIGINAL_DST
      lb_policy: CLUSTER_PROVIDED
      connect_timeout: 2s
      per_connection_buffer_limit_bytes: {{ $bufferLimit }}
      original_dst_lb_config:
        use_http_header: true
        http_header_name: x-kvgate-endpoint
    {{- if $scraped }}
    - name: kvgate_admin
      type: STATIC
      connect_timeout: 1s
      load_assignment:
        cluster_name: kvgate_admin
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address:
                      address: 127.0.0.1
                      port_value: {{ $standalone.adminPort }}
    {{- end }}
    {{- range $name, $pool := $pools }}
    {{- if $pool.address }}
    - name: {{ printf "pool_%s" $name }}
      type: STRICT_DNS
      connect_timeout: 2s
      per_connection_buffer_limit_bytes: {{ $bufferLimit }}
      load_assignment:
        cluster_name: {{ printf "pool_%s" $name }}
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address:
                      address: {{ $pool.address }}
                      port_value: {{ int $pool.port }}
    {{- end }}
    {{- end }}
    {{- include "kvgate.auth.standaloneClusters" . | nindent 4 }}
{{- end -}}

{{/*
The file-based SDS resources the bootstrap's gate cluster names, by ConfigMap key (under /etc/envoy).
Each watches the Secret volume's directory: the kubelet updates it by renaming its ..data link, and
Envoy reads the files again on that rename.
*/}}
{{- define "kvgate.envoy.sdsFiles" -}}
{{- $dir := include "kvgate.tls.dir" "gate" -}}
gate-ca.yaml: |
  resources:
    - "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret
      name: kvgate_gate_ca
      validation_context:
        trusted_ca:
          filename: {{ $dir }}/ca.crt
        watched_directory:
          path: {{ $dir }}
{{- if .Values.tls.gate.clientAuth }}
gate-client-certificate.yaml: |
  resources:
    - "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret
      name: kvgate_gate_client
      tls_certificate:
        certificate_chain:
          filename: {{ $dir }}/tls.crt
        private_key:
          filename: {{ $dir }}/tls.key
        watched_directory:
          path: {{ $dir }}
{{- end }}
{{- end -}}

{{/* A pool route's match, under `path` ("": every path): on the headers the gate set (two round trips)
or the metadata it wrote (one: the route table adds the headers only once a route is chosen); `pool` ""
matches any request (the catch-all). */}}
{{- define "kvgate.envoy.poolMatch" -}}
{{- if .path }}
path_separated_prefix: {{ .path }}
{{- else }}
prefix: /
{{- end }}
{{- if not .pool }}
{{- else if .oneTrip }}
dynamic_metadata:
  - filter: {{ .namespace }}
    path:
      - key: pool
    value:
      string_match:
        exact: {{ .pool }}
  {{- if .pinned }}
  - filter: {{ .namespace }}
    path:
      - key: endpoint
    value:
      present_match: true
  {{- end }}
{{- else }}
headers:
  - name: x-kvgate-pool
    string_match:
      exact: {{ .pool }}
  {{- if .pinned }}
  - name: x-kvgate-endpoint
    present_match: true
  {{- end }}
{{- end }}
{{- end -}}

{{/*
One virtual host's routes, as kvgate.envoyconfig.bootstrap.routes: the queue's own API (queue.enabled),
then each route policy path's pool routes (longest prefix first), then the pool routes for every path.
The routes to the queue carry the tenant class of their path's policy, else of the virtual host's
(`hostClass`, "" for none) in x-kvgate-tenant-class.
Include with (dict "root" $ "paths" LIST "hostClass" CLASS "oneTrip" BOOL "namespace" NS).
*/}}
{{- define "kvgate.envoy.routes" -}}
{{- $root := .root -}}
{{- if $root.Values.queue.enabled }}
{{- range $path := splitList "," (include "kvgate.queue.apiPaths" $root) }}
# `kvgate queue`'s own API, straight to it: nothing for the gate to size (the queue admits each batch line).
- match:
    path_separated_prefix: {{ $path }}
  route:
    cluster: {{ printf "pool_%s" (include "kvgate.queue.pool" $root) }}
    timeout: {{ printf "%ds" (int $root.Values.envoy.routeTimeoutSeconds) }}
  typed_per_filter_config:
    envoy.filters.http.ext_proc:
      "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute
      disabled: true
    # Not inflated: nothing caps these streamed routes (the queue refuses a compressed upload, 415).
    envoy.filters.http.decompressor:
      "@type": type.googleapis.com/envoy.config.route.v3.FilterConfig
      disabled: true
    {{- if $.oneTrip }}
    # A batch file may be larger than the buffer that holds requests for the gate.
    envoy.filters.http.buffer:
      "@type": type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute
      disabled: true
    {{- end }}
  {{- include "kvgate.envoy.tenantClassHeader" $.hostClass }}
{{- end }}
{{- end }}
{{- range $path := .paths }}
{{- $class := include "kvgate.routePolicies.tenantClass" $path.merged | default $.hostClass }}
{{- include "kvgate.envoy.poolRoutes" (dict "root" $root "path" $path.prefix "metadata" $path.metadata "tenantClass" $class "oneTrip" $.oneTrip "namespace" $.namespace) }}
{{- end }}
{{- include "kvgate.envoy.poolRoutes" (dict "root" $root "path" "" "metadata" list "tenantClass" .hostClass "oneTrip" .oneTrip "namespace" .namespace) }}
{{- end -}}

{{/* A route to the queue in a tenant class ("" for none): the class, for the queue to weigh its jobs. */}}
{{- define "kvgate.envoy.tenantClassHeader" -}}
{{- with . }}
  request_headers_to_add:
    - header:
        key: x-kvgate-tenant-class
        value: {{ . | quote }}
      append_action: OVERWRITE_IF_EXISTS_OR_ADD
{{- end }}
{{- end -}}

{{/* The pool routes under one path ("": every path), each carrying the route policy `metadata`. */}}
{{- define "kvgate.envoy.poolRoutes" -}}
{{- $root := .root -}}
{{- $envoy := $root.Values.envoy -}}
{{- $routeTimeout := printf "%ds" (int $envoy.routeTimeoutSeconds) -}}
{{- $longPools := include "kvgate.longPools" $root | splitList "," -}}
{{- $queuePool := ternary (include "kvgate.queue.pool" $root) "" $root.Values.queue.enabled -}}
{{- $common := dict "path" .path "oneTrip" .oneTrip "namespace" .namespace -}}
{{- range $name := splitList "," (include "kvgate.routedPools" $root) }}
{{- if $name }}
{{- if has $name $longPools }}
- match:
    {{- include "kvgate.envoy.poolMatch" (merge (dict "pool" $name "pinned" true) $common) | nindent 4 }}
  route:
    cluster: kvgate_pinned
    timeout: {{ $routeTimeout }}
  {{- with $.metadata }}
  typed_per_filter_config:
    {{- include "kvgate.routePolicies.extProcPerRoute" . | nindent 4 }}
  {{- end }}
{{- end }}
- match:
    {{- include "kvgate.envoy.poolMatch" (merge (dict "pool" $name "pinned" false) $common) | nindent 4 }}
  route:
    cluster: {{ printf "pool_%s" $name }}
    timeout: {{ $routeTimeout }}
    {{- if eq $name $queuePool }}
    # A held request waits in the queue up to queue.max_hold_s: Envoy's stream idle timeout (300 s by
    # default) must not answer before the queue does.
    idle_timeout: {{ printf "%ss" (include "kvgate.queue.idleTimeoutSeconds" $root) }}
    {{- end }}
  {{- with $.metadata }}
  typed_per_filter_config:
    {{- include "kvgate.routePolicies.extProcPerRoute" . | nindent 4 }}
  {{- end }}
  {{- if eq $name $queuePool }}
  {{- include "kvgate.envoy.tenantClassHeader" $.tenantClass }}
  {{- end }}
{{- end }}
{{- end }}
{{- include "kvgate.envoy.unansweredRoutes" (dict "root" $root "common" $common "metadata" .metadata) }}
- match:
    {{- include "kvgate.envoy.poolMatch" (merge (dict "pool" "" "pinned" false) $common) | nindent 4 }}
  route:
    cluster: {{ printf "pool_%s" $envoy.defaultPool }}
    timeout: {{ $routeTimeout }}
    {{- if eq $envoy.defaultPool $queuePool }}
    idle_timeout: {{ printf "%ss" (include "kvgate.queue.idleTimeoutSeconds" $root) }}
    {{- end }}
  {{- with .metadata }}
  typed_per_filter_config:
    {{- include "kvgate.routePolicies.extProcPerRoute" . | nindent 4 }}
  {{- end }}
  {{- if eq $envoy.defaultPool $queuePool }}
  {{- include "kvgate.envoy.tenantClassHeader" .tenantClass }}
  {{- end }}
{{- end -}}


{{/*
Failing open by size, as kvgate.envoyconfig.bootstrap.unanswered_routes: requests the gate did not answer
(no x-kvgate-pool header; one round trip: no pool metadata) whose body may be too long for the default
pool (kvgate.unsafeBodyBytes), whose size is unknown (a POST without Content-Length) or that are
compressed (sized before Envoy inflates them) are refused (kvgate.gateUnavailable) or sent to the long
pool unreserved (envoy.failOpenLong). Before the gate answers, Envoy asks it from these routes too: each
carries the route policy `metadata`.
*/}}
{{- define "kvgate.envoy.unansweredRoutes" -}}
{{- $root := .root -}}
{{- $unsafe := include "kvgate.unsafeBodyBytes" $root -}}
{{- $longPool := include "kvgate.failOpenLongPool" $root -}}
{{- $queuePool := ternary (include "kvgate.queue.pool" $root) "" $root.Values.queue.enabled -}}
{{- if $unsafe }}
{{- range $size := list "large" "unsized" "compressed" }}
- match:
    {{- include "kvgate.envoy.poolMatch" (merge (dict "pool" "" "pinned" false) $.common) | nindent 4 }}
    {{- if $.common.oneTrip }}
    dynamic_metadata:
      - filter: {{ $.common.namespace }}
        path:
          - key: pool
        value:
          present_match: true
        invert: true
    headers:
    {{- else }}
    headers:
      - name: x-kvgate-pool
        present_match: false
    {{- end }}
      {{- include "kvgate.unansweredHeaders" (dict "size" $size "unsafe" $unsafe) | nindent 6 }}
  {{- if $longPool }}
  route:
    cluster: {{ printf "pool_%s" $longPool }}
    timeout: {{ printf "%ds" (int $root.Values.envoy.routeTimeoutSeconds) }}
    {{- if eq $longPool $queuePool }}
    idle_timeout: {{ printf "%ss" (include "kvgate.queue.idleTimeoutSeconds" $root) }}
    {{- end }}
  {{- else }}
  {{- include "kvgate.gateUnavailable" $root | nindent 2 }}
  {{- end }}
  {{- with $.metadata }}
  typed_per_filter_config:
    {{- include "kvgate.routePolicies.extProcPerRoute" . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}
{{- end -}}
