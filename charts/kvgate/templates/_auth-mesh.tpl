{{/*
auth.method on a mesh's gateway (docs/helm.md, "Identity and tenants"): the mesh's own objects verify the
identity and write x-kvgate-tenant / x-kvgate-priority, after the chart's early header mutation removed the
client's copies.
*/}}

{{/*
The hosts the chart routes on an Istio gateway (envoy.istio.hosts and every route policy's), each also with
any port, as an AuthorizationPolicy's operation.hosts; empty when one of them is "*" (the whole gateway is
kvgate's). A policy on the gateway workload must not refuse another application's requests.
*/}}
{{- define "kvgate.istio.authHosts" -}}
{{- $hosts := .Values.envoy.istio.hosts -}}
{{- range $host := (include "kvgate.routePolicies" . | fromJson).hosts -}}
{{- $hosts = concat $hosts $host.hosts -}}
{{- end -}}
{{- $result := list -}}
{{- if not (has "*" $hosts) -}}
{{- range $host := $hosts | uniq -}}
{{- $result = append $result $host -}}
{{- $result = append $result (printf "%s:*" $host) -}}
{{- end -}}
{{- end -}}
{{- toJson $result -}}
{{- end -}}

{{/* The AuthorizationPolicy rules scoped to the chart's hosts (with `from`, the callers'), as YAML. */}}
{{- define "kvgate.istio.authRules" -}}
{{- $hosts := include "kvgate.istio.authHosts" .root | fromJsonArray -}}
{{- $rule := dict -}}
{{- with .from -}}
{{- $_ := set $rule "from" . -}}
{{- end -}}
{{- with $hosts -}}
{{- $_ := set $rule "to" (list (dict "operation" (dict "hosts" .))) -}}
{{- end -}}
{{- toYaml (list $rule) -}}
{{- end -}}

{{/*
Istio (security.istio.io/v1): jwt is a RequestAuthentication whose outputClaimToHeaders writes the claims
into the gate's headers, and, unless allowMissing, an AuthorizationPolicy that refuses requests without a
valid token (a RequestAuthentication alone lets a request without any token through); extAuthz is an
AuthorizationPolicy with action CUSTOM naming your mesh config's extensionProvider. mtls needs no object:
the Gateway's server (tls.mode MUTUAL) checks certificates and the EnvoyFilter's identity filter copies the
URI SAN.
*/}}
{{- define "kvgate.istio.auth" -}}
{{- $auth := .Values.auth -}}
{{- $istio := .Values.envoy.istio -}}
{{- if eq $auth.method "jwt" }}
{{- $jwt := $auth.jwt }}
---
apiVersion: security.istio.io/v1
kind: RequestAuthentication
metadata:
  name: {{ include "kvgate.fullname" . }}-jwt
  namespace: {{ $istio.namespace }}
  labels:
    {{- include "kvgate.labels" . | nindent 4 }}
spec:
  selector:
    matchLabels:
      {{- toYaml $istio.workloadSelector | nindent 6 }}
  jwtRules:
    - issuer: {{ $jwt.issuer | quote }}
      {{- with $jwt.audiences }}
      audiences:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $jwt.jwks.remoteUri }}
      jwksUri: {{ $jwt.jwks.remoteUri | quote }}
      {{- else }}
      jwks: {{ $jwt.jwks.inline | quote }}
      {{- end }}
      forwardOriginalToken: {{ $jwt.forwardToken }}
      outputClaimToHeaders:
        - header: {{ include "kvgate.tenantHeader" . }}
          claim: {{ $jwt.tenantClaim }}
        - header: {{ include "kvgate.priorityHeader" . }}
          claim: {{ $jwt.priorityClaim }}
{{- if not $jwt.allowMissing }}
---
# Without this, a request that carries no token at all passes the RequestAuthentication.
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata:
  name: {{ include "kvgate.fullname" . }}-require-jwt
  namespace: {{ $istio.namespace }}
  labels:
    {{- include "kvgate.labels" . | nindent 4 }}
spec:
  selector:
    matchLabels:
      {{- toYaml $istio.workloadSelector | nindent 6 }}
  action: DENY
  rules:
    {{- include "kvgate.istio.authRules" (dict "root" . "from" (list (dict "source" (dict "notRequestPrincipals" (list "*"))))) | nindent 4 }}
{{- end }}
{{- else if eq $auth.method "extAuthz" }}
---
# The extensionProvider (meshConfig.extensionProviders) decides each request and sets the tenant headers
# (its headersToUpstreamOnAllow must list auth.extAuthz.headers).
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata:
  name: {{ include "kvgate.fullname" . }}-ext-authz
  namespace: {{ $istio.namespace }}
  labels:
    {{- include "kvgate.labels" . | nindent 4 }}
spec:
  selector:
    matchLabels:
      {{- toYaml $istio.workloadSelector | nindent 6 }}
  action: CUSTOM
  provider:
    name: {{ $auth.extAuthz.istioProvider }}
  rules:
    {{- include "kvgate.istio.authRules" (dict "root" . "from" list) | nindent 4 }}
{{- end }}
{{- end -}}

{{/*
Envoy Gateway (gateway.envoyproxy.io/v1alpha1 SecurityPolicy on the Gateway, api/v1alpha1/jwt_types.go and
ext_auth_types.go, envoyproxy/gateway d32f28294245e454d20f81d323d626a90e660c1e): jwt with claimToHeaders,
or extAuth with the headers it may set. mtls: the ClientTrafficPolicy's clientValidation and an
EnvoyPatchPolicy (envoy-gateway.yaml).
*/}}
{{- define "kvgate.envoyGateway.securityPolicy" -}}
{{- $auth := .Values.auth -}}
{{- $eg := .Values.envoy.envoyGateway -}}
{{- if has $auth.method (list "jwt" "extAuthz") }}
---
apiVersion: gateway.envoyproxy.io/v1alpha1
kind: SecurityPolicy
metadata:
  name: {{ include "kvgate.fullname" . }}
  namespace: {{ $eg.gatewayNamespace }}
  labels:
    {{- include "kvgate.labels" . | nindent 4 }}
spec:
  targetRefs:
    - group: gateway.networking.k8s.io
      kind: Gateway
      name: {{ $eg.gatewayName }}
  {{- if eq $auth.method "jwt" }}
  {{- $jwt := $auth.jwt }}
  jwt:
    # true: a request without a token passes (the tenant anonymous); an invalid one is refused.
    optional: {{ $jwt.allowMissing }}
    providers:
      - name: kvgate
        issuer: {{ $jwt.issuer | quote }}
        {{- with $jwt.audiences }}
        audiences:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        {{- if $jwt.jwks.remoteUri }}
        remoteJWKS:
          uri: {{ $jwt.jwks.remoteUri | quote }}
          cacheDuration: {{ printf "%ds" (int $jwt.jwks.cacheSeconds) }}
        {{- else }}
        localJWKS:
          type: Inline
          inline: {{ $jwt.jwks.inline | quote }}
        {{- end }}
        claimToHeaders:
          - header: {{ include "kvgate.tenantHeader" . }}
            claim: {{ $jwt.tenantClaim }}
          - header: {{ include "kvgate.priorityHeader" . }}
            claim: {{ $jwt.priorityClaim }}
  {{- else }}
  {{- $authz := $auth.extAuthz }}
  extAuth:
    # An unreachable authorization service refuses requests rather than admitting them unchecked.
    failOpen: false
    timeout: {{ printf "%dms" (int $authz.timeoutMs) }}
    {{ $authz.protocol }}:
      backendRefs:
        - {{ include "kvgate.serviceBackendRef" (list . (dict "address" $authz.address "port" $authz.port)) | nindent 10 | trim }}
      {{- if eq $authz.protocol "http" }}
      headersToBackend:
        {{- toYaml $authz.headers | nindent 8 }}
      {{- end }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The Gateway's xDS listener names the EnvoyPatchPolicies patch, as JSON. */}}
{{- define "kvgate.envoyGateway.listeners" -}}
{{- $eg := .Values.envoy.envoyGateway -}}
{{- toJson ($eg.requestDecompression.listeners | default (list (printf "%s/%s/http" $eg.gatewayNamespace $eg.gatewayName))) -}}
{{- end -}}
