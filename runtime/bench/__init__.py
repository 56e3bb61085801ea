"""Benchmarks behind ``kvferry bench …``. Each prints JSON; none is a test."""
