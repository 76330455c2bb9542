"""The local lab: a whole cluster on one machine (``cachefs lab``), optionally
on network namespaces, and the fault harness that tests and benches share."""
