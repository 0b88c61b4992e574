{{/*
Names, labels and the pieces shared by the plain manifests (head Deployment, worker
StatefulSets) and the KubeRay RayCluster: both render the same pod specs from here.
*/}}

{{/* The GCS port of `ray start --head` and the dashboard port (Ray's defaults). */}}
{{- define "halfmoon.gcsPort" -}}6379{{- end }}
{{- define "halfmoon.dashboardPort" -}}8265{{- end }}

{{- define "halfmoon.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/* Base name of every resource; 40 characters leave room for "-prefill-NN" pod names. */}}
{{- define "halfmoon.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "halfmoon.selectorLabels" -}}
app.kubernetes.io/name: {{ include "halfmoon.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "halfmoon.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "halfmoon.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: halfmoon
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "head") */}}
{{- define "halfmoon.componentSelector" -}}
{{ include "halfmoon.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "halfmoon.componentLabels" -}}
{{ include "halfmoon.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "halfmoon.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "halfmoon.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "halfmoon.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* Internal Service of the Ray head (GCS, dashboard) and the address workers join. */}}
{{- define "halfmoon.headService" -}}
{{- printf "%s-head" (include "halfmoon.fullname" .) }}
{{- end }}

{{- define "halfmoon.headAddress" -}}
{{- printf "%s.%s.svc:%s" (include "halfmoon.headService" .) .Release.Namespace (include "halfmoon.gcsPort" .) }}
{{- end }}

{{/* Secret names: an existing one when named, else the one this chart generates. */}}
{{- define "halfmoon.redisSecretName" -}}
{{- if .Values.redis.bundled.enabled }}
{{- .Values.redis.bundled.existingSecret | default (printf "%s-redis" (include "halfmoon.fullname" .)) }}
{{- else }}
{{- .Values.redis.external.existingSecret }}
{{- end }}
{{- end }}

{{- define "halfmoon.redisPasswordKey" -}}
{{- if .Values.redis.bundled.enabled }}{{ .Values.redis.bundled.passwordKey }}{{ else }}{{ .Values.redis.external.passwordKey }}{{ end }}
{{- end }}

{{- define "halfmoon.kvSecretName" -}}
{{- .Values.kvTransport.secret.existingSecret | default (printf "%s-kv" (include "halfmoon.fullname" .)) }}
{{- end }}

{{/*
The Redis URL the Conductor gets. The password never appears here: Kubernetes substitutes
$(HALFMOON_REDIS_PASSWORD) from the container's env, which references the Secret.
*/}}
{{- define "halfmoon.redisUrl" -}}
{{- if .Values.redis.bundled.enabled }}
{{- printf "redis://:$(HALFMOON_REDIS_PASSWORD)@%s-redis.%s.svc:6379/0" (include "halfmoon.fullname" .) .Release.Namespace }}
{{- else if .Values.redis.external.existingSecret }}
{{- $parts := splitn "://" 2 .Values.redis.external.url }}
{{- printf "%s://:$(HALFMOON_REDIS_PASSWORD)@%s" $parts._0 $parts._1 }}
{{- else }}
{{- .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/* `--model`: the alias, or the file/folder in the mounted model volume. */}}
{{- define "halfmoon.modelArg" -}}
{{- if eq .Values.model.source "builtin" }}
{{- .Values.model.alias }}
{{- else }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.path) }}
{{- end }}
{{- end }}

{{/* A number as a flag value: whole numbers without a fraction or an exponent (JSON numbers
reach templates as float64, which Go would print as 1.048576e+06). */}}
{{- define "halfmoon.num" -}}
{{- if eq (float64 .) (floor .) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- end }}

{{/* GiB (float) -> bytes (int), for `ray start --object-store-memory`. */}}
{{- define "halfmoon.gibBytes" -}}
{{- mulf . 1073741824.0 | floor | int64 }}
{{- end }}

{{/*
The Conductor: `halfmoon serve` flags, one list item per token (tests parse them with the real
argparse parser, so a flag that does not exist fails the tests).
*/}}
{{- define "halfmoon.serveArgs" -}}
{{- $v := .Values }}
- --ray-address
- auto
- --prefill
- {{ $v.prefill.replicas | int | quote }}
- --decode
- {{ $v.decode.replicas | int | quote }}
{{- if $v.conductor.standby }}
- --standby
- {{ $v.conductor.standby | int | quote }}
{{- end }}
- --worker-threads
- {{ $v.conductor.workerThreads | int | quote }}
- --prefill-gpus
- {{ $v.prefill.gpus | int | quote }}
- --decode-gpus
- {{ $v.decode.gpus | int | quote }}
- --prefill-tp
- {{ $v.prefill.tp | int | quote }}
- --decode-tp
- {{ $v.decode.tp | int | quote }}
- --prefill-resource
- {{ $v.prefill.rayResource | quote }}
- --decode-resource
- {{ $v.decode.rayResource | quote }}
- --host
- 0.0.0.0
- --grpc-port
- {{ $v.conductor.grpcPort | int | quote }}
- --http-port
- {{ $v.conductor.httpPort | int | quote }}
- --kv-transport
- {{ $v.kvTransport.backend | quote }}
- --kv-host
- 0.0.0.0
- --kv-port
- {{ $v.kvTransport.port | int | quote }}
{{- with $v.kvTransport.ucxTls }}
- --ucx-tls
- {{ . | quote }}
{{- end }}
- --ucx-poll-us
- {{ $v.kvTransport.ucxPollUs | int | quote }}
- --redis-url
- {{ include "halfmoon.redisUrl" . | quote }}
- --model
- {{ include "halfmoon.modelArg" . | quote }}
{{- with $v.model.dtype }}
- --dtype
- {{ . | quote }}
{{- end }}
{{- with $v.model.quantization }}
- --quantization
- {{ . | quote }}
{{- end }}
{{- with $v.conductor.servedModelName }}
- --served-model-name
- {{ . | quote }}
{{- end }}
{{- if not $v.conductor.dashboard }}
- --no-dashboard
{{- end }}
{{- with $v.conductor.toolCallParser }}
- --tool-call-parser
- {{ . | quote }}
{{- end }}
{{- if not $v.kvTiers.remoteFetch }}
- --no-remote-fetch
{{- end }}
{{- $t := $v.tracing }}
{{- if $t.enabled }}
- --tracing
{{- range $flag, $value := dict "--otlp-endpoint" $t.endpoint "--otlp-protocol" $t.protocol "--otel-service-name" $t.serviceName "--trace-sampler" $t.sampler "--otel-resource-attributes" $t.resourceAttributes }}
{{- with $value }}
- {{ $flag }}
- {{ . | quote }}
{{- end }}
{{- end }}
{{- if not (kindIs "invalid" $t.sampleRatio) }}
- --trace-sample-ratio
- {{ include "halfmoon.num" $t.sampleRatio | quote }}
{{- end }}
{{- end }}
{{- if ne $v.logs.format "text" }}
- --log-format
- {{ $v.logs.format | quote }}
{{- end }}
{{- if ne $v.logs.level "warning" }}
- --log-level
- {{ $v.logs.level | quote }}
{{- end }}
{{- range $flag, $value := dict "--kv-cache-gb" $v.engine.kvCacheGb "--block-size" $v.engine.blockSize "--max-num-seqs" $v.engine.maxNumSeqs "--prefill-max-seqs" $v.engine.prefillMaxSeqs "--max-num-batched-tokens" $v.engine.maxNumBatchedTokens "--max-model-len" $v.engine.maxModelLen "--num-blocks" $v.engine.numBlocks "--kv-timeout-s" $v.kvTransport.timeoutS "--kv-max-inflight-mb" $v.kvTransport.maxInflightMb "--request-timeout-s" $v.conductor.requestTimeoutS "--migration-attempts" $v.conductor.migrationAttempts "--migration-stall-s" $v.conductor.migrationStallS "--ray-wait-s" $v.conductor.rayWaitS }}
{{- if not (kindIs "invalid" $value) }}
- {{ $flag }}
- {{ include "halfmoon.num" $value | quote }}
{{- end }}
{{- end }}
{{- $l := $v.conductor.limits }}
{{- range $flag, $value := dict "--max-prompt-tokens" $l.maxPromptTokens "--max-tokens-limit" $l.maxTokens "--max-request-bytes" $l.maxRequestBytes "--max-streams-per-client" $l.maxStreamsPerClient "--max-stop" $l.maxStop "--max-stop-chars" $l.maxStopChars "--max-messages" $l.maxMessages "--max-id-chars" $l.maxIdChars }}
{{- if not (kindIs "invalid" $value) }}
- {{ $flag }}
- {{ include "halfmoon.num" $value | quote }}
{{- end }}
{{- end }}
{{- $a := $v.admission }}
{{- with $a.policy }}
- --admission
- {{ . | quote }}
{{- end }}
{{- with $a.defaultClass }}
- --default-class
- {{ . | quote }}
{{- end }}
{{- $c := $a.classes }}
{{- range $flag, $value := dict "--interactive-ttft-ms" $c.interactive.ttftMs "--interactive-tbt-ms" $c.interactive.tbtMs "--standard-ttft-ms" $c.standard.ttftMs "--standard-tbt-ms" $c.standard.tbtMs "--batch-ttft-ms" $c.batch.ttftMs "--batch-tbt-ms" $c.batch.tbtMs "--queue-threshold" $a.queueThreshold "--max-queue-per-worker" $a.maxQueuePerWorker "--shed-headroom" $a.shedHeadroom "--admit-quantile" $a.admitQuantile "--admit-window-ms" $a.admitWindowMs }}
{{- if not (kindIs "invalid" $value) }}
- {{ $flag }}
- {{ include "halfmoon.num" $value | quote }}
{{- end }}
{{- end }}
{{- if eq $a.secondLook false }}
- --no-second-look
{{- end }}
{{- $p := $v.planner }}
{{- with $p.mode }}
- --planner
- {{ . | quote }}
{{- end }}
{{- range $flag, $value := dict "--planner-interval-s" $p.intervalS "--planner-window-s" $p.windowS "--min-prefill" $p.minPrefill "--max-prefill" $p.maxPrefill "--min-decode" $p.minDecode "--max-decode" $p.maxDecode "--planner-min-workers" $p.minWorkers "--planner-max-workers" $p.maxWorkers "--planner-min-gain" $p.minGain "--planner-confirm" $p.confirm "--planner-judge-s" $p.judgeS "--planner-rollback-margin" $p.rollbackMargin "--planner-cooldown-s" $p.cooldownS "--planner-drain-s" $p.drainS }}
{{- if not (kindIs "invalid" $value) }}
- {{ $flag }}
- {{ include "halfmoon.num" $value | quote }}
{{- end }}
{{- end }}
{{- with $v.engine.attentionBackend }}
- --attention-backend
- {{ . | quote }}
{{- end }}
- --device
- {{ $v.engine.device | default (ternary "cuda" "cpu" (eq $v.image.variant "cuda")) | quote }}
{{- if not $v.engine.cudaGraphs }}
- --no-cuda-graphs
{{- end }}
{{- with $v.engine.gpuMemoryFraction }}
- --gpu-memory-fraction
- {{ include "halfmoon.num" . | quote }}
{{- end }}
{{- with $v.engine.speculative.mode }}
- --speculative
- {{ . | quote }}
{{- end }}
{{- range $flag, $value := dict "--speculative-tokens" $v.engine.speculative.tokens "--speculative-max-batch" $v.engine.speculative.maxBatch }}
{{- if not (kindIs "invalid" $value) }}
- {{ $flag }}
- {{ include "halfmoon.num" $value | quote }}
{{- end }}
{{- end }}
{{- /* always given: 0 must turn off the tier `serve` keeps by default */}}
- --host-cache-gb
- {{ include "halfmoon.num" $v.kvTiers.hostGb | quote }}
{{- if gt (float64 $v.kvTiers.disk.sizeGb) 0.0 }}
- --disk-cache-dir
- {{ $v.kvTiers.disk.mountPath | quote }}
- --disk-cache-gb
- {{ include "halfmoon.num" $v.kvTiers.disk.sizeGb | quote }}
{{- end }}
{{- if $v.auth.existingSecret }}
- --api-token-file
- {{ printf "/etc/halfmoon/tokens/%s" $v.auth.key | quote }}
{{- end }}
{{- if $v.auth.admin.existingSecret }}
- --admin-token-file
- {{ printf "/etc/halfmoon/admin-tokens/%s" $v.auth.admin.key | quote }}
{{- end }}
{{- $lora := $v.lora }}
{{- range $lora.adapters }}
- --lora
- {{ printf "%s=%s" .name (ternary .path (printf "%s/%s" (trimSuffix "/" $lora.volume.mountPath) .path) (hasPrefix "/" .path)) | quote }}
{{- end }}
{{- range $flag, $value := dict "--max-loras" $lora.maxLoras "--max-lora-rank" $lora.maxRank "--max-cpu-loras" $lora.maxCpuLoras }}
{{- if not (kindIs "invalid" $value) }}
- {{ $flag }}
- {{ include "halfmoon.num" $value | quote }}
{{- end }}
{{- end }}
{{- if not $lora.baseCheck }}
- --lora-skip-base-check
{{- end }}
{{- if $v.tls.existingSecret }}
- --tls-cert
- /etc/halfmoon/tls/tls.crt
- --tls-key
- /etc/halfmoon/tls/tls.key
{{- end }}
{{- range $v.conductor.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* Env of every Ray container: Ray token auth on or explicitly off. */}}
{{- define "halfmoon.rayAuthEnv" -}}
{{- if .Values.ray.auth.existingSecret }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.ray.auth.existingSecret }}
      key: {{ .Values.ray.auth.key }}
{{- else }}
- name: RAY_AUTH_MODE
  value: disabled
{{- end }}
{{- end }}

{{/* Model volume + mount (none for the builtin alias, which ships in the image). */}}
{{- define "halfmoon.modelVolume" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ $m.hostPath.path }}
    type: Directory
{{- else if eq $m.source "image" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.image.sizeLimit }}
{{- end }}
{{- end }}

{{/* lora.volume: the adapters' PVC, read-only in the head and every worker pod. */}}
{{- define "halfmoon.loraVolume" -}}
{{- with .Values.lora.volume.claimName }}
- name: lora-adapters
  persistentVolumeClaim:
    claimName: {{ . }}
    readOnly: true
{{- end }}
{{- end }}

{{- define "halfmoon.loraMount" -}}
{{- if .Values.lora.volume.claimName }}
- name: lora-adapters
  mountPath: {{ .Values.lora.volume.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "halfmoon.modelMount" -}}
{{- if ne .Values.model.source "builtin" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* source=image: copy the weights into the pod's emptyDir before the main container starts. */}}
{{- define "halfmoon.modelInitContainer" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "image" }}
- name: copy-model
  image: {{ printf "%s:%s" $m.image.repository $m.image.tag | quote }}
  imagePullPolicy: {{ $m.image.pullPolicy }}
  command: ["sh", "-c", "cp -R \"$0\"/. \"$1\"/", {{ $m.image.sourcePath | quote }}, {{ $m.mountPath | quote }}]
  securityContext:
    allowPrivilegeEscalation: false
    capabilities:
      drop: ["ALL"]
  volumeMounts:
    - name: model
      mountPath: {{ $m.mountPath }}
{{- end }}
{{- end }}

{{- define "halfmoon.podCommon" -}}
serviceAccountName: {{ include "halfmoon.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Container resources of a worker group: the group's CPU/memory plus its GPUs and RDMA devices
(extended resources: requests = limits).
*/}}
{{- define "halfmoon.workerResources" -}}
{{- $g := index .root.Values .role }}
{{- $requests := deepCopy (default (dict) $g.resources.requests) }}
{{- $limits := deepCopy (default (dict) $g.resources.limits) }}
{{- if gt (int $g.gpus) 0 }}
{{- $_ := set $requests .root.Values.gpu.resourceName (int $g.gpus) }}
{{- $_ := set $limits .root.Values.gpu.resourceName (int $g.gpus) }}
{{- end }}
{{- if gt (int $g.rdmaDevices) 0 }}
{{- $_ := set $requests .root.Values.rdma.resourceName (int $g.rdmaDevices) }}
{{- $_ := set $limits .root.Values.rdma.resourceName (int $g.rdmaDevices) }}
{{- end }}
{{- with $requests }}
requests:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $limits }}
limits:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* /dev/shm of a worker: host KV tier + Ray object store + 1 GiB headroom, in MiB. */}}
{{- define "halfmoon.workerShmMi" -}}
{{- addf .Values.kvTiers.hostGb .Values.ray.objectStoreMemoryGb 1.0 | mulf 1024.0 | ceil | int64 }}
{{- end }}

{{- define "halfmoon.diskTierOn" -}}
{{- if gt (float64 .Values.kvTiers.disk.sizeGb) 0.0 }}true{{ end }}
{{- end }}

{{/*
The head pod's spec: `ray start --head`, then the Conductor in the foreground (tini reaps Ray's
daemons and forwards SIGTERM, so `halfmoon serve` shuts down cleanly). Shared by the Deployment
and the RayCluster's headGroupSpec.
*/}}
{{- define "halfmoon.headPodSpec" -}}
{{- $v := .Values }}
{{- $tls := $v.tls.existingSecret }}
{{- $redisSecret := include "halfmoon.redisSecretName" . }}
{{- include "halfmoon.podCommon" . }}
{{- with $v.head.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.head.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.head.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (include "halfmoon.modelInitContainer" . | trim) }}
initContainers:
  {{- . | nindent 2 }}
{{- end }}
containers:
  - name: ray-head
    image: {{ include "halfmoon.image" . | quote }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    command:
      - tini
      - --
      - /bin/sh
      - -c
      - >-
        ray start --head --port={{ include "halfmoon.gcsPort" . }} --dashboard-host=0.0.0.0
        --dashboard-port={{ include "halfmoon.dashboardPort" . }} --num-cpus=0
        --object-store-memory={{ include "halfmoon.gibBytes" $v.head.objectStoreMemoryGb }}
        --disable-usage-stats && exec halfmoon serve "$@"
      - halfmoon-serve
    args:
      {{- with (include "halfmoon.serveArgs" . | trim) }}{{ . | nindent 6 }}{{- end }}
    env:
      {{- with (include "halfmoon.rayAuthEnv" . | trim) }}{{ . | nindent 6 }}{{- end }}
      {{- if $redisSecret }}
      - name: HALFMOON_REDIS_PASSWORD
        valueFrom:
          secretKeyRef:
            name: {{ $redisSecret }}
            key: {{ include "halfmoon.redisPasswordKey" . }}
      {{- end }}
      {{- with $v.head.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    ports:
      - name: grpc
        containerPort: {{ $v.conductor.grpcPort }}
        protocol: TCP
      - name: http
        containerPort: {{ $v.conductor.httpPort }}
        protocol: TCP
      - name: gcs
        containerPort: {{ include "halfmoon.gcsPort" . }}
        protocol: TCP
      - name: dashboard
        containerPort: {{ include "halfmoon.dashboardPort" . }}
        protocol: TCP
    {{- range $kind, $probe := dict "startupProbe" $v.head.probes.startup "readinessProbe" $v.head.probes.readiness "livenessProbe" $v.head.probes.liveness }}
    {{ $kind }}:
      {{- if $tls }}
      httpGet:
        path: /health
        port: {{ $v.conductor.httpPort }}
        scheme: HTTPS
      {{- else }}
      grpc:
        port: {{ $v.conductor.grpcPort }}
      {{- end }}
      periodSeconds: {{ $probe.periodSeconds }}
      failureThreshold: {{ $probe.failureThreshold }}
      timeoutSeconds: 5
    {{- end }}
    resources:
      {{- toYaml $v.head.resources | nindent 6 }}
    securityContext:
      allowPrivilegeEscalation: false
      capabilities:
        drop: ["ALL"]
    volumeMounts:
      - name: shm
        mountPath: /dev/shm
      {{- with (include "halfmoon.modelMount" . | trim) }}{{ . | nindent 6 }}{{- end }}
      {{- with (include "halfmoon.loraMount" . | trim) }}{{ . | nindent 6 }}{{- end }}
      {{- if $v.auth.existingSecret }}
      - name: api-tokens
        mountPath: /etc/halfmoon/tokens
        readOnly: true
      {{- end }}
      {{- if $v.auth.admin.existingSecret }}
      - name: admin-tokens
        mountPath: /etc/halfmoon/admin-tokens
        readOnly: true
      {{- end }}
      {{- if $tls }}
      - name: tls
        mountPath: /etc/halfmoon/tls
        readOnly: true
      {{- end }}
volumes:
  - name: shm
    emptyDir:
      medium: Memory
      sizeLimit: {{ printf "%dMi" (addf $v.head.objectStoreMemoryGb 1.0 | mulf 1024.0 | ceil | int64) }}
  {{- with (include "halfmoon.modelVolume" . | trim) }}{{ . | nindent 2 }}{{- end }}
  {{- with (include "halfmoon.loraVolume" . | trim) }}{{ . | nindent 2 }}{{- end }}
  {{- if $v.auth.existingSecret }}
  - name: api-tokens
    secret:
      secretName: {{ $v.auth.existingSecret }}
      defaultMode: 0440
  {{- end }}
  {{- if $v.auth.admin.existingSecret }}
  - name: admin-tokens
    secret:
      secretName: {{ $v.auth.admin.existingSecret }}
      defaultMode: 0440
  {{- end }}
  {{- if $tls }}
  - name: tls
    secret:
      secretName: {{ $tls }}
      defaultMode: 0440
  {{- end }}
{{- end }}

{{/*
Ray's start flags of a worker pod (plain: on the command line; KubeRay: rayStartParams).
One unit of the role's custom resource per pod: the Conductor places one actor per pod.
*/}}
{{- define "halfmoon.workerResourcesJson" -}}
{{- dict (index .root.Values .role).rayResource 1 | toJson }}
{{- end }}

{{/* Init containers of a worker pod (same context as halfmoon.workerPodSpec). */}}
{{- define "halfmoon.workerInitContainers" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $disk := include "halfmoon.diskTierOn" $root }}
{{- $vol := $v.kvTiers.disk.volume }}
{{- if not .kuberay }}
# Join only once the head's GCS accepts connections (else `ray start` fails and backs off).
- name: wait-for-head
  image: {{ include "halfmoon.image" $root | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command:
    - python
    - -c
    - |
      import socket, sys, time
      host, port = sys.argv[1].rsplit(":", 1)
      while True:
          try:
              socket.create_connection((host, int(port)), timeout=2).close()
              break
          except OSError:
              time.sleep(2)
    - {{ include "halfmoon.headAddress" $root | quote }}
  securityContext:
    allowPrivilegeEscalation: false
    capabilities:
      drop: ["ALL"]
{{- end }}
{{- if and $disk (eq $vol.type "hostPath") }}
# The node's NVMe directory is created by the kubelet as root: hand this pod's subdirectory to uid 1000.
- name: disk-tier-permissions
  image: {{ include "halfmoon.image" $root | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command: ["chown", "{{ int64 $v.podSecurityContext.runAsUser }}:{{ int64 $v.podSecurityContext.runAsGroup }}", "/kv"]
  securityContext:
    runAsUser: 0
    runAsNonRoot: false
    allowPrivilegeEscalation: false
    capabilities:
      drop: ["ALL"]
      add: ["CHOWN"]
  env:
    - name: POD_NAME
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
  volumeMounts:
    - name: kv-disk
      mountPath: /kv
      subPathExpr: $(POD_NAME)
{{- end }}
{{- with (include "halfmoon.modelInitContainer" $root | trim) }}
{{ . }}
{{- end }}
{{- end }}

{{/*
A worker pod's affinity: the group's own, plus (placement.separateRoles) one pod anti-affinity
term (appended to the group's own terms) against the other role's pods on the same Kubernetes
node, "preferred" (spread when nodes allow; one node still runs both) or "required" (never
together). Same context as halfmoon.workerPodSpec.
*/}}
{{- define "halfmoon.workerAffinity" -}}
{{- $root := .root }}
{{- $mode := $root.Values.placement.separateRoles }}
{{- $affinity := deepCopy ((index $root.Values .role).affinity | default dict) }}
{{- if ne $mode "off" }}
{{- $other := ternary "decode" "prefill" (eq .role "prefill") }}
{{- $labels := include "halfmoon.componentSelector" (dict "root" $root "component" $other) | fromYaml }}
{{- $term := dict "labelSelector" (dict "matchLabels" $labels) "topologyKey" "kubernetes.io/hostname" }}
{{- $anti := $affinity.podAntiAffinity | default dict }}
{{- if eq $mode "required" }}
{{- $_ := set $anti "requiredDuringSchedulingIgnoredDuringExecution" (append ($anti.requiredDuringSchedulingIgnoredDuringExecution | default list) $term) }}
{{- else }}
{{- $_ := set $anti "preferredDuringSchedulingIgnoredDuringExecution" (append ($anti.preferredDuringSchedulingIgnoredDuringExecution | default list) (dict "weight" 100 "podAffinityTerm" $term)) }}
{{- end }}
{{- $_ := set $affinity "podAntiAffinity" $anti }}
{{- end }}
{{- if $affinity }}
{{- toYaml $affinity }}
{{- end }}
{{- end }}

{{/*
A worker pod's spec: (dict "root" $ "role" "prefill"|"decode" "kuberay" bool).
*/}}
{{- define "halfmoon.workerPodSpec" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $g := index $v .role }}
{{- $disk := include "halfmoon.diskTierOn" $root }}
{{- $vol := $v.kvTiers.disk.volume }}
{{- include "halfmoon.podCommon" $root }}
{{- with $g.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $g.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with (include "halfmoon.workerAffinity" . | fromYaml) }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $inits := include "halfmoon.workerInitContainers" . | trim }}
{{- with $inits }}
initContainers:
  {{- . | nindent 2 }}
{{- end }}
containers:
  - name: ray-worker
    image: {{ include "halfmoon.image" $root | quote }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    {{- if .kuberay }}
    # KubeRay generates `ray start --address=<head> ... --block` from rayStartParams.
    command: ["/bin/bash", "-c", "--"]
    args: ['ulimit -n 65536; exec tini -- /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD"']
    {{- else }}
    command:
      - tini
      - --
      - ray
      - start
      - {{ printf "--address=%s" (include "halfmoon.headAddress" $root) | quote }}
      - {{ printf "--resources=%s" (include "halfmoon.workerResourcesJson" .) | quote }}
      - {{ printf "--num-cpus=%d" ($v.conductor.workerThreads | int) | quote }}
      {{- if gt (int $g.gpus) 0 }}
      - {{ printf "--num-gpus=%d" ($g.gpus | int) | quote }}
      {{- end }}
      - {{ printf "--object-store-memory=%s" (include "halfmoon.gibBytes" $v.ray.objectStoreMemoryGb) | quote }}
      - --disable-usage-stats
      - --block
    {{- end }}
    env:
      {{- with (include "halfmoon.rayAuthEnv" $root | trim) }}{{ . | nindent 6 }}{{- end }}
      # The KV transport's shared secret; Ray's actors inherit the raylet's environment.
      - name: HALFMOON_KV_SECRET
        valueFrom:
          secretKeyRef:
            name: {{ include "halfmoon.kvSecretName" $root }}
            key: {{ $v.kvTransport.secret.key }}
      {{- if and $disk (eq $vol.type "hostPath") }}
      - name: POD_NAME
        valueFrom:
          fieldRef:
            fieldPath: metadata.name
      {{- end }}
      {{- if $v.model.weightsCache.enabled }}
      - name: HALFMOON_CACHE_DIR
        value: /var/cache/halfmoon
      {{- else }}
      - name: HALFMOON_WEIGHTS_CACHE
        value: "0"
      {{- end }}
      {{- with $g.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- if eq .role "decode" }}
    # Only decode workers listen: the KV receiver prefill workers stream each layer into.
    ports:
      - name: kv
        containerPort: {{ $v.kvTransport.port }}
        protocol: TCP
    {{- end }}
    resources:
      {{- with (include "halfmoon.workerResources" . | trim) }}{{ . | nindent 6 }}{{- end }}
    securityContext:
      allowPrivilegeEscalation: false
      capabilities:
        drop: ["ALL"]
        {{- if gt (int $g.rdmaDevices) 0 }}
        add: ["IPC_LOCK"]
        {{- end }}
    volumeMounts:
      - name: shm
        mountPath: /dev/shm
      {{- with (include "halfmoon.modelMount" $root | trim) }}{{ . | nindent 6 }}{{- end }}
      {{- with (include "halfmoon.loraMount" $root | trim) }}{{ . | nindent 6 }}{{- end }}
      {{- if $v.model.weightsCache.enabled }}
      - name: weights-cache
        mountPath: /var/cache/halfmoon
      {{- end }}
      {{- if $disk }}
      - name: kv-disk
        mountPath: {{ $v.kvTiers.disk.mountPath }}
        {{- if eq $vol.type "hostPath" }}
        subPathExpr: $(POD_NAME)
        {{- end }}
      {{- end }}
volumes:
  - name: shm
    emptyDir:
      medium: Memory
      sizeLimit: {{ printf "%sMi" (include "halfmoon.workerShmMi" $root) }}
  {{- with (include "halfmoon.modelVolume" $root | trim) }}{{ . | nindent 2 }}{{- end }}
  {{- with (include "halfmoon.loraVolume" $root | trim) }}{{ . | nindent 2 }}{{- end }}
  {{- if $v.model.weightsCache.enabled }}
  - name: weights-cache
    emptyDir:
      sizeLimit: {{ $v.model.weightsCache.sizeLimit }}
  {{- end }}
  {{- if $disk }}
  {{- if eq $vol.type "hostPath" }}
  - name: kv-disk
    hostPath:
      path: {{ $vol.hostPath }}
      type: DirectoryOrCreate
  {{- else if eq $vol.type "emptyDir" }}
  - name: kv-disk
    emptyDir:
      sizeLimit: {{ printf "%dGi" (add1 ($v.kvTiers.disk.sizeGb | ceil | int64)) }}
  {{- end }}
  {{- end }}
{{- end }}

{{/* PodDisruptionBudget: (dict "root" $ "component" name "pdb" settings) */}}
{{- define "halfmoon.pdb" -}}
{{- if .pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ printf "%s-%s" (include "halfmoon.fullname" .root) .component }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "halfmoon.componentLabels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "halfmoon.componentSelector" . | nindent 6 }}
{{- end }}
{{- end }}
