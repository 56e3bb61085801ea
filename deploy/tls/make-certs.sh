#!/usr/bin/env sh
# Make a private CA, one server certificate per host and a client certificate
# for mutual TLS. Usage: deploy/tls/make-certs.sh OUTDIR host1.lan host2.lan ...
set -eu
out=${1:?usage: make-certs.sh OUTDIR HOST...}; shift
mkdir -p "$out" && cd "$out"
[ -f ca.pem ] || openssl req -x509 -newkey rsa:3072 -nodes -keyout ca.key -out ca.pem -days 825 \
  -subj "/CN=kvferry private CA"
for host in "$@"; do
  openssl req -newkey rsa:3072 -nodes -keyout "$host.key" -out "$host.csr" -subj "/CN=$host"
  printf "subjectAltName=DNS:%s\n" "$host" > "$host.ext"
  openssl x509 -req -in "$host.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$host.pem" \
    -days 825 -extfile "$host.ext"
done
openssl req -newkey rsa:3072 -nodes -keyout client.key -out client.csr -subj "/CN=kvferry-client"
openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 825
chmod 600 ./*.key
echo "CA: $out/ca.pem; per-host server certs: $out/<host>.pem/.key; client: $out/client.pem/.key"
