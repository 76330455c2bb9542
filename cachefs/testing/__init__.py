"""Test helpers shared by the test suite, the lab and the benchmarks: real parts made small.

Nothing here is a mock: free ports on this host, a dict block store with the
backing client's signatures, real metanode and datanode processes, a
filesystem that loses what a power cut would. The tests' conftests and
``bench/`` import from here, never from each other.
"""
