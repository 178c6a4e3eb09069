#!/bin/sh
# Print the kit Secrets that deploy/k8s mounts, made from the kits of deploy/docker/make-kits.sh:
#
#   deploy/k8s/kit-secrets.sh KITS | kubectl apply -f -
#
#   crossdc-coordinator-kit   KITS/coordinator/ (no ca.key), its certs/ flat beside the rest
#   crossdc-site-<id>-kit     KITS/site-<id>/
#
# Nothing is sent anywhere: `kubectl create secret --dry-run=client` only prints. NAMESPACE
# (default crossdc), SITES (default "eu us ap") and KUBECTL (default kubectl) can be set.
set -eu

if [ $# -ne 1 ]; then
    echo "usage: $0 KITS" >&2
    exit 2
fi
kits=$1
ns=${NAMESPACE:-crossdc}
sites=${SITES:-eu us ap}
kubectl=${KUBECTL:-kubectl}

"$kubectl" create secret generic crossdc-coordinator-kit --namespace "$ns" \
    --from-file="$kits/coordinator/" --from-file="$kits/coordinator/certs/" \
    --dry-run=client --output=yaml
for site in $sites; do
    echo ---
    "$kubectl" create secret generic "crossdc-site-$site-kit" --namespace "$ns" \
        --from-file="$kits/site-$site/" --dry-run=client --output=yaml
done
