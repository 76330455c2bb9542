"""Test helpers shared by the test suite, the lab and the benchmarks."""
