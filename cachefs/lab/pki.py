"""A throwaway certificate authority for the lab's mutual TLS (``cachefs lab up --tls``).

One CA and one certificate per lab node (and one for clients), each naming
its node's address, made with the ``openssl`` command: certificates good for
a lab's life, not a production PKI.
"""

from __future__ import annotations

import ipaddress
import secrets
import shutil
import subprocess
from pathlib import Path

TLS_DAYS = 30


class PkiError(Exception):
    """The ``openssl`` command is missing or failed; the message says which step."""


def make_pki(d: Path, hosts: dict[str, str]) -> None:
    """A throwaway CA (``d/ca.pem``) and a certificate per name (``d/NAME.pem``,
    ``d/NAME-key.pem``) for ``hosts[NAME]``, made with the ``openssl`` command.

    Each certificate is good for both ends of a link (server and client
    auth), since inside the cluster every daemon is also a client. Files that
    exist are kept, so a restarted lab keeps its certificates.

    Raises:
        PkiError: no ``openssl`` command, or it failed.
    """
    if shutil.which("openssl") is None:
        raise PkiError("--tls needs the openssl command (apt-get install openssl)")
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    ca, ca_key = d / "ca.pem", d / "ca-key.pem"
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    if not (ca.exists() and ca_key.exists()):
        _openssl("req", "-x509", *curve, "-keyout", str(ca_key), "-out", str(ca), "-days", str(TLS_DAYS),
                 "-subj", "/CN=cachefs lab CA", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    for name, host in hosts.items():
        cert, key = d / f"{name}.pem", d / f"{name}-key.pem"
        if cert.exists() and key.exists():
            continue
        csr, ext = d / f"{name}.csr", d / f"{name}.ext"
        san = f"IP:{host}" if _is_ip(host) else f"DNS:{host}"
        ext.write_text("basicConstraints=critical,CA:FALSE\n"
                       "keyUsage=critical,digitalSignature,keyEncipherment\n"
                       "extendedKeyUsage=serverAuth,clientAuth\n"
                       f"subjectAltName={san}\n")
        _openssl("req", "-new", *curve, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
                 "-set_serial", str(secrets.randbits(63)), "-days", str(TLS_DAYS),
                 "-extfile", str(ext), "-out", str(cert))
        csr.unlink()
        ext.unlink()
    for key in d.glob("*-key.pem"):
        key.chmod(0o600)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise PkiError(f"openssl {args[0]} failed: {result.stderr.strip()}")
