{{/* Names and labels shared by every object of the release. */}}

{{- define "quiver.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "quiver.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "quiver.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "quiver.selectorLabels" -}}
app.kubernetes.io/name: {{ include "quiver.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "quiver.labels" -}}
helm.sh/chart: {{ include "quiver.chart" . }}
{{ include "quiver.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "quiver.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "quiver.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "quiver.modelCacheClaim" -}}
{{- default (printf "%s-model-cache" (include "quiver.fullname" .)) .Values.modelCache.persistence.existingClaim }}
{{- end }}

{{- define "quiver.sharedMemory" -}}
{{- if or .Values.sharedMemory.enabled (gt (int .Values.model.numShard) 1) }}true{{ end }}
{{- end }}

{{/* "true" when /metrics is served without a key (--metrics-open): as set, else with an
InferencePool, whose endpoint picker cannot send one. */}}
{{- define "quiver.metricsOpen" -}}
{{- $open := .Values.server.metricsOpen }}
{{- if kindIs "invalid" $open }}
{{- if .Values.inferencePool.enabled }}true{{ end }}
{{- else if $open }}true{{ end }}
{{- end }}

{{/* SIGTERM to exit: the drain, then the router's 5 s and the shards' 10 s, plus margin. */}}
{{- define "quiver.terminationGracePeriod" -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add .Values.preStopSleepSeconds .Values.server.gracefulShutdownSecs 30 }}
{{- else }}
{{- .Values.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* One `--flag value` pair per set value, as YAML list items. */}}
{{- define "quiver.flag" -}}
{{- if not (kindIs "invalid" .value) }}
{{- $text := toString .value }}
{{- /* YAML numbers arrive as float64, which prints 4194304 as 4.194304e+06. */}}
{{- if and (kindIs "float64" .value) (eq (float64 (int64 .value)) .value) }}
{{- $text = toString (int64 .value) }}
{{- end }}
{{- if ne $text "" }}
- {{ .flag | quote }}
- {{ $text | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The launcher's command line (docs/flags.md). */}}
{{- define "quiver.args" -}}
{{- $v := .Values }}
{{- include "quiver.flag" (dict "flag" "--hostname" "value" $v.server.hostname) }}
{{- include "quiver.flag" (dict "flag" "--port" "value" $v.server.port) }}
{{- include "quiver.flag" (dict "flag" "--model-id" "value" $v.model.id) }}
{{- include "quiver.flag" (dict "flag" "--revision" "value" $v.model.revision) }}
{{- include "quiver.flag" (dict "flag" "--served-model-name" "value" $v.model.servedModelName) }}
{{- include "quiver.flag" (dict "flag" "--dtype" "value" $v.model.dtype) }}
{{- include "quiver.flag" (dict "flag" "--device" "value" $v.model.device) }}
{{- include "quiver.flag" (dict "flag" "--num-shard" "value" $v.model.numShard) }}
{{- include "quiver.flag" (dict "flag" "--cache-dir" "value" $v.modelCache.mountPath) }}
{{- include "quiver.flag" (dict "flag" "--graceful-shutdown-secs" "value" $v.server.gracefulShutdownSecs) }}
{{- include "quiver.flag" (dict "flag" "--shard-startup-timeout-secs" "value" $v.server.shardStartupTimeoutSecs) }}
{{- include "quiver.flag" (dict "flag" "--body-read-timeout-secs" "value" $v.server.bodyReadTimeoutSecs) }}
{{- include "quiver.flag" (dict "flag" "--body-read-min-rate" "value" $v.server.bodyReadMinRate) }}
{{- if include "quiver.metricsOpen" . }}
{{- include "quiver.flag" (dict "flag" "--metrics-open" "value" "true") }}
{{- end }}
{{- include "quiver.flag" (dict "flag" "--max-input-tokens" "value" $v.limits.maxInputTokens) }}
{{- include "quiver.flag" (dict "flag" "--max-total-tokens" "value" $v.limits.maxTotalTokens) }}
{{- include "quiver.flag" (dict "flag" "--max-batch-prefill-tokens" "value" $v.limits.maxBatchPrefillTokens) }}
{{- include "quiver.flag" (dict "flag" "--max-batch-total-tokens" "value" $v.limits.maxBatchTotalTokens) }}
{{- include "quiver.flag" (dict "flag" "--max-batch-size" "value" $v.limits.maxBatchSize) }}
{{- include "quiver.flag" (dict "flag" "--max-concurrent-requests" "value" $v.limits.maxConcurrentRequests) }}
{{- include "quiver.flag" (dict "flag" "--max-queue-wait-secs" "value" $v.limits.maxQueueWaitSecs) }}
{{- include "quiver.flag" (dict "flag" "--max-request-body-bytes" "value" $v.limits.maxRequestBodyBytes) }}
{{- include "quiver.flag" (dict "flag" "--max-logprob-entries" "value" $v.limits.maxLogprobEntries) }}
{{- include "quiver.flag" (dict "flag" "--prefix-caching" "value" $v.scheduling.prefixCaching) }}
{{- include "quiver.flag" (dict "flag" "--chunked-prefill" "value" $v.scheduling.chunkedPrefill) }}
{{- include "quiver.flag" (dict "flag" "--prefill-pace" "value" $v.scheduling.prefillPace) }}
{{- include "quiver.flag" (dict "flag" "--mixed-prefill" "value" $v.scheduling.mixedPrefill) }}
{{- include "quiver.flag" (dict "flag" "--gpu-memory-fraction" "value" $v.memory.gpuMemoryFraction) }}
{{- include "quiver.flag" (dict "flag" "--cpu-kv-cache-gib" "value" $v.memory.cpuKvCacheGib) }}
{{- include "quiver.flag" (dict "flag" "--adapter-source" "value" $v.adapters.source) }}
{{- if $v.adapters.volume.enabled }}
{{- include "quiver.flag" (dict "flag" "--adapter-root" "value" $v.adapters.volume.mountPath) }}
{{- end }}
{{- if $v.adapters.s3Buckets }}
{{- include "quiver.flag" (dict "flag" "--s3-adapter-buckets" "value" (join "," $v.adapters.s3Buckets)) }}
{{- end }}
{{- if $v.adapters.preload }}
{{- include "quiver.flag" (dict "flag" "--preload-adapters" "value" (join "," $v.adapters.preload)) }}
{{- end }}
{{- include "quiver.flag" (dict "flag" "--max-active-adapters" "value" $v.adapters.maxActiveAdapters) }}
{{- include "quiver.flag" (dict "flag" "--max-lora-rank" "value" $v.adapters.maxLoraRank) }}
{{- include "quiver.flag" (dict "flag" "--lora-rank-classes" "value" $v.adapters.loraRankClasses) }}
{{- include "quiver.flag" (dict "flag" "--max-cpu-adapters" "value" $v.adapters.maxCpuAdapters) }}
{{- include "quiver.flag" (dict "flag" "--adapter-disk-cache-gib" "value" $v.adapters.diskCacheGib) }}
{{- if $v.secrets.apiKeysFile.secretName }}
{{- include "quiver.flag" (dict "flag" "--api-keys-file" "value" (printf "%s/%s" $v.secrets.apiKeysFile.mountPath $v.secrets.apiKeysFile.key)) }}
{{- end }}
{{- if $v.server.jsonLogs }}
- "--json-logs"
{{- end }}
{{- range $v.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* Startup probe failures allowed: enough for the launcher's own shard start-up timeout and
the router's start, unless set. */}}
{{- define "quiver.startupFailureThreshold" -}}
{{- $probe := .Values.probes.startup }}
{{- if kindIs "invalid" $probe.failureThreshold }}
{{- $period := int $probe.periodSeconds }}
{{- div (add .Values.server.shardStartupTimeoutSecs 60 $period -1) $period }}
{{- else }}
{{- $probe.failureThreshold }}
{{- end }}
{{- end }}
