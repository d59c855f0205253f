#!/usr/bin/env bash
# Deploy one model overlay: render deployment/models/<model> with kustomize and apply it.
#
#   ./deploy_model.sh [--dry-run] <model> [kubectl apply options...]
#
# <model> is a directory name under models/ (or models/<name>). --dry-run only prints the rendered
# manifests. Extra options go to `kubectl apply` (e.g. -n my-namespace). Uses the `kustomize`
# binary when it is on PATH, else `kubectl kustomize`. The overlays reference patches under base/,
# outside their own directory, hence --load-restrictor LoadRestrictionsNone.
set -euo pipefail

usage() {
    echo "usage: $0 [--dry-run] <model> [kubectl apply options...]" >&2
    local dir names=()
    for dir in "$here"/models/*/; do
        dir="${dir%/}"
        names+=("${dir##*/}")
    done
    echo "models: ${names[*]}" >&2
    exit 2
}

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then
    dry_run=1
    shift
fi
[[ $# -ge 1 && -n "$1" && "$1" != -* ]] || usage
model="${1#models/}"
model="${model%/}"
shift
overlay="$here/models/$model"
if [[ ! -f "$overlay/kustomization.yaml" ]]; then
    echo "$0: no model overlay $overlay/kustomization.yaml" >&2
    usage
fi

if command -v kustomize >/dev/null 2>&1; then
    render=(kustomize build --load-restrictor LoadRestrictionsNone "$overlay")
elif command -v kubectl >/dev/null 2>&1; then
    render=(kubectl kustomize --load-restrictor LoadRestrictionsNone "$overlay")
else
    echo "$0: needs kustomize or kubectl on PATH" >&2
    exit 1
fi

if [[ $dry_run -eq 1 ]]; then
    exec "${render[@]}"
fi
manifests="$("${render[@]}")"
printf '%s\n' "$manifests" | kubectl apply "$@" -f -
