"""The root conftest fails a test on a WARNING record of ours it did not declare."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def test_undeclared_warnings_of_ours_fail_the_test(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(ROOT_CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    allow_log: the test expects these records\n    needs_fuse: FUSE\n")
    pytester.makepyfile('''
        import logging
        import pytest

        log = logging.getLogger("cachefs.rpc")

        def test_undeclared():
            log.warning("peer went away")

        def test_error_in_a_child_logger():
            logging.getLogger("cachefs.rpc.pool").error("lost a reply")

        @pytest.mark.allow_log("cachefs.rpc", match="went away")
        def test_declared():
            log.warning("peer went away")

        @pytest.mark.allow_log("cachefs.rpc", match="something else")
        def test_declared_another_message():
            log.warning("peer went away")

        @pytest.mark.allow_log("cachefs.rpcx")
        def test_declared_another_logger():
            log.warning("peer went away")

        def test_not_our_logger():
            logging.getLogger("trio").warning("not ours")

        def test_info_is_fine():
            log.info("fine")
    ''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=7, errors=4)
    result.stdout.fnmatch_lines(["*1 unexpected WARNING+ log record*", "*WARNING cachefs.rpc: peer went away*"])
    errors = {line.split("::")[-1].split()[0] for line in result.stdout.lines if line.startswith("ERROR test_")}
    assert errors == {"test_undeclared", "test_error_in_a_child_logger", "test_declared_another_message",
                      "test_declared_another_logger"}
