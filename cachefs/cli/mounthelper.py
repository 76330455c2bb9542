"""``mount.cachefs``: the helper mount(8) runs for ``mount -t cachefs`` and fstab lines.

    mount -t cachefs 10.0.0.1:7100,10.0.0.2:7100,10.0.0.3:7100:data /mnt/data \\
        -o secret-file=/etc/cachefs/secret,l1-size=8G,readahead=64M
    # /etc/fstab
    10.0.0.1:7100,10.0.0.2:7100,10.0.0.3:7100:data /mnt/data cachefs _netdev,secret-file=/etc/cachefs/secret 0 0

mount(8) finds the helper as ``/sbin/mount.cachefs`` (a symlink to this
console script) and calls it as ``mount.cachefs SPEC DIR [-sfnv] [-o OPTIONS]``
with an empty environment, so everything the mount needs goes in the options.
SPEC is ``META_ADDRS:VOLUME``. The helper runs ``cachefs mount --background``,
which returns once the mount answers, so mount(8) (and systemd's mount unit)
sees success only for a mount that works.

Options, in the order mount(8) gives them (a later one wins):

- every option of ``cachefs mount`` as ``name=value``, a flag as ``name`` or
  ``no-name``: the names come from the click command itself
  (:func:`option_table`), so this helper and ``cachefs mount`` never drift
  apart; ``allow_other`` is also accepted, spelled as FUSE spells it;
- ``ro``/``rw``: ``--read-only`` or not;
- the kernel flags FUSE takes (``noexec``, ``noatime``, ``nosuid``, ...;
  :data:`cachefs.client.mount.KERNEL_FLAGS`): passed on with
  ``--mount-flags``; ``relatime`` is FUSE's behaviour already;
- what mount(8) and systemd act on themselves (``_netdev``, ``nofail``,
  ``user``, ``users``, ``owner``, ``group``, ``auto``, ``noauto``,
  ``defaults``, ``x-*``, ``comment=``): accepted, nothing to do here.

Anything else is refused with its name, unless ``-s`` (sloppy) asks to
ignore it. ``-f`` (fake) checks everything and mounts nothing, ``-v`` prints
the ``cachefs mount`` command line, ``-n`` (no mtab) changes nothing since
the kernel keeps the mount table.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass

import click

# The subcommand this helper drives, and its options that belong to the helper.
MOUNT = "mount"
HELPER_OWNED = {"background"}  # always on: mount(8) waits for the helper to exit
ALIASES = {"allow_other": "allow-other"}  # as FUSE spells it
FOR_MOUNT8 = {"_netdev", "nofail", "user", "users", "nouser", "owner", "group", "auto", "noauto",
              "defaults"}
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class HelperError(click.ClickException):
    """A mount request the helper refuses, with what is wrong in words."""

    exit_code = 1  # mount(8)'s "incorrect invocation or permissions"


@dataclass(frozen=True)
class Option:
    """How one ``-o`` name becomes ``cachefs mount`` arguments."""

    flag: str  # the command-line option, e.g. --l1-size or --no-write-through
    takes_value: bool


def option_table(command: click.Command) -> dict[str, Option]:
    """``-o`` name -> option, for every long option of ``command``."""
    table: dict[str, Option] = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name in HELPER_OWNED:
            continue
        for opt in [*param.opts, *param.secondary_opts]:
            if opt.startswith("--"):
                table[opt[2:]] = Option(opt, takes_value=not param.is_flag)
    return table


def split_options(text: str) -> list[str]:
    """``a=1,b="x,y",c`` -> ``["a=1", "b=x,y", "c"]``: commas inside quotes stay (as libmount does)."""
    out, word, quoted = [], "", False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            out.append(word)
            word = ""
        else:
            word += ch
    if quoted:
        raise HelperError(f"unbalanced quote in mount options {text!r}")
    out.append(word)
    return [w for w in out if w]


def parse_spec(spec: str) -> tuple[str, str]:
    """``host:port,host:port:VOLUME`` -> (addresses, volume)."""
    addrs, sep, volume = spec.rpartition(":")
    if not sep or not addrs or not volume or ":" not in addrs:
        raise HelperError(f"{spec!r} is not META_ADDRS:VOLUME (e.g. 10.0.0.1:7100,10.0.0.2:7100:data)")
    return addrs, volume


def translate(options: list[str], table: dict[str, Option], kernel_flags: tuple[str, ...],
              *, sloppy: bool = False) -> list[str]:
    """``-o`` words -> ``cachefs mount`` arguments (see the module docstring)."""
    args: list[str] = []
    flags: list[str] = []
    read_only = False
    for word in options:
        name, has_value, value = word.partition("=")
        if name == "rw" and not has_value:
            read_only = False
            continue
        if name == "ro" and not has_value:
            read_only = True
            continue
        if name in kernel_flags and not has_value:
            flags.append(name)
            continue
        if name in FOR_MOUNT8 or name.startswith("x-") or name == "comment":
            continue  # user=NAME too: mount(8) adds it for a user mount
        if name == "relatime" and not has_value:
            continue  # what FUSE mounts do anyway
        option = table.get(ALIASES.get(name, name))
        if option is None:
            if sloppy:
                continue
            raise HelperError(f"unknown mount option {name!r} (see `cachefs mount --help`; "
                              f"-o takes its options without the leading --)")
        if option.takes_value and not has_value:
            raise HelperError(f"mount option {name!r} needs a value: {name}=...")
        if not option.takes_value and has_value:
            raise HelperError(f"mount option {name!r} is a flag: give it without '={value}'")
        args += [option.flag, value] if option.takes_value else [option.flag]
    if read_only:
        args.append("--read-only")
    if flags:
        args += ["--mount-flags", ",".join(flags)]
    return args


def parse_argv(argv: list[str]) -> tuple[str, str, list[str], set[str]]:
    """mount(8)'s helper calling convention -> (spec, dir, -o words, single-letter flags)."""
    positional: list[str] = []
    options: list[str] = []
    letters: set[str] = set()
    words = iter(argv)
    for arg in words:
        if arg in ("-o", "-t", "-N"):
            value = next(words, None)
            if value is None:
                raise HelperError(f"{arg} needs an argument")
            if arg == "-o":
                options += split_options(value)
            elif arg == "-N":
                raise HelperError("-N (mount in another namespace) is not supported: run mount there")
            elif value.split(".")[0] != "cachefs":
                raise HelperError(f"-t {value}: this helper mounts only cachefs")
        elif arg.startswith("-o") and len(arg) > 2:
            options += split_options(arg[2:])
        elif arg.startswith("-") and len(arg) > 1:
            for letter in arg[1:]:
                if letter not in "sfnv":
                    raise HelperError(f"unknown flag -{letter} (mount(8) passes -s, -f, -n, -v, -o)")
                letters.add(letter)
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise HelperError("usage: mount.cachefs META_ADDRS:VOLUME MOUNTPOINT [-sfnv] [-o OPTIONS]")
    return positional[0], positional[1], options, letters


def mount_argv(argv: list[str]) -> tuple[list[str], set[str]]:
    """The ``cachefs`` arguments that perform this helper invocation, and its flags."""
    from cachefs.cli import NeedsExtra, _load

    spec, mountpoint, options, letters = parse_argv(argv)
    addrs, volume = parse_spec(spec)
    command = _load(MOUNT)
    if command is None:
        raise HelperError("this build of cachefs has no mount command")
    if isinstance(command, NeedsExtra):
        raise HelperError(command.reason)
    from cachefs.client.mount import KERNEL_FLAGS

    extra = translate(options, option_table(command), KERNEL_FLAGS, sloppy="s" in letters)
    return [MOUNT, addrs, volume, mountpoint, "--background", *extra], letters


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``mount.cachefs``."""
    from cachefs.cli import _load
    from cachefs.cli import main as cachefs

    try:
        args, letters = mount_argv(sys.argv[1:] if argv is None else argv)
        if "v" in letters or "f" in letters:
            click.echo(shlex.join(["cachefs", *args]))
        if "f" in letters:  # fake: check the options as the real run parses them, mount nothing
            command = _load(MOUNT)
            assert command is not None
            command.make_context("cachefs mount", args[1:])
            return
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    os.environ.setdefault("PATH", DEFAULT_PATH)  # mount(8) gives helpers no environment
    cachefs.main(args, prog_name="cachefs")


if __name__ == "__main__":
    main()
