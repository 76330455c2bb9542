"""``cachefs credential``: issue and inspect credentials (see cachefs.credentials)."""

from __future__ import annotations

import json
import os
import sys

import click

from cachefs.config import load_secret
from cachefs.credentials import ROLES, Credential, read_secret
from cachefs.errors import InvalidArgument


@click.group()
def credential() -> None:
    """Credentials for clients and admins, derived from the cluster secret."""


@credential.command("issue")
@click.option("--role", type=click.Choice(list(ROLES)), required=True,
              help="client: client operations on --volume only; admin: cluster administration; "
                   "server: a daemon (daemons usually derive their own from the cluster secret).")
@click.option("--name", default=None, help="Who holds it (shown in logs and errors; default: the role).")
@click.option("--volume", "volumes", multiple=True, help="A volume a client credential may use (repeatable).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True,
              help="File to write (mode 0600); give it as --secret-file to the client or admin command.")
@click.option("--secret-file", envvar="CACHEFS_SECRET_FILE", type=click.Path(dir_okay=False),
              help="File holding the cluster secret (or set CACHEFS_SECRET).")
def issue(role: str, name: str | None, volumes: tuple[str, ...], output: str, secret_file: str | None) -> None:
    """Issue a credential: its key id names role, name and volumes; its key is
    derived from the cluster secret, so no server keeps a list of them."""
    secret = load_secret(secret_file, insecure=False, cluster=True)
    assert isinstance(secret, bytes)
    try:
        cred = Credential.issue(secret, role, name or role, list(volumes))
    except InvalidArgument as exc:
        raise click.UsageError(exc.message) from None
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(cred.to_json())
    click.echo(f"{cred.key_id} -> {output}", err=True)


@credential.command("show")
@click.argument("path", type=click.Path(dir_okay=False))
def show(path: str) -> None:
    """Print a credential's identity as JSON (never its key)."""
    try:
        cred = read_secret(path)
    except OSError as exc:
        raise click.UsageError(f"{path}: {exc.strerror}") from None
    except InvalidArgument as exc:
        raise click.UsageError(exc.message) from None
    if not isinstance(cred, Credential):
        click.echo(json.dumps({"role": "server", "cluster_secret": True}))
        sys.exit(0)
    ident = cred.identity
    click.echo(json.dumps({"key_id": cred.key_id, "role": ident.role, "name": ident.name,
                           "volumes": sorted(ident.volumes) if ident.volumes is not None else None}))
