{{/* Names and labels. */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Component names leave room for the longest suffix (-agent-interactive) within 63 characters. */}}
{{- define "kvgate.base" -}}{{ include "kvgate.fullname" . | trunc 45 | trimSuffix "-" }}{{- end -}}
{{- define "kvgate.gate.fullname" -}}{{ include "kvgate.base" . }}-gate{{- end -}}
{{- define "kvgate.envoy.fullname" -}}{{ include "kvgate.base" . }}-envoy{{- end -}}
{{- define "kvgate.queue.fullname" -}}{{ include "kvgate.base" . }}-queue{{- end -}}
{{/* The agents of one pool: include with (list $ "long"). */}}
{{- define "kvgate.agent.fullname" -}}{{ include "kvgate.base" (index . 0) }}-agent-{{ index . 1 }}{{- end -}}
{{/* The simulated nodes of one pool (simulator.enabled): include with (list $ "long"). */}}
{{- define "kvgate.sim.fullname" -}}{{ include "kvgate.base" (index . 0) }}-sim-{{ index . 1 }}{{- end -}}

{{/* A simulated pool's Service as envoy.pools names it: a DNS name, or `name.namespace` for Envoy Gateway. */}}
{{- define "kvgate.sim.address" -}}
{{- $root := index . 0 -}}
{{- if eq $root.Values.envoy.mode "envoy-gateway" -}}
{{- printf "%s.%s" (include "kvgate.sim.fullname" .) $root.Release.Namespace -}}
{{- else -}}
{{- printf "%s.%s.svc.cluster.local" (include "kvgate.sim.fullname" .) $root.Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* The pods an agent pool's headless Service selects: its DaemonSet's, or the simulated nodes' (an agent beside each sim). */}}
{{- define "kvgate.agent.component" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (ternary "sim" "agent" $root.Values.simulator.enabled) (index . 1) -}}
{{- end -}}

{{- define "kvgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: include with (list $ "gate"). */}}
{{- define "kvgate.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "kvgate.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "kvgate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Worker processes: gate.workers, or one per whole CPU of the gate's CPU limit (request if no limit). */}}
{{- define "kvgate.gate.workers" -}}
{{- $workers := int .Values.gate.workers -}}
{{- if le $workers 0 -}}
{{- $resources := .Values.gate.resources | default dict -}}
{{- $cpu := toString (dig "limits" "cpu" (dig "requests" "cpu" "1" $resources) $resources) -}}
{{- if hasSuffix "m" $cpu -}}
{{- $workers = div (int (trimSuffix "m" $cpu)) 1000 -}}
{{- else -}}
{{- $workers = int (float64 $cpu) -}}
{{- end -}}
{{- $workers = max $workers 1 -}}
{{- end -}}
{{- $workers -}}
{{- end -}}

{{/* The request body limit the gate enforces; Envoy buffers a little more so the gate, not Envoy, refuses. */}}
{{- define "kvgate.maxBodyBytes" -}}
{{- int (dig "request" "max_body_bytes" 33554432 (.Values.gate.config | default dict)) -}}
{{- end -}}

{{- define "kvgate.envoy.bufferLimitBytes" -}}
{{- add (include "kvgate.maxBodyBytes" . | int) 1048576 -}}
{{- end -}}

{{- define "kvgate.gate.terminationGracePeriodSeconds" -}}
{{- add (int .Values.gate.preStopSleepSeconds) (int (ceil .Values.gate.drainSeconds)) (int .Values.gate.terminationMarginSeconds) -}}
{{- end -}}

{{- define "kvgate.gate.host" -}}
{{- printf "%s.%s.svc.cluster.local" (include "kvgate.gate.fullname" .) .Release.Namespace -}}
{{- end -}}

{{- define "kvgate.gate.headlessHost" -}}
{{- printf "%s-headless.%s.svc.cluster.local" (include "kvgate.gate.fullname" .) .Release.Namespace -}}
{{- end -}}

{{- define "kvgate.agent.dns" -}}
{{- $root := index . 0 -}}
{{- printf "%s.%s.svc.cluster.local:%d" (include "kvgate.agent.fullname" .) $root.Release.Namespace (int $root.Values.agent.port) -}}
{{- end -}}

{{/* The gate config section each agent pool feeds: reservations (long) or the water level only. */}}
{{- define "kvgate.agent.section" -}}
{{- ternary "headroom" "interactive_headroom" (eq . "long") -}}
{{- end -}}

{{/* Every pool name the gate config can set (default_model and each model), so each gets a route. */}}
{{- define "kvgate.referencedPools" -}}
{{- $names := list -}}
{{- $models := prepend (.Values.gate.config.models | default list) (.Values.gate.config.default_model | default dict) -}}
{{- range $models -}}
{{- $pools := .pools | default dict -}}
{{- $names = append $names ($pools.interactive | default "interactive") -}}
{{- $names = append $names ($pools.long | default "long") -}}
{{- end -}}
{{- $names | uniq | sortAlpha | join "," -}}
{{- end -}}

{{/* The pool names the gate sends long-context requests to (pinned to a node when it names one). */}}
{{- define "kvgate.longPools" -}}
{{- $names := list -}}
{{- $models := prepend (.Values.gate.config.models | default list) (.Values.gate.config.default_model | default dict) -}}
{{- range $models -}}
{{- $names = append $names ((.pools | default dict).long | default "long") -}}
{{- end -}}
{{- $names | uniq | sortAlpha | join "," -}}
{{- end -}}

{{/*
envoy.pools as Envoy routes to them, as JSON (`include "kvgate.pools" . | fromJson`): with
simulator.enabled, the simulators' Services are the interactive and long pools.
*/}}
{{- define "kvgate.pools" -}}
{{- $pools := deepCopy .Values.envoy.pools -}}
{{- if .Values.simulator.enabled -}}
{{- range $name := list "interactive" "long" -}}
{{- if (index $pools $name | default dict).address -}}
{{- fail (printf "envoy.pools.%s.address must stay empty with simulator.enabled: the simulated %s pool (Service %s) takes its place" $name $name (include "kvgate.sim.fullname" (list $ $name))) -}}
{{- end -}}
{{- $_ := set $pools $name (dict "address" (include "kvgate.sim.address" (list $ $name)) "port" (int $.Values.simulator.port)) -}}
{{- end -}}
{{- end -}}
{{- if .Values.queue.enabled -}}
{{- $name := include "kvgate.queue.pool" . -}}
{{- if (index $pools $name | default dict).address -}}
{{- fail (printf "envoy.pools.%s.address must stay empty with queue.enabled: the queue (Service %s) is the %s pool" $name (include "kvgate.queue.fullname" .) $name) -}}
{{- end -}}
{{- $_ := set $pools $name (dict "address" (include "kvgate.queue.address" .) "port" (int .Values.queue.port)) -}}
{{- end -}}
{{- toJson $pools -}}
{{- end -}}

{{/* The pool the queue serves: the default model entry's async pool (the gate's PoolNames.async_). */}}
{{- define "kvgate.queue.pool" -}}
{{- dig "default_model" "pools" "async" "async" (.Values.gate.config | default dict) -}}
{{- end -}}

{{/* The queue's Service as envoy.pools names it: a DNS name, or `name.namespace` for Envoy Gateway. */}}
{{- define "kvgate.queue.address" -}}
{{- if eq .Values.envoy.mode "envoy-gateway" -}}
{{- printf "%s.%s" (include "kvgate.queue.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- printf "%s.%s.svc.cluster.local" (include "kvgate.queue.fullname" .) .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/*
The idle timeout of routes to the queue, in seconds: a held request waits there up to queue.max_hold_s,
then the queue answers 429 itself; Envoy's stream idle timeout (300 s by default) must leave that answer
time to arrive (kvgate.envoyconfig.settings.QUEUE_IDLE_MARGIN_S).
*/}}
{{- define "kvgate.queue.idleTimeoutSeconds" -}}
{{- add (ceil (dig "queue" "max_hold_s" 300 (.Values.gate.config | default dict)) | int) 30 -}}
{{- end -}}

{{/* `kvgate queue`'s own API, routed to it with ext_proc off (kvgate.envoyconfig.bootstrap.QUEUE_API_PATHS). */}}
{{- define "kvgate.queue.apiPaths" -}}
/v1/files,/v1/batches,/v1/kvgate/jobs
{{- end -}}

{{/* Fails the render, naming the value, when a pool the gate routes to has no address. */}}
{{- define "kvgate.checkPools" -}}
{{- $pools := include "kvgate.pools" . | fromJson -}}
{{- range $name := splitList "," (include "kvgate.referencedPools" .) -}}
{{- $pool := index $pools $name | default dict -}}
{{- if not $pool.address -}}
{{- fail (printf "envoy.pools.%s.address is required: the gate routes requests to pool %q (envoy.mode=%s)" $name $name $.Values.envoy.mode) -}}
{{- end -}}
{{- end -}}
{{- if not (hasKey $pools .Values.envoy.defaultPool) -}}
{{- fail (printf "envoy.defaultPool %q names no entry of envoy.pools" .Values.envoy.defaultPool) -}}
{{- end -}}
{{- end -}}

{{/* Pools in a stable order: the default pool's route must come last (it matches everything). */}}
{{- define "kvgate.routedPools" -}}
{{- $names := list -}}
{{- range $name, $pool := include "kvgate.pools" . | fromJson -}}
{{- if and $pool.address (ne $name $.Values.envoy.defaultPool) -}}
{{- $names = append $names $name -}}
{{- end -}}
{{- end -}}
{{- $names | sortAlpha | join "," -}}
{{- end -}}

{{- define "kvgate.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvgate.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{- define "kvgate.otelEnv" -}}
{{- if .Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.otel.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .Values.otel.protocol | quote }}
{{- end }}
- name: OTEL_SERVICE_NAME
  value: {{ .Values.otel.serviceName | quote }}
{{- end -}}

{{/* An Envoy Gateway backendRef from a pool address `name` or `name.namespace`: (list $ pool). */}}
{{- define "kvgate.serviceBackendRef" -}}
{{- $root := index . 0 -}}
{{- $pool := index . 1 -}}
{{- $parts := splitList "." $pool.address -}}
name: {{ first $parts }}
{{- if gt (len $parts) 1 }}
namespace: {{ index $parts 1 }}
{{- end }}
port: {{ int $pool.port }}
{{- end -}}

{{/*
The headers the gate sets, removed from client requests before the first route selection (with the
identity headers, kvgate.strippedHeaders): when ext_proc fails open nothing a client sent may pick the pool
or the pinned endpoint. With one round trip the route table copies these from the gate's metadata.
*/}}
{{- define "kvgate.gateHeaders" -}}
x-kvgate-pool,x-kvgate-endpoint,x-kvgate-tokens,x-kvgate-reason
{{- end -}}

{{/*
The gate's decision, copied from its dynamic metadata (namespace kvgate, the gate's
server.metadata_namespace, which the chart leaves at its default) into response headers, so a client
sees where its request went at no extra round trip. Absent metadata (ext_proc failed open, or a
request the gate never saw) adds nothing: Envoy leaves out a header whose value formats empty. A
refusal the gate answers itself already carries its own x-kvgate-reason and x-kvgate-tokens; these
are added only when absent (as envoy/envoy.yaml).
*/}}
{{- define "kvgate.responseHeaders" -}}
x-kvgate-pool,x-kvgate-tokens,x-kvgate-reason
{{- end -}}

{{- define "kvgate.responseHeadersToAdd" -}}
{{- range $header := splitList "," (include "kvgate.responseHeaders" .) }}
- header:
    key: {{ $header }}
    value: {{ printf "%%DYNAMIC_METADATA(kvgate:%s)%%" (trimPrefix "x-kvgate-" $header) | quote }}
  append_action: ADD_IF_ABSENT
{{- end }}
{{- end -}}

{{/*
Failing open by size (kvgate.envoyconfig.unanswered): a request the gate did not answer goes to
envoy.defaultPool only when its Content-Length proves it fits there. This is the fewest body bytes that
may not: the smallest interactive_max_tokens among the models whose short requests go to that pool
(model entries inherit default_model's keys, as kvgate.yaml's do), at one token per byte, the most any
shipped calibration allows (kvgate.estimate.calibration.most_tokens_per_byte; a test keeps the chart's
bootstrap equal to `kvgate envoy-config`'s). Empty when envoy.failOpen is off (Envoy answers 500 itself)
or no model sends its short requests to envoy.defaultPool.
*/}}
{{- define "kvgate.unsafeBodyBytes" -}}
{{- $default := .Values.gate.config.default_model | default dict -}}
{{- $defaultPools := $default.pools | default dict -}}
{{- $limit := 0 -}}
{{- range $model := prepend (.Values.gate.config.models | default list) $default -}}
{{- $interactive := ($model.pools | default dict).interactive | default $defaultPools.interactive | default "interactive" -}}
{{- if eq $interactive $.Values.envoy.defaultPool -}}
{{- $tokens := int ($model.interactive_max_tokens | default $default.interactive_max_tokens | default 4096) -}}
{{- if or (eq $limit 0) (lt $tokens $limit) -}}
{{- $limit = $tokens -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and .Values.envoy.failOpen $limit -}}
{{- $limit -}}
{{- end -}}
{{- end -}}

{{/* envoy.failOpenLong long-pool: the default model's long pool, where those requests go unreserved. */}}
{{- define "kvgate.failOpenLongPool" -}}
{{- if eq .Values.envoy.failOpenLong "long-pool" -}}
{{- ((.Values.gate.config.default_model | default dict).pools | default dict).long | default "long" -}}
{{- end -}}
{{- end -}}

{{/*
The header matchers that tell the three kinds of those requests apart (kvgate.envoyconfig.bootstrap
unanswered_routes): `size` large (a Content-Length of `unsafe` bytes or more), unsized (a POST without
Content-Length) or compressed (a POST with a Content-Encoding).
*/}}
{{- define "kvgate.unansweredHeaders" -}}
{{- if eq .size "large" }}
- name: content-length
  range_match:
    start: {{ .unsafe }}
    end: 9223372036854775807
{{- else }}
- name: ":method"
  string_match:
    exact: POST
- name: {{ ternary "content-length" "content-encoding" (eq .size "unsized") }}
  present_match: {{ ne .size "unsized" }}
{{- end }}
{{- end -}}

{{/*
A regular expression (RE2, whole value) for the decimal integers of at least `.` (a positive integer),
for a Gateway API header match, which has no range (envoy-gateway mode's content-length): more digits,
or as many with a larger digit after a common prefix, or the number itself. 4096:
0*([1-9][0-9]{4,}|[5-9][0-9]{3}|4[1-9][0-9]{2}|409[7-9]|4096).
*/}}
{{- define "kvgate.atLeastRegex" -}}
{{- $digits := toString . -}}
{{- $n := len $digits -}}
{{- $alternatives := list (printf "[1-9][0-9]{%d,}" $n) -}}
{{- range $i := until $n -}}
{{- $digit := int (substr (int $i) (int (add1 $i)) $digits) -}}
{{- if lt $digit 9 -}}
{{- $larger := printf "%s[%d-9]" (substr 0 (int $i) $digits) (add1 $digit) -}}
{{- $rest := sub $n (add1 $i) -}}
{{- if gt $rest 0 -}}
{{- $larger = printf "%s[0-9]{%d}" $larger $rest -}}
{{- end -}}
{{- $alternatives = append $alternatives $larger -}}
{{- end -}}
{{- end -}}
{{- printf "0*(%s)" (join "|" (append $alternatives $digits)) -}}
{{- end -}}

{{/*
Envoy's own answer to those requests where they are refused: the gate_unavailable row of the refusal
table (kvgate.policy.refusals; kvgate.envoyconfig.unanswered.gate_unavailable), as direct_response and
response_headers_to_add of a route. OVERWRITE: Envoy gives a direct response its own Content-Type
(text/plain).
*/}}
{{- define "kvgate.gateUnavailable.body" -}}
{"error": {"message": "The admission gate did not answer, and this request may be too long for the interactive pool; retry shortly.", "type": "server_error", "param": null, "code": "gate_unavailable"}}
{{- end -}}

{{- define "kvgate.gateUnavailable.headers" -}}
{{- toJson (list (list "content-type" "application/json") (list "x-kvgate-reason" "gate_unavailable") (list "retry-after" "1") (list "x-kvgate-retry-after-ms" "1000") (list "retry-after-ms" "1000")) -}}
{{- end -}}

{{- define "kvgate.gateUnavailable" -}}
direct_response:
  status: 503
  body:
    inline_string: {{ include "kvgate.gateUnavailable.body" . | quote }}
response_headers_to_add:
  {{- range $pair := include "kvgate.gateUnavailable.headers" . | fromJsonArray }}
  - header:
      key: {{ index $pair 0 }}
      value: {{ index $pair 1 | quote }}
    append_action: OVERWRITE_IF_EXISTS_OR_ADD
  {{- end }}
{{- end -}}

{{/*
Envoy's own answer to a node that failed before it answered (refused the connection while stopping,
died, reset the stream before its first byte): the upstream_unavailable row of the refusal table
(kvgate.envoyconfig.upstream_failure), in place of its plain-text 503, matched by the router's response
flags. The HttpConnectionManager's local_reply_config.
*/}}
{{- define "kvgate.envoy.upstreamFailureReplies" -}}
local_reply_config:
  mappers:
    - filter:
        response_flag_filter:
          flags: [UF, UC, UR, UO, UH, URX]
      status_code: 503
      body:
        inline_string: {{ `{"error": {"message": "The engine chosen for this request could not be reached before it answered (it may be restarting); retry shortly.", "type": "server_error", "param": null, "code": "upstream_unavailable"}}` | quote }}
      body_format_override:
        text_format_source:
          inline_string: "%LOCAL_REPLY_BODY%"
        content_type: application/json
      headers_to_add:
        {{- range $pair := list (list "content-type" "application/json") (list "x-kvgate-reason" "upstream_unavailable") (list "retry-after" "1") (list "x-kvgate-retry-after-ms" "1000") (list "retry-after-ms" "1000") }}
        - header:
            key: {{ index $pair 0 }}
            value: {{ index $pair 1 | quote }}
          append_action: OVERWRITE_IF_EXISTS_OR_ADD
        {{- end }}
{{- end -}}

{{/*
Envoy inflates gzip request bodies ahead of ext_proc, so the gate reads plain JSON and the engine
(which does not inflate) gets it too; other encodings pass to the gate, which inflates deflate itself.
Requests only, as envoy/envoy.yaml: a response stays as the engine sent it, and nothing is added to the
upstream request's Accept-Encoding (envoy/extensions/filters/http/decompressor/v3/decompressor.proto,
envoyproxy/envoy 040783c8c0b423531a51d33f2d4765ca3de0d96e: both directions are on unless `enabled`
says otherwise).
max_inflate_ratio 1032, deflate's largest possible ratio: at the default of 100 Envoy stops inflating a
frame that grows past 100 times its size and passes on what it has, so a prompt of repeated text
reached the gate and the engine cut short (source/extensions/compression/gzip/decompressor/
zlib_decompressor_impl.cc, envoyproxy/envoy 0f470b1e3f786b4931f53bd2e33ba4aab7284d43; the field and its
1..1032 bounds are in Envoy 1.40's gzip.proto, as xds-protos 1.85.0 ships it). A body that inflates past
the buffer limit is refused whole, with 413.
*/}}
{{- define "kvgate.decompressorFilter" -}}
name: envoy.filters.http.decompressor
typed_config:
  "@type": type.googleapis.com/envoy.extensions.filters.http.decompressor.v3.Decompressor
  decompressor_library:
    name: gzip
    typed_config:
      "@type": type.googleapis.com/envoy.extensions.compression.gzip.decompressor.v3.Gzip
      max_inflate_ratio: 1032
  request_direction_config:
    advertise_accept_encoding: false
  response_direction_config:
    common_config:
      enabled:
        default_value: false
        runtime_key: kvgate.decompress_responses
{{- end -}}

{{- define "kvgate.stripGateHeaders" -}}
- name: envoy.http.early_header_mutation.header_mutation
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation
    mutations:
      {{- range splitList "," (include "kvgate.strippedHeaders" .) }}
      - remove: {{ . }}
      {{- end }}
{{- end -}}

{{/* The metrics port of gate worker i: "metrics" for the first (annotations scrape it), "metrics-i" after. */}}
{{- define "kvgate.gate.metricsPortName" -}}
{{- if eq (int .) 0 }}metrics{{ else }}metrics-{{ . }}{{ end }}
{{- end }}

{{/*
The gate's tokenizer (gate.tokenizer), shared by the gate and the queue (which estimates batch lines and
requests that never passed the gate): an init container that fetches it, the volume, its mount and the
--tokenizer flag; each renders nothing when gate.tokenizer.source is none.
*/}}
{{- define "kvgate.tokenizer.initContainers" -}}
{{- $tokenizer := .Values.gate.tokenizer -}}
{{- if eq $tokenizer.source "initContainer" }}
initContainers:
  - name: fetch-tokenizer
    image: {{ required "gate.tokenizer.initContainer.image is required when gate.tokenizer.source is initContainer" $tokenizer.initContainer.image }}
    {{- with $tokenizer.initContainer.command }}
    command:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with $tokenizer.initContainer.args }}
    args:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    securityContext:
      {{- include "kvgate.containerSecurityContext" . | nindent 6 }}
    volumeMounts:
      - name: tokenizers
        mountPath: /tokenizers
{{- end }}
{{- end -}}

{{- define "kvgate.tokenizer.args" -}}
{{- $tokenizer := .Values.gate.tokenizer -}}
{{- if ne $tokenizer.source "none" }}
- --tokenizer
- {{ printf "%s/%s" $tokenizer.mountPath $tokenizer.file | quote }}
{{- end }}
{{- end -}}

{{- define "kvgate.tokenizer.mount" -}}
{{- $tokenizer := .Values.gate.tokenizer -}}
{{- if ne $tokenizer.source "none" }}
- name: tokenizers
  mountPath: {{ $tokenizer.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "kvgate.tokenizer.volume" -}}
{{- $tokenizer := .Values.gate.tokenizer -}}
{{- if eq $tokenizer.source "configMap" }}
- name: tokenizers
  configMap:
    name: {{ required "gate.tokenizer.configMap.name is required when gate.tokenizer.source is configMap" $tokenizer.configMap.name }}
{{- else if eq $tokenizer.source "volume" }}
- name: tokenizers
  {{- if not $tokenizer.volume }}
  {{- fail "gate.tokenizer.volume is required when gate.tokenizer.source is volume" }}
  {{- end }}
  {{- toYaml $tokenizer.volume | nindent 2 }}
{{- else if eq $tokenizer.source "initContainer" }}
- name: tokenizers
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* The InferencePool and its HTTPRoute share this name. */}}
{{- define "kvgate.inferencePool.name" -}}{{ include "kvgate.base" . }}-pool{{- end -}}

{{/* Fails the render, naming the value, where an InferencePool cannot work as set. */}}
{{- define "kvgate.inferencePool.check" -}}
{{- $pool := .Values.inferencePool -}}
{{- if ne .Values.envoy.mode "none" -}}
{{- fail (printf "inferencePool.enabled needs envoy.mode none, not %q: the pool's gateway (Istio, Envoy Gateway, ...) is the Envoy, and the gate speaks the Endpoint Picker Protocol to it (docs/picker.md)" .Values.envoy.mode) -}}
{{- end -}}
{{- if not $pool.selector -}}
{{- fail "inferencePool.selector is required: the labels of the engine pods the pool serves (InferencePool spec.selector.matchLabels)" -}}
{{- end -}}
{{- if not $pool.gateway.name -}}
{{- fail "inferencePool.gateway.name is required: the Gateway the HTTPRoute to the pool attaches to" -}}
{{- end -}}
{{- if not (and .Values.agent.enabled .Values.agent.pools.long.enabled .Values.agent.pools.interactive.enabled) -}}
{{- fail "inferencePool.enabled needs agent.enabled and both agent.pools (long and interactive) enabled: the picker names engines their agents report" -}}
{{- end -}}
{{- if .Values.queue.enabled -}}
{{- fail "inferencePool.enabled cannot go with queue.enabled: an InferencePool's endpoints are engines, and the async queue is none" -}}
{{- end -}}
{{- end -}}
