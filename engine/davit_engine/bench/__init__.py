"""Benchmarks: offline throughput (`davit bench throughput`) and online serving (`... serve`)."""
