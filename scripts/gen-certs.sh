#!/usr/bin/env bash
# Generate a private CA and a TLS server certificate for the SuperLink.
#
# Usage: scripts/gen-certs.sh [--out DIR] [--names "superlink,localhost,127.0.0.1"]
#                             [--force]
#
# Writes to DIR (default: <repo>/certs):
#   ca.key, ca.crt          the CA; give ca.crt to SuperNodes (--root-certificates)
#                           and to `flwr` (root-certificates in config.toml)
#   server.key, server.pem  the SuperLink's key and certificate, signed by the CA
#                           (--ssl-keyfile, --ssl-certfile, --ssl-ca-certfile ca.crt);
#                           server.crt is the same certificate under another name
# Every name in --names becomes a subjectAltName (IP: for addresses, DNS: for host
# names): list every name clients dial, e.g. the compose service name and the
# address devices use. Keys are mode 600.
#
# Idempotent: existing files are kept. The server certificate alone is re-issued
# (with the existing CA) when it lacks one of the requested names or was not signed
# by ca.crt; --force regenerates everything. Needs openssl; without it, falls back
# to Python's `cryptography` package (the project's .venv has it);
# GEN_CERTS_BACKEND=openssl|python forces one.
set -euo pipefail

LOG_PREFIX=gen-certs
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

CA_DAYS=3650
SERVER_DAYS=825
CA_KEY_BITS=3072
SERVER_KEY_BITS=2048

usage() { # the comment block at the top of this file
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
}

out="$TESSERA_ROOT/certs"
names="superlink,localhost,127.0.0.1"
force=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) [ $# -ge 2 ] || die "--out needs a folder"; out="$2"; shift 2 ;;
        --out=*) out="${1#--out=}"; shift ;;
        --names) [ $# -ge 2 ] || die "--names needs a comma-separated list"; names="$2"; shift 2 ;;
        --names=*) names="${1#--names=}"; shift ;;
        --force) force=1; shift ;;
        -h | --help) usage; exit 0 ;;
        *) die "unknown argument '$1'; see --help" ;;
    esac
done

# Split and validate the names (commas or spaces).
name_list=()
for n in ${names//,/ }; do
    case "$n" in
        *[!A-Za-z0-9.:_-]*) die "invalid name '$n' in --names: use host names or IP addresses" ;;
    esac
    name_list+=("$n")
done
[ "${#name_list[@]}" -gt 0 ] || die "--names is empty; give e.g. --names superlink,127.0.0.1"

# Common name: the first host name, else the first address.
cn="${name_list[0]}"
for n in "${name_list[@]}"; do
    if ! is_ip "$n"; then cn="$n"; break; fi
done

mkdir -p "$out"
out="$(cd "$out" && pwd)"

# ------------------------------------------------------------------ openssl backend
openssl_cnf() { # openssl_cnf FILE: request/extension config for CA and server
    local i=0 j=0 n
    {
        printf '[req]\ndistinguished_name = dn\nprompt = no\n\n'
        printf '[dn]\nCN = %s\n\n' "$1"
        printf '[v3_ca]\nbasicConstraints = critical, CA:TRUE\n'
        printf 'keyUsage = critical, keyCertSign, cRLSign\n'
        printf 'subjectKeyIdentifier = hash\n\n'
        printf '[v3_server]\nbasicConstraints = critical, CA:FALSE\n'
        printf 'keyUsage = critical, digitalSignature, keyEncipherment\n'
        printf 'extendedKeyUsage = serverAuth\n'
        printf 'subjectKeyIdentifier = hash\n'
        printf 'authorityKeyIdentifier = keyid, issuer\n'
        printf 'subjectAltName = @alt_names\n\n[alt_names]\n'
        for n in "${name_list[@]}"; do
            if is_ip "$n"; then i=$((i + 1)); printf 'IP.%d = %s\n' "$i" "$n"
            else j=$((j + 1)); printf 'DNS.%d = %s\n' "$j" "$n"; fi
        done
    }
}

openssl_covers() { # true when server.pem is signed by ca.crt and names every name
    local n
    openssl verify -CAfile "$out/ca.crt" "$out/server.pem" >/dev/null 2>&1 || return 1
    for n in "${name_list[@]}"; do
        if is_ip "$n"; then
            openssl x509 -in "$out/server.pem" -noout -checkip "$n" 2>/dev/null \
                | grep -q "does match" || return 1
        else
            openssl x509 -in "$out/server.pem" -noout -checkhost "$n" 2>/dev/null \
                | grep -q "does match" || return 1
        fi
    done
}

openssl_make() { # openssl_make all|server TMPDIR
    local what="$1" tmp="$2" ca_key ca_crt
    openssl_cnf "$cn" >"$tmp/server.cnf"
    if [ "$what" = all ]; then
        {
            printf '[req]\ndistinguished_name = dn\nprompt = no\n\n'
            printf '[dn]\nCN = Tessera local CA\n\n'
            sed -n '/^\[v3_ca\]/,/^$/p' "$tmp/server.cnf"
        } >"$tmp/ca.cnf"
        (umask 077 && openssl genrsa -out "$tmp/ca.key" "$CA_KEY_BITS" 2>/dev/null)
        openssl req -x509 -new -sha256 -days "$CA_DAYS" -key "$tmp/ca.key" \
            -config "$tmp/ca.cnf" -extensions v3_ca -out "$tmp/ca.crt"
        ca_key="$tmp/ca.key"; ca_crt="$tmp/ca.crt"
    else
        ca_key="$out/ca.key"; ca_crt="$out/ca.crt"
    fi
    (umask 077 && openssl genrsa -out "$tmp/server.key" "$SERVER_KEY_BITS" 2>/dev/null)
    openssl req -new -sha256 -key "$tmp/server.key" -config "$tmp/server.cnf" \
        -out "$tmp/server.csr"
    openssl x509 -req -sha256 -days "$SERVER_DAYS" -in "$tmp/server.csr" \
        -CA "$ca_crt" -CAkey "$ca_key" -set_serial "0x$(openssl rand -hex 16)" \
        -extfile "$tmp/server.cnf" -extensions v3_server -out "$tmp/server.pem" 2>/dev/null
    rm -f "$tmp/server.csr" "$tmp/server.cnf" "$tmp/ca.cnf"
}

# ------------------------------------------------------------------- python backend
PY_CERTS='
import datetime, ipaddress, os, sys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

mode, out, tmp, cn, ca_bits, srv_bits, ca_days, srv_days = sys.argv[1:9]
names = sys.argv[9:]

def san():
    alt = []
    for n in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    return alt

def load(path):
    with open(path, "rb") as fh:
        return fh.read()

if mode == "check":
    ca = x509.load_pem_x509_certificate(load(os.path.join(out, "ca.crt")))
    srv = x509.load_pem_x509_certificate(load(os.path.join(out, "server.pem")))
    try:
        srv.verify_directly_issued_by(ca)
        have = srv.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except Exception:
        sys.exit(1)
    sys.exit(0 if all(a in have for a in san()) else 1)

def write_key(key, path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.private_bytes(serialization.Encoding.PEM,
                                   serialization.PrivateFormat.TraditionalOpenSSL,
                                   serialization.NoEncryption()))

def write_cert(cert, path):
    with open(path, "wb") as fh:
        fh.write(cert.public_bytes(serialization.Encoding.PEM))

now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
if mode == "all":
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=int(ca_bits))
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Tessera local CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=int(ca_days)))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False,
                                       decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    write_key(ca_key, os.path.join(tmp, "ca.key"))
    write_cert(ca, os.path.join(tmp, "ca.crt"))
else:
    ca_key = serialization.load_pem_private_key(load(os.path.join(out, "ca.key")), None)
    ca = x509.load_pem_x509_certificate(load(os.path.join(out, "ca.crt")))

key = rsa.generate_private_key(public_exponent=65537, key_size=int(srv_bits))
cert = (x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(ca.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=int(srv_days)))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                     key_encipherment=True, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False,
                                     decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectAlternativeName(san()), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
            ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256()))
write_key(key, os.path.join(tmp, "server.key"))
write_cert(cert, os.path.join(tmp, "server.pem"))
'

python_backend() { # python_backend check|all|server TMPDIR
    "$py" -c "$PY_CERTS" "$1" "$out" "${2:-}" "$cn" "$CA_KEY_BITS" "$SERVER_KEY_BITS" "$CA_DAYS" \
        "$SERVER_DAYS" "${name_list[@]}"
}

# ------------------------------------------------------------------------ main
# GEN_CERTS_BACKEND=openssl|python forces a backend (default: openssl if present).
backend="${GEN_CERTS_BACKEND:-}"
if [ -z "$backend" ] && have openssl; then
    backend=openssl
elif [ "$backend" = openssl ]; then
    have openssl || die "GEN_CERTS_BACKEND=openssl but openssl is not on PATH"
else
    py="$(tessera_python)" || die "neither openssl nor python3 is available"
    "$py" -c 'import cryptography' 2>/dev/null \
        || die "openssl is missing and $py has no 'cryptography'; install either"
    backend=python
fi

covers() {
    if [ "$backend" = openssl ]; then openssl_covers; else python_backend check; fi
}

if [ "$force" = 1 ]; then
    what=all
elif [ ! -s "$out/ca.crt" ] || [ ! -s "$out/ca.key" ]; then
    what=all
elif [ ! -s "$out/server.pem" ] || [ ! -s "$out/server.key" ]; then
    what=server
elif ! covers; then
    log "server certificate in $out lacks a requested name or another CA signed it;" \
        "re-issuing it with the existing CA"
    what=server
else
    what=none
fi

if [ "$what" = none ]; then
    log "keeping existing certificates in $out (names: ${name_list[*]}); --force regenerates"
else
    tmp="$(mktemp -d "$out/.gen-certs.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    if [ "$backend" = openssl ]; then openssl_make "$what" "$tmp"; else python_backend "$what" "$tmp"; fi
    if [ "$what" = all ]; then
        mv -f "$tmp/ca.key" "$out/ca.key"
        mv -f "$tmp/ca.crt" "$out/ca.crt"
    fi
    mv -f "$tmp/server.key" "$out/server.key"
    mv -f "$tmp/server.pem" "$out/server.pem"
    log "wrote $([ "$what" = all ] && echo "CA and ")server certificate to $out" \
        "(backend $backend; SAN: ${name_list[*]})"
fi
cp -f "$out/server.pem" "$out/server.crt"
chmod 600 "$out/ca.key" "$out/server.key"
chmod 644 "$out/ca.crt" "$out/server.pem" "$out/server.crt"
