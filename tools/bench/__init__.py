"""`longserve bench ...`: benchmarks that report ratios side by side in one run (see docs/benchmarks.md)."""
