{{/*
TLS wiring (docs/tls.md, "TLS in the chart"). Each link has one directory, mounted in both of its
workloads: /etc/kvgate-tls/gate (Envoy -> gate) and /etc/kvgate-tls/agents (gate -> agents). In each
pod, tls.crt and tls.key there are that pod's own certificate for the link and ca.crt is the CA it
checks the peer against, projected from the peer's Secret alone: the peer's key never leaves it.
*/}}
{{- define "kvgate.tls.dir" -}}
{{- printf "/etc/kvgate-tls/%s" . -}}
{{- end -}}

{{/* Fails the render, naming the value, for TLS settings the chart cannot wire. */}}
{{- define "kvgate.tls.check" -}}
{{- $gate := .Values.tls.gate -}}
{{- $agents := .Values.tls.agents -}}
{{- if and $gate.clientAuth (not $gate.enabled) -}}
{{- fail "tls.gate.clientAuth needs tls.gate.enabled: client certificates are checked over TLS" -}}
{{- end -}}
{{- if and $agents.clientAuth (not $agents.enabled) -}}
{{- fail "tls.agents.clientAuth needs tls.agents.enabled: client certificates are checked over TLS" -}}
{{- end -}}
{{- if $gate.enabled -}}
{{- if not (has .Values.envoy.mode (list "standalone" "none")) -}}
{{- fail (printf "tls.gate.enabled is not supported with envoy.mode=%s: the chart does not give that mesh's Envoy a TLS context for the gate, so it would fail open on every request. Secure Envoy -> gate the mesh's way instead (Istio: sidecar mTLS; Envoy Gateway: a BackendTLSPolicy) and leave tls.gate.enabled false; tls.agents works in every mode" .Values.envoy.mode) -}}
{{- end -}}
{{- $_ := required "tls.gate.secretName is required when tls.gate.enabled is true: the Secret with the gate's certificate (tls.crt, tls.key, ca.crt)" $gate.secretName -}}
{{- if $gate.clientAuth -}}
{{- $_ := required "tls.gate.clientSecretName is required when tls.gate.clientAuth is true: the Secret with Envoy's client certificate, whose ca.crt the gate trusts" $gate.clientSecretName -}}
{{- end -}}
{{- end -}}
{{- if $agents.enabled -}}
{{- $_ := required "tls.agents.secretName is required when tls.agents.enabled is true: the Secret with the agents' certificate (tls.crt, tls.key, ca.crt)" $agents.secretName -}}
{{- if $agents.clientAuth -}}
{{- $_ := required "tls.agents.clientSecretName is required when tls.agents.clientAuth is true: the Secret with the gate's client certificate, whose ca.crt the agents trust" $agents.clientSecretName -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The volume of one link's directory: (dict "name" "tls-gate" "cert" SECRET "ca" SECRET), either may be
empty. tls.crt and tls.key come from `cert`, ca.crt from `ca`. A projected Secret is updated in place
(the kubelet swaps a symlink), which kvgate and Envoy's file-based SDS both notice. 0440 with the pod's
fsGroup: readable by the container's group only.
*/}}
{{- define "kvgate.tls.volume" -}}
- name: {{ .name }}
  projected:
    defaultMode: 0440
    sources:
      {{- with .cert }}
      - secret:
          name: {{ . }}
          items:
            - key: tls.crt
              path: tls.crt
            - key: tls.key
              path: tls.key
      {{- end }}
      {{- with .ca }}
      - secret:
          name: {{ . }}
          items:
            - key: ca.crt
              path: ca.crt
      {{- end }}
{{- end -}}

{{- define "kvgate.tls.mount" -}}
- name: {{ printf "tls-%s" . }}
  mountPath: {{ include "kvgate.tls.dir" . }}
  readOnly: true
{{- end -}}

{{/*
A probe of a gRPC port: (list TLS-ON PORT). The kubelet's grpc probe cannot speak TLS, so with TLS on
it only checks that the port accepts connections (the code has no plaintext health port). A TCP
connect that closes without a handshake logs nothing on the gate or the agent.
*/}}
{{- define "kvgate.grpcProbe" -}}
{{- if index . 0 -}}
tcpSocket:
  port: {{ index . 1 }}
{{- else -}}
grpc:
  port: {{ index . 1 }}
{{- end -}}
{{- end -}}


{{/* A client of the agents (the gate, the queue): the CA of their certificate; with clientAuth, its own. */}}
{{- define "kvgate.tls.agentsClientVolume" -}}
{{- $tls := .Values.tls.agents -}}
{{- if $tls.enabled }}
{{- include "kvgate.tls.volume" (dict
      "name" "tls-agents"
      "cert" (ternary $tls.clientSecretName "" $tls.clientAuth)
      "ca" $tls.secretName) }}
{{- end }}
{{- end -}}
