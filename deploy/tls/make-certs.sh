#!/usr/bin/env sh
# Make a private CA, one server certificate per host and a client certificate
# for mutual TLS. Usage: deploy/tls/make-certs.sh OUTDIR HOST...
# Each HOST is a DNS name (mac-a.lan) or an IP address (192.168.1.10, fd00::2);
# its certificate carries it as a DNS or an IP subjectAltName, so clients can
# dial either. Re-running keeps the CA and reissues the host certificates.
set -eu
out=${1:?usage: make-certs.sh OUTDIR HOST...}; shift
[ "$#" -gt 0 ] || { echo "usage: make-certs.sh OUTDIR HOST..." >&2; exit 2; }
mkdir -p "$out" && cd "$out"
[ -f ca.pem ] || openssl req -x509 -newkey rsa:3072 -nodes -keyout ca.key -out ca.pem -days 825 \
  -subj "/CN=kvferry private CA" 2>/dev/null
for host in "$@"; do
  case "$host" in
    *:*) san="IP:$host" ;;                       # IPv6
    *[!0-9.]*|"") san="DNS:$host" ;;             # a name
    *) san="IP:$host" ;;                         # IPv4
  esac
  openssl req -newkey rsa:3072 -nodes -keyout "$host.key" -out "$host.csr" -subj "/CN=$host" 2>/dev/null
  printf "subjectAltName=%s\n" "$san" > "$host.ext"
  openssl x509 -req -in "$host.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -out "$host.pem" \
    -days 825 -extfile "$host.ext" 2>/dev/null
  rm -f "$host.csr" "$host.ext"
done
openssl req -newkey rsa:3072 -nodes -keyout client.key -out client.csr -subj "/CN=kvferry-client" 2>/dev/null
openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 825 2>/dev/null
rm -f client.csr
chmod 600 ./*.key
echo "CA: $out/ca.pem; per-host server certs: $out/<host>.pem/.key; client: $out/client.pem/.key"
