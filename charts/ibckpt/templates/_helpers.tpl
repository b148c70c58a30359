{{- define "ibckpt.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ibckpt.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "ibckpt.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "ibckpt.operatorAccount" -}}
{{- printf "%s-operator" (include "ibckpt.fullname" .) -}}
{{- end -}}

{{- define "ibckpt.agentAccount" -}}
{{- printf "%s-agent" (include "ibckpt.fullname" .) -}}
{{- end -}}

{{/* The one identity the agents accept on their API. */}}
{{- define "ibckpt.operatorIdentity" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "ibckpt.operatorAccount" .) -}}
{{- end -}}

{{/* Pod spec lines both components take from the top-level values. */}}
{{- define "ibckpt.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . | quote }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The image key set's Secret: the agents sign and verify checkpoint manifests with it (docs/image-store.md). */}}
{{- define "ibckpt.imageKeysSecret" -}}
{{- default (printf "%s-image-keys" (include "ibckpt.fullname" .)) .Values.imageKeys.secretName -}}
{{- end -}}
