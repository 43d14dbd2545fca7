{{/* Names and labels shared by the templates. */}}

{{- define "slipstream.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "slipstream.operatorName" -}}
{{- printf "%s-operator" (include "slipstream.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "slipstream.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "slipstream.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "slipstream.selectorLabels" -}}
app.kubernetes.io/name: slipstream-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "slipstream.labels" -}}
{{ include "slipstream.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "slipstream.clusterwide" -}}
{{- if .Values.watchNamespaces -}}false{{- else -}}true{{- end -}}
{{- end -}}

{{- define "slipstream.controlMasterSecret" -}}
{{- if .Values.controlPlane.masterKeySecret -}}
{{- .Values.controlPlane.masterKeySecret -}}
{{- else -}}
{{- printf "%s-control-master" (include "slipstream.operatorName" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "slipstream.policyNamespaces" -}}
{{- if .Values.watchNamespaces -}}
{{- toYaml .Values.watchNamespaces -}}
{{- else -}}
{{- toYaml (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}
