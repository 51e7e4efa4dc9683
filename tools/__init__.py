"""Tools a reader runs beside the lessons: the benchmark, the studies, the diagnostics, curves."""
