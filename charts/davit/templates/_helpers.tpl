{{/* Chart name, overridable only through the release name (no nameOverride knobs). */}}
{{- define "davit.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name of the release's objects: "<release>-davit", or the release name when it already
contains the chart name. */}}
{{- define "davit.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "davit.selectorLabels" -}}
app.kubernetes.io/name: {{ include "davit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "davit.labels" -}}
{{ include "davit.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: davit
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "davit.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "davit.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "davit.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s:%s@%s" .Values.image.repository $tag .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* "true" when the operator watches every namespace. */}}
{{- define "davit.clusterWide" -}}
{{- if eq .Values.watchNamespace "" -}}true{{- end -}}
{{- end -}}

{{/* Permissions the operator needs where InferenceServices live: one list, rendered into a
ClusterRole (cluster-wide mode) or a Role in the watched namespace. Only the verbs the operator
uses: children are written by server-side apply (PATCH, which needs create to make a new object),
read through kopf indexes (list/watch) and removed by DELETE; nothing is ever PUT (update).
Jobs are the memory-profiling runs, whose results are kept in ConfigMaps (read and applied, never
listed or deleted); pods are read for profiling results and rollout progress; a user's HTTPRoute
is read and merge-patched for canary weights. */}}
{{- define "davit.namespacedRules" -}}
- apiGroups: ["serving.davit.dev"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["serving.davit.dev"]
  resources: ["inferenceservices/status"]
  verbs: ["get", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}

{{/* Cluster-scoped rights, needed in both modes: node reads (accelerator products and
capacity), CRD reads (kopf discovers the resources it serves through them) and namespace reads in
single-namespace mode. */}}
{{- define "davit.clusterRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
{{- if ne .Values.watchNamespace "" }}
{{- /* A namespaced kopf operator lists and watches namespaces to learn which of its namespaces
exist; without the right it retries for about a minute before it starts serving. */}}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end -}}

{{/* kopf peering rights: the peering kind matches the operator's scope (ClusterKopfPeering for a
cluster-wide operator, KopfPeering in the watched namespace for a namespaced one). list/watch
cover the kind, which kopf watches whole; get/patch only the release's own object. Rendered into
the same ClusterRole or Role as the namespaced rules. */}}
{{- define "davit.peeringRules" -}}
{{- $resource := ternary "clusterkopfpeerings" "kopfpeerings" (eq .Values.watchNamespace "") -}}
{{- if .Values.leaderElection.enabled -}}
- apiGroups: ["kopf.dev"]
  resources: [{{ $resource | quote }}]
  verbs: ["list", "watch"]
- apiGroups: ["kopf.dev"]
  resources: [{{ $resource | quote }}]
  resourceNames: [{{ include "davit.fullname" . | quote }}]
  verbs: ["get", "patch"]
{{- end }}
{{- end -}}

{{- define "davit.operatorArgs" -}}
{{- if eq .Values.watchNamespace "" }}
- --all-namespaces
{{- else }}
- --namespace={{ .Values.watchNamespace }}
{{- end }}
- --metrics-port={{ .Values.metrics.port }}
- --liveness=http://0.0.0.0:{{ .Values.health.port }}/healthz
- --drift-interval={{ .Values.driftIntervalSeconds }}
{{- if .Values.leaderElection.enabled }}
- --peering={{ include "davit.fullname" . }}
{{- end }}
{{- if .Values.verbose }}
- --verbose
{{- end }}
{{- with .Values.modelDelivery }}
{{- with .cacheClaim }}
- {{ printf "--model-cache=%s" . | quote }}
{{- end }}
{{- with .hfEndpoint }}
- {{ printf "--hf-endpoint=%s" . | quote }}
{{- end }}
{{- with .s3Endpoint }}
- {{ printf "--s3-endpoint=%s" . | quote }}
{{- end }}
{{- if .maxBytesPerSecond }}
- --fetch-max-bytes-per-second={{ int64 .maxBytesPerSecond }}
{{- end }}
{{- end }}
{{- /* The fetch Jobs run the operator's own image unless told otherwise. */}}
- {{ printf "--fetch-image=%s" (.Values.modelDelivery.fetchImage | default (include "davit.image" .)) | quote }}
{{- range .Values.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}
