"""The rows of bench/real_matrix.py, by what they run (common: what every row shares)."""
