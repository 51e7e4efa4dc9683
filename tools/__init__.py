"""Tools a reader runs beside the lessons: the benchmark (bench.py) and the multi-seed study (study.py)."""
