{{/*
The agent container and its volumes, on a GPU node (agent-daemonset.yaml) or beside a simulated node
(simulator.yaml). Include with (dict "root" $ "engine" $engine "simulated" bool "pool" NAME): `engine`
is agent.engine merged with the pool's overrides; agent.pools.NAME's capacityTokens and
unreservedRequestTokens, where not null, win over agent.*. A simulated node's agent reads the sim in its own pod,
pins requests to the pod's address, names itself after the pod and simulates its GPUs.
*/}}
{{- define "kvgate.agent.container" -}}
{{- $root := .root -}}
{{- $values := $root.Values -}}
{{- $tls := $values.tls.agents -}}
{{- $tlsDir := include "kvgate.tls.dir" "agents" -}}
{{- $poolValues := index $values.agent.pools .pool -}}
{{- $capacity := $values.agent.capacityTokens -}}
{{- if not (kindIs "invalid" $poolValues.capacityTokens) -}}
{{- $capacity = $poolValues.capacityTokens -}}
{{- end -}}
{{- $unreserved := $values.agent.unreservedRequestTokens -}}
{{- if not (kindIs "invalid" $poolValues.unreservedRequestTokens) -}}
{{- $unreserved = $poolValues.unreservedRequestTokens -}}
{{- end -}}
{{- $endpoint := "" -}}
{{- $metricsUrl := "" -}}
{{- if .simulated -}}
{{- $endpoint = printf "$(POD_IP):%d" (int $values.simulator.port) -}}
{{- $metricsUrl = printf "http://127.0.0.1:%d/metrics" (int $values.simulator.port) -}}
{{- else -}}
{{- $host := ternary "$(NODE_IP)" .engine.host (eq .engine.host "hostIP") -}}
{{- $endpoint = printf "%s:%d" $host (int .engine.port) -}}
{{- $metricsUrl = printf "http://%s:%d%s" $host (int .engine.port) .engine.metricsPath -}}
{{- end -}}
name: agent
image: {{ include "kvgate.image" $root }}
imagePullPolicy: {{ $values.image.pullPolicy }}
args:
  - agent
  - --listen
  - {{ printf "0.0.0.0:%d" (int $values.agent.port) | quote }}
  - --metrics-listen
  - {{ printf "0.0.0.0:%d" (int $values.agent.metricsPort) | quote }}
  - --endpoint
  - {{ $endpoint | quote }}
  - --engine-metrics
  - {{ $metricsUrl | quote }}
  - --nvml
  - {{ ternary "fake" $values.agent.nvml .simulated | quote }}
  - --period-ms
  - {{ $values.agent.periodMs | quote }}
  - --safety-ratio
  - {{ $values.agent.safetyRatio | quote }}
  {{- range $key, $flag := dict "safetyRatioMin" "--safety-ratio-min" "safetyRatioMax" "--safety-ratio-max" "heartbeatMs" "--heartbeat-ms" "idleScrapeMs" "--idle-scrape-ms" }}
  {{- $value := index $values.agent $key }}
  {{- if not (kindIs "invalid" $value) }}
  - {{ $flag }}
  - {{ $value | quote }}
  {{- end }}
  {{- end }}
  - --node-name
  - {{ ternary "$(POD_NAME)" "$(NODE_NAME)" .simulated }}
  {{- if gt (int $capacity) 0 }}
  # Engines that publish no KV figures (TGI, llama.cpp) need it: the node then admits on reservations alone.
  - --capacity-tokens
  - {{ $capacity | int | quote }}
  {{- end }}
  {{- if not (kindIs "invalid" $unreserved) }}
  - --unreserved-request-tokens
  - {{ $unreserved | int | quote }}
  {{- end }}
  # Soft pools (docs/operations.md, "Soft pools"): the node's role and, interactive, its lending limits.
  - --role
  - {{ $poolValues.role | default .pool | quote }}
  {{- range $key, $flag := dict "chatReserveMinShare" "--chat-reserve-min-share" "chatReserveFactor" "--chat-reserve-factor" "chatReserveWindowSeconds" "--chat-reserve-window-s" "maxPromptTokens" "--lend-max-prompt-tokens" "prefillBudgetTokens" "--lend-prefill-budget-tokens" "maxPrefills" "--lend-max-prefills" "prefillTokensPerS" "--prefill-tokens-per-s" }}
  {{- $value := index ($poolValues.lending | default dict) $key }}
  {{- if not (kindIs "invalid" $value) }}
  - {{ $flag }}
  - {{ $value | quote }}
  {{- end }}
  {{- end }}
  {{- if $tls.enabled }}
  - --tls-cert
  - {{ printf "%s/tls.crt" $tlsDir }}
  - --tls-key
  - {{ printf "%s/tls.key" $tlsDir }}
  {{- if $tls.clientAuth }}
  - --tls-client-ca
  - {{ printf "%s/ca.crt" $tlsDir }}
  {{- end }}
  {{- end }}
  {{- with $values.agent.extraArgs }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
env:
  {{- if .simulated }}
  - name: POD_NAME
    valueFrom:
      fieldRef:
        fieldPath: metadata.name
  - name: POD_IP
    valueFrom:
      fieldRef:
        fieldPath: status.podIP
  {{- else }}
  - name: NODE_NAME
    valueFrom:
      fieldRef:
        fieldPath: spec.nodeName
  - name: NODE_IP
    valueFrom:
      fieldRef:
        fieldPath: status.hostIP
  # Every GPU of the node is visible to NVML, yet none is requested from the device plugin,
  # so the agent never takes a GPU away from the engine.
  - name: NVIDIA_VISIBLE_DEVICES
    value: all
  - name: NVIDIA_DRIVER_CAPABILITIES
    value: utility
  {{- end }}
  {{- include "kvgate.otelEnv" $root | nindent 2 }}
  {{- with $values.agent.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
ports:
  - name: grpc
    containerPort: {{ $values.agent.port }}
    protocol: TCP
  - name: metrics
    containerPort: {{ $values.agent.metricsPort }}
    protocol: TCP
readinessProbe:
  {{- include "kvgate.grpcProbe" (list $tls.enabled $values.agent.port) | nindent 2 }}
  periodSeconds: 5
livenessProbe:
  {{- include "kvgate.grpcProbe" (list $tls.enabled $values.agent.port) | nindent 2 }}
  initialDelaySeconds: 10
  periodSeconds: 10
resources:
  {{- toYaml $values.agent.resources | nindent 2 }}
securityContext:
  {{- include "kvgate.containerSecurityContext" $root | nindent 2 }}
volumeMounts:
  - name: tmp
    mountPath: /tmp
  {{- if $tls.enabled }}
  {{- include "kvgate.tls.mount" "agents" | nindent 2 }}
  {{- end }}
{{- end -}}

{{- define "kvgate.agent.volumes" -}}
{{- $tls := .Values.tls.agents -}}
- name: tmp
  emptyDir: {}
{{- if $tls.enabled }}
{{- /* Serving the gate: its own certificate; with clientAuth, the CA of the gate's certificate. */}}
{{ include "kvgate.tls.volume" (dict
      "name" "tls-agents"
      "cert" (include "kvgate.tls.agents.secretName" .)
      "ca" (ternary (include "kvgate.tls.agents.clientSecretName" .) "" $tls.clientAuth)) }}
{{- end }}
{{- end -}}
