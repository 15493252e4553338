#!/usr/bin/env bash
# Makes a throwaway test CA, a SuperLink TLS certificate signed by it, and SuperNode authentication keys for a
# zofed run on Flower (docs/flower.md). For tests and trials only: a real deployment uses its own CA.
#
#   scripts/make_flower_certs.sh OUT_DIR [SUPERNODES] [HOSTS]
#
# OUT_DIR/ca.crt            CA certificate: --ssl-ca-certfile on the SuperLink, --root-certificates on SuperNodes,
#                           root-certificates in the flwr connection
# OUT_DIR/server.pem, .key  SuperLink certificate and key (--ssl-certfile, --ssl-keyfile), valid for HOSTS
# OUT_DIR/supernode_N       SuperNode N's private key (--auth-supernode-private-key), N = 1..SUPERNODES
# OUT_DIR/supernode_N.pub   its public key, registered with `flwr supernode register supernode_N.pub <connection>`
#
# HOSTS is a comma-separated list of the SuperLink's names and addresses (default "127.0.0.1,localhost").
# Needs openssl and ssh-keygen (Flower reads SuperNode keys as OpenSSH ECDSA P-384 keys).
set -euo pipefail

out=${1:?usage: make_flower_certs.sh OUT_DIR [SUPERNODES] [HOSTS]}
supernodes=${2:-2}
hosts=${3:-127.0.0.1,localhost}
for tool in openssl ssh-keygen; do
    command -v "$tool" >/dev/null || { echo "make_flower_certs.sh: $tool is required" >&2; exit 1; }
done
mkdir -p "$out"
cd "$out"

san=""
IFS=',' read -ra names <<<"$hosts"
for name in "${names[@]}"; do
    if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then san+="IP:$name,"; else san+="DNS:$name,"; fi
done
san=${san%,}

openssl req -x509 -newkey rsa:4096 -sha256 -days 30 -nodes -keyout ca.key -out ca.crt \
    -subj "/CN=zofed test CA" 2>/dev/null
openssl req -newkey rsa:4096 -sha256 -nodes -keyout server.key -out server.csr \
    -subj "/CN=${names[0]}" 2>/dev/null
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
    "$san" >server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.pem -days 30 -sha256 \
    -extfile server.ext 2>/dev/null
rm -f server.csr server.ext ca.srl

for n in $(seq 1 "$supernodes"); do
    rm -f "supernode_$n" "supernode_$n.pub"
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "zofed supernode $n" -f "supernode_$n"
done
chmod 600 ca.key server.key supernode_*[0-9]
echo "wrote $(pwd): ca.crt, server.pem, server.key, supernode_1..${supernodes} (+ .pub) for ${hosts}"
