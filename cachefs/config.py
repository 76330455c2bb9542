"""Configuration shared by every subcommand: option types, secrets, logging.

Precedence, highest first: command-line flags, environment variables
(``CACHEFS_<OPTION>`` for the common daemon options, and
``CACHEFS_<SUBCOMMAND>_<OPTION>`` for every option through click's
``auto_envvar_prefix``), then the TOML file given with ``cachefs --config
FILE`` (one ``[subcommand]`` table each), then built-in defaults. The TOML
file is validated against the subcommand's options before anything runs, and
errors name the file, the table, the key and the value.
"""

from __future__ import annotations

import os
import re
import tomllib
from typing import Any

import click

from cachefs.credentials import Credential, Secret, read_secret
from cachefs.errors import InvalidArgument
from cachefs.logs import FORMATS, setup_logging  # noqa: F401 - setup_logging: every command's, imported from here

# ---------------------------------------------------------------- types

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def parse_size(text: str | int) -> int:
    """``"4M"``, ``"64MiB"``, ``"1.5G"``, ``4096`` -> bytes (binary units)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidArgument(f"size must not be negative, got {text}")
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise InvalidArgument(f"not a size: {text!r} (use e.g. 4096, 64M, 10GiB)")
    number, unit, _ = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


def check_addr(text: str) -> str:
    from cachefs.rpc import parse_addr

    parse_addr(text)
    return text


class SizeType(click.ParamType):
    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_size(value)
        except InvalidArgument as exc:
            self.fail(exc.message, param, ctx)


class AddrType(click.ParamType):
    name = "host:port"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            return check_addr(str(value))
        except InvalidArgument as exc:
            self.fail(exc.message, param, ctx)


class AddrListType(click.ParamType):
    """Comma-separated ``host:port`` list (TOML may give a real list)."""

    name = "host:port,..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[str]:
        items = value if isinstance(value, list) else [v for v in str(value).split(",") if v.strip()]
        if not items:
            self.fail("needs at least one host:port", param, ctx)
        try:
            return [check_addr(str(v).strip()) for v in items]
        except InvalidArgument as exc:
            self.fail(exc.message, param, ctx)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class DurationType(click.ParamType):
    """Seconds, or a number with s, m, h or d (``90``, ``30m``, ``12h``, ``7d``)."""

    name = "DURATION"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int | float):
            return int(value)
        m = _DURATION.match(str(value))
        if not m:
            self.fail(f"{value!r} is not a duration (e.g. 90, 30m, 12h, 7d)", param, ctx)
        return int(float(m.group(1)) * _SECONDS[m.group(2).lower()])


SIZE = SizeType()
DURATION = DurationType()
ADDR = AddrType()
ADDRS = AddrListType()

# ---------------------------------------------------------------- secrets

def load_secret(secret_file: str | None, insecure: bool, *, cluster: bool = False) -> Secret | None:
    """The cluster secret or a credential (``cachefs credential issue``), or
    None when running insecure on purpose; daemons (``cluster``) need the
    cluster secret itself, since they verify everyone else's credentials.

    ``CACHEFS_SECRET`` (the secret itself) is read when no file is given.

    Raises:
        click.UsageError: no secret and no --insecure, an unreadable file or
            a broken credential, or a credential where the cluster secret is needed.
    """
    if secret_file:
        try:
            secret = read_secret(secret_file)
        except OSError as exc:
            raise click.UsageError(f"--secret-file {secret_file}: {exc.strerror}") from None
        except InvalidArgument as exc:
            raise click.UsageError(f"--secret-file {exc.message}") from None
        if cluster and isinstance(secret, Credential):
            raise click.UsageError(f"--secret-file {secret_file} holds a credential ({secret.key_id}); "
                                   "this command needs the cluster secret")
        return secret
    env = os.environ.get("CACHEFS_SECRET", "").strip()
    if env:
        return env.encode()
    if insecure:
        return None
    raise click.UsageError(
        "no cluster secret: give --secret-file FILE (or CACHEFS_SECRET), "
        "or --insecure to run without authentication")


# ---------------------------------------------------------------- options

LOG_LEVELS = click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False)
log_format_option = click.option(
    "--log-format", envvar="CACHEFS_LOG_FORMAT", type=click.Choice(FORMATS), default="text", show_default=True,
    help="Log lines as text, or as one JSON object each (for a log shipper).")


def metrics_options(kind: str, envvar: str | None = "CACHEFS_METRICS_ADDR") -> Any:
    """``--metrics-addr`` (on by default, at ``kind``'s default port) and ``--no-metrics``."""
    from click.core import ParameterSource

    from cachefs.metrics import DEFAULT_PORTS, parse_addr

    def convert(ctx: click.Context, param: click.Parameter, value: str) -> Any:
        explicit = ctx.get_parameter_source(param.name or "") is not ParameterSource.DEFAULT
        try:
            return parse_addr(value, explicit=explicit)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None

    options = [
        click.option("--metrics-addr", envvar=envvar, metavar="[HOST:]PORT", default=str(DEFAULT_PORTS[kind]),
                     show_default=True, callback=convert,
                     help="Serve Prometheus /metrics here (host: CACHEFS_METRICS_HOST or 127.0.0.1). "
                          "A default port already taken falls back to a free one, logged."),
        click.option("--no-metrics", is_flag=True, help="Do not serve /metrics."),
    ]
    return _apply(options)


def _apply(options: list[Any]) -> Any:
    def decorate(fn: Any) -> Any:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


class DaemonGroup(click.Group):
    """A daemon's command that also has subcommands (``cachefs datanode drain``):
    run without one, it needs the options in ``run_requires`` (parameter
    names), which click cannot mark required on a group. :meth:`check_run` is
    the one place that says so: the command calls it before it runs, and
    validators that only parse a command line (``cachefs.testing.cliparse``)
    call it too."""

    def __init__(self, *args: Any, run_requires: tuple[str, ...] = (), **kwargs: Any) -> None:
        kwargs.setdefault("invoke_without_command", True)
        super().__init__(*args, **kwargs)
        self.run_requires = run_requires

    def check_run(self, ctx: click.Context) -> None:
        """MissingParameter for the first option to run the daemon that ``ctx`` lacks."""
        for param in self.params:
            if param.name in self.run_requires and ctx.params.get(param.name) is None:
                raise click.MissingParameter(ctx=ctx, param=param, message=f"needed to run a {self.name}")


def daemon_options(kind: str) -> Any:
    """The options every daemon shares (secret, logging, metrics at ``kind``'s default port)."""
    options = [
        click.option("--secret-file", envvar="CACHEFS_SECRET_FILE", type=click.Path(dir_okay=False),
                     help="File holding the cluster secret (or set CACHEFS_SECRET)."),
        click.option("--insecure", is_flag=True, envvar="CACHEFS_INSECURE",
                     help="Run without authentication (lab use only)."),
        click.option("--log-level", envvar="CACHEFS_LOG_LEVEL", type=LOG_LEVELS, default="INFO",
                     show_default=True, help="Log level (SIGHUP reads it again from the --config file)."),
        log_format_option,
        click.option("--log-file", type=click.Path(dir_okay=False),
                     help="Log here instead of stderr (fds 1 and 2 too); reopened on SIGHUP and "
                          "when logrotate has moved it."),
    ]
    return lambda fn: _apply(options)(metrics_options(kind)(fn))


# ---------------------------------------------------------------- TOML file

def load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise click.UsageError(f"config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise click.UsageError(f"config file {path}: not valid TOML: {exc}") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise click.UsageError(f"config file {path}: {section!r} must be a [table] named after a subcommand")
    return data


def validate_section(path: str, section: str, table: dict[str, Any], command: click.Command,
                     ctx: click.Context) -> dict[str, Any]:
    """Map a TOML table onto ``command``'s options, converting every value.

    Returns the table keyed by parameter name, ready for ``default_map``.
    """
    params = {p.name: p for p in command.params if p.name}
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        param = params.get(name)
        if param is None:
            known = ", ".join(sorted(n.replace("_", "-") for n in params))
            raise click.UsageError(f"config file {path}: [{section}] has unknown key {key!r} (known: {known})")
        if isinstance(value, dict):
            raise click.UsageError(f"config file {path}: [{section}] {key} must be a value, not a table")
        try:
            param.type_cast_value(ctx, value)
        except click.BadParameter as exc:
            raise click.UsageError(f"config file {path}: [{section}] {key} = {value!r}: {exc.message}") from None
        out[name] = value
    return out


# ---------------------------------------------------------------- TLS

def tls_options(fn: Any) -> Any:
    """``--tls-cert/--tls-key/--tls-ca``: mutual TLS on every link (all three or none)."""
    options = [
        click.option("--tls-cert", envvar="CACHEFS_TLS_CERT", type=click.Path(dir_okay=False),
                     help="PEM certificate of this node (TLS; needs --tls-key and --tls-ca)."),
        click.option("--tls-key", envvar="CACHEFS_TLS_KEY", type=click.Path(dir_okay=False),
                     help="PEM private key of --tls-cert."),
        click.option("--tls-ca", envvar="CACHEFS_TLS_CA", type=click.Path(dir_okay=False),
                     help="PEM CA of the cluster: the only one trusted, for servers and clients."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def load_tls(cert: str | None, key: str | None, ca: str | None) -> tuple[Any, Any]:
    """``(server context, client context)``, both None when TLS is off.

    Inside the cluster TLS is mutual: servers ask clients for a certificate
    signed by ``ca``, and clients trust only ``ca``. So it takes all three
    files or none, and a partial or unreadable set stops the command before
    it listens or connects rather than silently falling back to plain TCP.

    Raises:
        click.UsageError: some but not all given, or a file that is
            unreadable or not valid PEM.
    """
    given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
    if not any(given.values()):
        return None, None
    missing = [name for name, value in given.items() if not value]
    if missing:
        raise click.UsageError(f"TLS needs --tls-cert, --tls-key and --tls-ca together; missing {', '.join(missing)}")
    for name, path in given.items():
        try:
            with open(path, "rb") as f:  # type: ignore[arg-type]
                f.read(1)
        except OSError as exc:
            raise click.UsageError(f"{name} {path}: {exc.strerror}") from None
    import ssl

    from cachefs.rpc import client_tls, server_tls

    try:
        server = server_tls(cert, key, client_ca_file=ca)  # type: ignore[arg-type]
        client = client_tls(ca, cert, key)  # type: ignore[arg-type]
    except ssl.SSLError as exc:
        raise click.UsageError(f"TLS files --tls-cert {cert} --tls-key {key} --tls-ca {ca}: {exc.reason or exc}") from None
    return server, client
