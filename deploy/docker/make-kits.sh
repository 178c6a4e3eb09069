#!/bin/sh
# Make the key kits of the compose stack and of deploy/k8s with `crossdc keys`:
#
#   deploy/docker/make-kits.sh OUT [ENDPOINT]
#
#   OUT/federation/    the federation kit (crossdc keys init): the CA key is in it; keep it
#                      offline, it is what issues and revokes. Mounted nowhere.
#   OUT/coordinator/   what the running coordinator needs: the kit without ca.key and sites/
#   OUT/site-<id>/     the startup kit of site eu, us and ap (crossdc keys issue)
#
# ENDPOINT (default tcp://coordinator:7710, the compose service) only goes into each site kit's
# starter site.toml. CROSSDC names the command (default: crossdc on PATH), SITES the site ids
# (default "eu us ap") and DAYS the certificates' validity (default 90). OUT must not exist.
set -eu

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: $0 OUT [ENDPOINT]" >&2
    exit 2
fi
out=$1
endpoint=${2:-tcp://coordinator:7710}
crossdc=${CROSSDC:-crossdc}
sites=${SITES:-eu us ap}
days=${DAYS:-90}

if [ -e "$out" ]; then
    echo "$0: $out exists; remove it or choose another directory" >&2
    exit 2
fi
umask 077
mkdir -p "$out"
"$crossdc" keys init "$out/federation"
for site in $sites; do
    "$crossdc" keys issue --kit "$out/federation" --site "$site" --days "$days" \
        --endpoint "$endpoint" --out "$out/site-$site"
done
mkdir -p "$out/coordinator/certs"
cp -p "$out/federation/kit.json" "$out/federation/ca.pem" "$out/federation/crl.pem" \
    "$out/federation"/coordinator.* "$out/coordinator/"
cp -p "$out/federation"/certs/*.pem "$out/coordinator/certs/"
echo "kits in $out: coordinator/ and site-*/ to mount, federation/ to keep offline"
