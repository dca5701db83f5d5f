{{- define "jpaged.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "jpaged.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "jpaged.labels" -}}
{{ include "jpaged.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "jpaged.queueName" -}}
{{- .Values.kueue.queueName | default (include "jpaged.fullname" .) -}}
{{- end -}}

{{- define "jpaged.clusterQueueName" -}}
{{- .Values.kueue.clusterQueue.name | default (include "jpaged.fullname" .) -}}
{{- end -}}

{{/* Workload labels: Kueue admits a Deployment or LeaderWorkerSet that names its LocalQueue. */}}
{{- define "jpaged.workloadLabels" -}}
{{ include "jpaged.labels" . }}
{{- if .Values.kueue.enabled }}
kueue.x-k8s.io/queue-name: {{ include "jpaged.queueName" . }}
{{- end }}
{{- end -}}

{{/* A dict of values as `jpaged serve` flags: camelCase -> --kebab-case; true -> --x, false -> --no-x, null left
out; a list -> the flag then each item; whole numbers printed as integers (YAML numbers reach templates as
float64). */}}
{{- define "jpaged.flags" -}}
{{- range $key, $value := . }}
{{- $flag := kebabcase $key }}
{{- if kindIs "bool" $value }}
- {{ printf "--%s%s" (ternary "" "no-" $value) $flag | quote }}
{{- else if kindIs "slice" $value }}
{{- if $value }}
- {{ printf "--%s" $flag | quote }}
{{- range $value }}
- {{ . | toString | quote }}
{{- end }}
{{- end }}
{{- else if not (kindIs "invalid" $value) }}
- {{ printf "--%s" $flag | quote }}
{{- if and (kindIs "float64" $value) (eq $value (floor $value)) }}
- {{ int64 $value | toString | quote }}
{{- else }}
- {{ $value | toString | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "jpaged.image" -}}
{{- $tag := required "image.tag must name a version" .Values.image.tag | toString -}}
{{- if eq $tag "latest" -}}
{{- fail "image.tag must name a version, not latest: a restarted pod must run what was tested" -}}
{{- end -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* The seconds a pod gets from its deletion to SIGKILL: the preStop wait, the server's drain, a margin. */}}
{{- define "jpaged.terminationGracePeriodSeconds" -}}
{{- add .Values.preStopSleepSeconds (ceil .Values.server.shutdownGracePeriod) .Values.terminationGraceMarginSeconds -}}
{{- end -}}

{{/* The container's resources, with the accelerators requested and limited (device plugins need both). */}}
{{- define "jpaged.resources" -}}
{{- $requests := deepCopy (.Values.resources.requests | default dict) -}}
{{- $limits := deepCopy (.Values.resources.limits | default dict) -}}
{{- if .Values.accelerator.resource -}}
{{- $_ := set $requests .Values.accelerator.resource (int .Values.accelerator.count) -}}
{{- $_ := set $limits .Values.accelerator.resource (int .Values.accelerator.count) -}}
{{- end -}}
requests: {{- toYaml $requests | nindent 2 }}
limits: {{- toYaml $limits | nindent 2 }}
{{- end -}}

{{/* The engine's pod: role "server" runs the HTTP server (a Deployment's pods, a LeaderWorkerSet's leader),
role "worker" follows the leader through jax.distributed. Both run the same command; only the process id differs. */}}
{{- define "jpaged.podSpec" -}}
{{- $root := .root -}}
{{- $values := $root.Values -}}
{{- $server := eq .role "server" -}}
{{- with $values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
terminationGracePeriodSeconds: {{ include "jpaged.terminationGracePeriodSeconds" $root }}
securityContext: {{- toYaml $values.podSecurityContext | nindent 2 }}
{{- with $values.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  - name: {{ ternary "jpaged" "jpaged-worker" $server }}
    image: {{ include "jpaged.image" $root | quote }}
    imagePullPolicy: {{ $values.image.pullPolicy }}
    command: ["jpaged", "serve"]
    args:
      {{- with $values.model.name }}
      - {{ . | quote }}
      {{- end }}
      - "--host"
      - "0.0.0.0"
      - "--port"
      - {{ $values.service.port | toString | quote }}
      {{- include "jpaged.flags" $values.server | trim | nindent 6 }}
      {{- include "jpaged.flags" $values.engine | trim | nindent 6 }}
      {{- if $values.multihost.enabled }}
      - "--distributed"
      {{- end }}
      {{- range $values.extraArgs }}
      - {{ . | quote }}
      {{- end }}
    env:
      {{- if $values.multihost.enabled }}
      # LeaderWorkerSet puts LWS_* first in the container's env, so these can refer to them.
      - name: JAX_COORDINATOR_ADDRESS
        value: "$(LWS_LEADER_ADDRESS):{{ $values.multihost.coordinatorPort }}"
      - name: JAX_NUM_PROCESSES
        value: "$(LWS_GROUP_SIZE)"
      - name: JAX_PROCESS_ID
        value: "$(LWS_WORKER_INDEX)"
      - name: JPAGED_CONTROL_PORT
        value: {{ $values.multihost.controlPort | toString | quote }}
      {{- end }}
      - name: HOME
        value: /tmp
      - name: JPAGED_CACHE_DIR
        value: {{ $values.cache.mountPath | quote }}
      - name: JPAGED_KERNEL_CACHE
        value: {{ printf "%s/kernels" $values.cache.mountPath | quote }}
      - name: HF_HOME
        value: {{ printf "%s/huggingface" $values.cache.mountPath | quote }}
      {{- if $values.apiKey.secretName }}
      - name: JPAGED_API_KEY
        valueFrom:
          secretKeyRef: {name: {{ $values.apiKey.secretName | quote }}, key: {{ $values.apiKey.secretKey | quote }}}
      {{- end }}
      {{- if $values.model.hfTokenSecret.name }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef: {name: {{ $values.model.hfTokenSecret.name | quote }}, key: {{ $values.model.hfTokenSecret.key | quote }}}
      {{- end }}
    ports:
      {{- if $server }}
      - {name: http, containerPort: {{ $values.service.port }}, protocol: TCP}
      {{- end }}
      {{- if $values.multihost.enabled }}
      - {name: coordinator, containerPort: {{ $values.multihost.coordinatorPort }}, protocol: TCP}
      - {name: control, containerPort: {{ $values.multihost.controlPort }}, protocol: TCP}
      {{- end }}
    {{- if $server }}
    # /health is liveness (200 while loading and draining), /ready readiness (200 from the end of warm-up to SIGTERM).
    livenessProbe:
      httpGet: {path: /health, port: http}
      {{- toYaml $values.probes.liveness | nindent 6 }}
    readinessProbe:
      httpGet: {path: /ready, port: http}
      {{- toYaml $values.probes.readiness | nindent 6 }}
    lifecycle:
      preStop:
        exec:
          command: ["sleep", {{ $values.preStopSleepSeconds | toString | quote }}]
    {{- end }}
    resources: {{- include "jpaged.resources" $root | nindent 6 }}
    securityContext: {{- toYaml $values.securityContext | nindent 6 }}
    volumeMounts:
      - {name: cache, mountPath: {{ $values.cache.mountPath | quote }}}
      - {name: tmp, mountPath: /tmp}
      - {name: dshm, mountPath: /dev/shm}
      {{- if $values.model.volume }}
      - {name: models, mountPath: {{ $values.model.mountPath | quote }}, readOnly: true}
      {{- end }}
volumes:
  - name: cache
    {{- toYaml $values.cache.volume | nindent 4 }}
  - name: tmp
    emptyDir: {}
  - name: dshm
    emptyDir: {medium: Memory, sizeLimit: {{ $values.shmSizeLimit }}}
  {{- with $values.model.volume }}
  - name: models
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{- define "jpaged.podMetadata" -}}
{{- $root := .root -}}
labels:
  {{- include "jpaged.selectorLabels" $root | nindent 2 }}
  app.kubernetes.io/component: {{ .role }}
  {{- with $root.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- $annotations := deepCopy ($root.Values.podAnnotations | default dict) }}
{{- if and (eq .role "server") $root.Values.metrics.enabled (not (include "jpaged.serviceMonitor" $root)) }}
{{- $_ := set $annotations "prometheus.io/scrape" "true" }}
{{- $_ := set $annotations "prometheus.io/port" ($root.Values.service.port | toString) }}
{{- $_ := set $annotations "prometheus.io/path" "/metrics" }}
{{- end }}
{{- with $annotations }}
annotations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* "true" when a ServiceMonitor is rendered: wanted, and the Prometheus operator's CRD is in the cluster. */}}
{{- define "jpaged.serviceMonitor" -}}
{{- if and .Values.metrics.enabled .Values.metrics.serviceMonitor.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor") -}}
true
{{- end -}}
{{- end -}}
