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
uses: server-side apply is a PATCH, adoption and garbage collection need get/list/watch/delete. */}}
{{- define "davit.namespacedRules" -}}
- apiGroups: ["serving.davit.dev"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["serving.davit.dev"]
  resources: ["inferenceservices/status"]
  verbs: ["get", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}

{{/* Cluster-scoped reads, needed in both modes: nodes (accelerator products and capacity) and
CustomResourceDefinitions (kopf discovers the resources it serves through them). */}}
{{- define "davit.clusterRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
{{- end -}}

{{- define "davit.operatorArgs" -}}
{{- if eq .Values.watchNamespace "" }}
- --all-namespaces
{{- else }}
- --namespace={{ .Values.watchNamespace }}
{{- end }}
- --metrics-port={{ .Values.metrics.port }}
- --health-port={{ .Values.health.port }}
- --log-level={{ .Values.logLevel }}
{{- if .Values.leaderElection.enabled }}
- --leader-election
- --leader-election-namespace={{ .Release.Namespace }}
{{- end }}
{{- range .Values.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}
