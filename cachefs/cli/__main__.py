"""``python -m cachefs.cli``: the ``cachefs`` command (how the lab and the tests start daemons)."""

from cachefs.cli import main

main()
