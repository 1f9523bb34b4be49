{{/*
envoy.routePolicies laid out as Envoy's route table carries them, the same layout as
kvgate.envoyconfig.routepolicy (a test keeps the standalone bootstrap equal to `kvgate envoy-config`'s):
- entries naming the same hosts share one virtual host, named after the first of them; the one among
  them without a pathPrefix is that host's policy. Host lists that overlap without being the same are
  refused: Envoy puts a domain in one virtual host only;
- an entry with a pathPrefix is a set of routes under that prefix in every virtual host it applies to
  (its hosts', or every one when it names none), longest prefix first; an every-host entry and a host's
  entry with the same prefix make one set, the host's values winning key by key.
As JSON (`include "kvgate.routePolicies" . | fromJson`):
  {"hosts": [{"name", "hosts", "metadata", "paths": [{"prefix", "metadata", "merged"}]}],
   "paths": [{"prefix", "metadata", "merged"}]}
`metadata` is a list of {key, value} in a fixed key order (the route's own entries: Envoy lays them over
its virtual host's); `merged` is the virtual host's entries with the route's laid over them, for the
meshes where the chart can only reach routes.
*/}}
{{/* chartKey:metadataKey, in metadata order: the route-policy table of kvgate.config.routekeys (a test
keeps this line, and the schema's envoy.routePolicies properties, equal to it). */}}
{{- define "kvgate.routePolicies.keys" -}}
interactiveMaxTokens:x-kvgate-interactive-max-tokens,maxTotalTokens:x-kvgate-max-total-tokens,defaultOutputTokens:x-kvgate-default-output-tokens,modelPolicy:x-kvgate-model-policy,async:x-kvgate-async,maxPriority:x-kvgate-max-priority,tenantClass:x-kvgate-tenant-class
{{- end -}}

{{/* A values dict (x-kvgate-* key -> value) as the ordered {key, value} list. */}}
{{- define "kvgate.routePolicies.ordered" -}}
{{- $values := . -}}
{{- $list := list -}}
{{- range $pair := splitList "," (include "kvgate.routePolicies.keys" nil) -}}
{{- $key := index (splitList ":" $pair) 1 -}}
{{- if hasKey $values $key -}}
{{- $list = append $list (dict "key" $key "value" (index $values $key)) -}}
{{- end -}}
{{- end -}}
{{- toJson $list -}}
{{- end -}}

{{/* Path sets from (dict "paths" prefix->values "base" host values), longest prefix first, as JSON. */}}
{{- define "kvgate.routePolicies.paths" -}}
{{- $sortable := list -}}
{{- range $prefix, $_ := .paths -}}
{{- $sortable = append $sortable (printf "%05d %s" (sub 10000 (len $prefix)) $prefix) -}}
{{- end -}}
{{- $result := list -}}
{{- range $key := sortAlpha $sortable -}}
{{- $prefix := substr 6 (len $key) $key -}}
{{- $values := index $.paths $prefix -}}
{{- $merged := merge (deepCopy $values) $.base -}}
{{- $result = append $result (dict
      "prefix" $prefix
      "metadata" (include "kvgate.routePolicies.ordered" $values | fromJsonArray)
      "merged" (include "kvgate.routePolicies.ordered" $merged | fromJsonArray)) -}}
{{- end -}}
{{- toJson $result -}}
{{- end -}}

{{- define "kvgate.routePolicies" -}}
{{- $policies := (.Values.gate.config | default dict).policies | default dict -}}
{{- $groups := list -}}
{{- $everyHost := dict -}}
{{- $names := dict -}}
{{- range $i, $entry := .Values.envoy.routePolicies | default list -}}
{{- $where := printf "envoy.routePolicies[%d] (%s)" $i $entry.name -}}
{{- if hasKey $names $entry.name -}}
{{- fail (printf "%s: name used twice" $where) -}}
{{- end -}}
{{- $_ := set $names $entry.name true -}}
{{- $priorities := dig "admission" "priorities" (list "high" "normal" "low") ($.Values.gate.config | default dict) -}}
{{- if and $entry.maxPriority (not (has $entry.maxPriority $priorities)) -}}
{{- fail (printf "%s: maxPriority %q is not one of gate.config.admission.priorities (%s)" $where $entry.maxPriority (join ", " $priorities)) -}}
{{- end -}}
{{- if and $entry.modelPolicy (not (hasKey $policies $entry.modelPolicy)) -}}
{{- fail (printf "%s: modelPolicy %q is not an entry of gate.config.policies (known: %s)" $where $entry.modelPolicy (keys $policies | sortAlpha | join ", " | default "none")) -}}
{{- end -}}
{{- $classes := dig "fairness" "classes" dict ($.Values.gate.config | default dict) -}}
{{- if and $entry.tenantClass (not (hasKey $classes $entry.tenantClass)) -}}
{{- fail (printf "%s: tenantClass %q is not an entry of gate.config.fairness.classes (known: %s)" $where $entry.tenantClass (keys $classes | sortAlpha | join ", " | default "none")) -}}
{{- end -}}
{{- if and $entry.interactiveMaxTokens $entry.maxTotalTokens (gt (int $entry.interactiveMaxTokens) (int $entry.maxTotalTokens)) -}}
{{- fail (printf "%s: interactiveMaxTokens (%d) must not exceed maxTotalTokens (%d)" $where (int $entry.interactiveMaxTokens) (int $entry.maxTotalTokens)) -}}
{{- end -}}
{{- $values := dict -}}
{{- range $pair := splitList "," (include "kvgate.routePolicies.keys" nil) -}}
{{- $parts := splitList ":" $pair -}}
{{- if hasKey $entry (index $parts 0) -}}
{{- $value := index $entry (index $parts 0) -}}
{{- $_ := set $values (index $parts 1) (ternary (toString (int64 $value)) (toString $value) (kindIs "float64" $value)) -}}
{{- end -}}
{{- end -}}
{{- if not $entry.hosts -}}
{{- if hasKey $everyHost $entry.pathPrefix -}}
{{- fail (printf "%s: pathPrefix %s is given twice for every host" $where $entry.pathPrefix) -}}
{{- end -}}
{{- $_ := set $everyHost $entry.pathPrefix $values -}}
{{- else -}}
{{- $hosts := $entry.hosts | sortAlpha -}}
{{- $group := dict -}}
{{- range $other := $groups -}}
{{- if eq (join "," $other.hosts) (join "," $hosts) -}}
{{- $group = $other -}}
{{- else -}}
{{- range $host := $hosts -}}
{{- if has $host $other.hosts -}}
{{- fail (printf "%s: host %s is also in route policy %q with other hosts; entries for the same host must list the same hosts (Envoy puts a domain in one virtual host)" $where $host $other.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if not $group -}}
{{- $group = dict "name" $entry.name "hosts" $hosts "paths" dict -}}
{{- $groups = append $groups $group -}}
{{- end -}}
{{- if not $entry.pathPrefix -}}
{{- if hasKey $group "values" -}}
{{- fail (printf "%s: hosts %s already have a policy without pathPrefix" $where (join ", " $hosts)) -}}
{{- end -}}
{{- $_ := set $group "values" $values -}}
{{- else if hasKey $group.paths $entry.pathPrefix -}}
{{- fail (printf "%s: pathPrefix %s is given twice for these hosts" $where $entry.pathPrefix) -}}
{{- else -}}
{{- $_ := set $group.paths $entry.pathPrefix $values -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $hosts := list -}}
{{- range $group := $groups -}}
{{- $base := $group.values | default dict -}}
{{- $paths := dict -}}
{{- range $prefix, $values := $everyHost -}}
{{- $_ := set $paths $prefix (deepCopy $values) -}}
{{- end -}}
{{- range $prefix, $values := $group.paths -}}
{{- $_ := set $paths $prefix (merge (deepCopy $values) (index $paths $prefix | default dict)) -}}
{{- end -}}
{{- $hosts = append $hosts (dict
      "name" $group.name
      "hosts" $group.hosts
      "metadata" (include "kvgate.routePolicies.ordered" $base | fromJsonArray)
      "paths" (include "kvgate.routePolicies.paths" (dict "paths" $paths "base" $base) | fromJsonArray)) -}}
{{- end -}}
{{- toJson (dict
      "hosts" $hosts
      "paths" (include "kvgate.routePolicies.paths" (dict "paths" $everyHost "base" dict) | fromJsonArray)) -}}
{{- end -}}

{{/* An ExtProcPerRoute with the metadata list (the gate's route policy), as typed_per_filter_config. */}}
{{/* The tenant class a {key, value} list names, or "" (kvgate.envoyconfig.bootstrap.tenant_class_of). */}}
{{- define "kvgate.routePolicies.tenantClass" -}}
{{- range . }}{{ if eq .key "x-kvgate-tenant-class" }}{{ .value }}{{ end }}{{ end -}}
{{- end -}}

{{- define "kvgate.routePolicies.extProcPerRoute" -}}
envoy.filters.http.ext_proc:
  "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute
  overrides:
    grpc_initial_metadata:
      {{- range . }}
      - key: {{ .key }}
        value: {{ .value | quote }}
      {{- end }}
{{- end -}}

{{/*
The route scopes of the meshes where the chart writes routes, not virtual hosts (istio, envoy-gateway):
one per set of hosts, each a full route table, as JSON: [{"name", "hosts", "sets": [{"id", "path",
"merged"}]}]. The first scope is every host's (name "", hosts null: the mode's own host list); then one per
policy host. Each scope's sets are its route policy paths (id "path<i>-", longest first) and last the
pool routes for every path (id "", path ""). Only a set's catch-all route needs the policy: Envoy takes
the ext_proc per-route config from the route chosen when the request's headers arrive, before the gate
has set x-kvgate-pool (which Envoy strips from clients), so a header-matching route is never that route.
*/}}
{{- define "kvgate.routePolicies.scopes" -}}
{{- $layout := include "kvgate.routePolicies" . | fromJson -}}
{{- $scopes := list -}}
{{- $sets := list -}}
{{- range $i, $path := $layout.paths -}}
{{- $sets = append $sets (dict "id" (printf "path%d-" $i) "path" $path.prefix "merged" $path.merged) -}}
{{- end -}}
{{- $scopes = append $scopes (dict "name" "" "sets" (append $sets (dict "id" "" "path" "" "merged" list))) -}}
{{- range $host := $layout.hosts -}}
{{- $sets := list -}}
{{- range $i, $path := $host.paths -}}
{{- $sets = append $sets (dict "id" (printf "path%d-" $i) "path" $path.prefix "merged" $path.merged) -}}
{{- end -}}
{{- $sets = append $sets (dict "id" "" "path" "" "merged" $host.metadata) -}}
{{- $scopes = append $scopes (dict "name" $host.name "hosts" $host.hosts "sets" $sets) -}}
{{- end -}}
{{- toJson $scopes -}}
{{- end -}}
